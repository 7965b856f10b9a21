"""Shared test fixtures: the tiny offline model, data files, and a launcher for the real entry script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
PRESETS = REPO / "accelerate_configs"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A tiny random Llama built by the shipped script (checks the script and keeps tests off models/)."""
    out = tmp_path_factory.mktemp("tiny-llama")
    subprocess.run([sys.executable, str(REPO / "scripts" / "make_tiny_model.py"), str(out)], check=True,
                   capture_output=True)
    return out


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


ENTRY = REPO / "hftrain" / "finetune.py"


def launch_command(output_dir: Path, *args: str, preset: str = "cpu", processes: int | None = None,
                   launch_args: tuple[str, ...] = ("--main_process_port", "0"),  # a free port: no collisions
                   script: Path = ENTRY) -> list[str]:
    cmd = [str(BIN / "accelerate"), "launch", "--config_file", str(PRESETS / f"{preset}.yaml"), *launch_args]
    if processes is not None:
        cmd += ["--num_processes", str(processes)]
    return cmd + [str(script), "--output_dir", str(output_dir), *args]


def launch_env(env: dict | None = None) -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false",
            **(env or {})}


def launch(output_dir: Path, *args: str, preset: str = "cpu", processes: int | None = None,
           env: dict | None = None, check: bool = True, timeout: int = 600,
           launch_args: tuple[str, ...] = ("--main_process_port", "0"), script: Path = ENTRY) -> Run:
    """`accelerate launch --config_file accelerate_configs/<preset>.yaml hftrain/finetune.py --output_dir ...`."""
    cmd = launch_command(output_dir, *args, preset=preset, processes=processes, launch_args=launch_args,
                         script=script)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=launch_env(env), cwd=REPO, timeout=timeout)
    run = Run(proc.returncode, proc.stdout, proc.stderr, output_dir)
    if check and proc.returncode != 0:
        raise AssertionError(f"launch failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return run


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path
