"""Packed rows on CPU: sdpa over each row under a block-diagonal mask against hftrain's varlen CPU kernel (sdpa over
each document, `hftrain.attention.CPU_KERNEL`), for attention alone and for one forward + backward of the bench's 8.8M
Llama (scripts/bench.py's full size), alternating, one thread. Results: docs/benchmarks.md, "varlen on CPU".

    python scripts/bench_varlen_cpu.py [--documents 300 200 150 250 124] [--reps 2]
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from hftrain.attention import CPU_KERNEL


def block_mask(documents: list[int]) -> torch.Tensor:
    width = sum(documents)
    mask, start = torch.zeros(width, width, dtype=torch.bool), 0
    for n in documents:
        mask[start:start + n, start:start + n] = torch.ones(n, n, dtype=torch.bool).tril()
        start += n
    return mask


def seconds(fn, reps: int) -> float:
    fn()  # warm-up
    started = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - started) / reps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, nargs="+", default=[300, 200, 150, 250, 124])
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    docs, rows, width = args.documents, args.rows, sum(args.documents)
    cu = torch.tensor([0, *torch.tensor(docs * rows).cumsum(0).tolist()], dtype=torch.int32)

    q, k, v = (torch.randn(rows, 8, width, 32, requires_grad=True) for _ in range(3))
    mask = block_mask(docs)[None, None]

    def masked():
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum().backward()

    def per_document():
        flat = [t.transpose(1, 2).reshape(rows * width, 8, 32) for t in (q, k, v)]
        CPU_KERNEL.call(*flat, cu, cu, max(docs), max(docs), window_size=(-1, 0)).sum().backward()

    config = LlamaConfig(hidden_size=256, num_hidden_layers=8, num_attention_heads=8, intermediate_size=1024,
                         vocab_size=753)
    ids = torch.randint(0, 753, (rows, width))
    positions = torch.cat([torch.arange(n) for n in docs])[None].repeat(rows, 1)
    models = {}
    for kind in ("sdpa", "varlen"):
        torch.manual_seed(0)
        # a config of its own each: the attention implementation is set on the config object
        models[kind] = LlamaForCausalLM._from_config(copy.deepcopy(config), attn_implementation=kind)

    def model_step(kind: str):
        model = models[kind]
        model.zero_grad()
        if kind == "sdpa":
            out = model(input_ids=ids, position_ids=positions, attention_mask=block_mask(docs)[None, None].expand(
                rows, 1, width, width), labels=ids)
        else:
            out = model(input_ids=ids.reshape(1, -1), position_ids=positions.reshape(1, -1), labels=ids.reshape(1, -1),
                        cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(docs), max_length_k=max(docs))
        out.loss.backward()

    for name, (a, b) in {"attention forward + backward": (masked, per_document),
                         "8.8M Llama forward + backward": (lambda: model_step("sdpa"), lambda: model_step("varlen"))
                         }.items():
        first, second = [], []
        for _ in range(args.reps):  # alternating
            first.append(seconds(a, 1))
            second.append(seconds(b, 1))
        print(f"{name}, {rows} rows x {width} tokens of documents {docs}: block-diagonal mask "
              f"{', '.join(f'{t * 1000:,.0f}' for t in first)} ms; per-document "
              f"{', '.join(f'{t * 1000:,.0f}' for t in second)} ms; {sum(first) / sum(second):.2f}x")


if __name__ == "__main__":
    main()
