"""Build a tiny random Llama (or Qwen2, Gemma, Qwen3-MoE, or LLaVA image-text model) with a locally trained tokenizer
and a ChatML chat template.

    python scripts/make_tiny_model.py OUT_DIR [--hidden_size 64 --num_layers 2 --vocab_size 1024 --seed 0]
    python scripts/make_tiny_model.py OUT_DIR --arch qwen2 --tie   # input and output embeddings tied (one tensor)
    python scripts/make_tiny_model.py OUT_DIR --arch qwen3_moe --tokenizer models/tiny-llama [--num_experts 8 ...]
    python scripts/make_tiny_model.py OUT_DIR --arch llava --tokenizer models/tiny-llama [--image_size 28 ...]

Needs no network: the byte-level BPE tokenizer is trained on the shipped data/ files
(or any text files given with --corpus), or copied from a folder with --tokenizer. The result loads offline with
`AutoTokenizer.from_pretrained(OUT_DIR)` and `AutoModelForCausalLM.from_pretrained(OUT_DIR)`.
`models/tiny-llama` in the repository was made with the defaults; `models/tiny-moe` (a Qwen3-MoE-shaped
mixture of experts: 8 experts, 2 per token, on tiny-llama's tokenizer and chat template) with
`python scripts/make_tiny_model.py models/tiny-moe --arch qwen3_moe --tokenizer models/tiny-llama`.

`--arch llava` builds an image-text-to-text model (`AutoModelForImageTextToText` + `AutoProcessor`): a 2-layer CLIP
vision tower on 28x28 images in 7x7 patches (16 image tokens per image), LLaVA's 2-layer projector and a tiny Llama,
with a `<image>` token added to the tokenizer and a chat template whose message content is a list of parts (TRL's
vision format). Its image processor is the Pillow one (CLIPImageProcessorPil): it needs no torchvision.
`models/tiny-vlm` was made with
`python scripts/make_tiny_model.py models/tiny-vlm --arch llava --tokenizer models/tiny-llama`.
With `--tie` the output projection is the input embedding (`tie_word_embeddings: true`, as SmolLM2, Qwen2.5-0.5B,
Llama-3.2-1B and Gemma ship): the saved file then holds `model.embed_tokens.weight` only.
"""

import argparse
import json
import shutil
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GemmaConfig,
    LlamaConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3MoeConfig,
)

REPO = Path(__file__).resolve().parent.parent
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML, as Qwen and SmolLM use it. `<|im_end|>` is EOS so generation stops at the end of a turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def corpus_lines(paths: list[Path]):
    for path in paths:
        for line in path.read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            if "text" in row:
                yield row["text"]
            for message in row.get("messages", []):
                content = message["content"]
                yield content if isinstance(content, str) else " ".join(p.get("text", "") for p in content)


def build_tokenizer(corpus: list[Path], vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_lines(corpus), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=512,
    )


# ChatML over TRL's vision format: content is a string or a list of parts ({"type": "image"} / {"type": "text"}).
VISION_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_llava(tokenizer, text_shape: dict, args):
    """A tiny LLaVA (CLIP vision tower, projector, Llama) and its processor; `tokenizer` gains the image token."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    side, patch = args.image_size, args.patch_size
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
    # vision_feature_select_strategy "default" drops the CLS token: (side/patch)^2 image tokens per image
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=patch,
                               vision_feature_select_strategy="default", num_additional_image_tokens=1,
                               chat_template=VISION_CHAT_TEMPLATE)
    config = LlavaConfig(
        text_config=dict(model_type="llama", intermediate_size=args.hidden_size * 2,
                         num_key_value_heads=args.num_kv_heads or args.num_heads,
                         **{**text_shape, "vocab_size": len(tokenizer)}),
        vision_config=dict(model_type="clip_vision_model", hidden_size=args.hidden_size // 2,
                           intermediate_size=args.hidden_size, num_hidden_layers=2, num_attention_heads=2,
                           image_size=side, patch_size=patch, projection_dim=args.hidden_size // 2),
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"), image_seq_length=(side // patch) ** 2,
        vision_feature_layer=-1, vision_feature_select_strategy="default", tie_word_embeddings=False,
    )
    return LlavaForConditionalGeneration(config), processor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--hidden_size", type=int, default=64)
    parser.add_argument("--num_layers", type=int, default=2)
    parser.add_argument("--num_heads", type=int, default=4)
    parser.add_argument("--num_kv_heads", type=int, default=None,
                        help="llama: key/value heads (grouped-query attention below --num_heads; default: as many)")
    parser.add_argument("--vocab_size", type=int, default=1024)
    parser.add_argument("--max_position_embeddings", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arch", choices=("llama", "qwen2", "gemma", "qwen3_moe", "llava"), default="llama")
    parser.add_argument("--tie", action="store_true", help="tie the output projection to the input embedding "
                        "(tie_word_embeddings: true)")
    parser.add_argument("--image_size", type=int, default=28, help="llava: image side the processor resizes to")
    parser.add_argument("--patch_size", type=int, default=7, help="llava: vision patch side")
    parser.add_argument("--num_experts", type=int, default=8, help="qwen3_moe: experts per layer")
    parser.add_argument("--num_experts_per_tok", type=int, default=2, help="qwen3_moe: experts each token uses")
    parser.add_argument("--tokenizer", type=Path, help="copy this folder's tokenizer and chat template instead of "
                        "training one (e.g. models/tiny-llama)")
    parser.add_argument("--corpus", type=Path, nargs="*", default=[REPO / "data" / "chat.jsonl",
                                                                      REPO / "data" / "text.jsonl"])
    args = parser.parse_args()

    if args.tokenizer:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    else:
        tokenizer = build_tokenizer(args.corpus, args.vocab_size)
    shape = dict(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        max_position_embeddings=args.max_position_embeddings,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=args.tie,
    )
    processor = None
    dense = dict(intermediate_size=args.hidden_size * 2, num_key_value_heads=args.num_kv_heads or args.num_heads)
    if args.arch == "llava":
        torch.manual_seed(args.seed)
        model, processor = build_llava(tokenizer, shape, args)
        config = model.config
    elif args.arch == "llama":
        config = LlamaConfig(**dense, **shape)
    elif args.arch == "qwen2":
        config = Qwen2Config(**dense, **shape)
    elif args.arch == "gemma":  # head_dim is its own setting in Gemma (256 by default)
        config = GemmaConfig(**dense, head_dim=args.hidden_size // args.num_heads, **shape)
    else:  # Qwen3-30B-A3B's layout, scaled down: grouped-query attention, every layer sparse, top-k renormalised
        config = Qwen3MoeConfig(
            num_key_value_heads=max(1, args.num_heads // 2),
            head_dim=args.hidden_size // args.num_heads,
            intermediate_size=args.hidden_size * 2,
            moe_intermediate_size=args.hidden_size // 2,
            num_experts=args.num_experts,
            num_experts_per_tok=args.num_experts_per_tok,
            decoder_sparse_step=1,
            norm_topk_prob=True,
            **shape,
        )
    if processor is None:
        torch.manual_seed(args.seed)
        model = AutoModelForCausalLM.from_config(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    args.out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out_dir)
    (processor or tokenizer).save_pretrained(args.out_dir)
    # byte for byte: save_pretrained would add loading-time keys to tokenizer_config.json
    if args.tokenizer and processor is None:
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
            if (args.tokenizer / name).exists():
                shutil.copyfile(args.tokenizer / name, args.out_dir / name)
    n_params = sum(p.numel() for p in model.parameters())  # a tied weight once
    print(f"tiny {config.model_type} with {n_params:,} parameters and a {len(tokenizer)}-token tokenizer in "
          f"{args.out_dir}")


if __name__ == "__main__":
    main()
