"""A run's report from its metrics.jsonl: PNG plots and a short markdown summary.

    python -m hftrain.report outputs/tiny-chat        # writes outputs/tiny-chat/report/{report.md,*.png}

Plots: loss and eval loss, learning rate, tokens/sec (global and per rank), per-rank own-time
throughput (stragglers stand out), step time split, peak memory per rank, heartbeat lag per rank against
hang_timeout (a rank drifting toward a hang stands out), and for dpo/simpo/orpo/kto runs the rewards (TRL's
rewards/* metrics, train and eval), for orpo its terms (nll_loss, log_odds_*), for kto its KL reference point
(kl), for grpo its reward and, with tool calling, its tool use (tools/call_frequency, tools/failure_frequency),
with async_generation the worker's and trainer's times per window and the staleness,
for a reward model its accuracy, margin and mean reward, for distill the student's entropy (and on-policy
completion lengths).
The summary states what ran (from the newest hftrain_state.json), final and best losses, the rewards,
throughput, step-time split, memory, MFU, device-hours and cost, the largest heartbeat lag, and any straggler
or desync the run reported.
"""

from __future__ import annotations

import collections
import json
import math
import re
import statistics
from pathlib import Path

import yaml

from hftrain.errors import HftrainError, run_tool
from hftrain.options import Parser
from hftrain.paths import CONFIG_FILE, FINAL_DIR, METRICS_FILE, PREFIX, REPORT_DIR, STATE_FILE

RANK_KEY = re.compile(r"^rank(\d+)/(.+)$")
# what the loop timed as data wait: for a grpo run logged before generation_time was split from it, mostly the
# sampling of each generation window's completions
WAIT_WORDS = {False: "data wait", True: "generation + data wait"}


def wait_words(train: list[dict]) -> str:
    """The data wait's label: it holds grpo's generation unless the run logged generation_time apart."""
    return WAIT_WORDS[any("reward_std" in r for r in train) and not any("generation_time" in r for r in train)]


TOOL_METRICS = ("tools/call_frequency", "tools/failure_frequency")  # grpo with tool calling
REWARDS = ("rewards/accuracies", "rewards/margins", "rewards/chosen", "rewards/rejected")  # dpo / simpo / orpo rows
ORPO_TERMS = ("nll_loss", "log_odds_ratio", "log_odds_chosen")  # orpo's two loss terms and its log odds (TRL's names)
REWARD_MODEL = ("accuracy", "margin", "mean_reward")  # objective reward (RewardTrainer's names)
# grpo with async_generation: the rollout worker's and the trainer's time per window (s), the importance weights
ASYNC_TIMES = ("rollout/worker_busy_s", "rollout/worker_idle_s", "perf/rollout_wait_s")
IMPORTANCE = ("sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
              "sampling/importance_sampling_ratio/max")
# retrieval_eval_dir's metrics, objectives embedding and reranker (evaluation rows' eval_<name>)
RETRIEVAL = ("ndcg@10", "mrr@10", "recall@1", "recall@5", "recall@10")


def read_metrics(output_dir: Path) -> list[dict]:
    path = output_dir / METRICS_FILE
    if not path.is_file():
        raise HftrainError(f"{output_dir} has no metrics.jsonl; give the output_dir of an hftrain run")
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise HftrainError(f"{path} line {number} is not JSON ({exc.msg}); the file is damaged") from None
        if not isinstance(row, dict) or "step" not in row:
            raise HftrainError(f"{path} line {number} is not a metrics row with a step")
        rows.append(row)
    if not any("loss" in r for r in rows):
        raise HftrainError(f"{path} holds no training rows yet; run at least one logging step")
    return rows


def run_state(output_dir: Path) -> dict:
    """hftrain_state.json of the final model, else of the newest checkpoint, else {}; with the recipe recorded beside
    it (hftrain_config.yaml) under "recipe"."""
    candidates = [output_dir / FINAL_DIR] + sorted(output_dir.glob(f"{PREFIX}*"),
                                                 key=lambda p: int(p.name.split("-")[-1]) if
                                                 p.name.split("-")[-1].isdigit() else -1, reverse=True)
    for folder in candidates:
        state = folder / STATE_FILE
        if state.is_file():
            recipe = folder / CONFIG_FILE
            return {**json.loads(state.read_text(encoding="utf-8")),
                    "recipe": (yaml.safe_load(recipe.read_text(encoding="utf-8")) or {}) if recipe.is_file() else {}}
    return {}


PRECISIONS = {"bf16": "bf16 mixed precision", "fp16": "fp16 mixed precision", "fp8": "fp8 mixed precision"}
WEIGHTS = {"float32": "fp32", "bfloat16": "bf16 weights", "float16": "fp16 weights"}
DEVICES = {"cpu": "CPU", "cuda": "GPU", "xpu": "XPU", "mps": "Apple GPU (MPS)", "npu": "NPU"}


def launch_words(state: dict) -> str:
    """How the run was launched, in a user's words: "1 process, CPU, fp32", "8 processes on 2 machines (FSDP2
    FULL_SHARD), GPU (NVIDIA H100 80GB HBM3), bf16 mixed precision", and the preset the recipe is sized for."""
    launch, layout, recipe = state.get("launch", {}), state.get("parallelism", {}), state.get("recipe", {})
    processes = layout.get("processes", launch.get("num_processes", 1))
    machines = layout.get("machines", launch.get("num_machines", 1))
    words = f"{processes} process{'es' if processes != 1 else ''}"
    words += f" on {machines} machines" if machines > 1 else ""
    if processes > 1 and layout.get("name"):
        words += f" ({layout['name']})"
    kind = str(launch.get("device", "cpu")).split(":")[0]
    names = {d.get("name") for d in state.get("devices", {}).get("processes", []) if d.get("type") != "cpu"}
    device = DEVICES.get(kind, kind) + (f" ({names.pop()})" if len(names) == 1 and None not in names else "")
    precision = PRECISIONS.get(launch.get("mixed_precision", "no")) or WEIGHTS.get(recipe.get("dtype", "float32"),
                                                                                  recipe.get("dtype"))
    preset = (state.get("launch_preset") or {}).get("recipe")
    return f"{words}, {device}, {precision}" + (f" (the recipe is sized for preset {preset})" if preset else "")


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    return [p[0] for p in points], [p[1] for p in points]


def rank_keys(rows: list[dict], metric: str) -> list[str]:
    ranks = sorted({int(m.group(1)) for r in rows for k in r if (m := RANK_KEY.match(k)) and m.group(2) == metric})
    return [f"rank{i}/{metric}" for i in ranks]


# --------------------------------------------------------------------------------- plots
def _figure(title: str, ylabel: str):
    from matplotlib.figure import Figure  # here: every training process imports this module for the model card

    fig = Figure(figsize=(7, 4), dpi=100)  # no pyplot: no GUI backend, no global figure list to close
    ax = fig.subplots()
    ax.set_title(title)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    return fig, ax


def step_axis_start(steps: list[int]) -> float:
    """Where the step axis starts: just before the first logged step (matplotlib's margin would show a step 0, or a
    negative one, that no run has)."""
    return min(steps) - 0.5 * bar_width(steps) if steps else 0.0


def bar_width(steps: list[int]) -> float:
    return max(0.8, 0.6 * _spacing(steps))


def _save(fig, ax, path: Path, steps: list[int] | None = None) -> Path:
    from matplotlib.ticker import MaxNLocator  # here, as Figure in _figure

    if steps:
        ax.set_xlim(left=step_axis_start(steps))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path


def plot_loss(train: list[dict], evals: list[dict], path: Path) -> Path:
    """The train loss curve and, where the run evaluated one, the eval loss's (also the model card's figure)."""
    pairs = any(REWARDS[1] in r for r in train)  # rewards/margins: dpo, simpo, orpo and kto
    fig, ax = _figure("Train and eval loss" if evals else "Train loss",
                      "loss (mean over pairs)" if pairs else "loss (token-weighted)")
    ax.plot(*series(train, "loss"), label="train loss", marker=".")
    if evals:
        ax.plot(*series(evals, "eval_loss"), label="eval loss", marker="o")
    return _save(fig, ax, path, sorted({r["step"] for r in train}))


def plot_train_and_eval(ax, train: list[dict], evals: list[dict], keys) -> None:
    """Each of `keys` as a training curve and, where there are evaluations, its eval_ curve (dashed)."""
    for key in keys:
        ax.plot(*series(train, key), label=key, marker=".")
        if evals:
            ax.plot(*series(evals, f"eval_{key}"), label=f"eval_{key}", marker="o", linestyle="--")


def is_kto(train: list[dict]) -> bool:
    """A kto run's rows: rewards and a kl (grpo's kl rows have no rewards/chosen)."""
    return any("kl" in r and "rewards/chosen" in r for r in train)


def plot_all(train: list[dict], evals: list[dict], folder: Path, ranked: list[dict] = ()) -> list[Path]:
    """The run's plots; `ranked`: the evaluation rows with retrieval metrics (with or without an eval loss)."""
    made, steps = [plot_loss(train, evals, folder / "loss.png")], sorted({r["step"] for r in train})
    many_ranks = len(rank_keys(train, "tokens_per_second")) > 1  # one process: its rank0 line is the total
    pairs = any(REWARDS[1] in r for r in train)  # rewards/margins: dpo, simpo, orpo and kto

    if pairs:
        fig, ax = _figure("Rewards (beta x log-ratio to the reference; simpo, orpo: beta x mean token log-prob)",
                          "reward")
        plot_train_and_eval(ax, train, evals, REWARDS[1:])
        made.append(_save(fig, ax, folder / "rewards.png", steps))

    if any(ORPO_TERMS[1] in r for r in train):  # orpo: the NLL term, log sigmoid(log odds) and the log odds
        fig, ax = _figure("ORPO terms (loss = nll_loss - beta x log_odds_ratio)", "value")
        plot_train_and_eval(ax, train, evals, ORPO_TERMS)
        made.append(_save(fig, ax, folder / "orpo.png", steps))

    if is_kto(train):  # kto: the KL reference point of each step (TRL's name)
        fig, ax = _figure("KTO reference point (kl: the step's KL estimate, clamped at 0)", "kl")
        plot_train_and_eval(ax, train, evals, ["kl"])
        made.append(_save(fig, ax, folder / "kto.png", steps))

    if any(REWARD_MODEL[2] in r for r in train):  # reward: pairs ranked right, chosen - rejected, mean score
        fig, ax = _figure("Reward model (accuracy, margin = r_chosen - r_rejected, mean reward)", "value")
        plot_train_and_eval(ax, train, evals, REWARD_MODEL)
        made.append(_save(fig, ax, folder / "reward_model.png", steps))

    if ranked:  # retrieval_eval_dir (embedding, reranker): the live model's ranking for each query at each evaluation
        fig, ax = _figure("Retrieval (retrieval_eval_dir: each query's documents ranked)", "value")
        for key in RETRIEVAL:
            ax.plot(*series(ranked, f"eval_{key}"), marker="o", label=key)
        made.append(_save(fig, ax, folder / "retrieval.png", sorted({r["step"] for r in ranked})))

    grpo = any("reward_std" in r for r in train)  # grpo logs an entropy too
    if any("entropy" in r for r in train) and not grpo:  # distill: the student's entropy per trained token (TRL's)
        fig, ax = _figure("Student entropy per trained token (distill; nats)", "entropy")
        plot_train_and_eval(ax, train, evals, ["entropy"])
        if any("completions/mean_length" in r for r in train):  # on-policy steps: the sampled completions' length
            ax.plot(*series(train, "completions/mean_length"), label="completions/mean_length (on-policy)",
                    linestyle=":")
        made.append(_save(fig, ax, folder / "distill.png", steps))

    if grpo:  # grpo: the mean reward of each window's completions (TRL's names)
        fig, ax = _figure("Reward (grpo: mean over each step's completions)", "reward")
        steps, mean = series(train, "reward")
        _, std = series(train, "reward_std")
        ax.plot(steps, mean, label="reward", marker=".", linewidth=2)
        if len(std) == len(mean):
            ax.fill_between(steps, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)], alpha=0.2,
                            label="± reward_std")
        for key in sorted({k for r in train for k in r if k.startswith("rewards/") and k.endswith("/mean")}):
            ax.plot(*series(train, key), label=key, linestyle="--")
        made.append(_save(fig, ax, folder / "reward.png", steps))

    if any(TOOL_METRICS[0] in r for r in train):  # grpo with tool calling (TRL's names)
        fig, ax = _figure("Tool use (grpo: calls per completion, failed share of calls)", "value")
        for key in TOOL_METRICS:
            ax.plot(*series(train, key), label=key, marker=".")
        made.append(_save(fig, ax, folder / "tools.png", steps))

    if any("sample/staleness_max" in r for r in train):  # grpo, async_generation
        fig, ax = _figure("Asynchronous generation (per window: the worker's sampling and waiting, the trainer's "
                          "wait; staleness)", "seconds")
        for key in ASYNC_TIMES:
            ax.plot(*series(train, key), label=key, marker=".")
        staleness = ax.twinx()
        staleness.step(*series(train, "sample/staleness_max"), where="mid", color="grey", linestyle=":",
                       label="sample/staleness_max (right axis)")
        staleness.set_ylabel("weight syncs behind the trainer")
        made.append(_save(fig, ax, folder / "async.png", steps))

    fig, ax = _figure("Learning rate", "learning rate")
    ax.plot(*series(train, "learning_rate"), marker=".")
    made.append(_save(fig, ax, folder / "learning_rate.png", steps))

    fig, ax = _figure("Throughput", "trained tokens / s")
    ax.plot(*series(train, "tokens_per_second"), label="global", linewidth=2)
    for key in rank_keys(train, "tokens_per_second") if many_ranks else []:
        ax.plot(*series(train, key), label=key.replace("/tokens_per_second", " (wall-clock)"), linestyle="--")
    made.append(_save(fig, ax, folder / "tokens_per_second.png", steps))

    if many_ranks:
        fig, ax = _figure("Per-rank throughput in its own time (a straggler stands out)",
                          "processed tokens / s of data wait + forward")
        for key in rank_keys(train, "own_tokens_per_second"):
            ax.plot(*series(train, key), label=key.split("/")[0], marker=".")
        made.append(_save(fig, ax, folder / "rank_throughput.png", steps))

    fig, ax = _figure("Step time split (mean per step)", "seconds")
    timed, _ = series(train, "step_time")
    bottom = [0.0] * len(timed)
    for key, label in (("generation_time", "generation"), ("data_wait_time", wait_words(train)),
                       ("forward_backward_time", "forward + backward"), ("optimizer_time", "optimizer")):
        values = [r.get(key, 0.0) if key == "generation_time" else r.get(key) for r in train if "step_time" in r]
        if key == "generation_time" and not any(values):
            continue
        if None not in values and len(values) == len(timed):
            ax.bar(timed, values, bottom=bottom, label=label, width=bar_width(timed))
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    made.append(_save(fig, ax, folder / "step_time.png", steps))

    fig, ax = _figure("Peak memory", "MiB")
    ax.plot(*series(train, "peak_memory_mb"), label="max over ranks", linewidth=2)
    for key in rank_keys(train, "peak_memory_mb") if many_ranks else []:
        ax.plot(*series(train, key), label=key.split("/")[0], linestyle="--")
    if any("peak_memory_reserved_mb" in r for r in train):
        ax.plot(*series(train, "peak_memory_reserved_mb"), label="reserved (CUDA)", linestyle=":")
    made.append(_save(fig, ax, folder / "memory.png", steps))

    lags = rank_keys(train, "heartbeat_lag")
    if lags:  # several processes with the hang watchdog on
        fig, ax = _figure("Heartbeat lag per rank (seen by rank 0; the job stops at hang_timeout)", "seconds")
        for key in lags:
            ax.plot(*series(train, key), label=key.split("/")[0], marker=".")
        ax.plot(*series(train, "hang_timeout"), label="hang_timeout", color="red", linestyle="--")
        made.append(_save(fig, ax, folder / "heartbeat_lag.png", steps))
    return made


def _spacing(steps: list[int]) -> float:
    gaps = [b - a for a, b in zip(steps, steps[1:], strict=False)]
    return statistics.median(gaps) if gaps else 1.0


# ------------------------------------------------------------------------------- summary
def _fmt(value, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    if isinstance(value, float):
        return f"{value:,.{digits}g}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def async_words(windows: list[dict]) -> str:
    """The summary's line for async_generation: the logged windows counted by staleness (a histogram), the medians of
    the worker's and the trainer's times per window, and the importance weights' range."""
    counts = collections.Counter(int(r["sample/staleness_max"]) for r in windows)

    def median(key: str) -> str:
        return _fmt(statistics.median(r[key] for r in windows))

    words = ("- asynchronous generation: logged windows by staleness (weight syncs behind the trainer) "
             + ", ".join(f"{k}: {counts[k]}" for k in sorted(counts))
             + f"; per window, medians: worker sampling {median(ASYNC_TIMES[0])} s, worker waiting "
             f"{median(ASYNC_TIMES[1])} s, trainer waiting {median(ASYNC_TIMES[2])} s")
    low = [r[IMPORTANCE[0]] for r in windows if isinstance(r.get(IMPORTANCE[0]), (int, float))
           and math.isfinite(r[IMPORTANCE[0]])]
    high = [r[IMPORTANCE[2]] for r in windows if isinstance(r.get(IMPORTANCE[2]), (int, float))
            and math.isfinite(r[IMPORTANCE[2]])]
    if low and high:
        words += f"; importance-sampling ratio {_fmt(min(low))} to {_fmt(max(high))} (logged windows)"
    return words


def summary(output_dir: Path, train: list[dict], evals: list[dict], state: dict, images: list[Path],
            ranked: list[dict] = ()) -> str:
    last = train[-1]
    launch = state.get("launch", {})  # absent when the run has not saved anything yet
    lines = [f"# Run report: {output_dir.resolve().name}", ""]
    if launch:
        lines.append(f"- launch: {launch_words(state)}")
    lines += [
        f"- steps logged: {train[0]['step']} to {last['step']}"
        + (f" of {state['total_steps']}" if "total_steps" in state else "")
        + f"; epoch {_fmt(last.get('epoch'))}; trained tokens {_fmt(last.get('trained_tokens'))}",
        f"- effective batch size: {_fmt(last.get('effective_batch_size', state.get('effective_batch_size')))}",
        f"- loss: first {_fmt(train[0]['loss'])}, last {_fmt(last['loss'])}, "
        f"lowest {_fmt(min(r['loss'] for r in train))}",
    ]
    if "reward_std" in last:  # grpo
        lines.append(f"- reward (grpo): first {_fmt(train[0].get('reward'))}, last {_fmt(last.get('reward'))}, "
                     f"highest {_fmt(max(r['reward'] for r in train if r.get('reward') is not None))}; rollouts in "
                     "rollouts.jsonl")
    if any(TOOL_METRICS[0] in r for r in train):
        calls = [r for r in train if TOOL_METRICS[0] in r]
        lines.append(f"- tool calls per completion: first {_fmt(calls[0][TOOL_METRICS[0]])}, last "
                     f"{_fmt(calls[-1][TOOL_METRICS[0]])}; failed share of calls last "
                     f"{_fmt(calls[-1][TOOL_METRICS[1]])}")
    windows = [r for r in train if "sample/staleness_max" in r]
    if windows:  # grpo, async_generation
        lines.append(async_words(windows))
    if evals:
        best = min(evals, key=lambda r: r["eval_loss"])
        perplexity = f" (perplexity {_fmt(evals[-1]['eval_perplexity'])})" if "eval_perplexity" in evals[-1] else ""
        lines.append(f"- eval loss: last {_fmt(evals[-1]['eval_loss'])}{perplexity} at step {evals[-1]['step']}; best "
                     f"{_fmt(best['eval_loss'])} at step {best['step']}")
    if any(REWARDS[1] in r for r in train):
        lines.append("- rewards (last train window): " + ", ".join(f"{key} {_fmt(last.get(key))}" for key in REWARDS
                                                                   if key in last))
        if evals and f"eval_{REWARDS[0]}" in evals[-1]:
            lines.append(f"- eval rewards at step {evals[-1]['step']}: " + ", ".join(
                f"{key} {_fmt(evals[-1].get(f'eval_{key}'))}" for key in REWARDS) + f"; first eval (step "
                f"{evals[0]['step']}) accuracies {_fmt(evals[0].get(f'eval_{REWARDS[0]}'))}")
    if is_kto(train):
        lines.append(f"- kto reference point (last train window): kl {_fmt(last.get('kl'))}"
                     + (f"; eval_kl {_fmt(evals[-1].get('eval_kl'))} at step {evals[-1]['step']}" if evals else ""))
    if any(REWARD_MODEL[2] in r for r in train):
        lines.append("- reward model (last train window): " + ", ".join(f"{key} {_fmt(last.get(key))}"
                                                                       for key in REWARD_MODEL))
        if evals:
            lines.append(f"- eval at step {evals[-1]['step']}: " + ", ".join(
                f"{key} {_fmt(evals[-1].get(f'eval_{key}'))}" for key in REWARD_MODEL) + f"; first eval (step "
                f"{evals[0]['step']}) accuracy {_fmt(evals[0].get('eval_accuracy'))}")
    if ranked:
        lines.append(f"- retrieval at step {ranked[-1]['step']}: " + ", ".join(
            f"{key} {_fmt(ranked[-1][f'eval_{key}'])}" for key in RETRIEVAL) + f"; first (step {ranked[0]['step']}) "
            f"ndcg@10 {_fmt(ranked[0]['eval_ndcg@10'])}")
    if any(ORPO_TERMS[1] in r for r in train):
        lines.append("- orpo terms (last train window): " + ", ".join(f"{key} {_fmt(last.get(key))}"
                                                                     for key in ORPO_TERMS))
    timed = [r for r in train if r.get("tokens_per_second") is not None]
    steady = timed[1:] or timed  # the first window holds one-time warm-up
    if steady:
        tokens = statistics.fmean(r["tokens_per_second"] for r in steady)
        samples = statistics.fmean(r["samples_per_second"] for r in steady)
        unit = "pairs" if any("pairs_per_second" in r for r in steady) else "samples"
        lines.append(f"- throughput (windows after the first): {_fmt(tokens)} trained tokens/s, {_fmt(samples)} "
                     f"{unit}/s")
        if all("step_time" in r for r in steady):
            step = statistics.fmean(r["step_time"] for r in steady)
            parts = {k: statistics.fmean(r.get(k, 0.0) for r in steady)
                     for k in ("generation_time", "data_wait_time", "forward_backward_time", "optimizer_time")}
            generated = f"generation {parts['generation_time'] / step:.0%}, " if parts["generation_time"] else ""
            lines.append(f"- step time {_fmt(step)} s: {generated}{wait_words(train)} "
                         f"{parts['data_wait_time'] / step:.0%}, forward + "
                         f"backward {parts['forward_backward_time'] / step:.0%}, optimizer "
                         f"{parts['optimizer_time'] / step:.0%}")
        if all("mfu" in r for r in steady):
            lines.append(f"- MFU {statistics.fmean(r['mfu'] for r in steady):.1%} "
                         f"({_fmt(statistics.fmean(r['tflops_per_device'] for r in steady))} TFLOP/s per device)")
        elif all("tflops_per_device" in r for r in steady):
            lines.append(f"- {_fmt(statistics.fmean(r['tflops_per_device'] for r in steady))} model TFLOP/s per "
                         "device (no peak known for this device: set device_peak_tflops for MFU)")
    lines.append(f"- peak memory: {_fmt(max(r.get('peak_memory_mb') or 0 for r in train))} MiB (max over ranks)"
                 + (f", {_fmt(state['memory_baseline_mb'])} MiB before the model was loaded"
                    if "memory_baseline_mb" in state else ""))
    hours = state.get("device_hours", last.get("device_hours"))
    if hours is not None:
        lines.append(f"- device-hours: {hours:.4f}" + (f", cost {last['cost']:.2f}" if "cost" in last else ""))
    stragglers = [r for r in train if r.get("slowest_rank_ratio") is not None and r.get("slowest_rank") is not None]
    desync = [r["step"] for r in train if r.get("ranks_in_sync") is False]
    if stragglers:
        worst = min(stragglers, key=lambda r: r["slowest_rank_ratio"])
        lines.append(f"- slowest rank: rank {worst['slowest_rank']} at {worst['slowest_rank_ratio']:.0%} of the "
                     f"others' own-time throughput (step {worst['step']})")
    lagged = [(r[key], key.split("/")[0], r["step"], r.get("hang_timeout")) for key in rank_keys(train, "heartbeat_lag")
              for r in train if r.get(key) is not None]
    if lagged:
        lag, rank, step, limit = max(lagged)
        lines.append(f"- largest heartbeat lag: {lag:.1f} s ({rank}, step {step}; hang_timeout {_fmt(limit)} s)")
    if desync:
        lines.append(f"- DESYNC: ranks disagreed at steps {desync[:10]}{' ...' if len(desync) > 10 else ''}")
    lines.append("")
    lines += [f"![{p.stem}]({p.name})" for p in images]
    return "\n".join(lines) + "\n"


def write_report(output_dir: Path) -> Path:
    rows = read_metrics(output_dir)
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval_loss" in r]
    ranked = [r for r in rows if f"eval_{RETRIEVAL[0]}" in r]
    folder = output_dir / REPORT_DIR
    folder.mkdir(exist_ok=True)
    images = plot_all(train, evals, folder, ranked)
    report = folder / "report.md"
    report.write_text(summary(output_dir, train, evals, run_state(output_dir), images, ranked), encoding="utf-8")
    return report


def build_arg_parser(prog: str = "hftrain report") -> Parser:
    parser = Parser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("output_dir", type=Path, help="The run's output_dir (holds metrics.jsonl).")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_arg_parser().parse_args(argv)
    report = run_tool(write_report, args.output_dir)
    print(f"hftrain: report written to {report} (plots beside it)")


if __name__ == "__main__":
    main()
