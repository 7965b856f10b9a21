"""Metric logging: `output_dir/metrics.jsonl` always, plus accelerate trackers (W&B, TensorBoard).

The rank-0 check lives here, so the loop can call `log` on every rank.
"""

from __future__ import annotations

import json
import math
import resource
from pathlib import Path

import torch

from hftrain.config import Recipe


def peak_memory_mb(device: torch.device) -> float:
    """Peak CUDA memory allocated on this device, or the process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def _step_of(line: str) -> int | None:
    """The step of a metrics line, or None for a line cut short by a crash."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return None


def tracker_config(recipe: Recipe, run_info: dict) -> dict:
    """The resolved recipe plus run facts, flattened to the scalar values every tracker accepts."""
    flat = {**recipe.to_dict(), "effective_batch_size": run_info["effective_batch_size"],
            "total_steps": run_info["total_steps"], **{f"launch/{k}": v for k, v in run_info["launch"].items()}}
    return {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in flat.items()}


class MetricLogger:
    def __init__(self, accelerator, recipe: Recipe, start_step: int, run_info: dict):
        self.accelerator = accelerator
        self.main = accelerator.is_main_process
        self.trackers = [t for t in recipe.report_to if t != "none"]
        self.path = Path(recipe.output_dir) / "metrics.jsonl"
        if self.main:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # A resumed run continues the file; rows logged after its checkpoint are dropped.
            rows = self.path.read_text(encoding="utf-8").splitlines() if start_step and self.path.exists() else []
            kept = [r for r in rows if _step_of(r) is not None and _step_of(r) <= start_step]
            self.path.write_text("".join(r + "\n" for r in kept), encoding="utf-8")
        if self.trackers:
            run_name = recipe.run_name or Path(recipe.output_dir).resolve().name
            accelerator.init_trackers(recipe.project_name, config=tracker_config(recipe, run_info),
                                      init_kwargs={"wandb": {"name": run_name}})

    def log(self, row: dict) -> None:
        """Append one row (must hold `step`) to metrics.jsonl and send it to the trackers."""
        if self.main:
            clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(clean) + "\n")
        if self.trackers:
            self.accelerator.log({k: v for k, v in row.items() if k != "step"}, step=row["step"])

    def print(self, message: str) -> None:
        self.accelerator.print(message)

    def close(self) -> None:
        if self.trackers:
            self.accelerator.end_training()
