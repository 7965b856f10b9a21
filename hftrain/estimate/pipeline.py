"""Memory of each process of a pipeline (pp_size, with tp inside each stage): its stages' model state, from
hftrain.memory's model, and the activations its schedule keeps in flight; the per-stage lines of `--pp`."""

from __future__ import annotations

from dataclasses import dataclass

from hftrain.estimate.activations import layer_activation_bytes
from hftrain.estimate.budget import usable_bytes
from hftrain.estimate.shape import ModelShape, tp_elements
from hftrain.memory import ADAMW_BYTES, GIB, SINGLE, ModelState
from hftrain.stages import STAGES_PER_PROCESS, split_layers, stage_indices


@dataclass(frozen=True)
class StageMemory:
    """What one process of a pipeline (pp_size, `hftrain/parallel/pipeline/`) holds, in bytes."""

    rank: int  # position in the pipeline (stages rank, rank + pp, ... with Interleaved1F1B)
    layers: int  # decoder layers of its stages
    params: int  # weights of its stages: its layers, the embedding (first stage), the final norm and head (last)
    weights: float
    grads: float
    optimizer: float
    in_flight: int  # microbatch-stage chunks whose activations it holds at once
    activations: float

    def peak(self) -> float:
        """Weights, gradients and optimizer state, plus the activations in flight: under a pipeline, gradients
        accumulate from the first microbatch's backward on while later microbatches' activations are still held."""
        return self.weights + self.grads + self.optimizer + self.activations


def pipeline_bubble(pp: int, schedule: str, microbatches: int) -> float:
    """The idle share of a pipeline step: (p-1)/m for GPipe and 1F1B, (p-1)/(v m) interleaved (v stages a process)."""
    return (pp - 1) / (STAGES_PER_PROCESS[schedule] * microbatches)


def chunks_in_flight(rank: int, pp: int, schedule: str, microbatches: int) -> int:
    """How many (microbatch, stage) activations process `rank` holds at most, in torch's schedules (2.13,
    torch/distributed/pipelining/schedules.py): GPipe runs every forward first (m); 1F1B's stage s does min(m, p - s)
    forwards before its first backward; Interleaved1F1B's warm-up is (v-1) x (microbatches per round) + 2 (p-1-rank)
    forwards, plus the one its first forward-backward pair adds, at most v m."""
    m = microbatches
    if schedule == "GPipe":
        return m
    if schedule == "1F1B":
        return min(m, pp - rank)
    v = 2  # Interleaved1F1B: two stages per process (STAGES_PER_PROCESS)
    per_round = m // max(1, m // pp)
    return min((v - 1) * per_round + 2 * (pp - 1 - rank) + 1, v * m)


def pipeline_memory(shape: ModelShape, pp: int, schedule: str, microbatches: int, batch: int, seq: int,
                    precision: str = "bf16", tp: int = 1, checkpointing: bool = False) -> list[StageMemory]:
    """Memory of each process of a pp-stage pipeline for full fine-tuning with AdamW, as hftrain runs it: the layers
    split by `split_layers` (the embedding and the head counted as one layer each), the model state of what its
    stages hold by hftrain.memory's model (fp32 weights, gradients and two fp32 moments; plus autocast's bf16
    copies), a tied head as its own copy on the last stage (its gradient is summed with the embedding's); each
    per-pipeline batch of `batch` rows split into `microbatches` (rows padded to a multiple of them), the activations
    of `chunks_in_flight` microbatch-stages (each a stage's layers on one microbatch; the last stage adds the final
    norm and the loss buffers of each microbatch it holds).
    Data-parallel copies of the pipeline change none of this (hftrain averages their gradients in place).

    `tp` > 1 (pp x tp, each stage's layers loaded with transformers' tp plan over tp ranks): the numbers are those of
    the largest tp rank of each stage. Its parameters are the plan's shards (`ModelShape.layer_tp`: attention and MLP
    linears 1/tp, norms whole; Llama's embedding and head 1/tp of the vocabulary), their gradients and moments alike,
    except the vocabulary-parallel embedding's gradient, which transformers 5.23 leaves whole (replicated) on every tp
    rank (`sum_whole` in parallel/pipeline/ relies on it); activations per `layer_activation_bytes`; the loss
    buffers whole (the head gathers the logits: `colwise_gather_output`). pp == 1 with tp: the tensor-parallel
    backend, one microbatch (`batch` rows) at a time. `checkpointing`: each chunk keeps only its layers' inputs,
    and backward recomputes one layer at a time."""
    per_process = STAGES_PER_PROCESS[schedule]
    count = pp * per_process
    ranges = split_layers(shape.layers, count)
    mixed = precision == "bf16"
    compute, residual = (2, 4) if mixed else (4, 4)
    tokens = -(-batch // microbatches) * seq  # one microbatch's rows (padded) x the fixed length
    whole = lambda parts: tp_elements(parts, 1)  # noqa: E731
    sharded = tp > 1 and shape.tp_plan
    layer_params = tp_elements(shape.layer_tp, tp) if sharded else shape.largest_layer_params
    embedding = tp_elements([shape.embedding_tp], tp) if sharded else shape.embedding_params
    head = tp_elements([shape.head_tp], tp) if sharded else shape.head_params or shape.embedding_params  # tied: copy
    rest = max(shape.params - shape.embedding_params - shape.head_params - shape.layers * shape.largest_layer_params,
               0)  # the final norm
    whole_embedding_grad = sharded and shape.embedding_tp[1] > 0 and not (shape.head_params == 0 and pp == 1)
    loss = tokens * shape.hidden * (2 * residual + compute) + tokens * shape.logit_width * 12  # as `activation_bytes`
    layer_activations = layer_activation_bytes(shape, tokens, compute, residual, tp if sharded else 1)
    out = []
    for rank in range(pp):
        stages = stage_indices(rank, pp, per_process)
        layers = sum(len(ranges[s]) for s in stages)
        first, last = 0 in stages, count - 1 in stages
        tied_here = first and shape.head_params == 0  # pp == 1: the tied head is the embedding itself
        params = layers * layer_params + (embedding if first else 0) + ((0 if tied_here else head) + rest if last
                                                                        else 0)
        grads = params + (whole([shape.embedding_tp]) - embedding if first and whole_embedding_grad else 0)
        chunks = chunks_in_flight(rank, pp, schedule, microbatches)
        if checkpointing:
            per_chunk = layers / per_process * tokens * shape.hidden * residual
            recomputed = layer_activations  # the layer whose backward runs, its activations rebuilt
        else:
            per_chunk, recomputed = layers / per_process * layer_activations, 0
        last_stage_chunks = min(chunks, microbatches if schedule == "GPipe" else 1) if last else 0
        # the stage's model state is hftrain.memory's (as every strategy row and the run's start-up line): one whole
        # copy of what this process holds, fp32 weights and gradients and AdamW's moments, placed on it alone (its
        # data-parallel copies hold their own); beyond it, by name: autocast's 16-bit weight copies and the
        # whole gradient a vocabulary-parallel embedding keeps
        held = SINGLE.per_device(ModelState.of(params, params, 4, ADAMW_BYTES))
        autocast_copy = 2 * params if mixed else 0
        whole_grad = 4 * (grads - params)
        out.append(StageMemory(rank, layers, params, held.weights + autocast_copy, held.gradients + whole_grad,
                               held.optimizer, chunks, chunks * per_chunk + recomputed + last_stage_chunks * loss))
    return out


def format_pipeline(shape: ModelShape, pp: int, schedule: str, microbatches: int, batch: int, seq: int,
                    precision: str, gpus: int, gpu_memory_gib: float, tp: int = 1) -> list[str]:
    """The per-stage lines of `hftrain estimate --pp N [--tp T]` (and of `--tp T` alone: one line)."""
    stages = pipeline_memory(shape, pp, schedule, microbatches, batch, seq, precision, tp)
    budget = usable_bytes(gpu_memory_gib)
    copies = gpus // (pp * tp)
    copies_text = f"{copies} data-parallel cop{'y' if copies == 1 else 'ies'}"
    per_tp = f", each of its {tp} tp ranks (the largest share)" if tp > 1 else ""
    if pp == 1:
        title = f"tensor parallel tp={tp} ({copies_text}; preset tp), full fine-tuning, GiB per process:"
    else:
        title = (f"pipeline parallel pp={pp}{f' x tensor parallel tp={tp}' if tp > 1 else ''} ({schedule}, "
                 f"{microbatches} microbatches of {-(-batch // microbatches)} rows; {copies_text}; preset pp on one "
                 f"node, multi_node_3d on several, cpu_pp on CPU), full fine-tuning, GiB per process{per_tp}:")
    lines = ["", title,
             f"{'rank':>4} {'layers':>6} {'weights':>8} {'grads':>8} {'optim':>8} {'in flight':>9} {'activ.':>8} "
             f"{'peak':>8}"]
    for st in stages:
        lines.append(f"{st.rank:>4} {st.layers:>6} {st.weights / GIB:>8.2f} {st.grads / GIB:>8.2f} "
                     f"{st.optimizer / GIB:>8.2f} {st.in_flight:>9} {st.activations / GIB:>8.2f} "
                     f"{st.peak() / GIB:>8.2f}" + ("" if st.peak() <= budget else " !"))
    if pp > 1:
        lines.append(f"bubble: {pipeline_bubble(pp, schedule, microbatches):.1%} of each step idle ((p-1)/"
                     f"{'(v m)' if schedule == 'Interleaved1F1B' else 'm'}); more microbatches shrink it")
    return lines
