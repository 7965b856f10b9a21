"""A trained folder as a model to use: `hftrain chat` and `hftrain eval` read any of

- a full model folder (`output_dir/final` of a full fine-tune, a merged folder, any `from_pretrained` folder):
  config.json + weights;
- a peft adapter folder (`output_dir/final` of a use_peft run): adapter_config.json, its base read from there
  (or `--base_model_name_or_path`); a QLoRA adapter goes on its base quantized and dequantized again exactly as in
  training (`hftrain.merge.load_dequantized_base`), the function the adapter was trained with;
- an hftrain `checkpoint-N` saved by one process or DDP (model.safetensors: the trained weights, every weight of a
  full fine-tune or the adapter's), rebuilt from its hftrain_config.yaml: the base, the adapter settings, the
  tokenizer and chat template as training prepared them. Sharded checkpoints (FSDP2 and pipeline DCP folders,
  DeepSpeed engine files, tensor parallelism's gathered state) are refused with the way to get a final folder.

`inspect(folder)` says which one a folder is, or why it is none, reading only small files, so that a bad folder is
refused before anything heavy loads. A reward model's folder (objective reward: a ...ForSequenceClassification, its
LoRA adapter, or a checkpoint of its run) is refused there too, with how to score with it: it writes no text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from hftrain import hub
from hftrain.config import read_yaml, recipe_subset
from hftrain.data.tokenize import prepare_chat_template
from hftrain.errors import HftrainError, first_line
from hftrain.fields.data import looks_local
from hftrain.merge import BASE_FIELDS, load_dequantized_base, training_recipe
from hftrain.model import fit_embeddings_to_tokenizer, lora_config
from hftrain.paths import COMPLETE_FILE, CONFIG_FILE, FINAL_DIR, MODEL_FILE, PREFIX, STATE_FILE
from hftrain.ties import tied_groups

ADAPTER_CONFIG = "adapter_config.json"
# what a checkpoint's recipe says about the model it trained: the base, the adapters, the tokenizer and template
CHECKPOINT_FIELDS = (*BASE_FIELDS, "use_peft", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules",
                     "use_dora", "use_rslora", "modules_to_save", "tokenizer_name_or_path", "chat_template_path")
WRAPPER_PREFIX = "lm."  # the loss wrapper's attribute (model.WrapsCausalLM.lm): checkpoints' weight names
# what each sharded layout leaves in a checkpoint instead of MODEL_FILE
SHARDED_LAYOUTS = {"fsdp2": "FSDP2's sharded DCP files", "deepspeed": "DeepSpeed's engine files",
                   "tp": "tensor parallelism's gathered training state", "pipeline": "per-stage DCP files"}


@dataclass
class Folder:
    """What a folder holds: `kind` is model, adapter or checkpoint; `base`: an adapter's or a checkpoint's base."""

    path: Path
    kind: str
    base: str | None = None
    adapter: bool = False  # a checkpoint of a use_peft run

    def describe(self) -> str:
        if self.kind == "model":
            return f"model {self.path}"
        if self.kind == "adapter":
            return f"adapter {self.path} on base {self.base}"
        return f"checkpoint {self.path} ({'adapter' if self.adapter else 'full fine-tune'} of {self.base})"


@dataclass
class Trained:
    model: torch.nn.Module  # in eval mode, on `device`
    tokenizer: PreTrainedTokenizerBase
    folder: Folder


def inspect(folder: Path, base: str | None = None) -> Folder:
    """Which kind of trained folder `folder` is, from its small files; raises HftrainError (one paragraph) for a
    folder that is none, an adapter whose base cannot be found, or a checkpoint that cannot be read here."""
    if not folder.is_dir():
        raise HftrainError(f"{str(folder)!r} is not a folder; give a trained model folder: output_dir/{FINAL_DIR}, a "
                           f"merged folder, an adapter folder or output_dir/{PREFIX}N")
    if (folder / ADAPTER_CONFIG).is_file():
        refuse_retrieval_model(folder)
        refuse_reward_model(folder, "adapter")
        found = Folder(folder, "adapter", base or adapter_base(folder))
    elif (folder / "config.json").is_file():
        if not any(folder.glob("*.safetensors")) and not any(folder.glob("*.bin")):
            raise HftrainError(f"{folder} has config.json but no weights (*.safetensors or *.bin): it describes a "
                               "model without holding one; give the folder the model was saved to")
        refuse_retrieval_model(folder)
        refuse_reward_model(folder, "model")
        return Folder(folder, "model")
    elif (folder / STATE_FILE).is_file() and (folder / CONFIG_FILE).is_file():
        refuse_retrieval_model(folder)
        refuse_reward_model(folder, "checkpoint")
        recipe = checkpoint_recipe(folder, base)
        found = Folder(folder, "checkpoint", recipe.model_name_or_path, recipe.use_peft)
        checkpoint_problem(folder)
    else:
        inside = [p.name for p in (folder / FINAL_DIR, *sorted(folder.glob(f"{PREFIX}*"))) if p.is_dir()]
        hint = f" It looks like a run's output_dir: give {folder / inside[0]}." if inside else ""
        raise HftrainError(f"{folder} is not a model folder: it holds neither config.json (a model), "
                           f"{ADAPTER_CONFIG} (a peft adapter) nor {STATE_FILE} with {CONFIG_FILE} (an hftrain "
                           f"checkpoint-N).{hint}")
    check_base(found)
    return found


def sequence_classifier(folder: Path, kind: str) -> str | None:
    """What makes `folder` (of `kind`: model, adapter, checkpoint) a reward model / sequence classifier, in words,
    from its small files; None for a text generator."""
    if kind == "model":
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        classes = [a for a in config.get("architectures") or [] if a.endswith("ForSequenceClassification")]
        if not classes:
            return None
        labels = len(config.get("id2label") or {}) or config.get("num_labels", 2)
        return f"a {classes[0]} with {'one output' if labels == 1 else f'{labels} outputs'}"
    if kind == "adapter":
        task = json.loads((folder / ADAPTER_CONFIG).read_text(encoding="utf-8")).get("task_type")
        return f"a LoRA adapter of a sequence classifier (task_type {task})" if task == "SEQ_CLS" else None
    objective = (read_yaml(str(folder / CONFIG_FILE)) or {}).get("objective")
    return "a checkpoint of an objective reward run" if objective == "reward" else None


def refuse_retrieval_model(folder: Path) -> None:
    """An embedding model or a reranker (objective embedding / reranker: sentence-transformers' files beside the
    model, or a checkpoint of such a run) writes no text: chat and eval's tasks have nothing to run on it."""
    st_config = folder / "config_sentence_transformers.json"
    if st_config.is_file():
        model_type = json.loads(st_config.read_text(encoding="utf-8")).get("model_type", "SentenceTransformer")
    elif (folder / CONFIG_FILE).is_file() and (folder / STATE_FILE).is_file():
        objective = (read_yaml(str(folder / CONFIG_FILE)) or {}).get("objective")
        model_type = {"embedding": "SentenceTransformer", "reranker": "CrossEncoder"}.get(objective)
    else:
        model_type = None
    if model_type not in ("SentenceTransformer", "CrossEncoder"):
        return
    what, use = (("an embedding model", f"encode texts with sentence_transformers.SentenceTransformer({str(folder)!r}) "
                  f"as its README.md shows, or rank a local task with `hftrain eval {folder} --retrieval DIR`")
                 if model_type == "SentenceTransformer" else
                 ("a reranker", f"score (query, passage) pairs with sentence_transformers.CrossEncoder({str(folder)!r})"
                  " as its README.md shows"))
    if not st_config.is_file():
        use = f"use the run's {FINAL_DIR} folder: {use.replace(str(folder), f'output_dir/{FINAL_DIR}')}"
    raise HftrainError(f"{folder} is {what} (sentence-transformers' {model_type}): it writes no text, so chat and "
                       f"eval's --tasks, which generate text, cannot use it. Instead, {use}.")


def refuse_reward_model(folder: Path, kind: str) -> None:
    """A reward model scores text and writes none: chat and eval have nothing to run on it. Says how to use it."""
    what = sequence_classifier(folder, kind)
    if what is None:
        return
    score = ("scores = model(**tokenizer.apply_chat_template(messages, return_dict=True, return_tensors='pt'))"
             ".logits[:, 0]")
    how = {
        "model": f"load it with AutoModelForSequenceClassification.from_pretrained({str(folder)!r}) and its tokenizer, "
                 f"then {score} (higher is better; its README.md has the snippet), or name the folder in a grpo "
                 "run's reward_funcs",
        "adapter": f"merge it into its base with `hftrain merge {folder} MERGED` (a full reward model folder, which "
                   "grpo's reward_funcs also takes), or load it with peft's "
                   f"AutoPeftModelForSequenceClassification.from_pretrained({str(folder)!r}, num_labels=1), then "
                   f"{score}",
        "checkpoint": f"use the run's {FINAL_DIR} folder (resume from this checkpoint with --max_steps set to its step "
                      "to save one), which loads with AutoModelForSequenceClassification",
    }[kind]
    raise HftrainError(f"{folder} is a reward model ({what}): it gives a conversation one score and writes no text, "
                       f"so chat and eval, which generate text, cannot use it. To score with it, {how}.")


def adapter_base(folder: Path) -> str:
    base = json.loads((folder / ADAPTER_CONFIG).read_text(encoding="utf-8")).get("base_model_name_or_path")
    if not base:
        raise HftrainError(f"{folder / ADAPTER_CONFIG} names no base model (base_model_name_or_path); pass "
                           "--base_model_name_or_path with the model the adapter was trained on")
    return base


def check_base(found: Folder) -> None:
    """The base of an adapter or checkpoint exists: a local folder, or a hub id whose config loads (the cache
    only, offline)."""
    where = f"{found.path / ADAPTER_CONFIG}" if found.kind == "adapter" else f"{found.path / CONFIG_FILE}"
    if looks_local(found.base) and not Path(found.base).expanduser().is_dir():
        raise HftrainError(f"the base model of {found.path}, {found.base!r} (named in {where}), is not a folder on "
                           "this machine; pass --base_model_name_or_path with where that model is now")
    hub.reach(f"the base model of {found.path} (named in {where}),", found.base,
              local="pass --base_model_name_or_path with a local copy")
    try:
        AutoConfig.from_pretrained(found.base)
    except (OSError, ValueError) as exc:
        raise HftrainError(f"cannot load the base model {found.base!r} of {found.path} (named in {where}): "
                           f"{first_line(exc)}. Pass --base_model_name_or_path with a local copy, or a hub id "
                           "reachable from this machine (with HF_HUB_OFFLINE=1 only cached models load)") from None


def checkpoint_recipe(folder: Path, base: str | None):
    values = read_yaml(str(folder / CONFIG_FILE))
    if base:
        values["model_name_or_path"] = base
    return recipe_subset(values, CHECKPOINT_FIELDS, source=str(folder / CONFIG_FILE))


def checkpoint_problem(folder: Path) -> None:
    """Refuse a checkpoint whose weights are not one model.safetensors (a sharded layout) or that is incomplete."""
    if not (folder / COMPLETE_FILE).is_file():
        raise HftrainError(f"{folder} has no {COMPLETE_FILE}: the checkpoint was never completed (a save cut short); "
                           "give an earlier checkpoint or the final folder")
    if (folder / MODEL_FILE).is_file():
        return
    state = json.loads((folder / STATE_FILE).read_text(encoding="utf-8"))
    parallel = state.get("parallelism", {})
    kind = "pipeline" if parallel.get("pp_size", 1) > 1 else parallel.get("kind", "unknown")
    name = parallel.get("name", kind)
    raise HftrainError(
        f"{folder} was saved by {name} and holds {SHARDED_LAYOUTS.get(kind, 'sharded files')} instead of one "
        f"{MODEL_FILE}, which this command does not read. Get a standard folder from it: rerun the training command "
        f"under the same preset with --resume_from_checkpoint {folder} --max_steps {state['progress']['step']}; it "
        f"resumes at its last step and saves output_dir/{FINAL_DIR} without training, which this command reads")


def load_tokenizer(found: Folder, chat_template: str | None = None):
    if found.kind == "checkpoint":  # training's tokenizer and template, from the recipe (a checkpoint saves none)
        recipe = checkpoint_recipe(found.path, found.base)
        tokenizer = AutoTokenizer.from_pretrained(recipe.tokenizer_name_or_path or recipe.model_name_or_path,
                                                  trust_remote_code=recipe.trust_remote_code)
        prepare_chat_template(tokenizer, recipe.chat_template_path, needs_chat=True)
    else:
        has_tokenizer = any((found.path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json"))
        tokenizer = AutoTokenizer.from_pretrained(str(found.path) if has_tokenizer else found.base)
    if chat_template:
        tokenizer.chat_template = Path(chat_template).read_text(encoding="utf-8")
    return tokenizer


def add_loading_arguments(parser) -> None:
    """The options of `load` that the console tools reading a trained folder (`hftrain chat`, `hftrain eval`) share."""
    parser.add_argument("--base_model_name_or_path", default=None,
                        help="An adapter's or checkpoint's base model, if not where its folder says.")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                        help="dtype of the weights (auto: as saved).")


def load(folder: Path, base: str | None = None, chat_template: str | None = None, device: str | None = None,
         dtype: str = "auto") -> Trained:
    """The folder's model (eval mode, on `device`: CUDA when there is one) and tokenizer."""
    from peft import PeftModel  # optional heavy: peft imports bitsandbytes

    found = inspect(folder, base)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = load_tokenizer(found, chat_template)
    torch_dtype = "auto" if dtype == "auto" else getattr(torch, dtype)
    try:
        if found.kind == "model":
            model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch_dtype)
        elif found.kind == "adapter":
            recipe, _ = training_recipe(folder, found.base)
            model = PeftModel.from_pretrained(load_dequantized_base(recipe), str(folder))
        else:
            model = load_checkpoint(found)
    except (OSError, ValueError) as exc:
        raise HftrainError(f"cannot load {found.describe()}: {first_line(exc)}") from None
    if dtype != "auto":
        model = model.to(torch_dtype)
    return Trained(model.to(device).eval(), tokenizer, found)


def load_checkpoint(found: Folder) -> torch.nn.Module:
    """checkpoint-N's model: its base (dequantized for QLoRA) with the recipe's adapters, then the saved trained
    weights (every one of them must find its place; a full fine-tune's file holds every weight)."""
    from peft import get_peft_model  # optional heavy: peft imports bitsandbytes

    recipe = checkpoint_recipe(found.path, found.base)
    model = load_dequantized_base(recipe)
    fit_embeddings_to_tokenizer(model, load_tokenizer(found))  # the ChatML fallback's tokens, as training added
    if recipe.use_peft:
        model = get_peft_model(model, lora_config(recipe), autocast_adapter_dtype=True)
    saved = {k.removeprefix(WRAPPER_PREFIX): v for k, v in load_file(str(found.path / MODEL_FILE)).items()}
    result = model.load_state_dict(saved, strict=False)
    tied = {name for group in tied_groups(model) if group & set(saved) for name in group}
    missing = [] if recipe.use_peft else sorted(set(result.missing_keys) - tied)
    if result.unexpected_keys or missing:
        raise HftrainError(f"{found.path / MODEL_FILE} does not match the model its {CONFIG_FILE} describes "
                           f"({len(result.unexpected_keys)} unexpected weights, e.g. {result.unexpected_keys[:2]}; "
                           f"{len(missing)} missing, e.g. {missing[:2]}); was the recipe file edited?")
    return model
