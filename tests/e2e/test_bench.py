"""Smoke test of scripts/bench.py --quick: every contender runs and the report is written (no timing checks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.launch
CONTENDERS = ["hftrain", "hftrain_accum", "hftrain_random", "hftrain_packed", "hftrain_varlen", "trainer",
              "trl_padding", "trl_packing", "trl_padding_free", "loop", "loop_accum"]


def test_quick_bench_writes_a_row_per_contender(tmp_path):
    out = tmp_path / "report"
    out.mkdir()
    # an existing page keeps its own text; only the marked results section is replaced
    (out / "benchmarks.md").write_text("# Notes kept\n\n<!-- bench results: begin (written by scripts/bench.py) -->\n"
                                       "stale table\n<!-- bench results: end -->\n\n## Levers kept\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "bench.py"), "--quick", "--out", str(out),
                           "--work", str(tmp_path / "work")], capture_output=True, text=True, cwd=tmp_path, env=env,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    report = json.loads((out / "benchmarks.json").read_text())
    assert report["mode"] == "quick" and report["environment"]["versions"]["trl"] == "1.16.0"
    results = report["results"]
    assert list(results) == CONTENDERS
    for name, row in results.items():
        assert row["ok_runs"] == 1 and row["failed_runs"] == 0, name
        for key in ("tokens_per_second", "time_to_first_step_s", "wall_s", "peak_rss_mb"):
            assert row[key] > 0, (name, key)
        assert row["wall_s"] >= row["time_to_first_step_s"], name
        assert row["steps"] >= 2 and 0 <= row["padding"] < 1, name
    # the same examples are trained by everyone, counted the same way (label != -100 after the shift)
    assert len({row["trained_tokens"] for row in results.values()}) == 1
    # packing and padding-free leave (next to) no padding; random padded batches do, grouping cuts it
    assert results["trl_packing"]["padding"] == 0 and results["trl_padding_free"]["padding"] == 0
    assert results["hftrain"]["padding"] < results["hftrain_random"]["padding"]
    assert results["loop"]["padding"] == pytest.approx(results["hftrain"]["padding"])  # the same batches
    assert results["loop_accum"]["padding"] == pytest.approx(results["hftrain_accum"]["padding"])
    # the same examples per step split into 4 micro-batches: smaller groups of closer lengths pad less
    assert results["hftrain_accum"]["padding"] <= results["hftrain"]["padding"]
    assert {t["hftrain_setting"] for t in report["targets"]} == {n for n in CONTENDERS if n.startswith("hftrain")}

    page = (out / "benchmarks.md").read_text()
    assert page.startswith("# Notes kept") and page.rstrip().endswith("## Levers kept") and "stale table" not in page
    for name in CONTENDERS:
        assert f"| {name} | " in page
    assert "--quick" in page and "torch 2.13.0" in page and "hftrain settings meeting every target:" in page
