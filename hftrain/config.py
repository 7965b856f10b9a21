"""The recipe: one typed schema, YAML presets, CLI overrides and up-front validation.

Field names follow transformers `TrainingArguments`, TRL `SFTConfig` / `ModelConfig` and peft
`LoraConfig` wherever the concept is the same, so a TRL recipe moves over almost unchanged.
Each field's `help` becomes `--help`. `load_recipe` reports every problem at once (unknown keys,
wrong types, bad values, impossible combinations) before any model or dataset is touched.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import re
import shutil
import textwrap
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from hftrain import from_trl
from hftrain.errors import ConfigError, first_line
from hftrain.fields.data import DataFields, DatasetSource
from hftrain.fields.data import problems as data_problems
from hftrain.fields.distill import DISTILL_DEFAULTS, DistillFields
from hftrain.fields.distill import problems as distill_problems
from hftrain.fields.evaluation import EvaluationFields
from hftrain.fields.evaluation import problems as evaluation_problems
from hftrain.fields.fp8 import FP8Fields
from hftrain.fields.fp8 import problems as fp8_problems
from hftrain.fields.grpo import OBJECTIVE_DEFAULTS, GRPOFields
from hftrain.fields.grpo import problems as grpo_problems
from hftrain.fields.hub import SECRET_FIELDS, HubFields
from hftrain.fields.hub import problems as hub_problems
from hftrain.fields.hub import unused as hub_unused
from hftrain.fields.logging import LoggingFields
from hftrain.fields.logging import problems as logging_problems
from hftrain.fields.model import ModelFields
from hftrain.fields.model import problems as model_problems
from hftrain.fields.monitoring import MonitoringFields
from hftrain.fields.monitoring import problems as monitoring_problems
from hftrain.fields.muon import MuonFields
from hftrain.fields.muon import problems as muon_problems
from hftrain.fields.objectives import ObjectiveFields
from hftrain.fields.objectives import problems as objective_problems
from hftrain.fields.parallel import ParallelFields
from hftrain.fields.parallel import problems as parallel_problems
from hftrain.fields.peft import PeftFields
from hftrain.fields.peft import problems as peft_problems
from hftrain.fields.qat import QATFields
from hftrain.fields.qat import problems as qat_problems
from hftrain.fields.retrieval import RetrievalFields
from hftrain.fields.retrieval import problems as retrieval_problems
from hftrain.fields.training import TORCH_ADAMW as TORCH_ADAMW  # `as`: re-exported
from hftrain.fields.training import TrainingFields
from hftrain.fields.training import problems as training_problems
from hftrain.options import is_bool_word, parse_bool
from hftrain.paths import DEFAULT_DATASET as DEFAULT_DATASET  # `as`: re-exported (shipped paths, in hftrain.paths)
from hftrain.paths import DEFAULT_MODEL as DEFAULT_MODEL
from hftrain.paths import FINAL_DIR, RECIPE_DIR, complete_checkpoints, holds_a_run
from hftrain.paths import PRESET_DIR as PRESET_DIR
from hftrain.paths import SHIPPED as SHIPPED

DEFAULT_RECIPE_NOTE = ("with no --config, each field takes the default shown (the tiny offline model and the chat "
                       "data shipped inside hftrain); `hftrain launch`, `hftrain finetune` and `hftrain data` with no "
                       "--config use the demo recipe tiny-chat instead")
# fields that name a file or folder: a relative one that is not under the current folder may be a shipped file
PATH_FIELDS = ("model_name_or_path", "tokenizer_name_or_path", "dataset_name", "eval_dataset_name",
               "chat_template_path", "teacher_model_name_or_path", "retrieval_eval_dir")


@dataclass
class Recipe(HubFields, ParallelFields, MonitoringFields, EvaluationFields, LoggingFields, QATFields, PeftFields,
             MuonFields, FP8Fields, TrainingFields,
             RetrievalFields, DistillFields, GRPOFields, ObjectiveFields, DataFields, ModelFields):
    """One flat, typed schema: every field of every group (declared per group, in this order: model, data,
    objective, training, peft and quantization, logging, evaluation, monitoring, parallelism, hub; dataclasses collect
    the bases' fields from the last base to the first)."""

    # ------------------------------------------------------------------ derived values
    @property
    def order_seed(self) -> int:
        """The seed of everything data: order, eval hold-out and mixture sampling."""
        return self.seed if self.data_seed is None else self.data_seed

    @property
    def reads_eval_dataset(self) -> bool:
        """eval_dataset_name is loaded: set, and evaluation not turned off (eval_strategy no)."""
        return bool(self.eval_dataset_name) and self.eval_strategy != "no"

    def warmup_for(self, total_steps: int) -> int:
        return self.warmup_steps if self.warmup_steps > 0 else math.ceil(self.warmup_ratio * total_steps)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_record(self) -> dict[str, Any]:
        """The recipe as the run's files record it: credentials (hub_token) left out, written as null."""
        return {**self.to_dict(), **dict.fromkeys(SECRET_FIELDS)}

    def dump(self, path: Path) -> None:
        """Write the resolved recipe as YAML (a checkpoint's hftrain_config.yaml), without credentials."""
        path.write_text(yaml.safe_dump(self.to_record(), sort_keys=False), encoding="utf-8")


FIELDS = {f.name: f for f in dataclasses.fields(Recipe)}
TYPES = typing.get_type_hints(Recipe)  # resolved annotations (they are strings under __future__ annotations)


# --------------------------------------------------------------------------- coercion
def _base_type(tp: Any) -> tuple[Any, bool]:
    """(inner type, optional?) for annotations like `int | None`."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args:
        inner = [a for a in args if a is not type(None)]
        return inner[0], True
    return tp, False


def _coerce(name: str, value: Any, from_cli: bool) -> Any:
    """Convert `value` to the field's type or raise ValueError with a readable reason."""
    tp, optional = _base_type(TYPES[name])
    word = value[0] if isinstance(value, list) and len(value) == 1 else value  # a list field's words (nargs +)
    if value is None or (optional and from_cli and isinstance(word, str) and word.lower() in {"none", "null"}):
        if optional:  # `--eval_steps none` unsets; for other fields "none" is a value (`--report_to none`)
            return None
        raise ValueError("may not be empty")
    if typing.get_origin(tp) is dict:
        value = yaml.safe_load(value) if isinstance(value, str) else value  # CLI: --dataset_columns '{a: b}'
        if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
            raise ValueError(f"expected a mapping of strings, got {value!r}")
        return dict(value)
    if typing.get_args(tp) == (DatasetSource,):
        value = yaml.safe_load(value) if isinstance(value, str) else value
        if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
            raise ValueError("expected a list of {name, config, split, weight, columns, format} mappings")
        return [_dataset_source(i, v) for i, v in enumerate(value)]
    if typing.get_origin(tp) is list:
        return _coerce_list(typing.get_args(tp)[0], value, from_cli)
    return _coerce_scalar(tp, value, name)


# what an item of each type is called in a problem ("expected a list of numbers")
_NOUNS = {bool: ("true or false", "true/false values"), int: ("an integer", "integers"),
          float: ("a number", "numbers"), str: ("a string", "strings")}


def _coerce_list(item_type: type, value: Any, from_cli: bool) -> list:
    """A list field, every item read as `item_type` (YAML `[1.0, 0.5]`; on the command line `--f 1.0 0.5`, `--f
    1.0,0.5` or `--f '[1.0, 0.5]'`), or ValueError naming the first item that is not one."""
    words = [value] if isinstance(value, str) else value
    if isinstance(value, str) or from_cli and isinstance(value, list) and all(isinstance(v, str) for v in value):
        value = words
        if len(value) == 1 and value[0].lstrip().startswith("["):  # a YAML flow list: --reward_weights '[1, 0.5]'
            try:
                value = yaml.safe_load(value[0])
            except yaml.YAMLError:
                raise ValueError(f"expected a list of {_NOUNS[item_type][1]}, got {value[0]!r}") from None
        else:  # argparse hands over the words (nargs +), each may hold comma-separated items
            value = [item.strip() for word in value for item in word.split(",") if item.strip()]
    if not isinstance(value, list):
        raise ValueError(f"expected a list of {_NOUNS[item_type][1]}, got {value!r}")
    items = []
    for i, item in enumerate(value, 1):
        if item_type is str and not isinstance(item, str):  # YAML read it as another type: refuse, do not guess
            raise ValueError(f"expected a list of strings; item {i} is {item!r} (quote it)")
        try:
            items.append(_coerce_scalar(item_type, item.strip() if isinstance(item, str) else item))
        except ValueError:
            raise ValueError(f"expected a list of {_NOUNS[item_type][1]}; item {i} is {item!r}, not "
                             f"{_NOUNS[item_type][0]}") from None
    return [item for item in items if item != ""] if item_type is str else items


def _coerce_scalar(tp: Any, value: Any, name: str = "") -> Any:
    """`value` as a bool, int, float or str (a field, or an item of a list field), or ValueError."""
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and is_bool_word(value):  # the words every command's yes/no options take
            return parse_bool(value)
        raise ValueError(f"expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ValueError(f"expected an integer, got {value!r}")
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"expected an integer, got {value!r}") from None
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ValueError(f"expected a number, got {value!r}")
        try:
            return float(value)  # YAML reads `1e-4` as a string: accept it as a number
        except ValueError:
            raise ValueError(f"expected a number, got {value!r}") from None
    if tp is str:
        if isinstance(value, (dict, list)):
            raise ValueError(f"expected a string, got {value!r}")
        return str(value)
    raise TypeError(f"unsupported field type {tp} for {name}")  # a bug in the schema, not user input


def _dataset_source(index: int, value: dict) -> DatasetSource:
    known = {f.name for f in dataclasses.fields(DatasetSource)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"entry {index} has unknown key(s) {unknown}; keys are {sorted(known)}")
    if "name" not in value:
        raise ValueError(f"entry {index} has no name")
    try:
        source = DatasetSource(**value)
        source.weight = float(source.weight)
    except (TypeError, ValueError):
        raise ValueError(f"entry {index}: weight must be a number, got {value.get('weight')!r}") from None
    if not isinstance(source.columns, dict):
        raise ValueError(f"entry {index}: columns must be a mapping")
    return source


def with_objective_defaults(values: dict[str, Any]) -> dict[str, Any]:
    """`values` plus the objective's own defaults (fields.grpo.OBJECTIVE_DEFAULTS: TRL's GRPOConfig differs from
    DPOConfig there) for the fields they leave unset."""
    defaults = {**OBJECTIVE_DEFAULTS, "distill": DISTILL_DEFAULTS}
    return {**defaults.get(values.get("objective"), {}), **values}


# ------------------------------------------------------------------------ validation
def validate(recipe: Recipe) -> list[str]:
    """Every problem with the recipe's values and combinations; [] when it is usable."""
    r, problems = recipe, []
    for name, f in FIELDS.items():
        choices = f.metadata["choices"]
        if choices and getattr(r, name) not in choices:
            shown = ", ".join(str(c) for c in choices if c is not None)
            problems.append(f"{name}={getattr(r, name)!r} is not one of: {shown}")
    for group in (logging_problems, training_problems, data_problems, objective_problems, grpo_problems,
                  distill_problems, model_problems, monitoring_problems, muon_problems, qat_problems, fp8_problems,
                  retrieval_problems, hub_problems, evaluation_problems, peft_problems):
        problems += group(r)
    return problems


def unused_settings(r: Recipe) -> list[str]:
    """Start-up notes for settings that a cadence or push_to_hub turned off leaves without effect (they stay in the
    resolved recipe as given: `--eval_strategy no` on a recipe with eval_steps needs nothing more)."""
    unused = {"eval": [name for name in ("eval_steps", "eval_dataset_name") if getattr(r, name) is not None],
              "save": [name for name in ("save_steps", "save_total_limit") if getattr(r, name) is not None]}
    return [f"{kind}_strategy no: {', '.join(f'{name}={getattr(r, name)}' for name in names)} not used"
            for kind, names in unused.items() if names and getattr(r, f"{kind}_strategy") == "no"] + hub_unused(r)


def check_output_dir(r: Recipe) -> list[str]:
    """Problems with where a training run writes and resumes (not needed to preview data)."""
    problems = []
    out = Path(r.output_dir)
    if r.resume_from_checkpoint not in (None, "latest") and not Path(r.resume_from_checkpoint).is_dir():
        problems.append(f"resume_from_checkpoint {r.resume_from_checkpoint!r} is not a checkpoint folder")
    if out.is_file():
        problems.append(f"output_dir {r.output_dir!r} is a file")
    elif r.resume_from_checkpoint is None and not r.overwrite_output_dir and holds_a_run(out):
        problems.append(_holds_a_run_problem(r.output_dir, out))
    return problems + parallel_problems(r)


def _holds_a_run_problem(name: str, out: Path) -> str:
    """What to do with an output_dir that holds a run: resume is offered only when a checkpoint can be resumed
    (resume_from_checkpoint=latest refuses a folder without one, so advising it there is a dead end)."""
    start_over = "set overwrite_output_dir=true to start over in it (its files are replaced)"
    if resumable := complete_checkpoints(out):
        return (f"output_dir {name!r} already holds a run (its newest checkpoint: {resumable[-1].name}); resume it "
                f"with resume_from_checkpoint=latest, pick another output_dir, or {start_over}")
    held = "a final model" if (out / FINAL_DIR).exists() else "checkpoints that were never completed"
    return (f"output_dir {name!r} already holds a run ({held}) but no complete checkpoint to resume from; pick "
            f"another output_dir, or {start_over}")


# -------------------------------------------------------------------------- loading
def _did_you_mean(name: str) -> str:
    close = difflib.get_close_matches(name.lstrip("-").replace("-", "_"), FIELDS, n=3, cutoff=0.75)
    return f" (did you mean {', '.join(close)}?)" if close else ""


def _coerce_all(values: dict[str, Any], from_cli: bool) -> tuple[dict[str, Any], list[str]]:
    """Typed values for known keys, and a problem for each unknown key or wrong type."""
    values, problems = from_trl.translate(values, FIELDS)
    clean = {}
    for key, value in values.items():
        if key not in FIELDS:
            problems.append(f"unknown key {key!r}{_did_you_mean(key)}")
            continue
        try:
            clean[key] = _coerce(key, value, from_cli)
        except ValueError as exc:
            problems.append(f"{key}: {exc}")
    return with_shipped_paths(clean), problems


def shipped_path(value: str) -> str:
    """A relative path that is not under the current folder but is one of the files shipped inside hftrain
    (models/tiny-llama, data/chat.jsonl...: the repository's recipes name them so) becomes that shipped file's
    absolute path, so that a shipped recipe, or a copy of one, runs from any folder as from the repository. Anything
    else (an existing path, an absolute one, a hub id) is returned unchanged."""
    path = Path(value)
    if path.is_absolute() or value.startswith("~") or path.exists() or not (SHIPPED / path).exists():
        return value
    return str(SHIPPED / path)


def with_shipped_paths(values: dict[str, Any]) -> dict[str, Any]:
    """`values` with `shipped_path` applied to the PATH_FIELDS and to dataset_mixture's names."""
    values = {key: shipped_path(value) if key in PATH_FIELDS and isinstance(value, str) else value
              for key, value in values.items()}
    if isinstance(values.get("dataset_mixture"), list):
        values["dataset_mixture"] = [dataclasses.replace(source, name=shipped_path(source.name))
                                     for source in values["dataset_mixture"]]
    return values


def recipe_from_dict(values: dict[str, Any], source: str = "recipe", for_training: bool = True) -> Recipe:
    """Build a validated Recipe from a mapping (e.g. a YAML file), or raise ConfigError with every problem."""
    clean, problems = _coerce_all(values, from_cli=False)
    return _validated(clean, problems, source, for_training)


def _validated(values: dict[str, Any], problems: list[str], source: str, for_training: bool,
               command_line: list[str] | None = None) -> Recipe:
    """The Recipe of coerced `values` (with the objective's defaults for the fields they leave unset), or ConfigError
    with `problems` (the coercion's) and every problem validation finds, under `source`; `command_line`: the
    problems of the command line's own words (unknown flags, values of the wrong type), reported as the command
    line's before them."""
    recipe = Recipe(**with_objective_defaults(values))
    problems = problems + validate(recipe)  # wrongly typed fields keep their defaults here
    problems += check_output_dir(recipe) if for_training else []
    if problems or command_line:
        raise ConfigError(groups=[("command line", command_line or []), (source, problems)])
    return recipe


def recipe_subset(values: dict[str, Any], names: tuple[str, ...], source: str) -> Recipe:
    """A Recipe with the typed `names` taken from `values` and defaults elsewhere, without path validation: for
    tools that read a finished run's hftrain_config.yaml (whose output_dir holds that run)."""
    clean, problems = _coerce_all({k: v for k, v in values.items() if k in names}, from_cli=False)
    if problems:
        raise ConfigError(problems, source)
    return Recipe(**with_objective_defaults(clean))


def shipped_recipes() -> list[Path]:
    """The recipes shipped inside hftrain (the repository's recipes/), by name."""
    return sorted(RECIPE_DIR.glob("*.yaml"), key=lambda path: path.stem)


def recipe_file(name: str) -> str:
    """`--config`'s value: a recipe file; else a shipped recipe, by name (`tiny-dpo`) or by its path in the repository
    (`recipes/tiny-dpo.yaml`, as the docs write it), so that both work from any folder."""
    path = Path(name).expanduser()
    if path.is_file():
        return name
    if not path.is_absolute() and ".." not in path.parts:
        for shipped in (SHIPPED / path, RECIPE_DIR / path, RECIPE_DIR / f"{name}.yaml"):
            if shipped.is_file():
                return str(shipped)
    names = ", ".join(p.stem for p in shipped_recipes())
    raise ConfigError([f"cannot read recipe file {name!r}: there is no such file, nor a recipe of that name among "
                       f"those shipped with hftrain ({names}; `hftrain recipes` describes them)"], "command line")


def read_yaml(path: str) -> dict[str, Any]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError([f"cannot read recipe file {path!r}: {exc.strerror}"], "command line") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError([f"{path} is not valid YAML: {first_line(exc)}"], f"recipe {path}") from None
    if not isinstance(data, dict):
        raise ConfigError([f"{path} must be a mapping of field: value"], f"recipe {path}")
    return data


# What `--help` shows of each group: one line on the group, then its commonly used fields (every field: --help GROUP,
# --help all); tests/unit/test_config.py checks that each group and each named field exists.
HELP_GROUPS = {
    "model": ("what loads and how: model, dtype, attention kernel, memory savers",
              ("model_name_or_path", "dtype", "attn_implementation", "gradient_checkpointing")),
    "data": ("datasets, formats and columns, chat template and loss masks, length, packing, streaming",
             ("dataset_name", "eval_dataset_name", "validation_split_percentage", "max_length", "packing",
              "assistant_only_loss")),
    "objective": ("what the loss is (sft, dpo, simpo, orpo, kto, reward, distill, grpo, embedding) and its "
                  "coefficients",
                  ("objective", "beta")),
    "grpo": ("online RL, objective grpo: reward functions, generations, clipping, vLLM, tools",
             ("reward_funcs", "num_generations")),
    "distill": ("objective distill: the teacher and the on-policy share", ("teacher_model_name_or_path",)),
    "retrieval": ("objective embedding: pooling, the contrastive loss's scale, the query prompt, the cached mode",
                  ("pooling", "contrastive_scale", "query_prompt", "mini_batch_size")),
    "training": ("the run: output, length, batch, optimizer and schedule, precision, seeds",
                 ("output_dir", "max_steps", "num_train_epochs", "per_device_train_batch_size",
                  "gradient_accumulation_steps", "learning_rate", "lr_scheduler_type", "warmup_ratio", "bf16",
                  "seed")),
    "peft": ("LoRA / DoRA adapters", ("use_peft", "lora_r", "lora_alpha")),
    "quantization": ("QLoRA: a 4- or 8-bit base (bitsandbytes)", ("load_in_4bit",)),
    "logging": ("when to log, evaluate and save; resuming; trackers",
                ("logging_steps", "eval_steps", "save_steps", "save_total_limit", "resume_from_checkpoint",
                 "report_to")),
    "evaluation": ("evaluation add-ons: lm-evaluation-harness tasks, completion samples", ("eval_tasks",)),
    "monitoring": ("W&B tags, progress bar, stragglers and hangs, profiling, MFU and cost", ()),
    "parallelism": ("the preset a recipe is sized for; tensor, sequence, context, expert and pipeline parallelism",
                    ("launch_preset",)),
    "hub": ("pushing to the Hugging Face hub", ("push_to_hub", "hub_model_id")),
}
HELP_ALL = "all"


class RecipeParser(argparse.ArgumentParser):
    """The recipe's command line: `--config` and `--<field> VALUE` for every field (field docs = help, one argument
    group per field group). `--help` shows each group in a line with its commonly used fields, one line each;
    `--help GROUP` a group's fields in full, `--help FIELD` one field, `--help all` every field. Nothing here imports
    torch: `hftrain finetune --help` prints before the training module is imported."""

    def __init__(self, prog: str) -> None:
        super().__init__(
            prog=prog, usage="%(prog)s [--help [GROUP|FIELD|all]] [--config RECIPE] [--<field> VALUE ...]",
            description="Fine-tune a causal LM. Fields come from --config (YAML) and are overridden by --<field> "
            "value on the command line (a list field takes its items as words or comma-separated: --reward_weights 1 "
            f"0.5; a yes/no field true or false: --bf16 true); {DEFAULT_RECIPE_NOTE}.",
            argument_default=argparse.SUPPRESS, add_help=False,
            allow_abbrev=False,  # a prefix is a typo to report, not a field to guess (--lora: which of the lora_*?)
        )
        self.add_argument("-h", "--help", action=RecipeHelp)
        self.add_argument("--config", metavar="RECIPE", help="Recipe YAML file, or a shipped recipe's name (hftrain "
                          "recipes lists them).")
        self.field_groups: dict[str, list[argparse.Action]] = {}
        for name, f in FIELDS.items():
            group = f.metadata["group"]
            if group not in self.field_groups:
                self.field_groups[group] = []
                container = self.add_argument_group(group)
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            tp, _ = _base_type(TYPES[name])
            kind = {bool: "BOOL", int: "INT", float: "FLOAT"}.get(tp) or {list: "LIST", dict: "MAP"}.get(
                typing.get_origin(tp), "STR")
            extra = {"nargs": "?", "const": "true"} if tp is bool else {}
            if typing.get_origin(tp) is list and typing.get_args(tp)[0] in _NOUNS:  # TRL's form: --reward_weights 1 0.5
                extra = {"nargs": "+"}
            text = f"{f.metadata['help']} (default: {default})".replace("%", "%%")  # argparse formats help with %
            self.field_groups[group].append(container.add_argument(f"--{name}", metavar=kind, help=text, **extra))

    def help_text(self, topic: str) -> str:
        """`--help`'s text for `topic`: "" the overview, a group's or a field's name, or "all"."""
        if topic == "":
            return self.overview()
        if topic == HELP_ALL:
            return self.format_help()
        name = topic.removeprefix("--")
        if name in self.field_groups:
            return self.described([name])
        if name in FIELDS:
            return self.described([FIELDS[name].metadata["group"]], only=f"--{name}")
        self.error(f"--help {topic}: no such group or field; give a group ({', '.join(self.field_groups)}), a field "
                   f"name, or {HELP_ALL}")
        return ""

    def described(self, groups: list[str], only: str | None = None) -> str:
        """The usage line and the full help of `groups`' fields (or of the one field `only`)."""
        formatter = self.formatter_class(prog=self.prog)
        formatter.add_usage(self.usage, self._actions, [])
        for group in groups:
            actions = [a for a in self.field_groups[group] if only is None or only in a.option_strings]
            formatter.start_section(f"{group} ({HELP_GROUPS.get(group, ('', ()))[0]})" if only is None else group)
            formatter.add_arguments(actions)
            formatter.end_section()
        return formatter.format_help()

    def overview(self, width: int | None = None) -> str:
        """Each group in one line, with its commonly used fields in one line each (their help's first sentence)."""
        width = (width or shutil.get_terminal_size().columns) - 2  # as argparse wraps
        formatter = self.formatter_class(prog=self.prog)
        formatter.add_usage(self.usage, self._actions, [])
        formatter.add_text(self.description)
        shown = [(group, action) for group, actions in self.field_groups.items() for action in actions
                 if action.dest in HELP_GROUPS.get(group, ("", ()))[1]]
        column = max(len(f"--{action.dest} {action.metavar}") for _, action in shown) + 4
        options = {"-h, --help [GROUP|FIELD|all]": "this overview; a group's fields in full (--help data), one "
                   "field's (--help max_length), all: every field",
                   "--config RECIPE": "a recipe YAML file, or a shipped recipe's name (hftrain recipes lists them)"}
        lines = [formatter.format_help().rstrip(), "", "options:"]
        for flag, doc in options.items():
            lines += textwrap.wrap(doc, max(width, column + 20), initial_indent=f"  {flag:<{column - 2}}",
                                   subsequent_indent=" " * column)
        lines += ["", f"fields: {len(FIELDS)} in {len(self.field_groups)} groups, each below with its commonly used "
                  "fields:"]
        for group, actions in self.field_groups.items():
            lines += textwrap.wrap(f"{group} ({len(actions)} fields): {HELP_GROUPS.get(group, ('', ()))[0]}",
                                   max(width, column + 20), subsequent_indent="    ")
            for action in actions:
                if (group, action) in shown:
                    flag = f"--{action.dest} {action.metavar}"
                    doc = first_sentence(FIELDS[action.dest].metadata["help"])
                    lines.append(f"  {flag:<{column - 2}}" + textwrap.shorten(doc, max(width - column, 20),
                                                                          placeholder=" ..."))
        return "\n".join(lines) + "\n"


class RecipeHelp(argparse.Action):
    """-h / --help [GROUP|FIELD|all]: print the recipe's help for the topic and exit."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs) -> None:
        super().__init__(option_strings, dest="help", nargs="?", const="", default=argparse.SUPPRESS,
                         metavar="GROUP|FIELD|all", help="this overview; GROUP: a group's fields in full, FIELD: one "
                         "field's, all: every field")

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(parser.help_text(values), end="")
        parser.exit()


def first_sentence(text: str) -> str:
    end = re.search(r"(?<!e\.g)(?<!i\.e)(?<!etc)\.(\s|$)", text)
    return text[:end.start() + 1] if end else text


def wants_help(argv: list[str]) -> bool:
    """Whether the recipe's arguments ask for `--help` (which prints without loading anything)."""
    return any(arg in ("-h", "--help") or arg.startswith("--help=") for arg in argv)


def build_arg_parser(prog: str = "hftrain finetune") -> RecipeParser:
    """`--config recipe.yaml` plus `--<field> value` for every field; field docs become --help."""
    return RecipeParser(prog)


def load_recipe(argv: list[str] | None = None, for_training: bool = True, prog: str = "hftrain finetune") -> Recipe:
    """Parse `--config` + overrides into a validated Recipe, or raise ConfigError listing every problem.

    `for_training` adds the output_dir / resume checks, which a data preview does not need.
    """
    args, unknown = build_arg_parser(prog).parse_known_args(argv)
    config_path = getattr(args, "config", None)
    source = f"recipe {config_path}" if config_path else "command line"
    problems = []
    for i, item in enumerate(unknown):  # a value right after an unknown flag belongs to it
        if item.startswith("-"):
            problems.append(f"unknown argument {item!r}{_did_you_mean(item)}")
        elif i == 0 or not unknown[i - 1].startswith("-"):
            problems.append(f"unexpected value {item!r} (fields are given as --name value)")
    cli_values = {k: v for k, v in vars(args).items() if k != "config"}
    from_cli, cli_problems = _coerce_all(cli_values, from_cli=True)
    file_values = read_yaml(recipe_file(config_path)) if config_path else {}
    # a file value overridden on the command line is not used, so its problems do not count
    from_file, file_problems = _coerce_all({k: v for k, v in file_values.items() if k not in cli_values},
                                           from_cli=False)
    return _validated({**from_file, **from_cli}, file_problems, source, for_training, problems + cli_problems)



