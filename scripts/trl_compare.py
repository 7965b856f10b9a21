"""What the scripts/compare_trl*.py comparisons share: one objective trained by TRL's trainer and by hftrain on the
same rows, in the same order, with the same hyperparameters, and the two compared step by step.

Each script keeps only what its objective decides: its data, its TRL trainer and config, the recipe fields that map
onto them, the metrics it compares and what it prints. This module holds the rest: the shared settings, the chat
template without a trailing newline, the TRL run (model made as hftrain makes it, a callback recording the logged
metrics), the hftrain run (the real entry script on a JSON recipe, its metrics.jsonl read back) and the command line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
# ChatML as in models/tiny-llama, with the newline that separates turns written before each turn but the first:
# every conversation renders to the same text as with the shipped template, without the final trailing "\n".
NO_TRAILING_NEWLINE = (
    "{% for message in messages %}"
    "{% if not loop.first %}{{ '\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '\n<|im_start|>assistant\n' }}{% endif %}"
)
# The preference and distillation comparisons' hyperparameters (AdamW torch, constant learning rate, no warmup or
# weight decay, clipping at 1.0, fp32, 4 rows per step, no accumulation): TrainingArguments and recipe fields alike.
SETTINGS = dict(per_device_train_batch_size=4, max_length=256, lr_scheduler_type="constant", warmup_steps=0,
                weight_decay=0.0, max_grad_norm=1.0, seed=42, logging_steps=1, beta=0.1)
LORA = dict(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])


def learning_rate(method: str) -> float:
    return 2e-2 if method == "lora" else 1e-3


def parser(doc: str, out: str, model: bool = True) -> argparse.ArgumentParser:
    """The options every comparison takes; a script adds its own."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if model:
        parser.add_argument("--model", type=Path, default=REPO / "models" / "tiny-llama",
                            help="The model both train, a local folder (default: %(default)s).")
    parser.add_argument("--steps", type=int, default=3, help="Optimizer steps of each run (default: %(default)s).")
    parser.add_argument("--out", type=Path, default=Path(out),
                        help="Where the data, the recipes and both runs are written (default: %(default)s).")
    parser.add_argument("--json", type=Path, default=None, help="Also write the results here.")
    return parser


def write_template(out: Path) -> Path:
    """The output folder, made, with NO_TRAILING_NEWLINE written into it."""
    out.mkdir(parents=True, exist_ok=True)
    template = out / "chatml_no_trailing_newline.jinja"
    template.write_text(NO_TRAILING_NEWLINE)
    return template


def first_rows(source: str, count: int, out: Path, keep: Callable[[dict], bool] = lambda row: True) -> Path:
    """The first `count` lines of data/`source` whose row `keep` accepts, as out/`source`."""
    lines = [line for line in (REPO / "data" / source).read_text(encoding="utf-8").splitlines()
             if keep(json.loads(line))][:count]
    path = out / source
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def policy(model_path: Path, method: str, model_class=None, task_type: str = "CAUSAL_LM", **load):
    """The model TRL trains, made as hftrain makes it (seed, load, get_peft_model), so that both start from the same
    weights, score head and adapter initialisation."""
    from transformers import AutoModelForCausalLM, set_seed

    set_seed(SETTINGS["seed"])
    model = (model_class or AutoModelForCausalLM).from_pretrained(model_path, dtype=torch.float32, **load)
    if method == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(task_type=task_type, **LORA), autocast_adapter_dtype=True)
    return model


def tokenizer(model_path: Path, template: Path | None = None):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if template:
        tokenizer.chat_template = template.read_text()
    return tokenizer


def train_trl(trainer_class, config_class, model, processing_class, data: Path, steps: int, out: Path,
              keys: Iterable[str], trainer_kwargs: dict | None = None, **config) -> tuple[list[dict], object]:
    """TRL's trainer on `data` in file order for `steps` steps on the CPU, nothing saved or evaluated on the way:
    each logged step's values of `keys` (those it logs), and the trained trainer."""
    import datasets
    from transformers import TrainerCallback

    keys, rows = tuple(keys), []

    class Record(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                rows.append({k: logs[k] for k in keys if k in logs})

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = config_class(output_dir=str(out), use_cpu=True, bf16=False, optim="adamw_torch",
                            gradient_checkpointing=False, max_steps=steps, train_sampling_strategy="sequential",
                            eval_strategy="no", save_strategy="no", report_to=[], disable_tqdm=True, **config)
        trainer = trainer_class(model=model, args=args, processing_class=processing_class,
                                train_dataset=datasets.load_dataset("json", data_files=str(data), split="train"),
                                callbacks=[Record()], **(trainer_kwargs or {}))
        trainer.train()
    return rows, trainer


def run_hftrain(out: Path, model_path: Path, data: Path, steps: int, method: str = "full", **fields) -> list[dict]:
    """hftrain's entry script on `data` in file order for `steps` steps, no checkpoint on the way, LoRA as LORA for
    method "lora", `fields` added to the recipe (or replacing its defaults: optim): every row of its metrics.jsonl."""
    recipe = {**dict(model_name_or_path=str(model_path), dataset_name=str(data), validation_split_percentage=0,
                     train_sampling_strategy="sequential", optim="adamw_torch", max_steps=steps, output_dir=str(out),
                     overwrite_output_dir=True, report_to=["none"], disable_tqdm=True, save_steps=10_000),
              **{k: str(v) if isinstance(v, Path) else v for k, v in fields.items()}}
    if method == "lora":
        recipe.update(use_peft=True, lora_r=LORA["r"], lora_alpha=LORA["lora_alpha"],
                      lora_dropout=LORA["lora_dropout"], lora_target_modules=LORA["target_modules"])
    path = out.parent / f"{out.name}.json"
    path.write_text(json.dumps(recipe))  # JSON is YAML
    proc = subprocess.run([sys.executable, str(REPO / "hftrain" / "finetune.py"), "--config", str(path)],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    if proc.returncode:
        raise SystemExit(proc.stderr[-3000:])
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def train_steps(rows: list[dict], keys: Iterable[str]) -> list[dict]:
    """The values of `keys` on each training row of a metrics.jsonl."""
    return [{k: r[k] for k in keys} for r in rows if "loss" in r]


def print_steps(trl: list[dict], mine: list[dict], shown: Iterable[tuple[str, str, str]], worst: bool = True) -> None:
    """One line a step: each (label, key, format) of `shown` for TRL and hftrain (0 where TRL does not log the key),
    then, with `worst`, the largest relative difference over the values TRL logged."""
    shown = tuple(shown)
    for step, (a, b) in enumerate(zip(trl, mine), 1):
        said = "; ".join(f"{label} TRL {a.get(key, 0):{spec}} hftrain {b[key]:{spec}}" for label, key, spec in shown)
        if worst:
            largest = max(abs(a[k] - b[k]) / max(abs(b[k]), 1e-8) for k in a)
            said += f"; largest relative difference over {len(a)} values {largest:.1e}"
        print(f"  step {step}: {said}")


def write_json(path: Path | None, results: dict) -> None:
    if path:
        path.write_text(json.dumps(results, indent=1))
