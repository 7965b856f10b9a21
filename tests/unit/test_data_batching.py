"""Length-grouped batching (`train_sampling_strategy: group_by_length`): coverage, determinism, resume, padding."""

from __future__ import annotations

import random

import pytest
from datasets import Dataset

from hftrain.config import Recipe, validate
from hftrain.data import BatchPlan, row_lengths, training_plan
from hftrain.data.batching import GROUP_WINDOW_BATCHES


def skewed_lengths(n: int, seed: int = 0) -> tuple[int, ...]:
    """Chat-like lengths: log-normal around ~200 tokens, clipped to [33, 900]."""
    rng = random.Random(seed)
    return tuple(min(900, max(33, int(rng.lognormvariate(5.3, 0.8)))) for _ in range(n))


def grouped(n: int, b: int, world: int, accum: int, seed: int = 0, shuffle: bool = True) -> BatchPlan:
    return BatchPlan(n, b, world, accum, seed=seed, shuffle=shuffle, lengths=skewed_lengths(n, seed=n))


def global_batches(plan: BatchPlan, epoch: int, start_step: int = 0) -> list[list[int]]:
    """Rows of each optimizer step over every rank and micro-batch."""
    by_rank = [list(plan.micro_batches(epoch, rank, start_step)) for rank in range(plan.world)]
    steps = plan.steps_per_epoch - start_step
    return [[row for batches in by_rank for mb in batches[s * plan.accum:(s + 1) * plan.accum] for row in mb]
            for s in range(steps)]


def padding_fraction(plan: BatchPlan, lengths: tuple[int, ...], epoch: int = 0) -> float:
    """Share of right-padded micro-batch slots that hold padding."""
    slots = real = 0
    for rank in range(plan.world):
        for mb in plan.micro_batches(epoch, rank):
            if mb:
                slots += len(mb) * max(lengths[r] for r in mb)
                real += sum(lengths[r] for r in mb)
    return 1 - real / slots


LAYOUTS = [(256, 8, 1, 1), (1000, 4, 2, 2), (999, 3, 1, 4), (37, 2, 2, 1), (5000, 2, 1, 2)]


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("n,b,world,accum", LAYOUTS)
def test_every_row_exactly_once_per_epoch(n, b, world, accum, shuffle):
    plan = grouped(n, b, world, accum, shuffle=shuffle)
    for epoch in range(2):
        steps = global_batches(plan, epoch)
        assert len(steps) == plan.steps_per_epoch
        flat = [row for step in steps for row in step]
        assert sorted(flat) == list(range(n))
        # only the last step may be short
        assert all(len(step) == plan.global_batch for step in steps[:-1])


@pytest.mark.parametrize("n,b,world,accum", LAYOUTS)
def test_a_step_takes_neighbouring_lengths_of_one_window(n, b, world, accum):
    """Within a window, global batches are consecutive slices of the length-sorted rows: their ranges never overlap."""
    plan = grouped(n, b, world, accum, seed=4)
    lengths, g = plan.lengths, plan.global_batch
    base = BatchPlan(n, b, world, accum, seed=4, shuffle=True).epoch_order(1)  # the shuffled order before grouping
    window_of = {row: i // (g * GROUP_WINDOW_BATCHES) for i, row in enumerate(base)}
    steps = global_batches(plan, 1)
    for step in steps:
        assert len({window_of[row] for row in step}) == 1
    for i, a in enumerate(steps):
        for c in steps[i + 1:]:
            if window_of[a[0]] == window_of[c[0]]:
                lo_a, hi_a = min(lengths[r] for r in a), max(lengths[r] for r in a)
                lo_c, hi_c = min(lengths[r] for r in c), max(lengths[r] for r in c)
                assert hi_a <= lo_c or hi_c <= lo_a


def test_order_depends_only_on_seed_and_epoch():
    def order(seed: int, epoch: int) -> list[int]:
        return grouped(400, 4, 1, 2, seed=seed).epoch_order(epoch)

    assert order(7, 0) == order(7, 0)
    assert order(7, 0) != order(7, 1)
    assert order(7, 0) != order(8, 0)


def test_batch_order_is_shuffled_unless_sequential():
    lengths = skewed_lengths(400)
    step_max = lambda plan: [max(lengths[r] for r in step) for step in global_batches(plan, 0)]  # noqa: E731
    shuffled = step_max(BatchPlan(400, 8, 1, 1, seed=1, shuffle=True, lengths=lengths))
    sequential = step_max(BatchPlan(400, 8, 1, 1, seed=1, shuffle=False, lengths=lengths))
    assert sequential == sorted(sequential, reverse=True)  # one window, longest first
    assert shuffled != sorted(shuffled, reverse=True)
    assert sorted(shuffled) == sorted(sequential)  # same batches, another order


@pytest.mark.parametrize("n,b,world,accum", LAYOUTS)
def test_resume_from_start_step_is_the_tail_of_the_full_epoch(n, b, world, accum):
    plan = grouped(n, b, world, accum, seed=5)
    for rank in range(world):
        full = list(plan.micro_batches(3, rank))
        for k in range(plan.steps_per_epoch + 1):
            assert list(plan.micro_batches(3, rank, start_step=k)) == full[k * accum:]


@pytest.mark.parametrize("n,b,world,accum", [(256, 8, 1, 1), (2000, 4, 2, 1), (600, 2, 1, 4)])
def test_grouping_pads_far_less_than_random_batches(n, b, world, accum):
    lengths = skewed_lengths(n, seed=1)
    random_plan = BatchPlan(n, b, world, accum, seed=0, shuffle=True)
    grouped_plan = BatchPlan(n, b, world, accum, seed=0, shuffle=True, lengths=lengths)
    random_pad = sum(padding_fraction(random_plan, lengths, e) for e in range(3)) / 3
    grouped_pad = sum(padding_fraction(grouped_plan, lengths, e) for e in range(3)) / 3
    assert random_pad > 0.25  # the skewed distribution really wastes slots when batched at random
    assert grouped_pad < random_pad / 3


def test_lengths_must_match_rows():
    with pytest.raises(ValueError, match="3 row lengths for 4 rows"):
        BatchPlan(4, 2, 1, 1, seed=0, shuffle=True, lengths=(1, 2, 3))


def test_training_plan_follows_the_recipe():
    data = Dataset.from_dict({"input_ids": [[1] * n for n in (5, 50, 7, 60, 6, 55)]})
    rows = [[0], [1], [2], [3], [4], [5]]
    assert row_lengths(data, [[0, 2], [1]]) == [12, 50]
    plan = training_plan(Recipe(train_sampling_strategy="group_by_length", per_device_train_batch_size=3), data,
                         rows, world=1)
    assert plan.lengths == (5, 50, 7, 60, 6, 55) and plan.shuffle
    assert sorted(sorted(step) for step in global_batches(plan, 0)) == [[0, 2, 4], [1, 3, 5]]  # short with short
    assert training_plan(Recipe(train_sampling_strategy="random"), data, rows, world=1).lengths is None
    sequential = training_plan(Recipe(train_sampling_strategy="sequential"), data, rows, world=1)
    assert not sequential.shuffle and sequential.lengths is None


def test_grouping_packed_rows_is_refused():
    problems = validate(Recipe(packing=True, train_sampling_strategy="group_by_length"))
    assert any("group_by_length with packing=true" in p for p in problems)
    assert not validate(Recipe(packing=False, train_sampling_strategy="group_by_length"))
