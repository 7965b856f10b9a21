"""`hftrain env` and the version gates: TESTED is what constraints/lower.txt and constraints/lock.txt say (so the
range it prints is the one CI tests), pyproject.toml's floors are the lower end, and a feature that needs a newer
transformers is refused in one paragraph naming the version that brings it."""

from __future__ import annotations

import re
import subprocess
import sys

import tomllib

from hftrain import versions
from tests.conftest import REPO


def exact(path) -> dict[str, str]:
    return {m.group(1).lower().replace("_", "-"): m.group(2)
            for m in re.finditer(r"(?m)^([A-Za-z0-9_.-]+)==(\S+)$", path.read_text())}


def test_the_tested_range_is_the_lower_end_and_the_lock():
    lower, lock = exact(REPO / "constraints" / "lower.txt"), exact(REPO / "constraints" / "lock.txt")
    floors = {}
    for requirement in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]:
        if match := re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9.]+)", requirement.split(";")[0].strip()):
            floors[match.group(1).lower()] = match.group(2)
    for package, (low, high) in versions.TESTED.items():
        assert high == lock[package], package
        assert low == floors[package], package  # the declared floor
        if package != "torch":  # the lower end runs torch 2.13.0, the only CPU build here (docs/versions.md)
            assert lower[package] == low, package
    assert set(lower) <= set(floors), "every package of the lower end is a declared dependency"


def test_placement_against_the_range():
    assert versions.placement("transformers", "5.17.0") == "in range"
    assert versions.placement("transformers", "5.23.0") == "in range"
    assert versions.placement("transformers", "5.24.0") == "newer than tested"
    assert versions.placement("transformers", "5.16.1").startswith("OLDER than tested")
    assert versions.placement("torch", "2.13.0+cpu") == "in range"
    assert versions.placement("torch", None) == "not installed"


def test_a_gated_feature_names_the_version_that_brings_it(monkeypatch):
    monkeypatch.setattr(versions, "installed", lambda package: {"transformers": "5.18.0"}.get(package))
    problem = versions.feature_problem("expert_parallel")
    assert problem.startswith("expert parallelism (DistributedConfig ep_size) needs transformers >= 5.19.0")
    assert "this environment has transformers 5.18.0: pip install 'transformers>=5.19.0'" in problem
    monkeypatch.setattr(versions, "installed", lambda package: {"transformers": "5.19.0"}.get(package))
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

    assert re.search(rf"(?m)^transformers +{re.escape(transformers.__version__)} +5\.17\.0 \.\. 5\.23\.0", out)
    assert "features (yes: available here; no: what it needs)" in out
    expected = "yes " if versions.available("expert_parallel") else "no   expert parallelism"
    assert expected in out
    as_json = subprocess.run([sys.executable, "-m", "hftrain", "env", "--json"], capture_output=True, text=True,
                             check=True, cwd=REPO).stdout
    import json

    info = json.loads(as_json)
    assert info["packages"]["transformers"]["version"] == transformers.__version__
    assert set(info["features"]) == set(versions.FEATURES)
