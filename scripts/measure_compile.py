"""Do compiled decoder blocks recompile when packed micro-batches change shape? Measured on CPU (docs/benchmarks.md).

    HF_HUB_OFFLINE=1 .venv/bin/python scripts/measure_compile.py            # 4 settings, ~6 min on 2 cores
    HF_HUB_OFFLINE=1 .venv/bin/python scripts/measure_compile.py --attention varlen --compile hftrain

A tiny grouped-query Llama (hidden 64, 2 layers, 4 heads on 2 key/value heads) with its decoder blocks compiled in
place runs forward and backward (bf16 autocast) over the same eight packed micro-batches: rows of other lengths,
other document counts, a row holding one document (sdpa then gets no mask), two rows at once, and last the one-token
filler row of an epoch's short last step. Per call: its seconds and the graphs dynamo has compiled so far
(`torch._dynamo.utils.counters["stats"]["unique_graphs"]`); `TORCH_LOGS=recompiles` prints why each one recompiled.

Settings: attention sdpa (hftrain's packed rows today on CPU: a block-diagonal mask) or varlen (the CUDA kernel's
contract run by tests/varlen_reference.py's reference inside a custom op, which dynamo cannot look into, as it cannot
look into torch's kernel), compiled as torch's default does (`block.compile()`: the first shape static, dynamic after
a change) or as hftrain does (`hftrain.model.compile_blocks`: dynamic shapes from the first call). Each setting runs in
a process of its own with an empty inductor cache (a cold compile, as a first run on a machine).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# packed micro-batches, as lists of rows of document lengths (padded to the longest row)
LAYOUTS = [[(30, 20)], [(10, 10, 25)], [(60,)], [(5, 1, 40), (20, 20)], [(33, 7)], [(64,)], [(12, 50), (62,)], [(1,)]]


def measure(attention: str, how: str) -> list[dict]:
    """One setting in this process: the calls' seconds and the graphs compiled after each."""
    import torch
    from torch._dynamo.utils import counters
    from transformers import LlamaConfig, LlamaForCausalLM

    import hftrain.attention
    from hftrain.data.batching import document_boundaries
    from hftrain.model import compile_blocks
    from hftrain.objectives.sft import CausalLMTokenLoss
    from tests.varlen_reference import opaque_kernel

    kernel = opaque_kernel()
    hftrain.attention.varlen_kernel = lambda: kernel
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0,
                         attn_implementation=attention)
    lm = LlamaForCausalLM(config).train()
    if how == "hftrain":
        compile_blocks(lm, None)
    else:
        for block in lm.model.layers:
            block.compile()
    loss_fn = CausalLMTokenLoss(lm)
    g = torch.Generator().manual_seed(1)
    calls = []
    for rows in LAYOUTS:
        width = max(sum(row) for row in rows)
        input_ids = torch.randint(3, 256, (len(rows), width), generator=g)
        position_ids = torch.zeros_like(input_ids)
        for r, row in enumerate(rows):
            offset = 0
            for n in row:
                position_ids[r, offset:offset + n] = torch.arange(n)
                offset += n
            position_ids[r, offset:] = torch.arange(width - offset)
        documents = document_boundaries([[(range(n), None) for n in row] for row in rows], width) \
            if attention == "varlen" else {}
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn(input_ids, input_ids.clone(), position_ids=position_ids, **documents)
        loss.backward()
        calls.append({"rows": rows, "shape": list(input_ids.shape), "seconds": time.perf_counter() - start,
                      "graphs": counters["stats"]["unique_graphs"]})
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--attention", choices=("sdpa", "varlen"), action="append")
    parser.add_argument("--compile", choices=("torch-default", "hftrain"), action="append", dest="how")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.attention[0], args.how[0])))
        return
    results = {}
    for attention in args.attention or ["sdpa", "varlen"]:
        for how in args.how or ["torch-default", "hftrain"]:
            with tempfile.TemporaryDirectory() as cache:  # a cold inductor cache: compile as on a fresh machine
                env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "PYTHONPATH": str(REPO)}
                proc = subprocess.run([sys.executable, __file__, "--child", "--attention", attention, "--compile",
                                       how], capture_output=True, text=True, env=env, cwd=REPO)
            if proc.returncode != 0:
                raise SystemExit(f"measure_compile: {attention}, {how} failed:\n{proc.stderr[-3000:]}")
            results[(attention, how)] = json.loads(proc.stdout.strip().splitlines()[-1])
            print(f"measure_compile: {attention}, {how}: done", file=sys.stderr, flush=True)
    settings = list(results)
    print("| micro-batch (rows of documents) | shape | " + " | ".join(f"{a}, {h}" for a, h in settings) + " |")
    print("| --- | --- |" + " --- |" * len(settings))
    for i, rows in enumerate(LAYOUTS):
        cells = [f"{results[s][i]['seconds']:.1f} s, {results[s][i]['graphs']} graph(s)" for s in settings]
        shape = "x".join(map(str, results[settings[0]][i]["shape"]))
        print(f"| {' + '.join(map(str, rows))} | {shape} | " + " | ".join(cells) + " |")
    totals = [f"{sum(c['seconds'] for c in results[s]):.0f} s, {results[s][-1]['graphs']} graphs" for s in settings]
    print("| all eight | | " + " | ".join(totals) + " |")


if __name__ == "__main__":
    main()
