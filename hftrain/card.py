"""Model cards: the README.md of every folder hftrain writes for use (output_dir/final: a full model or an adapter; the
model `hftrain merge` writes), in the hub's conventions so that `huggingface_hub.ModelCard.load` parses it and the hub
files the model under its base, library, task and datasets.

Front matter: `base_model` (the base's hub id: the recipe's model id, or the repo of a local folder inside a hub cache;
none for any other local folder: the hub takes only repo ids there and refuses a push whose card names a path),
`library_name` (transformers, or peft for an adapter),
`pipeline_tag`, `tags` (hftrain, the objective, the method), `datasets` (those that are hub ids), `license` (from the
base model's card or config, when either gives one). Body: what was trained and how, the final losses (rewards for
grpo, preference rewards for dpo/simpo), device-hours, the loss curve (loss.png beside the card, drawn as
`hftrain report` draws it), a quick start that loads the folder, the recipe's own settings and the framework
versions. Everything comes from the folder's run files (hftrain_state.json, hftrain_config.yaml) and the run's
metrics.jsonl; the card is written atomically (a temporary file renamed over README.md), so it can be rewritten
once the final evaluation has run.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata as md
import json
import os
from pathlib import Path

import yaml
from huggingface_hub import ModelCard, ModelCardData, try_to_load_from_cache

from hftrain.config import PATH_FIELDS, Recipe
from hftrain.fields.data import looks_local
from hftrain.fields.hub import SECRET_FIELDS
from hftrain.paths import CONFIG_FILE, METRICS_FILE, SHIPPED, STATE_FILE
from hftrain.report import plot_loss

CARD_FILE = "README.md"
LOSS_FIGURE = "loss.png"
OBJECTIVES = {
    "sft": "supervised fine-tuning (next-token cross-entropy on the trained tokens)",
    "dpo": "Direct Preference Optimization on chosen/rejected pairs",
    "simpo": "SimPO (reference-free, length-normalised preference optimization)",
    "orpo": "ORPO (reference-free odds-ratio preference optimization with the chosen answers' NLL)",
    "kto": "KTO (Kahneman-Tversky optimization on unpaired desirable/undesirable feedback, against a reference)",
    "reward": "reward modelling (a one-output score head trained to rank chosen above rejected answers, as TRL's "
              "RewardTrainer)",
    "grpo": "GRPO (online RL: completions sampled from the model and scored by reward functions)",
    "distill": "knowledge distillation (the generalized JSD to a teacher model's next-token distributions)",
    "embedding": "a text-embedding model (a bi-encoder trained with sentence-transformers' "
                 "MultipleNegativesRankingLoss on anchor/positive pairs with in-batch and hard negatives)",
    "reranker": "a reranker (a cross-encoder scoring query/passage pairs, trained with sentence-transformers' "
                "CrossEncoder losses)",
}
PIPELINE_TAG = "text-generation"
# the results' metrics (metrics.jsonl's keys, TRL's names) in words: a training row's as given, an evaluation's
# (eval_<key>) as "eval <words>"
LABELS = {"reward": "mean reward", "reward_std": "reward std", "rewards/accuracies": "reward accuracy",
          "rewards/margins": "reward margin", "accuracy": "accuracy", "margin": "margin"}
# objectives whose folder is not a text generator
PIPELINE_TAGS = {"reward": "text-classification", "embedding": "sentence-similarity",
                 "reranker": "text-ranking"}


# ------------------------------------------------------------------------------------------------ facts
def read_metrics(output_dir: Path) -> list[dict]:
    """The run's metrics rows ([] when there is no metrics.jsonl; a line cut short by a crash is skipped)."""
    path = output_dir / METRICS_FILE
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines() if path.is_file() else []:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and "step" in row:
            rows.append(row)
    return rows


def method_of(recipe: dict, summary: dict) -> tuple[str, str]:
    """(tag, description) of the fine-tuning method."""
    if not recipe.get("use_peft"):
        return "full", "full fine-tuning (every weight trained)"
    name = "dora" if recipe.get("use_dora") else "lora"
    bits = 4 if recipe.get("load_in_4bit") else 8 if recipe.get("load_in_8bit") else None
    tag = "qlora" if bits == 4 else name
    adapters = (f"{'DoRA' if name == 'dora' else 'LoRA'} adapters (r={recipe['lora_r']}, alpha={recipe['lora_alpha']}"
                f"{', rsLoRA scaling' if recipe.get('use_rslora') else ''}) on "
                f"{', '.join(recipe.get('lora_target_modules') or [])}")
    if bits is not None:
        quant = f"{recipe.get('bnb_4bit_quant_type', 'nf4')} 4-bit" if bits == 4 else "LLM.int8 8-bit"
        adapters += f" over a {quant} quantized base (bitsandbytes)"
    return tag, adapters


def base_license(model: str, revision: str | None) -> str | None:
    """The license the base model's card (README.md front matter) or config names, read locally: from the folder, or
    from the hub cache for a hub id (no download); None for a folder that is gone."""
    if not Path(model).is_dir() and hub_id(model) is None:
        return None
    for name in ("README.md", "config.json"):
        if Path(model).is_dir():
            path = Path(model) / name
        else:
            cached = try_to_load_from_cache(model, name, revision=revision)
            path = Path(cached) if isinstance(cached, str) else None
        if path is None or not path.is_file():
            continue
        try:
            if name == "README.md":
                found = ModelCard.load(path).data.to_dict().get("license")
            else:
                found = json.loads(path.read_text(encoding="utf-8")).get("license")
        except (ValueError, OSError, yaml.YAMLError):
            continue
        if isinstance(found, str) and found:
            return found
    return None


def hub_id(model: str) -> str | None:
    """The hub repo id `model` (a recipe's model_name_or_path) is known by: itself when it is an id, the repo of a
    folder inside a hub cache (<cache>/models--org--name/snapshots/<commit>, as huggingface_hub's scan_cache reads
    it), None for any other local folder."""
    path = Path(model).expanduser()
    if not path.is_dir():
        return None if looks_local(model) else model
    parts = path.resolve().parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-3].removeprefix("models--").replace("--", "/")
    return None


def shipped_name(value: str) -> str | None:
    """The name inside hftrain's shipped files (`models/tiny-llama`, `data/preference.jsonl`: as the shipped recipes
    write them, and as any folder reads them) of the file or folder `value`, else None: a card names them so, not by
    their path in this installation (a site-packages path in a user's environment; the checkout's models/ and data/
    are the same files)."""
    if not isinstance(value, str) or not Path(value).expanduser().exists():
        return None
    real = Path(value).expanduser().resolve()
    for entry in sorted(SHIPPED.iterdir()):  # data, models... (symlinks in a checkout, folders in a wheel)
        inside = sorted(entry.iterdir()) if entry.is_dir() else []
        for shipped in (entry, *inside):
            if real == shipped.resolve() or shipped.resolve() in real.parents:
                return str(shipped.relative_to(SHIPPED) / real.relative_to(shipped.resolve()))
    return None


def shipped_model(model: str) -> str | None:
    """The name of the model shipped inside hftrain (hftrain/shipped/models/<name>: the tiny models of the demo and the
    tests) that the folder `model` is, else None."""
    name = shipped_name(model)
    return Path(name).name if name is not None and Path(name).parent == Path("models") else None


def hub_datasets(recipe: dict) -> list[str]:
    names = [recipe.get("dataset_name"), recipe.get("eval_dataset_name"),
             *[source["name"] for source in recipe.get("dataset_mixture") or []]]
    return list(dict.fromkeys(n for n in names if n and not looks_local(n)))


def recipe_settings(recipe: dict) -> dict:
    """The fields whose value differs from hftrain's default (what the recipe and command line set), credentials
    left out."""
    defaults = dataclasses.asdict(Recipe())
    named = {k: shipped_name(v) or v if k in PATH_FIELDS else v for k, v in recipe.items()}  # shipped files by name
    return {k: v for k, v in named.items() if k not in SECRET_FIELDS and k in defaults
            and v != (shipped_name(defaults[k]) or defaults[k] if k in PATH_FIELDS else defaults[k])}


def final_rows(rows: list[dict], step: int) -> tuple[dict | None, dict | None]:
    """(last training row, evaluation row of the final step), either None when absent."""
    train = [r for r in rows if r.get("loss") is not None and r["step"] <= step]
    # grpo: eval_reward; eval_tasks without an eval set: only eval/<task>/<metric>
    evals = [r for r in rows if r["step"] == step and any(k.startswith(("eval_", "eval/")) for k in r)]
    return (train[-1] if train else None), (evals[-1] if evals else None)


# ------------------------------------------------------------------------------------------------ the card
def _epochs(rows: list[dict], step: int) -> float | None:
    """The epoch the log gives at the last step (fractional, as Trainer logs it)."""
    logged = [r["epoch"] for r in rows if r.get("epoch") is not None and r["step"] == step]
    return logged[-1] if logged else None


def _fmt(value, digits: int = 4) -> str:
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def _reward_quick_start(load_from: str, kind: str, chat: bool) -> str:
    """Scoring a conversation (or a text) with a reward model's folder."""
    auto = "AutoPeftModelForSequenceClassification" if kind == "adapter" else "AutoModelForSequenceClassification"
    head = (f"from peft import {auto}\nfrom transformers import AutoTokenizer\n\n" if kind == "adapter" else
            f"from transformers import {auto}, AutoTokenizer\n\n")
    labels = ", num_labels=1" if kind == "adapter" else ""  # the base's own config has 2
    head += (f'model = {auto}.from_pretrained("{load_from}"{labels})\n'
             f'tokenizer = AutoTokenizer.from_pretrained("{load_from}")\n')
    if chat:
        body = ('messages = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4."}]\n'
                "inputs = tokenizer.apply_chat_template(messages, return_tensors=\"pt\", return_dict=True)\n")
    else:
        body = 'inputs = tokenizer("What is 2 + 2? 4.", return_tensors="pt")\n'
    body += "print(model(**inputs).logits[0, 0].item())  # the reward: higher is better"
    return f"```python\n{head}{body}\n```"


def _embedding_quick_start(load_from: str, kind: str) -> str:
    """Encoding queries and documents with an embedding model's folder: sentence-transformers reads its
    modules.json (pooling, normalisation, the query prompt); transformers alone loads the bare encoder."""
    adapter = ("# an adapter folder: sentence-transformers loads its base, then the adapter (peft installed)\n"
               if kind == "adapter" else "")
    return ("```python\nfrom sentence_transformers import SentenceTransformer\n\n" + adapter +
            f'model = SentenceTransformer("{load_from}")\n'
            'queries = model.encode_query(["What is 2 + 2?"])  # adds the query prompt the model was trained with\n'
            'documents = model.encode_document(["2 + 2 = 4.", "Paris is in France."])\n'
            "print(model.similarity(queries, documents))  # cosine similarities\n```\n\n"
            "The encoder alone loads with transformers' `AutoModel.from_pretrained`; its embedding is the pooling "
            "named in `1_Pooling/config.json` over the last hidden states, L2-normalised.")


def _reranker_quick_start(load_from: str) -> str:
    """Scoring (query, passage) pairs with a reranker's folder."""
    return ("```python\nfrom sentence_transformers import CrossEncoder\n\n"
            f'model = CrossEncoder("{load_from}")\n'
            'scores = model.predict([("What is 2 + 2?", "2 + 2 = 4."), ("What is 2 + 2?", "Paris is in France.")])\n'
            "print(scores)  # sigmoid of each pair's score: higher is more relevant\n```\n\n"
            "transformers alone: `AutoModelForSequenceClassification.from_pretrained` and "
            "`tokenizer(query, passage)`; the logit is the score. A yes/no reranker (a `1_LogitScore` folder, the "
            "Qwen3-Reranker form): `AutoModelForCausalLM.from_pretrained`, the pair rendered by the folder's chat "
            "template (messages with roles `query` and `document`); the score is logit('yes') - logit('no') at the "
            "last position.")


def _quick_start(load_from: str, kind: str, chat: bool, objective: str = "sft") -> str:
    if objective == "reward":
        return _reward_quick_start(load_from, kind, chat)
    if objective == "embedding":
        return _embedding_quick_start(load_from, kind)
    if objective == "reranker":
        return _reranker_quick_start(load_from)
    if kind == "adapter":
        head = ("from peft import AutoPeftModelForCausalLM\nfrom transformers import AutoTokenizer\n\n"
                f'model = AutoPeftModelForCausalLM.from_pretrained("{load_from}")  # the base model, then this adapter')
    else:
        head = ("from transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
                f'model = AutoModelForCausalLM.from_pretrained("{load_from}")')
    head += f'\ntokenizer = AutoTokenizer.from_pretrained("{load_from}")\n'
    if chat:
        body = ('messages = [{"role": "user", "content": "Hello! What can you do?"}]\n'
                "inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors=\"pt\", "
                "return_dict=True)\n")
    else:
        body = 'inputs = tokenizer("Once upon a time", return_tensors="pt")\n'
    body += ("output = model.generate(**inputs, max_new_tokens=64)\n"
             'print(tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))')
    return f"```python\n{head}{body}\n```"


def _versions_section(state: dict) -> list[str]:
    versions = state.get("versions") or {"hftrain": _version("hftrain"), "transformers": _version("transformers"),
                                         "peft": _version("peft"), "torch": _version("torch")}
    return ["## Framework versions", "", *[f"- {name}: {version}" for name, version in versions.items()], ""]


def _version(package: str) -> str:
    try:
        return md.version(package)
    except md.PackageNotFoundError:
        return "not installed"


def build_card(folder: Path, recipe: dict, state: dict, rows: list[dict], *, kind: str, device_hours: float | None,
               name: str, load_from: str | None = None, merged_from: dict | None = None, curve: bool = True
               ) -> tuple[ModelCard, str | None]:
    """The card of `folder` and the name of the loss figure to draw beside it (None: too few points).

    kind: model (a full fine-tune's folder), adapter (peft), merged (an adapter merged into its base: `merged_from`
    is hftrain_merge.json's record). `recipe` and `state` are the training run's (its hftrain_config.yaml and
    hftrain_state.json), `rows` its metrics.jsonl. `name`: the model's name (the hub repo id, or the run's folder
    name); `load_from`: what the quick start loads (the hub repo id; default the folder's path); `curve`: show the
    loss curve (false: a card about to be rewritten, e.g. before the final evaluation, skips drawing it)."""
    progress, summary = state.get("progress", {}), state.get("model", {})
    step = progress.get("step", 0)
    method_tag, method = method_of(recipe, summary)
    objective = recipe.get("objective", "sft")
    base = recipe["model_name_or_path"] if merged_from is None else merged_from["base_model_name_or_path"]
    base = str(Path(base).expanduser().resolve()) if Path(base).expanduser().is_dir() else base  # a local folder
    base_id = hub_id(base)
    tags = ["hftrain", *([objective] if state else []), method_tag, *(["merge"] if kind == "merged" else [])]
    data = ModelCardData(
        base_model=base_id,
        library_name="peft" if kind == "adapter" else "sentence-transformers" if objective in ("embedding", "reranker")
        else "transformers",
        pipeline_tag=PIPELINE_TAGS.get(objective, PIPELINE_TAG),
        tags=list(dict.fromkeys(tags)), datasets=hub_datasets(recipe) or None,
        license=base_license(base, recipe.get("model_revision")),
        model_name=name)
    title = name
    what = {"model": "a fine-tune", "adapter": "a peft adapter", "merged": "a fine-tune (adapter merged into its base)"}
    shipped = shipped_model(base)
    if shipped is not None:
        base_link = (f"hftrain's shipped `{shipped}` (a tiny model inside the hftrain package, "
                     f"hftrain/shipped/models/{shipped}; not a hub id, so the metadata above names no base_model)")
    elif base_id is None:
        base_link = f"the local model `{base}` (a folder, not a hub id, so the metadata above names no base_model)"
    else:
        base_link = f"[{base_id}](https://huggingface.co/{base_id})" + (f" (the local copy `{base}`)" if base_id != base
                                                                          else "")
    datasets = [s["name"] for s in state.get("data", {}).get("sources", [])] or [recipe.get("dataset_name")]
    datasets = [shipped_name(d) or d if d else d for d in datasets]
    how = (f", trained with hftrain by {OBJECTIVES.get(objective, objective)} on "
           f"{', '.join(f'`{d}`' for d in datasets if d)}" if state else ", merged with hftrain")
    lines = [f"# {title}", "", f"This is {what[kind]} of {base_link}{how}.", ""]
    if merged_from is not None:
        lines += [f"The adapter `{merged_from['adapter']}` was merged into the {merged_from['merged_into']} in "
                  f"float32 and saved as {merged_from['dtype']}.", ""]

    lines += ["## Quick start", "", _quick_start(load_from or str(folder.resolve()),
                                                 "adapter" if kind == "adapter" else "model",
                                                 (folder / "chat_template.jinja").exists(), objective), ""]
    if kind == "adapter" and shipped is not None:
        lines += [f"The adapter's config (adapter_config.json) names its base, hftrain's shipped `{shipped}`, by its "
                  "path in the hftrain installation that trained it, which the quick start loads. Elsewhere, load "
                  f"hftrain/shipped/models/{shipped} of that machine's hftrain and add the adapter to it: "
                  f'`PeftModel.from_pretrained(base, "{load_from or folder.resolve()}")`.', ""]
    elif kind == "adapter" and base_id != base:
        lines += [f"The adapter's config (adapter_config.json) names its base by the local path `{base}`, which "
                  "the quick start loads. On another machine, load your copy of the base model yourself and add "
                  f'the adapter to it: `PeftModel.from_pretrained(base, "{load_from or folder.resolve()}")`.', ""]

    if not state:  # an adapter trained elsewhere, merged by hftrain: its training is not known here
        lines += ["## Training", "", f"The adapter was not trained by hftrain (no {STATE_FILE} beside it), so its "
                  "training is not described here.", ""]
        lines += _versions_section(state)
        return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines)), None

    parallelism = state.get("parallelism", {})
    launch = state.get("launch", {})
    schedule = (f"{recipe.get('lr_scheduler_type')} schedule"
                + (f", {recipe['warmup_steps']} warmup steps" if recipe.get("warmup_steps") else "")
                + (f", warmup ratio {recipe['warmup_ratio']}" if recipe.get("warmup_ratio") else ""))
    learning_rate = (state.get("lr_scaling") or {}).get("learning_rate", recipe.get("learning_rate"))
    precision = "bf16 mixed precision" if recipe.get("bf16") else "fp16 mixed precision" if recipe.get("fp16") else \
        launch.get("mixed_precision", "no") if launch.get("mixed_precision", "no") != "no" else \
        f"{recipe.get('dtype', 'float32')} weights, no mixed precision"
    trained, total = summary.get("trainable_parameters"), summary.get("parameters")
    table = [
        ("objective", f"`{objective}`: {OBJECTIVES.get(objective, objective)}"),
        ("method", method + (f"; {_fmt(trained)} of {_fmt(total)} parameters trained" if trained and total else "")),
        ("strategy", f"{parallelism.get('name', 'single process')}"
                     + (f", {processes} processes" if (processes := parallelism.get("processes", 1)) > 1 else "")
                     + f" on {launch.get('device', 'cpu')}"),
        ("steps", f"{_fmt(step)} optimizer steps" + (f" ({_fmt(epochs)} epochs)" if (epochs := _epochs(rows, step))
                                                      is not None else "")),
        ("tokens trained", _fmt(progress.get("trained_tokens", 0))),
        ("effective batch", f"{_fmt(state.get('effective_batch_size'))} examples per step "
                            f"({recipe.get('per_device_train_batch_size')} per device x "
                            f"{parallelism.get('dp_world', 1)} data-parallel x "
                            f"{recipe.get('gradient_accumulation_steps')} accumulation)"),
        ("learning rate", f"{_fmt(learning_rate)} peak, {schedule}, optimizer {recipe.get('optim')}"),
        ("sequence length", f"{recipe.get('max_length')} tokens{', packed' if recipe.get('packing') else ''}"),
        ("precision", precision),
    ]
    if device_hours is not None:
        table.append(("device-hours", _fmt(device_hours)))
    lines += ["## Training", "", "| | |", "| --- | --- |", *[f"| {k} | {v} |" for k, v in table], ""]

    train_row, eval_row = final_rows(rows, step)
    results = metric_results(objective, rows, train_row, eval_row, step)
    benchmarks = {k: v for k, v in (eval_row or {}).items() if k.startswith("eval/") and "_stderr" not in k}
    for key, value in benchmarks.items():  # eval_tasks: lm-eval's results, eval/<task>/<metric>
        task, metric = key.removeprefix("eval/").split("/", 1)
        name, _, kept_filter = metric.partition(",")  # exact_match,strict-match: its stderr exact_match_stderr,...
        stderr = eval_row.get(f"eval/{task}/{name}_stderr" + (f",{kept_filter}" if kept_filter else ""))
        shown = _fmt(value) + (f" ± {_fmt(stderr)}" if stderr is not None else "")
        results.append((f"{task} {metric} (lm-eval)", shown))
    figure = None
    if results:
        lines += ["## Results", "", "| | final |", "| --- | --- |", *[f"| {k} | {v} |" for k, v in results], ""]
        if curve and len([r for r in rows if r.get("loss") is not None]) >= 2:
            figure = LOSS_FIGURE
            lines += [f"![{loss_title(rows)}]({LOSS_FIGURE})", ""]
    else:
        lines += ["## Results", "", "No metrics.jsonl was found beside this folder, so the losses are not shown; "
                  f"the run's progress is in {STATE_FILE}.", ""]

    settings = recipe_settings(recipe)
    lines += ["## Recipe", "", f"The settings that differ from hftrain's defaults (the whole resolved recipe is "
              f"{CONFIG_FILE}):", "", "```yaml",
              yaml.safe_dump(settings, sort_keys=False).rstrip() if settings else "# hftrain's defaults", "```", ""]
    lines += _versions_section(state)
    card = ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines))
    return card, figure


def metric_results(objective: str, rows: list[dict], train_row: dict | None, eval_row: dict | None,
                   step: int) -> list[tuple[str, str]]:
    """The results table's rows (label, value), each metric in words (`LABELS`), the objective's headline first: the
    train and eval loss, or for grpo the mean reward (its policy-gradient loss is about 0 by construction)."""
    losses, metrics = [], []
    if train_row is not None:
        note = "; grpo's loss is about 0 by construction: the mean reward says how it learns" \
            if objective == "grpo" else ""
        losses.append(("train loss", f"{_fmt(train_row['loss'])} (logged at step {train_row['step']}){note}"))
    if eval_row is not None and eval_row.get("eval_loss") is not None:
        losses.append(("eval loss", f"{_fmt(eval_row['eval_loss'])} (after step {step})"))
        if "eval_perplexity" in eval_row:
            losses.append(("eval perplexity", _fmt(eval_row["eval_perplexity"])))
    trained = [r for r in rows if r.get("loss") is not None and r["step"] <= step]
    for key, label in LABELS.items():
        logged = [r for r in trained if r.get(key) is not None]  # grpo logs its rewards at the steps that sample
        if logged:
            shown = _fmt(logged[-1][key])
            if key == "reward":  # the headline of grpo: where it started, too
                shown += f" (logged at step {logged[-1]['step']}" + (
                    f"; {_fmt(logged[0]['reward'])} at step {logged[0]['step']})" if len(logged) > 1 else ")")
            metrics.append((label, shown))
        if eval_row is not None and eval_row.get(f"eval_{key}") is not None:
            metrics.append((f"eval {label}", _fmt(eval_row[f"eval_{key}"])))
    return metrics + losses if objective == "grpo" else losses + metrics


def loss_title(rows: list[dict]) -> str:
    """The loss figure's title: it shows the eval loss only where the run evaluated one."""
    return "Train and eval loss" if any("eval_loss" in r for r in rows) else "Train loss"


def write_card(folder: Path, card: ModelCard, figure: str | None, rows: list[dict]) -> Path:
    """README.md (and the loss figure) in `folder`, each written to a temporary file and renamed into place."""
    if figure is not None:
        tmp = folder / f".{figure}.tmp.png"
        plot_loss([r for r in rows if r.get("loss") is not None], [r for r in rows if "eval_loss" in r], tmp)
        os.replace(tmp, folder / figure)
    tmp = folder / f".{CARD_FILE}.tmp"
    tmp.write_text(str(card), encoding="utf-8")
    os.replace(tmp, folder / CARD_FILE)
    return folder / CARD_FILE


def run_card(folder: Path, output_dir: Path, *, kind: str, device_hours: float | None, repo_id: str | None = None,
             location: Path | None = None, curve: bool = True) -> Path:
    """The card of a run's folder for use (final/, or the model a save pushes), from its run files and the run's
    metrics.jsonl. `repo_id`: the hub repo it is pushed to (its name and what the quick start loads); `location`:
    where the folder ends up (it may be written under a temporary name first)."""
    recipe = yaml.safe_load((folder / CONFIG_FILE).read_text(encoding="utf-8"))
    state = json.loads((folder / STATE_FILE).read_text(encoding="utf-8"))
    rows = read_metrics(output_dir)
    card, figure = build_card(folder, recipe, state, rows, kind=kind, device_hours=device_hours,
                              name=repo_id or output_dir.resolve().name,
                              load_from=repo_id or str((location or folder).resolve()), curve=curve)
    return write_card(folder, card, figure, rows)


def merged_card(merged_dir: Path, adapter_dir: Path, record: dict, load_from: str | None = None) -> Path:
    """The card of a merged model: the adapter's training run (its run files, and metrics.jsonl of the output_dir
    it sits in) with the merge's record."""
    config, state_file = adapter_dir / CONFIG_FILE, adapter_dir / STATE_FILE
    if config.is_file():
        recipe = yaml.safe_load(config.read_text(encoding="utf-8"))
    else:  # an adapter from elsewhere: what its adapter_config.json says
        adapter = json.loads((adapter_dir / "adapter_config.json").read_text(encoding="utf-8"))
        targets = adapter.get("target_modules") or []
        recipe = {"model_name_or_path": record["base_model_name_or_path"], "use_peft": True,
                  "use_dora": bool(adapter.get("use_dora")), "lora_r": adapter.get("r"),
                  "lora_alpha": adapter.get("lora_alpha"),
                  "lora_target_modules": sorted(targets) if isinstance(targets, list) else [targets],
                  **({"objective": "reward"} if adapter.get("task_type") == "SEQ_CLS" else {})}
    state = json.loads(state_file.read_text(encoding="utf-8")) if state_file.is_file() else {}
    rows = read_metrics(adapter_dir.resolve().parent) if state else []
    card, figure = build_card(merged_dir, recipe, state, rows, kind="merged",
                              device_hours=state.get("device_hours"), name=load_from or merged_dir.resolve().name,
                              load_from=load_from, merged_from=record)
    return write_card(merged_dir, card, figure, rows)
