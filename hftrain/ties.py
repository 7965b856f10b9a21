"""Weights a model holds under more than one name: tied input and output embeddings (`lm_head.weight` is
`model.embed_tokens.weight`). A tie is the model's property, and three parts of hftrain must keep it: a checkpoint or
final save writes such a tensor once, under either name; a strategy's preparation or a load must leave it one tensor
(`check_ties`); a pipeline stage or a trained folder reads it back under the name it was saved with.
"""

from __future__ import annotations

from hftrain.errors import HftrainError


def tied_groups(model) -> list[set[str]]:
    """The state-dict keys of each tensor the model holds under more than one name: tied input and output embeddings
    (`lm_head.weight` is `model.embed_tokens.weight`, as transformers' `all_tied_weights_keys` declares for SmolLM2,
    Qwen2.5-0.5B, Llama-3.2-1B, Gemma). A file holds such a tensor once, under any of its names (safetensors drops the
    aliases), and loading that one name restores every alias, since they are one tensor."""
    names: dict[int, set[str]] = {}
    for n, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(t), set()).add(n)
    return [group for group in names.values() if len(group) > 1]


def declared_ties(model) -> list[tuple[str, str]]:
    """(alias, source) parameter names of every tie the model's transformers parts declare (`all_tied_weights_keys`,
    as `tie_weights` made them), prefixed with where each part sits in `model` (the loss wrapper, peft's wrappers)."""
    ties = []
    for prefix, module in model.named_modules(remove_duplicate=False):
        tied = getattr(module, "all_tied_weights_keys", None)
        if isinstance(tied, dict) and hasattr(module, "tie_weights"):
            ties += [(f"{prefix}.{alias}" if prefix else alias, f"{prefix}.{source}" if prefix else source)
                     for alias, source in tied.items()]
    return ties


def held_ties(model) -> list[str]:
    """The aliases of the declared ties (`declared_ties`) that `model` holds as one tensor with their source: the
    names a saved state dict can leave out, since loading the source restores them."""
    params = dict(model.named_parameters(remove_duplicate=False))
    return [alias for alias, source in declared_ties(model)
            if alias in params and source in params and params[alias] is params[source]]


def broken_ties(model) -> list[str]:
    """The declared ties (`declared_ties`) whose two names no longer hold one tensor: a load or a wrapper that made
    two copies, which would then train apart. [] when every tie holds."""
    params = dict(model.named_parameters(remove_duplicate=False))
    return [f"{alias} / {source}" for alias, source in declared_ties(model)
            if alias in params and source in params and params[alias] is not params[source]]


def check_ties(model, after: str) -> None:
    """Raise if `after` (a load, a strategy's preparation) left a declared tie as two tensors (`broken_ties`)."""
    if broken := broken_ties(model):
        raise HftrainError(f"{after} left the model's tied input and output embeddings as separate tensors "
                           f"({broken[0]}): they would be trained as two copies that drift apart and saved as one. "
                           "This is a bug in hftrain's handling of this strategy; please report it with the recipe")
