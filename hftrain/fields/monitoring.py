"""The monitoring group of the recipe (what a run shows about itself: trackers' tags, progress bar, straggler
warnings, hang detection, profiler, MFU and cost): its fields (`MonitoringFields`) and the rules judged from the recipe
alone (`problems`); the code is `hftrain/metrics.py`, `hftrain/tracking.py` and `hftrain/watchdog.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

from hftrain.fields import recipe_field as _f


@dataclass
class MonitoringFields:
    wandb_tags: list[str] = _f([], "W&B run tags (comma-separated on the command line).", group="monitoring")
    wandb_group: str | None = _f(None, "W&B run group, e.g. one sweep or one experiment family.", group="monitoring")
    disable_tqdm: bool = _f(False, "Hide the progress bar (metrics.jsonl and trackers are unaffected).",
                            group="monitoring")
    straggler_threshold: float = _f(
        0.2, "Warn when a rank's own throughput (tokens per second of data wait + forward time, the parts of a "
        "step in which it waits for nobody) is this fraction below the other ranks' median in two logging "
        "windows in a row.", group="monitoring",
    )
    hang_timeout: float | None = _f(
        None, "Seconds, after the first optimizer step, that a rank may stay silent (no heartbeat: frozen, its node "
        "lost or cut off) or make no progress (a hung kernel, a deadlocked data worker) before every rank stops "
        "naming it, exiting non-zero so the launcher ends the job; evaluation, checkpoint saves and generation count "
        "as progress. Default: the larger of 300 and 10 x the median step time. 0 = off (collectives then wait "
        "ddp_timeout). On CUDA also sets NCCL's heartbeat monitor (TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC). See "
        "docs/hangs.md.", group="monitoring",
    )
    profile_steps: int = _f(
        0, "Record a torch.profiler trace of this many optimizer steps (from profile_start_step) into "
        "output_dir/profile, one Chrome/TensorBoard trace per rank; 0 = off.", group="monitoring",
    )
    profile_start_step: int = _f(3, "First optimizer step traced when profile_steps > 0 (skip warm-up steps).",
                                 group="monitoring")
    device_peak_tflops: float | None = _f(
        None, "Peak dense bf16 TFLOP/s of one device, for MFU. Default: looked up from the GPU name (H100, A100, "
        "L4, ...); on CPU or an unknown GPU MFU is logged only when this is set.", group="monitoring",
    )
    cost_per_gpu_hour: float | None = _f(
        None, "Price of one device-hour; when set, the run logs its cost (device_hours x price).", group="monitoring"
    )


def problems(r) -> list[str]:
    problems = []
    if r.wandb_tags or r.wandb_group:
        if "wandb" not in r.report_to:
            problems.append("wandb_tags / wandb_group are set but report_to does not include wandb")
        if any(len(t) > 64 for t in r.wandb_tags):
            problems.append("wandb_tags must be at most 64 characters each (a W&B limit)")
    if not 0 < r.straggler_threshold < 1:
        problems.append(f"straggler_threshold must be in (0, 1) (a fraction of the median rank's throughput), "
                        f"got {r.straggler_threshold}")
    if r.hang_timeout is not None and r.hang_timeout < 0:
        problems.append(f"hang_timeout must be >= 0 seconds (0 = off) or unset (automatic), got {r.hang_timeout}")
    if r.hang_timeout and r.hang_timeout >= r.ddp_timeout:
        problems.append(f"hang_timeout ({r.hang_timeout:g}s) must be below ddp_timeout ({r.ddp_timeout}s): a hung "
                        "collective would time out first, without naming the rank that holds it up")
    if r.profile_steps < 0 or r.profile_start_step < 1:
        problems.append(f"profile_steps must be >= 0 and profile_start_step >= 1, got {r.profile_steps} and "
                        f"{r.profile_start_step}")
    for name in ("device_peak_tflops", "cost_per_gpu_hour"):
        value = getattr(r, name)
        if value is not None and value <= 0:
            problems.append(f"{name} must be > 0 or unset, got {value}")
    return problems
