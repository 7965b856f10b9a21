"""The exactness checks each objective's end-to-end tests make (tests/e2e/test_orpo.py, test_kto.py, test_reward.py,
test_distill.py, test_preference.py): its scripts/compare_trl_*.py run gives TRL's steps; against its one-process
run, the same optimizer step split into micro-batches or processes, or sharded, gives the same per-step values and
final weights, and a run resumed from checkpoint-2 continues exactly."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import REPO, Run, launch, launch_env, run_script


def compare_with_trl(tmp_path: Path, script: str, *args: str) -> dict:
    """scripts/`script` (TRL's trainer and hftrain on the same rows) run with `args`: the results it wrote (--json)."""
    results = tmp_path / "results.json"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / script), "--out", str(tmp_path), "--json",
                           str(results), *args], capture_output=True, text=True, cwd=REPO, env=launch_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(results.read_text())


def assert_steps_match_trl(name: str, theirs: list[dict], ours: list[dict], keys: Iterable[str] | None = None,
                           steps: int = 3) -> None:
    """`steps` steps each, and every step's values of `keys` (default: all hftrain's) within 1e-4 of TRL's."""
    assert len(theirs) == len(ours) == steps, name
    for step, (a, b) in enumerate(zip(theirs, ours), 1):
        for key in b if keys is None else keys:
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (name, step, key)


def assert_same_steps(run: Run, expected: Run, keys: Iterable[str], weights: str = "model.safetensors") -> None:
    """Per-step values of `keys` (rtol 1e-4) and the final `weights` file (the model, or the adapter) of `expected`
    (rtol 1e-4, atol 1e-5)."""
    for key in keys:
        torch.testing.assert_close(torch.tensor([float(r[key]) for r in run.train_rows()]),
                                   torch.tensor([float(r[key]) for r in expected.train_rows()]), rtol=1e-4,
                                   atol=1e-6, msg=key)
    reference = load_file(expected.output_dir / "final" / weights)
    for key, value in load_file(run.output_dir / "final" / weights).items():
        torch.testing.assert_close(value, reference[key], rtol=1e-4, atol=1e-5, msg=key)


def assert_same_over_micro_batches_and_processes(tmp_path: Path, expected: Run, args: Iterable[str],
                                                 keys: Iterable[str], rows: int) -> None:
    """`expected` trained `rows` rows a step as one micro-batch on one process; the same steps in micro-batches of 2
    on one process (rows / 2 of them) and on 2 DDP processes (rows / 4 each) give its values of `keys` and its final
    weights (assert_same_steps)."""
    args, keys = tuple(args), tuple(keys)
    accum = run_script(tmp_path / "accum", *args, "--per_device_train_batch_size", "2",
                       "--gradient_accumulation_steps", str(rows // 2))
    ddp = launch(tmp_path / "ddp", *args, "--per_device_train_batch_size", "2", "--gradient_accumulation_steps",
                 str(rows // 4), preset="cpu_ddp")
    assert ddp.state()["launch"]["model_wrapper"] == "DistributedDataParallel"
    for run in (accum, ddp):
        assert_same_steps(run, expected, keys)


def assert_resumes_exactly(tmp_path: Path, expected: Run, args: Iterable[str], keys: Iterable[str],
                           weights_atol: float = 1e-7, weights: str = "model.safetensors") -> Run:
    """`expected` (3 steps, a checkpoint at step 2) resumed from checkpoint-2 by one process with `args`: step 3's
    values of `keys` (rtol 1e-5) and the final `weights` file (the model, or the adapter; rtol 1e-5, atol
    `weights_atol`) equal the uninterrupted run's. Returns the resumed run, for what a caller checks beside."""
    out = tmp_path / "out"
    shutil.copytree(expected.output_dir, out)
    shutil.rmtree(out / "final")
    resumed = run_script(out, *args, "--resume_from_checkpoint", "latest")
    (row,) = [r for r in resumed.train_rows() if r["step"] == 3]
    reference = expected.train_rows()[2]
    for key in keys:
        assert row[key] == pytest.approx(reference[key], rel=1e-5, abs=1e-7), key
    reference = load_file(expected.output_dir / "final" / weights)
    for key, value in load_file(out / "final" / weights).items():
        torch.testing.assert_close(value, reference[key], rtol=1e-5, atol=weights_atol, msg=key)
    return resumed
