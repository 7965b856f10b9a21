"""Peak memory and time of one forward + backward with and without `loss_chunk_tokens` on a large vocabulary.

    HF_HUB_OFFLINE=1 .venv/bin/python scripts/bench_loss_chunking.py [--vocab 128000 --tokens 8192]

Each setting runs in a fresh process (peak RSS is per process): a random 2-layer Llama (hidden 256) with a
`--vocab`-token output layer, one micro-batch of `--tokens` trained tokens, hftrain's CausalLMTokenLoss.
Full fp32 logits of the micro-batch take tokens x vocab x 4 bytes (4.2 GB for the defaults); chunking keeps one
chunk's. Prints a markdown table (docs/benchmarks.md, Levers).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def child(vocab: int, tokens: int, chunk: int) -> dict:
    import resource

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from hftrain.objectives.sft import CausalLMTokenLoss

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=1024, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=2048)
    loss = CausalLMTokenLoss(LlamaForCausalLM(config), chunk)
    rows = tokens // 1024
    input_ids = torch.randint(0, vocab, (rows, 1025))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    start = time.perf_counter()
    value = loss(input_ids, input_ids.clone())
    value.backward()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"chunk": chunk, "loss": value.item(), "seconds": seconds, "peak_rss_mb": peak,
            "before_mb": before, "grad_norm": float(loss.lm.lm_head.weight.grad.norm())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=128_000)
    parser.add_argument("--tokens", type=int, default=8192, help="trained tokens per micro-batch (multiple of 1024)")
    parser.add_argument("--chunks", default="0,4096,1024")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.vocab, args.tokens, args.child)))
        return
    results = []
    for chunk in (int(c) for c in args.chunks.split(",")):
        out = subprocess.run([sys.executable, __file__, "--vocab", str(args.vocab), "--tokens", str(args.tokens),
                              "--child", str(chunk)], capture_output=True, text=True, check=True,
                             env={**os.environ, "HF_HUB_OFFLINE": "1"})
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"vocab {args.vocab:,}, {args.tokens:,} trained tokens in one micro-batch, 2-layer Llama (hidden 256); "
          f"full fp32 logits: {args.tokens * args.vocab * 4 / 2**30:.1f} GiB\n")
    print("| loss_chunk_tokens | peak RSS (MB) | forward + backward (s) | loss | lm_head grad norm |")
    print("| --- | --- | --- | --- | --- |")
    for r in results:
        print(f"| {r['chunk'] or 'off'} | {r['peak_rss_mb']:,.0f} | {r['seconds']:.1f} | {r['loss']:.2f} | "
              f"{r['grad_norm']:.5f} |")


if __name__ == "__main__":
    main()
