"""scripts/bench.py's report: the CUDA-only columns appear only when a contender measured CUDA memory."""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from types import SimpleNamespace

import pytest

from tests.conftest import REPO


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench", REPO / "scripts" / "bench.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench"] = module  # dataclasses look their module up while the script is executed
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("bench", None)


def report(results: dict) -> dict:
    machine = {"cpu": "test cpu", "cores": 2, "memory_gib": 4.0, "torch_threads": 1, "cuda": None}
    return {"command": "bench", "date": "today", "mode": "quick", "reps": 1, "load_before": [0], "load_after": [0],
            "environment": {"machine": machine, "versions": {"torch": "2.13.0"}}, "model_parameters": 1000,
            "data": {"chats": 4, "min_tokens": 3, "max_tokens": 9, "median_tokens": 5, "max_length": 16},
            "packed_batch": 2, "results": results, "targets": []}


def row(name: str, **extra) -> dict:
    return {"label": f"{name} setting", "ok_runs": 1, "failed_runs": 0, "padding": 0.25, "tokens_per_second": 100.0,
            "tokens_per_second_range": [90.0, 110.0], "time_to_first_step_s": 1.0, "wall_s": 2.0, "process_s": 2.5,
            "peak_rss_mb": 500.0, "steps": 3, "trained_tokens": 300, **extra}


def table_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("| ")]


def test_cpu_results_have_no_cuda_columns(bench):
    results = {"hftrain": row("hftrain"), "trainer": row("trainer")}
    assert bench.cuda_columns(results) == []
    header, rule, *rows = table_lines(bench.markdown(report(results)))
    assert header.endswith("| peak RSS (MB) | padding share |") and rule.count("---") == 9
    assert rows[0] == "| hftrain | hftrain setting | 3 | 100 (90-110) | 1.00x | 1.0 | 2.0 | 500 | 25% |"


def test_cuda_results_add_peak_memory_and_mfu_only_hftrain_reports_mfu(bench):
    results = {"hftrain": row("hftrain", peak_cuda_mb=2048.0, mfu=0.315),
               "trainer": row("trainer", peak_cuda_mb=3000.0),
               "trl_packing": {"label": "trl", "ok_runs": 0, "failed_runs": 1, "padding": None}}
    assert bench.cuda_columns(results) == ["peak_cuda_mb", "mfu"]
    header, rule, *rows = table_lines(bench.markdown(report(results)))
    assert header.endswith("| padding share | peak CUDA memory (MB) | MFU |") and rule.count("---") == 11
    assert rows[0].endswith("| 25% | 2,048 | 31.5% |")
    assert rows[1].endswith("| 25% | 3,000 | - |")  # MFU is not estimated for the other runners
    assert rows[2].endswith("| - | - | - |") and "failed" in rows[2]


def test_run_summary_carries_cuda_numbers_only_when_measured(bench):
    run = bench.Run("hftrain", 0, 0, start=0.0, exit=3.0, peak_rss_mb=10.0, log="log", steps=3, first_step_end=1.0,
                    last_step_end=2.0, trained_tokens=30, steady_tokens=20)
    assert "peak_cuda_mb" not in run.summary() and "mfu" not in run.summary()
    run.peak_cuda_mb, run.mfu = 100.0, 0.5
    assert run.summary()["peak_cuda_mb"] == 100.0 and run.summary()["mfu"] == 0.5
    table = bench.aggregate([run], {})
    assert table["hftrain"]["peak_cuda_mb"] == 100.0 and table["hftrain"]["mfu"] == 0.5


def test_a_budget_skips_the_runs_that_would_end_past_it(bench, monkeypatch, tmp_path):
    """--budget (a device call's time limit): a run starts only while the longest run so far would still end within
    it; the report lists the contenders it skipped, so a call cut short returns the runs that fit."""
    clock = [1000.0]
    monkeypatch.setattr(bench, "time", SimpleNamespace(time=lambda: clock[0], strftime=time.strftime))
    monkeypatch.setattr(bench, "build_model", lambda size, out: 1000)
    monkeypatch.setattr(bench, "make_chats", lambda size, model_dir, out: [3, 5, 9])

    def run_contender(name, rep, setup, max_steps=-1):
        start = clock[0]
        clock[0] += 100
        return bench.Run(name, rep, 0, start, clock[0], 500.0, "log", steps=3, first_step_end=start + 10,
                         last_step_end=start + 90, trained_tokens=300, steady_tokens=200)

    monkeypatch.setattr(bench, "run_contender", run_contender)
    names = ["trainer", "trl_padding", "trl_packing", "loop"]
    runs = bench.bench(names, bench.QUICK, 1, False, tmp_path, tmp_path / "out", "bench", budget=250)
    assert [r.contender for r in runs] == ["trainer", "trl_padding"]  # the third would end at 300 s
    written = json.loads((tmp_path / "out" / "benchmarks.json").read_text())
    assert written["skipped"] == ["trl_packing", "loop"] and set(written["results"]) == {"trainer", "trl_padding"}
    assert "Not run (past the --budget): trl_packing, loop" in (tmp_path / "out" / "benchmarks.md").read_text()
