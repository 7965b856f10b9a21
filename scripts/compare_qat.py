"""Quantization-aware training against post-training quantization on the tiny model (docs/quantization.md).

    HF_HUB_OFFLINE=1 .venv/bin/python scripts/compare_qat.py                  # both schemes, ~2-4 min on 2 cores
    HF_HUB_OFFLINE=1 .venv/bin/python scripts/compare_qat.py --steps 150 --schemes int4_weight_only
    # make smollm2 first (models/smollm2-135m-instruct): real weights, full fine-tuning
    HF_HUB_OFFLINE=1 .venv/bin/python scripts/compare_qat.py --model models/smollm2-135m-instruct \
        --config recipes/smollm2-135m-lora-cpu.yaml --steps 20 --schemes int4_weight_only \
        --extra="--use_peft false --learning_rate 5e-5 --assistant_only_loss false"

data/text.jsonl is split once (the last 60 rows held out). For each scheme, the same recipe (tiny-text's settings,
full fine-tuning of models/tiny-llama) trains twice through hftrain's entry script: in full precision, and with
`qat_scheme`. Then, in plain PyTorch here, the mean next-token cross-entropy over the held-out rows (each text + EOS,
one row at a time) of:

- fp:   the full-precision run's final/ (the ceiling);
- PTQ:  the same final/ quantized after training (transformers' TorchAoConfig of the scheme: what serving it
        quantized without QAT gives);
- QAT:  the QAT run's final-quantized/ (converted to real int4 weights).

"recovered" = (PTQ - QAT) / (PTQ - fp): the part of the quantization's loss increase that QAT wins back.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hftrain import qat  # noqa: E402
from hftrain.config import Recipe  # noqa: E402


def train(out: Path, train_file: Path, steps: int, extra: list[str], config: str, model: str) -> None:
    subprocess.run([sys.executable, str(REPO / "hftrain" / "finetune.py"), "--config", config,
                    "--model_name_or_path", model, "--dataset_name", str(train_file),
                    "--validation_split_percentage", "0", "--eval_strategy", "no", "--save_strategy", "no",
                    "--max_steps", str(steps), "--logging_steps", str(steps), "--output_dir", str(out),
                    "--overwrite_output_dir", "true", *extra], check=True, capture_output=True, text=True)


def held_out_loss(model, tokenizer, texts: list[str]) -> float:
    total, tokens = 0.0, 0
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
    parser.add_argument("--extra", default="", help="more recipe fields for both runs, as one string")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer, TorchAoConfig

    rows = [json.loads(line)["text"] for line in (REPO / "data" / "text.jsonl").read_text().splitlines()]
    train_rows, held_out = rows[:-60], rows[-60:]
    work = Path(tempfile.mkdtemp(prefix="compare-qat-"))
    train_file = work / "train.jsonl"
    train_file.write_text("".join(json.dumps({"text": t}) + "\n" for t in train_rows))
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    extra = args.extra.split()
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
    train(work / "fp", train_file, args.steps, extra, args.config, args.model)
    fp_final = work / "fp" / "final"
    fp = held_out_loss(AutoModelForCausalLM.from_pretrained(fp_final), tokenizer, held_out)
    results = []
    for scheme in args.schemes:
        config = qat.base_config(scheme, args.group_size)
        with qat.quiet_torchao():
            ptq_model = AutoModelForCausalLM.from_pretrained(fp_final, quantization_config=TorchAoConfig(config))
        ptq = held_out_loss(ptq_model, tokenizer, held_out)
        train(work / scheme, train_file, args.steps, [*extra, "--qat_scheme", scheme, "--qat_group_size",
                                                      str(args.group_size)], args.config, args.model)
        converted = AutoModelForCausalLM.from_pretrained(work / scheme / qat.QUANTIZED_DIR)
        qat_loss = held_out_loss(converted, tokenizer, held_out)
        fq = AutoModelForCausalLM.from_pretrained(work / scheme / "final")  # the QAT weights in full precision
        fq_fp = held_out_loss(fq, tokenizer, held_out)
        qat.prepare(fq, Recipe(qat_scheme=scheme, qat_group_size=args.group_size))
        results.append({"model": args.model, "start": start, "scheme": scheme, "group_size": args.group_size,
                        "steps": args.steps, "fp": fp, "ptq": ptq,
                        "qat": qat_loss, "qat_fake_quantized": held_out_loss(fq, tokenizer, held_out),
                        "qat_weights_unquantized": fq_fp,
                        "recovered": (ptq - qat_loss) / (ptq - fp) if ptq != fp else None})
    print(f"{'scheme':<38} {'fp':>7} {'PTQ':>7} {'QAT':>7} {'QAT fq':>7} {'QAT w/o q':>9} {'recovered':>9}")
    for r in results:
        recovered = "-" if r["recovered"] is None else f"{100 * r['recovered']:.0f}%"
        print(f"{r['scheme'] + ' g' + str(r['group_size']):<38} {r['fp']:7.4f} {r['ptq']:7.4f} {r['qat']:7.4f} "
              f"{r['qat_fake_quantized']:7.4f} {r['qat_weights_unquantized']:9.4f} {recovered:>9}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
