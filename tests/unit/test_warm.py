"""tests/warm: a script run through the warm interpreter behaves as in a fresh one (argv, environment, working
directory, umask, sys.path, streams, exit status, signals), and a stand-in killed takes its child with it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.conftest import WARM_START, launch_env

SCRIPT = """
import json, os, signal, sys, time
mode = sys.argv[1]
if mode == "report":
    umask = os.umask(0)
    print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "umask": umask, "path0": sys.path[0],
                      "var": os.environ.get("WARM_VAR"), "torch_loaded": "torch" in sys.modules, "main": __name__,
                      "file": __file__}))
    print("to stderr", file=sys.stderr)
    sys.exit(3)
if mode == "hub":  # read once at import by huggingface_hub
    import huggingface_hub.constants
    print(huggingface_hub.constants.HF_HOME, "torch" in sys.modules)
if mode == "raise":
    raise ValueError("boom")
if mode == "signal":
    signal.signal(signal.SIGTERM, lambda *a: (print("got SIGTERM", flush=True), sys.exit(7)))
    print("ready", flush=True)
    time.sleep(60)
if mode == "sleep":
    print(os.getpid(), flush=True)
    time.sleep(600)
"""


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text(SCRIPT)
    return path


def run(argv, cwd, env=None, warm=True):
    cmd = [sys.executable, *([str(WARM_START)] if warm else []), *map(str, argv)]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=launch_env(env), timeout=120)


@pytest.mark.skipif(os.environ.get("HFTRAIN_TEST_FRESH") == "1", reason="HFTRAIN_TEST_FRESH=1: no warm interpreter")
def test_a_warm_run_reports_what_a_fresh_one_does(script, tmp_path):
    env = {"WARM_VAR": "set for this run"}
    before = os.umask(0o007)  # inherited by a fresh process; the zygote's children take the stand-in's
    try:
        warm = run([script, "report", "x"], tmp_path, env)
        fresh = run([script, "report", "x"], tmp_path, env, warm=False)
    finally:
        os.umask(before)
    assert (warm.returncode, fresh.returncode) == (3, 3)
    assert warm.stderr.endswith("to stderr\n") and fresh.stderr.endswith("to stderr\n")
    got, expected = (json.loads(r.stdout.splitlines()[-1]) for r in (warm, fresh))
    assert got.pop("torch_loaded") and not expected.pop("torch_loaded")  # the warm one did come from the zygote
    assert got == expected == {"argv": [str(script), "report", "x"], "cwd": str(tmp_path), "umask": 0o007,
                                "path0": str(tmp_path),
                                "var": "set for this run", "main": "__main__", "file": str(script)}


def test_an_uncaught_exception_exits_1_with_its_traceback(script, tmp_path):
    warm = run([script, "raise"], tmp_path)
    assert warm.returncode == 1 and warm.stderr.rstrip().endswith("ValueError: boom")


def test_an_environment_read_at_import_gets_a_fresh_interpreter(script, tmp_path):
    hf_home = str(tmp_path / "hf")
    own = run([script, "hub"], tmp_path, {"HF_HOME": hf_home})
    assert own.returncode == 0 and own.stdout.split() == [hf_home, "False"]
    env = {**launch_env(), "HF_HOME": hf_home}  # sent to the suite's zygote, imported without it: refused
    refused = subprocess.run([sys.executable, str(WARM_START), str(script), "hub"], capture_output=True, text=True,
                             cwd=tmp_path, env=env, timeout=120)
    assert refused.returncode == 0 and refused.stdout.split() == [hf_home, "False"]


@pytest.mark.skipif(os.environ.get("HFTRAIN_TEST_FRESH") == "1", reason="HFTRAIN_TEST_FRESH=1: no warm interpreter")
def test_signals_reach_the_child_and_a_killed_stand_in_takes_it_along(script, tmp_path):
    cmd = [sys.executable, str(WARM_START), str(script), "signal"]
    stand_in = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=tmp_path, env=launch_env())
    assert stand_in.stdout.readline() == "ready\n"
    stand_in.send_signal(signal.SIGTERM)
    assert stand_in.wait(timeout=30) == 7 and stand_in.stdout.read() == "got SIGTERM\n"

    cmd = [sys.executable, str(WARM_START), str(script), "sleep"]
    stand_in = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=tmp_path, env=launch_env())
    child = psutil.Process(int(stand_in.stdout.readline()))
    assert child.pid != stand_in.pid and child.is_running()
    stand_in.kill()
    stand_in.wait(timeout=30)
    deadline = time.monotonic() + 30
    while child.is_running() and child.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
