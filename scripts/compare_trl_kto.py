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
asserts it. What the comparisons share: scripts/trl_compare.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import trl_compare as compare  # noqa: E402 - the comparisons' shared part, beside this script
from trl_compare import learning_rate  # noqa: E402

SETTINGS = {**compare.SETTINGS, "per_device_train_batch_size": 8}
VARIANTS = {f"{loss} {method}": (loss, method) for loss in ("kto", "apo_zero_unpaired") for method in ("full", "lora")}
# TRL logs kl for loss_type kto only
KEYS = ("loss", "kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")


def run_trl(model_path: Path, data: Path, template: Path, steps: int, out: Path, loss: str, method: str) -> list:
    from trl import KTOConfig, KTOTrainer

    rows, _ = compare.train_trl(KTOTrainer, KTOConfig, compare.policy(model_path, method),
                                compare.tokenizer(model_path, template), data, steps, out, KEYS, loss_type=loss,
                                learning_rate=learning_rate(method), **SETTINGS)
    return rows


def run_hftrain(model_path: Path, data: Path, template: Path, steps: int, out: Path, loss: str, method: str) -> list:
    rows = compare.run_hftrain(out, model_path, data, steps, method, chat_template_path=template, objective="kto",
                               loss_type=loss, learning_rate=learning_rate(method), **SETTINGS)
    return compare.train_steps(rows, KEYS)


def main() -> None:
    parser = compare.parser(__doc__, "/tmp/compare-trl-kto")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                        help="Which (loss_type, method) to compare (default: all four).")
    args = parser.parse_args()
    template = compare.write_template(args.out)
    data = compare.first_rows("unpaired.jsonl", SETTINGS["per_device_train_batch_size"] * args.steps, args.out)
    results = {}
    for i, name in enumerate(args.variants):
        loss, method = VARIANTS[name]
        trl = run_trl(args.model, data, template, args.steps, args.out / f"trl-{i}", loss, method)
        mine = run_hftrain(args.model, data, template, args.steps, args.out / f"hftrain-{i}", loss, method)
        results[name] = {"trl": trl, "hftrain": mine}
        print(f"== {name}")
        compare.print_steps(trl, mine, [("loss", "loss", ".6f"), ("kl", "kl", ".6f")])
    compare.write_json(args.json, results)


if __name__ == "__main__":
    main()
