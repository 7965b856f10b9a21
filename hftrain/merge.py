"""Merge a LoRA / DoRA adapter into its base model: a standard safetensors model folder + tokenizer.

    python -m hftrain.merge outputs/run/final outputs/run/merged [--dtype bfloat16] [--push_to_hub org/name --dry_run]
    hftrain merge ...                                             (the same, once hftrain is installed)

The merge is done in float32. An adapter trained on a quantized base (QLoRA: load_in_4bit / load_in_8bit in the
hftrain_config.yaml saved next to the adapter) is merged into the *dequantized* base: the base is quantized exactly
as in training, then dequantized, so the merged weights are dequant(quant(W)) + scale * B @ A, the function the
adapter was trained with. Merging into the 4-bit weights themselves re-quantizes (and loses) the update; merging
into the original W adds an adapter to weights it never saw.

The output loads with `AutoModelForCausalLM.from_pretrained` and vLLM-style loaders: config.json without
quantization settings, safetensors with the base model's tensor names, one floating dtype, tokenizer and chat
template, generation config. A reward model's adapter (objective reward: peft's SEQ_CLS task, its score head trained
whole) is merged into the base loaded as `AutoModelForSequenceClassification` with one output, its pad token set as
training set it (the score is read at the last token that is not padding): the output loads with
`AutoModelForSequenceClassification.from_pretrained` and as a grpo reward function (a reranker's likewise). An
embedding model's adapter (objective embedding: peft's FEATURE_EXTRACTION task) is merged into the base loaded as
`AutoModel`; the sentence-transformers files beside the adapter (modules.json, the pooling...) are copied, so the
output loads with `SentenceTransformer` (a reranker's: `CrossEncoder`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from huggingface_hub.utils import HFValidationError, validate_repo_id
from transformers import (
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoModelForSequenceClassification,
    AutoProcessor,
    AutoTokenizer,
)

if __package__ in (None, ""):  # run as a file: import the package, not sibling modules as top-level names
    _here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _here]
    sys.path.insert(0, str(_here.parent))

from hftrain import card, hub, vision
from hftrain.checkpoint import never_world_writable
from hftrain.compat.accelerate import deepspeed_probed_by_import
from hftrain.config import read_yaml, recipe_subset
from hftrain.errors import ConfigError, HftrainError, run_tool
from hftrain.model import (
    DTYPES,
    load_as_encoder,
    load_as_reward_model,
    load_error,
    name_deepspeeds_cpu_accelerator,
    pad_token_id,
    quantization_config,
    quiet_peft,
)
from hftrain.options import Parser, add_switch
from hftrain.paths import CONFIG_FILE

MERGE_FILE = "hftrain_merge.json"
# the files objective embedding and reranker add beside the model (objectives/embedding.py, reranker.py)
SENTENCE_TRANSFORMERS_FILES = ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json",
                               "1_Pooling", "2_Normalize", "1_LogitScore", "chat_template.jinja")
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
# What the merge needs from the training recipe: where the base is and how it was quantized.
BASE_FIELDS = ("model_name_or_path", "model_revision", "trust_remote_code", "load_in_4bit", "load_in_8bit",
               "bnb_4bit_quant_type", "bnb_4bit_use_double_quant", "bnb_4bit_compute_dtype", "bnb_4bit_quant_storage")


def training_recipe(adapter_dir: Path, base: str | None):
    """The recipe the adapter was trained with (its model and quantization fields), from hftrain_config.yaml.

    Only typed field values are read; the run's paths are not re-validated (its output_dir holds the run).
    An adapter from elsewhere (no hftrain_config.yaml) is taken as trained on the unquantized base.
    """
    config_file = adapter_dir / CONFIG_FILE
    values = read_yaml(str(config_file)) if config_file.exists() else {}
    adapter_config = json.loads((adapter_dir / "adapter_config.json").read_text(encoding="utf-8"))
    values["model_name_or_path"] = base or adapter_config.get("base_model_name_or_path") or values.get(
        "model_name_or_path")
    if not values["model_name_or_path"]:
        raise HftrainError(f"{adapter_dir}/adapter_config.json names no base model; pass --base_model_name_or_path")
    return recipe_subset(values, BASE_FIELDS, source=str(config_file)), config_file.exists()


def task_type(adapter_dir: Path) -> str | None:
    """peft's task of the adapter: SEQ_CLS (objective reward or reranker: a one-output sequence classifier),
    FEATURE_EXTRACTION (objective embedding: the body alone), CAUSAL_LM..."""
    return json.loads((adapter_dir / "adapter_config.json").read_text(encoding="utf-8")).get("task_type")


def scores(adapter_dir: Path) -> bool:
    """Whether the adapter is a reward model's or a reranker's (peft's SEQ_CLS task)."""
    return task_type(adapter_dir) == "SEQ_CLS"


def load_dequantized_base(recipe, reward: bool = False, encoder: bool = False):
    """The base in float32; quantized and dequantized again exactly as in training for a QLoRA adapter. `reward`:
    as objective reward loads it, a sequence classifier with one output; `encoder`: as objective embedding loads it,
    AutoModel."""
    hub.reach("base model", recipe.model_name_or_path, recipe.model_revision)
    quantization = quantization_config(recipe)
    kwargs = {"dtype": torch.float32, "revision": recipe.model_revision, "trust_remote_code": recipe.trust_remote_code}
    auto = AutoModelForImageTextToText if vision.is_image_text(vision.model_config(recipe)) else AutoModelForCausalLM
    if reward:
        auto, kwargs["num_labels"] = AutoModelForSequenceClassification, 1
    if quantization is not None:
        kwargs["quantization_config"] = quantization
    # the former two hold back the head-swap report
    load = load_as_reward_model if reward else load_as_encoder if encoder else auto.from_pretrained
    try:
        model = load(recipe.model_name_or_path, **kwargs)
    except (OSError, ValueError) as exc:
        raise HftrainError(load_error("base model", recipe.model_name_or_path, exc)) from None
    return model if quantization is None else model.dequantize(dtype=torch.float32)


def merge(adapter_dir: Path, output_dir: Path, base: str | None = None, dtype: str = "auto") -> dict:
    """Merge `adapter_dir` into its base and save the result in `output_dir`; returns what was done."""
    from peft import PeftModel  # optional heavy: peft imports bitsandbytes

    if not (adapter_dir / "adapter_config.json").exists():
        raise HftrainError(f"{str(adapter_dir)!r} has no adapter_config.json; give the final folder of a "
                           "use_peft run (output_dir/final) or another peft adapter folder")
    if output_dir.exists() and any(output_dir.iterdir()):
        raise HftrainError(f"output folder {str(output_dir)!r} is not empty; choose a new folder")
    recipe, from_hftrain = training_recipe(adapter_dir, base)
    reward, encoder = scores(adapter_dir), task_type(adapter_dir) == "FEATURE_EXTRACTION"
    model = load_dequantized_base(recipe, reward, encoder)
    base_dtype = model.config.dtype
    with quiet_peft():
        model = PeftModel.from_pretrained(model, str(adapter_dir), torch_device="cpu")
    model = model.merge_and_unload(safe_merge=True)
    out_dtype = DTYPES[dtype] if dtype != "auto" else base_dtype
    model = model.to(out_dtype)
    model.config.use_cache = True
    for leftover in ("quantization_config",):
        if hasattr(model.config, leftover):
            delattr(model.config, leftover)
    has_tokenizer = any((adapter_dir / f).exists() for f in ("tokenizer.json", "tokenizer_config.json"))
    source = str(adapter_dir) if has_tokenizer else recipe.model_name_or_path
    if vision.is_image_text(model.config):  # the processor: tokenizer, image processor and chat template
        tokenizer = AutoProcessor.from_pretrained(source, trust_remote_code=recipe.trust_remote_code)
    else:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=recipe.trust_remote_code)
    if reward:  # the score is read at the last token that is not this id: the pad id training set
        model.config.get_text_config().pad_token_id = model.config.pad_token_id = pad_token_id(tokenizer)
    output_dir.mkdir(parents=True, exist_ok=True)
    name_deepspeeds_cpu_accelerator()
    with deepspeed_probed_by_import():
        model.save_pretrained(output_dir, safe_serialization=True)
    tokenizer.save_pretrained(output_dir)
    for name in SENTENCE_TRANSFORMERS_FILES:  # an embedding model's or reranker's: it loads with sentence-transformers
        if (adapter_dir / name).is_dir():
            shutil.copytree(adapter_dir / name, output_dir / name)
        elif (adapter_dir / name).is_file():
            shutil.copy2(adapter_dir / name, output_dir / name)
    quantized = "4bit" if recipe.load_in_4bit else "8bit" if recipe.load_in_8bit else None
    record = {
        "adapter": str(adapter_dir.resolve()),
        "base_model_name_or_path": recipe.model_name_or_path,
        "base_quantization_in_training": quantized,
        "merged_into": "dequantized base" if quantized else "full-precision base",
        "model_class": type(model).__name__,
        "dtype": str(out_dtype).removeprefix("torch."),
        "recipe_found": from_hftrain,
    }
    (output_dir / MERGE_FILE).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return record


def push_problems(repo_id: str) -> list[str]:
    """Why `--push_to_hub repo_id` cannot work here (checked before the merge loads anything)."""
    problems = []
    try:
        validate_repo_id(repo_id)
    except HFValidationError as exc:
        problems.append(f"--push_to_hub {repo_id!r} is not a valid hub repo id: "
                        f"{str(exc).replace(' Use `repo_type` argument if needed.', '')} Give 'name' or 'org/name'")
    if hub.token_of(None) is None:
        problems.append("--push_to_hub needs a hub token with write access and none is set: log in with "
                        "`hf auth login` (`huggingface-cli login`) or export HF_TOKEN")
    if hub.offline():
        problems.append("--push_to_hub with HF_HUB_OFFLINE=1: huggingface_hub refuses every upload in offline mode; "
                        "unset HF_HUB_OFFLINE")
    return problems


def push_to_hub(folder: Path, repo_id: str, private: bool, dry_run: bool) -> list[str]:
    """Upload `folder` to the hub model repo `repo_id`; with dry_run only list what would be uploaded."""
    files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    if dry_run:
        return files
    try:
        hub.upload(folder, repo_id, "Upload model merged with hftrain", private=private or None)
    except Exception as exc:  # network, auth and offline errors all end the same way for the user
        raise HftrainError(f"cannot push {folder} to the hub repo {repo_id!r}: {hub.failure(exc)}. The merged model is "
                           "saved locally; log in with `hf auth login` (or set HF_TOKEN), unset HF_HUB_OFFLINE and "
                           f"push again with `hf upload {repo_id} {folder} .`") from None
    return files


def build_arg_parser(prog: str = "hftrain.merge") -> argparse.ArgumentParser:
    parser = Parser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("adapter_dir", type=Path, help="Folder with adapter_config.json (a use_peft run's final/).")
    parser.add_argument("output_dir", type=Path, help="New folder for the merged model.")
    parser.add_argument("--base_model_name_or_path", default=None,
                        help="Base model; default: the one named in adapter_config.json.")
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                        help="dtype of the saved weights (the merge itself is float32); auto = the base's dtype.")
    parser.add_argument("--push_to_hub", metavar="REPO_ID", default=None, help="Upload the merged folder to this "
                        "hub model repo (org/name).")
    add_switch(parser, "--private", help="Create the hub repo as private.")
    add_switch(parser, "--dry_run", help="With --push_to_hub: list what would be uploaded and where, without "
               "contacting the hub.")
    return parser


def merge_and_push(args: argparse.Namespace) -> None:
    if args.dry_run and not args.push_to_hub:
        raise HftrainError("--dry_run only applies to --push_to_hub; add --push_to_hub org/name or drop it")
    if args.push_to_hub and (problems := push_problems(args.push_to_hub) if not args.dry_run else []):
        raise ConfigError(problems, "command line")
    record = merge(args.adapter_dir, args.output_dir, args.base_model_name_or_path, args.dtype)
    card.merged_card(args.output_dir, args.adapter_dir, record, load_from=args.push_to_hub)
    reward = " (a reward model: it loads with AutoModelForSequenceClassification)" \
        if record["model_class"].endswith("ForSequenceClassification") else ""
    print(f"hftrain: merged {args.adapter_dir} into the {record['merged_into']} {record['base_model_name_or_path']}"
          f" ({record['dtype']}): {args.output_dir}{reward}")
    if args.push_to_hub:
        files = push_to_hub(args.output_dir, args.push_to_hub, args.private, args.dry_run)
        verb = "would upload" if args.dry_run else "uploaded"
        print(f"hftrain: {verb} {len(files)} files to https://huggingface.co/{args.push_to_hub}"
              f"{' (private)' if args.private else ''}: {', '.join(files)}")


def main(argv: list[str] | None = None, prog: str = "hftrain.merge") -> None:
    args = build_arg_parser(prog).parse_args(argv)
    never_world_writable()
    run_tool(merge_and_push, args)


if __name__ == "__main__":
    main()
