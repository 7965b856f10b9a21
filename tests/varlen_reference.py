"""A CPU stand-in for torch's variable-length FlashAttention kernel (`torch.nn.attention.varlen.varlen_attn`, CUDA
only), for the tests, the test launcher `tests/launchers/varlen_on_cpu.py` and the compile measurement of
`scripts/measure_compile.py`. It implements the kernel's contract as hftrain.attention uses it -- (total, heads, dim)
query, key and value, int32 cumulative lengths, Python-int maximum lengths, keyword `scale`, `window_size` ((-1, 0)
causal, (-1, -1) full) and, from torch 2.12, `enable_gqa` -- as plain sdpa over each document in turn, and checks
the arguments as the kernel needs them (it would read out of bounds, or refuse, where this one raises).

`reference_kernel(gqa=...)` is what the tests substitute for `hftrain.attention.varlen_kernel()`: with gqa False the
signature is torch 2.11's (no enable_gqa) and unequal head counts are refused, as 2.12+ refuses them without
enable_gqa. `opaque_kernel()` runs the same computation inside a torch custom op (forward and backward ops with fake
implementations), which torch.compile cannot look into, as it cannot look into torch's: what dynamo sees of it is
what it sees of the real kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hftrain.attention import VarlenKernel


class Calls:
    """What the kernel was called with, per call: head counts, dtypes, the maximum lengths (for the tests)."""

    def __init__(self):
        self.seen: list[dict] = []

    def add(self, q, k, max_q, max_k, gqa):
        self.seen.append({"heads": q.shape[1], "kv_heads": k.shape[1], "dtypes": (q.dtype, k.dtype),
                          "max": (max_q, max_k), "enable_gqa": gqa})


def check(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, window_size, enable_gqa):
    """The kernel's preconditions (varlen_attn's and FlashAttention's), as assertions."""
    assert query.dim() == key.dim() == value.dim() == 3, "(total, heads, dim) tensors"
    assert query.stride(-1) == key.stride(-1) == value.stride(-1) == 1, "contiguous last dimension"
    assert type(max_q) is int and type(max_k) is int, "maximum lengths are Python ints: no device sync reads them"
    for cu, total in ((cu_seq_q, query.shape[0]), (cu_seq_k, key.shape[0])):
        assert cu.dtype == torch.int32 and cu.dim() == 1 and cu.device == query.device, "int32 cumulative lengths"
        assert int(cu[0]) == 0 and int(cu[-1]) == total, f"cumulative lengths end at {int(cu[-1])}, tokens {total}"
        assert bool((cu[1:] > cu[:-1]).all()), "empty or negative segments"
    assert torch.equal(cu_seq_q, cu_seq_k), "hftrain's query and key segments are the same documents"
    assert max_q >= int((cu_seq_q[1:] - cu_seq_q[:-1]).max()) and max_k >= int((cu_seq_k[1:] - cu_seq_k[:-1]).max())
    heads, kv_heads = query.shape[1], key.shape[1]
    if not enable_gqa and heads != kv_heads:
        raise ValueError(f"Expect query and key/value to have the same number of heads but got Hq={heads} and "
                         f"Hkv={kv_heads}. Try setting enable_gqa=True for GQA.")
    assert heads % kv_heads == 0
    assert tuple(window_size) in ((-1, 0), (-1, -1)), f"window {window_size}: the reference computes no local window"


def per_document(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window_size, enable_gqa):
    """sdpa over each document of the flattened tokens, causal for window (-1, 0)."""
    bounds = cu_seq_q.tolist()
    pieces = []
    for start, end in zip(bounds, bounds[1:]):
        q, k, v = (t[start:end].transpose(0, 1)[None] for t in (query, key, value))  # (1, heads, length, dim)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=tuple(window_size) == (-1, 0), scale=scale,
                                             enable_gqa=enable_gqa)
        pieces.append(out[0].transpose(0, 1))
    return torch.cat(pieces)


def reference_kernel(gqa: bool = True, calls: Calls | None = None) -> VarlenKernel:
    """A kernel of torch 2.12+'s signature (`gqa`) or 2.11's, running on CPU."""
    if gqa:
        def call(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                 enable_gqa=False):
            check(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, window_size, enable_gqa)
            if calls is not None:
                calls.add(query, key, max_q, max_k, enable_gqa)
            return per_document(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window_size, enable_gqa)
    else:
        def call(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
            check(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, window_size, False)
            if calls is not None:
                calls.add(query, key, max_q, max_k, False)
            return per_document(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window_size, False)
    return VarlenKernel(call, gqa, "reference", needs_cuda=False)


# ----------------------------------------------------------------------------------------- the opaque kernel
@torch.library.custom_op("hftrain_test::varlen", mutates_args=())
def _varlen(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_q: torch.Tensor,
            cu_seq_k: torch.Tensor, max_q: int, max_k: int, causal: bool, scale: float | None,
            enable_gqa: bool) -> torch.Tensor:
    window = (-1, 0) if causal else (-1, -1)
    return per_document(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window, enable_gqa).contiguous()


@_varlen.register_fake
def _(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, causal, scale, enable_gqa):
    return torch.empty_like(query)


@torch.library.custom_op("hftrain_test::varlen_backward", mutates_args=())
def _varlen_backward(grad: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     cu_seq_q: torch.Tensor, cu_seq_k: torch.Tensor, max_q: int, max_k: int, causal: bool,
                     scale: float | None, enable_gqa: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention's backward written out per document (a custom op's body runs below autograd): with P = softmax(S),
    S = scale q k^T (causal), O = P v: dv = P^T dO, dS = P (dO v^T - rowsum(dO O)), dq = scale dS k, dk = scale dS^T q;
    grouped key/value heads sum their query heads' gradients."""
    heads, kv_heads, dim = query.shape[1], key.shape[1], query.shape[2]
    groups, scale = heads // kv_heads, dim ** -0.5 if scale is None else scale
    bounds = cu_seq_q.tolist()
    dq, dk, dv = (torch.zeros_like(t, dtype=torch.float32) for t in (query, key, value))
    for start, end in zip(bounds, bounds[1:]):
        q, k, v, g = (t[start:end].transpose(0, 1).float() for t in (query, key, value, grad))  # (heads, length, dim)
        k, v = (t.repeat_interleave(groups, dim=0) for t in (k, v))
        scores = scale * q @ k.transpose(1, 2)
        if causal:
            n = end - start
            scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        p = scores.softmax(-1)
        out = p @ v
        ds = p * (g @ v.transpose(1, 2) - (g * out).sum(-1, keepdim=True))
        dq[start:end] = (scale * ds @ k).transpose(0, 1)
        dk[start:end] = (scale * ds.transpose(1, 2) @ q).unflatten(0, (kv_heads, groups)).sum(1).transpose(0, 1)
        dv[start:end] = (p.transpose(1, 2) @ g).unflatten(0, (kv_heads, groups)).sum(1).transpose(0, 1)
    return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype)


@_varlen_backward.register_fake
def _(grad, query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, causal, scale, enable_gqa):
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


def _setup(ctx, inputs, output):
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, causal, scale, enable_gqa = inputs
    ctx.save_for_backward(query, key, value, cu_seq_q, cu_seq_k)
    ctx.rest = (max_q, max_k, causal, scale, enable_gqa)


def _backward(ctx, grad):
    query, key, value, cu_seq_q, cu_seq_k = ctx.saved_tensors
    dq, dk, dv = _varlen_backward(grad.contiguous(), query, key, value, cu_seq_q, cu_seq_k, *ctx.rest)
    return dq, dk, dv, None, None, None, None, None, None, None


_varlen.register_autograd(_backward, setup_context=_setup)


def opaque_kernel() -> VarlenKernel:
    """The reference inside custom ops: torch.compile traces a call to it, as to torch's kernel, not its loop."""
    def call(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
             enable_gqa=False):
        return _varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, tuple(window_size) == (-1, 0), scale,
                       enable_gqa)
    return VarlenKernel(call, True, "opaque reference", needs_cuda=False)
