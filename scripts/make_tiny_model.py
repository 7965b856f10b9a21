"""Build a tiny random Llama (or Qwen2, Gemma, Qwen3-MoE, or a LLaVA / Gemma 3 / Idefics3 / Qwen2-VL / Qwen2.5-VL /
Qwen3-VL image-text model) with a locally trained tokenizer and a ChatML chat template.

    python scripts/make_tiny_model.py OUT_DIR [--hidden_size 64 --num_layers 2 --vocab_size 1024 --seed 0]
    python scripts/make_tiny_model.py OUT_DIR --arch qwen2 --tie   # input and output embeddings tied (one tensor)
    python scripts/make_tiny_model.py OUT_DIR --arch qwen3_moe --tokenizer models/tiny-llama [--num_experts 8 ...]
    python scripts/make_tiny_model.py OUT_DIR --arch llava --tokenizer models/tiny-llama [--image_size 28 ...]
    python scripts/make_tiny_model.py OUT_DIR --arch gemma3 --tokenizer models/tiny-llama [--image_tokens 4]
    python scripts/make_tiny_model.py OUT_DIR --arch idefics3 --tokenizer models/tiny-llama [--split_edge 56]

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
`--arch gemma3`: a SigLIP tower on 28x28 images (16 patches average-pooled to --image_tokens), Gemma 3's projector and
a 2-layer Gemma 3 text model (one sliding-window layer, one global; tied embeddings), Gemma 3's processor (each image
becomes "\n\n<start_of_image>" + <image_soft_token> x N + "<end_of_image>\n\n"; token_type_ids mark the image tokens,
which attend to each other both ways) and a Gemma-3-shaped chat template (<start_of_turn>user / model).
`--arch idefics3` (SmolVLM v1's architecture): an image is resized to --split_edge and split into 28x28 tiles, each tile
and the whole image giving 4 <image> tokens (pixel shuffle) between <fake_token_around_image> and <row_i_col_j> /
<global-img> tags; a Llama; SmolVLM's chat template ("User:<image>...<end_of_utterance>\nAssistant: ...").
Both use their family's Pillow image processor (no torchvision); the tests build them at run time (tests/conftest.py).
`--arch qwen2_vl` / `qwen2_5_vl` / `qwen3_vl`: the family's vision tower (Qwen2.5-VL's with window attention, Qwen3-VL's
with learned positions and DeepStack), its 2x2 patch merger and a 2-layer text model with multimodal rotary positions;
Qwen2-VL's image processor (images resized to 28x28 .. 56x56, 7x7 patches, 2x2 merged: 4 <|image_pad|> tokens for a
28x28 image) and the family's video processor, which needs torchvision (make test-newest's environment).
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


# Gemma 3's chat template in shape: the system message folded into the first user turn, the assistant role called
# "model", <start_of_turn> / <end_of_turn>, an image part rendered as <start_of_image> (the processor expands it).
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(prefix='') %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{% set ns.prefix = (message['content'] if message['content'] is string else "
    "message['content'] | map(attribute='text') | join('')) + '\n\n' %}"
    "{% else %}<start_of_turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n{{ ns.prefix }}"
    "{% set ns.prefix = '' %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<start_of_image>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)

# SmolVLM's (Idefics3) chat template:
# "<|im_start|>User:<image>Describe.<end_of_utterance>\nAssistant: A red circle.<end_of_utterance>\n"
IDEFICS3_CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'] is string %}{{ ': ' + message['content'] }}"
    "{% else %}{{ ':' if message['content'][0]['type'] == 'image' else ': ' }}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


def build_gemma3(tokenizer, text_shape: dict, args):
    """A tiny Gemma 3 (SigLIP vision tower, Gemma 3's pooling projector, a Gemma 3 text model with a sliding-window
    layer and a global one, tied embeddings) and its processor with the Pillow image processor; `tokenizer` gains
    <bos>, the turn tokens and the image tokens (<start_of_image>, <image_soft_token>, <end_of_image>)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    image_tokens = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"}
    tokenizer.add_special_tokens({"bos_token": "<bos>", "extra_special_tokens": [
        "<start_of_turn>", "<end_of_turn>", *image_tokens.values()]}, replace_extra_special_tokens=False)
    tokenizer._set_model_specific_special_tokens(image_tokens)  # tokenizer.boi_token etc., as Gemma 3's tokenizer has
    tokenizer.eos_token = "<end_of_turn>"
    side, patch, per_image = args.image_size, args.patch_size, args.image_tokens
    processor = Gemma3Processor(image_processor=Gemma3ImageProcessorPil(size={"height": side, "width": side}),
                                tokenizer=tokenizer, image_seq_length=per_image, chat_template=GEMMA3_CHAT_TEMPLATE)
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in image_tokens.items()}
    text = {**text_shape, "vocab_size": len(tokenizer), "eos_token_id": tokenizer.eos_token_id,
            "bos_token_id": tokenizer.bos_token_id, "tie_word_embeddings": True}
    config = Gemma3Config(
        text_config=dict(model_type="gemma3_text", intermediate_size=args.hidden_size * 2,
                         num_key_value_heads=max(1, args.num_heads // 2), head_dim=args.hidden_size // args.num_heads,
                         query_pre_attn_scalar=args.hidden_size // args.num_heads, sliding_window=32,
                         layer_types=["sliding_attention", "full_attention"][:args.num_layers]
                         + ["full_attention"] * (args.num_layers - 2), **text),
        vision_config=dict(model_type="siglip_vision_model", hidden_size=args.hidden_size // 2,
                           intermediate_size=args.hidden_size, num_hidden_layers=2, num_attention_heads=2,
                           image_size=side, patch_size=patch, vision_use_head=False),
        mm_tokens_per_image=per_image, boi_token_index=ids["boi_token"], eoi_token_index=ids["eoi_token"],
        image_token_index=ids["image_token"], tie_word_embeddings=True,
    )
    model = Gemma3ForConditionalGeneration(config)
    # transformers starts the projection at zero (a checkpoint overwrites it): random here, or no image would reach
    # the language model and no test could tell images from their absence
    torch.nn.init.normal_(model.model.multi_modal_projector.mm_input_projection_weight, std=config.initializer_range)
    return model, processor


def build_idefics3(tokenizer, text_shape: dict, args):
    """A tiny Idefics3 / SmolVLM (SigLIP-like vision tower, pixel-shuffle connector, a Llama) and its processor with
    the Pillow image processor: an image is resized to --split_edge and split into --image_size tiles, each tile and
    the whole image (resized to one tile) give (image_size/patch_size)^2/4 image tokens, between
    <fake_token_around_image> and <row_i_col_j> / <global-img> tags; `tokenizer` gains those tokens."""
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tags = [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]
    tokenizer.add_special_tokens({"extra_special_tokens": [
        "<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>", *tags]},
        replace_extra_special_tokens=False)
    tokenizer.eos_token = "<end_of_utterance>"
    side, patch, scale = args.image_size, args.patch_size, 2
    image_processor = Idefics3ImageProcessorPil(size={"longest_edge": args.split_edge},
                                                max_image_size={"longest_edge": side})
    per_tile = (side // patch) ** 2 // scale**2
    processor = Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_len=per_tile,
                                  chat_template=IDEFICS3_CHAT_TEMPLATE)
    config = Idefics3Config(
        text_config=dict(model_type="llama", intermediate_size=args.hidden_size * 2,
                         num_key_value_heads=args.num_kv_heads or args.num_heads,
                         **{**text_shape, "vocab_size": len(tokenizer), "eos_token_id": tokenizer.eos_token_id}),
        vision_config=dict(hidden_size=args.hidden_size // 2, intermediate_size=args.hidden_size,
                           num_hidden_layers=2, num_attention_heads=2, image_size=side, patch_size=patch),
        scale_factor=scale, image_token_id=tokenizer.convert_tokens_to_ids("<image>"), tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
    )
    return Idefics3ForConditionalGeneration(config), processor


# Qwen2-VL's chat template in shape (the default system message, ChatML turns, an image part rendered as
# <|vision_start|><|image_pad|><|vision_end|>, of which the processor expands <|image_pad|> to the image's tokens).
QWEN2_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen3-VL's: the same turns and image rendering, no default system message.
QWEN3_VL_CHAT_TEMPLATE = QWEN2_VL_CHAT_TEMPLATE.replace(
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}", "")
QWEN_VL_TOKENS = {"vision_start_token": "<|vision_start|>", "vision_end_token": "<|vision_end|>",
                  "image_token": "<|image_pad|>", "video_token": "<|video_pad|>"}


def build_qwen_vl(tokenizer, text_shape: dict, args):
    """A tiny Qwen2-VL, Qwen2.5-VL or Qwen3-VL (--arch qwen2_vl / qwen2_5_vl / qwen3_vl): the family's vision tower on
    --image_size images in --patch_size patches, merged 2x2 per image token (a 28x28 image: 16 patches, 4 tokens), its
    merger and a 2-layer text model with multimodal rotary positions (M-RoPE), and the family's processor (Qwen2-VL's
    image processor; its video processor, which needs torchvision) with a Qwen-VL-shaped chat template. `tokenizer`
    gains <|vision_start|>, <|vision_end|>, <|image_pad|> and <|video_pad|>."""
    import transformers
    from transformers import Qwen2VLImageProcessor

    arch = args.arch
    tokenizer.add_special_tokens({"extra_special_tokens": list(QWEN_VL_TOKENS.values())},
                                 replace_extra_special_tokens=False)
    ids = {name.replace("_token", "_token_id"): tokenizer.convert_tokens_to_ids(token)
           for name, token in QWEN_VL_TOKENS.items()}
    side, patch, merge = args.image_size, args.patch_size, 2
    pixels = {"min_pixels": side * side, "max_pixels": side * side * 4}
    image_processor = Qwen2VLImageProcessor(patch_size=patch, merge_size=merge, temporal_patch_size=2, **pixels)
    video_name, processor_name, model_name, config_name = {
        "qwen2_vl": ("Qwen2VLVideoProcessor", "Qwen2VLProcessor", "Qwen2VLForConditionalGeneration", "Qwen2VLConfig"),
        "qwen2_5_vl": ("Qwen2VLVideoProcessor", "Qwen2_5_VLProcessor", "Qwen2_5_VLForConditionalGeneration",
                       "Qwen2_5_VLConfig"),
        "qwen3_vl": ("Qwen3VLVideoProcessor", "Qwen3VLProcessor", "Qwen3VLForConditionalGeneration", "Qwen3VLConfig"),
    }[arch]
    video_processor = getattr(transformers, video_name)(patch_size=patch, merge_size=merge, temporal_patch_size=2,
                                                        **pixels)
    template = QWEN3_VL_CHAT_TEMPLATE if arch == "qwen3_vl" else QWEN2_VL_CHAT_TEMPLATE
    processor = getattr(transformers, processor_name)(image_processor=image_processor, tokenizer=tokenizer,
                                                      video_processor=video_processor, chat_template=template)
    hidden, heads = args.hidden_size, args.num_heads
    head_dim = hidden // heads  # M-RoPE splits head_dim / 2 rotary frequencies into (time, height, width) sections
    sections = [head_dim // 4, head_dim // 8, head_dim // 8]
    text = dict(text_shape, vocab_size=len(tokenizer), intermediate_size=hidden * 2,
                num_key_value_heads=args.num_kv_heads or heads, eos_token_id=tokenizer.eos_token_id,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": sections})
    vision_shape = dict(depth=2, num_heads=2, in_channels=3, patch_size=patch, spatial_merge_size=merge,
                        temporal_patch_size=2)
    if arch == "qwen2_vl":
        vision = dict(vision_shape, embed_dim=hidden // 2, hidden_size=hidden, mlp_ratio=2)
    elif arch == "qwen2_5_vl":  # window attention over 2x2 merged windows, the last block global
        vision = dict(vision_shape, hidden_size=hidden // 2, intermediate_size=hidden, out_hidden_size=hidden,
                      window_size=patch * merge * 2, fullatt_block_indexes=[1])
        text["rope_parameters"]["rope_type"] = "default"
    else:  # Qwen3-VL: learned position embeddings (interpolated), DeepStack features of block 0 into the text model
        vision = dict(vision_shape, hidden_size=hidden // 2, intermediate_size=hidden, out_hidden_size=hidden,
                      num_position_embeddings=(side * 2 // patch) ** 2, deepstack_visual_indexes=[0])
        text.update(head_dim=head_dim, rope_parameters={**text["rope_parameters"], "mrope_interleaved": True})
        text.pop("max_position_embeddings", None)
    config = getattr(transformers, config_name)(text_config=text, vision_config=vision, tie_word_embeddings=False,
                                                **ids)
    return getattr(transformers, model_name)(config), processor


def main(argv: list[str] | None = None) -> None:
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
    parser.add_argument("--arch", default="llama",
                        choices=("llama", "qwen2", "gemma", "qwen3_moe", "llava", "gemma3", "idefics3", "qwen2_vl",
                                 "qwen2_5_vl", "qwen3_vl"))
    parser.add_argument("--tie", action="store_true", help="tie the output projection to the input embedding "
                        "(tie_word_embeddings: true)")
    parser.add_argument("--image_size", type=int, default=28, help="llava: image side the processor resizes to")
    parser.add_argument("--patch_size", type=int, default=7, help="llava: vision patch side")
    parser.add_argument("--image_tokens", type=int, default=4, help="gemma3: image tokens per image (the vision "
                        "tower's patches average-pooled to this many)")
    parser.add_argument("--split_edge", type=int, default=56, help="idefics3: the longest image side before the "
                        "image is split into --image_size tiles")
    parser.add_argument("--num_experts", type=int, default=8, help="qwen3_moe: experts per layer")
    parser.add_argument("--num_experts_per_tok", type=int, default=2, help="qwen3_moe: experts each token uses")
    parser.add_argument("--tokenizer", type=Path, help="copy this folder's tokenizer and chat template instead of "
                        "training one (e.g. models/tiny-llama)")
    parser.add_argument("--corpus", type=Path, nargs="*", default=[REPO / "data" / "chat.jsonl",
                                                                      REPO / "data" / "text.jsonl"])
    args = parser.parse_args(argv)

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
    vision = {"llava": build_llava, "gemma3": build_gemma3, "idefics3": build_idefics3,
              **dict.fromkeys(("qwen2_vl", "qwen2_5_vl", "qwen3_vl"), build_qwen_vl)}
    if args.arch in vision:
        torch.manual_seed(args.seed)
        model, processor = vision[args.arch](tokenizer, shape, args)
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
