"""scripts/bench_ep.py's reading of hftrain's profiler traces (the run itself is a benchmark, not tested): the share of
the traced steps' wall time covered by gloo's all-to-all, overlaps between gloo's threads counted once, time outside
the steps left out. Expected values worked out by hand from the intervals."""

from __future__ import annotations

import importlib.util
import json

from tests.conftest import REPO


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_ep", REPO / "scripts" / "bench_ep.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def event(name: str, start: float, end: float, tid: int = 1) -> dict:
    return {"ph": "X", "name": name, "ts": start, "dur": end - start, "tid": tid}


def test_the_all_to_all_share_counts_each_moment_once_within_the_traced_steps(tmp_path):
    bench = load_bench()
    trace = tmp_path / "rank0.pt.trace.json"
    trace.write_text(json.dumps({"traceEvents": [
        event("ProfilerStep#4", 0, 100, tid=0), event("ProfilerStep#5", 200, 300, tid=0),
        event("gloo:all_to_all", 10, 30), event("gloo:all_to_all", 20, 40),  # overlapping: 10-40
        event("gloo:all_to_all", 35, 50, tid=2),  # another gloo thread, overlapping: 10-50 in all
        event("gloo:all_to_all", 90, 110),  # half inside the first step: 90-100
        event("gloo:all_to_all", 150, 160),  # between the traced steps: not counted
        event("gloo:all_to_all", 250, 260),
        event("_c10d_functional::all_to_all_single", 60, 80, tid=0),  # the training thread's call, not gloo's work
        event("gloo:all_gather", 200, 220, tid=2), event("gloo:all_reduce", 210, 230, tid=2),
        {"ph": "i", "name": "gloo:all_to_all", "ts": 5},  # not a complete event
    ]}))
    all_to_all, others = bench.trace_shares(trace)
    assert all_to_all == (40 + 10 + 10) / 200
    assert others == 30 / 200


def test_union_of_intervals():
    bench = load_bench()
    assert bench.union([(0, 1), (2, 3)]) == 2
    assert bench.union([(0, 10), (2, 3), (5, 12)]) == 12
    assert bench.union([]) == 0
