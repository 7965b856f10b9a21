"""Resuming with another number of processes or batch size: where training continues in the epoch."""

from __future__ import annotations

import pytest

from hftrain.checkpoint import Progress, realign
from hftrain.data import BatchPlan


def plan(world: int, micro: int, accum: int = 1, n: int = 100) -> BatchPlan:
    return BatchPlan(n, micro, world, accum, seed=0, shuffle=True)


@pytest.mark.parametrize("saved_batch, new_plan, step_in_epoch, expected", [
    (16, plan(2, 8), 3, 3),           # 1 -> 2 processes, same global batch: same step in the epoch
    (16, plan(1, 8, accum=2), 3, 3),  # 2 -> 1 with accumulation: same
    (16, plan(2, 16), 3, 1),          # batch doubled: 48 examples done -> 1 step of 32, 16 examples seen again
    (32, plan(1, 16), 3, 6),          # batch halved: 96 examples done -> 6 steps of 16
    (16, plan(2, 16), 7, 4),          # finished epoch (7 steps of 16 cover 100) stays finished: 4 steps of 32
])
def test_realign_keeps_the_position_in_examples(saved_batch, new_plan, step_in_epoch, expected):
    saved = Progress(step=10, epoch=1, step_in_epoch=step_in_epoch, trained_tokens=1234, world_size=1)
    progress = realign(saved, saved_batch, new_plan)
    assert progress.step_in_epoch == expected
    assert (progress.step, progress.epoch, progress.trained_tokens) == (10, 1, 1234)  # the schedule continues
    assert progress.world_size == new_plan.world
    # never skips data: the new position is at or before the examples already trained on
    assert progress.step_in_epoch * new_plan.global_batch <= max(step_in_epoch * saved_batch, 0) or \
        progress.step_in_epoch == new_plan.steps_per_epoch


def test_the_data_order_does_not_depend_on_the_layout():
    """Why the position can be kept in examples: every layout walks the same epoch order."""
    one, two = plan(1, 8, accum=2), plan(2, 8)
    assert one.epoch_order(3) == two.epoch_order(3)
    step = 2
    seen_one = [i for b in list(one.micro_batches(3, 0))[step * 2:(step + 1) * 2] for i in b]
    seen_two = [i for r in range(2) for b in list(two.micro_batches(3, r))[step:step + 1] for i in b]
    assert sorted(seen_one) == sorted(seen_two)
