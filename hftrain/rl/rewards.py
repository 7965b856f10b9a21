"""Reward functions of objective grpo: loaded from the recipe's `reward_funcs` (a dotted import path
`pkg.module.func` or `path/to/file.py:func`), checked before any heavy work, and called with TRL's signature
`f(prompts, completions, completion_ids, **dataset_columns) -> list[float | None]`. An entry that is a folder is a
reward model (`RewardModel`: a sequence classifier with one output, e.g. objective reward's final folder), as TRL
accepts a model id there.

A conversational prompt (a list of messages) gets its completion as `[{"role": "assistant", "content": text}]`, a
text prompt as the text, as TRL does. None means "no reward from this function for this completion" (NaN in the
advantages' nan-sums); every other value must be a real number, one per completion.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import math
import numbers
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

from hftrain.errors import HftrainError

CALL_ARGUMENTS = ("prompts", "completions", "completion_ids")


@dataclass
class RewardFunction:
    spec: str  # as the recipe wrote it
    name: str  # the function's __name__: the rollouts' and metrics' key (rewards/<name>/mean)
    func: Callable


def load_object(spec: str) -> Callable:
    """The object `spec` names (pkg.module.name or path/to/file.py:name); ImportError / AttributeError / OSError say
    what is missing."""
    if ":" in spec:
        path, _, attr = spec.rpartition(":")
        file = Path(path).expanduser()
        if not file.is_file():
            raise OSError(f"no file {file}")
        # the same name in every process (a rollout worker's environments are unpickled by the trainer)
        module_name = f"hftrain_reward_{hashlib.sha256(str(file.resolve()).encode()).hexdigest()[:16]}"
        loader = importlib.util.spec_from_file_location(module_name, file)
        module = importlib.util.module_from_spec(loader)
        sys.modules[module_name] = module  # dataclasses and pickling inside the file look their module up here
        loader.loader.exec_module(module)
    else:
        module_path, _, attr = spec.rpartition(".")
        if not module_path:
            raise ImportError("a dotted path needs a module and a function name, e.g. my_rewards.length_reward")
        module = importlib.import_module(module_path)
    return getattr(module, attr)


class RewardModel:
    """A reward model folder (`AutoModelForSequenceClassification`, one output) as a reward function, scoring as TRL's
    GRPOTrainer scores with a model: each prompt + completion rendered by the folder's tokenizer (its chat template
    for conversational prompts, the plain concatenation for text), tokenized without special tokens, right-padded,
    the score at each sequence's last non-pad token. The weights load at the first call, on this process's device."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.__name__ = folder.parent.name if folder.name == "final" else folder.name  # rewards/<name>/mean
        self.model = self.tokenizer = None

    @staticmethod
    def problem(folder: Path) -> str | None:
        """Why the folder is not a reward model that loads (from its config only), or None."""
        if not (folder / "config.json").is_file():
            adapter = (folder / "adapter_config.json").is_file()
            return "is a LoRA adapter; merge it into its base first (a full reward model folder)" if adapter else \
                "has no config.json; give a folder saved with save_pretrained (objective reward's final folder)"
        try:
            config = AutoConfig.from_pretrained(folder)
        except (OSError, ValueError) as exc:
            return f"has a config that does not load ({exc})"
        classes = [a for a in (config.architectures or []) if a.endswith("ForSequenceClassification")]
        if not classes or config.num_labels != 1:
            what = f"{classes[0]} with {config.num_labels} outputs" if classes else \
                ", ".join(config.architectures or ["model without architectures"])
            return (f"is a {what}, not a reward model (a ...ForSequenceClassification with one output: train one "
                    "with objective: reward)")
        return None

    def load(self) -> None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.tokenizer = AutoTokenizer.from_pretrained(self.folder)
        if self.tokenizer.pad_token_id is None:  # as TRL: the EOS token pads
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(self.folder, num_labels=1).to(device).eval()
        self.model.config.get_text_config().pad_token_id = self.tokenizer.pad_token_id

    def __call__(self, prompts: list, completions: list, completion_ids: list, **columns) -> list[float]:
        if self.model is None:
            self.load()
        if prompts and isinstance(prompts[0], list):
            texts = [self.tokenizer.apply_chat_template(p + c, tokenize=False) for p, c in zip(prompts, completions)]
        else:
            texts = [p + c for p, c in zip(prompts, completions)]
        inputs = self.tokenizer(text=texts, return_tensors="pt", padding=True, padding_side="right",
                                add_special_tokens=False).to(self.model.device)
        with torch.inference_mode():
            return self.model(**inputs).logits[:, 0].float().tolist()


def signature_problem(func: Callable, columns: Sequence[str] | None) -> str | None:
    """Why `func` cannot be called as TRL calls reward functions with these dataset columns, or None. `columns`
    None: the columns are not known yet, only TRL's three arguments are checked (a function may require a
    column by name)."""
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):
        return None  # a builtin or C function: trust it, its first call is checked
    try:
        names = (*CALL_ARGUMENTS, *(columns or ()))
        (signature.bind_partial if columns is None else signature.bind)(**{name: [] for name in names})
    except TypeError as exc:
        return f"it cannot take the keyword arguments {', '.join(names)} ({exc}); define it as f(prompts, " \
               "completions, completion_ids, **kwargs)"
    return None


def load_reward_functions(specs: Sequence[str]) -> tuple[list[RewardFunction], list[str]]:
    """(the loaded functions, every problem found): each spec imported and checked for TRL's three arguments."""
    funcs, problems = [], []
    for spec in specs:
        folder = Path(spec).expanduser()
        if folder.is_dir():  # a reward model
            if problem := RewardModel.problem(folder):
                problems.append(f"reward_funcs entry {spec!r} is a folder that {problem}")
            else:
                model = RewardModel(folder)
                funcs.append(RewardFunction(spec, model.__name__, model))
            continue
        try:
            func = load_object(spec)
        except Exception as exc:  # noqa: BLE001 - any failure of user code while importing is reported the same way
            problems.append(f"reward_funcs entry {spec!r} does not load ({type(exc).__name__}: {exc}); give a dotted "
                            "import path pkg.module.func or path/to/file.py:func")
            continue
        if not callable(func):
            problems.append(f"reward_funcs entry {spec!r} is a {type(func).__name__}, not a function")
            continue
        problem = signature_problem(func, None)
        if problem:
            problems.append(f"reward_funcs entry {spec!r}: {problem}")
            continue
        funcs.append(RewardFunction(spec, getattr(func, "__name__", spec.rpartition(".")[2]), func))
    names = [f.name for f in funcs]
    for name in sorted({n for n in names if names.count(n) > 1}):
        problems.append(f"reward_funcs has two functions named {name!r}: their metrics and rollout columns would "
                        "collide; rename one")
    return funcs, problems


def column_problems(funcs: Sequence[RewardFunction], columns: Sequence[str]) -> list[str]:
    """Problems of calling the functions with the dataset's other columns (known once the data is loaded)."""
    problems = []
    for f in funcs:
        problem = signature_problem(f.func, columns)
        if problem:
            problems.append(f"reward function {f.spec!r} with the dataset's columns: {problem}")
    return problems


class RewardFailure(HftrainError):
    """A reward function returned something that is not one number (or None) per completion."""


def score(funcs: Sequence[RewardFunction], prompts: list, completions: list, completion_ids: list[list[int]],
          columns: dict[str, list]) -> torch.Tensor:
    """[completions, functions] float32 rewards, NaN where a function returned None."""
    out = torch.full((len(completions), len(funcs)), math.nan, dtype=torch.float32)
    for k, f in enumerate(funcs):
        try:
            values = f.func(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        except Exception as exc:  # noqa: BLE001 - user code: every failure stops the run the same way, named
            raise RewardFailure(f"reward function {f.spec!r} raised {type(exc).__name__}: {exc}") from exc
        try:
            values = list(values)
        except TypeError:
            raise RewardFailure(f"reward function {f.spec!r} returned a {type(values).__name__}, not a list of "
                                f"{len(completions)} numbers (one per completion; None for no reward)") from None
        if len(values) != len(completions):
            raise RewardFailure(f"reward function {f.spec!r} returned {len(values)} rewards for {len(completions)} "
                                "completions; it must return exactly one per completion (None for no reward)")
        for i, value in enumerate(values):
            if value is None:
                continue
            if not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
                raise RewardFailure(f"reward function {f.spec!r} returned {value!r} for completion {i}: rewards must "
                                    "be finite numbers, or None for no reward")
            out[i, k] = float(value)
    return out
