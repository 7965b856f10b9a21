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
asserts it. What the comparisons share: scripts/trl_compare.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
import trl_compare as compare  # noqa: E402 - the comparisons' shared part, beside this script
from trl_compare import learning_rate  # noqa: E402

KEYS = ("loss", "accuracy", "margin", "mean_reward")
SETTINGS = {k: v for k, v in compare.SETTINGS.items() if k != "beta"}  # a reward model's loss has no temperature
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
    """TRL's values per step and its trained score head; the model is made as hftrain makes it, which is
    RewardTrainer's own order for a model given by name."""
    from transformers import AutoModelForSequenceClassification
    from trl import RewardConfig, RewardTrainer

    model = compare.policy(model_path, method, AutoModelForSequenceClassification, "SEQ_CLS", num_labels=1)
    rows, trainer = compare.train_trl(RewardTrainer, RewardConfig, model, compare.tokenizer(model_path, template),
                                      data, steps, out, KEYS, center_rewards_coefficient=center,
                                      learning_rate=learning_rate(method), **SETTINGS)
    head = score_head({k: v.detach() for k, v in trainer.model.state_dict().items()})
    return {"steps": rows, "score": head.flatten().tolist()}


def run_hftrain(model_path: Path, data: Path, template: Path, steps: int, out: Path, method: str,
                center: float | None) -> dict:
    rows = compare.run_hftrain(out, model_path, data, steps, method, chat_template_path=template, objective="reward",
                               center_rewards_coefficient=center, learning_rate=learning_rate(method), **SETTINGS)
    weights = out / "final" / ("adapter_model.safetensors" if method == "lora" else "model.safetensors")
    return {"steps": compare.train_steps(rows, KEYS), "score": score_head(load_file(weights)).flatten().tolist()}


def main() -> None:
    args = compare.parser(__doc__, "/tmp/compare-trl-reward").parse_args()
    template = compare.write_template(args.out)
    data = compare.first_rows("preference.jsonl", SETTINGS["per_device_train_batch_size"] * args.steps, args.out)
    results = {}
    for i, (name, (method, margins, center)) in enumerate(VARIANTS.items()):
        pairs = with_margins(data, args.out) if margins else data
        trl = run_trl(args.model, pairs, template, args.steps, args.out / f"trl-{i}", method, center)
        mine = run_hftrain(args.model, pairs, template, args.steps, args.out / f"hftrain-{i}", method, center)
        results[name] = {"trl": trl, "hftrain": mine}
        print(f"== {name}")
        compare.print_steps(trl["steps"], mine["steps"], [("loss", "loss", ".6f"), ("accuracy", "accuracy", ".2f")])
        head = (torch.tensor(trl["score"]) - torch.tensor(mine["score"])).abs().max().item()
        print(f"  trained score head: largest difference {head:.1e} (values up to "
              f"{torch.tensor(mine['score']).abs().max().item():.3f})")
    compare.write_json(args.json, results)


if __name__ == "__main__":
    main()
