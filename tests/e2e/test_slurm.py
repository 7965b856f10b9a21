"""The Slurm templates run as a two-node job on 127.0.0.1: srun and scontrol are test-only shims
(tests/launchers/slurm_shims) that start each node's command locally with SLURM_NODEID set."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, Run, free_port

pytestmark = pytest.mark.launch
SHIMS = REPO / "tests" / "launchers" / "slurm_shims"


@pytest.mark.parametrize("template", ["multi_node.sbatch", "multi_node_torchrun.sbatch"])
def test_sbatch_template_runs_two_nodes(tmp_path, template):
    env = {**os.environ, "PATH": f"{SHIMS}:{os.environ['PATH']}", "SLURM_NNODES": "2", "SLURM_JOB_ID": "4242",
           "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_JOB_NAME": "hftrain", "GPUS_PER_NODE": "1",
           "PYTHON": sys.executable, "PYTHONPATH": str(REPO), "MASTER_PORT": str(free_port()),
           "LOG_PREFIX": str(tmp_path / "logs" / "job"), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    out = tmp_path / "out"
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "slurm" / template), "recipes/tiny-chat.yaml", "--output_dir", str(out),
         "--max_steps", "4", "--logging_steps", "1", "--save_steps", "2", "--validation_split_percentage", "0"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    logs = {p.name: p.read_text() for p in (tmp_path / "logs").glob("*.log")}
    assert proc.returncode == 0, proc.stderr[-2000:] + "\n".join(t[-2000:] for t in logs.values())
    assert sorted(logs) == ["job-node0.log", "job-node1.log"]  # one log per node
    assert all("final model saved" in text for text in logs.values())  # each node's local main process reports
    run = Run(0, logs["job-node0.log"], "", out)
    info = run.state()["launch"]
    assert (info["distributed_type"], info["num_processes"], info["num_machines"], info["model_wrapper"]) == \
        ("MULTI_CPU", 2, 2, "DistributedDataParallel")
    assert [r["step"] for r in run.train_rows()] == [1, 2, 3, 4]
    assert run.state("checkpoint-2")["launch"]["num_machines"] == 2
