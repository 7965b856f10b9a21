"""hftrain.report on a made-up two-rank metrics.jsonl: valid PNGs and a summary whose numbers are checked by hand."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from PIL import Image

from hftrain.paths import REPORT_DIR
from hftrain.report import step_axis_start, write_report
from tests.conftest import REPO

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def train_row(step: int, loss: float, ranks_in_sync: bool = True) -> dict:
    return {"step": step, "epoch": step / 10, "loss": loss, "learning_rate": 1e-3 * step, "grad_norm": 1.0,
            "trained_tokens": 100 * step, "tokens_per_second": 1000.0 * step, "samples_per_second": 10.0 * step,
            "effective_batch_size": 32, "step_time": 2.0, "data_wait_time": 0.5, "forward_backward_time": 1.0,
            "optimizer_time": 0.5, "peak_memory_mb": 900.0 + step, "tflops_per_device": 3.0, "mfu": 0.25,
            "device_hours": 0.1 * step, "cost": 0.2 * step, "rank0/tokens_per_second": 500.0 * step,
            "rank1/tokens_per_second": 500.0 * step, "rank0/own_tokens_per_second": 4000.0,
            "rank1/own_tokens_per_second": 2000.0, "rank0/peak_memory_mb": 900.0 + step,
            "rank1/peak_memory_mb": 800.0, "slowest_rank": 1, "slowest_rank_ratio": 0.5 + step / 100,
            "ranks_in_sync": ranks_in_sync}


@pytest.fixture
def run_dir(tmp_path):
    rows = [train_row(1, 5.0), train_row(2, 4.0), {"step": 2, "eval_loss": 3.9, "eval_perplexity": 49.4,
                                                   "eval_tokens": 10},
            train_row(3, 3.0, ranks_in_sync=False), train_row(4, 3.5), {"step": 4, "eval_loss": 4.1,
                                                                         "eval_perplexity": 60.3, "eval_tokens": 10}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "hftrain_state.json").write_text(json.dumps({
        "launch": {"distributed_type": "MULTI_GPU", "num_processes": 2, "model_wrapper": "DistributedDataParallel",
                   "mixed_precision": "bf16", "device": "cuda:0"},
        "parallelism": {"name": "DDP", "processes": 2, "machines": 1},
        "devices": {"processes": [{"rank": rank, "type": "cuda", "name": "NVIDIA H100 80GB HBM3"} for rank in (0, 1)]},
        "total_steps": 4, "effective_batch_size": 32, "memory_baseline_mb": 300.0, "device_hours": 0.45}))
    return tmp_path


def test_report_writes_valid_pngs_and_a_checked_summary(run_dir):
    report = write_report(run_dir)
    pngs = sorted(p.name for p in report.parent.glob("*.png"))
    assert pngs == ["learning_rate.png", "loss.png", "memory.png", "rank_throughput.png", "step_time.png",
                    "tokens_per_second.png"]
    for name in pngs:
        path = report.parent / name
        assert path.read_bytes()[:8] == PNG_SIGNATURE
        with Image.open(path) as image:
            image.verify()  # a complete, uncorrupted PNG
        with Image.open(path) as image:
            assert image.size == (700, 400)
            assert len(image.convert("L").getcolors(maxcolors=256)) > 10, f"{name} looks blank"
    text = report.read_text()
    assert "- launch: 2 processes (DDP), GPU (NVIDIA H100 80GB HBM3), bf16 mixed precision\n" in text  # issue 49
    assert "steps logged: 1 to 4 of 4" in text
    assert "loss: first 5, last 3.5, lowest 3" in text
    assert "eval loss: last 4.1 (perplexity 60.3) at step 4; best 3.9 at step 2" in text
    # windows after the first: mean of 2000, 3000, 4000 tokens/s and of 20, 30, 40 samples/s
    assert "3,000 trained tokens/s, 30 samples/s" in text
    assert "step time 2 s: data wait 25%, forward + backward 50%, optimizer 25%" in text
    assert "MFU 25.0%" in text and "peak memory: 904 MiB" in text and "300 MiB before the model" in text
    assert "device-hours: 0.4500, cost 0.80" in text
    assert "slowest rank: rank 1 at 51% of the others' own-time throughput (step 1)" in text
    assert "DESYNC: ranks disagreed at steps [3]" in text
    assert all(f"![{p[:-4]}]({p})" in text for p in pngs)


def test_report_cli_refuses_a_folder_without_metrics(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "hftrain.report", str(tmp_path)], capture_output=True, text=True,
                          cwd=REPO)
    message = " ".join(proc.stderr.split())  # one paragraph, wrapped
    assert proc.returncode == 2
    assert message.startswith("hftrain: error:") and "has no metrics.jsonl" in message
    assert "Traceback" not in proc.stderr


def test_report_names_a_damaged_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps(train_row(1, 2.0)) + "\n{not json\n")
    proc = subprocess.run([sys.executable, "-m", "hftrain.report", str(tmp_path)], capture_output=True, text=True,
                          cwd=REPO)
    assert proc.returncode == 2 and "line 2 is not JSON" in " ".join(proc.stderr.split())


def test_a_dpo_run_reports_its_rewards_and_pairs(tmp_path):
    """dpo/simpo rows carry TRL's rewards/* names: the report plots them and states the last train and eval values
    (numbers made up here, read back by hand)."""
    def dpo_row(step: int, accuracy: float, margin: float) -> dict:
        row = {k: v for k, v in train_row(step, 0.7 - margin / 10).items() if not k.startswith("rank")}
        return {**row, "pairs_per_second": row["samples_per_second"], "rewards/accuracies": accuracy,
                "rewards/margins": margin, "rewards/chosen": margin / 2, "rewards/rejected": -margin / 2}

    def dpo_eval(step: int, accuracy: float, margin: float) -> dict:
        return {"step": step, "eval_loss": 0.6, "eval_pairs": 40, "eval_rewards/accuracies": accuracy,
                "eval_rewards/margins": margin, "eval_rewards/chosen": 0.1, "eval_rewards/rejected": 0.1 - margin}

    rows = [dpo_row(1, 0.0, 0.0), dpo_row(2, 0.5, 0.2), dpo_eval(2, 0.25, 0.05), dpo_row(3, 0.75, 0.4),
            dpo_row(4, 1.0, 0.8), dpo_eval(4, 0.875, 0.6)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = write_report(tmp_path)
    rewards = report.parent / "rewards.png"
    with Image.open(rewards) as image:
        assert len(image.convert("L").getcolors(maxcolors=256)) > 10, "rewards.png looks blank"
    text = report.read_text()
    assert ("rewards (last train window): rewards/accuracies 1, rewards/margins 0.8, rewards/chosen 0.4, "
            "rewards/rejected -0.4") in text
    assert ("eval rewards at step 4: rewards/accuracies 0.875, rewards/margins 0.6, rewards/chosen 0.1, "
            "rewards/rejected -0.5; first eval (step 2) accuracies 0.25") in text
    assert "3,000 trained tokens/s, 30 pairs/s" in text and "![rewards](rewards.png)" in text
    assert "eval loss: last 0.6 at step 4; best 0.6 at step 2" in text  # a pair loss has no perplexity


def test_an_sft_report_has_no_rewards(run_dir):
    report = write_report(run_dir)
    assert not (report.parent / "rewards.png").exists() and "rewards" not in report.read_text()


def test_heartbeat_lag_per_rank_is_plotted_against_hang_timeout_and_its_largest_summarised(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    lags = {1: (0.4, 0.5), 2: (0.3, 2.5), 3: (0.2, 1.0), 4: (0.5, 0.4)}  # step: (rank 0's, rank 1's), as logged
    for row in rows:
        if "loss" in row:
            row.update({"hang_timeout": 300.0, "rank0/heartbeat_lag": lags[row["step"]][0],
                        "rank1/heartbeat_lag": lags[row["step"]][1]})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = write_report(run_dir)
    with Image.open(report.parent / "heartbeat_lag.png") as image:
        assert image.size == (700, 400) and len(image.convert("L").getcolors(maxcolors=256)) > 10
    assert "- largest heartbeat lag: 2.5 s (rank1, step 2; hang_timeout 300 s)" in report.read_text()


def test_one_process_gets_no_per_rank_chart_and_no_step_before_its_first(tmp_path):
    """One process: its rank0 columns are the totals, so no per-rank chart; the step axis starts just before step 1
    (matplotlib's margin drew a step 0). A grpo run's data wait is where it samples: labelled so."""
    one = [{k: v for k, v in train_row(step, 5.0 - step).items() if not k.startswith("rank1/")} | {"reward": 0.1,
           "reward_std": 0.01} for step in (1, 2, 3, 4)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in one))
    report = write_report(tmp_path)
    assert sorted(p.name for p in report.parent.glob("*.png")) == [
        "learning_rate.png", "loss.png", "memory.png", "reward.png", "step_time.png", "tokens_per_second.png"]
    assert "- step time 2 s: generation + data wait 25%, forward + backward 50%, optimizer 25%" in report.read_text()
    assert 0 < step_axis_start([1, 2, 3, 4]) < 1 and 0 < step_axis_start([10, 20, 30]) < 10


def test_a_grpo_runs_generation_time_is_its_own_part_of_the_step(tmp_path):
    rows = [{k: v for k, v in train_row(step, 1.0).items() if not k.startswith("rank1/")}
            | {"reward": 0.1, "reward_std": 0.01, "data_wait_time": 0.1, "generation_time": 0.4} for step in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = write_report(tmp_path).read_text()
    assert "- step time 2 s: generation 20%, data wait 5%, forward + backward 50%, optimizer 25%" in text


def test_a_grpo_runs_entropy_is_not_drawn_as_distillation(tmp_path):
    """grpo logs an entropy as distill does (TRL's name for both): its report has reward.png, not distill.png."""
    rows = [{k: v for k, v in train_row(step, 1.0).items() if not k.startswith("rank1/")}
            | {"reward": 0.1 * step, "reward_std": 0.01, "entropy": 2.0} for step in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    write_report(tmp_path)
    folder = tmp_path / REPORT_DIR
    assert (folder / "reward.png").exists() and not (folder / "distill.png").exists()


def test_an_orpo_run_reports_its_terms(tmp_path):
    """orpo rows carry TRL's nll_loss / log_odds_ratio / log_odds_chosen: orpo.png plots them, the summary states the
    last train window's values (numbers made up here)."""
    rows = [{**{k: v for k, v in train_row(step, 6.0 - step).items() if not k.startswith("rank")},
             "rewards/accuracies": 0.5, "rewards/margins": 0.01 * step, "rewards/chosen": -0.6,
             "rewards/rejected": -0.7,
             "nll_loss": 5.9 - step, "log_odds_ratio": -0.69 + 0.05 * step, "log_odds_chosen": 0.1 * step}
            for step in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = write_report(tmp_path)
    with Image.open(report.parent / "orpo.png") as image:
        assert len(image.convert("L").getcolors(maxcolors=256)) > 10, "orpo.png looks blank"
    text = report.read_text()
    assert "orpo terms (last train window): nll_loss 2.9, log_odds_ratio -0.54, log_odds_chosen 0.3" in text
    assert "![orpo](orpo.png)" in text


def test_the_launch_is_described_in_a_users_words(tmp_path):
    """Issue 49: the report said accelerate's "launch: NO, 1 process(es), model wrapped as CausalLMTokenLoss,
    precision no, device cpu"; it says the processes, the layout, the device and the precision, and the preset the
    recipe is sized for (from the run's files)."""
    (tmp_path / "metrics.jsonl").write_text(json.dumps(train_row(1, 2.0)) + "\n" + json.dumps(train_row(2, 1.0)) + "\n")
    final = tmp_path / "final"
    final.mkdir()
    (final / "hftrain_config.yaml").write_text("dtype: float32\nlaunch_preset: cpu\n")
    (final / "hftrain_state.json").write_text(json.dumps({
        "launch": {"distributed_type": "NO", "num_processes": 1, "model_wrapper": "CausalLMTokenLoss",
                   "mixed_precision": "no", "device": "cpu"},
        "parallelism": {"kind": "single", "name": "single process", "processes": 1, "machines": 1},
        "devices": {"processes": [{"rank": 0, "type": "cpu", "name": "x86_64"}]},
        "launch_preset": {"recipe": "cpu", "reason": "tiny"}}))
    text = write_report(tmp_path).read_text()
    assert "- launch: 1 process, CPU, fp32 (the recipe is sized for preset cpu)\n" in text
    assert "NO," not in text and "precision no" not in text and "CausalLMTokenLoss" not in text
    (final / "hftrain_config.yaml").write_text("dtype: bfloat16\n")
    state = json.loads((final / "hftrain_state.json").read_text())
    state.update(parallelism={"name": "FSDP2 FULL_SHARD", "processes": 16, "machines": 2}, launch_preset=None)
    (final / "hftrain_state.json").write_text(json.dumps(state))
    assert "- launch: 16 processes on 2 machines (FSDP2 FULL_SHARD), CPU, bf16 weights\n" in \
        write_report(tmp_path).read_text()


def test_a_reward_models_report_names_its_eval_metrics_as_its_training_ones(tmp_path):
    rows = [{**train_row(1, 0.7), "accuracy": 0.5, "margin": 0.1, "mean_reward": 0.0},
            {"step": 1, "eval_loss": 0.69, "eval_accuracy": 0.25, "eval_margin": 0.05, "eval_mean_reward": 0.5}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = write_report(tmp_path).read_text()
    assert "- eval at step 1: accuracy 0.25, margin 0.05, mean_reward 0.5; first eval (step 1) accuracy 0.25" in text



def test_an_embedding_run_reports_its_retrieval_metrics_and_no_reward_model(tmp_path):
    """objective embedding logs an accuracy (no margin, no mean reward: not a reward model) and, with
    retrieval_eval_dir and no eval set, evaluation rows of retrieval metrics alone: plotted and stated (numbers made
    up here, read back by hand)."""
    def ranked(step: int, ndcg: float) -> dict:
        return {"step": step, "eval_ndcg@10": ndcg, "eval_mrr@10": ndcg / 2, "eval_recall@1": 0.25,
                "eval_recall@5": 0.5, "eval_recall@10": 0.75}

    rows = [{**train_row(1, 2.0), "accuracy": 0.25}, ranked(1, 0.2), {**train_row(2, 1.5), "accuracy": 0.5},
            ranked(2, 0.4)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = write_report(tmp_path)
    assert (report.parent / "retrieval.png").is_file() and not (report.parent / "reward_model.png").exists()
    text = report.read_text()
    assert ("retrieval at step 2: ndcg@10 0.4, mrr@10 0.2, recall@1 0.25, recall@5 0.5, recall@10 0.75; first "
            "(step 1) ndcg@10 0.2") in text
    assert "reward model" not in text


def test_an_async_grpo_run_reports_its_staleness_histogram_and_the_times_per_window(tmp_path):
    """async_generation's rows: the summary counts the logged windows by staleness (hand-counted below: one window
    at 0, three at 1), gives the medians of the worker's and trainer's times and the importance weights' range (NaN:
    a window with no weight kept, left out), and async.png is drawn."""
    times = [(0.30, 0.05, 0.40), (0.20, 0.01, 0.10), (0.25, 0.02, 0.05), (0.22, 0.00, 0.07)]
    ratios = [(1.0, 1.0), (0.5, 1.5), (float("nan"), float("nan")), (0.8, 2.5)]
    rows = [{k: v for k, v in train_row(step, 1.0).items() if not k.startswith("rank1/")}
            | {"reward": 0.1, "reward_std": 0.01, "generation_time": 0.1, "sample/staleness_mean": float(stale),
               "sample/staleness_max": float(stale), "rollout/worker_busy_s": busy, "rollout/worker_idle_s": idle,
               "perf/rollout_wait_s": wait, "sampling/importance_sampling_ratio/min": low,
               "sampling/importance_sampling_ratio/mean": 1.0, "sampling/importance_sampling_ratio/max": high}
            for step, stale, (busy, idle, wait), (low, high) in zip((1, 2, 3, 4), (0, 1, 1, 1), times, ratios)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = write_report(tmp_path).read_text()
    assert ("- asynchronous generation: logged windows by staleness (weight syncs behind the trainer) 0: 1, 1: 3; "
            "per window, medians: worker sampling 0.235 s, worker waiting 0.015 s, trainer waiting 0.085 s; "
            "importance-sampling ratio 0.5 to 2.5 (logged windows)") in text
    assert Image.open(tmp_path / REPORT_DIR / "async.png").size[0] > 0
