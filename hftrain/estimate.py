"""Memory per GPU before launching: every strategy side by side, and the cheapest launch preset that fits.

    python -m hftrain.estimate --model Qwen/Qwen2.5-7B --gpus 8 --gpu_memory 80 [--lora | --qlora] \
        [--seq 4096 --batch 4] [--sp 4] [--pp 4 --tp 8 --pp_schedule 1F1B]
    python -m hftrain.estimate --model models/llama-3-70b-shape --nodes 4 --gpus_per_node 8 --gpu_memory_gib 80

Only the model's config is read (the model is built on the meta device: no weights are downloaded).
The numbers are a model of what training keeps in memory, per GPU, in bytes:

- weights, gradients, optimizer states (AdamW: two fp32 moments), per strategy: hftrain.memory's model, the one
  each run's start-up line uses too (`Placement`: what a strategy shards, splits and offloads). bf16 mixed
  precision: DDP and FSDP keep fp32 weights and gradients (+ the bf16 weight copies autocast
  caches for the forward); DeepSpeed ZeRO keeps bf16 weights and gradients with fp32 master
  weights in the optimizer state (2 + 2 + 12 bytes per parameter, the ZeRO paper's model). ZeRO-1
  shards the optimizer state, ZeRO-2 also the gradients, ZeRO-3 / FSDP full shard everything; a
  sharded run also holds the gathered weights of the layers in flight (two, with prefetch). DDP
  with 2+ GPUs keeps a second copy of the gradients in its all-reduce buckets.
- activations saved for backward, counted tensor by tensor for a Llama-style decoder layer with
  SDPA/flash attention (no s x s score matrix): per token, two norms (input and normalised
  output in the residual dtype, plus the input of the next matmul), q/k/v, attention output and
  its contiguous copy, and four MLP tensors. With gradient checkpointing only each layer's input
  is kept, plus one layer recomputed during backward. The loss keeps fp32 log-probabilities and
  their gradient for every predicted token (vocab x tokens x 8 bytes) and the logits themselves.
- the peak is weights + optimizer + max(activations, gradients): gradients fill up during backward
  while activations are freed (and gradients are freed by `zero_grad(set_to_none=True)` before the
  next forward). Offload variants move what they offload to CPU memory (shown separately).
- sequence parallelism (--sp N, DeepSpeed Ulysses, preset zero3_sp): each GPU of a group of N holds the
  activations and loss buffers of 1/N of every sequence (its slice; attention runs on 1/N of the heads over the
  whole sequence) plus, per layer, the all-to-all outputs (whole-sequence q, k, v and attention output for those
  heads), on top of ZeRO-3's model state. The same --sp N adds a context-parallel row (torch ring attention under
  FSDP2, preset fsdp2_cp, recipe cp_size): 1/N of the activations plus the ring's key/value blocks of one layer
  (the block attended to and the next one arriving), for any head count. Without --sp, a full fine-tuning that
  needs gradient checkpointing or does not fit gets the smallest degree that fits as a hint (Ulysses where the
  heads divide, else the ring).
- pipeline parallelism (--pp N, with --tp T inside each stage): per process, its stages' weights, gradients and
  optimizer state (the shards transformers' tp plan gives the largest tp rank) and the activations its schedule keeps
  in flight, and the bubble (`pipeline_memory`). --nodes / --gpus_per_node search the 3D layouts (data x tensor x
  pipeline) of a cluster and recommend one with its preset and recipe fields (`search_layouts`, `format_layouts`;
  what they leave out: `NOT_MODELLED`). `models/llama-3-70b-shape` is a config-only Llama-3-70B (no weights).
- LoRA keeps the frozen base in bf16 and trains all-linear adapters of rank r; QLoRA stores the
  base's decoder linears in 4-bit NF4 with double quantization (0.5 + ~0.016 bytes per parameter) and, as
  peft's `prepare_model_for_kbit_training` leaves them, every other weight (embeddings, norms, head) in fp32.

Checked against measured peaks of real CPU runs (docs/memory-estimates.md): within +-25%.
A GPU also needs ~1 GiB for the CUDA context and communication buffers, and fragmentation takes a
part of the rest: a strategy "fits" when its peak stays under 90% of (gpu_memory - 1 GiB).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification
from transformers.distributed import tensor_parallel
from transformers.distributed.tensor_parallel import (
    ALL_PARALLEL_STYLES,
    ColwiseParallel,
    PackedColwiseParallel,
    PackedRowwiseParallel,
    ReplicatedWithGradAllReduce,
    RowwiseParallel,
    TensorParallelLayer,
)

from hftrain import hub
from hftrain.compat.transformers import expanded_parallel_plan
from hftrain.config import PRESET_DIR
from hftrain.errors import ConfigError, HftrainError, first_line, run_tool
from hftrain.memory import (
    ADAMW_BYTES,
    GIB,
    MOMENTUM_BYTES,
    SINGLE,
    ModelState,
    Placement,
    deepspeed_bytes,
    fsdp,
    zero,
    zero_offload_state,
)
from hftrain.metrics import active_expert_fraction, num_experts
from hftrain.options import Parser, add_switch
from hftrain.stages import STAGES_PER_PROCESS, split_layers, stage_indices

# transformers >= 5.21 gives embeddings a style of their own (EmbeddingParallel, its `shard_dim`); before, none: it
# shards an nn.Embedding under the colwise style on the hidden dim (1) and under rowwise on the vocabulary (0) itself
EmbeddingParallel = getattr(tensor_parallel, "EmbeddingParallel", None)

NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)  # 4-bit weights, 8-bit absmax per 64 weights, fp32 absmax per 256 blocks
CUDA_OVERHEAD_GIB = 1.0
USABLE_FRACTION = 0.9


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs from a model, read from its config on the meta device."""

    name: str
    architecture: str
    params: int  # all parameters (tied weights once)
    embedding_params: int  # input embedding
    head_params: int  # output projection when not tied to the input embedding, else 0
    layer_linear_params: int  # weights of the decoder layers' linear layers (what LoRA adapts, QLoRA quantizes)
    largest_layer_params: int  # parameters of one decoder layer (the unit gathered by ZeRO-3 / FSDP)
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_dim: int  # key/value width (num_key_value_heads x head_dim)
    kv_heads: int
    vocab: int
    lora_params_per_rank: int  # adapter parameters per unit of LoRA rank: sum of (in + out) over adapted linears
    active_params: int | None = None  # mixture-of-experts: parameters one token computes with (top-k experts)
    model_type: str = ""
    pipeline_plan: bool = False  # its base_model_pp_plan is embed_tokens, layers, norm (what hftrain's stages split)
    # transformers' tensor-parallel plan (`tp_plan`, resolved on the model), as (elements, size of the sharded
    # dimension, 0 = replicated) per parameter: one decoder layer's, the input embedding's, the output projection's
    layer_tp: tuple[tuple[int, int], ...] = ()
    embedding_tp: tuple[int, int] = (0, 0)
    head_tp: tuple[int, int] = (0, 0)
    tp_plan: bool = False  # the model has a tp plan
    tp_unmodelled: tuple[str, ...] = ()  # plan styles whose placement this estimate does not model (packed, experts)
    experts: int | None = None  # mixture-of-experts: experts per MoE layer (parallel/expert.py reads the config)
    layer_expert_params: int = 0  # the expert weights of the largest decoder layer (what --ep splits)
    scores: bool = False  # a reward model (objective reward): a one-output score head, no vocabulary logits

    @property
    def logit_width(self) -> int:
        """Logits per token the loss holds: the vocabulary, or a reward model's one score."""
        return 1 if self.scores else self.vocab


def ulysses_splits(heads: int, kv_heads: int, sp: int) -> bool:
    """Whether DeepSpeed's Ulysses can give each of `sp` ranks heads/sp attention heads: sp divides the heads, and
    divides the key/value heads or is a multiple of them (they are then replicated)."""
    return heads % sp == 0 and (kv_heads % sp == 0 or sp % kv_heads == 0)


def model_shape(model: str, trust_remote_code: bool = False, reward: bool = False) -> ModelShape:
    """Read `model`'s config (local folder or hub id) and count its parameters on the meta device. `reward`: as
    objective reward builds it (AutoModelForSequenceClassification, one output: the causal LM's head replaced by a
    hidden -> 1 score head)."""
    hub.reach("the config of model", model)
    try:
        config = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise HftrainError(f"cannot read the config of model {model!r}: {first_line(exc)}. Give a local model "
                           "folder or a hub id reachable from this machine (only config.json is needed, no weights)"
                           ) from None
    if reward:
        config.num_labels = 1
    auto = AutoModelForSequenceClassification if reward else AutoModelForCausalLM
    try:
        with torch.device("meta"):
            lm = auto.from_config(config, trust_remote_code=trust_remote_code)
    except ValueError as exc:
        what = "sequence classifier (objective reward)" if reward else "causal LM"
        raise HftrainError(f"model {model!r} ({type(config).__name__}) is not a {what} transformers can build: "
                           f"{first_line(exc)}") from None
    text = config.get_text_config()
    inp, out = lm.get_input_embeddings(), lm.score if reward else lm.get_output_embeddings()
    tied = out is not None and out.weight is inp.weight
    layers = _decoder_layers(lm)
    split, unmodelled = _tp_split(lm)
    names = {id(m): n for n, m in lm.named_modules()}
    largest = max(layers, key=lambda layer: sum(p.numel() for p in layer.parameters()))
    head_module = out if out is not None else inp
    pp_plan = getattr(config, "base_model_pp_plan", None) or {}
    linears = [m for layer in layers for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return ModelShape(
        name=model, architecture=type(lm).__name__,
        params=sum(p.numel() for p in lm.parameters()),
        embedding_params=inp.weight.numel(),
        head_params=0 if tied or out is None else out.weight.numel(),
        layer_linear_params=sum(m.weight.numel() for m in linears),
        largest_layer_params=max(sum(p.numel() for p in layer.parameters()) for layer in layers),
        layers=len(layers), hidden=text.hidden_size,
        intermediate=getattr(text, "intermediate_size", 4 * text.hidden_size),
        heads=heads, kv_dim=getattr(text, "num_key_value_heads", heads) * head_dim,
        kv_heads=getattr(text, "num_key_value_heads", None) or heads, vocab=text.vocab_size,
        lora_params_per_rank=sum(m.in_features + m.out_features for m in linears),
        active_params=_active_params(lm, text),
        model_type=config.model_type, pipeline_plan=list(pp_plan) == ["embed_tokens", "layers", "norm"],
        layer_tp=tuple(split.get(f"{names[id(largest)]}.{n}", (p.numel(), 0)) for n, p in largest.named_parameters()),
        embedding_tp=split.get(f"{names[id(inp)]}.weight", (inp.weight.numel(), 0)),
        head_tp=split.get(f"{names[id(head_module)]}.weight", (head_module.weight.numel(), 0)),
        tp_plan=bool(split), tp_unmodelled=unmodelled, scores=reward, experts=num_experts(config),
        layer_expert_params=sum(p.numel() for name, p in largest.named_parameters() if ".experts." in f".{name}"),
    )


def _tp_split(lm) -> tuple[dict[str, tuple[int, int]], tuple[str, ...]]:
    """How transformers' tensor-parallel plan places each parameter (`apply_tensor_parallelism` in
    transformers/distributed/tensor_parallel.py, 5.23): {name: (elements, size of the sharded dimension)}, 0 for a
    replicated one (norms, and what the plan does not name), and the plan's styles this estimate does not model.
    colwise styles shard a weight's output rows (dim ndim-2: a bias too; packed_colwise, a fused gate/up weight or a
    3D experts' one, the same dimension in strided halves), rowwise ones a weight's input columns (the bias
    replicated; packed_rowwise likewise), embedding styles their `shard_dim` (Llama's plan adds `embed_tokens:
    embedding_rowwise`, the vocabulary); replicated_with_grad_allreduce (Qwen3's q_norm / k_norm) keeps the weight
    whole. Empty for a model without a plan."""
    plan = getattr(lm, "tp_plan", None) or {}
    styles = expanded_parallel_plan(lm, plan) if plan else None
    if styles is None:
        return {}, ()
    split, unmodelled = {}, set()
    for module_name, module in lm.named_modules():
        for short, p in module.named_parameters(recurse=False):  # a tied head's weight under its own name too
            name = f"{module_name}.{short}" if module_name else short
            style = styles.get(name)
            kind = ALL_PARALLEL_STYLES[style] if style is not None else None
            dim = None
            own_embedding = EmbeddingParallel is None and isinstance(module, torch.nn.Embedding)
            if isinstance(kind, ColwiseParallel):
                dim = 1 if own_embedding else (p.ndim - 2) % p.ndim
            elif isinstance(kind, PackedColwiseParallel):
                dim = (p.ndim - 2) % p.ndim
            elif isinstance(kind, RowwiseParallel):
                dim = 0 if own_embedding else None if short == "bias" else p.ndim - 1
            elif isinstance(kind, PackedRowwiseParallel):
                dim = None if p.ndim == 1 else p.ndim - 1
            elif EmbeddingParallel is not None and isinstance(kind, EmbeddingParallel):
                dim = kind.shard_dim
            elif kind is not None and type(kind) not in (TensorParallelLayer, ReplicatedWithGradAllReduce):
                unmodelled.add(style)
            split[name] = (p.numel(), 0 if dim is None else p.shape[dim])
    return split, tuple(sorted(unmodelled))


def tp_elements(parts, tp: int) -> int:
    """Elements the largest tp rank holds of parameters `parts` ((elements, sharded size) pairs): torch's Shard
    gives rank 0 ceil(size / tp) slices of a dimension that tp does not divide."""
    return sum(n // size * -(-size // tp) if size else n for n, size in parts)


def _active_params(lm, config) -> int | None:
    """Parameters a token computes with in a mixture-of-experts model: expert weights count k / experts of their
    size. Compute (FLOPs, MFU) follows these; memory holds every parameter. None for a dense model."""
    fraction = active_expert_fraction(config)
    if fraction is None:
        return None
    experts = sum(p.numel() for name, p in lm.named_parameters() if ".experts." in f".{name}")
    return sum(p.numel() for p in lm.parameters()) - round((1 - fraction) * experts)


def _decoder_layers(lm):
    lists = [m for m in lm.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 0]
    if not lists:
        raise HftrainError(f"cannot find the decoder layers of {type(lm).__name__}; the estimate supports "
                           "decoder-only transformers with a list of layers")
    return max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))


# ------------------------------------------------------------------------ activations
def layer_activation_bytes(s: ModelShape, tokens: int, compute_bytes: int, residual_bytes: int, tp: int = 1) -> int:
    """Bytes one decoder layer saves for backward (SDPA/flash attention, no dropout).

    Per token: each of the two norms keeps its input and normalised output (residual dtype) and the
    next matmul keeps its (cast) input; attention keeps q, k, v and the output projection's input;
    the MLP keeps gate, silu(gate), up and their product. Under tensor parallelism (`tp` ranks, transformers' plan:
    q/k/v, gate and up column-wise, o and down row-wise, no sequence parallelism) each rank keeps 1/tp of the
    attention and MLP tensors (its heads, its slice of the intermediate width) and the norms' tensors whole: the
    row-wise outputs are all-reduced back to the full hidden width.
    """
    h, kv, i = s.hidden, s.kv_dim, s.intermediate
    part = lambda width: -(-width // tp)  # noqa: E731 - this rank's share of a sharded width
    norms = 2 * (2 * h * residual_bytes + h * compute_bytes)
    attention = (part(h) + 2 * part(kv) + part(h)) * compute_bytes
    mlp = 4 * part(i) * compute_bytes
    return tokens * (norms + attention + mlp)


def activation_bytes(s: ModelShape, batch: int, seq: int, compute_bytes: int, residual_bytes: int,
                     checkpointing: bool) -> int:
    """What one micro-batch holds when backward starts: saved activations plus the loss's gradient buffers."""
    tokens = batch * seq
    per_layer = layer_activation_bytes(s, tokens, compute_bytes, residual_bytes)
    layers = s.layers * tokens * s.hidden * residual_bytes if checkpointing else s.layers * per_layer
    final_norm = tokens * s.hidden * (2 * residual_bytes + compute_bytes)
    loss = tokens * s.logit_width * 12  # fp32 log-probabilities, their gradient and the logits' gradient
    return layers + final_norm + loss


def backward_floor_bytes(s: ModelShape, batch: int, seq: int, compute_bytes: int, residual_bytes: int) -> int:
    """What backward holds on top of the gradients when it reaches the first layer: that layer's activations
    (saved, or recomputed under checkpointing) and the gradients flowing through its MLP."""
    tokens = batch * seq
    return layer_activation_bytes(s, tokens, compute_bytes, residual_bytes) + 2 * tokens * s.intermediate * 4


# ------------------------------------------------------------------------------ pipeline
@dataclass(frozen=True)
class StageMemory:
    """What one process of a pipeline (pp_size, `hftrain/parallel/pipeline.py`) holds, in bytes."""

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
    split by `split_layers` (the embedding and the head counted as one layer each), fp32 weights, gradients and two
    fp32 moments of what its stages hold (plus autocast's bf16 copies), a tied head as its own copy on the last stage
    (its gradient is summed with the embedding's); each per-pipeline batch of `batch` rows split into `microbatches`
    (rows padded to a multiple of them), the activations of `chunks_in_flight` microbatch-stages (each a stage's layers
    on one microbatch; the last stage adds the final norm and the loss buffers of each microbatch it holds).
    Data-parallel copies of the pipeline change none of this (hftrain averages their gradients in place).

    `tp` > 1 (pp x tp, each stage's layers loaded with transformers' tp plan over tp ranks): the numbers are those of
    the largest tp rank of each stage. Its parameters are the plan's shards (`ModelShape.layer_tp`: attention and MLP
    linears 1/tp, norms whole; Llama's embedding and head 1/tp of the vocabulary), their gradients and moments alike,
    except the vocabulary-parallel embedding's gradient, which transformers 5.23 leaves whole (replicated) on every tp
    rank (`sum_whole` in parallel/pipeline.py relies on it); activations per `layer_activation_bytes`; the loss
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
        out.append(StageMemory(rank, layers, params, (4 + (2 if mixed else 0)) * params, 4 * grads, 8 * params,
                               chunks, chunks * per_chunk + recomputed + last_stage_chunks * loss))
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


# ------------------------------------------------------------------------ 3D layouts
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


# -------------------------------------------------------------------------- strategies
@dataclass
class Row:
    strategy: str
    preset: str
    method: str  # full, lora, qlora
    weights: float
    grads: float
    optimizer: float
    activations: float
    activations_ckpt: float
    backward_floor: float  # activations still held when the gradients are (nearly) complete
    cpu: float = 0.0  # offloaded bytes in CPU memory, per GPU
    note: str = ""
    placement: Placement = SINGLE  # how the strategy spreads the model state (hftrain.memory)
    copy_bytes: float = 4  # bytes per weight of a frozen copy beside it (a reference, a teacher)

    def add_frozen(self, params: int, bytes_per_weight: float) -> None:
        """A frozen copy of `params` weights (dpo's / kto's reference, distill's teacher), placed as the strategy
        places its weights (`Placement.frozen`)."""
        held = self.placement.frozen(bytes_per_weight * params)
        self.weights += held.weights
        self.cpu += held.cpu

    def peak(self, checkpointing: bool) -> float:
        """Weights and optimizer state, plus the larger of: everything saved when backward starts, or the
        gradients when backward ends (with the first layer's activations)."""
        act = self.activations_ckpt if checkpointing else self.activations
        return self.weights + self.optimizer + max(act, self.grads + self.backward_floor)


@dataclass
class Plan:
    shape: ModelShape
    gpus: int
    batch: int
    seq: int
    precision: str
    lora_r: int
    rows: list[Row] = field(default_factory=list)
    sp: int = 1
    pp: int = 1  # --pp: a pipeline's per-stage lines (`format_pipeline`)
    pp_schedule: str = "1F1B"
    pp_microbatches: int = 1
    tp: int = 1  # --tp: tensor parallel inside each stage (or alone), in the per-stage lines
    optim: str = "adamw"  # --optim


def estimate(shape: ModelShape, gpus: int, batch: int, seq: int, precision: str = "bf16", lora_r: int = 16,
             objective: str = "sft", sp: int = 1, ep: int = 1, teacher: ModelShape | None = None,
             precompute_ref: bool = False, optim: str = "adamw") -> Plan:
    """Memory per GPU for every strategy (bytes).

    optim muon (`optim: muon`): Muon keeps one fp32 momentum buffer (4 bytes) per parameter of the decoder layers'
    linear weights (the hidden matrices) and AdamW its two moments (8 bytes) for the rest; only the rows muon runs
    under are kept (one GPU and DDP, full fine-tuning: the sharded strategies and LoRA refuse it).

    ep > 1 (a mixture-of-experts model): the expert-parallel row, transformers' layout (`ep_size`,
    parallel/expert.py): the dense weights FSDP2-sharded over every GPU, each GPU's experts (1/ep of each layer's)
    FSDP2-sharded over the gpus / ep copies, so the model state per GPU is FSDP's; what differs is the unit gathered
    for compute: a layer's dense weights whole, but only its own 1/ep of the experts.

    objective dpo / simpo / orpo: `batch` counts pairs, two sequences each (one forward); kto: `batch` counts rows,
    one sequence each (its KL pass runs without gradients: not counted). dpo's and kto's full-fine-tuning rows
    add the frozen reference copy as hftrain places it: the loaded fp32 weights on one GPU / DDP and sharded under
    FSDP, the engine's 16-bit weights under DeepSpeed (replicated for ZeRO-1/2, partitioned for ZeRO-3, offloaded
    with parameter offload). `precompute_ref` (precompute_ref_log_probs) or LoRA (adapters disabled) need no copy:
    the precomputed log-probs are a few bytes per row, and their pass before step 1 holds no gradients. The reference's
    own forward runs without gradients and holds one layer's activations at a time: not counted.
    objective distill: `teacher`'s frozen weights are added to every row, placed as hftrain places them (as dpo's
    reference for full fine-tuning, in the base's dtype beside a LoRA / QLoRA student, never quantized); its logits
    exist one chunk of 4096 tokens at a time (not counted).
    """
    n, g = shape.params, gpus
    mixed = precision == "bf16"
    compute, residual = (2, 4) if mixed else (4, 4)
    rows_per_step = batch * (2 if objective in ("dpo", "simpo", "orpo", "reward") else 1)  # kto: one per row
    act = activation_bytes(shape, rows_per_step, seq, compute, residual, checkpointing=False)
    act_ckpt = activation_bytes(shape, rows_per_step, seq, compute, residual, checkpointing=True)
    floor = backward_floor_bytes(shape, rows_per_step, seq, compute, residual)
    activations = (act, act_ckpt, floor)
    copy_note = f"with {objective}'s frozen reference copy; precompute_ref_log_probs needs none"
    # the model state per GPU is hftrain.memory's (the run's start-up line computes it alike); what a strategy holds
    # beyond it is added here by name
    state = ADAMW_BYTES if optim == "adamw" else (MOMENTUM_BYTES * shape.layer_linear_params
                                                  + ADAMW_BYTES * (n - shape.layer_linear_params)) / n
    fp32 = ModelState.of(n, n, 4, state)  # DDP and FSDP: fp32 weights and gradients, the optimizer's state
    w16, master = deepspeed_bytes(4, ADAMW_BYTES, mixed)  # ZeRO: 16-bit weights, fp32 master weights in the state
    zero_state = ModelState.of(n, n, w16, master)
    autocast_copy = 2 * n if mixed else 0  # bf16 weight copies autocast keeps for the forward
    bucket = 4 * n if g > 1 else 0  # DDP all-reduce buckets (a second copy of the gradients)
    unit = shape.largest_layer_params
    in_flight = 2 * unit * w16  # ZeRO-3 / FSDP: the two layers gathered for compute (with prefetch), 16-bit

    def row(strategy, preset, state, placement, weights=0.0, grads=0.0, method="full", copies=4, note="", acts=None):
        """A strategy's row: `state` placed by `placement`, plus what it holds beyond the model state (`weights`,
        `grads`); a frozen copy (reference, teacher) would hold `copies` bytes per weight, placed alike."""
        held = placement.per_device(state)
        return Row(strategy, preset, method, held.weights + weights, held.gradients + grads, held.optimizer,
                   *(acts or activations), cpu=held.cpu, note=note, placement=placement, copy_bytes=copies)

    rows = [row("DDP" if g > 1 else "single GPU", "multi_gpu" if g > 1 else "single_gpu", fp32, SINGLE,
                weights=autocast_copy, grads=bucket)]
    if g > 1:
        rows += [
            row("ZeRO-1", "zero1", zero_state, zero(1, g), copies=w16),
            row("ZeRO-2", "zero2", zero_state, zero(2, g), copies=w16),
            row("FSDP full shard", "fsdp2", fp32, fsdp(g), weights=in_flight, grads=unit * 4),
            row("ZeRO-3", "zero3", zero_state, zero(3, g), weights=in_flight, copies=w16),
        ]
        if sp > 1 and ulysses_splits(shape.heads, shape.kv_heads, sp):
            # each GPU holds the activations of its 1/sp slice of every sequence, plus per layer the all-to-all
            # outputs (whole-sequence q, k, v and attention output for heads/sp heads: as large as the slice's own;
            # measured in docs/long-context.md). Under checkpointing only the recomputed layer has them.
            exchange = rows_per_step * seq // sp * (2 * shape.hidden + 2 * shape.kv_dim) * compute
            rows.append(row(f"ZeRO-3 + Ulysses sequence parallel sp={sp}", "zero3_sp", zero_state, zero(3, g),
                            weights=in_flight, copies=w16,
                            acts=(act / sp + shape.layers * exchange, act_ckpt / sp + exchange, floor / sp + exchange),
                            note=f"{g // sp} data-parallel copies of {sp}-GPU sequence groups"))
        if ep > 1:  # a layer's dense weights gathered whole, but only its own 1/ep of the experts
            expert_unit = unit - shape.layer_expert_params + shape.layer_expert_params // ep
            rows.append(row(f"FSDP full shard + expert parallel ep={ep}", "multi_gpu", fp32, fsdp(g),
                            weights=2 * expert_unit * (2 if mixed else 4), grads=expert_unit * 4,
                            note=f"ep_size: {ep} ({shape.experts // ep} of {shape.experts} experts per GPU; "
                                 "any DDP-type or FSDP2 preset)"))
        if sp > 1:  # the ring: 1/cp of the activations; while one layer's attention runs, the key/value block it
            # attends to and the next one arriving (both of 1/cp of the sequence), any head count
            ring = rows_per_step * seq // sp * 2 * shape.kv_dim * compute * 2
            rows.append(row(f"FSDP full shard + ring attention context parallel cp={sp}", "fsdp2_cp", fp32, fsdp(g),
                            weights=in_flight, grads=unit * 4, acts=(act / sp + ring, act_ckpt / sp + ring,
                                                                     floor / sp + ring),
                            note=f"{g // sp} data-parallel copies of {sp}-GPU context groups; sdpa, no packing"))
    rows += [
        row("ZeRO-2 + optimizer offload", "zero2_offload", zero_offload_state(zero_state, n, 2),
            zero(2, g, ("optimizer",)), copies=w16),
        row("ZeRO-3 + parameter and optimizer offload", "zero3_offload", zero_state,
            zero(3, g, ("weights", "optimizer")), weights=in_flight, copies=w16),
    ]
    adapters = shape.lora_params_per_rank * lora_r
    base = 2 if mixed else 4
    others = n - shape.layer_linear_params
    lora_preset = "multi_gpu" if g > 1 else "single_gpu"
    trained = ModelState(4 * adapters, 4 * adapters, ADAMW_BYTES * adapters)  # fp32 adapters beside a frozen base
    rows += [
        row(f"LoRA r={lora_r} ({'DDP' if g > 1 else 'single GPU'})", lora_preset,
            ModelState(base * n + trained.weights, trained.gradients, trained.optimizer), SINGLE,
            grads=trained.gradients if g > 1 else 0, method="lora", copies=base,
            note=f"{adapters / 1e6:,.1f}M adapter parameters"),
        row(f"QLoRA r={lora_r} ({'DDP' if g > 1 else 'single GPU'})", lora_preset,
            ModelState(NF4_BYTES * shape.layer_linear_params + 4 * others + trained.weights, trained.gradients,
                       trained.optimizer), SINGLE,
            weights=2 * unit, grads=trained.gradients if g > 1 else 0, method="qlora", copies=base,
            note="base in 4-bit NF4"),  # + one layer dequantized for compute
    ]
    if optim == "muon":  # the one layout muon runs under
        rows = rows[:1]
    if objective in ("dpo", "kto") and not precompute_ref:  # full fine-tuning's frozen reference; LoRA's: adapters off
        for r in rows:
            if r.method == "full":
                r.add_frozen(n, r.copy_bytes)  # DDP / FSDP: the loaded fp32 weights; ZeRO: the engine's
                r.note = copy_note
    if teacher is not None:
        t = teacher.params
        for r in rows:
            r.add_frozen(t, r.copy_bytes)
            r.note = "; ".join(filter(None, [r.note, f"with the {t / 1e9:,.2f}B-parameter teacher"]))
    return Plan(shape, gpus, batch, seq, precision, lora_r, rows, sp, optim=optim)


def sequence_parallel_hint(plan: Plan, gpu_memory_gib: float, objective: str = "sft") -> str | None:
    """For a plan without --sp whose full fine-tuning does not fit without gradient checkpointing: the smallest sp
    (dividing the GPUs and the attention heads) with which ZeRO-3 + Ulysses fits without it."""
    row, ckpt = recommend(plan, gpu_memory_gib, "full")[:2]
    if plan.sp > 1 or plan.gpus < 2 or objective != "sft" or (row is not None and not ckpt):
        return None
    for sp in range(2, plan.gpus + 1):
        if plan.gpus % sp:
            continue
        with_sp = estimate(plan.shape, plan.gpus, plan.batch, plan.seq, plan.precision, plan.lora_r, sp=sp)
        ulysses = ulysses_splits(plan.shape.heads, plan.shape.kv_heads, sp)
        preset = "zero3_sp" if ulysses else "fsdp2_cp"
        peak = next(r for r in with_sp.rows if r.preset == preset).peak(False)
        if peak <= usable_bytes(gpu_memory_gib):
            field = "sp_size" if preset == "zero3_sp" else "cp_size"
            return (f"long sequences: --sp {sp} (accelerate_configs/{preset}.yaml, recipe {field}: {sp}) splits each "
                    f"{plan.seq}-token sequence over {sp} GPUs and needs {peak / GIB:.1f} GiB per GPU without "
                    "gradient checkpointing")
    return None


def usable_bytes(gpu_memory_gib: float) -> float:
    return (gpu_memory_gib - CUDA_OVERHEAD_GIB) * USABLE_FRACTION * GIB


def recommend(plan: Plan, gpu_memory_gib: float, method: str) -> tuple[Row | None, bool, str]:
    """The cheapest (row, gradient checkpointing) that fits, and why.

    Cost order: replicated before sharded (ZeRO-1, ZeRO-2, FSDP, ZeRO-3: more communication per
    step), every in-GPU strategy before gradient checkpointing (~30% more compute), and offload
    (bounded by host memory bandwidth) last.
    """
    budget = usable_bytes(gpu_memory_gib)
    candidates = [r for r in plan.rows if r.method == method]
    in_gpu = [r for r in candidates if not r.cpu]
    offload = [r for r in candidates if r.cpu]
    order = [(r, False) for r in in_gpu] + [(r, True) for r in in_gpu]
    order += [(r, c) for c in (False, True) for r in offload]
    skipped = []
    for row, ckpt in order:
        peak = row.peak(ckpt)
        if peak <= budget:
            why = (f"{row.strategy}{' with gradient checkpointing' if ckpt else ''} needs {peak / GIB:.1f} GiB per GPU "
                   f"of the {budget / GIB:.1f} GiB usable on a {gpu_memory_gib:g} GiB GPU")
            if skipped:
                why += f"; cheaper options do not fit ({'; '.join(skipped[:3])})"
            return row, ckpt, why
        skipped.append(f"{row.strategy}{' + checkpointing' if ckpt else ''} {peak / GIB:.1f} GiB")
    return None, False, (f"nothing fits in {budget / GIB:.1f} GiB usable per GPU (smallest: "
                         f"{min(r.peak(True) for r in candidates) / GIB:.1f} GiB); use more GPUs, a smaller batch or "
                         "sequence, or " + ("QLoRA" if method != "qlora" else "GPUs with more memory"))


TOKENS_PER_PARAMETER = 20  # compute-optimal pretraining, Hoffmann et al. 2022 ("Chinchilla"): ~20 tokens/parameter


def token_budget_line(params: int, planned_tokens: int | None) -> str:
    """The compute-optimal token count of a model this size, next to the tokens the run plans to train."""
    optimal = TOKENS_PER_PARAMETER * params
    line = (f"tokens: compute-optimal pretraining of {params / 1e9:.3f}B parameters is ~{optimal / 1e9:,.1f}B tokens "
            f"(~{TOKENS_PER_PARAMETER} per parameter, Hoffmann et al. 2022)")
    if planned_tokens is None:
        return line + "; pass --tokens to compare the run's plan"
    return line + (f"; planned {planned_tokens / 1e9:,.3f}B = {planned_tokens / optimal:.1%} of it (fine-tuning "
                   "usually needs a small fraction; far above 100% is continued pretraining)")


# --------------------------------------------------------------------------------- CLI
def format_plan(plan: Plan, gpu_memory_gib: float, method: str, planned_tokens: int | None = None) -> str:
    s = plan.shape
    active = (f", {s.active_params / 1e9:.3f}B active per token (memory holds all, compute uses these)"
              if s.active_params else "")
    lines = [
        f"{s.name}: {s.architecture}, {s.params / 1e9:.3f}B parameters{active} ({s.layers} layers, hidden {s.hidden}, "
        f"vocab {s.vocab}); {plan.gpus} GPU(s) x {gpu_memory_gib:g} GiB; micro-batch {plan.batch} x {plan.seq} "
        f"tokens per GPU; {'bf16 mixed precision' if plan.precision == 'bf16' else 'fp32'}, "
        f"{'Muon + AdamW' if plan.optim == 'muon' else 'AdamW'}.",
        "GiB per GPU. peak = weights + optimizer + max(activations, grads); ckpt = with gradient checkpointing.",
        "",
        f"{'strategy':<42} {'preset':<14} {'weights':>8} {'grads':>8} {'optim':>8} {'activ.':>8} "
        f"{'act.ckpt':>8} {'peak':>8} {'peak ckpt':>9} {'CPU':>7}",
    ]
    budget = usable_bytes(gpu_memory_gib)
    for r in plan.rows:
        mark = lambda b: f"{b / GIB:.1f}" + ("" if b <= budget else "!")
        lines.append(f"{r.strategy:<42} {r.preset:<14} {r.weights / GIB:>8.2f} {r.grads / GIB:>8.2f} "
                     f"{r.optimizer / GIB:>8.2f} {r.activations / GIB:>8.2f} {r.activations_ckpt / GIB:>8.2f} "
                     f"{mark(r.peak(False)):>8} {mark(r.peak(True)):>9} {r.cpu / GIB:>7.1f}"
                     + (f"  ({r.note})" if r.note else ""))
    lines.append(f"('!' = does not fit in {budget / GIB:.1f} GiB usable; CPU = offloaded GiB per GPU, in host memory)")
    row, ckpt, why = recommend(plan, gpu_memory_gib, method)
    lines.append("")
    if row is None:
        lines.append(f"recommendation: none: {why}")
    else:
        preset = PRESET_DIR / f"{row.preset}.yaml"
        missing = "" if preset.exists() else " (this preset is not in this checkout yet)"
        lines.append(f"recommendation: accelerate_configs/{row.preset}.yaml{missing} with gradient_checkpointing: "
                     f"{str(ckpt).lower()}" + (f", {method} r={plan.lora_r}" if method != "full" else ""))
        lines.append(f"reason: {why}.")
    if (plan.pp > 1 or plan.tp > 1) and method == "full":
        lines += format_pipeline(s, plan.pp, plan.pp_schedule, plan.pp_microbatches, plan.batch, plan.seq,
                                 plan.precision, plan.gpus, gpu_memory_gib, plan.tp)
    hint = sequence_parallel_hint(plan, gpu_memory_gib) if method == "full" else None
    if hint:
        lines.append(hint)
    lines.append(token_budget_line(s.params, planned_tokens))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="hftrain estimate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="Hub id or local folder (only its config is read).")
    parser.add_argument("--gpus", type=int, default=None,
                        help="GPUs in the job (all nodes); default 1, or --nodes x --gpus_per_node.")
    parser.add_argument("--gpu_memory", "--gpu_memory_gib", dest="gpu_memory", type=float, default=80.0,
                        help="Memory of one GPU in GiB.")
    parser.add_argument("--nodes", type=int, default=None,
                        help="Nodes of the cluster, with --gpus_per_node: adds the best 3D layouts (data x tensor x "
                             "pipeline) for full fine-tuning, the recommended one with its preset and recipe fields.")
    parser.add_argument("--gpus_per_node", type=int, default=None,
                        help="GPUs per node (tensor parallel stays inside a node: tp divides this).")
    parser.add_argument("--global_batch", type=int, default=None,
                        help=f"Rows per optimizer step for the 3D layouts (default {DEFAULT_GLOBAL_BATCH}); "
                             "a pipeline runs global_batch / (data-parallel copies x --batch) microbatches.")
    method = parser.add_mutually_exclusive_group()
    add_switch(method, "--lora", help="Recommend for LoRA fine-tuning.")
    add_switch(method, "--qlora", help="Recommend for QLoRA (4-bit base) fine-tuning.")
    parser.add_argument("--lora_r", type=int, default=16, help="LoRA rank (all linear layers adapted).")
    parser.add_argument("--optim", choices=("adamw", "muon"), default="adamw",
                        help="adamw (two fp32 moments per parameter) or muon (optim: muon: one momentum buffer for "
                        "the hidden matrices, AdamW's moments for the rest; one GPU or DDP only).")
    parser.add_argument("--seq", type=int, default=2048, help="Tokens per sequence (max_length).")
    parser.add_argument("--batch", type=int, default=1, help="Sequences per GPU per micro-batch.")
    parser.add_argument("--sp", type=int, default=1,
                        help="Sequence-/context-parallel degree: adds a DeepSpeed Ulysses row (preset zero3_sp; when "
                             "it divides the attention heads) and a ring attention row (preset fsdp2_cp), whose "
                             "activations are those of 1/sp of each sequence. Must divide --gpus.")
    parser.add_argument("--ep", type=int, default=1,
                        help="Expert-parallel degree (ep_size) for a mixture-of-experts model: adds the row of each "
                             "GPU holding 1/ep of every layer's experts, the dense weights FSDP2-sharded. Must divide "
                             "--gpus and the experts.")
    parser.add_argument("--pp", type=int, default=1,
                        help="Pipeline-parallel stages (recipe pp_size): adds each stage's memory (its layers' "
                             "weights, gradients and optimizer state, the activations its schedule keeps in flight) "
                             "and the bubble. --batch is then the rows each pipeline takes per micro-batch. Must "
                             "divide --gpus (the rest are data-parallel copies).")
    parser.add_argument("--tp", type=int, default=1,
                        help="Tensor-parallel degree inside each pipeline stage (recipe tp_size; with --pp 1: "
                             "tensor parallel alone): the per-process lines count the shards transformers' tp plan "
                             "gives each rank. Must divide the attention and key/value heads; --pp x --tp must "
                             "divide --gpus.")
    parser.add_argument("--pp_schedule", choices=("1F1B", "GPipe", "Interleaved1F1B"), default="1F1B",
                        help="The pipeline schedule (recipe pp_schedule).")
    parser.add_argument("--pp_microbatches", type=int, default=None,
                        help="Microbatches per pipeline step (recipe pp_microbatches); default 2 x the stages.")
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="bf16",
                        help="bf16 mixed precision (GPU default) or fp32 (CPU runs).")
    parser.add_argument("--objective", choices=("sft", "dpo", "simpo", "orpo", "kto", "reward", "distill"),
                        default="sft",
                        help="dpo / simpo / orpo / reward: --batch counts preference pairs (two sequences each); kto: "
                             "rows (one each); reward: the model as a one-output sequence classifier (a score head in "
                             "place of the vocabulary head and its logits); dpo's and kto's full fine-tuning adds the "
                             "frozen reference copy; distill adds --teacher's frozen weights.")
    add_switch(parser, "--precompute_ref_log_probs",
               help="dpo / kto: the reference's log-probs computed once before training (recipe "
                             "precompute_ref_log_probs): no frozen reference copy is counted.")
    parser.add_argument("--teacher", default=None,
                        help="distill: the teacher (hub id or local folder; its config only), placed as hftrain "
                             "places it.")
    parser.add_argument("--tokens", type=int, default=None,
                        help="Tokens the run plans to train (steps x effective batch x tokens per sequence), shown "
                             "next to the compute-optimal count.")
    add_switch(parser, "--trust_remote_code", help="Allow the model's own config code.")
    return parser


def print_plan(args: argparse.Namespace) -> None:
    cluster = args.nodes is not None or args.gpus_per_node is not None
    problems = []
    if cluster:
        if args.nodes is None or args.gpus_per_node is None:
            problems.append("--nodes and --gpus_per_node go together (the 3D layouts need both)")
        elif min(args.nodes, args.gpus_per_node) < 1:
            problems.append(f"--nodes and --gpus_per_node must be >= 1, got {args.nodes} and {args.gpus_per_node}")
        elif args.gpus is not None and args.gpus != args.nodes * args.gpus_per_node:
            problems.append(f"--gpus {args.gpus} is not --nodes {args.nodes} x --gpus_per_node {args.gpus_per_node}; "
                            "leave --gpus out")
        else:
            args.gpus = args.nodes * args.gpus_per_node
    if args.gpus is None:
        args.gpus = 1
    problems += [f"--{k} must be >= 1, got {getattr(args, k)}"
                 for k in ("gpus", "seq", "batch", "lora_r", "sp", "tp", "ep") if getattr(args, k) < 1]
    if args.ep > 1 and args.gpus % args.ep:
        problems.append(f"--ep {args.ep} must divide --gpus {args.gpus} (each group of ep GPUs holds every expert "
                        "once)")
    if args.sp > 1 and args.gpus % args.sp:
        problems.append(f"--sp {args.sp} must divide --gpus {args.gpus} (the rest of the GPUs are data-parallel)")
    if args.pp < 1 or (args.pp > 1 and args.tp == 1 and args.gpus % args.pp):
        problems.append(f"--pp {args.pp} must be >= 1 and divide --gpus {args.gpus} (the rest of the GPUs are "
                        "data-parallel copies of the pipeline)")
    elif args.tp > 1 and args.gpus % (args.pp * args.tp):
        problems.append(f"--pp {args.pp} x --tp {args.tp} must divide --gpus {args.gpus} (the rest of the GPUs are "
                        "data-parallel copies)")
    if args.tp > 1 and args.gpus_per_node is not None and args.gpus_per_node % args.tp:
        problems.append(f"--tp {args.tp} must divide --gpus_per_node {args.gpus_per_node}: a tensor-parallel group "
                        "stays inside one node")
    if args.objective == "reward" and (args.pp > 1 or args.tp > 1):
        problems.append("--objective reward trains under DDP, ZeRO or FSDP2 (pp_size and tp_size are refused there)")
    if args.pp_microbatches is not None and args.pp_microbatches < 1:
        problems.append(f"--pp_microbatches must be >= 1, got {args.pp_microbatches}")
    if args.global_batch is not None and (args.global_batch < 1 or not cluster):
        problems.append(f"--global_batch {args.global_batch} needs --nodes and --gpus_per_node and must be >= 1")
    if args.tokens is not None and args.tokens < 1:
        problems.append(f"--tokens must be >= 1, got {args.tokens}")
    if args.gpu_memory <= CUDA_OVERHEAD_GIB:
        problems.append(f"--gpu_memory must be above {CUDA_OVERHEAD_GIB:g} GiB, got {args.gpu_memory:g}")
    if (args.objective == "distill") != (args.teacher is not None):
        problems.append("--objective distill and --teacher go together (the teacher's weights are counted)")
    if args.optim == "muon" and (args.lora or args.qlora or cluster or args.sp > 1 or args.ep > 1 or args.pp > 1
                                 or args.tp > 1):
        problems.append("--optim muon runs on one GPU or under DDP with full fine-tuning (hftrain refuses it with "
                        "LoRA and with layouts that split the weight matrices); drop --lora/--qlora, --nodes, --sp, "
                        "--ep, --pp and --tp")
    if args.precompute_ref_log_probs and args.objective not in ("dpo", "kto"):
        problems.append(f"--precompute_ref_log_probs precomputes dpo's or kto's reference, but --objective is "
                        f"{args.objective}")
    if problems:
        raise ConfigError(problems, "estimate arguments")
    shape = model_shape(args.model, args.trust_remote_code, reward=args.objective == "reward")
    teacher = model_shape(args.teacher, args.trust_remote_code) if args.teacher else None
    problems = layout_problems(shape, args.tp, args.pp, args.pp_schedule)
    if args.ep > 1 and (shape.experts is None or shape.experts % args.ep):
        problems.append(f"--ep {args.ep}: {shape.name} ({shape.model_type}) is not a mixture-of-experts model"
                        if shape.experts is None else
                        f"--ep {args.ep} must divide the model's {shape.experts} experts per layer")
    if problems:
        raise ConfigError(problems, "estimate arguments")
    plan = estimate(shape, args.gpus, args.batch, args.seq, args.precision, args.lora_r, args.objective, args.sp,
                    args.ep, teacher, args.precompute_ref_log_probs, args.optim)
    if args.pp > 1 or args.tp > 1:
        stages = args.pp * STAGES_PER_PROCESS[args.pp_schedule]
        plan.pp, plan.pp_schedule, plan.tp = args.pp, args.pp_schedule, args.tp
        plan.pp_microbatches = args.pp_microbatches or (2 * stages if args.pp > 1 else 1)
    method = "qlora" if args.qlora else "lora" if args.lora else "full"
    print(format_plan(plan, args.gpu_memory, method, args.tokens))
    if cluster:
        row, ckpt = recommend(plan, args.gpu_memory, "full")[:2]
        print("\n".join(format_layouts(shape, args.nodes, args.gpus_per_node, args.gpu_memory,
                                        args.global_batch or DEFAULT_GLOBAL_BATCH, args.batch, args.seq,
                                        args.precision, simpler=row.strategy if row and not ckpt else None)))


def main(argv: list[str] | None = None) -> None:
    run_tool(print_plan, build_parser().parse_args(argv))


if __name__ == "__main__":
    main()
