"""Build a tiny random Llama (or Qwen3-MoE) with a locally trained tokenizer and a ChatML chat template.

    python scripts/make_tiny_model.py OUT_DIR [--hidden_size 64 --num_layers 2 --vocab_size 1024 --seed 0]
    python scripts/make_tiny_model.py OUT_DIR --arch qwen3_moe --tokenizer models/tiny-llama [--num_experts 8 ...]

Needs no network: the byte-level BPE tokenizer is trained on the shipped data/ files
(or any text files given with --corpus), or copied from a folder with --tokenizer. The result loads offline with
`AutoTokenizer.from_pretrained(OUT_DIR)` and `AutoModelForCausalLM.from_pretrained(OUT_DIR)`.
`models/tiny-llama` in the repository was made with the defaults; `models/tiny-moe` (a Qwen3-MoE-shaped
mixture of experts: 8 experts, 2 per token, on tiny-llama's tokenizer and chat template) with
`python scripts/make_tiny_model.py models/tiny-moe --arch qwen3_moe --tokenizer models/tiny-llama`.
"""

import argparse
import json
import shutil
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, PreTrainedTokenizerFast, Qwen3MoeConfig

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
                yield message["content"]


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
    parser.add_argument("--arch", choices=("llama", "qwen3_moe"), default="llama")
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
        tie_word_embeddings=False,
    )
    if args.arch == "llama":
        config = LlamaConfig(intermediate_size=args.hidden_size * 2,
                             num_key_value_heads=args.num_kv_heads or args.num_heads, **shape)
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
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    args.out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out_dir)
    tokenizer.save_pretrained(args.out_dir)
    if args.tokenizer:  # byte for byte: save_pretrained would add loading-time keys to tokenizer_config.json
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
            if (args.tokenizer / name).exists():
                shutil.copyfile(args.tokenizer / name, args.out_dir / name)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"tiny {config.model_type} with {n_params:,} parameters and a {len(tokenizer)}-token tokenizer in "
          f"{args.out_dir}")


if __name__ == "__main__":
    main()
