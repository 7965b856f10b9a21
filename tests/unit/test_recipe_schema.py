"""The recipe schema survives regrouping (issue 25): every field of main before the refactor keeps its name, type,
default, --help group, metavar and help text, in the same order, and the groups keep their order.

`recipe_schema_dc12903.json` was dumped from hftrain/config.py at dc12903 (the code before the fields moved into
per-concern groups) with that code's own `build_arg_parser()` and `typing.get_type_hints(Recipe)`; the shipped
folder's absolute path is written <SHIPPED>. Fields added later (new features) may sit anywhere: the old ones must
keep their relative order. A class named in a type (DatasetSource) is compared by name: it may move to the module
of its group, with the same fields.
"""

from __future__ import annotations

import dataclasses
import json
import re
import typing
from pathlib import Path

from hftrain import data, objectives, parallel
from hftrain.config import FIELDS, SHIPPED, TYPES, DatasetSource, Recipe, build_arg_parser, check_output_dir, validate
from hftrain.fields import monitoring, peft

BEFORE = json.loads((Path(__file__).parent / "recipe_schema_dc12903.json").read_text(encoding="utf-8"))


def _norm(text):
    return None if text is None else str(text).replace(str(SHIPPED), "<SHIPPED>")


def _by_name(row: dict) -> dict:
    """`list[hftrain.config.DatasetSource]` -> `list[DatasetSource]`."""
    return {**row, "type": re.sub(r"hftrain(\.\w+)*\.(\w+)", r"\2", row["type"])}


def _current() -> dict[str, dict]:
    rows = {}
    for group in build_arg_parser()._action_groups:
        for action in group._group_actions:
            if action.dest in ("help", "config"):
                continue
            f = FIELDS[action.dest]
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            rows[action.dest] = {"name": action.dest, "type": str(TYPES[action.dest]), "default": _norm(repr(default)),
                                 "group": group.title, "metavar": action.metavar, "help": _norm(action.help),
                                 "nargs": action.nargs, "const": action.const,
                                 "choices": repr(f.metadata["choices"])}
    return rows


# Deliberate changes after the regrouping, each with the feature that made it: (field, attribute) -> why. The
# attribute is then not compared; everything else of the field still is.
LATER_CHANGES = {
    ("tp_size", "help"): "ad5ab8a, FSDP2 x tensor parallel: the help names the fsdp2 preset's 2D layout",
    ("cp_size", "help"): "tp x cp under FSDP2: the help names the composed layout and its process count",
    ("eval_strategy", "help"): "issue 36: no leaves eval_steps and eval_dataset_name unused (no longer refused)",
    ("save_strategy", "help"): "issue 36: no leaves save_steps unused (no longer refused)",
    ("lora_target_modules", "nargs"): "issue 36: list items as words too, as TRL",
    ("modules_to_save", "nargs"): "issue 36: list items as words too, as TRL",
    ("report_to", "nargs"): "issue 36: list items as words too, as TRL",
    ("wandb_tags", "nargs"): "issue 36: list items as words too, as TRL",
    ("precompute_ref_log_probs", "help"): "issue 40: kto precomputes its rows' and mismatched rows' log-probs too",
    ("objective", "help"): "issue 40: objective orpo",
    ("objective", "choices"): "issue 40: objective orpo",
    ("beta", "help"): "issue 40: orpo's beta",
    ("loss_type", "help"): "issue 40: kto's loss types",
    ("loss_type", "choices"): "issue 40: kto's loss types",
    ("dataset_format", "choices"): "issue 40: kto's unpaired format",
    ("attn_implementation", "help"): "issue 50: varlen, hftrain's attention for packed rows where it can run",
    ("attn_implementation", "choices"): "issue 50: varlen",
    ("torch_compile", "help"): "issue 50: dynamic shapes from the first compile; the first step's time is reported",
    ("optim", "help"): "issue 53: optim muon",
    ("optim", "choices"): "issue 53: optim muon",
}


def _without_later_changes(row: dict) -> dict:
    return {k: v for k, v in _by_name(row).items() if (row["name"], k) not in LATER_CHANGES}


def test_every_old_field_keeps_its_type_default_group_and_help():
    now = _current()
    missing = [row["name"] for row in BEFORE["fields"] if row["name"] not in now]
    assert not missing
    changed = [(row, now[row["name"]]) for row in BEFORE["fields"]
               if _without_later_changes(now[row["name"]]) != _without_later_changes(row)]
    assert not changed, changed[0]
    for name, attribute in LATER_CHANGES:  # each listed change is real: otherwise the entry is stale
        (old,) = [row for row in BEFORE["fields"] if row["name"] == name]
        assert now[name][attribute] != old[attribute], (name, attribute)


def test_a_mixture_entry_keeps_its_fields():
    hints = typing.get_type_hints(DatasetSource)
    now = [{"name": f.name, "type": str(hints[f.name]),
            "default": repr(f.default) if f.default is not dataclasses.MISSING else
            repr(f.default_factory()) if f.default_factory is not dataclasses.MISSING else "required"}
           for f in dataclasses.fields(DatasetSource)]
    assert now == BEFORE["dataset_source"]


def test_old_fields_and_groups_keep_their_order():
    names = [f.name for f in dataclasses.fields(Recipe)]
    old = [row["name"] for row in BEFORE["fields"]]
    assert [n for n in names if n in old] == old  # declaration order: --help, dumped recipes, to_dict
    help_order = list(_current())
    assert [n for n in help_order if n in old] == old
    groups = []
    for name in help_order:
        group = FIELDS[name].metadata["group"]
        groups += [] if group in groups else [group]
    assert [g for g in groups if g in BEFORE["groups"]] == BEFORE["groups"]


def test_the_recipe_is_one_flat_schema():
    """One dataclass whose fields are all plain values (no nested group objects), built by keyword."""
    recipe = Recipe(objective="dpo", lora_r=4, tp_size=1)
    assert dataclasses.is_dataclass(recipe) and len(FIELDS) == len(dataclasses.fields(Recipe))
    assert {name: getattr(recipe, name) for name in ("objective", "lora_r")} == {"objective": "dpo", "lora_r": 4}
    assert set(recipe.to_dict()) == set(FIELDS)


def test_validate_gathers_every_group_s_problems_at_once():
    """One bad setting per group: each group's own `problems` finds its one, and the recipe's validation reports
    all of them together (parallelism with the training checks, as before: check_output_dir)."""
    recipe = Recipe(dataset_num_proc=0, beta=0.0, lora_r=0, use_peft=True, straggler_threshold=2.0, tp_size=0)
    found = {group: problems(recipe) for group, problems in (
        ("data", data.problems), ("objectives", objectives.problems), ("peft", peft.problems),
        ("monitoring", monitoring.problems), ("parallel", parallel.problems))}
    assert all(len(problems) == 1 for problems in found.values()), found
    reported = validate(recipe) + check_output_dir(recipe)
    assert all(problems[0] in reported for problems in found.values())
