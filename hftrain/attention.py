"""Packed rows without a mask: torch's variable-length FlashAttention as a transformers attention function.

`attn_implementation: varlen` runs every document of a packed micro-batch as its own causal sequence through
`torch.nn.attention.varlen.varlen_attn` (FlashAttention-2 inside torch, CUDA, bf16/fp16), so a 4,096-token row of
short documents costs the sum of their causal squares, not the square of the row (sdpa's block-diagonal mask). It is
registered in transformers' attention interface under `VARLEN`; nothing registers a mask function for it, so
transformers builds no mask and never scans position_ids. The documents' boundaries come from the packer: the collator
(`data.batching.Collator`, `mark_documents`) puts transformers' flash keyword arguments in the batch (`cu_seq_lens_q/k`:
int32 cumulative lengths over the flattened micro-batch, `max_length_q/k`: the longest segment, a Python int so no
device sync reads it), and the model hands them to every attention call.

The kernel is looked up through `varlen_kernel()` (the one function the tests replace with a per-document sdpa
reference of the same contract: the kernel is CUDA-only). torch 2.11, the GPU image's, has no `enable_gqa`: there the
key/value heads are repeated to the query heads; from 2.12 grouped-query attention runs without that copy (read in
the sources of 2.11 to 2.14: the cuDNN backend, which refuses GQA, is never chosen by 2.12 and 2.13, whose
`_should_use_cudnn` returns False, and by 2.14 only without GQA and without a window, so never for causal attention).
Causal attention is `window_size=(-1, 0)` in every version (none of their `varlen_attn` takes `is_causal`). The
kernel has no dropout, and a sliding window shorter than a document is not applied: the preflight refuses both
(`preflight.varlen_obstacles`), and `varlen_attention_forward` raises if it meets them anyway.

On a machine without CUDA a named `varlen` runs `CPU_KERNEL` instead: the same contract computed as torch's sdpa over
each document in turn (causal, in fp32 or 16 bits), so a packed row costs its documents' causal squares there too
rather than the full square sdpa computes under a block-diagonal mask (about 4x less attention work for rows of five
documents; docs/benchmarks.md). It is chosen only when named: the automatic choice keeps the model's attention on CPU.
Under torch_compile the per-document loop runs between the compiled pieces of each layer (a graph break).

Where it is chosen (automatically on CUDA for packed rows in 16 bits, or by name) and what does not combine with it:
`preflight.varlen_obstacles`, asked for an explicit request and for the automatic choice (`preflight.attention_choice`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.varlen import varlen_attn
from transformers import AttentionInterface

from hftrain.errors import HftrainError

VARLEN = "varlen"
HALF = (torch.bfloat16, torch.float16)
# Architectures whose attention module calls transformers' attention interface as Llama's does (q, k, v, no mask
# function of their own, scaling from the module, dropout only in training, an optional sliding window, no soft-capping
# or attention sinks), checked in transformers 5.25's modeling files; every one runs through the reference kernel in
# tests/unit/test_attention.py.
VARLEN_MODEL_TYPES = frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen3", "phi3", "olmo2", "gemma"})
MAX_HEAD_DIM = 256  # FlashAttention-2's largest head dimension


@dataclass(frozen=True)
class VarlenKernel:
    """A variable-length attention kernel with the contract of `torch.nn.attention.varlen.varlen_attn`: (total, heads,
    dim) query, key and value, int32 cumulative lengths and Python-int maximum lengths, keyword `scale` and
    `window_size` ((-1, 0): causal). `gqa`: it takes `enable_gqa` (torch >= 2.12), so key/value heads may be fewer
    than query heads without a copy; `needs_cuda`: it runs on CUDA tensors only; `flash`: it is a FlashAttention kernel
    (16-bit compute only, head dimensions up to `MAX_HEAD_DIM`)."""

    call: Callable[..., torch.Tensor]
    gqa: bool
    name: str
    needs_cuda: bool = True
    flash: bool = True


# public since torch 2.10 (hftrain's floor is 2.11); CUDA only
TORCH_KERNEL = VarlenKernel(varlen_attn, "enable_gqa" in inspect.signature(varlen_attn).parameters, "torch flash")


def per_document_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_q: torch.Tensor,
                      cu_seq_k: torch.Tensor, max_q: int, max_k: int, *, scale: float | None = None,
                      window_size: tuple[int, int] = (-1, -1), enable_gqa: bool = False) -> torch.Tensor:
    """`varlen_attn`'s contract on any device: sdpa over each segment of the flattened tokens (the same segments for
    queries and keys, as hftrain passes them), causal for window (-1, 0). sdpa's causal kernel computes each
    document's triangle, and nothing across documents."""
    bounds = cu_seq_q.tolist()
    causal = tuple(window_size) == (-1, 0)
    pieces = []
    for start, end in zip(bounds, bounds[1:]):
        q, k, v = (t[start:end].transpose(0, 1).unsqueeze(0) for t in (query, key, value))  # (1, heads, length, dim)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=enable_gqa)
        pieces.append(out.squeeze(0).transpose(0, 1))
    return torch.cat(pieces)


CPU_KERNEL = VarlenKernel(per_document_sdpa, True, "per-document sdpa", needs_cuda=False, flash=False)


def varlen_kernel() -> VarlenKernel:
    """The kernel `varlen_attention_forward` calls where it can run: torch's."""
    return TORCH_KERNEL


def kernel_for(cuda: bool) -> VarlenKernel:
    """The kernel that runs on a machine with (`cuda`) or without a CUDA GPU: `varlen_kernel()`, or, where it needs
    CUDA and there is none, `CPU_KERNEL`."""
    kernel = varlen_kernel()
    return CPU_KERNEL if kernel.needs_cuda and not cuda else kernel


def compute_dtype(query: torch.Tensor, module: torch.nn.Module) -> torch.dtype:
    """The dtype the kernel gets: autocast's where it is on (RoPE's fp32 tables make the query and key fp32 under
    autocast, as sdpa's autocast cast would undo), else the query's when it is 16-bit, else a 16-bit model dtype (a
    QLoRA base whose fp32 norms make the activations fp32), else the query's own (fp32: FlashAttention refuses it, and
    the preflight refuses fp32 runs first)."""
    device = query.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    if query.dtype in HALF:
        return query.dtype
    configured = getattr(getattr(module, "config", None), "dtype", None)
    return configured if configured in HALF else query.dtype


def varlen_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                             is_causal: bool | None = None, cu_seq_lens_q: torch.Tensor | None = None,
                             cu_seq_lens_k: torch.Tensor | None = None, max_length_q: int | None = None,
                             max_length_k: int | None = None, sliding_window: int | None = None,
                             **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: (batch, heads, seq, dim) query and (batch, kv heads, seq, dim) key
    and value in, ((batch, seq, heads, dim) output, None) out. The batch is flattened into one sequence of tokens
    that `cu_seq_lens_q` cuts into documents (the packer's: every document, and each row's padding, is a segment);
    without them (an unpacked evaluation batch) each row is one sequence."""
    batch, heads, length, dim = query.shape
    kv_heads = key.shape[1]
    if key.shape[2] != length or attention_mask is not None:
        got = "an attention mask" if attention_mask is not None else "a key/value cache"
        raise HftrainError(f"attn_implementation=varlen runs training and evaluation forwards of whole rows; it got "
                           f"{got} (generation), which it cannot apply; generate with sdpa")
    if dropout:
        raise HftrainError(f"attn_implementation=varlen: torch's varlen kernel has no attention dropout, and this "
                           f"model trains with attention_dropout={dropout}; use sdpa, or set the model's "
                           "attention_dropout to 0")
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise HftrainError("attn_implementation=varlen: this model's attention soft-caps its scores or has attention "
                           "sinks, which torch's varlen kernel does not compute; use sdpa")
    if cu_seq_lens_q is None:  # rows without the packer's boundaries: one sequence per row (right padding is exact)
        cu_seq_lens_q = torch.arange(0, batch * length + 1, length, dtype=torch.int32, device=query.device)
        max_length_q = length
    cu_seq_lens_k = cu_seq_lens_q if cu_seq_lens_k is None else cu_seq_lens_k
    max_length_k = max_length_q if max_length_k is None else max_length_k
    if sliding_window is not None and sliding_window < max(max_length_q, max_length_k):
        raise HftrainError(f"attn_implementation=varlen: this model attends within a sliding window of "
                           f"{sliding_window} tokens and a document here has {max(max_length_q, max_length_k)}; "
                           f"set max_length <= {sliding_window}, or use sdpa")
    dtype = compute_dtype(query, module)
    # (batch, heads, seq, dim) -> (batch x seq, heads, dim): a view where the projections' (batch, seq, heads, dim)
    # layout survived the transposes, as in transformers' Llama-style attention
    q, k, v = (t.transpose(1, 2).reshape(batch * length, t.shape[1], t.shape[3]).to(dtype)
               for t in (query, key, value))
    kernel = kernel_for(query.device.type == "cuda")
    grouped = {}
    if kv_heads != heads:
        if kernel.gqa:
            grouped["enable_gqa"] = True
        else:  # torch 2.11: each key/value head repeated for its group of query heads (transformers' repeat_kv order)
            k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    out = kernel.call(q, k, v, cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k, scale=scaling,
                      window_size=(-1, 0) if causal else (-1, -1), **grouped)
    out = out.reshape(batch, length, heads, value.shape[-1])
    if not torch.is_autocast_enabled(query.device.type):
        out = out.to(query.dtype)  # what the output projection takes without autocast (a QLoRA base's fp32)
    return out, None


def describe(kernel: str | None, packed: bool, why_not_varlen: str | None = None, cuda: bool = True) -> str:
    """The start-up line's words for the attention a loaded model runs (`kernel`: its attn_implementation) on a
    machine with or without CUDA, and why varlen was not chosen where packed rows could have used it."""
    if kernel == VARLEN:
        details = [f"{kernel_for(cuda).name}, packed rows"]
    elif packed:
        flash = str(kernel).startswith("flash_attention")
        details = ["packed rows flattened into one" if flash else "block-diagonal mask over packed rows"]
    else:
        details = []
    details += [why_not_varlen] if why_not_varlen else []
    return f"{kernel} ({'; '.join(details)})" if details else str(kernel)


AttentionInterface.register(VARLEN, varlen_attention_forward)
