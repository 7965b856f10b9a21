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
asserts it. What the comparisons share: scripts/trl_compare.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import trl_compare as compare  # noqa: E402 - the comparisons' shared part, beside this script
from trl_compare import REPO, SETTINGS, learning_rate  # noqa: E402

STUDENT, TEACHER = REPO / "models" / "tiny-llama", REPO / "models" / "tiny-teacher"
VARIANTS = {"full": 0.5, "lora": 1.0}  # method: beta
KEYS = ("loss", "grad_norm")


def run_trl(data: Path, template: Path, steps: int, out: Path, method: str):
    """GKD's values per step and its final student (the adapter merged for LoRA), as a state dict."""
    from transformers import AutoModelForCausalLM
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    model = compare.policy(STUDENT, method)
    teacher = AutoModelForCausalLM.from_pretrained(TEACHER, dtype=torch.float32)
    rows, _ = compare.train_trl(GKDTrainer, GKDConfig, model, compare.tokenizer(STUDENT, template), data, steps, out,
                                KEYS, trainer_kwargs={"teacher_model": teacher}, learning_rate=learning_rate(method),
                                lmbda=0.0, temperature=1.0, **{**SETTINGS, "beta": VARIANTS[method]})
    if method == "lora":
        model = model.merge_and_unload()
    return rows, {k: v.detach().clone() for k, v in model.state_dict().items()}


def run_hftrain(data: Path, template: Path, steps: int, out: Path, method: str) -> list[dict]:
    rows = compare.run_hftrain(out, STUDENT, data, steps, method, teacher_model_name_or_path=TEACHER,
                               chat_template_path=template, assistant_only_loss=True, objective="distill", lmbda=0.0,
                               temperature=1.0, learning_rate=learning_rate(method),
                               **{**SETTINGS, "beta": VARIANTS[method]})
    return compare.train_steps(rows, KEYS)


def final_weights(out: Path, method: str) -> dict[str, torch.Tensor]:
    """hftrain's final student (the adapter merged into the base for LoRA), as a state dict."""
    from transformers import AutoModelForCausalLM

    if method == "full":
        return AutoModelForCausalLM.from_pretrained(out / "final", dtype=torch.float32).state_dict()
    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(STUDENT, dtype=torch.float32)
    return PeftModel.from_pretrained(base, out / "final").merge_and_unload().state_dict()


def main() -> None:
    from transformers import AutoModelForCausalLM

    args = compare.parser(__doc__, "/tmp/compare-trl-distill", model=False).parse_args()
    template = compare.write_template(args.out)
    data = compare.first_rows("chat.jsonl", SETTINGS["per_device_train_batch_size"] * args.steps, args.out,
                              keep=lambda row: sum(m["role"] == "assistant" for m in row["messages"]) == 1)
    results = {}
    for i, method in enumerate(VARIANTS):
        trl, trl_weights = run_trl(data, template, args.steps, args.out / f"trl-{i}", method)
        mine = run_hftrain(data, template, args.steps, args.out / f"hftrain-{i}", method)
        ours = final_weights(args.out / f"hftrain-{i}", method)
        initial = AutoModelForCausalLM.from_pretrained(STUDENT, dtype=torch.float32).state_dict()
        shared = [k for k in trl_weights if k in ours]
        weight_diff = max(float((ours[k] - trl_weights[k]).abs().max()) for k in shared)
        # how far apart the two runs' weights end, relative to how far training moved them (Frobenius, all tensors)
        apart = sum(float((ours[k] - trl_weights[k]).square().sum()) for k in shared) ** 0.5
        moved = sum(float((trl_weights[k] - initial[k]).square().sum()) for k in shared) ** 0.5
        results[method] = {"trl": trl, "hftrain": mine, "beta": VARIANTS[method], "max_weight_difference": weight_diff,
                           "relative_update_difference": apart / moved}
        print(f"== {method}, beta {VARIANTS[method]}")
        compare.print_steps(trl, mine, [("loss", "loss", ".6f"), ("grad_norm", "grad_norm", ".6f")], worst=False)
        print(f"  final weights: largest absolute difference {weight_diff:.1e}; apart by {apart / moved:.1e} of "
              "how far training moved them")
    compare.write_json(args.json, results)


if __name__ == "__main__":
    main()
