"""TRL 1.16's DPOTrainer against hftrain's dpo on an image-text model: per-step loss, rewards and log-probs, and the
updated weights.

    python scripts/compare_trl_vlm_dpo.py [--model models/tiny-vlm --steps 3 --out /tmp/compare-trl-vlm-dpo] [--json F]

Both train the tiny random LLaVA (the processor expands each <image> into 16 image tokens), or with --model a tiny
Qwen2-VL / Qwen2.5-VL (scripts/make_tiny_model.py; grid-sized image tokens, image_grid_thw, torchvision needed), on
the same image
preference pairs (the first pairs of data/image-pairs.jsonl: prompts whose image parts are written in the messages,
and prompts of string content into whose first user message TRL's `prepare_multimodal_messages` and hftrain put the
images), in the same order, with the same hyperparameters (scripts/trl_compare.py's: constant learning rate, clipping
at 1.0, fp32, 4 pairs per step; plain SGD, learning rate 0.2, so that the final weights compare too: AdamW's first
steps turn the rounding noise of a gradient that is zero in exact arithmetic, such as an attention key's bias, into
updates of the learning rate's size) and every part trained (the vision tower and projector too:
freeze_vision_tower / freeze_projector false), for loss_type sigmoid and ipo, and sigmoid with LoRA (scripts/
trl_compare.py's adapters on q/k/v/o_proj: the language model's and the vision tower's attention), and sigmoid with
QLoRA (the same adapters on the base loaded in 4 bits, NF4, float32 compute; bitsandbytes runs on the CPU: the
vision tower's attention trains through its adapters on 4-bit weights; TRL's DPOTrainer casts a quantized model's
adapters to bf16 at its construction, which the script undoes: hftrain keeps them in fp32, as peft makes them).
Full fine-tuning: TRL loads a reference copy, hftrain copies the policy; LoRA and QLoRA: both disable the adapters;
both give the reference the same pixels. The model folder is copied with a chat template that writes the newline
between turns before each turn, so that nothing follows a completion's <|im_end|> (TRL trains what the template
renders after the completion, hftrain stops at the end-of-turn token: docs/from-trl.md).

TRL's collator runs the image processor on each pair's images twice (chosen and rejected rows); hftrain once, the
pixels read for both rows: the values are the same. With one micro-batch per step TRL's mean is the mean over the
step's pairs. Writes both runs' final weights (TRL's under out/trl-N/final); tests/e2e/test_vision_dpo.py compares
them. Needs no network; about two minutes on 2 CPU cores.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import trl_compare as compare  # noqa: E402 - the comparisons' shared part, beside this script
from trl_compare import REPO, SETTINGS  # noqa: E402

OPTIMIZER = dict(optim="sgd", learning_rate=0.2)
VARIANTS = {"sigmoid full": ("sigmoid", "full"), "ipo full": ("ipo", "full"), "sigmoid lora": ("sigmoid", "lora"),
            "sigmoid qlora": ("sigmoid", "qlora")}
KEYS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")
# the tiny LLaVA's template (ChatML with list-of-parts content), the newline between turns written before each turn
NO_TRAILING_NEWLINE = (
    "{% for message in messages %}{% if not loop.first %}{{ '\n' }}{% endif %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}{{ '\n<|im_start|>assistant\n' }}{% endif %}"
)
# what the family's template writes for an image part (scripts/make_tiny_model.py's templates)
IMAGE_PART = {"llava": "<image>", **dict.fromkeys(("qwen2_vl", "qwen2_5_vl", "qwen3_vl"),
                                                  "<|vision_start|><|image_pad|><|vision_end|>")}


def model_copy(model: Path, out: Path) -> Path:
    """The model folder copied under `out`, its chat template NO_TRAILING_NEWLINE with the family's image part."""
    copy = out / "model"
    shutil.copytree(model, copy, dirs_exist_ok=True)
    family = json.loads((model / "config.json").read_text())["model_type"]
    (copy / "chat_template.jinja").write_text(NO_TRAILING_NEWLINE.replace("<image>", IMAGE_PART[family]))
    return copy


def pairs(count: int, out: Path) -> Path:
    """The first `count` pairs of data/image-pairs.jsonl with absolute image paths."""
    lines = (REPO / "data" / "image-pairs.jsonl").read_text(encoding="utf-8").splitlines()[:count]
    rows = [json.loads(line) for line in lines]
    for row in rows:
        row["images"] = [str(REPO / "data" / image) for image in row["images"]]
    path = out / "image-pairs.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def qlora_policy(model_path: Path):
    """QLoRA as peft's recipe makes it, for TRL: the base loaded in 4 bits by transformers (NF4, float32 compute:
    hftrain's defaults), its Linear4bit layers kept in their training layout (as hftrain keeps them:
    `model.keep_4bit_layout`), `prepare_model_for_kbit_training`, then the adapters of the lora variant."""
    import torch
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForImageTextToText, BitsAndBytesConfig

    quantized = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    model = compare.policy(model_path, "full", model_class=AutoModelForImageTextToText, quantization_config=quantized)
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    return get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **compare.LORA), autocast_adapter_dtype=True)


def run_trl(model_path: Path, data: Path, steps: int, out: Path, loss: str, method: str) -> list:
    import datasets
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    rows = []

    class Record(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                rows.append({k: logs[k] for k in KEYS if k in logs})

    dataset = datasets.load_dataset("json", data_files=str(data), split="train")
    dataset = dataset.cast_column("images", datasets.Sequence(datasets.Image()))  # decoded as PIL images
    if method == "qlora":
        model = qlora_policy(model_path)
    else:
        model = compare.policy(model_path, method, model_class=AutoModelForImageTextToText)
    args = DPOConfig(output_dir=str(out), use_cpu=True, bf16=False, gradient_checkpointing=False,
                     max_steps=steps, train_sampling_strategy="sequential", eval_strategy="no", save_strategy="no",
                     report_to=[], disable_tqdm=True, loss_type=[loss], **OPTIMIZER, **SETTINGS)
    adapters = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    trainer = DPOTrainer(model=model, args=args, processing_class=AutoProcessor.from_pretrained(model_path),
                         train_dataset=dataset, callbacks=[Record()])
    if method == "qlora":  # TRL 1.16 casts a quantized model's adapters to bf16 (QLoRA paper); hftrain keeps fp32
        for name, p in trainer.model.named_parameters():
            if name in adapters:
                p.data = adapters[name].clone()
    trainer.train()
    final = out / "final"
    final.mkdir(parents=True, exist_ok=True)
    torch.save({k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, final / "weights.pt")
    return rows


def run_hftrain(model_path: Path, data: Path, steps: int, out: Path, loss: str, method: str) -> list:
    quantized = {"load_in_4bit": True} if method == "qlora" else {}
    rows = compare.run_hftrain(out, model_path, data, steps, "lora" if method == "qlora" else method, objective="dpo",
                               loss_type=loss, **OPTIMIZER, **quantized, freeze_vision_tower=False,
                               freeze_projector=False, **SETTINGS)
    return compare.train_steps(rows, KEYS)


def main() -> None:
    parser = compare.parser(__doc__, "/tmp/compare-trl-vlm-dpo", model=False)
    parser.add_argument("--model", type=Path, default=REPO / "models" / "tiny-vlm",
                        help="The image-text model both train, a local folder (default: %(default)s).")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                        help="Which comparisons to run (default: all).")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = model_copy(args.model, args.out)
    data = pairs(SETTINGS["per_device_train_batch_size"] * args.steps, args.out)
    results = {}
    for i, name in enumerate(args.variants):
        loss, method = VARIANTS[name]
        trl = run_trl(model, data, args.steps, args.out / f"trl-{i}", loss, method)
        mine = run_hftrain(model, data, args.steps, args.out / f"hftrain-{i}", loss, method)
        results[name] = {"trl": trl, "hftrain": mine, "trl_final": str(args.out / f"trl-{i}" / "final"),
                         "hftrain_final": str(args.out / f"hftrain-{i}" / "final")}
        print(f"== {name}")
        compare.print_steps(trl, mine, [("loss", "loss", ".6f"), ("margins", "rewards/margins", ".6f")])
    compare.write_json(args.json, results)


if __name__ == "__main__":
    main()
