"""hftrain.compat: every private library use lives there, gated by the versions it was checked on."""

import ast
import importlib
from pathlib import Path

import pytest

import hftrain
from hftrain import compat
from hftrain.errors import HftrainError

PACKAGE = Path(hftrain.__file__).parent
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
        elif isinstance(node, ast.Attribute) and private(node.attr) and \
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


@pytest.mark.parametrize(("name", "library"), [
    ("accelerate", "accelerate"), ("cpython", "python"), ("datasets", "datasets"), ("deepspeed", "deepspeed"),
    ("torch", "torch"), ("transformers", "transformers")])
def test_the_installed_versions_are_within_every_gate(name, library):
    """The suite runs on the versions each gate names: a pin moved without the gate (or the other way) fails here."""
    module = importlib.import_module(f"hftrain.compat.{name}")
    gates = [value for key, value in vars(module).items() if key.startswith("CHECKED")]
    assert gates and all(compat.within(library, gate) for gate in gates)


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


def test_a_missing_library_is_outside_every_gate():
    assert not compat.within("no-such-distribution-hftrain", ">=0")


def test_local_version_labels_are_ignored(monkeypatch):
    monkeypatch.setattr(compat, "installed_version", lambda library: "2.13.0+cpu")
    compat.within.cache_clear()
    try:
        assert compat.within("torch", ">=2.13,<2.14")
    finally:
        compat.within.cache_clear()
