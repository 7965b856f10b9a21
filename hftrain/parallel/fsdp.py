"""FSDP2: parameters, gradients and optimizer state sharded over the processes, one shard group per transformer layer.

accelerate wraps the model with `fully_shard` from the preset's FSDP settings; it finds the layer classes to wrap
in the prepared module's `_no_split_modules`, which the loss wrapper forwards from the causal LM. Checkpoints are
sharded `torch.distributed.checkpoint` folders (one file per rank; `checkpoint_io.FSDP2Checkpoints`).
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager

from accelerate.utils.fsdp_utils import fsdp2_prepare_model
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, register_fsdp_forward_method

from hftrain.parallel.base import ALL_PARTS, Backend, Parallelism
from hftrain.parallel.checkpoint_io import FSDP2Checkpoints


class FSDP2Backend(Backend):
    checkpoint_io = FSDP2Checkpoints

    def __post_init__(self) -> None:
        super().__post_init__()
        plugin = self.accelerator.state.fsdp_plugin
        policy = plugin.mixed_precision_policy
        if isinstance(policy, MixedPrecisionPolicy) and policy.output_dtype is not None:
            # accelerate casts every FSDP unit's forward outputs to the compute dtype (bf16). The root unit is
            # hftrain's loss module: its fp32 loss sum would be rounded to 8 significant bits, in the logged loss and
            # in the backward's scale (measured: a logged step loss of exactly 6.625). The decoder layers compute in
            # the parameters' bf16 and return bf16 without the cast, so not casting changes only the loss.
            plugin.mixed_precision_policy = dataclasses.replace(policy, output_dtype=None)

    def make_record(self, **layout) -> Parallelism:
        plugin = self.accelerator.state.fsdp_plugin
        full_shard = plugin.reshard_after_forward is True  # SHARD_GRAD_OP keeps the weights gathered
        sharded = ALL_PARTS if full_shard else ("gradients", "optimizer")
        offloaded = ALL_PARTS if isinstance(plugin.cpu_offload, CPUOffloadPolicy) else ()  # OffloadPolicy(): none
        name = "FSDP2 " + ("FULL_SHARD" if full_shard else "SHARD_GRAD_OP") + (" + offload" if offloaded else "")
        return super().make_record(kind="fsdp2", name=name, sharded=sharded, offloaded=offloaded)

    def prepare_frozen(self, module):
        """Sharded like the trained model, by accelerate's own FSDP2 preparation (one shard group per layer, the
        module as root), without registering it with the accelerator (its checkpoints hold the trained model only)."""
        return fsdp2_prepare_model(self.accelerator, module).eval(), "sharded over the processes (FSDP2)"

    @contextmanager
    def generation_context(self, model):
        """generate through the sharded model, as TRL 1.16 does under FSDP2 (its `summon_full_params` is a no-op
        for FSDP2): the loss wrapper is the root FSDP unit, and its `generate` is registered as a forward method
        (torch's `register_fsdp_forward_method`), so the root's pre-forward runs first (lazy init as the root, its
        own weights -- embeddings, final norm, head -- all-gathered) and each decoder layer all-gathers its weights
        in its own pre-forward hook and frees them after, at every decoding step. Memory stays that of a training
        forward (one layer's full weights at a time, no whole-model copy); the price is one all-gather per layer
        and generated token. Those all-gathers are collectives, so `synced_gpus`: a rank whose completions have
        ended keeps running forwards until every rank's have."""
        if "generate" not in vars(model):  # registered once per prepared model (an instance attribute)
            register_fsdp_forward_method(model, "generate")
        yield model, True

    def clip_grad_norm(self, model, max_norm: float) -> float | None:
        norm = self.accelerator.clip_grad_norm_(model.parameters(), max_norm)
        return None if norm is None else float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
