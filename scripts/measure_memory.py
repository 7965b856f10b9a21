"""Measure the peak memory of real CPU training runs and compare it with `hftrain.estimate` (fp32, one GPU row).

    python scripts/measure_memory.py [--out docs/memory-estimates.md] [--sizes small,medium,large]

For each model size it builds a random Llama (scripts/make_tiny_model.py), writes long text rows so
every sequence is exactly `seq` tokens after truncation, trains 2 optimizer steps with
`python -m hftrain.finetune` (fp32, AdamW) with and without gradient checkpointing, and reads back
the run's peak RSS (`peak_memory_mb` in metrics.jsonl) and its RSS just before the model was built
(`memory_baseline_mb` in final/hftrain_state.json: Python, torch, the tokenizer and the dataset).
measured = peak - baseline is compared with the estimator's peak for the same shape.
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

from hftrain.estimate import estimate, model_shape  # noqa: E402

# name: (hidden, layers, micro-batch, seq)
SIZES = {
    "small": (256, 4, 8, 256),
    "medium": (512, 8, 8, 256),
    "large": (1024, 8, 4, 512),
    "xl": (1536, 8, 2, 512),
}
# glibc keeps freed tensors in its heap, so RSS would follow the allocator's high-water mark, not live
# memory (~1.5x after a few steps). Serving every allocation above 64 KiB with mmap returns freed
# tensors to the OS at once, which makes peak RSS comparable with the estimate (as max_memory_allocated
# is on a GPU).
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}
MIB = 2**20


def long_text_rows(path: Path, rows: int, seed: int = 0) -> Path:
    words = [json.loads(line)["text"] for line in (REPO / "data" / "text.jsonl").read_text().splitlines()]
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(rows):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(80))}) + "\n")
    return path


def measure(model: Path, data: Path, out: Path, batch: int, seq: int, checkpointing: bool) -> tuple[float, float]:
    """(peak RSS MiB, baseline RSS MiB) of a 2-step run (the second step has the optimizer state)."""
    cmd = [sys.executable, "-m", "hftrain.finetune", "--model_name_or_path", str(model), "--dataset_name", str(data),
           "--output_dir", str(out), "--overwrite_output_dir", "--max_steps", "2", "--logging_steps", "1",
           "--per_device_train_batch_size", str(batch), "--max_length", str(seq), "--validation_split_percentage", "0",
           "--gradient_checkpointing", str(checkpointing).lower(), "--disable_tqdm"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **MALLOC_ENV}
    subprocess.run(cmd, check=True, cwd=REPO, env=env, capture_output=True)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    state = json.loads((out / "final" / "hftrain_state.json").read_text())
    return max(r["peak_memory_mb"] for r in rows if "loss" in r), state["memory_baseline_mb"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default=",".join(SIZES))
    parser.add_argument("--out", type=Path, help="Also write the markdown table here.")
    args = parser.parse_args()
    lines = ["| model | params | batch x seq | checkpointing | baseline MiB | peak MiB | measured = peak - baseline "
             "MiB | estimated MiB | estimate / measured |", "|---|---|---|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = long_text_rows(tmp / "long.jsonl", 64)
        for name in args.sizes.split(","):
            hidden, layers, batch, seq = SIZES[name]
            model = tmp / name
            subprocess.run([sys.executable, str(REPO / "scripts" / "make_tiny_model.py"), str(model),
                            "--hidden_size", str(hidden), "--num_layers", str(layers),
                            "--max_position_embeddings", str(seq)], check=True, capture_output=True)
            shape = model_shape(str(model))
            (row,) = [r for r in estimate(shape, 1, batch, seq, precision="fp32").rows if r.strategy == "single GPU"]
            for ckpt in (False, True):
                peak, baseline = measure(model, data, tmp / f"out-{name}-{ckpt}", batch, seq, ckpt)
                measured, estimated = peak - baseline, row.peak(ckpt) / MIB
                line = (f"| {name} (hidden {hidden}, {layers} layers) | {shape.params / 1e6:.1f}M | {batch} x {seq} | "
                        f"{'yes' if ckpt else 'no'} | {baseline:.0f} | {peak:.0f} | {measured:.0f} | {estimated:.0f} | "
                        f"{estimated / measured:.2f} |")
                lines.append(line)
                print(line, flush=True)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
