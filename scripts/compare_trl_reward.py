"""TRL 1.16's RewardTrainer against hftrain's reward objective on the tiny local model: per-step loss and metrics,
and the trained score head.

    python scripts/compare_trl_reward.py [--model models/tiny-llama --steps 3 --out /tmp/compare-trl-reward] [--json F]

Both train the same sequence-classification model (the tiny causal LM's body, a one-output score head drawn after
seeding with the run's seed, as RewardTrainer and hftrain both draw it) on the same conversational pairs (the first
pairs of data/preference.jsonl, with a `margin` column added to half of the variants), in the same order
(sequential), with the same hyperparameters (AdamW torch, constant learning rate, no warmup or weight decay, clipping
at 1.0, fp32, 4 pairs per step, no accumulation): full fine-tuning with margins and center_rewards_coefficient, and
LoRA (peft's SEQ_CLS task: the score head trained whole). The chat template writes the newline between turns before
each turn, so that nothing follows a completion's <|im_end|> and RewardTrainer's whole-conversation tokenization
equals hftrain's prompt + completion.

With one micro-batch per step on one process, TRL's per-micro-batch means are the step's means: the two must agree.
Needs no network; under a minute on 2 CPU cores. docs/preference.md quotes its output; tests/e2e/test_reward.py
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
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
from compare_trl import NO_TRAILING_NEWLINE  # noqa: E402 - the sibling script's template
from compare_trl_dpo import COMMON, LORA, learning_rate, write_data  # noqa: E402 - the same settings as dpo's

KEYS = ("loss", "accuracy", "margin", "mean_reward")
SETTINGS = {k: v for k, v in COMMON.items() if k != "beta"}  # a reward model's loss has no temperature
# name: (method, margins in the data, center_rewards_coefficient)
VARIANTS = {"full, margin, centered": ("full", True, 0.01), "lora": ("lora", False, None)}


def with_margins(data: Path, out: Path) -> Path:
    """The pairs with RewardTrainer's optional margin column (a different value per pair)."""
    rows = [json.loads(line) for line in data.read_text(encoding="utf-8").splitlines()]
    path = out / "pairs-margin.jsonl"
    path.write_text("".join(json.dumps({**row, "margin": 0.25 * (i % 4)}) + "\n" for i, row in enumerate(rows)),
                    encoding="utf-8")
    return path


def score_head(weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """The trained score head's weight from a model's or an adapter's tensors."""
    (name,) = [k for k in weights if k.endswith("score.weight") or k.endswith("score.modules_to_save.default.weight")]
    return weights[name].float()


def run_trl(model_path: Path, data: Path, template: Path, steps: int, out: Path, method: str,
            center: float | None) -> dict:
    """TRL's values per step and its trained score head; the model is made as hftrain makes it (seed, load,
    get_peft_model), which is RewardTrainer's own order for a model given by name."""
    import datasets
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback, set_seed
    from trl import RewardConfig, RewardTrainer

    rows: list[dict] = []

    class Record(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                rows.append({k: logs[k] for k in KEYS})

    set_seed(SETTINGS["seed"])
    model = AutoModelForSequenceClassification.from_pretrained(model_path, num_labels=1, dtype=torch.float32)
    if method == "lora":
        model = get_peft_model(model, LoraConfig(task_type="SEQ_CLS", **LORA), autocast_adapter_dtype=True)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    tokenizer.chat_template = template.read_text()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = RewardConfig(output_dir=str(out), use_cpu=True, bf16=False, optim="adamw_torch",
                              gradient_checkpointing=False, max_steps=steps, train_sampling_strategy="sequential",
                              eval_strategy="no", save_strategy="no", report_to=[], disable_tqdm=True,
                              center_rewards_coefficient=center, learning_rate=learning_rate(method), **SETTINGS)
        trainer = RewardTrainer(model=model, args=config, processing_class=tokenizer,
                                train_dataset=datasets.load_dataset("json", data_files=str(data), split="train"),
                                callbacks=[Record()])
        trainer.train()
    head = score_head({k: v.detach() for k, v in trainer.model.state_dict().items()})
    return {"steps": rows, "score": head.flatten().tolist()}


def run_hftrain(model_path: Path, data: Path, template: Path, steps: int, out: Path, method: str,
                center: float | None) -> dict:
    recipe = dict(model_name_or_path=str(model_path), dataset_name=str(data), validation_split_percentage=0,
                  train_sampling_strategy="sequential", optim="adamw_torch", max_steps=steps, output_dir=str(out),
                  overwrite_output_dir=True, report_to=["none"], disable_tqdm=True, save_steps=10_000,
                  chat_template_path=str(template), objective="reward", center_rewards_coefficient=center,
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
    weights = out / "final" / ("adapter_model.safetensors" if method == "lora" else "model.safetensors")
    return {"steps": [{k: r[k] for k in KEYS} for r in rows if "loss" in r],
            "score": score_head(load_file(weights)).flatten().tolist()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=REPO / "models" / "tiny-llama")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("/tmp/compare-trl-reward"))
    parser.add_argument("--json", type=Path, default=None, help="Also write the results here.")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    data = write_data(args.out, SETTINGS["per_device_train_batch_size"] * args.steps)
    template = args.out / "chatml_no_trailing_newline.jinja"
    template.write_text(NO_TRAILING_NEWLINE)
    results = {}
    for i, (name, (method, margins, center)) in enumerate(VARIANTS.items()):
        pairs = with_margins(data, args.out) if margins else data
        trl = run_trl(args.model, pairs, template, args.steps, args.out / f"trl-{i}", method, center)
        mine = run_hftrain(args.model, pairs, template, args.steps, args.out / f"hftrain-{i}", method, center)
        results[name] = {"trl": trl, "hftrain": mine}
        print(f"== {name}")
        for step, (a, b) in enumerate(zip(trl["steps"], mine["steps"]), 1):
            worst = max(abs(a[k] - b[k]) / max(abs(b[k]), 1e-8) for k in KEYS)
            print(f"  step {step}: loss TRL {a['loss']:.6f} hftrain {b['loss']:.6f}; accuracy TRL {a['accuracy']:.2f} "
                  f"hftrain {b['accuracy']:.2f}; largest relative difference over {len(KEYS)} values {worst:.1e}")
        head = (torch.tensor(trl["score"]) - torch.tensor(mine["score"])).abs().max().item()
        print(f"  trained score head: largest difference {head:.1e} (values up to "
              f"{torch.tensor(mine['score']).abs().max().item():.3f})")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
