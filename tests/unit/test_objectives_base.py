"""The contract of the objective hooks (`hftrain.objectives.base`): a hook reads only the fields of the value it is
handed (`DataRun`, `ModelRun`, `TrainRun`) and changes none of them.

The project has no type checker, so the check reads the source: a parameter annotated with one of those values
anywhere in hftrain/ (e.g. embedding's retrieval add-on, called with the TrainRun), or named `run` without an
annotation in a module under hftrain/objectives or hftrain/rl (an override of an `Objective` hook: the base hook's
value; anything else: `TrainRun`, the widest), may only be read for that value's fields, in the function's body and
the closures and lambdas inside it."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

import pytest

from hftrain.objectives import OBJECTIVES
from hftrain.objectives.base import Objective
from hftrain.run_parts import DataRun, ModelRun, TrainRun

REPO = Path(__file__).resolve().parents[2]
VALUES = {value.__name__: {field.name for field in dataclasses.fields(value)}
          for value in (DataRun, ModelRun, TrainRun)}
# the value each base hook is annotated with (a string: the module has `from __future__ import annotations`)
HOOKS = {name: inspect.signature(hook).parameters["run"].annotation for name, hook in vars(Objective).items()
         if inspect.isfunction(hook) and "run" in inspect.signature(hook).parameters}
Function = ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda


def annotated(annotation: ast.expr | None) -> str | None:
    """The value an annotation names (`TrainRun`, `base.TrainRun`, "TrainRun"), "" for another type, None for none."""
    if annotation is None:
        return None
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        name = annotation.value.rsplit(".", 1)[-1]
    else:
        name = annotation.id if isinstance(annotation, ast.Name) else getattr(annotation, "attr", "")
    return name if name in VALUES else ""


def handed(function: Function, method: bool, unannotated_run: bool) -> dict[str, str]:
    """{parameter: the value it holds} of a function's parameters that hold one (`unannotated_run`: a `run` without
    an annotation holds one)."""
    args = function.args
    held = {}
    for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
        value = annotated(arg.annotation)
        if value is None and arg.arg == "run" and unannotated_run:
            value = HOOKS.get(function.name, "TrainRun") if method else "TrainRun"
        if value:
            held[arg.arg] = value
    return held


def own_nodes(function: Function, name: str):
    """The nodes of `function` where `name` is its parameter: a nested function or lambda with a parameter of that
    name is left to its own check."""
    stack = list(ast.iter_child_nodes(function))
    while stack:
        node = stack.pop()
        if isinstance(node, Function) and name in {a.arg for a in [*node.args.posonlyargs, *node.args.args,
                                                                      *node.args.kwonlyargs]}:
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def is_param(node: ast.expr, name: str) -> bool:
    return isinstance(node, ast.Name) and node.id == name


def violations(source: str, filename: str, seen: set | None = None, unannotated_run: bool = True) -> list[str]:
    """What the functions of `source` do with their handed values beyond reading the values' fields, as
    'file:line function: what'; `seen` collects (filename, function name) of each function checked."""
    tree = ast.parse(source)
    methods = {id(node) for cls in ast.walk(tree) if isinstance(cls, ast.ClassDef) for node in cls.body}
    found = []
    for function in ast.walk(tree):
        if not isinstance(function, Function):
            continue
        where = getattr(function, "name", "<lambda>")
        for name, value in handed(function, id(function) in methods, unannotated_run).items():
            if seen is not None:
                seen.add((filename, where))
            for node in own_nodes(function, name):
                said = None
                if isinstance(node, ast.Attribute) and is_param(node.value, name):
                    if not isinstance(node.ctx, ast.Load):
                        said = f"changes {name}.{node.attr} ({value} is frozen)"
                    elif node.attr not in VALUES[value]:
                        said = f"{name}.{node.attr} is not a field of {value}"
                elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args
                      and is_param(node.args[0], name) and node.func.id in ("getattr", "setattr", "delattr")):
                    attr = node.args[1].value if len(node.args) > 1 and isinstance(node.args[1], ast.Constant) else None
                    if node.func.id != "getattr":
                        said = f"{node.func.id}({name}, ...) changes {value}"
                    elif attr not in VALUES[value]:
                        said = f"getattr({name}, {attr!r}) is not a field of {value}"
                if said:
                    found.append((node.lineno, f"{where}: {said}"))
    return [f"{filename}:{line} {said}" for line, said in sorted(found)]


def test_every_hook_and_add_on_reads_only_the_fields_it_is_handed():
    found, seen = [], set()
    for path in sorted((REPO / "hftrain").rglob("*.py")):
        where = path.relative_to(REPO)
        found += violations(path.read_text(encoding="utf-8"), str(where), seen,
                            unannotated_run=where.parts[1] in ("objectives", "rl"))
    assert not found, ("these read what their value (hftrain/objectives/base.py) does not hold, or change it; use "
                       "its fields, or add the part a hook truly needs there with its reason:\n" + "\n".join(found))
    # not vacuous: every hook that a registered objective's class or its bases define was among the functions read
    defined = {(hook.__module__.replace(".", "/") + ".py", name)
               for objective in OBJECTIVES.values() for cls in type(objective).__mro__
               for name, hook in vars(cls).items() if name in HOOKS}
    assert len(defined) > len(HOOKS) and defined <= seen, sorted(defined - seen)
    assert ("hftrain/retrieval_eval.py", "__call__") in seen  # an objective's add-on, outside hftrain/objectives


PLANTED = '''\
from hftrain.objectives.base import Objective  # (ModelRun, TrainRun: hftrain.run_parts)


class Planted(Objective):
    def setup_data(self, run):
        return run.setup_examples(), run.model

    def prepare(self, run: ModelRun):
        run.recipe = None
        keep = lambda run: run.logger
        return run.parts, run.feed, keep

    def notes(self, run: "TrainRun") -> list[str]:
        rows = lambda names: [run.optimizer for _ in names]
        return [getattr(run, "scheduler"), setattr(run, "model", None), run.progress.step, rows]


def elsewhere(run: int, other: TrainRun):
    return run.real, other.anything, other.feed


def helper(run):
    return run.progress, run.logger
'''


def test_the_check_names_each_planted_reach_beyond_the_value_and_nothing_else():
    """Each line below is read off PLANTED by hand: the base hook's value for an unannotated override (setup_data:
    DataRun, no model yet), the annotated value, a lambda's own `run` (TrainRun) apart from the closure's, getattr /
    setattr, a parameter of any name annotated with a value; a parameter annotated as another type is not checked."""
    assert violations(PLANTED, "planted.py") == [
        "planted.py:6 setup_data: run.model is not a field of DataRun",
        "planted.py:9 prepare: changes run.recipe (ModelRun is frozen)",
        "planted.py:10 <lambda>: run.logger is not a field of TrainRun",
        "planted.py:11 prepare: run.feed is not a field of ModelRun",
        "planted.py:14 notes: run.optimizer is not a field of TrainRun",
        "planted.py:15 notes: getattr(run, 'scheduler') is not a field of TrainRun",
        "planted.py:15 notes: setattr(run, ...) changes TrainRun",
        "planted.py:19 elsewhere: other.anything is not a field of TrainRun",
        "planted.py:23 helper: run.logger is not a field of TrainRun",
    ]


def test_each_phase_hands_on_the_one_before_and_no_hook_can_rebind_a_field():
    earlier = DataRun(**{field.name: object() for field in dataclasses.fields(DataRun)})
    later = earlier.handed_on(ModelRun, data="data", parts="parts", model="model")
    assert [getattr(later, field.name) for field in dataclasses.fields(DataRun)] == \
        [getattr(earlier, field.name) for field in dataclasses.fields(DataRun)]
    assert (later.data, later.parts, later.model) == ("data", "parts", "model")
    with pytest.raises(dataclasses.FrozenInstanceError):
        later.model = "another model"
