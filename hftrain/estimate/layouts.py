"""The 3D layouts (data x tensor x pipeline) of a cluster: the search, the launch each needs, the report."""

from __future__ import annotations

from dataclasses import dataclass

from hftrain.estimate.budget import USABLE_FRACTION, usable_bytes
from hftrain.estimate.pipeline import StageMemory, pipeline_bubble, pipeline_memory
from hftrain.estimate.shape import ModelShape
from hftrain.memory import GIB
from hftrain.stages import STAGES_PER_PROCESS

DEFAULT_GLOBAL_BATCH = 128  # rows per optimizer step the 3D search assumes unless --global_batch says otherwise


@dataclass(frozen=True)
class Layout:
    """One data x tensor x pipeline layout of a cluster and its memory (`pipeline_memory`) per process."""

    dp: int
    tp: int
    pp: int
    schedule: str  # "" without a pipeline (pp == 1: the tensor-parallel backend)
    microbatches: int  # per pipeline step; pp == 1: gradient accumulation steps
    checkpointing: bool
    stages: tuple[StageMemory, ...]

    def peak(self) -> float:
        return max(st.peak() for st in self.stages)

    def bubble(self) -> float:
        return pipeline_bubble(self.pp, self.schedule, self.microbatches) if self.pp > 1 else 0.0

    def name(self) -> str:
        pipe = f" pp={self.pp} {self.schedule} m={self.microbatches}" if self.pp > 1 else " pp=1"
        return f"dp={self.dp} tp={self.tp}{pipe}" + (" + checkpointing" if self.checkpointing else "")


def layout_problems(shape: ModelShape, tp: int, pp: int, schedule: str) -> list[str]:
    """Why hftrain cannot run `shape` with tensor-parallel degree `tp` and `pp` stages (`schedule`): the estimate's
    own refusals, matching the run's preflight."""
    problems = []
    if tp > 1:
        if not shape.tp_plan:
            problems.append(f"--tp {tp}: {shape.name} ({shape.model_type}) has no tensor-parallel plan in transformers")
        elif shape.tp_unmodelled:
            problems.append(f"--tp {tp}: {shape.name}'s tp plan uses styles this estimate does not model "
                            f"({', '.join(shape.tp_unmodelled)})")
        if shape.heads % tp or shape.kv_heads % tp:
            problems.append(f"--tp {tp} must divide the attention heads ({shape.heads}) and the key/value heads "
                            f"({shape.kv_heads}) of {shape.name}: each tp rank computes whole heads")
    stages = pp * STAGES_PER_PROCESS.get(schedule, 1)
    if pp > 1 and shape.layers < stages:
        problems.append(f"--pp {pp} with {schedule} needs {stages} stages of at least one layer each, and "
                        f"{shape.name} has {shape.layers} layers")
    if pp > 1 and not shape.pipeline_plan:
        problems.append(f"--pp {pp}: {shape.name} ({shape.model_type}) has no pipeline plan of embed_tokens, layers "
                        "and norm, which hftrain's stages split")
    return problems


def search_layouts(shape: ModelShape, nodes: int, gpus_per_node: int, gpu_memory_gib: float, global_batch: int,
                   batch: int, seq: int, precision: str = "bf16") -> tuple[list[Layout], list[Layout]]:
    """Every 3D layout of `nodes` x `gpus_per_node` GPUs hftrain can run for full fine-tuning of `shape`, as
    (those that fit, ranked best first; all of them). The seeds' rule (shared/seeds, docs/pipeline.md): tensor
    parallel inside a node (tp divides gpus_per_node, so a tp group is consecutive ranks of one node, and the heads
    and key/value heads), pipeline stages across the rest (at least one layer per stage, balanced by `split_layers`
    with the embedding and the head counted), data-parallel copies of what remains. Each optimizer step takes
    `global_batch` rows of `seq` tokens in microbatches of `batch` rows: a pipeline runs global_batch / (dp x batch)
    microbatches per step (at least pp; Interleaved1F1B: a whole number of rounds), a layout without a pipeline as
    many accumulation steps. tp = pp = 1 (DDP, FSDP, ZeRO) is the table above.

    Ranking: fits (peak under the usable memory of every process) without gradient checkpointing before with it
    (~30% more compute); then the smallest bubble (p-1)/(v m); then the smallest tp (fewer, smaller all-reduces on
    every layer's critical path); then the lowest peak (the widest margin)."""
    world = nodes * gpus_per_node
    budget = usable_bytes(gpu_memory_gib)
    every = []
    for tp in (t for t in range(1, gpus_per_node + 1) if gpus_per_node % t == 0):
        for pp in (p for p in range(1, world // tp + 1) if (world // tp) % p == 0):
            if tp == pp == 1:
                continue
            dp = world // (tp * pp)
            steps, rest = divmod(global_batch, dp * batch)
            if rest or steps < max(pp, 1):
                continue
            for schedule in (("1F1B", "Interleaved1F1B") if pp > 1 else ("",)):
                if layout_problems(shape, tp, pp, schedule or "1F1B"):
                    continue
                if schedule == "Interleaved1F1B" and steps % max(1, steps // pp):
                    continue  # torch: the microbatches must fill whole rounds
                for checkpointing in (False, True):
                    stages = pipeline_memory(shape, pp, schedule or "1F1B", steps if pp > 1 else 1,
                                             batch * (steps if pp > 1 else 1), seq, precision, tp, checkpointing)
                    every.append(Layout(dp, tp, pp, schedule, steps, checkpointing, tuple(stages)))
    fitting = [layout for layout in every if layout.peak() <= budget]
    fitting.sort(key=lambda x: (x.checkpointing, x.bubble(), x.tp, x.peak()))
    return fitting, every


def layout_launch(layout: Layout, nodes: int, batch: int, seq: int) -> tuple[str, str]:
    """(the preset and its launch sizes, the recipe fields) that run `layout`."""
    world = layout.dp * layout.tp * layout.pp
    if nodes > 1:
        preset = (f"accelerate_configs/multi_node_3d.yaml with num_machines: {nodes}, num_processes: {world} (each "
                  "node runs it with its --machine_rank)")
    else:
        preset = f"accelerate_configs/{'pp' if layout.pp > 1 else 'tp'}.yaml with num_processes: {world}"
    fields = [f"tp_size: {layout.tp}"]
    if layout.pp > 1:
        fields += [f"pp_size: {layout.pp}", f"pp_schedule: {layout.schedule}",
                   f"pp_microbatches: {layout.microbatches}",
                   f"per_device_train_batch_size: {layout.microbatches * batch}", "gradient_accumulation_steps: 1"]
    else:
        fields += [f"per_device_train_batch_size: {batch}", f"gradient_accumulation_steps: {layout.microbatches}"]
    fields += [f"gradient_checkpointing: {str(layout.checkpointing).lower()}", f"max_length: {seq}"]
    return preset, ", ".join(fields)


NOT_MODELLED = ("not modelled: communication time (tp all-reduces, stage-to-stage sends, data-parallel gradient "
                "averaging) and compute speed; sequence parallelism inside tp (transformers' plan keeps norms and "
                "residuals whole on every tp rank, as counted); FSDP2 per stage (an fsdp2 preset with pp_size: each "
                "stage's state / its data-parallel ranks, not counted here) and ZeRO per stage (refused); LoRA / "
                "QLoRA, dpo and offload under 3D; receive buffers and allocator fragmentation beyond the "
                f"{1 - USABLE_FRACTION:.0%} margin; per-rank differences other than layer counts, the embedding and "
                "the head")


def format_layouts(shape: ModelShape, nodes: int, gpus_per_node: int, gpu_memory_gib: float, global_batch: int,
                   batch: int, seq: int, precision: str, show: int = 5, simpler: str | None = None) -> list[str]:
    """The 3D section of `hftrain estimate --nodes N --gpus_per_node G`: the best layouts that fit, the
    recommendation with its reason, preset and recipe fields, or why none fits. `simpler`: a strategy without tp or
    pp that fits without gradient checkpointing (the table's recommendation), named first."""
    fitting, every = search_layouts(shape, nodes, gpus_per_node, gpu_memory_gib, global_batch, batch, seq, precision)
    budget = usable_bytes(gpu_memory_gib)
    lines = ["", f"3D layouts (data x tensor x pipeline) on {nodes} node(s) x {gpus_per_node} GPUs x "
             f"{gpu_memory_gib:g} GiB, full fine-tuning, {global_batch} rows of {seq} tokens per optimizer step in "
             f"microbatches of {batch} row(s); tp inside a node, pipeline stages across, the rest data-parallel.",
             "ranked: fits without gradient checkpointing before with it, then smallest bubble (p-1)/(v m), then "
             "smallest tp (fewer all-reduces), then lowest peak."]
    if not every:
        lines.append(f"none fits: no layout of {nodes * gpus_per_node} GPUs splits {shape.name} ({shape.heads} heads, "
                     f"{shape.kv_heads} key/value heads, {shape.layers} layers) into whole heads and stages with at "
                     f"least pp microbatches from {global_batch} rows; change --global_batch or --batch")
        return lines + [NOT_MODELLED]
    if not fitting:
        low = min(every, key=Layout.peak)
        lines.append(f"none fits: the smallest peak is {low.peak() / GIB:.1f} GiB per GPU ({low.name()}) of the "
                     f"{budget / GIB:.1f} GiB usable on a {gpu_memory_gib:g} GiB GPU; use more nodes, GPUs with more "
                     "memory, shorter sequences, or LoRA / QLoRA (the table above)")
        return lines + [NOT_MODELLED]
    lines.append(f"{'layout':<56} {'bubble':>7} {'peak GiB':>9} {'stage layers':>14}")
    for layout in fitting[:show]:
        lines.append(f"{layout.name():<56} {layout.bubble():>7.1%} {layout.peak() / GIB:>9.1f} "
                     f"{'/'.join(str(st.layers) for st in layout.stages):>14}")
    best = fitting[0]
    worst = max(best.stages, key=StageMemory.peak)
    preset, fields = layout_launch(best, nodes, batch, seq)
    bubble = (f"bubble {best.bubble():.1%} = ({best.pp}-1)/"
              f"{'(2 x ' + str(best.microbatches) + ')' if best.schedule == 'Interleaved1F1B' else best.microbatches}"
              if best.pp > 1 else "no pipeline bubble")
    fullest = f" (pipeline rank {worst.rank} the fullest)" if best.pp > 1 else ""
    why = (f"fits in {best.peak() / GIB:.1f} of {budget / GIB:.1f} GiB usable{fullest}"
           f"{' only with gradient checkpointing' if best.checkpointing else ' without gradient checkpointing'}"
           f"; {bubble}; " + (f"tp={best.tp} keeps every all-reduce inside one node" if best.tp > 1 else
                                  "no tensor-parallel all-reduces"))
    if len(fitting) > 1:
        runner = fitting[1]
        why += f"; next: {runner.name()} (bubble {runner.bubble():.1%}, {runner.peak() / GIB:.1f} GiB)"
    lines += [f"recommendation: {best.name()}", f"reason: {why}.", f"preset: {preset}", f"recipe: {fields}"]
    if simpler:
        lines.append(f"note: {simpler} (the table's recommendation) fits without tensor or pipeline parallelism and "
                     "without gradient checkpointing: prefer it, the seeds add tp and pp only when it does not")
    lines.append(NOT_MODELLED)
    return lines
