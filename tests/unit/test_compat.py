"""hftrain.compat: every private library use lives there, gated by the versions it was checked on."""

import ast
import importlib
from pathlib import Path

import pytest

import hftrain
from hftrain import compat
from hftrain.errors import HftrainError

PACKAGE = Path(hftrain.__file__).parent
DOCUMENTED = {"os._exit"}  # underscore names that are documented public API
COMPAT_MODULES = ["accelerate", "cpython", "datasets", "deepspeed", "liger", "torch", "transformers"]


def private_uses(source: str) -> list[str]:
    """Where `source` imports a private name or module of another package, or reads / writes / looks up an
    underscore attribute of anything but `self` / `cls` (dunders are public protocol)."""

    def private(name: str) -> bool:
        return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split(".")[0] != "hftrain":
            names = [*node.module.split("."), *(alias.name for alias in node.names)]
            found += [f"line {node.lineno}: from {node.module} import {name}" for name in names if private(name)]
        elif isinstance(node, ast.Import):
            found += [f"line {node.lineno}: import {alias.name}" for alias in node.names
                      if any(private(part) for part in alias.name.split("."))]
        elif isinstance(node, ast.Attribute) and private(node.attr) and ast.unparse(node) not in DOCUMENTED and \
                not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) > 1 and \
                isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str) and \
                private(node.args[1].value):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


@pytest.mark.parametrize("snippet", [
    "from torch.distributed.pipelining.schedules import _Action",
    "from torch.distributed.tensor._utils import compute_local_shape_and_global_offset",
    "import torch._dynamo",
    "model.lm._mesh_manager.get_mesh('fsdp')",
    "threading._shutdown()",
    "atexit._run_exitfuncs()",
    "x = getattr(config, '_attn_implementation', None)",
    "setattr(engine, '_config', None)",
])
def test_the_check_finds_each_kind_of_private_use(snippet):
    assert len(private_uses(snippet)) == 1


@pytest.mark.parametrize("snippet", [
    "from __future__ import annotations",
    "from hftrain.data.tokenize import _fingerprint",
    "self._state = 1\ncls._cache = {}",
    "model.__class__ = type(model)\ngetattr(f, '__name__', None)",
    "from torch.distributed.pipelining.schedules import get_schedule_class",
    "os._exit(2)",
])
def test_the_check_lets_public_and_own_names_pass(snippet):
    assert private_uses(snippet) == []


def test_no_module_outside_compat_uses_a_library_private_name():
    uses = {str(path.relative_to(PACKAGE)): found for path in sorted(PACKAGE.rglob("*.py"))
            if "compat" not in path.relative_to(PACKAGE).parts and (found := private_uses(path.read_text()))}
    assert uses == {}, "move these into hftrain/compat/<library>.py, gated by the versions they were checked on"


@pytest.mark.parametrize("name", COMPAT_MODULES)
def test_each_compat_module_names_the_versions_it_was_checked_on(name):
    module = importlib.import_module(f"hftrain.compat.{name}")
    first_paragraph = module.__doc__.split("\n\n")[0]
    assert module.CHECKED and "(checked on " in first_paragraph


def pinned(file: str) -> dict[str, str]:
    """{distribution: version} of a constraints file (constraints/lock.txt: the suite's; lower.txt: CI's lower end)."""
    lines = (PACKAGE.parent / "constraints" / file).read_text().splitlines()
    return dict(line.split("==") for line in lines if "==" in line and not line.startswith("#"))


LIBRARIES = ["accelerate", "datasets", "deepspeed", "torch", "transformers"]
NOT_AT_THE_LOWER_END = {("transformers", "CHECKED")}  # uses CI's lower end does not run (tp, pp stages): 5.23 on


@pytest.mark.parametrize("library", LIBRARIES)
def test_the_suites_versions_are_within_every_gate(library, monkeypatch):
    """The suite runs the lock's versions, and CI's lower end the floors: a pin moved without the gate (or the other
    way) fails here, whichever environment runs it."""
    module = importlib.import_module(f"hftrain.compat.{library}")
    gates = {key: value for key, value in vars(module).items() if key.startswith("CHECKED")}
    assert gates
    for file in ("lock.txt", "lower.txt"):
        version = pinned(file)[library]
        monkeypatch.setattr(compat, "installed_version", lambda _, version=version: version)
        compat.within.cache_clear()
        for key, gate in gates.items():
            if file == "lower.txt" and (library, key) in NOT_AT_THE_LOWER_END:
                continue
            assert compat.within(library, gate), f"{library} {version} ({file}) outside {key} = {gate}"


def test_a_version_outside_the_gate_stops_with_one_paragraph(monkeypatch):
    monkeypatch.setattr(compat, "installed_version", lambda library: "2.99.0")
    compat.within.cache_clear()
    try:
        with pytest.raises(HftrainError) as raised:
            compat.require("torch", ">=2.13,<2.14", "pipeline evaluation with a V schedule")
    finally:
        compat.within.cache_clear()
    message = str(raised.value)
    assert "pipeline evaluation with a V schedule" in message and "torch>=2.13,<2.14" in message
    assert "torch 2.99.0 is installed" in message and "pip install 'torch>=2.13,<2.14'" in message
    # a pip user has no hftrain/compat/ to read, and "without this feature" is no advice for loading a model
    assert "hftrain/compat" not in message and "without this feature" not in message


def test_a_missing_library_is_outside_every_gate():
    assert not compat.within("no-such-distribution-hftrain", ">=0")


def test_local_version_labels_are_ignored(monkeypatch):
    monkeypatch.setattr(compat, "installed_version", lambda library: "2.13.0+cpu")
    compat.within.cache_clear()
    try:
        assert compat.within("torch", ">=2.13,<2.14")
    finally:
        compat.within.cache_clear()


def versions(monkeypatch, **given):
    """Pretend the given distributions (underscores for dashes) are installed at these versions, the others at the
    lock's (constraints/lock.txt), whichever environment runs the test."""
    real, lock = compat.installed_version, pinned("lock.txt")
    chosen = {name.replace("_", "-"): version for name, version in given.items()}
    monkeypatch.setattr(compat, "installed_version",
                        lambda library: chosen.get(library) or lock.get(library) or real(library))
    compat.within.cache_clear()


@pytest.fixture(autouse=True)
def fresh_version_cache():
    compat.within.cache_clear()
    yield
    compat.within.cache_clear()


def test_the_preflight_refuses_a_library_outside_the_uses_this_run_makes(monkeypatch):
    from hftrain.config import Recipe
    from hftrain.parallel.launch import Launch
    from hftrain.preflight import library_problems

    versions(monkeypatch, transformers="5.22.0")
    full = library_problems(Recipe(pp_size=2), Launch("ddp", 2, 2))
    assert len(full) == 1 and "reading only a pipeline stage's layers" in full[0]  # 5.22 has the rest
    assert "transformers 5.22.0 is installed" in full[0]
    assert library_problems(Recipe(pp_size=2, use_peft=True), Launch("ddp", 2, 2)) == []  # adapters read it all
    assert library_problems(Recipe(), Launch("ddp", 2, 2)) == []


def test_each_torch_use_of_a_layout_is_named_once(monkeypatch):
    from hftrain.config import Recipe
    from hftrain.parallel.launch import Launch
    from hftrain.preflight import library_problems

    versions(monkeypatch, torch="2.15.0")  # past the newest checked (2.14.1)
    problems = library_problems(Recipe(tp_size=2, cp_size=2), Launch("fsdp2", 8, 8))
    assert len(problems) == 2 and all("torch 2.15.0 is installed" in p for p in problems)
    assert any("ring attention" in p for p in problems) and any("FSDP2 x TP shards" in p for p in problems)
    assert library_problems(Recipe(pp_size=2, pp_schedule="ZBVZeroBubble"), Launch("ddp", 2, 2)) != []
    assert library_problems(Recipe(), Launch("ddp", 2, 2)) == []


def test_grpo_with_a_frozen_reference_under_cp_asks_for_accelerates_attention_mask_hooks(monkeypatch):
    """The ring drops the attention mask through accelerate's hooks, which accelerate attaches to the prepared model
    only; hftrain attaches them to grpo's frozen reference (beta > 0) itself."""
    from hftrain.config import Recipe
    from hftrain.parallel.launch import Launch
    from hftrain.preflight import library_problems

    versions(monkeypatch, accelerate="9.0.0")
    grpo = {"objective": "grpo", "reward_funcs": ["hftrain.rl.example_rewards.vowel_share"], "cp_size": 2}

    def hooks(beta: float) -> list[str]:
        return [p for p in library_problems(Recipe(**grpo, beta=beta), Launch("fsdp2", 2, 2))
                if "attention-mask hooks" in p]

    assert len(hooks(0.1)) == 1 and "accelerate 9.0.0 is installed" in hooks(0.1)[0]
    assert hooks(0.0) == []


def test_the_locked_libraries_pass_every_use_of_every_layout(monkeypatch):
    from hftrain.config import Recipe
    from hftrain.parallel.launch import Launch
    from hftrain.preflight import library_problems

    lock = pinned("lock.txt")
    monkeypatch.setattr(compat, "installed_version", lambda library: lock.get(library, "3.11.7"))
    for recipe, launch in [(Recipe(), Launch("single", 1, 1)), (Recipe(streaming=True), Launch("ddp", 2, 2)),
                           (Recipe(tp_size=2, cp_size=2), Launch("fsdp2", 8, 8)),
                           (Recipe(pp_size=2, pp_schedule="ZBVZeroBubble"), Launch("ddp", 2, 2))]:
        assert library_problems(recipe, launch) == []
