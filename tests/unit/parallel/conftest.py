"""A stand-in for accelerate's Accelerator with what the backends read from it (no process group needed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch


def fake_accelerator(processes: int = 1, index: int = 0, kind: str = "NO", deepspeed_config: dict | None = None,
                     fsdp_plugin=None) -> SimpleNamespace:
    state = SimpleNamespace(deepspeed_plugin=SimpleNamespace(deepspeed_config=deepspeed_config),
                            fsdp_plugin=fsdp_plugin)
    return SimpleNamespace(num_processes=processes, process_index=index, distributed_type=f"DistributedType.{kind}",
                           device=torch.device("cpu"), mixed_precision="no", state=state, is_main_process=index == 0)


@pytest.fixture
def accelerator():
    return fake_accelerator
