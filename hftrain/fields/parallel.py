"""The parallelism group of the recipe: its fields (`ParallelFields`) and the rules judged from the recipe alone
(`problems`); the backends are `hftrain/parallel/`, and the rules that need the launch or the model are in
`hftrain/preflight.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

from hftrain.fields import recipe_field as _f
from hftrain.paths import PRESET_DIR
from hftrain.presets import layout_problems

V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")  # two stages per process placed in a V (rank 0: the first and last)


@dataclass
class ParallelFields:
    # The strategy itself comes from the launch preset (accelerate_configs/); the recipe records which
    # preset it was sized for and why, and `hftrain launch` uses that preset when --preset is not given.
    launch_preset: str | None = _f(
        None, "Name of the accelerate_configs preset this recipe is sized for (e.g. zero3); `hftrain launch` "
        "uses it when --preset is not given, and the run logs it next to what really runs.", group="parallelism",
    )
    launch_preset_reason: str | None = _f(
        None, "Why that preset, e.g. the model-state memory estimate against the GPU memory (the run logs its "
        "own estimate for the strategy it runs).", group="parallelism",
    )
    tp_size: int = _f(
        1, "Tensor-parallel degree: load the model with transformers' DistributedConfig(tp_size=N), its predefined "
        "tensor-parallel plan (tp_plan 'auto'), so each linear layer is sharded over N processes that see the same "
        "batches. Needs a DDP-type preset (e.g. tp) with N processes, or a multiple of N for data-parallel copies "
        "of the split model (hftrain averages their gradients); or an FSDP2 preset with a multiple of N processes, at "
        "least 2N: FSDP2 x TP, each split weight further sharded over processes / N ranks. 1 = off.",
        group="parallelism",
    )
    sp_size: int = _f(
        1, "Sequence-parallel degree (DeepSpeed Ulysses / ALST): each sequence is split over N consecutive processes "
        "that exchange attention heads by all-to-all, so activation memory per process is about 1/N. Needs a "
        "DeepSpeed preset (cpu_sp, zero3_sp) with a multiple of N processes (the remaining factor is "
        "data-parallel) and attention heads divisible by N. docs/long-context.md. 1 = off.",
        group="parallelism",
    )
    cp_size: int = _f(
        1, "Context-parallel degree (torch ring attention through accelerate's ParallelismConfig): each sequence is "
        "split over N consecutive processes that pass key/value blocks around a ring, so activation memory per "
        "process is about 1/N. Needs an FSDP2 preset on CUDA GPUs (fsdp2_cp) with a multiple of N processes (the "
        "remaining factor is data-parallel), sdpa attention and unpacked rows. With tp_size T under an FSDP2 preset: "
        "tp x cp, processes a multiple of N x T (each tensor-parallel rank rings its own heads). "
        "docs/long-context.md. 1 = off.",
        group="parallelism",
    )
    ep_size: int = _f(
        1, "Expert-parallel degree for mixture-of-experts models: load with transformers' DistributedConfig(ep_size=N, "
        "ep_implementation='all_to_all') and the model's expert plan (base_model_ep_plan: Mixtral, Qwen3-MoE and "
        "newer families), so each process holds num_experts / N experts of every MoE layer and sends each token to "
        "its experts' process by all-to-all. transformers shards the other (dense) weights with FSDP2 over the same "
        "processes, so it runs under a DDP-type preset (cpu_ddp on CPU, multi_gpu) or an FSDP2 one alike, with N "
        "dividing the processes and the experts (the remaining factor holds copies of each expert). With tp_size T: "
        "N a multiple of T, the dense weights split by tensor parallelism and each rank of a tensor-parallel group "
        "dispatching its own slice of the shared batch (e.g. 2 processes: --tp_size 2 --ep_size 2 under cpu_ddp). "
        "Exact against one process on the same global batch. docs/parallelism.md. 1 = off.", group="parallelism",
    )
    # pipeline parallelism (hftrain/parallel/pipeline/, docs/pipeline.md): one contiguous block
    pp_size: int = _f(
        1, "Pipeline-parallel degree: the model's layers split into N stages by its pp plan (base_model_pp_plan), one "
        "per process (two with Interleaved1F1B), run by torch.distributed.pipelining. Needs a DDP-type preset "
        "(cpu_pp on CPU, pp on GPUs) with N processes (N x tp_size with tensor parallelism inside each stage), or a "
        "multiple of it for data-parallel copies of the pipeline (3D: data x tensor x pipeline). docs/pipeline.md. "
        "1 = off.", group="parallelism",
    )
    pp_schedule: str = _f(
        "1F1B", "Pipeline schedule (torch's names): 1F1B (one forward, one backward: few activations in flight), "
        "GPipe (all forwards, then all backwards), Interleaved1F1B (two stages per process: bubble halved); "
        "opt-in ZBVZeroBubble and DualPipeV (two stages per process placed in a V, the backward split into input and "
        "weight gradients to fill the bubble; docs/pipeline.md).", group="parallelism",
        choices=("1F1B", "GPipe", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV"),
    )
    pp_microbatches: int | None = _f(
        None, "Microbatches per pipeline step: each per-device batch is split into this many along its rows (padded "
        "with target-less rows to a multiple of it). Default: 2 x the pipeline stages. Bubble: (stages-1)/"
        "microbatches.", group="parallelism",
    )


def problems(r) -> list[str]:
    """The parallelism group: the recorded preset must be one that ships, and the recipe must have the layout that
    preset is for (hftrain.presets)."""
    problems = []
    if r.launch_preset is not None and not (PRESET_DIR / f"{r.launch_preset}.yaml").is_file():
        shipped = ", ".join(sorted(p.stem for p in PRESET_DIR.glob("*.yaml")))
        problems.append(f"launch_preset={r.launch_preset!r} is not a shipped preset; use one of: {shipped}")
    elif r.launch_preset is not None:
        problems += layout_problems(PRESET_DIR / f"{r.launch_preset}.yaml", r)
    for name in ("tp_size", "sp_size", "cp_size", "ep_size"):
        if getattr(r, name) < 1:
            problems.append(f"{name} must be >= 1 (1 = off), got {getattr(r, name)}")
    if r.sp_size > 1 and (r.tp_size > 1 or r.cp_size > 1):
        problems.append(f"sp_size={r.sp_size} with tp_size={r.tp_size} / cp_size={r.cp_size}: Ulysses sequence "
                        "parallelism runs under DeepSpeed, which hftrain does not combine with tensor or ring "
                        "attention context parallelism; for long sequences with tensor parallelism use tp_size with "
                        "cp_size under an FSDP2 preset, and set sp_size: 1")
    problems += _sequence_objective_problems(r)
    problems += _pipeline_problems(r)
    problems += _expert_problems(r)
    if r.launch_preset_reason is not None and r.launch_preset is None:
        problems.append("launch_preset_reason is set but launch_preset is not; name the preset it explains")
    return problems


def _sequence_objective_problems(r) -> list[str]:
    """sp_size / cp_size with an objective other than sft. grpo under sp_size or cp_size: generation and the reference
    see whole sequences on every rank of the group, the loss shards the tokens and their per-token weights
    (hftrain.parallel.sequence / context, `GRPOLoss.sliced_forward`). grpo under tp x cp is refused with every
    objective but sft under FSDP2 x TP (the preflight's `fsdp2_tensor_parallel_problems`)."""
    problems = []
    if r.cp_size > 1 and r.objective not in ("sft", "grpo"):
        problems.append(f"cp_size={r.cp_size} with objective={r.objective} is not supported: preference losses need "
                        "each row's whole log-probability on one process; use data parallelism")
    if r.sp_size > 1 and r.objective not in ("sft", "grpo"):
        problems.append(f"sp_size={r.sp_size} with objective={r.objective} is not supported: preference losses need "
                        "each row's whole log-probability on one process; use data parallelism")
    if r.sp_size > 1 and r.objective == "grpo":
        if r.use_vllm:
            problems.append(f"sp_size={r.sp_size} with use_vllm is not supported: each rank of a sequence group "
                            "would run its own vLLM engine on the same prompts, and the importance-sampling weights "
                            "are not sliced; use transformers' generate (use_vllm: false), or sp_size: 1")
    return problems


def _pipeline_problems(r) -> list[str]:
    """pp_size / pp_schedule / pp_microbatches, from the recipe alone (the launch and the model's layers are checked
    in the preflight: parallel.pipeline.pipeline_problems)."""
    if r.pp_size < 1:
        return [f"pp_size must be >= 1 (1 = off), got {r.pp_size}"]
    if r.pp_size == 1:
        return []
    problems = []
    sizes = {"sp_size": r.sp_size, "cp_size": r.cp_size}
    others = [f"{name}={size}" for name, size in sizes.items() if size > 1]
    if others:
        problems.append(f"pp_size={r.pp_size} with {', '.join(others)}: pipeline parallelism composes with tensor "
                        "parallelism (tp_size) and data-parallel copies only (pp x sp/cp is not built: the sequence "
                        "shards' positions and attention exchanges would have to cross the stages, docs/pipeline.md); "
                        "set them to 1")
    if r.objective != "sft":
        problems.append(f"pp_size={r.pp_size} with objective={r.objective}: a preference loss needs both rows of a "
                        "pair and the reference's log-probabilities on the last stage, which hftrain's pipeline does "
                        "not carry; use data parallelism or tensor parallelism")
    if r.pp_microbatches is not None and r.pp_microbatches < 1:
        problems.append(f"pp_microbatches must be >= 1 or unset, got {r.pp_microbatches}")
    elif r.pp_microbatches is not None and r.pp_schedule in V_SCHEDULES and r.pp_microbatches < 2 * r.pp_size:
        problems.append(f"pp_microbatches={r.pp_microbatches} with pp_schedule={r.pp_schedule}: its V of two stages "
                        f"per process needs at least as many microbatches as stages ({2 * r.pp_size}); raise it")
    elif r.pp_microbatches is not None and r.pp_schedule != "GPipe" and r.pp_microbatches < r.pp_size:
        problems.append(f"pp_microbatches={r.pp_microbatches} with pp_schedule={r.pp_schedule}: 1F1B-type schedules "
                        f"need at least as many microbatches as processes in the pipeline ({r.pp_size}); raise it")
    if r.use_liger_kernel or r.loss_chunk_tokens:
        problems.append(f"pp_size={r.pp_size} with use_liger_kernel / loss_chunk_tokens: the last stage computes the "
                        "plain token loss (NeMo's fused loss silently did nothing under pp, NeMo Automodel #2681); "
                        "turn them off")
    if r.torch_compile:
        problems.append(f"pp_size={r.pp_size} with torch_compile is not tested under hftrain's pipeline; turn it off")
    return problems


def _expert_problems(r) -> list[str]:
    """ep_size, from the recipe alone (the launch, the model's expert plan and experts are checked in the preflight:
    parallel.expert.expert_problems)."""
    if r.ep_size <= 1:
        return []
    problems = []
    others = [f"{name}={getattr(r, name)}" for name in ("pp_size", "sp_size", "cp_size")
              if getattr(r, name) > 1]
    if others:
        problems.append(f"ep_size={r.ep_size} with {', '.join(others)}: hftrain runs expert parallelism with data "
                        "and tensor parallelism only (transformers refuses its token dispatch with pipeline stages, "
                        "DistributedConfig._validate_resolved_ep_plan; sequence and context parallelism would split "
                        "the tokens a router balances and are not built with experts here); set them to 1")
    if r.objective != "sft":
        problems.append(f"ep_size={r.ep_size} with objective={r.objective}: expert parallelism is verified for the "
                        "token loss (objective sft) only; a reference model or generation through the dispatched "
                        "experts is not. Use data parallelism")
    return problems
