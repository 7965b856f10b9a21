"""GRPO's loss under sequence parallelism and context parallelism (`GRPOLoss.sliced_forward` with hftrain.parallel.
sequence's `SequenceSlices` and hftrain.parallel.context's `RingSlices`) against its whole-rows `forward`, on 2 real
gloo processes: under sp the micro-batch's rows concatenated and cut in two inside a completion; under cp each row
padded to 8 and cut into the ring's head-tail chunks (rank 0 positions 0-1 and 6-7, rank 1 positions 2-5); every
per-token input (targets, completion and tool mask, advantages, old and reference log-probs) sliced with the tokens.
The model is token-wise (embedding and head, no attention), so a slice's logits are the whole rows' at its positions
and the comparison isolates the slicing of the loss: the returned loss, the group's statistics, the gathered
log-probs, and the gradient (each rank's, averaged over the group as the strategy does) equal one process's, for
every loss_type, and with sequence-level (GSPO) ratios; the reference's log-probs (beta > 0) computed on the ring's
shards and gathered equal the whole rows'. The ring's layout is torch's own (its `context_parallel`
shards a buffer, its `context_parallel_unshard` restores one: both compared here). The attention across slices
(DeepSpeed's Ulysses, torch's ring) runs for real in tests/e2e/test_grpo.py."""

from __future__ import annotations

import io
import multiprocessing
import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn
from transformers import PretrainedConfig

from hftrain.data import IGNORE_INDEX
from hftrain.objectives.reference import FrozenReference
from hftrain.parallel.context import RingSlices
from hftrain.parallel.sequence import SequenceSlices
from hftrain.rl.grpo import GRPOLoss, ReferenceTokenLogProbs, reference_token_log_probs
from hftrain.rl.loss import LOSS_TYPES

VOCAB, SP = 11, 2
# every loss_type with token-level ratios; sequence-level (GSPO) ratios, each a completion's mean over its slices
CASES = [(loss_type, "token") for loss_type in LOSS_TYPES] + [("dapo", "sequence"), ("grpo", "sequence"),
                                                               ("cispo", "sequence"), ("sapo", "sequence")]
LAYOUTS = ("sp", "cp")


class TokenWise(nn.Module):
    """A causal LM whose logits at a position depend on that position's token only."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(VOCAB, 6), nn.Linear(6, VOCAB)
        self.config = PretrainedConfig()

    def forward(self, input_ids, position_ids=None, use_cache=False):
        return SimpleNamespace(logits=self.head(torch.tanh(self.embed(input_ids))))


def micro_batch():
    """3 rows of 7 (prompt, completion, right padding): 21 positions, cut 11 + 10 (the second slice padded by one)
    inside the second completion (its tokens predicted from positions 8-12); row 2's last completion token untrained
    (a tool result's)."""
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(1, VOCAB, (3, 7), generator=g)
    labels = torch.full((3, 7), IGNORE_INDEX)
    for row, (start, end) in enumerate([(2, 5), (2, 7), (1, 6)]):
        labels[row, start:end] = input_ids[row, start:end]
        input_ids[row, end:] = 0
    labels[2, 5] = IGNORE_INDEX
    return {"input_ids": input_ids, "labels": labels, "advantages": torch.tensor([0.7, -1.3, 0.4]),
            "old_logps": -2.5 + 0.3 * torch.randn(3, 6, generator=g),
            "ref_logps": -2.4 + 0.3 * torch.randn(3, 6, generator=g)}


def worker(rank: int, init: str, results) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=SP)
    try:
        buffer = io.BytesIO()  # as bytes: a tensor sent as such is a shared-memory handle gone with the process
        torch.save(compare(rank), buffer)
        results.put((rank, buffer.getvalue()))
    except Exception as exc:  # the test fails with the worker's error, not a queue timeout
        results.put((rank, repr(exc)))
    finally:
        dist.destroy_process_group()


def ring_layout(rank: int) -> dict:
    """RingSlices' shard and gather of a [3, 7] tensor next to torch's context_parallel (which pads nothing: it gets
    the row padded to 8 as the ring's micro-batch has it) and context_parallel_unshard."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import context_parallel_unshard

    # (context_parallel_unshard: torch 2.13 exports it from _attention only)
    slices, mesh = RingSlices(dist.group.WORLD, SP, rank), init_device_mesh("cpu", (SP,))
    rows = torch.arange(21.0).reshape(3, 7)
    buffer = torch.nn.functional.pad(rows, (0, 1), value=-1.0)
    with context_parallel(mesh, buffers=[buffer], buffer_seq_dims=[1], no_restore_buffers={buffer}):
        torch_shard = buffer.clone()
        torch_whole = context_parallel_unshard(mesh, [torch_shard], [1])[0]
    mine = slices.local(rows, fill=-1.0)
    # the reference's per-token log-probs (beta > 0) on this rank's shards, gathered, against the whole rows': the
    # frozen copy's module (FrozenReference) and the computation an adapter-off reference runs
    torch.manual_seed(0)
    lm, ids = TokenWise(), micro_batch()["input_ids"]
    frozen = FrozenReference(ReferenceTokenLogProbs(lm, 0.8), torch.device("cpu"))
    return {"shard": (torch_shard, mine), "whole": (torch_whole[:, :7], slices.gather(mine, 3, 7), rows),
            "positions": slices.positions(3, 7, "cpu"),
            "reference": (frozen.log_probs(ids), frozen.log_probs(ids, slices),
                          reference_token_log_probs(0.8)(lm, ids, slices))}


def compare(rank: int) -> dict:
    """Each layout's and loss_type's whole-rows and sliced results on this rank."""
    out = {"ring": ring_layout(rank)}
    for layout in LAYOUTS:
        slices = (SequenceSlices if layout == "sp" else RingSlices)(dist.group.WORLD, SP, rank)
        out.update(compare_losses(slices, layout))
    return out


def compare_losses(slices, layout: str) -> dict:
    out = {}
    for loss_type, level in CASES:
        torch.manual_seed(0)
        lm = TokenWise()
        recipe = SimpleNamespace(loss_type=loss_type, epsilon=0.1, epsilon_high=0.3, beta=0.5,
                                 importance_sampling_level=level, max_completion_length=6, temperature=0.8,
                                 sapo_temperature_pos=0.9, sapo_temperature_neg=1.3, advantage_estimator="grpo")
        loss_fn = GRPOLoss(lm, recipe, reference=None)
        batch = micro_batch()
        whole = loss_fn(**batch)
        whole.backward()
        grads = [p.grad.clone() for p in lm.parameters()]
        whole_sums = loss_fn.pop_sums()
        lm.zero_grad()
        sliced = loss_fn.sliced_forward(slices, **batch)
        sliced.backward()
        mean = []
        for p in lm.parameters():  # the strategy's mean over the group's processes
            dist.all_reduce(p.grad)
            mean.append(p.grad / SP)
        sliced_sums = loss_fn.pop_sums()
        loss_fn.collecting = True
        with torch.no_grad():
            logps, gathered = loss_fn(**batch), loss_fn.sliced_forward(slices, **batch)
        out[layout, loss_type, level] = {"loss": (whole.item(), sliced.item()), "grads": (grads, mean),
                                         "sums": (whole_sums, sliced_sums), "logps": (logps, gathered)}
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    init = f"file://{tmp_path_factory.mktemp('pg') / 'store'}"
    processes = [context.Process(target=worker, args=(rank, init, results)) for rank in range(SP)]
    for process in processes:
        process.start()
    found = dict(results.get(timeout=120) for _ in processes)
    assert not any(isinstance(out, str) for out in found.values()), found
    found = {rank: torch.load(io.BytesIO(out)) for rank, out in found.items()}
    for process in processes:
        process.join(timeout=60)
        assert process.exitcode == 0
    return [found[rank] for rank in range(SP)]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", CASES, ids=[f"{loss_type}-{level}" for loss_type, level in CASES])
def test_sliced_loss_equals_the_whole_rows(ranks, layout, case):
    for out in ranks:
        r = out[(layout, *case)]
        whole, sliced = r["loss"]
        assert sliced == pytest.approx(whole, rel=1e-6, abs=1e-7)
        for a, b in zip(*r["grads"], strict=True):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
        whole_sums, sliced_sums = r["sums"]
        assert sorted(whole_sums) == sorted(sliced_sums) and "kl" in whole_sums
        for name in whole_sums:
            torch.testing.assert_close(sliced_sums[name], whole_sums[name], rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(r["logps"][1], r["logps"][0], rtol=1e-6, atol=1e-7)


def test_ring_slices_lay_rows_out_as_torch_context_parallel_does(ranks):
    """Head-tail chunks of the row padded to 2 x cp (the fill -1 and the positions' repeated last one on rank 0's
    tail), gathered back whole; the same shards torch's context_parallel cuts, the same rows its unshard restores."""
    for rank, out in enumerate(ranks):
        torch_shard, mine = out["ring"]["shard"]
        torch.testing.assert_close(mine, torch_shard, rtol=0, atol=0)
        torch_whole, gathered, rows = out["ring"]["whole"]
        torch.testing.assert_close(gathered, rows, rtol=0, atol=0)
        torch.testing.assert_close(torch_whole, rows, rtol=0, atol=0)
        expected = [[0, 1, 6, 6], [2, 3, 4, 5]][rank]
        assert out["ring"]["positions"].tolist() == [expected] * 3
    assert ranks[0]["ring"]["shard"][1][0].tolist() == [0.0, 1.0, 6.0, -1.0]


def test_the_reference_sharded_over_the_ring_equals_the_whole_rows(ranks):
    for out in ranks:
        whole, frozen, adapter_off = out["ring"]["reference"]
        assert whole.shape == (3, 6)
        torch.testing.assert_close(frozen, whole, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(adapter_off, whole, rtol=1e-6, atol=1e-7)
