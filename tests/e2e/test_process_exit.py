"""How a distributed hftrain process ends (hftrain.parallel.launch.run_process): four gloo ranks with sub-groups, as
tensor parallelism with data-parallel copies makes them, exit with their own code, never an abort in interpreter
teardown, and still finish what Python's exit would have."""

import subprocess
import sys

from tests.conftest import REPO, launch_env

SCRIPT = REPO / "tests" / "e2e" / "launchers" / "gloo_exit.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4"]


def _launch(folder, code: int) -> subprocess.CompletedProcess:
    folder.mkdir()
    return subprocess.run([*TORCHRUN, str(SCRIPT), str(folder), str(code)], capture_output=True, text=True,
                          env=launch_env(None), cwd=REPO, timeout=300)


def test_ranks_exit_zero_after_finishing_python_exit_work(tmp_path):
    """Exit 0, no abort (the unguarded script aborted on 3 of 8 launches; the whole suite's distributed launches
    repeat the check), and every rank's non-daemon thread, atexit handler and unflushed stdout line got out."""
    proc = _launch(tmp_path / "run", 0)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "terminate called" not in proc.stderr
    for rank in range(4):
        assert (tmp_path / "run" / f"thread-{rank}").read_text() == "written"
        assert (tmp_path / "run" / f"atexit-{rank}").read_text() == "written"
        assert f"rank {rank} done" in proc.stdout


def test_a_failing_exit_code_reaches_the_launcher(tmp_path):
    """sys.exit(3) on every rank: torchrun sees exit code 3 from each rank, not a signal."""
    proc = _launch(tmp_path / "run", 3)
    assert proc.returncode != 0
    assert proc.stderr.count("exitcode  : 3") >= 1, proc.stderr[-3000:]
    assert "SIGABRT" not in proc.stderr and "terminate called" not in proc.stderr
    assert (tmp_path / "run" / "atexit-0").read_text() == "written"
