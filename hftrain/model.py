"""Model builders: tokenizer, the causal LM for each fine-tuning method, and the token-loss wrapper.

Full fine-tuning, LoRA and QLoRA differ only here (in the builder), never in the training loop.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hftrain import strategy
from hftrain.config import Recipe
from hftrain.data import IGNORE_INDEX
from hftrain.errors import HftrainError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _load_error(what: str, name: str, exc: Exception) -> HftrainError:
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return HftrainError(
        f"cannot load {what} {name!r}: {first_line}. Give a local folder or a hub id reachable from this machine "
        "(with HF_HUB_OFFLINE=1 only already-cached hub models load)"
    )


def build_tokenizer(recipe: Recipe):
    from transformers import AutoTokenizer

    name = recipe.tokenizer_name_or_path or recipe.model_name_or_path
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            name, revision=recipe.model_revision, trust_remote_code=recipe.trust_remote_code
        )
    except (OSError, ValueError) as exc:
        raise _load_error("tokenizer", name, exc) from None
    return tokenizer


def pad_token_id(tokenizer) -> int:
    """Padding never reaches the loss (labels are -100), so any id works when the tokenizer has no pad token."""
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0):
        if candidate is not None:
            return candidate
    return 0


def build_full_model(recipe: Recipe) -> nn.Module:
    """The causal LM with every parameter trainable (full fine-tuning)."""
    from transformers import AutoModelForCausalLM

    kwargs = {"dtype": DTYPES[recipe.dtype], "revision": recipe.model_revision,
              "trust_remote_code": recipe.trust_remote_code, **strategy.model_load_kwargs(recipe)}
    if recipe.attn_implementation:
        kwargs["attn_implementation"] = recipe.attn_implementation
    try:
        model = AutoModelForCausalLM.from_pretrained(recipe.model_name_or_path, **kwargs)
    except (OSError, ValueError) as exc:
        raise _load_error("model", recipe.model_name_or_path, exc) from None
    model.config.use_cache = False
    if recipe.gradient_checkpointing:
        # Non-reentrant checkpointing works with DDP and frozen inputs (no "marked ready twice").
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return model


def build_model(recipe: Recipe) -> nn.Module:
    """The builder chosen by the recipe's fine-tuning method."""
    return build_full_model(recipe)


def fit_embeddings_to_tokenizer(model: nn.Module, tokenizer) -> int | None:
    """Grow the embeddings when the tokenizer gained tokens (ChatML fallback); returns the new size or None."""
    if len(tokenizer) <= model.get_input_embeddings().num_embeddings:
        return None
    model.resize_token_embeddings(len(tokenizer), mean_resizing=True)
    model.config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return len(tokenizer)


def check_model_config(recipe: Recipe):
    """Load only the model's config (no weights): a missing model or a too-long max_length fails in seconds."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(recipe.model_name_or_path, revision=recipe.model_revision,
                                            trust_remote_code=recipe.trust_remote_code)
    except (OSError, ValueError) as exc:
        raise _load_error("model", recipe.model_name_or_path, exc) from None
    check_model_fits(recipe, config)
    return config


def check_model_fits(recipe: Recipe, config) -> None:
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and recipe.max_length > limit:
        raise HftrainError(f"max_length={recipe.max_length} is above the model's max_position_embeddings={limit}; "
                           "lower max_length")


# Architectures whose logits are exactly `lm_head(last_hidden_state)` in transformers 5.23. Others may
# scale or soft-cap them (Granite `logits_scaling`, Gemma 2/3 soft-capping, Cohere `logit_scale`) and
# take the model's own full-logits path.
HEAD_ONLY_MODEL_TYPES = frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen3", "phi3", "olmo2", "gemma"})


class CausalLMTokenLoss(nn.Module):
    """Wraps a causal LM so that `forward` returns the *sum* of next-token cross-entropies.

    The loop divides by the global number of trained tokens of the optimizer step, which makes
    gradient accumulation and data parallelism exact. For known architectures logits are computed
    only at trained positions (prompt and padding positions never need them), in fp32 for a stable
    softmax; any other model takes its own full-logits path.
    """

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm
        self.head_only = lm.config.model_type in HEAD_ONLY_MODEL_TYPES

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """`position_ids` restarting inside a row mark packed examples (block-diagonal attention)."""
        targets = labels[:, 1:]
        trained = targets != IGNORE_INDEX
        inputs = {"input_ids": input_ids, "position_ids": position_ids, "use_cache": False}
        if self.head_only:
            hidden = self.lm.get_decoder()(**inputs).last_hidden_state
            logits = self.lm.get_output_embeddings()(hidden[:, :-1][trained])
        else:
            logits = self.lm(**inputs).logits[:, :-1][trained]
        return F.cross_entropy(logits.float(), targets[trained], reduction="sum")
