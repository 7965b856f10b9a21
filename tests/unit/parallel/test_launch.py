"""parallel/launch.py: what `accelerate launch` passed on, read once; collective timeouts named by rank and phase."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from hftrain.errors import ConfigError, HftrainError
from hftrain.parallel.launch import Launch, devices_record, phase, shared_devices
from hftrain.preflight import gpu_count_problems


def test_launch_reads_what_accelerate_launch_passes(tmp_path):
    assert Launch.from_environ({}) == Launch("single", 1, 1)
    assert Launch.from_environ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}) == Launch("ddp", 4, 2)
    fsdp = Launch.from_environ({"ACCELERATE_USE_FSDP": "true", "WORLD_SIZE": "2",
                                "ACCELERATE_MIXED_PRECISION": "bf16"})
    assert (fsdp.kind, fsdp.world, fsdp.mixed_precision, fsdp.zero_stage) == ("fsdp2", 2, "bf16", None)
    assert not fsdp.fsdp_offload
    assert Launch.from_environ({"ACCELERATE_USE_FSDP": "true", "FSDP_OFFLOAD_PARAMS": "true"}).fsdp_offload
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


def test_two_processes_on_one_gpu_are_refused_and_cpu_processes_are_not():
    gpu = {"device": "cuda:0", "type": "cuda", "host": "node-a", "index": 0, "name": "NVIDIA H100", "uuid": "GPU-1"}
    ok = [{**gpu, "rank": 0}, {**gpu, "rank": 1, "device": "cuda:1", "index": 1, "uuid": "GPU-2"},
          {**gpu, "rank": 2, "host": "node-b"}]  # another host: another GPU
    assert shared_devices(ok) == []
    same = [{**gpu, "rank": 0}, {**gpu, "rank": 1, "index": 1}]  # renumbered by CUDA_VISIBLE_DEVICES, same UUID
    (problem,) = shared_devices(same)
    assert "ranks 0 and 1 would both train on GPU 1 (NVIDIA H100, GPU-1) of host node-a" in problem
    cpu = [{"device": "cpu", "type": "cpu", "host": "h", "rank": r, "uuid": None} for r in range(4)]
    assert shared_devices(cpu) == []


def test_more_processes_per_machine_than_visible_gpus_are_refused():
    assert gpu_count_problems(Launch("ddp", 8, 8), gpus=8) == []
    assert gpu_count_problems(Launch("ddp", 16, 8), gpus=8) == []  # two machines of 8
    assert gpu_count_problems(Launch("ddp", 4, 4), gpus=0) == []  # CPU: gloo processes
    (problem,) = gpu_count_problems(Launch("ddp", 8, 8), gpus=4)
    assert "starts 8 processes per machine but this machine shows 4 GPU(s)" in problem


def test_the_run_records_each_process_device_on_cpu():
    accelerator = SimpleNamespace(process_index=0, local_process_index=0, num_processes=1,
                                  device=torch.device("cpu"))
    record = devices_record(accelerator, environ={"CUDA_VISIBLE_DEVICES": "2,3"})
    assert record["CUDA_VISIBLE_DEVICES"] == "2,3"
    (me,) = record["processes"]
    assert (me["rank"], me["type"], me["uuid"]) == (0, "cpu", None) and me["host"]


def test_a_presets_parallelism_config_is_read_as_accelerate_reads_it(monkeypatch):
    """The sizes hftrain compares with the recipe's cp_size are the ones accelerate's ParallelismConfig would build
    from the same environment (a preset's parallelism_config section, passed on by `accelerate launch`)."""
    from accelerate import ParallelismConfig

    environ = {"ACCELERATE_USE_FSDP": "true", "WORLD_SIZE": "8", "ACCELERATE_USE_PARALLELISM_CONFIG": "true",
               "PARALLELISM_CONFIG_DP_SHARD_SIZE": "4", "PARALLELISM_CONFIG_CP_SIZE": "2"}
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    accelerate_reads = ParallelismConfig()
    mesh = Launch.from_environ(environ).preset_mesh
    assert mesh == {name: getattr(accelerate_reads, f"{name}_size") for name in mesh}
    assert sorted(mesh) == ["cp", "dp_replicate", "dp_shard", "tp"]
    assert mesh["cp"] == 2 and mesh["dp_shard"] == 4
    del environ["ACCELERATE_USE_PARALLELISM_CONFIG"]  # no parallelism_config section: nothing to compare
    assert Launch.from_environ(environ).preset_mesh is None
