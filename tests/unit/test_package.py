"""The package's shape: one-way imports between hftrain modules, top-level imports except for the optional heavy
packages, and a plain run that does not load them (issue 13 item 3)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

PACKAGE = REPO / "hftrain"

# The only imports allowed inside functions: optional heavy packages, loaded when the recipe or preset uses them.
LAZY_ALLOWED = {
    "deepspeed": "imported only under a DeepSpeed preset; importing it prints accelerator warnings on every CPU run",
    "bitsandbytes": "only for 8-bit optimizers and quantized bases; needs CUDA libraries to import cleanly",
    "peft": "imports bitsandbytes; only adapter (use_peft) runs and merges need it",
    "liger_kernel": "CUDA-only extra (pip install hftrain[cuda]); absent on CPU machines",
    "mlflow": "optional extra (report_to: mlflow)",
    "wandb": "only with report_to: wandb; slow to import",
    "tensorboard": "only with report_to: tensorboard",
    "vllm": "CUDA-only extra (pip install hftrain[vllm]); only grpo with use_vllm: true needs it",
    "matplotlib": "drawn only when a report or a model card's loss curve is; every training process (each rank of a "
                  "launch) would otherwise import it (~0.5 s) for the card's module",
    "lm_eval": "optional extra (pip install hftrain[eval]); only `hftrain eval` and eval_tasks need it",
    "torchao": "optional extra (pip install hftrain[qat]); only qat_scheme runs need it",
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """Full names a statement imports (`from a import b` gives a.b, which is a module or a name in a)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:  # relative import
        anchor = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
        base = ".".join(anchor + ([base] if base else []))
    return [base] + [f"{base}.{alias.name}" for alias in node.names]


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


def _top_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Imports that run when the module is imported: module level, including under if/try, not TYPE_CHECKING."""
    found, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If) and not _is_type_checking(node):
            todo += node.body + node.orelse
        elif isinstance(node, ast.Try):
            todo += node.body + node.orelse + node.finalbody + [n for h in node.handlers for n in h.body]
    return found


def _every_import(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement: module level, inside functions and under TYPE_CHECKING."""
    return [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]


def _graph(imports=_top_level_imports) -> dict[str, set[str]]:
    """hftrain module -> the hftrain modules its `imports` load (a package's __init__ included)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges = set()
        for node in imports(_parse(path)):
            for target in _imported(node, name, path.name == "__init__.py"):
                while target and target not in modules:  # `from a.b import name`: the module is a.b
                    target = target.rpartition(".")[0]
                parts = target.split(".")
                edges |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)} & set(modules)  # parents run too
        ancestors = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        graph[name] = edges - {name} - ancestors  # a submodule's own package is already importing: not an edge
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_graph_sees_known_edges():
    graph = _graph()
    assert "hftrain.from_trl" in graph["hftrain.config"]  # `from hftrain import from_trl`
    assert {"hftrain.parallel", "hftrain.model", "hftrain.data"} <= graph["hftrain.finetune"]
    assert "hftrain.data" in graph["hftrain.model"]  # `from hftrain.data import ...` runs hftrain/data/__init__.py


def test_the_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_hftrain_import_graph_has_no_cycle():
    cycle = _cycle(_graph())
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def test_no_import_cycle_counting_every_import():
    """Not even one that only a function or a TYPE_CHECKING block closes (issue 25): the names two modules both need
    live in the lower one (e.g. the run's file names in hftrain.paths, below config and checkpoint)."""
    graph = _graph(_every_import)
    assert "hftrain.config" in graph["hftrain.checkpoint"] and "hftrain.paths" in graph["hftrain.config"]
    cycle = _cycle(graph)
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def test_every_import_graph_sees_function_and_type_checking_imports():
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a\ndef f():\n    import b\n")
    assert sorted(alias.name for node in _every_import(tree) for alias in node.names) == ["TYPE_CHECKING", "a", "b"]
    assert [alias.name for node in _top_level_imports(tree) for alias in node.names] == ["TYPE_CHECKING"]


def test_function_local_imports_are_only_optional_heavy_packages():
    misplaced = []
    for name, path in _modules().items():
        tree = _parse(path)
        top = {id(node) for node in _top_level_imports(tree)}
        type_checking = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If) and _is_type_checking(block)
                         for n in ast.walk(block)}
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)) or id(node) in top | type_checking:
                continue
            roots = {n.split(".")[0] for n in _imported(node, name, path.name == "__init__.py")}
            if not roots <= set(LAZY_ALLOWED):
                misplaced.append(f"{path.relative_to(REPO)}:{node.lineno} imports {sorted(roots)}")
    assert not misplaced, "move these imports to the module top (or justify them in LAZY_ALLOWED):\n" + "\n".join(
        misplaced)


def test_importing_finetune_and_saving_a_model_load_no_optional_heavy_package(tmp_path):
    """Neither the import nor the final save of a run that uses none of them: transformers' save_pretrained asks
    accelerate to unwrap the model, whose probe imported DeepSpeed (and DeepSpeed MLflow), ~1.5 s of CPU per run."""
    heavy = ("deepspeed", "bitsandbytes", "wandb", "mlflow", "vllm", "matplotlib")
    code = "\n".join([
        "import sys, hftrain.finetune",
        f"imported = [m for m in {heavy!r} if m in sys.modules]",
        "from transformers import AutoModelForCausalLM",
        "from hftrain.model import WrapsCausalLM",
        "wrapper = WrapsCausalLM()",
        f"wrapper.lm = AutoModelForCausalLM.from_pretrained({str(REPO / 'models' / 'tiny-llama')!r})",
        f"wrapper.save_pretrained({str(tmp_path)!r})",
        f"print(imported, [m for m in {heavy!r} if m in sys.modules])",
    ])
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[] []", out.stdout + out.stderr
    assert (tmp_path / "model.safetensors").exists() and (tmp_path / "config.json").exists()


def test_importing_the_entry_point_prints_nothing_with_every_extra_installed():
    """The dev environment holds every extra (torchao, sentence-transformers, bitsandbytes, kernels...): importing
    hftrain.finetune, as every run does, writes nothing to the console (torchao's CUDA extensions that a CPU machine
    cannot load, torch's pytree deprecation note about torchao's enums, bitsandbytes' CPU kernel note)."""
    import importlib.util

    assert importlib.util.find_spec("torchao") is not None  # what the filters are for is installed here
    out = subprocess.run([sys.executable, "-c", "import hftrain.finetune"], cwd=REPO, capture_output=True, text=True,
                         check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.stdout == "" and out.stderr == "", out.stderr


def test_deepspeed_is_imported_without_mlflow_which_stays_importable():
    """A DeepSpeed launch imports DeepSpeed through compat.deepspeed, hiding MLflow from its autotuner's optional
    import (~1 s of CPU per process); report_to: mlflow can still import it after."""
    code = ("import sys; from hftrain.compat.deepspeed import import_deepspeed_without_mlflow; "
            "import_deepspeed_without_mlflow(); print('deepspeed' in sys.modules, 'mlflow' in sys.modules); "
            "import mlflow; print(mlflow.__name__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.splitlines()[-2:] == ["True False", "mlflow"], out.stdout + out.stderr  # after DeepSpeed's note


def test_test_files_have_unique_names():
    """tests/ has no __init__.py files: pytest imports each test file by its base name, so two files with one name
    in different folders stop the whole collection ("import file mismatch")."""
    names = [path.name for path in (REPO / "tests").rglob("test_*.py")]
    assert sorted({n for n in names if names.count(n) > 1}) == []


def test_recipe_groups_import_nothing_that_imports_config():
    """config composes hftrain/fields/*: those modules may import only hftrain.paths, hftrain.presets (which, like
    paths, import nothing of hftrain) and each other, or the recipe's imports would run in a circle
    (docs/architecture.md)."""
    graph = _graph(_every_import)
    groups = [name for name in graph if name == "hftrain.fields" or name.startswith("hftrain.fields.")]
    assert len(groups) >= 6
    allowed = {"hftrain.paths", "hftrain.presets", "hftrain.fields"}
    assert graph["hftrain.paths"] == graph["hftrain.presets"] == set()
    assert {name: graph[name] - allowed for name in groups} == {name: set() for name in groups}
