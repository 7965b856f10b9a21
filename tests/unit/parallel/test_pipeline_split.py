"""Pipeline splitting (parallel/pipeline/) in one process: the layer balance, and stages that chain to the
model's own forward with the HF parameter names kept. The distributed runs are in tests/e2e/test_pipeline.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from hftrain.config import Recipe
from hftrain.data import IGNORE_INDEX
from hftrain.errors import HftrainError
from hftrain.objectives.sft import CausalLMTokenLoss
from hftrain.parallel.pipeline import (
    PipelineStages,
    StageForward,
    keep_only,
    microbatches,
)
from hftrain.stages import split_layers, stage_indices


@pytest.mark.parametrize("layers, stages", [(2, 2), (4, 2), (4, 4), (5, 2), (30, 4), (32, 8), (3, 3), (7, 4)])
def test_every_layer_on_exactly_one_stage_balanced_with_embedding_and_head(layers, stages):
    ranges = split_layers(layers, stages)
    assert [i for r in ranges for i in r] == list(range(layers))  # Megatron #1304 built 28 of 30
    cost = [len(r) + (k == 0) + (k == stages - 1) for k, r in enumerate(ranges)]  # embedding and head count 1
    assert all(len(r) >= 1 for r in ranges)
    assert max(cost) - min(cost) <= 1 or min(len(r) for r in ranges) == 1


def test_fewer_layers_than_stages_is_refused():
    with pytest.raises(HftrainError, match="2 layers cannot fill 3 pipeline stages"):
        split_layers(2, 3)


def test_interleaved_stages_loop_over_the_ranks_and_microbatches_default_to_twice_the_stages():
    assert [stage_indices(r, 2, 2) for r in (0, 1)] == [[0, 2], [1, 3]]
    assert microbatches(Recipe(pp_size=2)) == 4
    assert microbatches(Recipe(pp_size=2, pp_schedule="Interleaved1F1B")) == 8
    assert microbatches(Recipe(pp_size=2, pp_microbatches=6)) == 6


def tiny_llama(layers: int = 4, tied: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
                         num_attention_heads=2, max_position_embeddings=64, tie_word_embeddings=tied)
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("stages", [2, 4])
def test_stages_chain_to_the_model_forward(stages):
    """Stage by stage (masks, positions and rotary recomputed on each) equals the model's own forward."""
    model = tiny_llama()
    ids = torch.randint(0, 50, (3, 11))
    expected = model.model(input_ids=ids).last_hidden_state
    ranges = split_layers(4, stages)
    hidden = ids
    for s in range(stages):
        hidden = StageForward(model, s, stages, ranges[s])(hidden)
    torch.testing.assert_close(hidden, expected, rtol=0, atol=0)


def test_placeholders_keep_the_hf_names_of_what_a_rank_holds():
    model = tiny_llama(tied=True)
    full = dict(model.named_parameters(remove_duplicate=False))
    keep_only(model, {2, 3}, first=False, last=True)  # the last of 2 stages
    names = dict(model.named_parameters(remove_duplicate=False))
    assert set(names) == {n for n in full if n.startswith(("model.layers.2.", "model.layers.3.", "model.norm."))} | \
        {"lm_head.weight"}
    assert all(names[n] is full[n] for n in names)  # the same tensors: the tied head keeps the embedding's
    assert model.model.layers[0].held_by_another_stage == "layer 0" and len(model.model.layers) == 4


def test_stages_and_head_under_autocast_give_the_one_process_bf16_loss():
    """bf16 under pp: each stage's forward and the last stage's token loss under autocast (as PipelineBackend.prepare
    wraps them) give the loss of the whole loss module under autocast (accelerate's wrapping without pp), bit for bit
    on the same rows; and it differs from the fp32 loss, so autocast really applies."""
    model = tiny_llama()
    loss_module = CausalLMTokenLoss(model)
    ids = torch.randint(0, 50, (2, 11))
    labels = ids.clone()
    labels[:, :4] = IGNORE_INDEX  # prompt positions: no target
    bf16 = torch.autocast("cpu", dtype=torch.bfloat16)
    with bf16:
        expected = loss_module(ids, labels)
    ranges = split_layers(4, 2)
    stages = [StageForward(model, s, 2, ranges[s]) for s in range(2)]
    hidden = ids
    for stage in stages:
        hidden = bf16(stage)(hidden)
    pipeline = PipelineStages(loss_module, stages, None, 1, 2, 2, 11)
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    torch.testing.assert_close(bf16(pipeline.token_loss)(hidden, targets), expected, rtol=0, atol=0)
    assert not torch.allclose(loss_module(ids, labels), expected, rtol=0, atol=1e-6)


def test_packed_stages_pass_the_documents_positions_on():
    """Packed rows: the position_ids go with the hidden states from stage to stage (the last returns the hidden
    states only), and the chain equals the model's own forward with them: attention stays inside each document."""
    model = tiny_llama()
    ids = torch.randint(0, 50, (2, 10))
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 4, 5, 0, 1, 2, 3]])
    expected = model.model(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state
    alone = model.model(input_ids=ids[:1, 4:7], use_cache=False).last_hidden_state  # row 0's second document
    torch.testing.assert_close(expected[:1, 4:7], alone, rtol=1e-5, atol=1e-5)  # the masks keep documents apart
    ranges = split_layers(4, 4)
    out = (ids, positions)
    for s in range(4):
        out = StageForward(model, s, 4, ranges[s], packed=True)(*out)
        if s < 3:
            assert isinstance(out, tuple) and out[1] is positions
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_v_placement_is_torchs_and_puts_the_first_and_last_stage_on_rank_0(pp):
    """ZBVZeroBubble / DualPipeV: each rank's two stages are where torch's V schedules send their activations."""
    from torch.distributed.pipelining.schedules import generate_stage_to_rank_mapping

    torch_ranks = generate_stage_to_rank_mapping(pp, 2 * pp, style="v")
    mine = {s: r for r in range(pp) for s in stage_indices(r, pp, 2, v=True)}
    assert mine == torch_ranks
    assert stage_indices(0, pp, 2, v=True) == [0, 2 * pp - 1]


def test_v_schedules_need_a_microbatch_per_stage():
    from hftrain.fields.parallel import _pipeline_problems

    short = _pipeline_problems(Recipe(pp_size=2, pp_schedule="ZBVZeroBubble", pp_microbatches=3))
    assert any("at least as many microbatches as stages (4)" in p for p in short)
    assert _pipeline_problems(Recipe(pp_size=2, pp_schedule="DualPipeV", pp_microbatches=4)) == []
    assert microbatches(Recipe(pp_size=2, pp_schedule="ZBVZeroBubble")) == 8
