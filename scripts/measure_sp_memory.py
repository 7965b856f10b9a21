"""Measure peak memory per rank of sequence-parallel CPU runs (sp_size 1 and 2) against max_length.

    python scripts/measure_sp_memory.py [--lengths 4096,8192,16384] [--out docs/long-context-memory.json]
    python scripts/measure_sp_memory.py --cp [--out docs/long-context-memory-cp.json]

With --cp the same for context parallelism (ring attention, cp_size 1 and 2) under FSDP2, through the CPU test
launchers (tests/launchers/: FSDP2 forced on CPU, and torch's ring registered for the CPU flash kernel).

Builds a random Llama with long positions (scripts/make_tiny_model.py), writes text rows just longer than
max_length (each sequence is exactly max_length tokens after truncation), and trains 2 optimizer steps of one
sequence per step through the cpu_sp preset (DeepSpeed ZeRO-2, gloo): 1 process with sp_size 1, and 2 processes
with sp_size 2. Reads back each rank's peak RSS (`rank<i>/peak_memory_mb` in metrics.jsonl) and the RSS just before
the model was built (`memory_baseline_mb`). Prints a markdown table (docs/long-context.md) and writes the numbers
as JSON. Both layouts run under DeepSpeed so that the libraries' own memory is the same on both sides.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from scripts.measure_memory import MALLOC_ENV  # noqa: E402

MODEL = {"--hidden_size": "64", "--num_layers": "2", "--num_heads": "4", "--max_position_embeddings": "16384"}


def long_rows(path: Path, rows: int, words: int, seed: int = 0) -> Path:
    vocabulary = [json.loads(line)["text"] for line in (REPO / "data" / "text.jsonl").read_text().splitlines()]
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(rows):
            f.write(json.dumps({"text": " ".join(rng.choice(vocabulary) for _ in range(words))}) + "\n")
    return path


def launch_of(sp: int, ring: bool) -> tuple[str, Path, list[str]]:
    """(preset, entry script, degree flag) of a run split over `sp` processes: Ulysses, or the ring under FSDP2."""
    if not ring:
        return "cpu_sp", REPO / "hftrain" / "finetune.py", ["--sp_size", str(sp)]
    if sp == 1:
        return "fsdp2", REPO / "tests" / "launchers" / "fsdp2_on_cpu.py", []
    return "fsdp2_cp", REPO / "tests" / "launchers" / "context_parallel_on_cpu.py", ["--cp_size", str(sp)]


def run(model: Path, data: Path, out: Path, seq: int, sp: int, ring: bool = False) -> dict:
    """Peak RSS per rank and baseline (MiB) of 2 steps of one `seq`-token sequence, split over `sp` processes."""
    preset, script, degree = launch_of(sp, ring)
    cmd = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file",
           str(REPO / "accelerate_configs" / f"{preset}.yaml"), "--num_processes", str(sp), "--main_process_port", "0",
           str(script), "--model_name_or_path", str(model), "--dataset_name", str(data),
           "--output_dir", str(out), "--overwrite_output_dir", "--max_steps", "2", "--logging_steps", "1",
           "--per_device_train_batch_size", "1", "--max_length", str(seq), "--validation_split_percentage", "0",
           *degree, "--save_strategy", "no", "--disable_tqdm", "--attn_implementation", "sdpa"]
    # one thread per process on both sides (accelerate sets it for 2+ processes only): per-thread buffers and malloc
    # arenas would otherwise add to the 1-process run alone
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
           **MALLOC_ENV}
    subprocess.run(cmd, check=True, cwd=REPO, env=env, capture_output=True)
    last = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
    state = json.loads((out / "final" / "hftrain_state.json").read_text())
    peaks = [last[f"rank{i}/peak_memory_mb"] for i in range(sp)]
    return {"sp_size": sp, "max_length": seq, "tokens_per_rank": seq // sp, "peak_rss_mb_per_rank": peaks,
            "baseline_mb": state["memory_baseline_mb"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="4096,8192,16384")
    parser.add_argument("--cp", action="store_true", help="context parallelism (ring attention, FSDP2) instead")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    args.out = args.out or REPO / "docs" / f"long-context-memory{'-cp' if args.cp else ''}.json"
    name = "cp" if args.cp else "sp"
    lengths = [int(x) for x in args.lengths.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = tmp / "model"
        subprocess.run([sys.executable, str(REPO / "scripts" / "make_tiny_model.py"), str(model),
                        *[x for kv in MODEL.items() for x in kv]], check=True, capture_output=True)
        results = []
        for seq in lengths:  # rows just long enough (a word is 1+ tokens): tokenizing far longer rows would set the
            # process's peak RSS before training starts
            data = long_rows(tmp / f"long-{seq}.jsonl", rows=4, words=seq)
            results += [run(model, data, tmp / f"sp{sp}-{seq}", seq, sp, args.cp) for sp in (1, 2)]
    args.out.write_text(json.dumps({"model": MODEL, "results": results}, indent=1) + "\n")
    by = {(r["sp_size"], r["max_length"]): r for r in results}
    print(f"| max_length | {name} 1: peak RSS (above baseline) | {name} 2: peak RSS per rank (above baseline) | "
          f"{name} 2 at this length / {name} 1 at half of it: peak (above baseline) |")
    print("| --- | --- | --- | --- |")
    above = {key: max(r["peak_rss_mb_per_rank"]) - r["baseline_mb"] for key, r in by.items()}
    for seq in lengths:
        one, two = by[(1, seq)], by[(2, seq)]
        half = by.get((1, seq // 2))
        ratio = (f"{max(two['peak_rss_mb_per_rank']) / half['peak_rss_mb_per_rank'][0]:.2f} "
                 f"({above[(2, seq)] / above[(1, seq // 2)]:.2f})" if half else "-")
        print(f"| {seq:,} | {one['peak_rss_mb_per_rank'][0]:,.0f} MiB ({above[(1, seq)]:,.0f}) | "
              f"{' / '.join(f'{p:,.0f}' for p in two['peak_rss_mb_per_rank'])} MiB ({above[(2, seq)]:,.0f}) "
              f"| {ratio} |")


if __name__ == "__main__":
    main()
