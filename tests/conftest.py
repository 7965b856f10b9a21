"""Shared test fixtures: the tiny offline model, data files, and a launcher for the real entry script."""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib.util
import io
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

# One compute thread per process, for the suite and every run it starts (inherited through the environment), unless
# the caller set another: `make test` runs 2 xdist workers on the CI's 2 cores, and two processes of torch's default
# 2 threads each ran the same tiny runs 1.6x slower than two of 1 thread (oversubscribed; alone, 2 threads gain 8%).
# torchrun already gives its workers 1 thread; the single-process runs and the in-process tests now match them.
# Set before torch is imported (it reads the variable once).
os.environ.setdefault("OMP_NUM_THREADS", "1")

from hftrain.config import PRESET_DIR  # noqa: E402
from tests.warm.zygote import import_relevant  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
PRESETS = PRESET_DIR  # the shipped launch presets (accelerate_configs/ in the repository)
ENTRY = REPO / "hftrain" / "finetune.py"
TINY_CHAT = ["--config", str(REPO / "recipes" / "tiny-chat.yaml")]  # the embedded default recipe
# Test-only entry points (faults injected, FSDP2 forced on CPU): they live in the test tree, never in hftrain/
FSDP_LAUNCHER = REPO / "tests" / "launchers" / "fsdp2_on_cpu.py"
FAULTY_RANK = REPO / "tests" / "e2e" / "launchers" / "faulty_rank.py"
MAIN_CASES = REPO / "tests" / "e2e" / "main_cases.py"


def build_tiny_model(folder: Path, *args: str) -> Path:
    """`scripts/make_tiny_model.py folder *args`: a random model built by the shipped script, its `main(argv)` called
    in this process (a subprocess spent ~10 s of CPU importing torch and transformers again; the files are byte for
    byte the same). Its tokenizer is trained with one thread (the same merges), so that no process this one forks
    later inherits the tokenizers library's parallelism."""
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # its one line, "tiny llama with ... parameters"
            tiny_model_script().main([str(folder), *args])
    finally:
        if before is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before
    return folder


FILE_SECONDS = REPO / "tests" / "file_seconds.json"  # seconds each test file took in CI: scripts/file_seconds.py


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist, the longest test files first: `make test` hands out whole files (`--dist loadfile
    --no-loadscope-reorder`), in this order, to whichever worker is free, so a long file never starts while the
    other worker is finishing the short ones (longest-first keeps the two workers' ends close). Tests keep their
    order within a file. A file missing from FILE_SECONDS counts as one minute (end to end) or one second (unit).
    Runs without xdist are left in pytest's order."""
    if not hasattr(config, "workerinput"):  # only xdist workers collect for the scheduler
        return
    seconds = json.loads(FILE_SECONDS.read_text())

    def cost(item) -> float:
        path = item.nodeid.split("::", 1)[0]
        return seconds.get(path, 60.0 if path.startswith("tests/e2e/") else 1.0)

    items.sort(key=cost, reverse=True)  # stable: a file's tests stay together and in order


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A tiny random Llama built by the shipped script (checks the script and keeps tests off models/)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@functools.cache
def tiny_model_script():
    """scripts/make_tiny_model.py as a module (its builders and `main(argv)`), loaded once in this process."""
    spec = importlib.util.spec_from_file_location("make_tiny_model", REPO / "scripts" / "make_tiny_model.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


@pytest.fixture(scope="session")
def image_text_model(tmp_path_factory):
    """arch -> a tiny random image-text model folder (weights + processor) built once per session by
    `scripts/make_tiny_model.py FOLDER --arch ARCH --tokenizer models/tiny-llama`, in this process (no import cost)."""
    script = tiny_model_script()
    built: dict[str, Path] = {}

    def build(arch: str) -> Path:
        if arch not in built:
            folder = tmp_path_factory.mktemp(f"tiny-{arch}")
            script.main([str(folder), "--arch", arch, "--tokenizer", str(REPO / "models" / "tiny-llama")])
            built[arch] = folder
        return built[arch]

    return build


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    output_dir: Path

    def metrics(self) -> list[dict]:
        return [json.loads(line) for line in (self.output_dir / "metrics.jsonl").read_text().splitlines()]

    def train_rows(self) -> list[dict]:
        return [r for r in self.metrics() if "loss" in r]

    def eval_rows(self) -> list[dict]:
        return [r for r in self.metrics() if "eval_loss" in r]

    def state(self, folder: str = "final") -> dict:
        return json.loads((self.output_dir / folder / "hftrain_state.json").read_text())


WARM_START = REPO / "tests" / "warm" / "start.py"


class WarmInterpreter:
    """This pytest process's zygote (tests/warm/zygote.py): torch, transformers and hftrain imported once, each run
    of an entry script forked from it (`tests/warm/start.py SCRIPT ...` in place of `python SCRIPT ...`, also as the
    script `accelerate launch` starts on each rank). Started at the first run, with the suite's environment; when
    that changes in a variable read at import (the test modules' imports set some, e.g. lm_eval's
    HF_XET_HIGH_PERFORMANCE), a new one replaces it. A run with its own such variable (a test's HF_HOME) gets a fresh
    interpreter, as every run does with HFTRAIN_TEST_FRESH=1 (as users start them)."""

    def __init__(self):
        self.process, self.socket, self.key = None, None, None

    def environment(self, env: dict[str, str]) -> dict[str, str]:
        """The variable that sends the runs of `env` to the zygote (started now if needed), {} for none."""
        suite = import_relevant(base_env())
        if os.environ.get("HFTRAIN_TEST_FRESH") == "1" or import_relevant(env) != suite:
            return {}
        if self.key != suite:
            if self.process is not None:
                self.process.kill()
            folder = Path(tempfile.mkdtemp(prefix="hftrain-zygote-"))
            log = open(folder / "log", "w")  # noqa: SIM115 - its import-time output goes to each run; this is the rest
            print(f"started for {sorted(suite.items())}", file=log, flush=True)
            self.process = subprocess.Popen([sys.executable, str(WARM_START.with_name("zygote.py")),
                                             str(folder / "socket")], cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                                            stdout=log, stderr=log)
            atexit.register(self.process.kill)
            self.socket, self.key = folder / "socket", suite
            deadline = time.monotonic() + 180
            while not self.socket.exists() and self.process.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
        return {"HFTRAIN_TEST_ZYGOTE": str(self.socket)} if self.process.poll() is None else {}


WARM = WarmInterpreter()


def entry(script: Path, fresh: bool) -> list[str]:
    """The argv that runs `script`: through tests/warm/start.py unless `fresh` (a test that freezes or inspects the
    training process itself) or HFTRAIN_TEST_FRESH=1."""
    return [str(script)] if fresh or os.environ.get("HFTRAIN_TEST_FRESH") == "1" else [str(WARM_START), str(script)]


def launch_command(output_dir: Path, *args: str, preset: str = "cpu", processes: int | None = None,
                   launch_args: tuple[str, ...] = ("--main_process_port", "0"),  # a free port: no collisions
                   script: Path = ENTRY, fresh: bool = False) -> list[str]:
    cmd = [str(BIN / "accelerate"), "launch", "--config_file", str(PRESETS / f"{preset}.yaml"), *launch_args]
    if processes is not None:
        cmd += ["--num_processes", str(processes)]
    return cmd + [*entry(script, fresh), "--output_dir", str(output_dir), *args]


def base_env() -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false"}


def launch_env(env: dict | None = None) -> dict:
    full = {**base_env(), **(env or {})}
    return {**full, **WARM.environment(full)}


def launch(output_dir: Path, *args: str, preset: str = "cpu", processes: int | None = None,
           env: dict | None = None, check: bool = True, timeout: int = 600,
           launch_args: tuple[str, ...] = ("--main_process_port", "0"), script: Path = ENTRY,
           fresh: bool = False) -> Run:
    """`accelerate launch --config_file accelerate_configs/<preset>.yaml hftrain/finetune.py --output_dir ...`."""
    cmd = launch_command(output_dir, *args, preset=preset, processes=processes, launch_args=launch_args,
                         script=script, fresh=fresh)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=launch_env(env), cwd=REPO, timeout=timeout)
    run = Run(proc.returncode, proc.stdout, proc.stderr, output_dir)
    if check and proc.returncode != 0:
        raise AssertionError(f"launch failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return run


def run_script(output_dir: Path, *args: str, env: dict | None = None, check: bool = True, timeout: int = 600,
               script: Path = ENTRY, fresh: bool = False) -> Run:
    """`python hftrain/finetune.py --output_dir ...`: one process without accelerate's launcher (~5 s less per run).

    For single-process runs whose property has nothing to do with the launcher; every preset is still run through
    `launch` by some test.
    """
    cmd = [sys.executable, *entry(script, fresh), "--output_dir", str(output_dir), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=launch_env(env), cwd=REPO, timeout=timeout)
    run = Run(proc.returncode, proc.stdout, proc.stderr, output_dir)
    if check and proc.returncode != 0:
        raise AssertionError(f"run failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return run


def run_main_cases(cases: dict[str, tuple[list[str], dict]], workdir: Path, timeout: int = 900,
                   process_env: dict | None = None) -> dict[str, Run]:
    """{name: (argv, extra environment)} -> {name: Run}: `hftrain.finetune.main(argv)` per case, all cases in one
    Python process (tests/e2e/main_cases.py), for refusals that never reach training. The environment is minimal:
    nothing of the caller's (no PYTHONPATH, no tracker settings) reaches the entry point; `process_env` adds to it
    what libraries read once at import (e.g. HF_HOME)."""
    spec, results = workdir / "cases.json", workdir / "results.json"
    spec.write_text(json.dumps({name: {"argv": argv, "env": env} for name, (argv, env) in cases.items()}))
    proc = subprocess.run([sys.executable, str(MAIN_CASES), str(spec), str(results)], capture_output=True, text=True,
                          cwd=REPO, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", **(process_env or {})},
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(results.read_text())
    return {name: Run(r["exit_code"], "", r["stderr"], Path(cases[name][0][cases[name][0].index("--output_dir") + 1]))
            for name, r in out.items()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path
