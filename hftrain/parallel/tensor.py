"""Tensor parallelism: every linear layer split over `tp_size` processes by transformers at load time.

`--tp_size N` loads the model with transformers' `DistributedConfig(tp_size=N)`, its predefined tensor-parallel plan
(`tp_plan="auto"`): each process reads only its shards. With more processes than tp_size (a multiple of it), each
group of tp_size consecutive ranks holds one sharded copy and trains on its own share of the data; hftrain averages
the gradients of the ranks that hold the same shard (`ReplicaGradients`; DDP cannot hold DTensor weights). The model
is not wrapped by accelerate, and its checkpoint is full state (`checkpoint_io.FullStateCheckpoints`), gathered and
re-sharded, so it does not depend on the layout.

Process layout (transformers' device mesh, TP innermost): rank = dp_rank * tp + tp_rank. With 4 processes and
tp_size=2: TP groups {0,1} {2,3} hold the two halves of every linear layer; data-parallel groups {0,2} {1,3} hold
the same half, train on different batches and average their gradients.

Under an FSDP2 preset (`FSDP2TensorParallelBackend`) the data-parallel ranks shard instead of copying: transformers
loads with `DistributedConfig(tp_size=T, fsdp_size=processes/T)` and applies FSDP2 itself (`fully_shard` on the
fsdp dimension of its ("fsdp", "tp") mesh, per the model's `_fsdp_plan`), so every weight is a DTensor on that 2D
mesh and FSDP2's reduce-scatter does what `ReplicaGradients` does for copies.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from transformers.distributed import DistributedConfig

from hftrain.compat.transformers import device_mesh
from hftrain.errors import HftrainError
from hftrain.parallel.base import ALL_PARTS, Backend, Parallelism, with_copies
from hftrain.parallel.checkpoint_io import FullStateCheckpoints
from hftrain.parallel.expert import load_kwargs as expert_load_kwargs


def _shard(size: int, parts: int, index: int) -> int:
    """The length of block `index` when `size` is cut into `parts` as torch cuts (torch.chunk, DTensor's Shard):
    blocks of ceil(size / parts), the last ones short or empty."""
    block = -(-size // parts)
    start = min(size, index * block)
    return min(size, start + block) - start


def fsdp_tp_blocks_disagree(size: int, fsdp: int, tp: int) -> bool:
    """Whether transformers' FSDP2 x TP loader and FSDP2 cut a dimension of `size` split by both (dim 0 of the
    embedding, the head and the column-wise projections) into blocks of different lengths on some rank. FSDP2 cuts
    each tp rank's block into fsdp pieces (`fully_shard`: torch.chunk); transformers' loader (`DtensorShardOperation`
    for [_StridedShard(0, sf=tp), Shard(0)]) takes piece f of every tp block and re-cuts their concatenation into tp
    equal parts. The two agree when, for every f, piece f has the length of its re-cut part (always when tp x fsdp
    divides the size). Otherwise transformers refuses its own load ("Reinit due to size mismatch"): the tiny
    model's 753-token vocabulary over fsdp 4 x tp 2 gives one rank 93 rows for FSDP2's 92."""
    blocks = [_shard(size, tp, t) for t in range(tp)]
    for f in range(fsdp):
        pieces = [_shard(block, fsdp, f) for block in blocks]
        if any(_shard(sum(pieces), tp, t) != piece for t, piece in enumerate(pieces)):
            return True
    return False


class _ReplicatedTensorParallel(DistributedConfig):
    """transformers' mesh with `dp_replicate_size` copies of the TP group, without its FSDP2 on the copies
    (transformers applies it only when dp_size > 1): hftrain averages their gradients itself."""

    @property
    def dp_size(self) -> int:
        return 1


def model_load_kwargs(tp: int, world: int) -> dict:
    """from_pretrained arguments that shard the weights over `tp` processes while they load."""
    copies = world // tp
    if copies <= 1:
        return {"distributed_config": DistributedConfig(tp_size=tp)}  # the model's own tp_plan ("auto")
    return {"distributed_config": _ReplicatedTensorParallel(tp_size=tp, dp_replicate_size=copies)}


class ReplicaGradients:
    """Average each gradient over the data-parallel copies of a tensor-parallel model, as DDP would. A hook per
    parameter runs once its gradient is accumulated in the backward of the micro-batch that ends an optimizer step
    (`accelerator.sync_gradients`), before clipping and the step. Every rank runs the same backward graph, so the
    collectives of the data-parallel and TP groups come in one order. Sum then divide (gloo has no average): the
    same arithmetic as DDP's mean over the copies."""

    def __init__(self, accelerator, model, group, copies: int):
        self.accelerator, self.group, self.copies = accelerator, group, copies
        self.handles = [p.register_post_accumulate_grad_hook(self.average)
                        for p in model.parameters() if p.requires_grad]

    def average(self, param) -> None:
        if not self.accelerator.sync_gradients:
            return
        with torch.no_grad():
            grad = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad  # DTensor: this shard
            dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=self.group)
            grad.div_(self.copies)


class TensorParallelBackend(Backend):
    checkpoint_io = FullStateCheckpoints
    @property
    def tp(self) -> int:
        return self.recipe.tp_size

    def make_record(self, **layout) -> Parallelism:
        name = with_copies(f"tensor parallel (tp_size={self.tp})", self.accelerator.num_processes, self.tp)
        return super().make_record(kind="tp", name=name, sharded=ALL_PARTS)  # norms replicated: counted split

    def shard_count(self) -> int:
        return self.tp

    def model_load_kwargs(self) -> dict:
        return model_load_kwargs(self.tp, self.accelerator.num_processes)

    def frozen_copy(self, model, rebuild):
        """dpo's reference: transformers' tensor-parallel weights (DTensors over the TP group's storage) cannot be
        deep-copied, so the model is loaded again, sharded the same way, and each process copies its own shards into
        it (exactly the starting weights, resized embeddings included)."""
        copy_ = rebuild()
        with torch.no_grad():
            for (name, mine), (_, theirs) in zip(copy_.named_parameters(), model.named_parameters(), strict=True):
                local = theirs.data.to_local() if hasattr(theirs.data, "to_local") else theirs.data
                target = mine.data.to_local() if hasattr(mine.data, "to_local") else mine.data
                if target.shape != local.shape:
                    raise HftrainError(f"dpo's reference copy: {name} is sharded differently from the model")
                target.copy_(local)
        return copy_

    def prepare_frozen(self, module):
        """dpo's reference keeps the tensor-parallel shards it was loaded with (see `frozen_copy`)."""
        return module.to(self.accelerator.device).eval(), f"sharded over the tensor-parallel group (tp_size={self.tp})"

    def wrap(self, model, optimizer):
        """The model (DTensor weights, sharded by transformers at load) stays unwrapped: DDP cannot hold DTensors."""
        accelerator, tp = self.accelerator, self.tp
        if accelerator.mixed_precision != "no":
            model.forward = accelerator.autocast()(model.forward)  # what accelerator.prepare would add
        rank = accelerator.process_index
        sharded = next(p for p in model.parameters() if hasattr(p, "device_mesh"))
        if sharded.device_mesh.mesh.flatten().tolist() != list(range(rank - rank % tp, rank - rank % tp + tp)):
            raise HftrainError(f"transformers sharded the model over ranks {sharded.device_mesh.mesh.tolist()}, not "
                               f"over consecutive groups of tp_size={tp} as hftrain assumes for the data split")
        if self.dp.world > 1:
            ReplicaGradients(accelerator, model, self.dp.groups[0], self.dp.world)
        self.checkpoints.attach(model, optimizer)
        return model, optimizer

    @contextmanager
    def generation_context(self, model):
        """generate through the shards, as transformers supports for the models it sharded: every rank of a tp group
        calls `generate` at once on the same prompts (they share a data-parallel rank, so the same rows and row
        seeds), each sharded layer's all-reduce / all-gather hands every rank the same activations and the whole,
        identical logits, so the ranks sample the same tokens in lockstep. Memory as a training forward: each rank
        its shards and 1/tp of the KV cache. `synced_gpus` True: one flag all-reduce per token over every process,
        so that tp groups (data-parallel copies) that finish at different steps, or a rank that ever sampled
        differently from its group (`DataParallel.check_replicas_agree` then says so), keep their collectives
        matched instead of hanging."""
        yield model, True


class FSDP2TensorParallelBackend(TensorParallelBackend):
    """The layouts transformers shards and wraps in FSDP2 itself: FSDP2 x tensor parallel, and expert parallelism
    (`ep_size`, parallel/expert.py: transformers' only EP layout shards the dense weights with FSDP2 too, so it runs
    here under a DDP-type preset as under an FSDP2 one, `fsdp_plugin` None taken as FULL_SHARD without offload).

    FSDP2 x tensor parallel, the 2D layout: an FSDP2 preset with tp_size T and processes = F x T. transformers
    shards every linear layer over the T ranks of a TP group while it loads and applies FSDP2 over the F ranks that
    hold the same TP shard (`DistributedConfig(tp_size=T, fsdp_size=F)`): each weight is a DTensor on the
    ("fsdp", "tp") mesh, each rank holds 1/(F x T) of it, and FSDP2's reduce-scatter averages the gradients over the
    F data-parallel ranks, as DDP's mean does (the loop's loss scale counts on that mean). The model is not prepared
    by accelerate (its FSDP2 x TP path, `Accelerator._prepare_tp`, imports transformers' removed ReplicateParallel);
    checkpoints are tensor parallelism's full-state file, loaded back by each rank's own blocks (`FullStateSlices`)."""

    checkpoint_io = functools.partial(FullStateCheckpoints, slices=True)

    def model_load_kwargs(self) -> dict:
        return {"distributed_config": DistributedConfig(
            tp_size=self.tp, fsdp_size=self.accelerator.num_processes // self.tp,
            fsdp_cpu_offload=self.offloaded,
            # transformers' FSDP2 mixed precision: bf16 compute, fp32 gradient reduction, outputs not cast (the fp32
            # loss sum keeps its precision, as FSDP2Backend ensures for accelerate's policy); fp16 is refused by the
            # preflight
            fsdp_mixed_precision=self.accelerator.mixed_precision == "bf16", **expert_load_kwargs(self.recipe.ep_size))}

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
        fsdp, ep = self.accelerator.num_processes // self.tp, self.recipe.ep_size
        name = f"FSDP2 {'FULL_SHARD' if self.full_shard else 'SHARD_GRAD_OP'} (fsdp_size={fsdp})"
        name += f" x tensor parallel (tp_size={self.tp})" if self.tp > 1 else ""
        name = f"expert parallel (ep_size={ep}: 1/{ep} of every MoE layer's experts per process), dense weights " \
               f"{name}" if ep > 1 else name
        sharded = ALL_PARTS if self.full_shard else ("gradients", "optimizer")
        offloaded = ALL_PARTS if self.offloaded else ()
        return Backend.make_record(self, kind="fsdp2_ep" if ep > 1 else "fsdp2_tp",
                                   name=name + (" + offload" if offloaded else ""), sharded=sharded,
                                   offloaded=offloaded, ep_size=ep)

    def shard_count(self) -> int:
        return self.accelerator.num_processes  # TP-split weights further sharded over the fsdp ranks

    def wrap(self, model, optimizer):
        """The loss wrapper becomes the root FSDP2 unit over transformers' units (embeddings, each decoder layer, the
        final norm with the head, the causal LM), on the same fsdp mesh and policy. torch takes the first unit whose
        forward runs as the root (`FSDPState._lazy_init`), and the wrapper calls the causal LM's decoder and head
        directly (`CausalLMTokenLoss`), not the causal LM's forward: without a root of its own the embeddings' unit
        would be taken, and the norm-with-head unit (two modules) would then refuse to be a second root. As root,
        accelerate's `no_sync` (gradient accumulation) reaches every unit through `set_requires_gradient_sync`."""
        accelerator, tp, world = self.accelerator, self.tp, self.accelerator.num_processes
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

    def clip_grad_norm(self, model, max_norm: float) -> float | None:
        """accelerate's DTensor-aware clipping: the TP-split weights' gradients on the 2D mesh and the norms' (whole
        over TP) on the fsdp mesh, each group's norm over all its shards, combined into one global norm."""
        for p in self.replicated:  # in one order on every rank (a backward hook's order may differ between ranks)
            if p.grad is not None:
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=self.dp.groups[0] if self.dp.groups else None)
                p.grad.div_(self.dp.world)
        norm = self.accelerator.clip_grad_norm_(model.parameters(), max_norm)
        return None if norm is None else float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
