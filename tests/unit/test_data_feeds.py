"""data/feeds.py: the `Feed` protocol the loop reads is what every feed provides (map-style rows, a stream, grpo's
rollouts), and the run's total steps are computed once, from the recipe and the plan."""

from __future__ import annotations

import inspect
import math
from types import SimpleNamespace

import pytest

from hftrain.data.batching import IndexedFeed
from hftrain.data.feeds import Feed, total_steps
from hftrain.data.streaming import StreamFeed
from hftrain.rl.grpo import Rollouts

METHODS = [name for name, member in vars(Feed).items() if inspect.isfunction(member) and not name.startswith("_")]


def test_the_protocol_names_what_the_loop_reads():
    assert sorted(METHODS) == ["batches", "pop_generation_seconds", "recorded_progress", "start", "state_dict",
                               "window_metrics"]


@pytest.mark.parametrize("feed", [IndexedFeed, StreamFeed, Rollouts])
def test_every_feed_has_the_protocols_methods_with_its_parameters(feed):
    for name in METHODS:
        wanted = list(inspect.signature(getattr(Feed, name)).parameters)
        assert list(inspect.signature(getattr(feed, name)).parameters) == wanted, f"{feed.__name__}.{name}"


def test_total_steps_is_max_steps_or_the_epochs_of_the_plan():
    plan = SimpleNamespace(steps_per_epoch=7)
    assert total_steps(SimpleNamespace(max_steps=3, num_train_epochs=2.0), plan) == 3
    assert total_steps(SimpleNamespace(max_steps=-1, num_train_epochs=2.5), plan) == math.ceil(2.5 * 7) == 18
    assert total_steps(SimpleNamespace(max_steps=5, num_train_epochs=1.0), SimpleNamespace()) == 5  # a stream
