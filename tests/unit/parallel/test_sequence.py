"""parallel/sequence.py: the pieces hftrain adds around DeepSpeed's Ulysses attention (run for real in
tests/e2e/test_sequence_parallel.py)."""

from __future__ import annotations

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from hftrain.parallel.sequence import document_mask, sdpa_within_documents


def test_document_mask_is_causal_within_each_example_only():
    mask = document_mask(torch.tensor([[0, 1, 2, 0, 1, 0]]))[0, 0].int()
    assert mask.tolist() == [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0],
                             [0, 0, 0, 1, 0, 0], [0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 1]]


def test_sdpa_within_documents_equals_each_example_attended_alone():
    """What Ulysses' attention hands sdpa (no mask, the whole row's position_ids) gives each packed example the
    output it has alone; plain causal attention over the row would not."""
    torch.manual_seed(0)
    module = torch.nn.Module()
    module.is_causal, module.training = True, False
    q, k, v = (torch.randn(1, 2, 7, 4) for _ in range(3))  # [batch, heads, length, head size]
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2]])
    out, _ = sdpa_within_documents(sdpa_attention_forward, module, q, k, v, None, position_ids=positions)
    alone = [sdpa_attention_forward(module, q[:, :, s], k[:, :, s], v[:, :, s], None)[0]
             for s in (slice(0, 4), slice(4, 7))]
    torch.testing.assert_close(out, torch.cat(alone, dim=1))
    across, _ = sdpa_attention_forward(module, q, k, v, None)
    assert not torch.allclose(across[:, 4:], out[:, 4:])
