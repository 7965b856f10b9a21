"""TRL 1.16's KTOTrainer against hftrain's kto on the tiny local model: per-step loss, KL reference point and
rewards.

    python scripts/compare_trl_kto.py [--model models/tiny-llama --steps 3 --out /tmp/compare-trl-kto] [--json F]

Both train the same model on the same conversational unpaired rows (the first rows of data/unpaired.jsonl), in the
same order (sequential), with the same hyperparameters as scripts/compare_trl_dpo.py (AdamW torch, constant learning
rate, no warmup or weight decay, clipping at 1.0, fp32, no accumulation) but 8 rows per step, for loss_type kto and
apo_zero_unpaired, full fine-tuning (TRL loads a reference copy, hftrain copies the policy) and LoRA (both disable
the adapters). The chat template writes the newline between turns before each turn, so that nothing follows a
completion's <|im_end|> (docs/from-trl.md).

TRL pairs each prompt with the previous row's completion within each block of per_device_train_batch_size rows and
takes the KL reference point per micro-batch; hftrain applies the same rule to the optimizer step's whole batch. With
one micro-batch per step on one process the two are the same: they must agree.
Needs no network; about a minute on 2 CPU cores. docs/preference.md quotes its output; tests/e2e/test_kto.py
asserts it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
from compare_trl import NO_TRAILING_NEWLINE  # noqa: E402 - the sibling script's template
from compare_trl_dpo import COMMON, LORA, learning_rate  # noqa: E402 - the same settings as dpo's

SETTINGS = {**COMMON, "per_device_train_batch_size": 8}
VARIANTS = {f"{loss} {method}": (loss, method) for loss in ("kto", "apo_zero_unpaired") for method in ("full", "lora")}
KEYS = ("loss", "kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")


def write_data(out: Path, rows: int) -> Path:
    lines = (REPO / "data" / "unpaired.jsonl").read_text(encoding="utf-8").splitlines()[:rows]
    path = out / "unpaired.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def run_trl(model_path: Path, data: Path, template: Path, steps: int, out: Path, loss: str, method: str) -> list:
    """TRL's values per step; the LoRA policy is made as hftrain makes it (seed, load, get_peft_model)."""
    import datasets
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback, set_seed
    from trl import KTOConfig, KTOTrainer

    rows: list[dict] = []

    class Record(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                rows.append({k: logs[k] for k in KEYS if k in logs})

    set_seed(SETTINGS["seed"])
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    if method == "lora":
        model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **LORA), autocast_adapter_dtype=True)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    tokenizer.chat_template = template.read_text()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = KTOConfig(output_dir=str(out), use_cpu=True, bf16=False, optim="adamw_torch",
                           gradient_checkpointing=False, max_steps=steps, train_sampling_strategy="sequential",
                           eval_strategy="no", save_strategy="no", report_to=[], disable_tqdm=True, loss_type=loss,
                           learning_rate=learning_rate(method), **SETTINGS)
        trainer = KTOTrainer(model=model, args=config, processing_class=tokenizer,
                             train_dataset=datasets.load_dataset("json", data_files=str(data), split="train"),
                             callbacks=[Record()])
        trainer.train()
    return rows


def run_hftrain(model_path: Path, data: Path, template: Path, steps: int, out: Path, loss: str, method: str) -> list:
    recipe = dict(model_name_or_path=str(model_path), dataset_name=str(data), validation_split_percentage=0,
                  train_sampling_strategy="sequential", optim="adamw_torch", max_steps=steps, output_dir=str(out),
                  overwrite_output_dir=True, report_to=["none"], disable_tqdm=True, save_steps=10_000,
                  chat_template_path=str(template), objective="kto", loss_type=loss,
                  learning_rate=learning_rate(method), **SETTINGS)
    if method == "lora":
        recipe.update(use_peft=True, lora_r=LORA["r"], lora_alpha=LORA["lora_alpha"],
                      lora_dropout=LORA["lora_dropout"], lora_target_modules=LORA["target_modules"])
    path = out.parent / f"{out.name}.json"
    path.write_text(json.dumps(recipe))  # JSON is YAML
    proc = subprocess.run([sys.executable, str(REPO / "hftrain" / "finetune.py"), "--config", str(path)],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    if proc.returncode:
        raise SystemExit(proc.stderr[-3000:])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: r[k] for k in KEYS} for r in rows if "loss" in r]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=REPO / "models" / "tiny-llama")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("/tmp/compare-trl-kto"))
    parser.add_argument("--json", type=Path, default=None, help="Also write the results here.")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                        help="Which (loss_type, method) to compare (default: all four).")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    data = write_data(args.out, SETTINGS["per_device_train_batch_size"] * args.steps)
    template = args.out / "chatml_no_trailing_newline.jinja"
    template.write_text(NO_TRAILING_NEWLINE)
    results = {}
    for i, name in enumerate(args.variants):
        loss, method = VARIANTS[name]
        trl = run_trl(args.model, data, template, args.steps, args.out / f"trl-{i}", loss, method)
        mine = run_hftrain(args.model, data, template, args.steps, args.out / f"hftrain-{i}", loss, method)
        results[name] = {"trl": trl, "hftrain": mine}
        print(f"== {name}")
        for step, (a, b) in enumerate(zip(trl, mine), 1):
            worst = max(abs(a[k] - b[k]) / max(abs(b[k]), 1e-8) for k in a)
            print(f"  step {step}: loss TRL {a['loss']:.6f} hftrain {b['loss']:.6f}; kl TRL {a.get('kl', 0):.6f} "
                  f"hftrain {b['kl']:.6f}; largest relative difference over {len(a)} values {worst:.1e}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
