"""Expert parallelism (`ep_size`): every mixture-of-experts layer's experts split over `ep_size` processes.

transformers 5.23 loads the model with `DistributedConfig(ep_size=E, fsdp_size=processes, ep_implementation=
"all_to_all")` and the model's expert plan (`base_model_ep_plan`): each process reads only its `num_experts / E`
experts of every layer (a DTensor sharded on the expert dimension over transformers' ("efsdp", "ep") mesh, ep
innermost: ranks 0..E-1 hold one copy of all experts), and each experts module sends every (token, expert) pair to the
expert's process with an all-to-all and brings the weighted outputs back with a second one (`AllToAllEP`, whose
exchanges have a backward). transformers shards the other weights (attention, router, norms, embeddings, head) with
FSDP2 over all the processes (its EP layout: experts on (efsdp, ep), the rest on fsdp), and the experts over their
`efsdp` copies.

The numbers the loop owns stay exact (tests/e2e/test_expert_parallel.py, against one process on the same batch):
- the loss of a rank's tokens is that rank's, wherever its experts ran, so the loop's token sums do not change;
- an expert's gradient gathers every rank's tokens through the all-to-all's backward (each scaled by its sender's
  dp_world / step tokens): transformers divides it by the data-parallel size (`set_gradient_divide_factor`), as FSDP2's
  reduce-scatter divides the dense gradients, the mean the loop's loss scale counts on;
- the gradient norm counts each expert once (accelerate's DTensor-aware clipping: one norm per mesh, combined);
- checkpoints are full state (`FullTrainingState`), the final folder every expert once (`save_pretrained` gathers).

One transform, `ExpertParallel`: its `DistributedConfig` fields (`distributed_fields`) and its part of the record.
The layout is transformers' FSDP2 one, held by `FSDP2Backend` whatever the preset (`strategy_for`: under a DDP-type
preset too), which shards the dense weights at load and holds the laid-out model (fsdp.py); frozen copies and
generation follow the shards (`base.LaidOutAtLoad`).

Beside tensor parallelism (`tp_size` T, ep a multiple of it: transformers' rule) the dense weights are split by tp and
the T ranks of a tensor-parallel group, which share a batch, each dispatch their own slice of its tokens
(`AllToAllEP`), so no token reaches an expert twice. With ep = T the expert group is the tensor-parallel group and
the layout is tensor parallelism's, held as its whole copies under a DDP-type preset (`Backend`, copies averaged by
`ReplicaGradients`, experts included); with ep > T an expert group spans batches, which transformers lays out over
its FSDP2 ranks only (efsdp = fsdp x tp / ep), so FSDP2 holds it (FSDP2 x TP, `fsdp_size` = processes / T).

The experts run as transformers' experts implementation (`grouped_mm` by default: one grouped matmul per
projection over the rows sorted by expert, `torch._grouped_mm` on CPU too) on the rows the all-to-all brought, without
the masks for routes to other ranks' experts, which the all-to-all never brings (`unmask_dispatched_experts`).

The rules that need the launch or the model's config are `expert_problems` (the preflight); those of the recipe alone
are hftrain/fields/parallel.py's.
"""

from __future__ import annotations

import dataclasses

from hftrain.compat.transformers import unmask_dispatched_experts
from hftrain.config import Recipe
from hftrain.metrics import num_experts
from hftrain.parallel.base import LaidOutAtLoad, Parallelism
from hftrain.parallel.dims import ParallelDims
from hftrain.parallel.launch import Launch
from hftrain.versions import feature_problem

DISPATCH = "ep_dispatch_experts"  # the plan style whose module exchanges tokens (transformers' token dispatch)


def expert_plan(model_config) -> dict[str, str]:
    """The model's expert-parallel plan (`base_model_ep_plan` of its transformers config), {} without one."""
    return dict(getattr(model_config.get_text_config(), "base_model_ep_plan", None) or {})


def expert_problems(recipe: Recipe, launch: Launch, model_config) -> list[str]:
    """ep_size: the transformers version, the launch and the model's expert plan and experts, before weights load."""
    ep = recipe.ep_size
    if ep <= 1:
        return []
    if (too_old := feature_problem("expert_parallel")) is not None:
        return [f"ep_size={ep}: {too_old}"]
    problems = []
    if launch.kind == "deepspeed":
        problems.append(f"ep_size={ep} with a DeepSpeed preset: transformers' expert parallelism shards the other "
                        "weights with its own FSDP2, not with ZeRO; use a DDP-type preset (cpu_ddp, multi_gpu) or an "
                        "FSDP2 one")
    elif launch.kind == "single":
        problems.append(f"ep_size={ep} needs ep_size (or a multiple of it) processes, and this launch is 1 process; "
                        f"use a DDP-type preset (cpu_ddp on CPU, multi_gpu) with --num_processes {ep}")
    else:
        problems += ParallelDims.build(recipe, launch).problems()
    if recipe.fp16:
        problems.append(f"fp16 with ep_size={ep}: transformers' FSDP2 mixed precision, which shards the weights of an "
                        "expert-parallel model, is bf16 only; use bf16")
    if recipe.load_in_4bit or recipe.load_in_8bit:
        problems.append(f"ep_size={ep} with a quantized (QLoRA) base: transformers shards the expert weights as "
                        "DTensors while they load, which bitsandbytes' packed weights are not; train the experts "
                        "unquantized")
    if model_config is None:
        return problems
    kind, plan, experts = model_config.model_type, expert_plan(model_config), num_experts(model_config)
    if DISPATCH not in plan.values():
        problems.append(f"ep_size={ep}: the model ({kind!r}) has no expert-parallel plan with token dispatch "
                        f"(base_model_ep_plan with an {DISPATCH!r} rule in its transformers config: Mixtral, "
                        "Qwen3-MoE and newer mixture-of-experts families have one), so transformers cannot split its "
                        "experts; use data parallelism (ep_size: 1)")
    elif experts is None or experts % ep:
        problems.append(f"ep_size={ep} does not divide the model's {experts} experts per layer: each of the ep_size "
                        "processes of a group holds an equal share of them; use an ep_size that divides "
                        f"{experts}")
    return problems


def load_kwargs(ep: int) -> dict:
    """The `DistributedConfig` fields that split the experts over `ep` ranks: transformers' all-to-all token dispatch
    (trained: its exchanges have a backward). None for ep 1."""
    return {"ep_size": ep, "ep_implementation": "all_to_all"} if ep > 1 else {}


class ExpertParallel(LaidOutAtLoad):
    """ep_size: every MoE layer's experts split over ep_size processes by transformers at load, tokens dispatched by
    all-to-all; the dense weights sharded by transformers' FSDP2 over every process, under a DDP-type preset as under
    an FSDP2 one."""

    axis = "ep"
    strategies = frozenset({"ddp", "fsdp2"})
    beside = frozenset({"tp"})

    @classmethod
    def strategy_for(cls, dims, strategy: str) -> str:
        """ep above tp: an expert group spans ranks with different batches, whose experts transformers lays out
        over FSDP2's ranks only (efsdp = fsdp x tp / ep), so FSDP2 holds the model under a DDP-type launch too. ep
        equal to tp: the expert group is a tensor-parallel group (one batch), held like tensor parallelism's whole
        copies."""
        return "fsdp2" if strategy == "ddp" and dims.ep > dims.tp else strategy

    @property
    def ep(self) -> int:
        return self.backend.recipe.ep_size

    def distributed_fields(self) -> dict:
        return load_kwargs(self.ep)

    def apply(self, model) -> None:
        """The experts without the off-rank route masks the all-to-all dispatch never needs
        (`unmask_dispatched_experts`)."""
        unmask_dispatched_experts(model)

    def prepare_frozen(self, module):
        unmask_dispatched_experts(module)
        return super().prepare_frozen(module)

    def describe(self, record: Parallelism) -> Parallelism:
        name = f"expert parallel (ep_size={self.ep}: 1/{self.ep} of every MoE layer's experts per process), dense " \
               f"weights {record.name}"
        return dataclasses.replace(record, kind=f"{record.kind}_ep", name=name, ep_size=self.ep)

    def frozen_how(self) -> str:
        return f"laid out as the trained model (experts over ep_size={self.ep}, the other weights sharded by FSDP2)"
