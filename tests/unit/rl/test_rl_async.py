"""async_generation's schedule (which policy version samples each window, the queue's bound) and its recipe rules."""

from __future__ import annotations

import pytest

from hftrain.config import ConfigError, load_recipe
from hftrain.rl.async_worker import queue_windows, sampling_version


def test_each_window_is_sampled_max_staleness_versions_behind_its_training_step():
    """Window w is trained at step w + 1, when the trainer has pushed version w // weight_sync_steps."""
    assert [sampling_version(w, 1, 0) for w in range(5)] == [0, 1, 2, 3, 4]  # the synchronous run
    assert [sampling_version(w, 1, 2) for w in range(6)] == [0, 0, 0, 1, 2, 3]
    assert [sampling_version(w, 2, 0) for w in range(6)] == [0, 0, 1, 1, 2, 2]
    assert [sampling_version(w, 2, 1) for w in range(8)] == [0, 0, 0, 0, 1, 1, 2, 2]
    for sync in (1, 2, 3):
        for stale in (0, 1, 4):
            for w in range(20):  # never older than max_staleness versions, never newer than the trainer's
                assert w // sync - stale <= sampling_version(w, sync, stale) <= w // sync


def test_queue_bound_is_trls_max_inflight_tasks_in_whole_windows():
    assert queue_windows(-1, 4, 16, 16) == 4  # TRL's automatic max(max_staleness, 1) x a step's completions
    assert queue_windows(-1, 0, 16, 16) == 1
    assert queue_windows(40, 4, 16, 16) == 2
    assert queue_windows(3, 4, 16, 16) == 1  # at least one window


def problems(tmp_path, *extra: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_recipe(["--config", "recipes/tiny-grpo.yaml", "--output_dir", str(tmp_path / "o"), *extra])
    return str(info.value)


def test_async_settings_and_refusals(tmp_path):
    recipe = load_recipe(["--config", "recipes/tiny-grpo-async.yaml", "--output_dir", str(tmp_path / "a")])
    assert (recipe.async_generation, recipe.max_staleness, recipe.weight_sync_steps, recipe.max_inflight_tasks,
            recipe.vllm_importance_sampling_correction) == (True, 1, 1, -1, True)
    # the importance-sampling fields (TRL's vllm_ names) configure the worker's correction too
    load_recipe(["--config", "recipes/tiny-grpo-async.yaml", "--output_dir", str(tmp_path / "b"),
                 "--vllm_importance_sampling_mode", "token_truncate"])
    text = problems(tmp_path, "--max_staleness", "2", "--weight_sync_steps", "3")
    assert "max_staleness, weight_sync_steps set without async_generation: true" in text
    text = problems(tmp_path, "--async_generation", "true", "--max_staleness", "-1", "--weight_sync_steps", "0",
                    "--num_iterations", "2", "--use_peft", "true", "--max_inflight_tasks", "0")
    for expected in ("max_staleness must be >= 0", "weight_sync_steps must be >= 1", "max_inflight_tasks must be >= 1",
                     "async_generation needs one optimizer step per generation window",
                     "async_generation with use_peft is refused"):
        assert expected in text, expected
    assert "async_generation is grpo's generation setting, but objective=sft" in problems(
        tmp_path, "--objective", "sft", "--async_generation", "true")
