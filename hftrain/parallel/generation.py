"""How a layout samples with transformers' `generate` (grpo's rollouts, log_completions' samples): one component per
way of holding the model, chosen with the layout as its checkpoint I/O is (the strategy's `generation_io`, unless
an axis transformers laid out at load names its own: `LaidOutShards`), and called through
`Backend.generation_context`.

Each component's `context(model)` is entered on every rank at once and yields (module, synced): the loss wrapper
whose `generate` (`WrapsCausalLM.generate`, the causal LM's) may be called inside the context, and generate's
`synced_gpus`: True where that call's forwards hold collectives, so that a rank whose completions have all ended
keeps calling forward until every rank's have (transformers 5.23 decides it only for ZeRO-3 and for modules sharded
by its own FSDP2 code, so hftrain passes it).
"""

from __future__ import annotations

from contextlib import contextmanager

from torch.distributed.fsdp import register_fsdp_forward_method


class WholeModel:
    """One process, DDP, DeepSpeed ZeRO-1/2: every rank holds the whole model; a wrapper (DDP's, the engine) is
    needed only for the backward, so the module is unwrapped and generates without collectives."""

    def __init__(self, backend):
        self.backend = backend

    @contextmanager
    def context(self, model):
        yield self.backend.unwrap(model), False


class FSDP2Generation(WholeModel):
    """generate through the sharded model, as TRL 1.16 does under FSDP2 (its `summon_full_params` is a no-op for
    FSDP2): the loss wrapper is the root FSDP unit, and its `generate` is registered as a forward method (torch's
    `register_fsdp_forward_method`), so the root's pre-forward runs first (lazy init as the root, its own weights --
    embeddings, final norm, head -- all-gathered) and each decoder layer all-gathers its weights in its own
    pre-forward hook and frees them after, at every decoding step. Memory stays that of a training forward (one
    layer's full weights at a time, no whole-model copy); the price is one all-gather per layer and generated token.
    Those all-gathers are collectives, so `synced_gpus`: a rank whose completions have ended keeps running forwards
    until every rank's have."""

    @contextmanager
    def context(self, model):
        if "generate" not in vars(model):  # registered once per prepared model (an instance attribute)
            register_fsdp_forward_method(model, "generate")
        yield model, True


class ZeRO3Generation(WholeModel):
    """DeepSpeed: ZeRO-1/2 hold the whole weights on every rank (`WholeModel`). ZeRO-3, as TRL 1.16's
    `unwrap_model_for_generation` (trl/models/utils.py) by `ds3_gather_for_generation`:

    - true (TRL's default): the whole model gathered on every rank for the call, the engine's partitioning hooks
      removed meanwhile and registered again after -- DeepSpeed 0.19.8's own
      `deepspeed.runtime.zero.unwrap_model_for_generation`, which is TRL's code. generate's many small forwards run on
      local weights, without collectives (synced_gpus False), at the cost of one full copy of the weights per rank
      while sampling.
    - false: the engine's module as it is, partitioning hooks in place: each submodule's pre-forward hook gathers its
      weights (all-gather) and its post-forward hook releases them, at every decoding step, so memory stays that of
      a training forward. Those gathers are collectives: synced_gpus, so that a rank whose completions have ended
      keeps running forwards until every rank's have (without it the run aborts: seen)."""

    @contextmanager
    def context(self, model):
        if self.backend.record.zero_stage != 3:
            with super().context(model) as generating:
                yield generating
            return
        if not self.backend.recipe.ds3_gather_for_generation:
            yield self.backend.unwrap(model), True
            return
        from deepspeed.runtime.zero import unwrap_model_for_generation

        with unwrap_model_for_generation(model):
            yield self.backend.unwrap(model), False


class LaidOutShards(WholeModel):
    """A model transformers laid out over the processes while it loaded (tensor parallelism, expert parallelism):
    generate through the shards, as transformers supports for the models it sharded. Every rank of a tp group calls
    `generate` at once on the same prompts (they share a data-parallel rank, so the same rows and row seeds), each
    sharded layer's all-reduce / all-gather hands every rank the same activations and the whole, identical logits,
    so the ranks sample the same tokens in lockstep; an expert layer's all-to-all exchanges every rank's tokens.
    Memory as a training forward: each rank its shards and 1/tp of the KV cache. `synced_gpus` True: one flag
    all-reduce per token over every process, so that groups (data-parallel copies) that finish at different steps,
    or a rank that ever sampled differently from its group (`DataParallel.check_replicas_agree` then says so), keep
    their collectives matched instead of hanging."""

    @contextmanager
    def context(self, model):
        yield model, True
