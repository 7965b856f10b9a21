"""Metric logging: `output_dir/metrics.jsonl` always, plus accelerate trackers (W&B, TensorBoard, MLflow).

The rank-0 check lives here, so the loop can call `log` on every rank. Trackers get the resolved
recipe and run facts with secrets redacted; W&B gets project, run name, tags and group from the
recipe, continues the same run on resume (its id is stored in every checkpoint, as MLflow's is), and
falls back to offline logging when the W&B server cannot be reached, so W&B never stops training.
Another tracker that cannot start (e.g. MLflow without a usable tracking URI) is a setup error.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import datasets
import transformers
from tqdm.auto import tqdm

from hftrain.config import Recipe
from hftrain.errors import HftrainError, first_line
from hftrain.jsonl import keep_through
from hftrain.paths import METRICS_FILE

SECRET_NAME = re.compile(r"token|key|secret|password|credential", re.IGNORECASE)
SECRET_VALUE = re.compile(r"^(hf_|sk-|ghp_|github_pat_|xox[bp]-)\w{8,}")
REDACTED = "<redacted>"


def _flatten(values: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in values.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}/"))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def redact(name: str, value):
    """Hide values whose field name or shape says they are credentials."""
    if value is None or value == "" or isinstance(value, bool):
        return value
    if SECRET_NAME.search(name.rsplit("/", 1)[-1]) or (isinstance(value, str) and SECRET_VALUE.match(value)):
        return REDACTED
    return value


def tracker_config(recipe: Recipe, run_info: dict) -> dict:
    """The resolved recipe plus run facts, flattened to scalar values every tracker accepts, secrets redacted."""
    flat = _flatten({**recipe.to_dict(), **{k: v for k, v in run_info.items() if k != "launch"},
                     "launch": run_info["launch"]})
    clean = {k: redact(k, v) for k, v in flat.items()}
    return {k: v if isinstance(v, (int, float, str, bool)) or v is None else str(v) for k, v in clean.items()}


@contextlib.contextmanager
def errors_only(logger_name: str) -> Iterator[None]:
    """A library's logger (and its children) shows only errors inside the block; its level is restored after."""
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def quiet_console(accelerator, stream=None) -> None:
    """One readable console: processes other than the main one show no library progress bars or info logs (their
    warnings and errors still print); the main process keeps transformers' and datasets' progress bars (loading
    weights, mapping rows) on a terminal only: written to a log file or a pipe, each redraw of a bar becomes a line of
    its own, as `ProgressDisplay` avoids for the training bar."""
    if not accelerator.is_main_process:
        transformers.utils.logging.set_verbosity_warning()
        datasets.utils.logging.set_verbosity_warning()
    if not accelerator.is_main_process or not (stream or sys.stderr).isatty():
        transformers.utils.logging.disable_progress_bar()
        datasets.disable_progress_bars()


class ProgressDisplay:
    """The main process's training progress. On a terminal, a tqdm bar redrawn in place with the headline metrics;
    when standard error is a file or a pipe (a log, a job's output), where a bar becomes one line of thousands of
    characters, one plain line per logged step instead. `enabled` False (other ranks, disable_tqdm): nothing."""

    def __init__(self, total: int, initial: int, enabled: bool, stream=None):
        self.stream = stream or sys.stderr
        self.total = total
        interactive = enabled and self.stream.isatty()
        self.bar = tqdm(total=total, initial=initial, desc="training", file=self.stream) if interactive else None
        self.plain = enabled and not interactive

    def update(self, steps: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(steps)

    def show(self, step: int, fields: dict[str, str]) -> None:
        """The metrics of the step just logged: the bar's postfix, or one line."""
        if self.bar is not None:
            self.bar.set_postfix(fields)
        elif self.plain:
            shown = ", ".join(f"{name} {value}" for name, value in fields.items())
            print(f"training: step {step}/{self.total}: {shown}", file=self.stream, flush=True)

    def write(self, line: str) -> None:
        """A line above the bar (on standard output), or in the plain sequence."""
        if self.bar is not None:
            self.bar.write(line, file=sys.stdout)
        elif self.plain:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@dataclass
class Table:
    """A table in a metrics row (grpo's log_completions): sent to W&B as a wandb.Table; metrics.jsonl and the
    scalar trackers leave it out (its rows are in a file of the run, e.g. rollouts.jsonl)."""

    columns: list[str]
    rows: list[list]


class MetricLogger:
    def __init__(self, accelerator, recipe: Recipe, start_step: int, run_info: dict, resumed: dict):
        self.accelerator = accelerator
        self.main = accelerator.is_main_process
        self.trackers = [t for t in recipe.report_to if t != "none"]
        self.path = Path(recipe.output_dir) / METRICS_FILE
        if self.main:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # A resumed run continues the file; rows logged after its checkpoint are dropped.
            if start_step:
                keep_through(self.path, start_step)
                self.path.touch()
            else:
                self.path.write_text("", encoding="utf-8")
        if self.trackers:
            self._start_trackers(recipe, run_info, resumed)

    def _start_trackers(self, recipe: Recipe, run_info: dict, resumed: dict) -> None:
        run_name = recipe.run_name or Path(recipe.output_dir).resolve().name
        wandb = {"name": run_name, "tags": list(recipe.wandb_tags), "group": recipe.wandb_group}
        if "wandb_run_id" in resumed:  # continue the run this checkpoint was logging to
            wandb.update(id=resumed["wandb_run_id"], resume="allow")
        config = tracker_config(recipe, run_info)
        mlflow = {"run_name": run_name}
        if "mlflow_run_id" in resumed:
            mlflow["run_id"] = resumed["mlflow_run_id"]
        init_kwargs = {"wandb": wandb, "mlflow": mlflow}
        try:
            self._init(recipe.project_name, config, init_kwargs, resumed)
        except Exception as exc:  # noqa: BLE001 - W&B falls back to offline; any other tracker is a setup error
            reason = first_line(exc)
            if type(exc).__module__.split(".")[0] != "wandb":
                raise HftrainError(f"a tracker in report_to={self.trackers} could not start a run: {reason}. Fix "
                                   "its settings (e.g. MLFLOW_TRACKING_URI for mlflow) or drop it from report_to"
                                   ) from None
            for tracker in self.accelerator.trackers:
                if tracker.name != "wandb" and getattr(tracker, "writer", None) is not None:
                    tracker.finish()
            self.accelerator.trackers.clear()
            self.warn(f"W&B could not start a run online ({reason}); logging to W&B offline instead (upload "
                      "the run later with `wandb sync`)")
            wandb["mode"] = "offline"
            self._init(recipe.project_name, config, init_kwargs, resumed)

    def _init(self, project: str, config: dict, init_kwargs: dict, resumed: dict) -> None:
        self.accelerator.init_trackers(project, init_kwargs=init_kwargs)
        for tracker in self.accelerator.trackers:
            # MLflow parameters are immutable: a continued run keeps those of its first start (the resumed
            # run's resolved recipe is in every checkpoint's hftrain_config.yaml)
            if not (tracker.name == "mlflow" and "mlflow_run_id" in resumed):
                tracker.store_init_configuration(config)

    def run_ids(self) -> dict:
        """Tracker run ids to store in checkpoints, so that a resumed run continues them (main process only)."""
        ids = {}
        if self.main and "wandb" in self.trackers:
            ids["wandb_run_id"] = self.accelerator.get_tracker("wandb", unwrap=True).id
        if self.main and "mlflow" in self.trackers:
            ids["mlflow_run_id"] = self.accelerator.get_tracker("mlflow", unwrap=True).info.run_id
        return ids

    def log(self, row: dict) -> None:
        """Append one row (must hold `step`) to metrics.jsonl and send it to the trackers (its `Table` values to
        W&B only)."""
        tables = {k: v for k, v in row.items() if isinstance(v, Table)}
        row = {k: v for k, v in row.items() if k not in tables}
        if self.main:
            clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(clean) + "\n")
        if self.trackers:
            self.accelerator.log({k: v for k, v in row.items() if k != "step" and v is not None}, step=row["step"])
        if tables and self.main and "wandb" in self.trackers:
            import wandb

            self.accelerator.get_tracker("wandb").log(
                {k: wandb.Table(columns=t.columns, data=t.rows) for k, t in tables.items()}, step=row["step"])

    def print(self, message: str) -> None:
        self.accelerator.print(message)

    def note(self, message: str) -> None:
        """One line on standard output from the main process, above the progress bar (not through it), whether or not
        the bar is shown."""
        if self.main:
            tqdm.write(message, file=sys.stdout)

    def warn(self, message: str) -> None:
        """One warning line on stderr from the main process (above the progress bar, not through it)."""
        if self.main:
            tqdm.write(f"hftrain: warning: {message}", file=sys.stderr)

    def close(self) -> None:
        """Finish the trackers (W&B uploads or closes its run file). Not `accelerator.end_training()`: it also
        destroys the process group, which can deadlock gloo (see hftrain.parallel.launch.run_process)."""
        for tracker in self.accelerator.trackers if self.trackers else ():
            tracker.finish()
