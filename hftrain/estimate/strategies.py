"""Every strategy's memory per GPU side by side (one process, DDP, ZeRO-1/2/3 with offload, FSDP2, sequence and
context parallelism, LoRA/QLoRA, frozen copies), and the cheapest that fits."""

from __future__ import annotations

from dataclasses import dataclass, field

from hftrain.estimate.activations import activation_bytes, backward_floor_bytes, qat_layer_bytes
from hftrain.estimate.budget import usable_bytes
from hftrain.estimate.shape import ModelShape, ulysses_splits
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

NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)  # 4-bit weights, 8-bit absmax per 64 weights, fp32 absmax per 256 blocks


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
    qat: tuple[str, int] | None = None  # --qat_scheme, --qat_group_size
    fp8: str | None = None  # --fp8 (its recipe)


def estimate(shape: ModelShape, gpus: int, batch: int, seq: int, precision: str = "bf16", lora_r: int = 16,
             objective: str = "sft", sp: int = 1, ep: int = 1, teacher: ModelShape | None = None,
             precompute_ref: bool = False, optim: str = "adamw", qat: tuple[str, int] | None = None,
             fp8: str | None = None) -> Plan:
    """Memory per GPU for every strategy (bytes).

    optim muon (`optim: muon`): Muon keeps one fp32 momentum buffer (4 bytes) per parameter of the decoder layers'
    linear weights (the hidden matrices) and AdamW its two moments (8 bytes) for the rest; only the rows muon runs
    under are kept (one GPU and DDP, full fine-tuning: the sharded strategies refuse it; Muon on LoRA's factors
    is not estimated).

    qat (`qat_scheme`, (scheme, group size)): the layouts QAT runs under (every one but QLoRA's); each decoder layer
    saves what torchao's fake quantization keeps for backward besides
    (`qat_layer_bytes`: for full fine-tuning the fake-quantized weights' intermediates, ~4 bytes per weight under
    bf16; with int8 activations also each linear layer's quantized input), under gradient checkpointing only the
    recomputed layer's.

    fp8 (`fp8: true`, the recipe; `shape.float8_params` from `model_shape(..., fp8_recipe)`): only the layouts fp8 runs
    under (one GPU, DDP, FSDP2; full fine-tuning); bf16 autocast's weight copies are not made for the float8 layers
    (Float8Linear casts its fp32 weight to float8 itself, one matmul at a time). Under FSDP2 with tensorwise scaling the
    float8 layers' weights are gathered in float8, 1 byte each (fp8_fsdp_all_gather, on by default; rowwise gathers
    them in bf16): the two layers in flight hold that much less. The activations saved are the same: a
    Float8Linear keeps its bf16 input and its weight, and casts them again for backward.

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
    autocast_copy = 2 * (n - (shape.float8_params if fp8 else 0)) if mixed else 0  # bf16 copies autocast keeps
    bucket = 4 * n if g > 1 else 0  # DDP all-reduce buckets (a second copy of the gradients)
    unit = shape.largest_layer_params
    in_flight = 2 * unit * w16  # ZeRO-3 / FSDP: the two layers gathered for compute (with prefetch), 16-bit
    # fp8 tensorwise under FSDP2: a layer's float8 weights gathered in float8 (1 byte; fp8_fsdp_all_gather)
    float8_gathered = 2 * shape.float8_params / shape.layers * (w16 - 1) if fp8 == "tensorwise" else 0

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
            row("FSDP full shard", "fsdp2", fp32, fsdp(g), weights=in_flight - float8_gathered, grads=unit * 4),
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
    if qat is not None:  # full fine-tuning (any data-parallel layout) or LoRA; the fake quantization's tensors added
        rows = [r for r in rows if r.method != "qlora"]
        for r in rows:
            extra = qat_layer_bytes(shape, rows_per_step * seq, *qat, mixed, r.method == "full")
            r.activations += shape.layers * extra
            r.activations_ckpt += extra
            r.backward_floor += extra
    if fp8 is not None:  # full fine-tuning on one GPU, DDP or FSDP2
        rows = [r for r in rows if r.strategy in ("single GPU", "DDP", "FSDP full shard")]
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
    return Plan(shape, gpus, batch, seq, precision, lora_r, rows, sp, optim=optim, qat=qat, fp8=fp8)


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
