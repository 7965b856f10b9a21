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
asserts it. What the comparisons share: scripts/trl_compare.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import trl_compare as compare  # noqa: E402 - the comparisons' shared part, beside this script
from trl_compare import SETTINGS, learning_rate  # noqa: E402

KEYS = ("loss", "nll_loss", "log_odds_ratio", "log_odds_chosen", "rewards/chosen", "rewards/rejected",
        "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected")


def run_trl(model_path: Path, data: Path, template: Path, steps: int, out: Path, method: str) -> list[dict]:
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    rows, _ = compare.train_trl(ORPOTrainer, ORPOConfig, compare.policy(model_path, method),
                                compare.tokenizer(model_path, template), data, steps, out, KEYS,
                                learning_rate=learning_rate(method), **SETTINGS)
    return rows


def run_hftrain(model_path: Path, data: Path, template: Path, steps: int, out: Path, method: str) -> list[dict]:
    rows = compare.run_hftrain(out, model_path, data, steps, method, chat_template_path=template, objective="orpo",
                               learning_rate=learning_rate(method), **SETTINGS)
    return compare.train_steps(rows, KEYS)


def main() -> None:
    args = compare.parser(__doc__, "/tmp/compare-trl-orpo").parse_args()
    template = compare.write_template(args.out)
    data = compare.first_rows("preference.jsonl", SETTINGS["per_device_train_batch_size"] * args.steps, args.out)
    results = {}
    for i, method in enumerate(("full", "lora")):
        trl = run_trl(args.model, data, template, args.steps, args.out / f"trl-{i}", method)
        mine = run_hftrain(args.model, data, template, args.steps, args.out / f"hftrain-{i}", method)
        results[method] = {"trl": trl, "hftrain": mine}
        print(f"== {method}")
        compare.print_steps(trl, mine, [("loss", "loss", ".6f"), ("nll_loss", "nll_loss", ".6f")])
    compare.write_json(args.json, results)


if __name__ == "__main__":
    main()
