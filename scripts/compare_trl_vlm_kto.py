"""TRL 1.16's KTOTrainer against hftrain's kto on an image-text model: per-step loss, KL reference point, rewards and
log-probs, and the updated weights.

    python scripts/compare_trl_vlm_kto.py [--model models/tiny-vlm --steps 3 --out /tmp/compare-trl-vlm-kto] [--json F]
                                          [--accumulate 2]

Both train the tiny random LLaVA on the same unpaired image rows (the first rows of data/image-unpaired.jsonl), in
the same order, with compare_trl_vlm_dpo.py's settings (scripts/trl_compare.py's, plain SGD at 0.2, every part
trained) and its model copy, whose chat template writes nothing after a completion's <|im_end|> (TRL trains what the
template renders after the completion, hftrain stops at the end-of-turn token). One micro-batch per step on one
process: TRL's KL reference point (its collator's cycled completions, each KL row on its own row's prompt and pixels)
is then hftrain's, taken over the step. Full fine-tuning: TRL loads a reference copy, hftrain copies the policy.
`--accumulate N`: hftrain takes each step as N accumulated micro-batches (its reference point still over the whole
step), TRL as one: the same values are expected.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import trl_compare as compare  # noqa: E402 - the comparisons' shared part, beside this script
from compare_trl_vlm_dpo import OPTIMIZER, model_copy  # noqa: E402
from trl_compare import REPO, SETTINGS  # noqa: E402

KEYS = ("loss", "kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")


def unpaired(count: int, out: Path) -> Path:
    """The first `count` rows of data/image-unpaired.jsonl with absolute image paths."""
    lines = (REPO / "data" / "image-unpaired.jsonl").read_text(encoding="utf-8").splitlines()[:count]
    rows = [json.loads(line) for line in lines]
    for row in rows:
        row["images"] = [str(REPO / "data" / image) for image in row["images"]]
    path = out / "image-unpaired.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def run_trl(model_path: Path, data: Path, steps: int, out: Path) -> list:
    import datasets
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor, TrainerCallback
    from trl import KTOConfig, KTOTrainer

    rows = []

    class Record(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                rows.append({k: logs[k] for k in KEYS if k in logs})

    dataset = datasets.load_dataset("json", data_files=str(data), split="train")
    dataset = dataset.cast_column("images", datasets.Sequence(datasets.Image()))  # decoded as PIL images
    model = compare.policy(model_path, "full", model_class=AutoModelForImageTextToText)
    args = KTOConfig(output_dir=str(out), use_cpu=True, bf16=False, gradient_checkpointing=False, max_steps=steps,
                     train_sampling_strategy="sequential", eval_strategy="no", save_strategy="no", report_to=[],
                     disable_tqdm=True, loss_type="kto", **OPTIMIZER, **SETTINGS)
    trainer = KTOTrainer(model=model, args=args, processing_class=AutoProcessor.from_pretrained(model_path),
                         train_dataset=dataset, callbacks=[Record()])
    trainer.train()
    final = out / "final"
    final.mkdir(parents=True, exist_ok=True)
    torch.save({k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, final / "weights.pt")
    return rows


def run_hftrain(model_path: Path, data: Path, steps: int, out: Path, accumulate: int) -> list:
    batch = SETTINGS["per_device_train_batch_size"]
    settings = {**SETTINGS, "per_device_train_batch_size": batch // accumulate}
    rows = compare.run_hftrain(out, model_path, data, steps, "full", objective="kto", loss_type="kto", **OPTIMIZER,
                               freeze_vision_tower=False, freeze_projector=False,
                               gradient_accumulation_steps=accumulate, **settings)
    return compare.train_steps(rows, KEYS)


def main() -> None:
    parser = compare.parser(__doc__, "/tmp/compare-trl-vlm-kto", model=False)
    parser.add_argument("--model", type=Path, default=REPO / "models" / "tiny-vlm",
                        help="The image-text model both train, a local folder (default: %(default)s).")
    parser.add_argument("--accumulate", type=int, default=1, choices=(1, 2, 4),
                        help="hftrain's micro-batches per step (default: %(default)s).")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = model_copy(args.model, args.out)
    data = unpaired(SETTINGS["per_device_train_batch_size"] * args.steps, args.out)
    trl = run_trl(model, data, args.steps, args.out / "trl")
    mine = run_hftrain(model, data, args.steps, args.out / "hftrain", args.accumulate)
    print("== kto full")
    compare.print_steps(trl, mine, [("loss", "loss", ".6f"), ("kl", "kl", ".6f"), ("chosen", "rewards/chosen", ".6f")])
    compare.write_json(args.json, {"kto full": {"trl": trl, "hftrain": mine,
                                                "trl_final": str(args.out / "trl" / "final"),
                                                "hftrain_final": str(args.out / "hftrain" / "final")}})


if __name__ == "__main__":
    main()
