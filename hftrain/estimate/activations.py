"""Activation bytes a decoder saves for backward, per layer and per micro-batch (SDPA/flash attention)."""

from __future__ import annotations

from hftrain.estimate.shape import ModelShape


def layer_activation_bytes(s: ModelShape, tokens: int, compute_bytes: int, residual_bytes: int, tp: int = 1) -> int:
    """Bytes one decoder layer saves for backward (SDPA/flash attention, no dropout).

    Per token: each of the two norms keeps its input and normalised output (residual dtype) and the
    next matmul keeps its (cast) input; attention keeps q, k, v and the output projection's input;
    the MLP keeps gate, silu(gate), up and their product. Under tensor parallelism (`tp` ranks, transformers' plan:
    q/k/v, gate and up column-wise, o and down row-wise, no sequence parallelism) each rank keeps 1/tp of the
    attention and MLP tensors (its heads, its slice of the intermediate width) and the norms' tensors whole: the
    row-wise outputs are all-reduced back to the full hidden width.
    """
    h, kv, i = s.hidden, s.kv_dim, s.intermediate
    part = lambda width: -(-width // tp)  # noqa: E731 - this rank's share of a sharded width
    norms = 2 * (2 * h * residual_bytes + h * compute_bytes)
    attention = (part(h) + 2 * part(kv) + part(h)) * compute_bytes
    mlp = 4 * part(i) * compute_bytes
    return tokens * (norms + attention + mlp)


def activation_bytes(s: ModelShape, batch: int, seq: int, compute_bytes: int, residual_bytes: int,
                     checkpointing: bool) -> int:
    """What one micro-batch holds when backward starts: saved activations plus the loss's gradient buffers."""
    tokens = batch * seq
    per_layer = layer_activation_bytes(s, tokens, compute_bytes, residual_bytes)
    layers = s.layers * tokens * s.hidden * residual_bytes if checkpointing else s.layers * per_layer
    final_norm = tokens * s.hidden * (2 * residual_bytes + compute_bytes)
    loss = tokens * s.logit_width * 12  # fp32 log-probabilities, their gradient and the logits' gradient
    return layers + final_norm + loss


def backward_floor_bytes(s: ModelShape, batch: int, seq: int, compute_bytes: int, residual_bytes: int) -> int:
    """What backward holds on top of the gradients when it reaches the first layer: that layer's activations
    (saved, or recomputed under checkpointing) and the gradients flowing through its MLP."""
    tokens = batch * seq
    return layer_activation_bytes(s, tokens, compute_bytes, residual_bytes) + 2 * tokens * s.intermediate * 4
