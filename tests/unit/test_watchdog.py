"""hftrain.watchdog: the verdict on heartbeats (who holds a job up), two ranks' watchdogs exchanging heartbeats through
one store, the automatic hang_timeout and the NCCL settings. The launched proofs (a frozen rank, a frozen node, a
stalled step) are in tests/e2e/test_reliability.py."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from hftrain import watchdog as wd
from hftrain.watchdog import Verdict, Watchdog, judge


def rec(step: int, lap: int = 0, window: str = "", done: bool = False, node: int = 0, idle: float = 0.0) -> dict:
    """A heartbeat record; `idle`: what the rank said of its training thread (seconds without moving)."""
    return {"step": step, "lap": lap, "where": "forward" if lap else "", "window": window, "done": done,
            "node": node, "host": "h", "idle": idle}


def test_nothing_is_named_while_every_rank_beats_and_moves_within_the_timeout():
    records = {0: rec(5, 3), 1: rec(5, 2)}
    assert judge(records, {0: 0.5, 1: 4.9}, {0: 4.9, 1: 4.9}, timeout=5) is None


def test_a_silent_rank_is_named_first_even_when_every_rank_stands_still():
    records = {0: rec(5, 3), 1: rec(5, 3), 2: rec(5, 3)}
    assert judge(records, {0: 0, 1: 0.4, 2: 7.0}, {0: 9, 1: 9, 2: 9}, timeout=5) == Verdict("silent", [2], 7.0)


def test_the_rank_behind_the_others_is_named_when_the_job_stands_still():
    """Rank 1 is stuck in its forward (lap 2: after data_wait and token_sync); ranks 0 and 2 went on to the
    backward's all-reduce (lap 3) and wait there: only rank 1 is named, by every observer."""
    records = {0: rec(4, 3, idle=6.0), 1: rec(4, 2, idle=6.2), 2: rec(4, 3, idle=5.9)}
    verdict = judge(records, {0: 0, 1: 0.3, 2: 0.2}, {0: 6.0, 1: 6.5, 2: 6.1}, timeout=5)
    assert verdict == Verdict("stalled", [1], 6.5)
    behind_a_step = {0: rec(5, 0), 1: rec(4, 4, idle=6)}  # rank 1 has not finished step 5's optimizer
    assert judge(behind_a_step, {0: 0, 1: 0}, {0: 6, 1: 6}, timeout=5).ranks == [1]


def test_a_frozen_rank_whose_stall_is_seen_before_its_silence_is_named_silent():
    """SIGSTOP freezes a rank's heartbeat thread a moment after its last progress, so its stall passes the timeout
    first (CI saw 'made no progress for 5s' for a frozen rank); a heartbeat older than a few intervals says the
    process itself has stopped. A stalled rank whose heartbeat thread still beats stays 'stalled'."""
    records = {0: rec(6, 3), 1: rec(2, 2, idle=5.0)}
    frozen = judge(records, {0: 0, 1: 4.8}, {0: 0.1, 1: 5.2}, timeout=5, stale=1.5)
    assert frozen == Verdict("silent", [1], 4.8)
    alive = judge(records, {0: 0, 1: 0.4}, {0: 0.1, 1: 5.2}, timeout=5, stale=1.5)
    assert alive == Verdict("stalled", [1], 5.2)


def test_a_rank_that_froze_after_quick_steps_the_others_did_not_sample_is_named_silent_not_stalled():
    """CI's case: rank 1 slept 3 s in step 3 (the others sampled it there, beating), then went through steps 3-6
    between two samples and was frozen; to rank 0 it stood at step 3 for 5 s with a beat 1 s old. Its own last
    heartbeat said 2.4 s without moving: no verdict yet, and once its beat is stale it is named silent."""
    records = {0: rec(6, 3), 1: rec(2, 2, idle=2.4)}
    assert judge(records, {0: 0, 1: 1.0}, {0: 5.1, 1: 5.2}, timeout=5, stale=2.5) is None
    assert judge(records, {0: 0, 1: 2.6}, {0: 6.7, 1: 6.8}, timeout=5, stale=2.5) == Verdict("silent", [1], 2.6)


def test_every_rank_is_named_when_all_stand_at_one_point():
    records = {0: rec(4, 3, idle=6), 1: rec(4, 3, idle=5.2)}
    assert judge(records, {0: 0, 1: 0}, {0: 6, 1: 5.5}, timeout=5) == Verdict("stuck", [0, 1], 6)


def test_a_single_process_stalled_in_its_step_is_named_as_stalled():
    assert judge({0: rec(7, 4, idle=9)}, {0: 0}, {0: 9}, timeout=5) == Verdict("stalled", [0], 9)


def test_windows_count_as_progress_and_finished_ranks_are_never_named():
    evaluating = {0: rec(4, 0, window="evaluation"), 1: rec(4, 0, window="evaluation")}
    assert judge(evaluating, {0: 0, 1: 0}, {0: 600, 1: 600}, timeout=5) is None
    done = {0: rec(10, done=True), 1: rec(10, 1)}  # rank 0 left the loop; its beats stopped
    assert judge(done, {0: 60, 1: 0}, {0: 60, 1: 1}, timeout=5) is None


def pair(tmp_path, timeout=5.0, checkpoint=None):
    store = torch.distributed.HashStore()
    return [Watchdog(lambda: store, r, 2, r, timeout, tmp_path, lambda d: checkpoint, interval=0.1) for r in (0, 1)]


def test_two_watchdogs_through_one_store_name_a_frozen_peer_with_its_node(tmp_path):
    w0, w1 = pair(tmp_path, checkpoint=tmp_path / "checkpoint-4")
    now = time.monotonic()
    for w in (w0, w1):
        w.step_done(4)
    for t in (now, now + 1):
        w1._observe(t)
        w0._observe(t)  # sees rank 1's beat of time t
    assert w0.check(now + 1) is None
    w0.lap("data_wait")  # rank 0 moves on; rank 1 (frozen) publishes nothing more
    w0._observe(now + 6.5)
    line = w0.check(now + 6.5)
    assert line.startswith("hftrain: error: hang detected by rank 0: rank 1 (node 1, host ")
    assert "sent no heartbeat for 6s" in line and "(hang_timeout 5s)" in line  # 5.5 s, rounded
    assert f"Last finished step heard from each rank: 0: 4, 1: 4; last complete checkpoint {tmp_path}/checkpoint-4 " \
        in line
    assert "\n" not in line


def test_a_rank_stalled_in_its_step_is_named_by_itself_and_by_its_peer(tmp_path):
    w0, w1 = pair(tmp_path)
    for w in (w0, w1):
        w.step_done(2)
        w.lap("data_wait")
        w.lap("token_sync")
    w0.lap("forward")  # rank 0 reaches the backward's all-reduce; rank 1's forward hangs
    start = time.monotonic()
    for t in (start, start + 0.5, start + 6, start + 6.2):  # both threads keep beating
        w0._observe(t)
        w1._observe(t)
    for w in (w0, w1):
        line = w.check(start + 6.2)
        assert f"hang detected by rank {w.rank}: rank 1 (node 1, host " in line
        assert "made no progress for 6s in training step 3 after token_sync while the other ranks wait" in line


def test_nothing_is_judged_before_the_first_step(tmp_path):
    w0, w1 = pair(tmp_path)
    now = time.monotonic()
    w0._observe(now)
    w1._observe(now)
    w0._observe(now + 600)  # a start-up of 10 minutes: rank 1 loading a dataset, its thread not yet beating
    assert w0.check(now + 600) is None


def test_the_automatic_timeout_is_the_larger_of_five_minutes_and_ten_median_steps(tmp_path):
    (w,) = [Watchdog(torch.distributed.HashStore, 0, 1, 0, None, tmp_path, lambda d: None)]
    assert w.timeout == 300 and w.interval == 5
    w.step_times.extend([20.0, 45.0, 50.0, 400.0])  # the median (47.5 s) x 10
    assert w.timeout == 475
    assert Watchdog(torch.distributed.HashStore, 0, 1, 0, 30, tmp_path, lambda d: None).timeout == 30


def test_metrics_give_each_ranks_heartbeat_lag(tmp_path):
    w0, w1 = pair(tmp_path)
    now = time.monotonic()
    w1._observe(now)
    w0._observe(now)
    w0._observe(now + 2)  # rank 1 published nothing since: 2 s behind
    metrics = w0.metrics()
    assert metrics["hang_timeout"] == 5 and metrics["rank0/heartbeat_lag"] == 0
    assert 2 <= metrics["rank1/heartbeat_lag"] < 3


def test_nccl_settings_come_from_hang_timeout_and_leave_the_users(monkeypatch):
    assert wd.nccl_environment(120) == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_ENABLE_MONITORING": "1",
                                        "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "120"}
    assert wd.nccl_environment(None)["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"] == "300"
    environ = {"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "900"}
    if not torch.cuda.is_available():
        assert wd.set_nccl_environment(120, environ) == {}  # no NCCL: nothing set
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    assert wd.set_nccl_environment(120, environ) == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
                                                     "TORCH_NCCL_ENABLE_MONITORING": "1",
                                                     "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "900"}


@pytest.mark.parametrize("value", [0])
def test_hang_timeout_zero_turns_the_watchdog_off(value, tmp_path):
    class Accelerator:
        num_processes, process_index = 2, 0

    class Recipe:
        hang_timeout, output_dir = value, str(tmp_path)

    off = Watchdog.for_run(Accelerator(), Recipe(), lambda d: None)
    assert isinstance(off, wd.Unwatched)
    with off.watching(), off.window("evaluation"):
        off.lap("forward")
        off.step_done(1)
    assert off.metrics() == {}


def test_a_store_that_does_not_answer_is_retried_and_named_once_silent_for_the_timeout(tmp_path, monkeypatch):
    """The store (node 0's launcher) refuses at first: the watchdog is still made and its thread connects again; once
    the store stays silent for hang_timeout after the first step, the job stops naming it."""
    monkeypatch.setenv("MASTER_ADDR", "node0")
    monkeypatch.setenv("MASTER_PORT", "29500")
    store, answering = torch.distributed.HashStore(), [False]

    def connect():
        if not answering[0]:
            raise RuntimeError("connection refused")
        return store

    w = Watchdog(connect, 1, 2, 1, 5.0, tmp_path, lambda d: None, interval=0.1)
    answering[0] = True
    now = time.monotonic()
    w._observe(now)
    assert w.store is store and w.store_ok == now
    w.step_done(3)
    answering[0] = False
    w.store = None  # the connection broke
    w._observe(now + 7)
    line = w.check(now + 7)
    assert line.startswith("hftrain: error: hang detected by rank 1: the job's rendezvous store at node0:29500 did "
                           "not answer for 7s: the machine that hosts it (node 0's launcher under a static rendezvous)")
    assert "This rank finished step 3; no complete checkpoint in" in line


def test_a_store_call_that_never_returns_does_not_stop_the_judge(tmp_path):
    """Node 0 frozen: its store accepts a call and never answers. The heartbeat thread is stuck in that call; the
    judging thread still names the store after hang_timeout (found by freezing node 0 of a 2-node job, whose node 1
    had waited in its collective while its single watchdog thread waited on the store)."""
    frozen, lines = threading.Event(), []

    class Store(dict):
        def set(self, key, value):
            if frozen.is_set():
                threading.Event().wait()  # never returns
            self[key] = value

        def check(self, keys):
            return all(k in self for k in keys)

        def get(self, key):
            return self[key]

    store = Store()
    w = Watchdog(lambda: store, 1, 2, 1, 0.6, tmp_path, lambda d: None, interval=0.05)
    w._stop_job = lines.append  # instead of printing and leaving the test process
    started = time.monotonic()
    with w.watching():
        w.step_done(1)
        frozen.set()
        while not lines and time.monotonic() - started < 10:
            time.sleep(0.05)
    assert lines and "the job's rendezvous store at" in lines[0] and time.monotonic() - started < 5
