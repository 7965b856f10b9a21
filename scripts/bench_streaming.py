"""Streaming vs map-style: time to the first optimizer step and peak memory, for generated chat sets of growing size.

    python scripts/bench_streaming.py --sizes 10000 100000 [1000000] [--map_up_to 100000] [--out results.json]

For each size it writes N generated chats (2-4 messages, system prompt on some) as one .jsonl file, then runs
`python hftrain/finetune.py` on the tiny model for one step (no eval, no checkpoints) twice: `streaming: false`
(every example tokenized and cached before step 1) and `streaming: true`. Each run gets a fresh HF_HOME, so the
map-style run pays its tokenization (a cold start, what a user's first run costs). Measured per run: seconds from
the process start to the first metrics row (step 1) and the peak resident memory of the process, sampled every
50 ms. It also measures the streamed resume: the time for `RowStream.load_state` + the first row at several
positions of the file (hftrain's .jsonl reader seeks to the saved byte offset; nothing is tokenized again).

    python scripts/bench_streaming.py --resume_only --sizes 10000 100000 1000000

measures only the resume, at the start, 1k, the middle and the end of one file, for the .jsonl file (hftrain's
reader) and for the same chats as one .parquet file (datasets' reader, which re-reads the shard up to the position).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
WORDS = ("alpha beta gamma delta river mountain cloud paper seven green quiet bright number letter answer question "
         "garden music table window").split()


def generate(path: Path, n: int, seed: int = 0) -> None:
    rng = random.Random(seed)

    def sentence(k: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(k)).capitalize() + "."

    with path.open("w", encoding="utf-8") as f:
        for _ in range(n):
            messages = [{"role": "system", "content": sentence(5)}] if rng.random() < 0.3 else []
            for _ in range(rng.randint(1, 2)):
                messages += [{"role": "user", "content": sentence(rng.randint(4, 12))},
                             {"role": "assistant", "content": sentence(rng.randint(6, 20))}]
            f.write(json.dumps({"messages": messages}) + "\n")


def run(data: Path, streaming: bool, work: Path) -> dict:
    out = work / f"out-{'stream' if streaming else 'map'}"
    env = {**os.environ, "HF_HOME": str(work / f"hf-{streaming}"), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, str(REPO / "hftrain" / "finetune.py"), "--model_name_or_path", str(REPO / "models" /
           "tiny-llama"), "--dataset_name", str(data), "--output_dir", str(out), "--max_steps", "1",
           "--eval_strategy", "no", "--validation_split_percentage", "0", "--save_strategy", "no",
           "--checkpoint_preflight", "false", "--report_to", "none", "--disable_tqdm", "true",
           "--per_device_train_batch_size", "16", "--max_length", "256", "--streaming", str(streaming).lower()]
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    watched, peak, first_step = psutil.Process(proc.pid), 0, None
    metrics = out / "metrics.jsonl"
    while proc.poll() is None:
        try:
            peak = max(peak, watched.memory_info().rss)
        except psutil.NoSuchProcess:
            break
        if first_step is None and metrics.exists() and metrics.stat().st_size:
            first_step = time.perf_counter() - started
        time.sleep(0.05)
    if proc.returncode != 0:
        raise SystemExit(f"run failed:\n{proc.stderr.read()[-3000:]}")
    if first_step is None:
        first_step = time.perf_counter() - started
    return {"first_step_s": round(first_step, 1), "peak_rss_mib": round(peak / 2**20)}


def resume_times(open_source, positions: list[int], repeats: int = 3) -> dict:
    """Milliseconds for a streamed run's resume at each position (the least of `repeats`): `RowStream.load_state` with
    the state saved there, plus the first row after it (one tokenize call, a stub here: the position is what is
    measured, not the tokenizer). `open_source()` gives the raw IterableDataset a run would read."""
    from hftrain.data.streaming import RowStream

    def tokenize(example, index):
        return [{"input_ids": [1, 2], "labels": [-100, 2], "dropped": ""}]

    def fresh():
        return RowStream(lambda passes: open_source(), tokenize, shuffle_buffer=1, seed=0, packing=False,
                         max_length=256)

    times = {}
    for position in positions:
        stream = fresh()
        stream.raw = open_source()
        stream.raw_iter = iter(stream.raw)
        for _ in range(position):  # reach the position once (this is what a resume must not repeat)
            next(stream.raw_iter)
        stream.read = position
        state = json.loads(json.dumps(stream.state()))  # as a checkpoint stores it
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            resumed = fresh()
            resumed.load_state(state)
            resumed.next_row()
            best = min(best, time.perf_counter() - started)
        times[position] = round(best * 1000, 1)  # milliseconds
    return times


def resume_row(data: Path, n: int) -> dict:
    """Resume times at the start, 1k, the middle and the end of one file of n chats: the .jsonl file through the
    source a run uses (hftrain's reader: a seek), the same file through datasets' JSON reader (what hftrain used
    before), and the same chats as one .parquet file (datasets' reader)."""
    import datasets

    from hftrain.data.streaming import stream_source

    parquet = to_parquet(data)
    positions = sorted({0, min(1000, n - 1), n // 2, n - 10})
    return {"chats": n, "jsonl_mib": round(data.stat().st_size / 2**20, 1),
            "parquet_mib": round(parquet.stat().st_size / 2**20, 1),
            "jsonl_hftrain_ms": resume_times(stream_source(str(data), None, "train", {}).open, positions),
            "jsonl_datasets_ms": resume_times(lambda: datasets.load_dataset(
                "json", data_files=str(data), split="train", streaming=True), positions),
            "parquet_datasets_ms": resume_times(stream_source(str(parquet), None, "train", {}).open, positions)}


def to_parquet(data: Path) -> Path:
    import datasets

    out = data.with_suffix(".parquet")
    datasets.load_dataset("json", data_files=str(data), split="train").to_parquet(str(out))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--map_up_to", type=int, default=10**9,
                        help="run the map-style contender only up to this many chats (it tokenizes them all first)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--resume_only", action="store_true",
                        help="only the resume times (.jsonl by hftrain and by datasets, .parquet by datasets)")
    args = parser.parse_args()
    results = []
    if args.resume_only:
        with tempfile.TemporaryDirectory() as tmp:
            for n in args.sizes:
                data = Path(tmp) / f"chats{n}.jsonl"
                generate(data, n)
                results.append(resume_row(data, n))
                print(json.dumps(results[-1]), flush=True)
        if args.out:
            args.out.write_text(json.dumps(results, indent=1) + "\n")
        return
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.sizes:
            work = Path(tmp) / str(n)
            work.mkdir()
            data = work / "chats.jsonl"
            generate(data, n)
            row = {"chats": n, "file_mib": round(data.stat().st_size / 2**20, 1),
                   "map": run(data, False, work) if n <= args.map_up_to else None, "stream": run(data, True, work),
                   "stream_resume": resume_row(data, n)}
            print(json.dumps(row), flush=True)
            results.append(row)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
