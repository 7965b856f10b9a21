"""Expert parallelism on CPU: tokens/s per process at ep 2 against one process (and 2-process DDP), the share of step
time spent in the all-to-all, and `hftrain estimate --ep`'s memory per device against the measured peak.

    python scripts/bench_ep.py [--hidden 256 --layers 4 --experts 8 --rows 8 --length 256 --steps 8 --reps 1]
    python scripts/bench_ep.py --write-docs     # also replace the marked section of docs/benchmarks.md

What runs: a random Qwen3-MoE built by scripts/make_tiny_model.py (`--experts` experts per layer, 2 per token,
expert width hidden / 2, tiny-llama's 753-token tokenizer), full fine-tuning in fp32 with AdamW on text rows of
exactly `--length` tokens (scripts/measure_memory.py's), the same global batch of `--rows` rows in every layout, each
run a fresh `accelerate launch` of hftrain/finetune.py:
- `one`: 1 process (preset cpu) with every core's thread;
- `ddp`: 2 processes (cpu_ddp), the experts replicated, rows / 2 each;
- `ep2`: the same 2 processes with `--ep_size 2`: each holds half of every layer's experts (transformers' all-to-all
  token dispatch), the dense weights FSDP2-sharded by transformers.
Threads: the machine's cores split over the processes (`--num_cpu_threads_per_process`), so every layout has the
whole machine; `--threads N` gives every process N instead.

What is measured, from the run's own files:
- tokens/s: trained tokens (`trained_tokens` of metrics.jsonl, the same in every layout) over the summed `step_time`
  of steps 3 .. steps - 2 (the first two warm up, the last two are profiled); per process = that / processes;
  against one process: each run's per process over the one-process run of its own repetition (`--reps`
  alternates the layouts), the median of those ratios;
- all-to-all share: the last 2 steps run under hftrain's profiler (`profile_steps`, one Chrome trace per rank); the
  share is the wall time during which an all-to-all ran in gloo (the union of the trace's `gloo:all_to_all` events,
  which span from the collective's start to its end, waiting for the peer included) over the traced steps' wall
  time (`ProfilerStep#` events), per rank, then averaged; the other collectives (FSDP2's all-gather / reduce-scatter,
  all-reduce) likewise. The profiler (shapes and memory recorded) slows the traced steps; the share is within them;
- expert load: in the same traces, the (token, expert) rows each MoE layer's dispatch brought each rank (the receive
  size of the all-to-all that follows each exchange of the split sizes, from the recorded shapes); summed over the
  traced layer calls, the busier rank's rows over an even split. Every layer's results come back in one all-to-all
  that waits for both ranks, so at 1.50 the slower rank runs 1.5x the expert work it would under balanced routing,
  and the other waits for it (the random model's router, unlike a trained one, is far from balanced);
- memory: peak RSS of the largest process (`peak_memory_mb` of metrics.jsonl, at the last step before profiling)
  minus its RSS before the model was built (`memory_baseline_mb`), with glibc returning freed tensors at once (as
  scripts/measure_memory.py does), against the estimate's peak for the layout: `hftrain estimate --precision fp32`'s
  single-GPU row, its DDP row (--gpus 2) and its expert-parallel row (--gpus 2 --ep 2), at each process's rows.

A benchmark, not a test: on a shared CPU machine the numbers move with the load (printed beside them).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from measure_memory import MALLOC_ENV, MIB, long_text_rows  # noqa: E402

from hftrain.estimate import estimate, model_shape  # noqa: E402

BEGIN, END = "<!-- ep bench: begin (written by scripts/bench_ep.py) -->", "<!-- ep bench: end -->"
# name: (processes, extra arguments, the estimate's row)
LAYOUTS = {
    "one": (1, [], "single GPU"),
    "ddp": (2, [], "DDP"),
    "ep2": (2, ["--ep_size", "2"], "FSDP full shard + expert parallel ep=2"),
}
PROFILED = 2  # the last steps, traced


def union(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by `intervals` (overlaps counted once)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def trace_shares(trace: Path) -> tuple[float, float]:
    """(all-to-all share, other collectives' share) of the traced steps' wall time in one rank's Chrome trace."""
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    steps = [(e["ts"], e["ts"] + e["dur"]) for e in events if e["name"].startswith("ProfilerStep#")]

    def covered(names) -> float:
        spans = [(e["ts"], e["ts"] + e["dur"]) for e in events if e["name"] in names]
        return union([(max(a, s), min(b, t)) for a, b in spans for s, t in steps if min(b, t) > max(a, s)])

    wall = sum(t - s for s, t in steps)
    return (covered({"gloo:all_to_all"}) / wall,
            covered({"gloo:all_gather", "gloo:reduce_scatter", "gloo:all_reduce", "gloo:allreduce"}) / wall)


def dispatched_rows(trace: Path, experts: int, ep: int) -> list[int]:
    """The rows each MoE layer's forward dispatch brought this rank, in order: in transformers' `AllToAllEP` the
    exchange of the split sizes (an all-to-all of an [ep, experts / ep] tensor) precedes the one of the tokens, whose
    first input is the received rows, [rows, hidden] (the recorded `Input Dims` of gloo's `c10d::alltoall_base_`)."""
    calls = sorted((e for e in json.loads(trace.read_text())["traceEvents"]
                    if e.get("ph") == "X" and e["name"] == "c10d::alltoall_base_"), key=lambda e: e["ts"])
    dims = [e.get("args", {}).get("Input Dims") or [[]] for e in calls]
    sizes = [ep, experts // ep]
    return [after[0][0] for before, after in zip(dims, dims[1:]) if before[:2] == [sizes, sizes]]


def expert_load(traces: list[Path], experts: int) -> float | None:
    """The busier rank's dispatched rows over an even split, summed over the traced layer calls (None: no exchange)."""
    per_rank = [dispatched_rows(t, experts, len(traces)) for t in traces]
    if not per_rank or not per_rank[0] or len({len(r) for r in per_rank}) != 1:
        return None
    busiest = sum(max(rows) for rows in zip(*per_rank))
    return busiest / (sum(map(sum, per_rank)) / len(per_rank))


def run(name: str, model: Path, data: Path, out: Path, args) -> dict:
    processes, extra, _ = LAYOUTS[name]
    threads = args.threads or max(1, (os.cpu_count() or 1) // processes)
    preset = "cpu" if processes == 1 else "cpu_ddp"
    cmd = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file",
           str(REPO / "accelerate_configs" / f"{preset}.yaml"), "--num_processes", str(processes),
           "--num_cpu_threads_per_process", str(threads), "--main_process_port", "0",
           str(REPO / "hftrain" / "finetune.py"), "--model_name_or_path", str(model), "--dataset_name", str(data),
           "--output_dir", str(out), "--overwrite_output_dir", "--max_steps", str(args.steps), "--logging_steps", "1",
           "--per_device_train_batch_size", str(args.rows // processes), "--max_length", str(args.length),
           "--validation_split_percentage", "0", "--save_strategy", "no", "--report_to", "none", "--disable_tqdm",
           "--learning_rate", "1e-3", "--profile_steps", str(PROFILED),
           "--profile_start_step", str(args.steps - PROFILED + 1), *extra]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false",
           **MALLOC_ENV}
    env.pop("OMP_NUM_THREADS", None)  # --num_cpu_threads_per_process sets it per process
    load = os.getloadavg()[0]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = {r["step"]: r for r in rows if "loss" in r}
    timed = range(3, args.steps - PROFILED + 1)
    tokens = rows[timed[-1]]["trained_tokens"] - rows[timed[0] - 1]["trained_tokens"]
    seconds = sum(rows[s]["step_time"] for s in timed)
    baseline = json.loads((out / "final" / "hftrain_state.json").read_text())["memory_baseline_mb"]
    last = rows[timed[-1]]
    peak = max([last["peak_memory_mb"], *(v for k, v in last.items() if k.endswith("/peak_memory_mb"))])
    traces = sorted((out / "profile").glob("rank*.pt.trace.json"))
    shares = [trace_shares(t) for t in traces]
    return {"layout": name, "processes": processes, "threads": threads, "tokens": tokens, "seconds": seconds,
            "tokens_per_second": tokens / seconds, "per_process": tokens / seconds / processes,
            "peak_mb": peak, "baseline_mb": baseline, "measured_mb": peak - baseline,
            "all_to_all": statistics.mean(a for a, _ in shares),
            "other_collectives": statistics.mean(o for _, o in shares),
            "expert_load": expert_load(traces, args.experts) if name == "ep2" else None,
            "load_before": load, "load_after": os.getloadavg()[0]}


def estimated_mb(model: Path, name: str, args) -> float:
    processes, extra, strategy = LAYOUTS[name]
    plan = estimate(model_shape(str(model)), processes, args.rows // processes, args.length, precision="fp32",
                    ep=2 if extra else 1)
    (row,) = [r for r in plan.rows if r.strategy == strategy]
    return row.peak(False) / MIB


def table(runs: list[dict], estimates: dict[str, float], layouts: list[str]) -> list[str]:
    lines = ["| layout | processes x threads | tokens/s (all) | tokens/s per process | vs one process (per process) | "
             "all-to-all share of the step | expert rows, busier rank / even split | other collectives | "
             "measured peak - baseline (MiB, largest process) | estimate (MiB) | estimate / measured | "
             "load average (before / after) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    median = {}
    for name in layouts:
        mine = [r for r in runs if r["layout"] == name]
        median[name] = {k: statistics.median(r[k] for r in mine) for k in
                        ("tokens_per_second", "per_process", "all_to_all", "other_collectives", "measured_mb")}
        # each run against the one-process run of its own repetition (the load moves between repetitions)
        median[name]["versus"] = statistics.median(r["per_process"] / one["per_process"] for r, one in
                                                   zip(mine, [r for r in runs if r["layout"] == "one"], strict=True))
        loads = [r["expert_load"] for r in mine if r.get("expert_load") is not None]
        median[name]["expert_load"] = f"{statistics.median(loads):.2f}" if loads else "-"
        median[name]["threads"] = mine[0]["threads"]
        median[name]["loads"] = ", ".join(f"{r['load_before']:.1f} / {r['load_after']:.1f}" for r in mine)
    for name, m in median.items():
        shares = ("-", "-") if name == "one" else (f"{m['all_to_all']:.1%}", f"{m['other_collectives']:.1%}")
        lines.append(f"| {name} | {LAYOUTS[name][0]} x {m['threads']} | {m['tokens_per_second']:,.0f} | "
                     f"{m['per_process']:,.0f} | {m['versus']:.2f}x | {shares[0]} | {m['expert_load']} | {shares[1]} | "
                     f"{m['measured_mb']:,.0f} | "
                     f"{estimates[name]:,.0f} | {estimates[name] / m['measured_mb']:.2f} | {m['loads']} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--rows", type=int, default=8, help="rows per optimizer step (all processes together)")
    parser.add_argument("--length", type=int, default=256, help="tokens per row")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per run (>= 5: 2 warm-up, 2 profiled)")
    parser.add_argument("--reps", type=int, default=1, help="runs of each layout, alternating")
    parser.add_argument("--threads", type=int, default=0,
                        help="threads per process; 0: the machine's cores split over the processes")
    parser.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--write-docs", action="store_true", help="replace the marked section of docs/benchmarks.md")
    args = parser.parse_args()
    if args.steps < 5 or args.rows % 2 or "one" not in args.layouts:
        raise SystemExit("--steps must be >= 5, --rows even, and the layouts must include 'one' (the reference)")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = tmp / "moe"
        subprocess.run([sys.executable, str(REPO / "scripts" / "make_tiny_model.py"), str(model), "--arch",
                        "qwen3_moe", "--tokenizer", str(REPO / "models" / "tiny-llama"), "--hidden_size",
                        str(args.hidden), "--num_layers", str(args.layers), "--num_experts", str(args.experts),
                        "--max_position_embeddings", str(args.length)], check=True, capture_output=True)
        data = long_text_rows(tmp / "long.jsonl", args.rows * args.steps)
        runs = []
        for rep in range(args.reps):
            for name in args.layouts:
                runs.append(run(name, model, data, tmp / f"{name}-{rep}", args))
                print(json.dumps(runs[-1]), flush=True)
        shape = model_shape(str(model))
        estimates = {name: estimated_mb(model, name, args) for name in args.layouts}
    import accelerate
    import torch
    import transformers

    command = (f"python scripts/bench_ep.py --hidden {args.hidden} --layers {args.layers} --experts {args.experts} "
               f"--rows {args.rows} --length {args.length} --steps {args.steps} --reps {args.reps}"
               + (f" --threads {args.threads}" if args.threads else ""))
    environment = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores shared with other "
                   f"sessions; torch {torch.__version__}, transformers {transformers.__version__}, accelerate "
                   f"{accelerate.__version__}")
    head = (f"`{command}` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {environment}): Qwen3-MoE "
            f"{shape.params / 1e6:.1f}M parameters ({shape.layers} layers x hidden {shape.hidden}, {shape.experts} "
            f"experts of {shape.layer_expert_params // shape.experts / 1e3:.0f}K parameters per layer, 2 per token), "
            f"fp32, {args.rows} rows x {args.length} tokens per step, steps 3-{args.steps - PROFILED} timed, "
            f"medians of {args.reps} run(s) per layout:")
    lines = table(runs, estimates, args.layouts)
    print("\n".join([head, "", *lines]))
    if args.write_docs:
        page = (REPO / "docs" / "benchmarks.md").read_text()
        before, _, rest = page.partition(BEGIN)
        _, _, after = rest.partition(END)
        (REPO / "docs" / "benchmarks.md").write_text(before + "\n".join([BEGIN, head, "", *lines, END]) + after)


if __name__ == "__main__":
    main()
