"""`hftrain env` and the version gates: TESTED is what constraints/lower.txt, constraints/lock.txt and
constraints/newest.txt say (so the range it prints is the one CI and `make test-newest` test), pyproject.toml's floors
are the lower end, and a feature that needs a newer transformers is refused in one paragraph naming the version that
brings it."""

from __future__ import annotations

import importlib
import os
import pkgutil
import re
import subprocess
import sys
from itertools import chain

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

from hftrain import compat, versions
from tests.conftest import REPO


def exact(path) -> dict[str, str]:
    return {m.group(1).lower().replace("_", "-"): m.group(2)
            for m in re.finditer(r"(?m)^([A-Za-z0-9_.-]+)==(\S+)$", path.read_text())}


def test_the_tested_range_is_the_lower_end_and_the_newer_of_the_lock_and_the_newest_end():
    lower, lock = exact(REPO / "constraints" / "lower.txt"), exact(REPO / "constraints" / "lock.txt")
    newest = exact(REPO / "constraints" / "newest.txt")
    floors = {}
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]  # the heavy parts TESTED also covers, declared as extras
    for requirement in [*project["dependencies"], *extras["deepspeed"], *extras["quantization"], *extras["wandb"]]:
        if match := re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9.]+)(,<[0-9.]+)?", requirement.split(";")[0].strip()):
            floors[match.group(1).lower()] = match.group(2)
    for package, (low, high) in versions.TESTED.items():
        assert high == max(lock[package], newest.get(package, lock[package]), key=Version), package
        assert low == floors[package], package  # the declared floor
        if package != "torch":  # the lower end runs torch 2.13.0, the only CPU build here (docs/versions.md)
            assert lower[package] == low, package
    assert set(lower) <= set(floors), "every package of the lower end is a declared dependency"


def test_placement_against_the_range():
    assert versions.placement("transformers", "5.17.0") == "in range"
    assert versions.placement("transformers", "5.23.0") == "in range"
    assert versions.placement("transformers", "5.24.0") == "in range"
    assert versions.placement("transformers", "5.25.0") == "in range"  # the lock's
    assert versions.placement("transformers", "5.26.0") == "newer than tested"
    assert versions.placement("torch", "2.14.1+cu130") == "in range"
    assert versions.placement("torch", "2.15.0") == "newer than tested"
    assert versions.placement("transformers", "5.16.1").startswith("OLDER than tested")
    assert versions.placement("torch", "2.13.0+cpu") == "in range"
    assert versions.placement("torch", None) == "not installed"


def test_a_gated_feature_names_the_version_that_brings_it(monkeypatch):
    monkeypatch.setattr(versions, "installed", lambda package: {"transformers": "5.19.0"}.get(package))
    problem = versions.feature_problem("expert_parallel")
    assert problem.startswith("expert parallelism (ep_size > 1) needs transformers >= 5.23.0")
    assert "this environment has transformers 5.19.0: pip install 'transformers>=5.23.0'" in problem
    monkeypatch.setattr(versions, "installed", lambda package: {"transformers": "5.23.0"}.get(package))
    assert versions.feature_problem("expert_parallel") is None
    monkeypatch.setattr(versions, "installed", lambda package: {"transformers": "5.22.0"}.get(package))
    assert "needs transformers >= 5.23.0" in versions.feature_problem("tensor_parallel")


def test_the_preflight_refuses_tensor_parallelism_on_an_older_transformers(monkeypatch):
    from hftrain.config import Recipe
    from hftrain.parallel.launch import Launch
    from hftrain.preflight import tensor_parallel_problems

    monkeypatch.setattr(versions, "installed", lambda package: {"transformers": "5.17.0"}.get(package))
    launch = Launch(kind="ddp", world=2, per_node=2)
    (problem,) = tensor_parallel_problems(Recipe(tp_size=2), launch)
    assert problem.startswith("tp_size=2: tensor parallelism (tp_size > 1) needs transformers >= 5.23.0")
    assert tensor_parallel_problems(Recipe(tp_size=1), launch) == []


def test_hftrain_env_prints_the_installed_versions_and_the_features():
    out = subprocess.run([sys.executable, "-m", "hftrain", "env"], capture_output=True, text=True, check=True,
                         cwd=REPO).stdout
    import transformers

    assert re.search(rf"(?m)^transformers +{re.escape(transformers.__version__)} +5\.17\.0 \.\. 5\.25\.0", out)
    assert "features (yes: available here; no: what it needs)" in out
    expected = "yes " if versions.available("expert_parallel") else "no   expert parallelism"
    assert expected in out
    as_json = subprocess.run([sys.executable, "-m", "hftrain", "env", "--json"], capture_output=True, text=True,
                             check=True, cwd=REPO).stdout
    import json

    info = json.loads(as_json)
    assert info["packages"]["transformers"]["version"] == transformers.__version__
    assert set(info["features"]) == set(versions.FEATURES)


def declared_ranges() -> dict[str, SpecifierSet]:
    """pyproject.toml's range of every requirement, the extras' too, and of Python itself ("python")."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    ranges = {"python": SpecifierSet(project["requires-python"])}
    for requirement in [*project["dependencies"], *chain.from_iterable(project["optional-dependencies"].values())]:
        parsed = Requirement(requirement)
        ranges.setdefault(canonicalize_name(parsed.name), parsed.specifier)
    return ranges


def compat_uses() -> dict[str, list[compat.Use]]:
    """Every use of a library's internals, by library: the `Use` values the hftrain.compat modules define."""
    uses: dict[str, list[compat.Use]] = {}
    for module_info in pkgutil.iter_modules(compat.__path__):
        module = importlib.import_module(f"hftrain.compat.{module_info.name}")
        for value in vars(module).values():
            if isinstance(value, compat.Use):
                uses.setdefault(canonicalize_name(value.library), []).append(value)
    return uses


def bound(specifier: SpecifierSet, operator: str) -> Version:
    (version,) = [Version(spec.version) for spec in specifier if spec.operator == operator]
    return version


# torch's floor is the lent GPU image's 2.11 (docs/versions.md); every use of its internals is a parallel feature
# (pipeline V-schedule evaluation, ring attention, FSDP2 x TP resume, pipeline buffers) that the preflight refuses
# below 2.13, in one paragraph, before anything loads
# (tests/unit/test_compat.py::test_the_preflight_refuses_a_library_outside_the_uses_this_run_makes)
FEATURE_FLOORS = {"torch"}


def test_the_declared_ranges_are_the_ranges_the_compat_gates_accept():
    """What `pip install hftrain` resolves must run: for every library whose internals hftrain uses, pyproject.toml's
    range ends where the checked versions end (no newer release admitted that a gate refuses, none refused that the
    gates admit) and starts where they start."""
    declared, uses = declared_ranges(), compat_uses()
    assert {"python", "torch", "transformers", "accelerate", "datasets", "deepspeed", "liger-kernel"} <= set(uses)
    for library, library_uses in uses.items():
        specifier = declared[library]
        caps = {bound(SpecifierSet(use.versions), "<") for use in library_uses}
        assert len(caps) == 1, f"{library}: its uses end at different versions {sorted(map(str, caps))}"
        (cap,) = caps
        pins = [Version(spec.version) for spec in specifier if spec.operator == "=="]
        if pins:  # an extra pinned exactly (liger-kernel): the pin is a checked version
            assert all(SpecifierSet(use.versions).contains(pin) for pin in pins for use in library_uses), library
            continue
        assert bound(specifier, "<") == cap, f"{library}: pyproject.toml declares {specifier}, its gates end at <{cap}"
        floor = min(bound(SpecifierSet(use.versions), ">=") for use in library_uses)
        declared_floor = bound(specifier, ">=")
        if library in FEATURE_FLOORS:
            assert declared_floor <= floor, library
        else:
            assert declared_floor.release[:2] == floor.release[:2], \
                f"{library}: pyproject.toml declares {specifier}, its gates start at >={floor}"


def test_the_installed_libraries_are_within_the_declared_ranges():
    """The lock (this venv) and the declared ranges agree: the suite runs on versions a user's pip could resolve."""
    for library, specifier in declared_ranges().items():
        installed = compat.installed_version(library)
        if installed is not None and library != "vllm":
            assert specifier.contains(Version(installed).public, prereleases=True), (library, installed, specifier)


def pip_report(*args: str, timeout: int = 900) -> dict:
    """`pip install --dry-run --ignore-installed --report` of `args`: what pip would install, from the index's metadata
    (no wheel is downloaded where the index serves a wheel's metadata on its own); skips when the index is not
    reachable."""
    import json

    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                           "--report", "-", *args], capture_output=True, text=True, timeout=timeout, cwd=REPO)
    if proc.returncode != 0 and re.search(r"No matching distribution|Could not fetch|connection|NewConnectionError|"
                                          r"Temporary failure", proc.stderr, re.I):
        pytest.skip(f"the package index is not reachable: {proc.stderr.strip()[-300:]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_the_vllm_extra_installs_beside_the_lower_end():
    """`pip install 'hftrain[vllm]'` resolves: every requirement vLLM has on a package hftrain also requires is met
    by the lower end (constraints/lower.txt), which pyproject.toml's ranges admit (make test-lower checks pip keeps
    it). vLLM's own metadata is read from the index (one wheel's metadata, seconds, no CUDA download)."""
    from packaging.requirements import Requirement

    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["vllm"]
    (vllm,) = pip_report("--no-deps", *extra)["install"]
    lower = exact(REPO / "constraints" / "lower.txt")
    shared = {}
    for text in vllm["metadata"]["requires_dist"]:
        requirement = Requirement(text)
        name = requirement.name.lower().replace("_", "-")
        if name in lower and (requirement.marker is None or requirement.marker.evaluate({"extra": ""})):
            shared[name] = requirement.specifier
    assert {"transformers", "torch", "tokenizers", "huggingface-hub", "safetensors"} <= set(shared)
    for name, specifier in shared.items():
        assert specifier.contains(lower[name], prereleases=True), (name, str(specifier), lower[name])


@pytest.mark.skipif(os.environ.get("HFTRAIN_TEST_VLLM_RESOLVE") != "1",
                    reason="the whole resolution of hftrain[vllm] reads ~200 packages' metadata (7 min here): "
                           "HFTRAIN_TEST_VLLM_RESOLVE=1")
def test_pip_resolves_hftrain_with_the_vllm_extra():
    report = pip_report("--no-build-isolation", f"{REPO}[vllm]", timeout=1800)
    chosen = {item["metadata"]["name"].lower(): item["metadata"]["version"] for item in report["install"]}
    assert chosen["vllm"] == "0.31.0" and chosen["transformers"].startswith("5.17.")
