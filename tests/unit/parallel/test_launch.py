"""parallel/launch.py: what `accelerate launch` passed on, read once; collective timeouts named by rank and phase."""

from __future__ import annotations

import json

import pytest

from hftrain.errors import ConfigError, HftrainError
from hftrain.parallel.launch import Launch, phase


def test_launch_reads_what_accelerate_launch_passes(tmp_path):
    assert Launch.from_environ({}) == Launch("single", 1, 1)
    assert Launch.from_environ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}) == Launch("ddp", 4, 2)
    fsdp = Launch.from_environ({"ACCELERATE_USE_FSDP": "true", "WORLD_SIZE": "2",
                                "ACCELERATE_MIXED_PRECISION": "bf16"})
    assert (fsdp.kind, fsdp.world, fsdp.mixed_precision, fsdp.zero_stage) == ("fsdp2", 2, "bf16", None)
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 2}, "train_batch_size": "auto"}))
    launch = Launch.from_environ({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(ds)})
    assert (launch.kind, launch.zero_stage, launch.deepspeed_config_path) == ("deepspeed", 2, str(ds))
    assert launch.deepspeed_config == {"zero_optimization": {"stage": 2}, "train_batch_size": "auto"}
    bare = Launch.from_environ({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": "none"})
    assert (bare.kind, bare.deepspeed_config, bare.zero_stage) == ("deepspeed", None, None)


def test_an_unreadable_deepspeed_config_is_a_launch_error(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    environ = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(bad)}
    with pytest.raises(ConfigError, match="is not valid JSON"):
        Launch.from_environ(environ)
    environ["ACCELERATE_DEEPSPEED_CONFIG_FILE"] = str(tmp_path / "missing.json")
    with pytest.raises(ConfigError, match="cannot read the DeepSpeed config"):
        Launch.from_environ(environ)


class FakeAccelerator:
    process_index, num_processes = 1, 2


def test_a_collective_timeout_names_the_rank_and_the_phase():
    step = 7
    with pytest.raises(HftrainError, match=r"rank 1 of 2 timed out after 20s .* during training step 8;"):
        with phase(FakeAccelerator(), lambda: f"training step {step + 1}", 20):
            raise RuntimeError("[../gloo/transport/tcp/pair.cc:534] Timed out waiting 20000ms for recv operation")
    with pytest.raises(RuntimeError, match="out of memory"):  # any other error passes through unchanged
        with phase(FakeAccelerator(), "evaluation", 20):
            raise RuntimeError("out of memory")
