"""TRL 1.16's SFTTrainer against hftrain on the tiny local model: the differences of docs/from-trl.md, measured.

    python scripts/compare_trl.py [--model models/tiny-llama --examples 64 --steps 3 --out /tmp/compare-trl] [--json F]

Both train the same model on the same conversational prompt/completion data (the shipped chat conversations
split into prompt = every message before the last, completion = the final assistant message), in the same
order (sequential), with the same hyperparameters (AdamW torch, constant learning rate, no warmup or weight
decay, clipping at 1.0, fp32, batch 8, no accumulation), and evaluate on the same held-out file:

1. as shipped (TRL trains the newline after the final end-of-turn token, hftrain does not): step losses differ;
2. with a chat template that puts the newline *before* each turn instead of after it (no text follows the
   final end-of-turn token, so both train the same tokens): step losses equal.

Then the eval_loss of each is compared with two plain-PyTorch computations on the final model: the
token-weighted mean over the eval set (hftrain's) and the mean of per-batch means (TRL's / Trainer's).
Needs no network; about a minute on 2 CPU cores. docs/from-trl.md quotes its output. What the comparisons
share: scripts/trl_compare.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import trl_compare as compare  # noqa: E402 - the comparisons' shared part, beside this script
from trl_compare import REPO  # noqa: E402

COMMON = dict(learning_rate=1e-3, per_device_train_batch_size=8, per_device_eval_batch_size=8, max_length=512,
              lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, seed=42,
              logging_steps=1)


def write_data(out: Path, examples: int) -> tuple[Path, Path]:
    """Conversational prompt/completion rows from data/chat.jsonl; the eval file holds 20 of the others, shortest
    answer first (batches of 8, 8 and 4 with different numbers of trained tokens, as real eval sets have)."""
    rows = []
    for line in (REPO / "data" / "chat.jsonl").read_text(encoding="utf-8").splitlines():
        messages = json.loads(line)["messages"]
        if messages[-1]["role"] == "assistant" and len(messages) <= 7:
            rows.append({"prompt": messages[:-1], "completion": messages[-1:]})
    train, evaluation = out / "train.jsonl", out / "eval.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows[:examples]), encoding="utf-8")
    rest = sorted(rows[examples:], key=lambda r: len(r["completion"][0]["content"]))
    chosen = rest[:10] + rest[-10:]
    evaluation.write_text("".join(json.dumps(r) + "\n" for r in chosen), encoding="utf-8")
    return train, evaluation


def run_trl(model_path: Path, train: Path, evaluation: Path, steps: int, out: Path, template: Path | None) -> dict:
    import datasets
    from trl import SFTConfig, SFTTrainer

    rows, trainer = compare.train_trl(
        SFTTrainer, SFTConfig, compare.policy(model_path, "full"), compare.tokenizer(model_path), train, steps, out,
        ("loss",), trainer_kwargs={"eval_dataset": datasets.load_dataset("json", data_files=str(evaluation),
                                                                         split="train")},
        chat_template_path=str(template) if template else None, **COMMON)
    first_batch = trainer.train_dataset["labels"][:COMMON["per_device_train_batch_size"]]
    trained = sum(sum(label != -100 for label in labels[1:]) for labels in first_batch)
    return {"losses": [r["loss"] for r in rows], "step1_trained_tokens": trained,
            "eval_loss": trainer.evaluate()["eval_loss"]}


def run_hftrain(model_path: Path, train: Path, evaluation: Path, steps: int, out: Path, template: Path | None) -> dict:
    rows = compare.run_hftrain(out, model_path, train, steps, eval_dataset_name=evaluation, eval_steps=10_000,
                               **({"chat_template_path": template} if template else {}), **COMMON)
    train_rows = [r for r in rows if "loss" in r]
    return {"losses": [r["loss"] for r in train_rows], "step1_trained_tokens": train_rows[0]["trained_tokens"],
            "eval_loss": [r for r in rows if "eval_loss" in r][-1]["eval_loss"], "final": out / "final"}


@torch.no_grad()
def reference_eval(final: Path, evaluation: Path, template: Path | None) -> dict:
    """Plain PyTorch on the final model: hftrain's masks (the completion and its end-of-turn token), batches of
    8 in file order: the token-weighted mean, and Trainer's: each batch's mean, averaged with the batch's number of
    examples as weight (transformers' evaluation_loop repeats a batch's loss batch_size times)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(final)
    kwargs = {"chat_template": template.read_text()} if template else {}
    examples = []
    for line in evaluation.read_text().splitlines():
        row = json.loads(line)
        prompt = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False, **kwargs)
        whole = tokenizer.apply_chat_template(row["prompt"] + row["completion"], tokenize=False, **kwargs)
        answer = whole[len(prompt):].rstrip("\n")  # hftrain: the answer and <|im_end|>, not what trails it
        ids_p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        ids_a = tokenizer(answer, add_special_tokens=False)["input_ids"]
        examples.append((ids_p + ids_a, [-100] * len(ids_p) + ids_a))
    sums, counts, sizes = [], [], []
    for i in range(0, len(examples), COMMON["per_device_eval_batch_size"]):
        total, tokens = 0.0, 0
        for ids, labels in examples[i:i + COMMON["per_device_eval_batch_size"]]:
            logits = model(torch.tensor([ids])).logits[0, :-1]
            target = torch.tensor(labels[1:])
            total += torch.nn.functional.cross_entropy(logits, target, ignore_index=-100, reduction="sum").item()
            tokens += int((target != -100).sum())
        sums.append(total)
        counts.append(tokens)
        sizes.append(len(examples[i:i + COMMON["per_device_eval_batch_size"]]))
    return {"token_weighted": sum(sums) / sum(counts),
            "mean_of_batch_means": sum(s / n * k for s, n, k in zip(sums, counts, sizes)) / sum(sizes),
            "batch_tokens": counts}


def main() -> None:
    parser = compare.parser(__doc__, "/tmp/compare-trl")
    parser.add_argument("--examples", type=int, default=64, help="Training rows (default: %(default)s).")
    args = parser.parse_args()
    template = compare.write_template(args.out)
    train, evaluation = write_data(args.out, args.examples)
    results = {}
    for name, chat_template in (("shipped template", None), ("no trailing newline", template)):
        trl = run_trl(args.model, train, evaluation, args.steps, args.out / f"trl-{len(results)}", chat_template)
        mine = run_hftrain(args.model, train, evaluation, args.steps, args.out / f"hftrain-{len(results)}",
                           chat_template)
        results[name] = (trl, mine)
        print(f"== {name}")
        print(f"  step-1 trained tokens: TRL {trl['step1_trained_tokens']}, hftrain {mine['step1_trained_tokens']}")
        for step, (a, b) in enumerate(zip(trl["losses"], mine["losses"]), 1):
            print(f"  step {step} loss: TRL {a:.6f}  hftrain {b:.6f}  |diff| {abs(a - b):.1e}  "
                  f"({abs(a - b) / b:.2%})")
    trl, mine = results["no trailing newline"]
    ref = reference_eval(mine["final"], evaluation, template)
    print("== eval_loss on the same 20 held-out examples, same final weights (no trailing newline)")
    print(f"  trained tokens per eval batch (8, 8, 4 examples): {ref['batch_tokens']}")
    print(f"  TRL eval_loss {trl['eval_loss']:.6f}; plain PyTorch mean of per-batch means (example-weighted) "
          f"{ref['mean_of_batch_means']:.6f}")
    print(f"  hftrain eval_loss {mine['eval_loss']:.6f}; plain PyTorch token-weighted mean "
          f"{ref['token_weighted']:.6f}")
    compare.write_json(args.json, {name: {"trl": trl, "hftrain": {k: v for k, v in mine.items() if k != "final"}}
                                   for name, (trl, mine) in results.items()} | {"eval": ref})


if __name__ == "__main__":
    main()
