"""Trackers through accelerate: W&B (offline, read back from its run file) and TensorBoard, next to metrics.jsonl."""

from __future__ import annotations

import pytest

from tests.conftest import REPO, launch
from tests.wandb_records import summary

pytestmark = pytest.mark.launch

DEFAULT = ["--config", str(REPO / "recipes" / "tiny-chat.yaml")]
LOGGED = ("loss", "learning_rate", "grad_norm", "tokens_per_second", "step_time", "peak_memory_mb", "eval_loss")


def wandb_runs(wandb_dir) -> dict[str, dict]:
    """Offline run folder name -> what its run file holds."""
    return {f.parent.name: summary(f) for f in sorted(wandb_dir.glob("wandb/offline-run-*/run-*.wandb"))}


def test_wandb_offline_values_config_and_resume(tmp_path):
    wandb_dir = tmp_path / "wandb"
    wandb_dir.mkdir()
    common = [*DEFAULT, "--logging_steps", "2", "--save_steps", "2", "--eval_steps", "2",
              "--report_to", "wandb,tensorboard", "--run_name", "tracked-run-4711", "--project_name", "hftrain-tests",
              "--wandb_tags", "sweep-a,tiny", "--wandb_group", "exp-7"]
    env = {"WANDB_DIR": str(wandb_dir), "WANDB_MODE": "offline"}
    run = launch(tmp_path / "out", *common, "--max_steps", "4", env=env)
    assert [r["step"] for r in run.train_rows()] == [1, 2, 4]

    (first,) = wandb_runs(wandb_dir).values()  # one W&B run, written by the main process only
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
    for row in run.metrics():
        for key in LOGGED:
            if row.get(key) is not None:
                assert history[row["step"]][key] == pytest.approx(row[key], rel=1e-12), (row["step"], key)
    events = list((tmp_path / "out").rglob("events.out.tfevents.*"))
    assert events and all(e.stat().st_size > 0 for e in events)

    # the checkpoint stores the run id; resuming continues the same W&B run
    assert run.state("checkpoint-2")["wandb_run_id"] == run.state("checkpoint-4")["wandb_run_id"] == first["id"]
    resumed = launch(tmp_path / "out", *common, "--max_steps", "6", "--resume_from_checkpoint", "latest", env=env)
    assert [r["step"] for r in resumed.train_rows()] == [1, 2, 4, 6]
    runs = wandb_runs(wandb_dir)
    assert len(runs) == 2 and {r["id"] for r in runs.values()} == {first["id"]}
    (second,) = [r for r in runs.values() if r["history"] != first["history"]]
    assert {h["_step"] for h in second["history"]} == {6}  # resumed from checkpoint-4, next log at step 6
    assert second["tags"] == ["sweep-a", "tiny"] and second["group"] == "exp-7"
    assert resumed.state()["wandb_run_id"] == first["id"]


def test_wandb_unreachable_does_not_stop_training(tmp_path):
    """Online mode against a closed port: W&B gives up after its init timeout and the run logs offline."""
    wandb_dir = tmp_path / "wandb"
    wandb_dir.mkdir()
    run = launch(tmp_path / "out", *DEFAULT, "--max_steps", "2", "--logging_steps", "1", "--report_to", "wandb",
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


def test_mlflow_values_and_resume(tmp_path):
    pytest.importorskip("mlflow", reason="mlflow is an optional tracker (pip install hftrain[mlflow])")
    env = {"MLFLOW_TRACKING_URI": (tmp_path / "mlruns").as_uri(), "MLFLOW_ALLOW_FILE_STORE": "true"}
    common = [*DEFAULT, "--logging_steps", "2", "--save_steps", "2", "--report_to", "mlflow",
              "--validation_split_percentage", "0", "--disable_tqdm"]
    run = launch(tmp_path / "out", *common, "--max_steps", "4", env=env)
    (run_dir,) = [p for p in (tmp_path / "mlruns").glob("*/*") if (p / "metrics").is_dir()]
    assert run.state("checkpoint-2")["mlflow_run_id"] == run_dir.name
    assert (run_dir / "params" / "learning_rate").read_text() == "0.003"
    assert mlflow_metric(run_dir, "loss") == pytest.approx({r["step"]: r["loss"] for r in run.train_rows()})
    launch(tmp_path / "out", *common, "--max_steps", "6", "--resume_from_checkpoint", "latest", env=env)
    runs = [p for p in (tmp_path / "mlruns").glob("*/*") if (p / "metrics").is_dir()]
    assert runs == [run_dir]  # the resumed run continued the same MLflow run
    assert sorted(mlflow_metric(run_dir, "loss")) == [1, 2, 4, 6]


def test_a_tracker_that_cannot_start_is_one_paragraph(tmp_path):
    pytest.importorskip("mlflow", reason="mlflow is an optional tracker (pip install hftrain[mlflow])")
    # MLflow 3 refuses its plain file store unless MLFLOW_ALLOW_FILE_STORE is set
    run = launch(tmp_path / "out", *DEFAULT, "--max_steps", "2", "--report_to", "mlflow", check=False,
                 env={"MLFLOW_TRACKING_URI": (tmp_path / "mlruns").as_uri(), "MLFLOW_ALLOW_FILE_STORE": "false"})
    assert run.returncode != 0
    message = " ".join(run.stderr[run.stderr.index("hftrain: error:"):].split("\n\n")[0].split())
    assert "a tracker in report_to=['mlflow'] could not start a run" in message and "MLFLOW_ALLOW_FILE_STORE" in message
    assert "Traceback" not in run.stderr[: run.stderr.index("hftrain: error:")]
