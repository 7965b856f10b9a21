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
asserts it. What the comparisons share: scripts/trl_compare.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import trl_compare as compare  # noqa: E402 - the comparisons' shared part, beside this script
from trl_compare import SETTINGS, learning_rate  # noqa: E402

VARIANTS = {f"{loss} {method}": (loss, method) for loss in ("sigmoid", "ipo") for method in ("full", "lora")}
KEYS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")


def run_trl(model_path: Path, data: Path, template: Path, steps: int, out: Path, loss: str, method: str) -> list:
    from trl import DPOConfig, DPOTrainer

    rows, _ = compare.train_trl(DPOTrainer, DPOConfig, compare.policy(model_path, method),
                                compare.tokenizer(model_path, template), data, steps, out, KEYS, loss_type=[loss],
                                learning_rate=learning_rate(method), **SETTINGS)
    return rows


def run_hftrain(model_path: Path, data: Path, template: Path, steps: int, out: Path, loss: str, method: str) -> list:
    rows = compare.run_hftrain(out, model_path, data, steps, method, chat_template_path=template, objective="dpo",
                               loss_type=loss, learning_rate=learning_rate(method), **SETTINGS)
    return compare.train_steps(rows, KEYS)


def main() -> None:
    args = compare.parser(__doc__, "/tmp/compare-trl-dpo").parse_args()
    template = compare.write_template(args.out)
    data = compare.first_rows("preference.jsonl", SETTINGS["per_device_train_batch_size"] * args.steps, args.out)
    results = {}
    for i, (name, (loss, method)) in enumerate(VARIANTS.items()):
        trl = run_trl(args.model, data, template, args.steps, args.out / f"trl-{i}", loss, method)
        mine = run_hftrain(args.model, data, template, args.steps, args.out / f"hftrain-{i}", loss, method)
        results[name] = {"trl": trl, "hftrain": mine}
        print(f"== {name}")
        compare.print_steps(trl, mine, [("loss", "loss", ".6f"), ("margins", "rewards/margins", ".6f")])
    compare.write_json(args.json, results)


if __name__ == "__main__":
    main()
