"""The memory estimate against the measured peak of a real CPU run (fp32, one process, 21.6M-parameter Llama).

Peak RSS includes Python, torch, tokenizer and dataset: the run records its RSS just before the model is
built (`memory_baseline_mb`), and peak - baseline is compared with the estimate. glibc is told to serve
allocations above 64 KiB with mmap, so freed tensors leave RSS at once and the peak follows live memory
(docs/memory-estimates.md has the full table and the reasoning).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hftrain.estimate import estimate, model_shape
from tests.conftest import REPO, build_tiny_model

pytestmark = pytest.mark.launch


@pytest.mark.parametrize("checkpointing", [False, True])
def test_estimate_within_25_percent_of_measured_peak(tmp_path, checkpointing):
    model = build_tiny_model(tmp_path / "model", "--hidden_size", "512", "--num_layers", "8",
                             "--max_position_embeddings", "256")
    words = [json.loads(line)["text"] for line in (REPO / "data" / "text.jsonl").read_text().splitlines()]
    data = tmp_path / "long.jsonl"  # every row is longer than 256 tokens: batches are exactly 8 x 256
    data.write_text("".join(json.dumps({"text": " ".join(words[i:i + 80])}) + "\n" for i in range(0, 32 * 10, 10)))
    out = tmp_path / "out"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
    proc = subprocess.run([sys.executable, "-m", "hftrain.finetune", "--model_name_or_path", str(model),
                           "--dataset_name", str(data), "--output_dir", str(out), "--max_steps", "2",
                           "--logging_steps", "1", "--per_device_train_batch_size", "8", "--max_length", "256",
                           "--validation_split_percentage", "0", "--gradient_checkpointing", str(checkpointing),
                           "--disable_tqdm"], capture_output=True, text=True, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(r["total_tokens_per_second"] * r["step_time"] == pytest.approx(8 * 256) for r in rows)  # 8 x 256
    measured = max(r["peak_memory_mb"] for r in rows) - json.loads(
        (out / "final" / "hftrain_state.json").read_text())["memory_baseline_mb"]
    (row,) = [r for r in estimate(model_shape(str(model)), 1, 8, 256, precision="fp32").rows
              if r.strategy == "single GPU"]
    estimated = row.peak(checkpointing) / 2**20
    assert 0.75 * measured <= estimated <= 1.25 * measured, (estimated, measured)
