"""Test-only entry point: attn_implementation varlen on a CPU machine.

torch's variable-length FlashAttention kernel (torch.nn.attention.varlen) runs on CUDA only. This launcher puts the
CPU reference of tests/varlen_reference.py in its place, through the one function hftrain looks the kernel up with
(`hftrain.attention.varlen_kernel`): per-document sdpa with the kernel's contract (int32 cumulative lengths, Python-int
maximum lengths, (total, heads, dim) tensors, enable_gqa), checked on every call. Its `needs_cuda` is False, so the
preflight and the automatic choice see a kernel that runs here. Everything else is the product path: the automatic
choice of varlen for packed rows in 16 bits, the collator's document boundaries, the loop, the model's attention
calls. At exit it prints how often the kernel ran, with which head counts: `varlen reference kernel: N calls, ...`.

    python tests/launchers/varlen_on_cpu.py --config ... --packing true --bf16 true
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import hftrain.attention  # noqa: E402
from tests.varlen_reference import Calls, reference_kernel  # noqa: E402

CALLS = Calls()
KERNEL = reference_kernel(gqa=True, calls=CALLS)
hftrain.attention.varlen_kernel = lambda: KERNEL

from hftrain.finetune import main  # noqa: E402
from hftrain.parallel import run_process  # noqa: E402


def counted() -> None:
    try:
        main()
    finally:
        heads = sorted({(call["heads"], call["kv_heads"]) for call in CALLS.seen})
        print(f"varlen reference kernel: {len(CALLS.seen)} calls, (heads, kv heads) {heads}", file=sys.stderr,
              flush=True)


if __name__ == "__main__":
    run_process(counted)
