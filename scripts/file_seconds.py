"""Seconds per test file, from a JUnit report of the suite, into tests/file_seconds.json (the order `make test`
hands files to its two workers: longest first, see tests/conftest.py).

    .venv/bin/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder tests --junitxml=/tmp/suite.xml
    python scripts/file_seconds.py /tmp/suite.xml [> tests/file_seconds.json]

A test's time is its setup + call + teardown, so a module-scoped run counts towards the file that uses it. Only the
order matters: a noisy machine scales every file alike, and a file missing from the JSON counts as one minute (end to
end) or one second (unit).
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_file(classname: str) -> str:
    """tests.e2e.test_x (or tests.e2e.test_x.TestClass) -> tests/e2e/test_x.py"""
    parts = classname.split(".")
    for end in range(len(parts), 0, -1):
        path = "/".join(parts[:end]) + ".py"
        if (REPO / path).is_file():
            return path
    raise ValueError(f"no test file for {classname}")


def file_seconds(report: str) -> dict[str, float]:
    seconds: dict[str, float] = defaultdict(float)
    for case in ET.parse(report).getroot().iter("testcase"):
        seconds[test_file(case.get("classname", ""))] += float(case.get("time", 0))
    return {path: round(s, 1) for path, s in sorted(seconds.items(), key=lambda item: -item[1])}


if __name__ == "__main__":
    print(json.dumps(file_seconds(sys.argv[1]), indent=1))
