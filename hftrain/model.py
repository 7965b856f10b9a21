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
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def build_model(recipe: Recipe) -> nn.Module:
    """The builder chosen by the recipe's fine-tuning method."""
    return build_full_model(recipe)


def check_model_fits(recipe: Recipe, model: nn.Module) -> None:
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and recipe.max_length > limit:
        raise HftrainError(f"max_length={recipe.max_length} is above the model's max_position_embeddings={limit}; "
                           "lower max_length")


class CausalLMTokenLoss(nn.Module):
    """Wraps a causal LM so that `forward` returns the *sum* of next-token cross-entropies.

    The loop divides by the global number of trained tokens of the optimizer step, which makes
    gradient accumulation and data parallelism exact. Logits are computed only at trained
    positions (prompt and padding positions never need them), in fp32 for a stable softmax.
    Models whose logits are more than `lm_head(hidden)` (soft-capping, logit scaling) take the
    model's own full-logits path.
    """

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm
        config = lm.config
        self.head_only = not (getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        targets = labels[:, 1:]
        trained = targets != IGNORE_INDEX
        if self.head_only:
            hidden = self.lm.get_decoder()(input_ids=input_ids, use_cache=False).last_hidden_state
            logits = self.lm.get_output_embeddings()(hidden[:, :-1][trained])
        else:
            logits = self.lm(input_ids=input_ids, use_cache=False).logits[:, :-1][trained]
        return F.cross_entropy(logits.float(), targets[trained], reduction="sum")
