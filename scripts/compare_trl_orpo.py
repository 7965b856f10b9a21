"""TRL 1.16's ORPOTrainer against hftrain's orpo on the tiny local model: per-step loss and metrics.

    python scripts/compare_trl_orpo.py [--model models/tiny-llama --steps 3 --out /tmp/compare-trl-orpo] [--json F]

Both train the same model on the same conversational pairs (the first pairs of data/preference.jsonl), in the same
order (sequential), with the same hyperparameters (AdamW torch, constant learning rate, no warmup or weight decay,
clipping at 1.0, fp32, 4 pairs per step, no accumulation), full fine-tuning and LoRA. The chat template writes the
newline between turns before each turn, so that nothing follows a completion's <|im_end|> (the tiny tokenizer's
EOS, which TRL's ORPO appends when a completion does not end with it; it has no BOS, which TRL's ORPO would
prepend to string prompts as hftrain does).

With one micro-batch per step on one process, TRL's per-micro-batch means are the step's means: the two must agree.
Needs no network; under a minute on 2 CPU cores. docs/preference.md quotes its output; tests/e2e/test_orpo.py
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
from compare_trl_dpo import COMMON, LORA, learning_rate, write_data  # noqa: E402 - the same settings as dpo's

KEYS = ("loss", "nll_loss", "log_odds_ratio", "log_odds_chosen", "rewards/chosen", "rewards/rejected",
        "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected")


def run_trl(model_path: Path, data: Path, template: Path, steps: int, out: Path, method: str) -> list[dict]:
    """TRL's values per step; the LoRA policy is made as hftrain makes it (seed, load, get_peft_model)."""
    import datasets
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback, set_seed
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

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
        config = ORPOConfig(output_dir=str(out), use_cpu=True, bf16=False, optim="adamw_torch",
                            gradient_checkpointing=False, max_steps=steps, train_sampling_strategy="sequential",
                            eval_strategy="no", save_strategy="no", report_to=[], disable_tqdm=True,
                            learning_rate=learning_rate(method), **COMMON)
        trainer = ORPOTrainer(model=model, args=config, processing_class=tokenizer,
                              train_dataset=datasets.load_dataset("json", data_files=str(data), split="train"),
                              callbacks=[Record()])
        trainer.train()
    return rows


def run_hftrain(model_path: Path, data: Path, template: Path, steps: int, out: Path, method: str) -> list[dict]:
    recipe = dict(model_name_or_path=str(model_path), dataset_name=str(data), validation_split_percentage=0,
                  train_sampling_strategy="sequential", optim="adamw_torch", max_steps=steps, output_dir=str(out),
                  overwrite_output_dir=True, report_to=["none"], disable_tqdm=True, save_steps=10_000,
                  chat_template_path=str(template), objective="orpo", learning_rate=learning_rate(method), **COMMON)
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
    parser.add_argument("--out", type=Path, default=Path("/tmp/compare-trl-orpo"))
    parser.add_argument("--json", type=Path, default=None, help="Also write the results here.")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    data = write_data(args.out, COMMON["per_device_train_batch_size"] * args.steps)
    template = args.out / "chatml_no_trailing_newline.jinja"
    template.write_text(NO_TRAILING_NEWLINE)
    results = {}
    for i, method in enumerate(("full", "lora")):
        trl = run_trl(args.model, data, template, args.steps, args.out / f"trl-{i}", method)
        mine = run_hftrain(args.model, data, template, args.steps, args.out / f"hftrain-{i}", method)
        results[method] = {"trl": trl, "hftrain": mine}
        print(f"== {method}")
        for step, (a, b) in enumerate(zip(trl, mine), 1):
            worst = max(abs(a[k] - b[k]) / max(abs(b[k]), 1e-8) for k in KEYS)
            print(f"  step {step}: loss TRL {a['loss']:.6f} hftrain {b['loss']:.6f}; nll_loss TRL {a['nll_loss']:.6f} "
                  f"hftrain {b['nll_loss']:.6f}; largest relative difference over {len(KEYS)} values {worst:.1e}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
