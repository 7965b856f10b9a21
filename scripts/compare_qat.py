"""Quantization-aware training against post-training quantization (docs/quantization.md).

    HF_HUB_OFFLINE=1 .venv/bin/python scripts/compare_qat.py                  # the tiny model, both schemes
    HF_HUB_OFFLINE=1 .venv/bin/python scripts/compare_qat.py --steps 150 --schemes int4_weight_only
    HF_HUB_OFFLINE=1 .venv/bin/python scripts/compare_qat.py --lora          # LoRA: the frozen base fake-quantized
    # make smollm2 first (models/smollm2-135m-instruct): real weights, LoRA, short rows, a few minutes
    HF_HUB_OFFLINE=1 .venv/bin/python scripts/compare_qat.py --model models/smollm2-135m-instruct --lora \
        --config recipes/smollm2-135m-lora-cpu.yaml --steps 12 --held_out 16 --schemes int4_weight_only \
        --extra="--max_length 64 --per_device_train_batch_size 4"
    # the same model, full fine-tuning (docs/quantization.md: 4 steps, ~15 min a run on the shared 2-core machine)
    HF_HUB_OFFLINE=1 .venv/bin/python scripts/compare_qat.py --model models/smollm2-135m-instruct \
        --config recipes/smollm2-135m-lora-cpu.yaml --steps 4 --held_out 16 --schemes int4_weight_only \
        --extra="--use_peft false --learning_rate 2e-4 --warmup_steps 1 --max_length 64 --per_device_train_batch_size 4"

data/text.jsonl is split once: its last 60 rows are never trained on, and the loss is measured on the last
--held_out of them (60 by default). For each scheme, the same recipe (--config, tiny-text's by default; full
fine-tuning, or with --lora LoRA r 16 on every linear layer, dropout 0) trains twice through hftrain's entry script:
in full precision, and with `qat_scheme`. Then, in plain PyTorch here, the mean next-token cross-entropy over
the held-out rows (each text + EOS, one row at a time) of:

- base: the model before training;
- fp:   the full-precision run's final/ (an adapter: merged into the base by hftrain.merge) (the ceiling);
- PTQ:  the same model quantized after training (transformers' TorchAoConfig of the scheme: what serving it
        quantized without QAT gives);
- QAT:  the QAT run's final-quantized/ (converted to real int4 weights; with LoRA: the adapter merged first);
- QAT fq: the function the QAT run trained (its weights, or base + adapter, prepared with fake quantization again).

"recovered" = (PTQ - QAT) / (PTQ - fp): the part of the quantization's loss increase that QAT wins back.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hftrain import qat  # noqa: E402
from hftrain.config import Recipe  # noqa: E402

LORA = ["--use_peft", "true", "--lora_r", "16", "--lora_alpha", "32", "--lora_dropout", "0"]


def train(out: Path, train_file: Path, steps: int, extra: list[str], config: str, model: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, str(REPO / "hftrain" / "finetune.py"), "--config", config,
                    "--model_name_or_path", model, "--dataset_name", str(train_file),
                    "--validation_split_percentage", "0", "--eval_strategy", "no", "--save_strategy", "no",
                    "--assistant_only_loss", "false", "--max_steps", str(steps), "--logging_steps", str(steps),
                    "--output_dir", str(out), "--overwrite_output_dir", "true", *extra],
                   check=True, capture_output=True, text=True)
    return time.perf_counter() - start


def full_model(out: Path) -> Path:
    """The run's trained model as one folder: final/, or final/'s adapter merged into its base."""
    final = out / "final"
    if not (final / "adapter_config.json").exists():
        return final
    from hftrain.merge import merge

    merge(final, out / "merged")
    return out / "merged"


def trained_function(out: Path, recipe: Recipe):
    """What the QAT run computed while training: its weights (or its base + adapter) with fake quantization."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    final = out / "final"
    if (final / "adapter_config.json").exists():
        base = json.loads((final / "adapter_config.json").read_text())["base_model_name_or_path"]
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), final)
    else:
        model = AutoModelForCausalLM.from_pretrained(final)
    qat.prepare(model, recipe)
    return model


def held_out_loss(model, tokenizer, texts: list[str]) -> float:
    total, tokens = 0.0, 0
    model.eval()
    with torch.no_grad():
        for text in texts:
            ids = torch.tensor([tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]])
            logits = model(input_ids=ids).logits[0, :-1].float()
            total += torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
            tokens += ids.shape[1] - 1
    return total / tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=80, help="0: no training, the model's own PTQ gap")
    parser.add_argument("--group_size", type=int, default=32)
    parser.add_argument("--schemes", nargs="+", default=["int4_weight_only", "int8_dynamic_activation_int4_weight"])
    parser.add_argument("--model", default=str(REPO / "models" / "tiny-llama"))
    parser.add_argument("--config", default=str(REPO / "recipes" / "tiny-text.yaml"))
    parser.add_argument("--lora", action="store_true", help="LoRA r 16 on every linear layer (both runs)")
    parser.add_argument("--held_out", type=int, default=60, help="rows of data/text.jsonl's end held out")
    parser.add_argument("--extra", default="", help="more recipe fields for both runs, as one string")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer, TorchAoConfig

    rows = [json.loads(line)["text"] for line in (REPO / "data" / "text.jsonl").read_text().splitlines()]
    train_rows, held_out = rows[:-60], rows[-args.held_out:]  # the training rows do not depend on --held_out
    work = Path(tempfile.mkdtemp(prefix="compare-qat-"))
    train_file = work / "train.jsonl"
    train_file.write_text("".join(json.dumps({"text": t}) + "\n" for t in train_rows))
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    extra = [*(LORA if args.lora else []), *args.extra.split()]
    start = held_out_loss(AutoModelForCausalLM.from_pretrained(args.model), tokenizer, held_out)
    if args.steps == 0:  # the quantization gap of the model as it is, no training
        for scheme in args.schemes:
            with qat.quiet_torchao():
                ptq_model = AutoModelForCausalLM.from_pretrained(
                    args.model, quantization_config=TorchAoConfig(qat.base_config(scheme, args.group_size)))
            ptq = held_out_loss(ptq_model, tokenizer, held_out)
            print(json.dumps({"model": args.model, "scheme": scheme, "group_size": args.group_size, "fp": start,
                              "ptq": ptq}))
        return
    seconds = {"fp": train(work / "fp", train_file, args.steps, extra, args.config, args.model)}
    fp_final = full_model(work / "fp")
    fp = held_out_loss(AutoModelForCausalLM.from_pretrained(fp_final), tokenizer, held_out)
    results = []
    for scheme in args.schemes:
        config = qat.base_config(scheme, args.group_size)
        with qat.quiet_torchao():
            ptq_model = AutoModelForCausalLM.from_pretrained(fp_final, quantization_config=TorchAoConfig(config))
        ptq = held_out_loss(ptq_model, tokenizer, held_out)
        seconds[scheme] = train(work / scheme, train_file, args.steps,
                                [*extra, "--qat_scheme", scheme, "--qat_group_size", str(args.group_size)],
                                args.config, args.model)
        converted = AutoModelForCausalLM.from_pretrained(work / scheme / qat.QUANTIZED_DIR)
        qat_loss = held_out_loss(converted, tokenizer, held_out)
        recipe = Recipe(qat_scheme=scheme, qat_group_size=args.group_size, use_peft=args.lora)
        fq = held_out_loss(trained_function(work / scheme, recipe), tokenizer, held_out)
        results.append({"model": args.model, "lora": args.lora, "base": start, "scheme": scheme,
                        "group_size": args.group_size, "steps": args.steps, "held_out": args.held_out, "fp": fp,
                        "ptq": ptq, "qat": qat_loss, "qat_fake_quantized": fq,
                        "recovered": (ptq - qat_loss) / (ptq - fp) if ptq != fp else None})
    print(f"{'scheme':<40} {'base':>7} {'fp':>7} {'PTQ':>7} {'QAT':>7} {'QAT fq':>7} {'recovered':>9}")
    for r in results:
        recovered = "-" if r["recovered"] is None else f"{100 * r['recovered']:.0f}%"
        name = f"{r['scheme']} g{r['group_size']}{' LoRA' if r['lora'] else ''}"
        print(f"{name:<40} {r['base']:7.4f} {r['fp']:7.4f} {r['ptq']:7.4f} {r['qat']:7.4f} "
              f"{r['qat_fake_quantized']:7.4f} {recovered:>9}")
    print("training seconds:", {k: round(v) for k, v in seconds.items()})
    print(json.dumps(results))


if __name__ == "__main__":
    main()
