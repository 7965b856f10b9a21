"""FSDP2: parameters, gradients and optimizer state sharded over the processes, one shard group per transformer layer.

accelerate wraps the model with `fully_shard` from the preset's FSDP settings; it finds the layer classes to wrap
in the prepared module's `_no_split_modules`, which the loss wrapper forwards from the causal LM. Checkpoints are
sharded `torch.distributed.checkpoint` folders (one file per rank; `checkpoint_io.FSDP2Checkpoints`).

A model transformers laid out at load (tensor parallelism, expert parallelism: `Backend.laid_out`) is sharded by
transformers' own FSDP2 while it loads (`distributed_config`: `DistributedConfig(..., fsdp_size=processes / tp)`,
`fully_shard` on the fsdp dimension of its mesh, per the model's `_fsdp_plan`), so every weight is a DTensor on the
("fsdp", "tp") mesh (the experts on transformers' (efsdp, ep) one) and FSDP2's reduce-scatter averages the gradients
over the data-parallel ranks, as DDP's mean does (the loop's loss scale counts on that mean); `wrap_laid_out` adds
the loss wrapper as the root unit. accelerate's FSDP2 x TP path (`Accelerator._prepare_tp`) imports transformers'
removed ReplicateParallel, so it is not used. Expert parallelism runs here under a DDP-type preset too (no
`fsdp_plugin`: FULL_SHARD without offload), transformers' only EP layout being FSDP2's. Its checkpoints are one
full-state file, loaded back by each rank's own blocks (`checkpoint_io.FullStateSlices`).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.distributed as dist
from accelerate.utils.fsdp_utils import fsdp2_prepare_model
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from transformers.distributed import DistributedConfig

from hftrain import fp8
from hftrain.compat.transformers import device_mesh
from hftrain.errors import HftrainError
from hftrain.parallel.base import ALL_PARTS, Backend, Parallelism
from hftrain.parallel.checkpoint_io import FSDP2Checkpoints, FullStateCheckpoints
from hftrain.parallel.generation import FSDP2Generation


class FSDP2Backend(Backend):
    checkpoint_io = FSDP2Checkpoints
    laid_out_checkpoint_io = functools.partial(FullStateCheckpoints, slices=True)
    generation_io = FSDP2Generation

    def __post_init__(self) -> None:
        self.replicated = []  # trained parameters outside every FSDP2 unit (`wrap_laid_out`)
        super().__post_init__()
        policy = getattr(self.plugin, "mixed_precision_policy", None)
        if isinstance(policy, MixedPrecisionPolicy) and policy.output_dtype is not None:
            # accelerate casts every FSDP unit's forward outputs to the compute dtype (bf16). The root unit is
            # hftrain's loss module: its fp32 loss sum would be rounded to 8 significant bits, in the logged loss and
            # in the backward's scale (measured: a logged step loss of exactly 6.625). The decoder layers compute in
            # the parameters' bf16 and return bf16 without the cast, so not casting changes only the loss.
            self.plugin.mixed_precision_policy = dataclasses.replace(policy, output_dtype=None)

    @property
    def plugin(self):
        """accelerate's FSDP plugin (the preset's FSDP settings); None under a DDP-type preset (expert parallelism)."""
        return getattr(self.accelerator.state, "fsdp_plugin", None)

    @property
    def full_shard(self) -> bool:
        return self.plugin is None or self.plugin.reshard_after_forward is True  # SHARD_GRAD_OP keeps them gathered

    @property
    def offloaded(self) -> bool:
        return self.plugin is not None and isinstance(self.plugin.cpu_offload, CPUOffloadPolicy)  # not OffloadPolicy()

    def make_record(self, **layout) -> Parallelism:
        name = "FSDP2 " + ("FULL_SHARD" if self.full_shard else "SHARD_GRAD_OP")
        if self.laid_out:
            name += f" (fsdp_size={self.accelerator.num_processes // self.recipe.tp_size})"
        offloaded = ALL_PARTS if self.offloaded else ()
        sharded = ALL_PARTS if self.full_shard else ("gradients", "optimizer")
        return super().make_record(kind="fsdp2", name=name + (" + offload" if offloaded else ""), sharded=sharded,
                                   offloaded=offloaded)

    def shard_count(self) -> int:
        return self.accelerator.num_processes  # with tp, the TP-split weights further sharded over the fsdp ranks

    def wrap(self, model, optimizer):
        """accelerate's FSDP2 preparation; with fp8's float8 all-gather (`fp8.float8_all_gather`), torchao's scales
        of the gathered float8 weights are recomputed after each optimizer step."""
        model, optimizer = super().wrap(model, optimizer)
        if fp8.float8_all_gather(self.recipe, self.record.kind):  # as the model was converted (finetune.build_model)
            fp8.precompute_scales_after_step(getattr(optimizer, "optimizer", optimizer), model)
        return model, optimizer

    def distributed_config(self, fields: dict) -> DistributedConfig:
        """transformers' FSDP2 over the fsdp = processes / tp ranks that hold the same tp shard."""
        tp = self.recipe.tp_size  # given as 1 without tp: transformers would derive it from the processes
        return DistributedConfig(
            **{"tp_size": tp, **fields}, fsdp_size=self.accelerator.num_processes // tp,
            fsdp_cpu_offload=self.offloaded,
            # transformers' FSDP2 mixed precision: bf16 compute, fp32 gradient reduction, outputs not cast (the fp32
            # loss sum keeps its precision, as for accelerate's policy above); fp16 is refused by the preflight
            fsdp_mixed_precision=self.accelerator.mixed_precision == "bf16")

    def place_frozen(self, module):
        """Sharded like the trained model, by accelerate's own FSDP2 preparation (one shard group per layer, the
        module as root), without registering it with the accelerator (its checkpoints hold the trained model only)."""
        return fsdp2_prepare_model(self.accelerator, module).eval(), "sharded over the processes (FSDP2)"

    def wrap_laid_out(self, model, optimizer):
        """The loss wrapper becomes the root FSDP2 unit over transformers' units (embeddings, each decoder layer, the
        final norm with the head, the causal LM), on the same fsdp mesh and policy. torch takes the first unit whose
        forward runs as the root (`FSDPState._lazy_init`), and the wrapper calls the causal LM's decoder and head
        directly (`CausalLMTokenLoss`), not the causal LM's forward: without a root of its own the embeddings' unit
        would be taken, and the norm-with-head unit (two modules) would then refuse to be a second root. As root,
        accelerate's `no_sync` (gradient accumulation) reaches every unit through `set_requires_gradient_sync`."""
        accelerator, tp, world = self.accelerator, self.recipe.tp_size, self.accelerator.num_processes
        layout = torch.arange(world).reshape(world // tp, tp)  # the data split's assumption: tp consecutive ranks
        meshes = {p.device_mesh for p in model.parameters() if hasattr(p, "device_mesh")}
        dense = ("fsdp", "tp") if tp > 1 else ("fsdp",)  # the experts' (efsdp, ep) mesh is transformers' own
        if not any(m.mesh_dim_names == dense for m in meshes) or \
                any(m.mesh_dim_names == ("fsdp", "tp") and not torch.equal(m.mesh.cpu(), layout) for m in meshes):
            raise HftrainError(f"transformers laid the weights out on {sorted(m.mesh.tolist() for m in meshes)} "
                               f"{[m.mesh_dim_names for m in meshes]}, not on the (fsdp, tp) mesh {layout.tolist()} "
                               "hftrain assumes for the data split")
        if accelerator.mixed_precision != "no":
            model.forward = accelerator.autocast()(model.forward)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if accelerator.mixed_precision == "bf16" else MixedPrecisionPolicy()
        offload = {"offload_policy": CPUOffloadPolicy()} if self.record.offloaded else {}
        fully_shard(model, mesh=device_mesh(model.lm, "fsdp"), mp_policy=policy, **offload)
        if not self.full_shard:
            model.set_reshard_after_forward(False)  # SHARD_GRAD_OP: every unit keeps its weights after forward
        if not isinstance(model, FSDPModule):
            raise HftrainError("FSDP2 x tensor parallel: the loss wrapper did not become an FSDP2 module")
        # peft's adapters, added after transformers made its FSDP2 units, are in none of them: whole on every rank,
        # started from rank 0's values and averaged over the data-parallel ranks as DDP would
        self.replicated = [p for p in model.parameters() if p.requires_grad and not isinstance(p, DTensor)]
        group = self.dp.groups[0] if self.dp.groups else None  # None: every process (no tensor-parallel groups)
        for p in self.replicated:
            dist.broadcast(p.data, src=0 if group is None else dist.get_global_rank(group, 0), group=group)
        self.checkpoints.attach(model, optimizer)
        return model, optimizer

    def release(self, model) -> None:
        """FSDP2 keeps the root unit's weights gathered after its forward, for the backward that follows; after
        forwards with none, every unit is resharded, so that the parameters are this rank's shards again (what the
        checkpoint preflight changes in place, and the optimizer steps)."""
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def clip_grad_norm(self, model, max_norm: float) -> float | None:
        """accelerate's DTensor-aware clipping: each mesh's gradients' norm over all its shards (with tp: the
        TP-split weights' on the 2D mesh and the norms' on the fsdp mesh), combined into one global norm. First the
        parameters outside every FSDP2 unit (`replicated`) averaged over the data-parallel ranks, in one order on every
        rank (a backward hook's order may differ between ranks)."""
        for p in self.replicated:
            if p.grad is not None:
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=self.dp.groups[0] if self.dp.groups else None)
                p.grad.div_(self.dp.world)
        norm = self.accelerator.clip_grad_norm_(model.parameters(), max_norm)
        return None if norm is None else float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
