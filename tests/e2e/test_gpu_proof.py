"""The GPU proof's bundle and orchestration, checked on CPU (the GPU run itself needs a lent GPU machine).

The bundle is what travels to the GPU machine besides the repository (docs/gpu-proof.md): its manifest must
name the locked versions (constraints/lock.txt), fit the device's 64 MiB with the repository, and assemble from PyPI
into exactly the recorded bytes. The dry run goes through every part of `scripts/gpu_proof.py run` on CPU with
the tiny model.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import zipfile

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.launch
SCRIPT = REPO / "scripts" / "gpu_proof.py"
MANIFEST = json.loads((REPO / "scripts" / "gpu_bundle.json").read_text())


def gpu_proof():
    spec = importlib.util.spec_from_file_location("gpu_proof", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_proof"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def locked() -> dict[str, str]:
    """name -> version of every `name==version` line of constraints/lock.txt (the versions the suite runs on)."""
    text = (REPO / "constraints" / "lock.txt").read_text()
    return {m.group(1).lower().replace("_", "-"): m.group(2) for m in re.finditer(r"(?m)^([A-Za-z0-9_.-]+)==(\S+)$",
                                                                                   text)}


def test_carried_versions_are_the_locked_ones():
    """The GPU proof runs the suite's versions: each carried wheel is at its version in the lock, so what the proof
    shows on the GPU is what CI tests on CPU."""
    lock = locked()
    carried = {w["name"]: w["version"] for w in MANIFEST["wheels"]}
    assert {"transformers", "peft", "trl"} <= set(lock)
    for name, version in carried.items():
        if name in lock:
            assert version == lock[name], name
    # what the proof needs and the image lacks (docs/gpu-proof.md): all are carried at their locked version
    assert {"transformers", "tokenizers", "peft", "datasets", "trl", "liger-kernel", "bitsandbytes"} <= set(carried)
    assert "torch" not in carried  # the image's torch 2.11 is used: a CUDA torch wheel is GBs


def test_bundle_and_repository_fit_the_device_limit():
    bundle = sum(w["bytes"] for w in MANIFEST["wheels"])
    repository = gpu_proof().travelling_bytes()
    assert MANIFEST["budget_bytes"] == 64 * 2**20
    assert repository + bundle <= MANIFEST["budget_bytes"], (repository, bundle)


def test_bundle_assembles_to_the_manifest_and_installs(tmp_path):
    bundle, site = tmp_path / "bundle", tmp_path / "site"
    proc = subprocess.run([sys.executable, str(SCRIPT), "assemble", "--bundle", str(bundle)], capture_output=True,
                          text=True, timeout=600)
    if proc.returncode != 0 and "pip could not download" in proc.stderr:
        pytest.skip(f"assembling downloads from PyPI, which is not reachable here: {proc.stderr[:300]}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "of 64 MiB" in proc.stdout
    assert sorted(p.name for p in bundle.iterdir()) == sorted(w["file"] for w in MANIFEST["wheels"])
    (bnb,) = bundle.glob("bitsandbytes-*.whl")
    libraries = sorted(n.rsplit("/", 1)[-1] for n in zipfile.ZipFile(bnb).namelist() if n.endswith(".so"))
    assert libraries == ["libbitsandbytes_cpu.so", "libbitsandbytes_cuda130.so"]

    # what scripts/gpu_proof.sh does on the device: every wheel installs, without an index, into one folder (here
    # for the device's Python and platform, whatever this interpreter is)
    platforms = [arg for p in MANIFEST["platforms"] for arg in ("--platform", p)]
    install = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                              "--only-binary=:all:", "--python-version", MANIFEST["python_version"], "--implementation",
                              "cp", *platforms, "--target", str(site), *map(str, bundle.glob("*.whl"))],
                             capture_output=True, text=True)
    assert install.returncode == 0, install.stderr[-2000:]
    installed = {p.name.split("-")[0].lower() for p in site.glob("*.dist-info")}
    assert installed == {w["name"].replace("-", "_") for w in MANIFEST["wheels"]}


def test_run_without_cuda_is_refused_in_one_paragraph(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "run", "--parts", "env", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "no CUDA device" in proc.stderr and "--dry-run" in proc.stderr
    assert not (tmp_path / "gpu_proof.json").exists()


def test_dry_run_goes_through_every_part(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(SCRIPT), "run", "--dry-run", "--out", str(out), "--work",
                           str(tmp_path / "work")], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    report = json.loads((out / "gpu_proof.json").read_text())
    checks = report["checks"]
    assert report["dry_run"] and report["device"] == "CPU"
    assert {c["part"] for c in checks} == {"env", "correctness", "throughput", "varlen", "memory", "grpo_pp", "fp8"}
    assert {c["status"] for c in checks} <= {"pass", "skip", "info"}
    assert all(c["detail"] for c in checks if c["status"] == "skip")  # every skip says why
    exact = [c for c in checks if c["part"] == "correctness" and c["name"].startswith("one step = plain PyTorch")]
    assert [c["status"] for c in exact] == ["pass", "pass"]  # fp32 and bf16, 2 x 4 accumulation
    sharp = [c for c in checks if c["name"].startswith("tolerance")]
    assert all(c["numbers"]["error"] > 10 * e["numbers"]["error"] for c, e in zip(sharp, exact))
    packed = [c for c in checks if c["name"].startswith("packed rows") and "sdpa" in c["name"]]
    assert [c["status"] for c in packed] == ["pass", "pass"]
    bench = json.loads((out / "bench" / "benchmarks.json").read_text())
    assert set(bench["results"]) == {"hftrain_packed", "trl_packing"}
    assert {c["name"] for c in checks if c["part"] == "throughput" and c["status"] == "info"} >= set(bench["results"])
    # varlen, through the reference kernel that tests/launchers/varlen_on_cpu.py stands in for torch's CUDA-only one
    varlen = {c["name"]: c for c in checks if c["part"] == "varlen"}
    assert varlen["packed rows = separate examples, varlen, bf16"]["status"] == "pass"
    assert varlen["fp32 with varlen: refused by the preflight"]["status"] == "pass"
    step = varlen["one step = plain PyTorch, packed 2x2, bf16 (varlen chosen)"]
    assert (step["status"], step["numbers"]["attention"]) == ("pass", "varlen")
    levers = json.loads((out / "bench-varlen" / "benchmarks.json").read_text())
    assert set(levers["results"]) == {"hftrain_packed", "hftrain_gpu_sdpa"} and levers["skipped"] == []
    assert varlen["hftrain_packed"]["detail"].startswith("attention sdpa (block-diagonal mask over packed rows")
    assert varlen["lever: varlen -> sdpa's block-diagonal mask"]["status"] == "info"

    fp8 = {c["name"]: c["status"] for c in checks if c["part"] == "fp8"}
    assert fp8 == {"fp8 refused without float8 tensor cores (CPU)": "pass",
                   "bf16 against float8: tokens/s and memory": "skip"}

    page = (out / "gpu_proof.md").read_text()
    assert page.startswith("# GPU proof (dry run on CPU)")
    assert "| part | check | status | measured | bound | exit | s | detail |" in page
    assert all(f"| {c['part']} | {c['name']} | {c['status']} |" in page for c in checks)


def test_a_failed_contenders_log_comes_back_with_the_report(tmp_path):
    """The bench keeps a failed run's log in its working folder, which stays on the device machine: the report's
    folder gets its last lines (the 2026-11-27 H100 run lost hftrain_gpu's reason this way)."""
    log = tmp_path / "log.txt"
    log.write_text("".join(f"line {i}\n" for i in range(500)) + "RuntimeError: the reason\n")
    dest = tmp_path / "out" / "failed-x.log"
    dest.parent.mkdir()
    tail = gpu_proof().keep_failed_logs({"failed_logs": [str(log), str(tmp_path / "gone.txt")]}, dest)
    kept = dest.read_text().splitlines()
    assert kept[0] == f"== {log}" and kept[-1] == "RuntimeError: the reason" and len(kept) == 201
    assert tail.endswith("RuntimeError: the reason") and "line 499" in tail
