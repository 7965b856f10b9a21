"""The micro-batch context parallelism shards (parallel/context.py), against the labels a plain causal LM uses."""

import torch

from hftrain.data import IGNORE_INDEX
from hftrain.parallel.context import CPU_SDPA, ring_inputs, ring_kernels


def test_ring_inputs_shift_the_labels_before_sharding_and_pad_to_the_load_balancers_chunks():
    input_ids = torch.tensor([[5, 6, 7, 8, 9], [3, 4, 0, 0, 0]])
    labels = torch.tensor([[-100, 6, 7, 8, 9], [-100, 4, -100, -100, -100]])
    inputs = ring_inputs({"input_ids": input_ids, "labels": labels, "num_examples": torch.tensor(2)}, cp=2)
    assert sorted(inputs) == ["input_ids", "position_ids", "shift_labels"]
    width = inputs["input_ids"].shape[1]
    assert width == 8, "5 positions padded to a multiple of 2 x cp = 4 (torch's head-tail load balancer)"
    assert torch.equal(inputs["input_ids"][:, :5], input_ids)
    # position t predicts token t+1: the shift a causal LM's loss makes, done before any rank sees a chunk
    expected = torch.full((2, width), IGNORE_INDEX)
    expected[:, :4] = labels[:, 1:]
    assert torch.equal(inputs["shift_labels"], expected)
    # the row's own positions, then the last one repeated: the fill never reaches a position the row does not have
    assert inputs["position_ids"].tolist() == [[0, 1, 2, 3, 4, 4, 4, 4]] * 2
    assert all(t.is_contiguous() and t.data_ptr() != input_ids.data_ptr() for t in inputs.values()), \
        "context_parallel resizes its buffers in place: they must be fresh tensors"
    assert ring_inputs({"input_ids": input_ids[:, :4], "labels": labels[:, :4]}, cp=2)["input_ids"].shape[1] == 4


def test_torch_ring_attention_has_no_cpu_kernel_of_its_own():
    """Why the CPU tests need tests/launchers/context_parallel_on_cpu.py: if a torch upgrade ships the CPU entry,
    this fails and the launcher's registration can go."""
    kernels = ring_kernels()
    assert "aten._scaled_dot_product_flash_attention.default" in kernels
    assert CPU_SDPA not in kernels
