"""Memory per GPU before launching: every strategy side by side, and the cheapest launch preset that fits.

    python -m hftrain.estimate --model Qwen/Qwen2.5-7B --gpus 8 --gpu_memory 80 [--lora | --qlora] \
        [--seq 4096 --batch 4] [--sp 4]

Only the model's config is read (the model is built on the meta device: no weights are downloaded).
The numbers are a model of what training keeps in memory, per GPU, in bytes:

- weights, gradients, optimizer states (AdamW: two fp32 moments), per strategy. bf16 mixed
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
- LoRA keeps the frozen base in bf16 and trains all-linear adapters of rank r; QLoRA stores the
  base's decoder linears in 4-bit NF4 with double quantization (0.5 + ~0.016 bytes per parameter).

Checked against measured peaks of real CPU runs (docs/memory-estimates.md): within +-25%.
A GPU also needs ~1 GiB for the CUDA context and communication buffers, and fragmentation takes a
part of the rest: a strategy "fits" when its peak stays under 90% of (gpu_memory - 1 GiB).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from hftrain.config import PRESET_DIR
from hftrain.errors import ConfigError, HftrainError, first_line, run_tool
from hftrain.metrics import active_expert_fraction
from hftrain.stages import STAGES_PER_PROCESS, split_layers, stage_indices

GIB = 2**30  # the one unit for memory sizes (parallel/base.py imports it)
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


def ulysses_splits(heads: int, kv_heads: int, sp: int) -> bool:
    """Whether DeepSpeed's Ulysses can give each of `sp` ranks heads/sp attention heads: sp divides the heads, and
    divides the key/value heads or is a multiple of them (they are then replicated)."""
    return heads % sp == 0 and (kv_heads % sp == 0 or sp % kv_heads == 0)


def model_shape(model: str, trust_remote_code: bool = False) -> ModelShape:
    """Read `model`'s config (local folder or hub id) and count its parameters on the meta device."""
    try:
        config = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise HftrainError(f"cannot read the config of model {model!r}: {first_line(exc)}. Give a local model "
                           "folder or a hub id reachable from this machine (only config.json is needed, no weights)"
                           ) from None
    try:
        with torch.device("meta"):
            lm = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except ValueError as exc:
        raise HftrainError(f"model {model!r} ({type(config).__name__}) is not a causal LM transformers can build: "
                           f"{first_line(exc)}") from None
    text = config.get_text_config()
    inp, out = lm.get_input_embeddings(), lm.get_output_embeddings()
    tied = out is not None and out.weight is inp.weight
    layers = _decoder_layers(lm)
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
    )


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
def layer_activation_bytes(s: ModelShape, tokens: int, compute_bytes: int, residual_bytes: int) -> int:
    """Bytes one decoder layer saves for backward (SDPA/flash attention, no dropout).

    Per token: each of the two norms keeps its input and normalised output (residual dtype) and the
    next matmul keeps its (cast) input; attention keeps q, k, v and the output projection's input;
    the MLP keeps gate, silu(gate), up and their product.
    """
    h, kv, i = s.hidden, s.kv_dim, s.intermediate
    norms = 2 * (2 * h * residual_bytes + h * compute_bytes)
    attention = (h + 2 * kv + h) * compute_bytes
    mlp = 4 * i * compute_bytes
    return tokens * (norms + attention + mlp)


def activation_bytes(s: ModelShape, batch: int, seq: int, compute_bytes: int, residual_bytes: int,
                     checkpointing: bool) -> int:
    """What one micro-batch holds when backward starts: saved activations plus the loss's gradient buffers."""
    tokens = batch * seq
    per_layer = layer_activation_bytes(s, tokens, compute_bytes, residual_bytes)
    layers = s.layers * tokens * s.hidden * residual_bytes if checkpointing else s.layers * per_layer
    final_norm = tokens * s.hidden * (2 * residual_bytes + compute_bytes)
    loss = tokens * s.vocab * 12  # fp32 log-probabilities, their gradient and the logits' gradient
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
                    precision: str = "bf16") -> list[StageMemory]:
    """Memory of each process of a pp-stage pipeline for full fine-tuning with AdamW, as hftrain runs it: the layers
    split by `split_layers` (the embedding and the head counted as one layer each), fp32 weights, gradients and two
    fp32 moments of what its stages hold (plus autocast's bf16 copies), a tied head as its own copy on the last stage
    (its gradient is summed with the embedding's); each per-pipeline batch of `batch` rows split into `microbatches`
    (rows padded to a multiple of them), the activations of `chunks_in_flight` microbatch-stages (each a stage's layers
    on one microbatch; the last stage adds the final norm and the loss buffers of each microbatch it holds).
    Data-parallel copies of the pipeline change none of this (hftrain averages their gradients in place)."""
    per_process = STAGES_PER_PROCESS[schedule]
    count = pp * per_process
    ranges = split_layers(shape.layers, count)
    mixed = precision == "bf16"
    compute, residual = (2, 4) if mixed else (4, 4)
    tokens = -(-batch // microbatches) * seq  # one microbatch's rows (padded) x the fixed length
    layer_params = shape.largest_layer_params
    head = shape.head_params or shape.embedding_params  # a tied head is a copy on the last stage
    rest = max(shape.params - shape.embedding_params - shape.head_params - shape.layers * layer_params, 0)  # norm
    loss = tokens * shape.hidden * (2 * residual + compute) + tokens * shape.vocab * 12  # as `activation_bytes`
    out = []
    for rank in range(pp):
        stages = stage_indices(rank, pp, per_process)
        layers = sum(len(ranges[s]) for s in stages)
        params = layers * layer_params + (shape.embedding_params if 0 in stages else 0) \
            + (head + rest if count - 1 in stages else 0)
        chunks = chunks_in_flight(rank, pp, schedule, microbatches)
        per_chunk = layers / per_process * layer_activation_bytes(shape, tokens, compute, residual)
        last_stage_chunks = min(chunks, microbatches if schedule == "GPipe" else 1) if count - 1 in stages else 0
        out.append(StageMemory(rank, layers, params, (4 + (2 if mixed else 0)) * params, 4 * params, 8 * params,
                               chunks, chunks * per_chunk + last_stage_chunks * loss))
    return out


def format_pipeline(shape: ModelShape, pp: int, schedule: str, microbatches: int, batch: int, seq: int,
                    precision: str, gpus: int, gpu_memory_gib: float) -> list[str]:
    """The per-stage lines of `hftrain estimate --pp N`."""
    stages = pipeline_memory(shape, pp, schedule, microbatches, batch, seq, precision)
    budget = usable_bytes(gpu_memory_gib)
    lines = ["", f"pipeline parallel pp={pp} ({schedule}, {microbatches} microbatches of {-(-batch // microbatches)} "
             f"rows; {gpus // pp} data-parallel cop{'y' if gpus // pp == 1 else 'ies'}; preset cpu_pp on CPU), "
             "full fine-tuning, GiB per process:",
             f"{'rank':>4} {'layers':>6} {'weights':>8} {'grads':>8} {'optim':>8} {'in flight':>9} {'activ.':>8} "
             f"{'peak':>8}"]
    for st in stages:
        lines.append(f"{st.rank:>4} {st.layers:>6} {st.weights / GIB:>8.2f} {st.grads / GIB:>8.2f} "
                     f"{st.optimizer / GIB:>8.2f} {st.in_flight:>9} {st.activations / GIB:>8.2f} "
                     f"{st.peak() / GIB:>8.2f}" + ("" if st.peak() <= budget else " !"))
    lines.append(f"bubble: {pipeline_bubble(pp, schedule, microbatches):.1%} of each step idle ((p-1)/"
                 f"{'(v m)' if schedule == 'Interleaved1F1B' else 'm'}); more microbatches shrink it")
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


def estimate(shape: ModelShape, gpus: int, batch: int, seq: int, precision: str = "bf16", lora_r: int = 16,
             objective: str = "sft", sp: int = 1) -> Plan:
    """Memory per GPU for every strategy (bytes).

    objective dpo / simpo: `batch` counts pairs, two sequences each (one forward); dpo's full-fine-tuning rows
    add the frozen reference copy as hftrain places it: the loaded fp32 weights on one GPU / DDP and sharded under
    FSDP, the engine's 16-bit weights under DeepSpeed (replicated for ZeRO-1/2, partitioned for ZeRO-3, offloaded
    with parameter offload). precompute_ref_log_probs or LoRA (adapters disabled) need no copy. The reference's
    own forward runs without gradients and holds one layer's activations at a time: not counted.
    """
    n, g = shape.params, gpus
    mixed = precision == "bf16"
    compute, residual = (2, 4) if mixed else (4, 4)
    rows_per_step = batch * (2 if objective != "sft" else 1)
    act = activation_bytes(shape, rows_per_step, seq, compute, residual, checkpointing=False)
    act_ckpt = activation_bytes(shape, rows_per_step, seq, compute, residual, checkpointing=True)
    floor = backward_floor_bytes(shape, rows_per_step, seq, compute, residual)
    reference = 4 * n if objective == "dpo" else 0  # the frozen copy keeps the loaded (fp32) weights
    autocast_copy = 2 * n if mixed else 0  # bf16 weight copies autocast keeps for the forward
    bucket = 4 * n if g > 1 else 0  # DDP all-reduce buckets (a second copy of the gradients)
    unit = shape.largest_layer_params
    rows = [Row("DDP" if g > 1 else "single GPU", "multi_gpu" if g > 1 else "single_gpu", "full",
                4 * n + autocast_copy + reference, 4 * n + bucket, 8 * n, act, act_ckpt, floor,
                note="with dpo's frozen reference copy; precompute_ref_log_probs needs none" if reference else "")]
    if g > 1:
        w16, in_flight = (2, 2 * unit * 2) if mixed else (4, 2 * unit * 4)  # two gathered layers
        master = 12 if mixed else 8
        rows += [
            Row("ZeRO-1", "zero1", "full", w16 * n, w16 * n, master * n / g, act, act_ckpt, floor),
            Row("ZeRO-2", "zero2", "full", w16 * n, w16 * n / g, master * n / g, act, act_ckpt, floor),
            Row("FSDP full shard", "fsdp2", "full", 4 * n / g + in_flight, 4 * n / g + unit * 4, 8 * n / g, act,
                act_ckpt, floor),
            Row("ZeRO-3", "zero3", "full", w16 * n / g + in_flight, w16 * n / g, master * n / g, act, act_ckpt, floor),
        ]
        if sp > 1 and ulysses_splits(shape.heads, shape.kv_heads, sp):
            # each GPU holds the activations of its 1/sp slice of every sequence, plus per layer the all-to-all
            # outputs (whole-sequence q, k, v and attention output for heads/sp heads: as large as the slice's own;
            # measured in docs/long-context.md). Under checkpointing only the recomputed layer has them.
            exchange = rows_per_step * seq // sp * (2 * shape.hidden + 2 * shape.kv_dim) * compute
            rows.append(Row(f"ZeRO-3 + Ulysses sequence parallel sp={sp}", "zero3_sp", "full",
                            w16 * n / g + in_flight, w16 * n / g, master * n / g, act / sp + shape.layers * exchange,
                            act_ckpt / sp + exchange, floor / sp + exchange,
                            note=f"{g // sp} data-parallel copies of {sp}-GPU sequence groups"))
        if sp > 1:  # the ring: 1/cp of the activations; while one layer's attention runs, the key/value block it
            # attends to and the next one arriving (both of 1/cp of the sequence), any head count
            ring = rows_per_step * seq // sp * 2 * shape.kv_dim * compute * 2
            rows.append(Row(f"FSDP full shard + ring attention context parallel cp={sp}", "fsdp2_cp", "full",
                            4 * n / g + in_flight, 4 * n / g + unit * 4, 8 * n / g, act / sp + ring,
                            act_ckpt / sp + ring, floor / sp + ring,
                            note=f"{g // sp} data-parallel copies of {sp}-GPU context groups; sdpa, no packing"))
    w16 = 2 if mixed else 4
    rows += [
        Row("ZeRO-2 + optimizer offload", "zero2_offload", "full", w16 * n, w16 * n / g, 0, act, act_ckpt, floor,
            cpu=(12 if mixed else 8) * n / g),
        Row("ZeRO-3 + parameter and optimizer offload", "zero3_offload", "full", 2 * unit * w16, unit * w16, 0,
            act, act_ckpt, floor, cpu=(w16 + (12 if mixed else 8)) * n / g),
    ]
    adapters = shape.lora_params_per_rank * lora_r
    base = 2 if mixed else 4
    others = n - shape.layer_linear_params
    lora_preset = "multi_gpu" if g > 1 else "single_gpu"
    rows += [
        Row(f"LoRA r={lora_r} ({'DDP' if g > 1 else 'single GPU'})", lora_preset, "lora",
            base * n + 4 * adapters, 4 * adapters * (2 if g > 1 else 1), 8 * adapters, act, act_ckpt, floor,
            note=f"{adapters / 1e6:,.1f}M adapter parameters"),
        Row(f"QLoRA r={lora_r} ({'DDP' if g > 1 else 'single GPU'})", lora_preset, "qlora",
            NF4_BYTES * shape.layer_linear_params + 2 * others + 4 * adapters + 2 * unit,
            4 * adapters * (2 if g > 1 else 1), 8 * adapters, act, act_ckpt, floor, note="base in 4-bit NF4"),
    ]
    if reference:
        w16 = 2 if mixed else 4
        copies = {"ZeRO-1": w16 * n, "ZeRO-2": w16 * n, "ZeRO-2 + optimizer offload": w16 * n,
                  "ZeRO-3": w16 * n / g, "FSDP full shard": 4 * n / g}
        for row in rows[1:]:
            if row.method == "full":
                if row.strategy in copies:
                    row.weights += copies[row.strategy]
                else:
                    row.cpu += w16 * n / g  # parameter offload keeps the reference's partitions in host memory
                row.note = "with dpo's frozen reference copy; precompute_ref_log_probs needs none"
    return Plan(shape, gpus, batch, seq, precision, lora_r, rows, sp)


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
        f"tokens per GPU; {'bf16 mixed precision' if plan.precision == 'bf16' else 'fp32'}, AdamW.",
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
    if plan.pp > 1 and method == "full":
        lines += format_pipeline(s, plan.pp, plan.pp_schedule, plan.pp_microbatches, plan.batch, plan.seq,
                                 plan.precision, plan.gpus, gpu_memory_gib)
    hint = sequence_parallel_hint(plan, gpu_memory_gib) if method == "full" else None
    if hint:
        lines.append(hint)
    lines.append(token_budget_line(s.params, planned_tokens))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hftrain estimate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="Hub id or local folder (only its config is read).")
    parser.add_argument("--gpus", type=int, default=1, help="GPUs in the job (all nodes).")
    parser.add_argument("--gpu_memory", type=float, default=80.0, help="Memory of one GPU in GiB.")
    method = parser.add_mutually_exclusive_group()
    method.add_argument("--lora", action="store_true", help="Recommend for LoRA fine-tuning.")
    method.add_argument("--qlora", action="store_true", help="Recommend for QLoRA (4-bit base) fine-tuning.")
    parser.add_argument("--lora_r", type=int, default=16, help="LoRA rank (all linear layers adapted).")
    parser.add_argument("--seq", type=int, default=2048, help="Tokens per sequence (max_length).")
    parser.add_argument("--batch", type=int, default=1, help="Sequences per GPU per micro-batch.")
    parser.add_argument("--sp", type=int, default=1,
                        help="Sequence-/context-parallel degree: adds a DeepSpeed Ulysses row (preset zero3_sp; when "
                             "it divides the attention heads) and a ring attention row (preset fsdp2_cp), whose "
                             "activations are those of 1/sp of each sequence. Must divide --gpus.")
    parser.add_argument("--pp", type=int, default=1,
                        help="Pipeline-parallel stages (recipe pp_size): adds each stage's memory (its layers' "
                             "weights, gradients and optimizer state, the activations its schedule keeps in flight) "
                             "and the bubble. --batch is then the rows each pipeline takes per micro-batch. Must "
                             "divide --gpus (the rest are data-parallel copies).")
    parser.add_argument("--pp_schedule", choices=("1F1B", "GPipe", "Interleaved1F1B"), default="1F1B",
                        help="The pipeline schedule (recipe pp_schedule).")
    parser.add_argument("--pp_microbatches", type=int, default=None,
                        help="Microbatches per pipeline step (recipe pp_microbatches); default 2 x the stages.")
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="bf16",
                        help="bf16 mixed precision (GPU default) or fp32 (CPU runs).")
    parser.add_argument("--objective", choices=("sft", "dpo", "simpo"), default="sft",
                        help="dpo / simpo: --batch counts preference pairs (two sequences each); dpo's full "
                             "fine-tuning on one GPU or DDP adds the frozen reference copy.")
    parser.add_argument("--tokens", type=int, default=None,
                        help="Tokens the run plans to train (steps x effective batch x tokens per sequence), shown "
                             "next to the compute-optimal count.")
    parser.add_argument("--trust_remote_code", action="store_true", help="Allow the model's own config code.")
    return parser


def print_plan(args: argparse.Namespace) -> None:
    problems = [f"--{k} must be >= 1, got {getattr(args, k)}" for k in ("gpus", "seq", "batch", "lora_r", "sp")
                if getattr(args, k) < 1]
    if args.sp > 1 and args.gpus % args.sp:
        problems.append(f"--sp {args.sp} must divide --gpus {args.gpus} (the rest of the GPUs are data-parallel)")
    if args.pp < 1 or (args.pp > 1 and args.gpus % args.pp):
        problems.append(f"--pp {args.pp} must be >= 1 and divide --gpus {args.gpus} (the rest of the GPUs are "
                        "data-parallel copies of the pipeline)")
    if args.pp_microbatches is not None and args.pp_microbatches < 1:
        problems.append(f"--pp_microbatches must be >= 1, got {args.pp_microbatches}")
    if args.tokens is not None and args.tokens < 1:
        problems.append(f"--tokens must be >= 1, got {args.tokens}")
    if args.gpu_memory <= CUDA_OVERHEAD_GIB:
        problems.append(f"--gpu_memory must be above {CUDA_OVERHEAD_GIB:g} GiB, got {args.gpu_memory:g}")
    if problems:
        raise ConfigError(problems, "estimate arguments")
    shape = model_shape(args.model, args.trust_remote_code)
    plan = estimate(shape, args.gpus, args.batch, args.seq, args.precision, args.lora_r, args.objective, args.sp)
    if args.pp > 1:
        stages = args.pp * (2 if args.pp_schedule == "Interleaved1F1B" else 1)
        if shape.layers < stages:
            raise ConfigError([f"--pp {args.pp} with {args.pp_schedule} needs {stages} stages of at least one layer "
                               f"each, and {args.model} has {shape.layers} layers"], "estimate arguments")
        plan.pp, plan.pp_schedule = args.pp, args.pp_schedule
        plan.pp_microbatches = args.pp_microbatches or 2 * stages
    method = "qlora" if args.qlora else "lora" if args.lora else "full"
    print(format_plan(plan, args.gpu_memory, method, args.tokens))


def main(argv: list[str] | None = None) -> None:
    run_tool(print_plan, build_parser().parse_args(argv))


if __name__ == "__main__":
    main()
