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


def qat_layer_bytes(s: ModelShape, tokens: int, scheme: str, group: int, mixed: bool, trained: bool) -> float:
    """Bytes torchao's fake quantization (`qat_scheme`, torchao 0.18) adds to what one Llama-style decoder layer (q, k,
    v, o, gate, up, down) saves for backward, per micro-batch of `tokens`; `mixed`: bf16 autocast, `trained`: the
    base weights train (full fine-tuning; False: LoRA's frozen base).

    A trained weight's fake quantization keeps its grouped values and two scale-sized tensors (4 + 8 / group bytes per
    weight), and the matmul keeps the fake-quantized weight (in fp32: 4 more bytes; under autocast its bf16 copy,
    which stands for the bf16 copy of the weight the plain layer keeps). A frozen weight keeps only the matmul's copy
    of it (fp32: 4 bytes; autocast: none extra). int8_dynamic_activation_int4_weight also fake-quantizes each linear
    layer's input: an intermediate of the input's size and dtype (4 bytes a value; under autocast o's and down's
    inputs are bf16 matmul outputs: 2), and a scale and zero point per token (8 bytes; 4 for a bf16 input); in fp32
    with trained weights the matmul also keeps fq(x) in place of the input it kept. Counted from autograd's saved
    tensors (tests/unit/test_estimate_quantized.py measures them on a real decoder layer)."""
    weights = s.layer_linear_params / s.layers
    if trained:
        per_weight = (4 if mixed else 8) + 8 / group
    else:
        per_weight = 0 if mixed else 4
    extra = weights * per_weight
    if scheme == "int8_dynamic_activation_int4_weight":
        h, o_in, i = s.hidden, s.heads * (s.kv_dim // s.kv_heads), s.intermediate
        if mixed:  # q k v gate up read the fp32 norm outputs (4 bytes a value), o and down bf16 matmul outputs (2)
            per_token = 4 * 5 * h + 2 * (o_in + i) + 5 * 8 + 2 * 4
        elif trained:  # 8 bytes per input value, less the 4 of each distinct input the plain matmuls kept
            per_token = 8 * (5 * h + o_in + i) - 4 * (2 * h + o_in + i) + 7 * 8
        else:
            per_token = 4 * (5 * h + o_in + i) + 7 * 8
        extra += tokens * per_token
    return extra
