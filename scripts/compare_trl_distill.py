"""TRL 1.16's GKDTrainer (lmbda 0: offline, the dataset's completions) against hftrain's distill on the tiny local
models: per-step loss, gradient norm and the final weights.

    python scripts/compare_trl_distill.py [--steps 3 --out /tmp/compare-trl-distill] [--json F]

Both distill models/tiny-teacher into models/tiny-llama on the same chats (the first single-answer conversations of
data/chat.jsonl: GKD's collator trains the last assistant turn only), in the same order (sequential), with the same
hyperparameters (AdamW torch, constant learning rate, no warmup or weight decay, clipping at 1.0, fp32, 4 chats per
step, no accumulation), at temperature 1 (GKDTrainer leaves the temperature out of its loss; DistillationTrainer and
hftrain divide both models' logits by it: tests/unit/test_distill.py compares that against TRL's functions), for
beta 0.5 with full fine-tuning and beta 1 (reverse KL) with LoRA. The chat template writes the newline between turns
before each turn, so that nothing follows a completion's <|im_end|> (GKD trains everything the template renders
after the prompt). GKD pads on the left, hftrain on the right: the same logits up to rounding (RoPE is relative).

With one micro-batch per step on one process, GKD's token mean is the step's: the two must agree.
Needs no network; under a minute on 2 CPU cores. docs/distillation.md quotes its output; tests/e2e/test_distill.py
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

STUDENT, TEACHER = REPO / "models" / "tiny-llama", REPO / "models" / "tiny-teacher"
VARIANTS = {"full": 0.5, "lora": 1.0}  # method: beta
KEYS = ("loss", "grad_norm")


def write_data(out: Path, rows: int) -> Path:
    """The first `rows` conversations of data/chat.jsonl with one assistant turn."""
    lines = [line for line in (REPO / "data" / "chat.jsonl").read_text(encoding="utf-8").splitlines()
             if sum(m["role"] == "assistant" for m in json.loads(line)["messages"]) == 1][:rows]
    path = out / "chats.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def run_trl(data: Path, template: Path, steps: int, out: Path, method: str) -> list[dict]:
    """GKD's values per step; the LoRA student is made as hftrain makes it (seed, load, get_peft_model)."""
    import datasets
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback, set_seed
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    rows: list[dict] = []

    class Record(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                rows.append({k: logs[k] for k in KEYS})

    set_seed(COMMON["seed"])
    model = AutoModelForCausalLM.from_pretrained(STUDENT, dtype=torch.float32)
    if method == "lora":
        model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **LORA), autocast_adapter_dtype=True)
    teacher = AutoModelForCausalLM.from_pretrained(TEACHER, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(STUDENT)
    tokenizer.chat_template = template.read_text()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = GKDConfig(output_dir=str(out), use_cpu=True, bf16=False, optim="adamw_torch",
                           gradient_checkpointing=False, max_steps=steps, train_sampling_strategy="sequential",
                           eval_strategy="no", save_strategy="no", report_to=[], disable_tqdm=True,
                           learning_rate=learning_rate(method), lmbda=0.0, temperature=1.0,
                           **{**COMMON, "beta": VARIANTS[method]})
        trainer = GKDTrainer(model=model, teacher_model=teacher, args=config, processing_class=tokenizer,
                             train_dataset=datasets.load_dataset("json", data_files=str(data), split="train"),
                             callbacks=[Record()])
        trainer.train()
    if method == "lora":
        model = model.merge_and_unload()
    return rows, {k: v.detach().clone() for k, v in model.state_dict().items()}


def run_hftrain(data: Path, template: Path, steps: int, out: Path, method: str):
    recipe = dict(model_name_or_path=str(STUDENT), teacher_model_name_or_path=str(TEACHER), dataset_name=str(data),
                  validation_split_percentage=0, train_sampling_strategy="sequential", optim="adamw_torch",
                  max_steps=steps, output_dir=str(out), overwrite_output_dir=True, report_to=["none"],
                  disable_tqdm=True, save_steps=10_000, chat_template_path=str(template), assistant_only_loss=True,
                  objective="distill", lmbda=0.0, temperature=1.0, learning_rate=learning_rate(method),
                  **{**COMMON, "beta": VARIANTS[method]})
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


def final_weights(out: Path, method: str) -> dict[str, torch.Tensor]:
    """hftrain's final student (the adapter merged into the base for LoRA), as a state dict."""
    from transformers import AutoModelForCausalLM

    if method == "full":
        return AutoModelForCausalLM.from_pretrained(out / "final", dtype=torch.float32).state_dict()
    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(STUDENT, dtype=torch.float32)
    return PeftModel.from_pretrained(base, out / "final").merge_and_unload().state_dict()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("/tmp/compare-trl-distill"))
    parser.add_argument("--json", type=Path, default=None, help="Also write the results here.")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    data = write_data(args.out, COMMON["per_device_train_batch_size"] * args.steps)
    template = args.out / "chatml_no_trailing_newline.jinja"
    template.write_text(NO_TRAILING_NEWLINE)
    results = {}
    for i, method in enumerate(VARIANTS):
        trl, trl_weights = run_trl(data, template, args.steps, args.out / f"trl-{i}", method)
        mine = run_hftrain(data, template, args.steps, args.out / f"hftrain-{i}", method)
        ours = final_weights(args.out / f"hftrain-{i}", method)
        weight_diff = max(float((ours[k] - v).abs().max()) for k, v in trl_weights.items() if k in ours)
        results[method] = {"trl": trl, "hftrain": mine, "beta": VARIANTS[method], "max_weight_difference": weight_diff}
        print(f"== {method}, beta {VARIANTS[method]}")
        for step, (a, b) in enumerate(zip(trl, mine), 1):
            print(f"  step {step}: loss TRL {a['loss']:.6f} hftrain {b['loss']:.6f}; grad_norm TRL "
                  f"{a['grad_norm']:.6f} hftrain {b['grad_norm']:.6f}")
        print(f"  final weights: largest absolute difference {weight_diff:.1e}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
