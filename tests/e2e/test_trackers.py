"""Trackers through accelerate: W&B in offline mode and TensorBoard, next to metrics.jsonl."""

from __future__ import annotations

import pytest

from tests.conftest import REPO, launch

pytestmark = pytest.mark.launch


def test_wandb_offline_and_tensorboard(tmp_path):
    wandb_dir = tmp_path / "wandb"
    wandb_dir.mkdir()
    run = launch(tmp_path / "out", "--config", str(REPO / "recipes" / "tiny-chat.yaml"), "--max_steps", "4",
                 "--logging_steps", "2", "--report_to", "wandb,tensorboard", "--run_name", "tracked-run-4711",
                 "--project_name", "hftrain-tests", env={"WANDB_DIR": str(wandb_dir), "WANDB_MODE": "offline"})
    assert [r["step"] for r in run.train_rows()] == [1, 2, 4]
    runs = list(wandb_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(runs) == 1, "one W&B run, written by the main process only"
    blob = runs[0].read_bytes()
    assert b"tracked-run-4711" in blob and b"learning_rate" in blob and b"per_device_train_batch_size" in blob
    events = list((tmp_path / "out").rglob("events.out.tfevents.*"))
    assert events and all(e.stat().st_size > 0 for e in events)
