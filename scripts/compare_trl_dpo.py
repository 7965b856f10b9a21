"""TRL 1.16's DPOTrainer against hftrain's dpo on the tiny local model: per-step loss and rewards.

    python scripts/compare_trl_dpo.py [--model models/tiny-llama --steps 3 --out /tmp/compare-trl-dpo] [--json F]

Both train the same model on the same conversational pairs (the first pairs of data/preference.jsonl), in the same
order (sequential), with the same hyperparameters (AdamW torch, constant learning rate, no warmup or weight decay,
clipping at 1.0, fp32, 4 pairs per step, no accumulation), for loss_type sigmoid and ipo, full fine-tuning (TRL
loads a reference copy, hftrain copies the policy) and LoRA (both disable the adapters). The chat template writes
the newline between turns before each turn, so that nothing follows a completion's <|im_end|>: TRL trains what
the template renders after the completion, hftrain stops at the end-of-turn token (docs/from-trl.md).

With one micro-batch per step, TRL's per-micro-batch mean is the mean over the step's pairs: the two must agree.
Needs no network; about a minute on 2 CPU cores. docs/preference.md quotes its output; tests/e2e/test_preference.py
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

COMMON = dict(per_device_train_batch_size=4, max_length=256, lr_scheduler_type="constant", warmup_steps=0,
              weight_decay=0.0, max_grad_norm=1.0, seed=42, logging_steps=1, beta=0.1)
LORA = dict(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
VARIANTS = {f"{loss} {method}": (loss, method) for loss in ("sigmoid", "ipo") for method in ("full", "lora")}
KEYS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")


def learning_rate(method: str) -> float:
    return 2e-2 if method == "lora" else 1e-3


def write_data(out: Path, pairs: int) -> Path:
    lines = (REPO / "data" / "preference.jsonl").read_text(encoding="utf-8").splitlines()[:pairs]
    path = out / "pairs.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def run_trl(model_path: Path, data: Path, template: Path, steps: int, out: Path, loss: str, method: str) -> dict:
    """TRL's values per step; the LoRA policy is made as hftrain makes it (seed, load, get_peft_model) so that both
    start from the same adapter initialisation."""
    import datasets
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback, set_seed
    from trl import DPOConfig, DPOTrainer

    rows: list[dict] = []

    class Record(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                rows.append({k: logs[k] for k in KEYS})

    set_seed(COMMON["seed"])
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    if method == "lora":
        model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **LORA), autocast_adapter_dtype=True)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    tokenizer.chat_template = template.read_text()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = DPOConfig(output_dir=str(out), use_cpu=True, bf16=False, optim="adamw_torch",
                           gradient_checkpointing=False, max_steps=steps, train_sampling_strategy="sequential",
                           eval_strategy="no", save_strategy="no", report_to=[], disable_tqdm=True, loss_type=[loss],
                           learning_rate=learning_rate(method), **COMMON)
        trainer = DPOTrainer(model=model, args=config, processing_class=tokenizer,
                             train_dataset=datasets.load_dataset("json", data_files=str(data), split="train"),
                             callbacks=[Record()])
        trainer.train()
    return {"steps": rows}


def run_hftrain(model_path: Path, data: Path, template: Path, steps: int, out: Path, loss: str, method: str) -> dict:
    recipe = dict(model_name_or_path=str(model_path), dataset_name=str(data), validation_split_percentage=0,
                  train_sampling_strategy="sequential", optim="adamw_torch", max_steps=steps, output_dir=str(out),
                  overwrite_output_dir=True, report_to=["none"], disable_tqdm=True, save_steps=10_000,
                  chat_template_path=str(template), objective="dpo", loss_type=loss,
                  learning_rate=learning_rate(method), **COMMON)
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
    return {"steps": [{k: r[k] for k in KEYS} for r in rows if "loss" in r]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=REPO / "models" / "tiny-llama")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("/tmp/compare-trl-dpo"))
    parser.add_argument("--json", type=Path, default=None, help="Also write the results here.")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    data = write_data(args.out, COMMON["per_device_train_batch_size"] * args.steps)
    template = args.out / "chatml_no_trailing_newline.jinja"
    template.write_text(NO_TRAILING_NEWLINE)
    results = {}
    for i, (name, (loss, method)) in enumerate(VARIANTS.items()):
        trl = run_trl(args.model, data, template, args.steps, args.out / f"trl-{i}", loss, method)
        mine = run_hftrain(args.model, data, template, args.steps, args.out / f"hftrain-{i}", loss, method)
        results[name] = {"trl": trl["steps"], "hftrain": mine["steps"]}
        print(f"== {name}")
        for step, (a, b) in enumerate(zip(trl["steps"], mine["steps"]), 1):
            worst = max(abs(a[k] - b[k]) / max(abs(b[k]), 1e-8) for k in KEYS)
            print(f"  step {step}: loss TRL {a['loss']:.6f} hftrain {b['loss']:.6f}; margins TRL "
                  f"{a['rewards/margins']:.6f} hftrain {b['rewards/margins']:.6f}; largest relative difference over "
                  f"{len(KEYS)} values {worst:.1e}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
