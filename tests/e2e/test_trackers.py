"""Trackers through accelerate: W&B (offline, read back from its run file), TensorBoard and MLflow, next to
metrics.jsonl."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import TINY_CHAT, Run, launch, run_script
from tests.wandb_records import summary

pytestmark = pytest.mark.launch

LOGGED = ("loss", "learning_rate", "grad_norm", "tokens_per_second", "step_time", "peak_memory_mb", "eval_loss")


def wandb_runs(wandb_dir) -> dict[str, dict]:
    """Offline run folder name -> what its run file holds."""
    return {f.parent.name: summary(f) for f in sorted(wandb_dir.glob("wandb/offline-run-*/run-*.wandb"))}


@dataclass
class Tracked:
    """A run to step 4 and its resumption to step 6 in the same folder, reporting to W&B (offline), TensorBoard and
    MLflow. What the resumption replaces (later metrics rows, checkpoint-2) is kept as the first launch left it."""
    run: Run
    metrics_first: list[dict]  # metrics.jsonl after the first launch
    checkpoints_first: dict[str, dict]  # hftrain_state.json of checkpoint-2 and -4 after the first launch
    resumed: Run
    wandb_dir: Path
    wandb_first: dict  # the W&B run file as the first launch left it
    mlruns: Path
    mlflow_first: list  # MLflow run folders after the first launch
    mlflow_loss_first: dict  # step -> loss in MLflow after the first launch


@pytest.fixture(scope="module")
def tracked(tmp_path_factory) -> Tracked:
    """One pair of launches shared by the W&B and MLflow tests: each tracker receives the same run and resume.
    MLflow is optional (hftrain[mlflow]): without it the pair reports to W&B and TensorBoard only."""
    root = tmp_path_factory.mktemp("tracked")
    wandb_dir, mlruns = root / "wandb", root / "mlruns"
    wandb_dir.mkdir()
    trackers = "wandb,tensorboard,mlflow" if importlib.util.find_spec("mlflow") else "wandb,tensorboard"
    common = [*TINY_CHAT, "--logging_steps", "2", "--save_steps", "2", "--eval_steps", "2",
              "--report_to", trackers, "--run_name", "tracked-run-4711", "--project_name", "hftrain-tests",
              "--wandb_tags", "sweep-a,tiny", "--wandb_group", "exp-7"]
    env = {"WANDB_DIR": str(wandb_dir), "WANDB_MODE": "offline",
           "MLFLOW_TRACKING_URI": mlruns.as_uri(), "MLFLOW_ALLOW_FILE_STORE": "true"}
    run = launch(root / "out", *common, "--max_steps", "4", env=env)
    metrics_first = run.metrics()
    checkpoints_first = {name: run.state(name) for name in ("checkpoint-2", "checkpoint-4")}
    (wandb_first,) = wandb_runs(wandb_dir).values()  # one W&B run, written by the main process only
    mlflow_first = mlflow_runs(mlruns)
    mlflow_loss_first = mlflow_metric(mlflow_first[0], "loss") if mlflow_first else {}
    resumed = launch(root / "out", *common, "--max_steps", "6", "--resume_from_checkpoint", "latest", env=env)
    return Tracked(run, metrics_first, checkpoints_first, resumed, wandb_dir, wandb_first, mlruns, mlflow_first,
                   mlflow_loss_first)


def test_wandb_offline_values_config_and_resume(tracked):
    run, first, checkpoints = tracked.run, tracked.wandb_first, tracked.checkpoints_first
    assert [r["step"] for r in tracked.metrics_first if "loss" in r] == [1, 2, 4]
    assert (first["name"], first["project"], first["group"], first["tags"]) == (
        "tracked-run-4711", "hftrain-tests", "exp-7", ["sweep-a", "tiny"])
    config = first["config"]
    assert config["learning_rate"] == 3e-3 and config["per_device_train_batch_size"] == 16
    assert config["wandb_tags"] == "['sweep-a', 'tiny']" and config["effective_batch_size"] == 16
    assert config["launch/distributed_type"] == "NO" and config["launch/num_processes"] == 1
    assert "'format': 'messages'" in config["data/sources"] and config["data/train_examples"] > 0
    # every value logged to metrics.jsonl is in the W&B history at the same step
    history: dict[int, dict] = {}
    for row in first["history"]:
        history.setdefault(row["_step"], {}).update(row)
    for row in tracked.metrics_first:
        for key in LOGGED:
            if row.get(key) is not None:
                assert history[row["step"]][key] == pytest.approx(row[key], rel=1e-12), (row["step"], key)
    events = list(run.output_dir.rglob("events.out.tfevents.*"))
    assert events and all(e.stat().st_size > 0 for e in events)

    # the checkpoint stores the run id; resuming continues the same W&B run
    assert checkpoints["checkpoint-2"]["wandb_run_id"] == checkpoints["checkpoint-4"]["wandb_run_id"] == first["id"]
    resumed = tracked.resumed
    assert [r["step"] for r in resumed.train_rows()] == [1, 2, 4, 6]
    runs = wandb_runs(tracked.wandb_dir)
    assert len(runs) == 2 and {r["id"] for r in runs.values()} == {first["id"]}
    (second,) = [r for r in runs.values() if r["history"] != first["history"]]
    assert {h["_step"] for h in second["history"]} == {6}  # resumed from checkpoint-4, next log at step 6
    assert second["tags"] == ["sweep-a", "tiny"] and second["group"] == "exp-7"
    assert resumed.state()["wandb_run_id"] == first["id"]


def test_wandb_unreachable_does_not_stop_training(tmp_path):
    """Online mode against a closed port: W&B gives up after its init timeout and the run logs offline."""
    wandb_dir = tmp_path / "wandb"
    wandb_dir.mkdir()
    run = run_script(tmp_path / "out", *TINY_CHAT, "--max_steps", "2", "--logging_steps", "1", "--report_to", "wandb",
                 "--validation_split_percentage", "0",
                 env={"WANDB_DIR": str(wandb_dir), "WANDB_MODE": "online", "WANDB_BASE_URL": "http://127.0.0.1:9",
                      "WANDB_API_KEY": "x" * 40, "WANDB_INIT_TIMEOUT": "5"})
    assert "W&B could not start a run online" in run.stderr
    assert [r["step"] for r in run.train_rows()] == [1, 2]
    (offline,) = wandb_runs(wandb_dir).values()
    assert sorted(h["_step"] for h in offline["history"]) == [1, 2]
    # the API key from the environment is not written into the run
    assert all(b"x" * 40 not in f.read_bytes() for f in wandb_dir.rglob("*") if f.is_file())


def mlflow_metric(run_dir, key: str) -> dict[int, float]:
    """step -> value from an MLflow file-store metric file (lines of `timestamp value step`)."""
    rows = [line.split() for line in (run_dir / "metrics" / key).read_text().splitlines()]
    return {int(step): float(value) for _, value, step in rows}


def mlflow_runs(mlruns) -> list:
    return [p for p in mlruns.glob("*/*") if (p / "metrics").is_dir()]


def test_mlflow_values_and_resume(tracked):
    pytest.importorskip("mlflow", reason="mlflow is an optional tracker (pip install hftrain[mlflow])")
    (run_dir,) = tracked.mlflow_first
    assert tracked.checkpoints_first["checkpoint-2"]["mlflow_run_id"] == run_dir.name
    assert (run_dir / "params" / "learning_rate").read_text() == "0.003"
    assert tracked.mlflow_loss_first == pytest.approx({r["step"]: r["loss"] for r in tracked.metrics_first
                                                       if "loss" in r})
    assert mlflow_runs(tracked.mlruns) == [run_dir]  # the resumed run continued the same MLflow run
    assert sorted(mlflow_metric(run_dir, "loss")) == [1, 2, 4, 6]


def test_a_tracker_that_cannot_start_is_one_paragraph(tmp_path):
    pytest.importorskip("mlflow", reason="mlflow is an optional tracker (pip install hftrain[mlflow])")
    # MLflow 3 refuses its plain file store unless MLFLOW_ALLOW_FILE_STORE is set
    run = launch(tmp_path / "out", *TINY_CHAT, "--max_steps", "2", "--report_to", "mlflow", check=False,
                 env={"MLFLOW_TRACKING_URI": (tmp_path / "mlruns").as_uri(), "MLFLOW_ALLOW_FILE_STORE": "false"})
    assert run.returncode != 0
    message = " ".join(run.stderr[run.stderr.index("hftrain: error:"):].split("\n\n")[0].split())
    assert "a tracker in report_to=['mlflow'] could not start a run" in message and "MLFLOW_ALLOW_FILE_STORE" in message
    assert "Traceback" not in run.stderr[: run.stderr.index("hftrain: error:")]
