"""What the estimate reads of a model: its shape from the config, built on the meta device (no weights), and how
transformers' tensor-parallel plan splits each parameter."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification
from transformers.distributed import tensor_parallel
from transformers.distributed.tensor_parallel import (
    ALL_PARALLEL_STYLES,
    ColwiseParallel,
    PackedColwiseParallel,
    PackedRowwiseParallel,
    ReplicatedWithGradAllReduce,
    RowwiseParallel,
    TensorParallelLayer,
)

from hftrain import hub
from hftrain.compat.transformers import expanded_parallel_plan
from hftrain.errors import HftrainError, first_line
from hftrain.fp8 import float8_layers
from hftrain.metrics import active_expert_fraction, num_experts

# transformers >= 5.21 gives embeddings a style of their own (EmbeddingParallel, its `shard_dim`); before, none: it
# shards an nn.Embedding under the colwise style on the hidden dim (1) and under rowwise on the vocabulary (0) itself
EmbeddingParallel = getattr(tensor_parallel, "EmbeddingParallel", None)


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs from a model, read from its config on the meta device."""

    name: str
    architecture: str
    params: int  # all parameters (tied weights once)
    embedding_params: int  # input embedding
    head_params: int  # output projection when not tied to the input embedding, else 0
    layer_linear_params: int  # weights of the decoder layers' linear layers (what LoRA adapts, QLoRA quantizes)
    largest_layer_params: int  # parameters of one decoder layer (the unit gathered by ZeRO-3 / FSDP)
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_dim: int  # key/value width (num_key_value_heads x head_dim)
    kv_heads: int
    vocab: int
    lora_params_per_rank: int  # adapter parameters per unit of LoRA rank: sum of (in + out) over adapted linears
    active_params: int | None = None  # mixture-of-experts: parameters one token computes with (top-k experts)
    model_type: str = ""
    pipeline_plan: bool = False  # its base_model_pp_plan is embed_tokens, layers, norm (what hftrain's stages split)
    # transformers' tensor-parallel plan (`tp_plan`, resolved on the model), as (elements, size of the sharded
    # dimension, 0 = replicated) per parameter: one decoder layer's, the input embedding's, the output projection's
    layer_tp: tuple[tuple[int, int], ...] = ()
    embedding_tp: tuple[int, int] = (0, 0)
    head_tp: tuple[int, int] = (0, 0)
    tp_plan: bool = False  # the model has a tp plan
    tp_unmodelled: tuple[str, ...] = ()  # plan styles whose placement this estimate does not model (packed, experts)
    experts: int | None = None  # mixture-of-experts: experts per MoE layer (parallel/expert.py reads the config)
    layer_expert_params: int = 0  # the expert weights of the largest decoder layer (what --ep splits)
    scores: bool = False  # a reward model (objective reward): a one-output score head, no vocabulary logits
    float8_params: int = 0  # fp8: weights of the linear layers hftrain.fp8 converts for the recipe asked (or 0)

    @property
    def logit_width(self) -> int:
        """Logits per token the loss holds: the vocabulary, or a reward model's one score."""
        return 1 if self.scores else self.vocab


def ulysses_splits(heads: int, kv_heads: int, sp: int) -> bool:
    """Whether DeepSpeed's Ulysses can give each of `sp` ranks heads/sp attention heads: sp divides the heads, and
    divides the key/value heads or is a multiple of them (they are then replicated)."""
    return heads % sp == 0 and (kv_heads % sp == 0 or sp % kv_heads == 0)


def model_shape(model: str, trust_remote_code: bool = False, reward: bool = False,
                fp8_recipe: str | None = None) -> ModelShape:
    """Read `model`'s config (local folder or hub id) and count its parameters on the meta device. `reward`: as
    objective reward builds it (AutoModelForSequenceClassification, one output: the causal LM's head replaced by a
    hidden -> 1 score head). `fp8_recipe`: also count the weights fp8 converts to float8 for it (hftrain.fp8's
    choice, torchao's rule: needs torchao)."""
    hub.reach("the config of model", model)
    try:
        config = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise HftrainError(f"cannot read the config of model {model!r}: {first_line(exc)}. Give a local model "
                           "folder or a hub id reachable from this machine (only config.json is needed, no weights)"
                           ) from None
    if reward:
        config.num_labels = 1
    auto = AutoModelForSequenceClassification if reward else AutoModelForCausalLM
    try:
        with torch.device("meta"):
            lm = auto.from_config(config, trust_remote_code=trust_remote_code)
    except ValueError as exc:
        what = "sequence classifier (objective reward)" if reward else "causal LM"
        raise HftrainError(f"model {model!r} ({type(config).__name__}) is not a {what} transformers can build: "
                           f"{first_line(exc)}") from None
    text = config.get_text_config()
    inp, out = lm.get_input_embeddings(), lm.score if reward else lm.get_output_embeddings()
    tied = out is not None and out.weight is inp.weight
    layers = _decoder_layers(lm)
    split, unmodelled = _tp_split(lm)
    names = {id(m): n for n, m in lm.named_modules()}
    largest = max(layers, key=lambda layer: sum(p.numel() for p in layer.parameters()))
    head_module = out if out is not None else inp
    pp_plan = getattr(config, "base_model_pp_plan", None) or {}
    float8 = set(float8_layers(lm, fp8_recipe)[0]) if fp8_recipe else set()
    linears = [m for layer in layers for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return ModelShape(
        name=model, architecture=type(lm).__name__,
        params=sum(p.numel() for p in lm.parameters()),
        embedding_params=inp.weight.numel(),
        head_params=0 if tied or out is None else out.weight.numel(),
        layer_linear_params=sum(m.weight.numel() for m in linears),
        largest_layer_params=max(sum(p.numel() for p in layer.parameters()) for layer in layers),
        layers=len(layers), hidden=text.hidden_size,
        intermediate=getattr(text, "intermediate_size", 4 * text.hidden_size),
        heads=heads, kv_dim=getattr(text, "num_key_value_heads", heads) * head_dim,
        kv_heads=getattr(text, "num_key_value_heads", None) or heads, vocab=text.vocab_size,
        lora_params_per_rank=sum(m.in_features + m.out_features for m in linears),
        active_params=_active_params(lm, text),
        model_type=config.model_type, pipeline_plan=list(pp_plan) == ["embed_tokens", "layers", "norm"],
        layer_tp=tuple(split.get(f"{names[id(largest)]}.{n}", (p.numel(), 0)) for n, p in largest.named_parameters()),
        embedding_tp=split.get(f"{names[id(inp)]}.weight", (inp.weight.numel(), 0)),
        head_tp=split.get(f"{names[id(head_module)]}.weight", (head_module.weight.numel(), 0)),
        tp_plan=bool(split), tp_unmodelled=unmodelled, scores=reward, experts=num_experts(config),
        layer_expert_params=sum(p.numel() for name, p in largest.named_parameters() if ".experts." in f".{name}"),
        float8_params=sum(m.weight.numel() for name, m in lm.named_modules() if name in float8),
    )


def _tp_split(lm) -> tuple[dict[str, tuple[int, int]], tuple[str, ...]]:
    """How transformers' tensor-parallel plan places each parameter (`apply_tensor_parallelism` in
    transformers/distributed/tensor_parallel.py, 5.23): {name: (elements, size of the sharded dimension)}, 0 for a
    replicated one (norms, and what the plan does not name), and the plan's styles this estimate does not model.
    colwise styles shard a weight's output rows (dim ndim-2: a bias too; packed_colwise, a fused gate/up weight or a
    3D experts' one, the same dimension in strided halves), rowwise ones a weight's input columns (the bias
    replicated; packed_rowwise likewise), embedding styles their `shard_dim` (Llama's plan adds `embed_tokens:
    embedding_rowwise`, the vocabulary); replicated_with_grad_allreduce (Qwen3's q_norm / k_norm) keeps the weight
    whole. Empty for a model without a plan."""
    plan = getattr(lm, "tp_plan", None) or {}
    styles = expanded_parallel_plan(lm, plan) if plan else None
    if styles is None:
        return {}, ()
    split, unmodelled = {}, set()
    for module_name, module in lm.named_modules():
        for short, p in module.named_parameters(recurse=False):  # a tied head's weight under its own name too
            name = f"{module_name}.{short}" if module_name else short
            style = styles.get(name)
            kind = ALL_PARALLEL_STYLES[style] if style is not None else None
            dim = None
            own_embedding = EmbeddingParallel is None and isinstance(module, torch.nn.Embedding)
            if isinstance(kind, ColwiseParallel):
                dim = 1 if own_embedding else (p.ndim - 2) % p.ndim
            elif isinstance(kind, PackedColwiseParallel):
                dim = (p.ndim - 2) % p.ndim
            elif isinstance(kind, RowwiseParallel):
                dim = 0 if own_embedding else None if short == "bias" else p.ndim - 1
            elif isinstance(kind, PackedRowwiseParallel):
                dim = None if p.ndim == 1 else p.ndim - 1
            elif EmbeddingParallel is not None and isinstance(kind, EmbeddingParallel):
                dim = kind.shard_dim
            elif kind is not None and type(kind) not in (TensorParallelLayer, ReplicatedWithGradAllReduce):
                unmodelled.add(style)
            split[name] = (p.numel(), 0 if dim is None else p.shape[dim])
    return split, tuple(sorted(unmodelled))


def tp_elements(parts, tp: int) -> int:
    """Elements the largest tp rank holds of parameters `parts` ((elements, sharded size) pairs): torch's Shard
    gives rank 0 ceil(size / tp) slices of a dimension that tp does not divide."""
    return sum(n // size * -(-size // tp) if size else n for n, size in parts)


def _active_params(lm, config) -> int | None:
    """Parameters a token computes with in a mixture-of-experts model: expert weights count k / experts of their
    size. Compute (FLOPs, MFU) follows these; memory holds every parameter. None for a dense model."""
    fraction = active_expert_fraction(config)
    if fraction is None:
        return None
    experts = sum(p.numel() for name, p in lm.named_parameters() if ".experts." in f".{name}")
    return sum(p.numel() for p in lm.parameters()) - round((1 - fraction) * experts)


def _decoder_layers(lm):
    lists = [m for m in lm.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 0]
    if not lists:
        raise HftrainError(f"cannot find the decoder layers of {type(lm).__name__}; the estimate supports "
                           "decoder-only transformers with a list of layers")
    return max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))
