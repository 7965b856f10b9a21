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


def exchange(start: float, received: int, sent: int, hidden: int = 8) -> dict:
    dims = [[received, hidden], [sent, hidden], [], [], [], [], []]
    return {**event("c10d::alltoall_base_", start, start + 1), "args": {"Input Dims": dims}}


def split_sizes(start: float) -> dict:  # ep 2, 4 experts: an [ep, experts / ep] tensor each way
    return {**event("c10d::alltoall_base_", start, start + 1), "args": {"Input Dims": [[2, 2], [2, 2], [], []]}}


def test_expert_load_is_the_busier_ranks_dispatched_rows_over_an_even_split(tmp_path):
    """Two MoE layers, 10 rows sent by each rank to each layer: layer 1 brings rank 0 14 rows and rank 1 6, layer 2
    brings 5 and 15. Only the exchange after the split sizes counts: the outputs' way back and the backward's
    exchanges (no split sizes before them) do not."""
    bench = load_bench()
    traces = []
    for rank, (first, second) in enumerate([(14, 5), (6, 15)]):
        trace = tmp_path / f"rank{rank}.pt.trace.json"
        trace.write_text(json.dumps({"traceEvents": [
            split_sizes(0), exchange(1, first, 10), exchange(3, 10, first),  # layer 1: dispatch, combine
            split_sizes(5), exchange(6, second, 10), exchange(8, 10, second),  # layer 2
            exchange(20, second, 10), exchange(22, 10, second),  # the backward of layer 2
            event("c10d::allreduce_", 30, 31),
        ]}))
        traces.append(trace)
    assert bench.dispatched_rows(traces[0], experts=4, ep=2) == [14, 5]
    assert bench.expert_load(traces, experts=4) == (14 + 15) / ((14 + 5 + 6 + 15) / 2)
