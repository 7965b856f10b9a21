"""`hftrain estimate` (python -m hftrain.estimate): its arguments, their checks, and the printed plan."""

from __future__ import annotations

import argparse

from hftrain.config import PRESET_DIR
from hftrain.errors import ConfigError, run_tool
from hftrain.estimate.budget import CUDA_OVERHEAD_GIB, usable_bytes
from hftrain.estimate.layouts import DEFAULT_GLOBAL_BATCH, format_layouts, layout_problems
from hftrain.estimate.pipeline import format_pipeline
from hftrain.estimate.shape import model_shape
from hftrain.estimate.strategies import Plan, estimate, recommend, sequence_parallel_hint, token_budget_line
from hftrain.fields.fp8 import FP8_RECIPES
from hftrain.fields.qat import QAT_SCHEMES
from hftrain.memory import GIB
from hftrain.options import Parser, add_switch
from hftrain.stages import STAGES_PER_PROCESS


def format_plan(plan: Plan, gpu_memory_gib: float, method: str, planned_tokens: int | None = None) -> str:
    s = plan.shape
    active = (f", {s.active_params / 1e9:.3f}B active per token (memory holds all, compute uses these)"
              if s.active_params else "")
    lines = [
        f"{s.name}: {s.architecture}, {s.params / 1e9:.3f}B parameters{active} ({s.layers} layers, hidden {s.hidden}, "
        f"vocab {s.vocab}); {plan.gpus} GPU(s) x {gpu_memory_gib:g} GiB; micro-batch {plan.batch} x {plan.seq} "
        f"tokens per GPU; {'bf16 mixed precision' if plan.precision == 'bf16' else 'fp32'}, "
        f"{'Muon + AdamW' if plan.optim == 'muon' else 'AdamW'}"
        + (f"; qat_scheme {plan.qat[0]} (groups of {plan.qat[1]})" if plan.qat else "")
        + (f"; fp8 {plan.fp8} ({s.float8_params / 1e9:.3f}B weights in float8 linear layers)" if plan.fp8 else "")
        + ".",
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
    hint = sequence_parallel_hint(plan, gpu_memory_gib) if method == "full" and not (plan.qat or plan.fp8) else None
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
    parser.add_argument("--qat_scheme", choices=QAT_SCHEMES, default=None,
                        help="Quantization-aware training (recipe qat_scheme): adds what torchao's fake quantization "
                        "saves for backward (full fine-tuning: the fake-quantized weights' intermediates, ~4 bytes "
                        "per weight in bf16; int8 activations: each linear layer's quantized input); one GPU or DDP, "
                        "full fine-tuning or --lora.")
    parser.add_argument("--qat_group_size", type=int, default=32, help="--qat_scheme: weights per int4 scale.")
    parser.add_argument("--fp8", choices=FP8_RECIPES, default=None,
                        help="FP8 training with this torchao recipe (recipe fp8: true, fp8_recipe): the float8 layers "
                        "hftrain.fp8 chooses keep no bf16 autocast copy of their weights; one GPU, DDP or FSDP2, "
                        "full fine-tuning (needs torchao to choose the layers).")
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
        problems.append("--optim muon runs on one GPU or under DDP (hftrain refuses it with layouts that split the "
                        "weight matrices), and the estimate counts its full fine-tuning only (Muon on LoRA's factors "
                        "is not estimated); drop --lora/--qlora, --nodes, --sp, --ep, --pp and --tp")
    split = cluster or args.sp > 1 or args.ep > 1 or args.pp > 1 or args.tp > 1
    if args.qat_scheme and (args.sp > 1 or args.ep > 1 or args.pp > 1 or args.tp > 1):
        problems.append("--qat_scheme runs under data-parallel layouts only (hftrain refuses it with layouts that "
                        "split the layers); drop --sp, --ep, --pp and --tp")
    if args.qat_scheme and args.qlora:
        problems.append("--qat_scheme with --qlora is refused (the base would be rounded by bitsandbytes before the "
                        "fake quantization); use --lora")
    if args.qat_scheme and (args.qat_group_size < 1 or args.qat_group_size & (args.qat_group_size - 1)):
        problems.append(f"--qat_group_size must be a power of two >= 1, got {args.qat_group_size}")
    if args.fp8 and (args.lora or args.qlora or split):
        problems.append("--fp8 trains full fine-tuning on one GPU, under DDP or FSDP2 (hftrain refuses it with LoRA "
                        "and with split layouts); drop --lora/--qlora, --nodes, --sp, --ep, --pp and --tp")
    if args.fp8 and args.qat_scheme:
        problems.append("--fp8 and --qat_scheme both replace the linear layers (hftrain refuses the pair); choose one")
    if args.precompute_ref_log_probs and args.objective not in ("dpo", "kto"):
        problems.append(f"--precompute_ref_log_probs precomputes dpo's or kto's reference, but --objective is "
                        f"{args.objective}")
    if problems:
        raise ConfigError(problems, "estimate arguments")
    shape = model_shape(args.model, args.trust_remote_code, reward=args.objective == "reward", fp8_recipe=args.fp8)
    teacher = model_shape(args.teacher, args.trust_remote_code) if args.teacher else None
    problems = layout_problems(shape, args.tp, args.pp, args.pp_schedule)
    if args.ep > 1 and (shape.experts is None or shape.experts % args.ep):
        problems.append(f"--ep {args.ep}: {shape.name} ({shape.model_type}) is not a mixture-of-experts model"
                        if shape.experts is None else
                        f"--ep {args.ep} must divide the model's {shape.experts} experts per layer")
    if problems:
        raise ConfigError(problems, "estimate arguments")
    plan = estimate(shape, args.gpus, args.batch, args.seq, args.precision, args.lora_r, args.objective, args.sp,
                    args.ep, teacher, args.precompute_ref_log_probs, args.optim,
                    (args.qat_scheme, args.qat_group_size) if args.qat_scheme else None, args.fp8)
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

