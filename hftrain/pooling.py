"""One vector per text from a model's last hidden states, as sentence-transformers' Pooling module computes it:
objective embedding's loss, its retrieval metrics and `hftrain eval --retrieval` share it."""

from __future__ import annotations

import torch


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor, pooling: str) -> torch.Tensor:
    """One vector per row of `hidden` [rows, length, dim] from its real tokens (`attention_mask`), padding on either
    side: the mean of the real tokens, the first real token, or the last real token."""
    mask = attention_mask.bool()
    if pooling == "mean":
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    if pooling == "cls":
        index = torch.where(mask, positions, mask.shape[1]).amin(dim=1)
    else:
        index = torch.where(mask, positions, -1).amax(dim=1)
    return hidden[torch.arange(len(hidden), device=hidden.device), index]
