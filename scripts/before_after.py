"""Before / after a fine-tune: eval loss and greedy answers of the base model and of the trained one.

    python scripts/before_after.py --config recipes/smollm2-135m-lora-cpu.yaml [--examples 6 --max_new_tokens 40]

Reads the recipe (model, data, eval carve-out, output_dir), then for the base model and for output_dir/final
(an adapter is put on the base with peft's `PeftModel.from_pretrained`, a full fine-tune is loaded directly):
the token-weighted loss on the recipe's eval set (for preference pairs: of the chosen answers), and the greedy answer
to the first eval prompts, each cut where the example's first trained (assistant) token starts. Prints markdown
(used in docs/peft.md and docs/preference.md).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from hftrain.config import FIELDS, read_yaml, recipe_subset  # noqa: E402
from hftrain.data import IGNORE_INDEX, Collator, eval_micro_batches, load_datasets, make_loader  # noqa: E402
from hftrain.model import build_tokenizer, load_base_model, pad_token_id  # noqa: E402
from hftrain.objectives.sft import CausalLMTokenLoss  # noqa: E402


@torch.no_grad()
def eval_loss(lm, dataset, collator: Collator, batch_size: int) -> float:
    model = CausalLMTokenLoss(lm).eval()
    loss_sum, tokens = 0.0, 0
    # the model stays where from_pretrained put it and batches are not moved: nothing to pin
    for batch in make_loader(eval_micro_batches(len(dataset), batch_size, 1, 0), collator, 0, pin_memory=False):
        batch.pop("num_examples")
        loss_sum += model(**batch).item()
        tokens += int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
    return loss_sum / tokens


@torch.no_grad()
def answer(lm, tokenizer, prompt_ids: list[int], max_new_tokens: int) -> str:
    lm.config.use_cache = True
    out = lm.generate(input_ids=torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids)),
                      max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                      pad_token_id=pad_token_id(tokenizer))
    return tokenizer.decode(out[0, len(prompt_ids):], skip_special_tokens=True).strip()


def last_user_turn(text: str) -> str:
    marker = "<|im_start|>user\n"
    return text.rsplit(marker, 1)[-1].split("<|im_end|>")[0].strip() if marker in text else text.strip()


def cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|") or "(empty)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="The recipe the run was trained with.")
    parser.add_argument("--examples", type=int, default=6)
    parser.add_argument("--max_new_tokens", type=int, default=40)
    args = parser.parse_args()

    recipe = recipe_subset(read_yaml(args.config), tuple(FIELDS), source=args.config)
    recipe.use_liger_kernel = False  # training kernels (Triton, CUDA only) are not needed to compare generations
    final = Path(recipe.output_dir) / "final"
    tokenizer = build_tokenizer(recipe)
    _, eval_set, _ = load_datasets(recipe, tokenizer)
    if eval_set is None:
        sys.exit("before_after: the recipe has no eval set (validation_split_percentage 0 and no eval_dataset_name)")
    eval_set = eval_set.select_columns(["input_ids", "labels"])  # preference pairs: the chosen answers
    collator = Collator(eval_set, pad_token_id(tokenizer))

    base = load_base_model(recipe).eval()
    rows = []
    for i in range(min(args.examples, len(eval_set))):
        ids, labels = eval_set[i]["input_ids"], eval_set[i]["labels"]
        start = next(j for j, label in enumerate(labels) if label != IGNORE_INDEX)
        end = next((j for j in range(start, len(labels)) if labels[j] == IGNORE_INDEX), len(labels))
        rows.append({"prompt": last_user_turn(tokenizer.decode(ids[:start])), "ids": ids[:start],
                     "reference": tokenizer.decode(ids[start:end], skip_special_tokens=True)})
    losses = {"base": eval_loss(base, eval_set, collator, recipe.per_device_eval_batch_size)}
    for row in rows:
        row["base"] = answer(base, tokenizer, row["ids"], args.max_new_tokens)

    if (final / "adapter_config.json").exists():
        from peft import PeftModel

        trained = PeftModel.from_pretrained(load_base_model(recipe), str(final)).eval()
    else:
        from transformers import AutoModelForCausalLM

        trained = AutoModelForCausalLM.from_pretrained(final).eval()
    losses["fine-tuned"] = eval_loss(trained, eval_set, collator, recipe.per_device_eval_batch_size)
    for row in rows:
        row["fine-tuned"] = answer(trained, tokenizer, row["ids"], args.max_new_tokens)

    print(f"eval loss on {len(eval_set)} held-out examples: base {losses['base']:.4f} "
          f"(perplexity {math.exp(losses['base']):.2f}) -> fine-tuned {losses['fine-tuned']:.4f} "
          f"(perplexity {math.exp(losses['fine-tuned']):.2f})\n")
    print("| prompt | training-data answer | base model | fine-tuned |\n| --- | --- | --- | --- |")
    for row in rows:
        print(f"| {cell(row['prompt'])} | {cell(row['reference'])} | {cell(row['base'])} | {cell(row['fine-tuned'])} |")


if __name__ == "__main__":
    main()
