"""The model-state memory model: bytes of weights, gradients and optimizer state per device, for any layout.

Two callers, one arithmetic: `hftrain estimate` (hftrain/estimate/) gives it facts read from a model's config and
the strategies it compares; each run's start-up line ("model state ~X GiB per device", `Backend.memory`) gives it the
facts of the layout that runs (its `Parallelism` record: what is sharded over how many processes, what is offloaded)
and the live model's parameters (`ParameterCounts`: how many, and the bytes they are stored in). What the model says:

- one copy of the model state is `ModelState`: weights (every parameter, frozen ones included), gradients and
  optimizer state (trained parameters only), in bytes. `ModelState.of(P, T, w, k)` is the ZeRO paper's accounting:
  w bytes per weight and per gradient, k bytes of optimizer state per trained parameter (`optimizer_bytes`: AdamW's
  two fp32 moments, 8; SGD with momentum, 4; plain SGD, 0). DeepSpeed in 16-bit mixed precision keeps 16-bit weights
  and gradients and an fp32 master copy in the optimizer state (`deepspeed_bytes`: 2 and k + 4).
- a layout places it (`Placement`): the parts it shards (ZeRO-1: the optimizer state; ZeRO-2: + gradients; ZeRO-3,
  FSDP2 FULL_SHARD, tensor-parallel shards: everything; FSDP2 SHARD_GRAD_OP: gradients and optimizer state) are split
  over `shards` processes, the others over the processes that split the model itself (`model_shards`: tensor-parallel
  shards x pipeline stages), and the parts it offloads live in CPU memory instead (`PerDevice.cpu`). ZeRO-Offload
  (DeepSpeed's optimizer offload) takes the gradients with the optimizer state: each gradient is reduced into the
  partition the CPU optimizer updates (`zero`), in fp32 at stages 1 and 2 (`zero_offload_state`).
- a frozen copy of the model (dpo's / kto's reference, distill's teacher) is placed like the trained model's weights
  (`Placement.frozen`): whole on each process of DDP, sharded under ZeRO-3 / FSDP, in host memory with parameter
  offload.

What a strategy holds beyond this (autocast's 16-bit weight copies, DDP's all-reduce buckets, the layers ZeRO-3 / FSDP
gather for compute, activations) is the estimate's, named where it adds it. Imports nothing of hftrain.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

GIB = 2**30  # the one unit for memory sizes
PARTS = ("weights", "gradients", "optimizer")  # the model state, in the order ZeRO's stages shard it (last first)
ADAMW_BYTES = 8  # AdamW: two fp32 moments per trained parameter
MOMENTUM_BYTES = 4  # SGD with momentum: one fp32 buffer
MASTER_WEIGHT_BYTES = 4  # the fp32 master copy mixed-precision DeepSpeed keeps in its optimizer state


def optimizer_bytes(adamw: bool, momentum: float = 0.0) -> int:
    """Optimizer-state bytes per trained parameter: AdamW 8, SGD with momentum 4, plain SGD 0."""
    return ADAMW_BYTES if adamw else MOMENTUM_BYTES if momentum > 0 else 0


def deepspeed_bytes(weight_bytes: int, state_bytes: int, sixteen_bit: bool) -> tuple[int, int]:
    """(weight, optimizer-state) bytes per parameter under DeepSpeed: in 16-bit mixed precision 2-byte weights and
    gradients, and the fp32 master weights added to the optimizer state; otherwise unchanged."""
    return (2, state_bytes + MASTER_WEIGHT_BYTES) if sixteen_bit else (weight_bytes, state_bytes)


@dataclass(frozen=True)
class ParameterCounts:
    """A live model's parameters as a run holds them: elements at their original size (a 4-bit weight unpacked) and
    bytes as stored (a 4-bit weight packed, LoRA adapters in the fp32 peft keeps beside a 16-bit base, a sharded
    parameter at its whole size), of all of them and of the trained ones."""

    trained: int
    total: int
    trained_bytes: int
    total_bytes: int

    @classmethod
    def uniform(cls, trained: int, total: int, weight_bytes: int) -> ParameterCounts:
        """Every parameter stored in `weight_bytes` bytes."""
        return cls(trained, total, weight_bytes * trained, weight_bytes * total)


@dataclass(frozen=True)
class ModelState:
    """Bytes of one whole copy of the model state, by part."""

    weights: float
    gradients: float
    optimizer: float

    @classmethod
    def of(cls, params: int, trained: int, weight_bytes: float, state_bytes: float) -> ModelState:
        """`params` weights of `weight_bytes`, a gradient of the same size and `state_bytes` of optimizer state for
        each of the `trained` ones."""
        return cls(weight_bytes * params, weight_bytes * trained, state_bytes * trained)


@dataclass(frozen=True)
class PerDevice:
    """What one process holds of the model state: each part's bytes on its device, and what it keeps in CPU memory."""

    weights: float
    gradients: float
    optimizer: float
    cpu: float

    @property
    def on_device(self) -> float:
        return self.weights + self.gradients + self.optimizer


@dataclass(frozen=True)
class Placement:
    """How a layout spreads the model state over its processes (the facts of a `parallel.base.Parallelism` record, or
    of a strategy the estimate compares)."""

    shards: int = 1  # processes the parts in `sharded` are split over
    model_shards: int = 1  # processes the model itself is split over (tensor-parallel shards x pipeline stages)
    sharded: tuple[str, ...] = ()
    offloaded: tuple[str, ...] = ()  # held in CPU memory

    def share(self, part: str, size: float) -> float:
        """One process's share of `part` of `size` bytes (rounded down: each part separately)."""
        return size // (self.shards if part in self.sharded else self.model_shards)

    def per_device(self, state: ModelState) -> PerDevice:
        shares = {part: self.share(part, getattr(state, part)) for part in PARTS}
        on_device = {part: 0 if part in self.offloaded else size for part, size in shares.items()}
        return PerDevice(**on_device, cpu=sum(size for part, size in shares.items() if part in self.offloaded))

    def frozen(self, weights: float) -> PerDevice:
        """A frozen copy of `weights` bytes (a reference, a teacher), placed as the trained model's weights are."""
        share = self.share("weights", weights)
        offloaded = "weights" in self.offloaded
        return PerDevice(0 if offloaded else share, 0, 0, share if offloaded else 0)


SINGLE = Placement()  # one process, or DDP: every process holds everything


def zero(stage: int, processes: int, offloaded: tuple[str, ...] = ()) -> Placement:
    """DeepSpeed ZeRO-`stage` over `processes`: stage 1 shards the optimizer state, 2 the gradients too, 3 all.
    `offloaded`: "optimizer" (offload_optimizer), "weights" (offload_param). With the optimizer offloaded the
    gradients go to CPU memory too, one partition per process at any stage: DeepSpeed reduces each gradient into
    the partition its CPU optimizer steps (0.19: stage_1_and_2.py's fp32 partition `.grad`, stage3.py's
    `grad_partitions_flat_buffer`), and keeps on the device only the buckets being reduced."""
    sharded, offloaded = PARTS[3 - stage:], tuple(offloaded)
    if "optimizer" in offloaded:
        offloaded += ("gradients",)
        if "gradients" not in sharded:  # stage 1
            sharded += ("gradients",)
    return Placement(processes, 1, sharded, offloaded)


def zero_offload_state(state: ModelState, trained: int, stage: int) -> ModelState:
    """The model state under ZeRO-Offload: at stages 1 and 2 the CPU gradient partitions are fp32 (4 bytes per
    trained parameter, whatever the weights' width); stage 3's are in its gradient-accumulation dtype, the 16-bit
    weights' by default (unchanged). With gradient accumulation stages 1-2 also keep a 16-bit accumulation buffer in
    CPU memory (`accumulated_grads_in_cpu`): not counted."""
    return replace(state, gradients=4 * trained) if stage < 3 else state


def fsdp(processes: int, full_shard: bool = True, offloaded: tuple[str, ...] = ()) -> Placement:
    """FSDP2 over `processes`: FULL_SHARD splits every part, SHARD_GRAD_OP keeps the weights gathered."""
    return Placement(processes, 1, PARTS if full_shard else PARTS[1:], offloaded)
