"""async_generation's schedule (which policy version samples each window, the queue's bound) and its recipe rules."""

from __future__ import annotations

import json
import math

import pytest
import torch

from hftrain.config import ConfigError, load_recipe
from hftrain.rl.async_worker import (
    PackedWeights,
    SampledWindow,
    held_windows,
    queue_windows,
    sampled_rows,
    sampling_version,
)
from hftrain.rl.rollouts import Prompt


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


def test_a_checkpoint_holds_exactly_the_windows_the_resumed_run_cannot_sample_again():
    """After step n the resumed run holds the weights after step n: version n / sync at a push, else it pushes the
    next version first (at the next multiple of sync). Every window it must sample itself is sampled by a version it
    pushes before it takes that window; the held ones are those sampled by older versions."""
    assert held_windows(1, 10, 1, 1) == [1]  # window 1 by version 0; the resumed weights are version 1
    assert held_windows(3, 10, 1, 0) == []  # the synchronous schedule holds nothing
    assert held_windows(3, 10, 2, 0) == [3]  # version 1 (after step 2) is gone at step 3
    assert held_windows(8, 9, 1, 4) == [8]  # never past the run's last window
    for sync in (1, 2, 3):
        for stale in (0, 1, 2):
            for step in range(12):
                held = held_windows(step, 40, sync, stale)
                assert held == list(range(step, step + len(held)))
                first = step + len(held)  # the resumed worker's first window
                for window in range(first, 40):
                    version = sampling_version(window, sync, stale)
                    pushed_at = version * sync  # the window at whose start the trainer pushes `version`
                    assert pushed_at >= step and (pushed_at > step or step % sync == 0) and pushed_at <= window
                for window in held:
                    assert sampling_version(window, sync, stale) * sync < step or (
                        step % sync and sampling_version(window, sync, stale) == step // sync)


def test_queue_bound_is_trls_max_inflight_tasks_in_whole_windows():
    assert queue_windows(-1, 4, 16, 16) == 4  # TRL's automatic max(max_staleness, 1) x a step's completions
    assert queue_windows(-1, 0, 16, 16) == 1
    assert queue_windows(40, 4, 16, 16) == 2
    assert queue_windows(3, 4, 16, 16) == 1  # at least one window


def test_a_push_is_one_shared_block_per_dtype_that_unpacks_to_the_same_tensors():
    state = {"a": torch.randn(3, 4), "b": torch.arange(6, dtype=torch.bfloat16).view(2, 3), "c": torch.randn(5),
             "d": torch.randn(2, 3).t()}  # not contiguous
    packed = PackedWeights.pack(state)
    assert set(packed.flats) == {torch.float32, torch.bfloat16} and all(f.is_shared() for f in packed.flats.values())
    back = packed.unpack()
    assert list(back) == list(state)
    for name, tensor in state.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name


class Tally:
    """An environment after its rollout."""

    def __init__(self, beads: int):
        self.beads = beads


def test_a_held_tool_window_round_trips_through_the_checkpoints_json():
    """A checkpoint's held window of multi-turn rollouts (JSON): the completions with their NaN behaviour log-probs
    on tool tokens, the masks, calls and messages, the prompts an environment's reset changed, and the environments
    themselves (pickled) come back as they were, and give the rollout source the same rows."""
    call = {"name": "add", "arguments": {"a": 1}, "result": "2", "failed": False, "kept": True}
    window = SampledWindow(3, 1, [5, 6], [([1, 2, 9], False, [-0.5, math.nan, -0.25])], 0.1, 0.0,
                           tools=[([1, 0, 1], [call], [{"role": "assistant", "content": "x"}])],
                           prompts=[Prompt([{"role": "user", "content": "q obs"}], "q obs", [4, 5], {"answer": 2})],
                           environments=[Tally(7)])
    back = SampledWindow.restore(json.loads(json.dumps(window.record())))
    assert (back.window, back.version, back.seeds, back.prompts) == (3, 1, [5, 6], window.prompts)
    assert [type(e) for e in back.environments] == [Tally] and back.environments[0].beads == 7
    [row], [want] = sampled_rows(back), sampled_rows(window)
    assert (row.completion_ids, row.truncated, row.tool_mask, row.tool_calls, row.messages) == \
        (want.completion_ids, want.truncated, want.tool_mask, want.tool_calls, want.messages)
    assert torch.equal(torch.tensor(row.sampling_logps).isnan(), torch.tensor([False, True, False]))
    single = SampledWindow(0, 0, [1], [([3], True, [-1.0])], 0.0, 0.0)
    back = SampledWindow.restore(json.loads(json.dumps(single.record())))
    assert sampled_rows(back) == sampled_rows(single) and (back.tools, back.prompts, back.environments) == (None,) * 3


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
                    "--num_iterations", "2", "--use_peft", "true", "--load_in_8bit", "true",
                    "--max_inflight_tasks", "0")
    for expected in ("max_staleness must be >= 0", "weight_sync_steps must be >= 1", "max_inflight_tasks must be >= 1",
                     "async_generation needs one optimizer step per generation window",
                     "async_generation with load_in_8bit is refused"):
        assert expected in text, expected
    assert "async_generation is grpo's generation setting, but objective=sft" in problems(
        tmp_path, "--objective", "sft", "--async_generation", "true")
