"""The layout record: how a launch's processes are split over the parallel axes, built once from the recipe and the
launch (torchtitan's `ParallelDims`).

    dims = ParallelDims.build(recipe, launch)      # or ParallelDims(world=8, strategy="ddp", pp=2, tp=2)
    dims.mesh                                      # (("pp", 2), ("dp", 2), ("tp", 2)): outermost first
    dims.coordinates(5)                            # {"pp": 1, "dp": 0, "tp": 1}
    dims.replicas                                  # ranks that train on the same batches (here a copy's 4)
    ParallelDims(world=4, strategy="ddp", ep=2).efsdp  # 2: ranks holding the same experts (expert parallelism)

One rank order serves every layout hftrain runs: pp outermost, then the data-parallel copies, then the sequence axis
(cp or sp: a sequence's shards), tp innermost, so a tensor-parallel group is consecutive ranks of one machine and
the `replicas` ranks that share one batch are consecutive unless stages split them (rank = ((pp_rank x dp + dp_rank)
x cp x sp + seq_rank) x tp + tp_rank). `strategy` is how each data-parallel rank holds the model state it trains:
whole ("single", "ddp"), sharded by FSDP2 over the data-parallel (and context) ranks ("fsdp2"), or by DeepSpeed ZeRO
("deepspeed"). The backend that runs a layout is chosen from this record (`hftrain.parallel.resolve`).

Expert parallelism (`ep`) is not a rank-order axis of its own: it is a second view of the dp x tp ranks of a stage,
transformers' (`TransformersDeviceMesh`: experts on (efsdp, ep), ep innermost). Each group of `ep` consecutive ranks
holds every expert once, `num_experts / ep` each, and exchanges tokens by all-to-all; the `efsdp` = dp x tp / ep
groups hold the same experts. It shares no batches, so `replicas` and `dp` do not change.
"""

from __future__ import annotations

from dataclasses import dataclass

from hftrain.config import Recipe

AXES = ("pp", "dp", "cp", "sp", "tp")  # the rank order, outermost first
STRATEGIES = ("single", "ddp", "fsdp2", "deepspeed")


@dataclass(frozen=True)
class ParallelDims:
    """The degrees of the parallel axes of a launch of `world` processes (1 = the axis is off); `dp`, the number of
    data-parallel copies, is what the others leave."""

    world: int
    strategy: str  # "single", "ddp", "fsdp2" or "deepspeed"
    pp: int = 1  # pipeline stages: each rank holds some layers
    cp: int = 1  # ring-attention context parallelism: a sequence split over cp ranks (FSDP2)
    sp: int = 1  # Ulysses sequence parallelism: the same, under DeepSpeed
    tp: int = 1  # tensor parallelism: every layer split over tp ranks
    ep: int = 1  # expert parallelism: every MoE layer's experts split over ep ranks of the dp x tp plane

    @classmethod
    def build(cls, recipe: Recipe, launch) -> ParallelDims:
        """The layout of `launch` (a `Launch`: the preset's strategy and process count) for `recipe`'s sizes."""
        return cls(world=launch.world, strategy=launch.kind, pp=recipe.pp_size, cp=recipe.cp_size,
                   sp=recipe.sp_size, tp=recipe.tp_size, ep=recipe.ep_size)

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")

    @property
    def replicas(self) -> int:
        """The ranks that train on the same batches (a copy's stages, sequence shards and tensor shards): its
        values are counted once per copy."""
        return self.pp * self.cp * self.sp * self.tp

    @property
    def dp(self) -> int:
        """The data-parallel copies: each trains on its own share of every batch."""
        return self.world // self.replicas

    @property
    def fsdp(self) -> int:
        """The ranks FSDP2 shards each weight (each tp shard of it) over: the data-parallel and context ranks of a
        stage (1 without FSDP2)."""
        return self.dp * self.cp if self.strategy == "fsdp2" else 1

    @property
    def efsdp(self) -> int:
        """The ranks that hold the same experts (transformers' efsdp: dp x tp / ep); 1 = each expert on one rank."""
        return self.dp * self.tp // self.ep

    @property
    def axes(self) -> frozenset[str]:
        """The model-splitting axes that are on, e.g. {"pp", "tp"} (dp is not one: every layout has copies)."""
        return frozenset(name for name in (*AXES, "ep") if name != "dp" and getattr(self, name) > 1)

    @property
    def mesh(self) -> tuple[tuple[str, int], ...]:
        """(axis, degree) of every axis above 1, plus dp, outermost first: the shape of the device mesh."""
        return tuple((name, self.size(name)) for name in AXES if name == "dp" or self.size(name) > 1)

    def size(self, axis: str) -> int:
        return self.dp if axis == "dp" else getattr(self, axis)

    def coordinates(self, rank: int) -> dict[str, int]:
        """This rank's index along each axis of `mesh`."""
        place = {}
        for name, degree in reversed(self.mesh):
            rank, place[name] = divmod(rank, degree)
        return {name: place[name] for name, _ in self.mesh}

    def problems(self) -> list[str]:
        """What makes this layout impossible whatever the strategy: a degree below 1, or axes whose product does not
        divide the processes. The strategy's own rules (which axes it runs, how many copies it needs) are in the
        preflight, beside the code that runs them."""
        low = [f"{name}_size must be >= 1 (1 = off), got {getattr(self, name)}"
               for name in (*AXES, "ep") if name != "dp" and getattr(self, name) < 1]
        if low:
            return low
        if self.world % self.replicas:
            sizes = " x ".join(f"{name}_size={getattr(self, name)}" for name in AXES
                               if name != "dp" and getattr(self, name) > 1)
            return [f"{sizes} = {self.replicas} does not divide the {self.world} processes of this launch; use a "
                    f"multiple of {self.replicas} processes (each copy of the model spans {self.replicas} ranks)"]
        if self.ep > 1 and self.ep % self.tp:
            return [f"ep_size={self.ep} is not a multiple of tp_size={self.tp}: the ranks of a tensor-parallel group "
                    "share a batch and split its tokens between them, so each holds its own experts; use an "
                    f"ep_size that is a multiple of {self.tp}"]
        if self.ep > 1 and (self.dp * self.tp) % self.ep:
            return [f"ep_size={self.ep} does not divide the {self.dp * self.tp} processes of a pipeline stage "
                    f"(dp {self.dp} x tp {self.tp}): each group of ep_size consecutive ranks holds every expert once; "
                    f"use an ep_size that divides {self.dp * self.tp}, or a multiple of {self.ep} processes"]
        return []

    def describe(self) -> str:
        """The layout in a few words, e.g. "pp 2 x dp 2 x tp 2 (DDP-style copies)"."""
        shards = {"single": "one process", "ddp": "DDP-style copies", "fsdp2": "FSDP2", "deepspeed": "DeepSpeed ZeRO"}
        experts = f", experts over ep {self.ep}" if self.ep > 1 else ""
        return " x ".join(f"{name} {degree}" for name, degree in self.mesh) + f" ({shards[self.strategy]}{experts})"
