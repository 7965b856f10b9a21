"""parallel/launch.py: what `accelerate launch` passed on, read once; collective timeouts named by rank and phase."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import yaml
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env, prepare_simple_launcher_cmd_env

from hftrain.cli import deepspeed_config_file
from hftrain.config import PRESET_DIR
from hftrain.errors import ConfigError, HftrainError
from hftrain.parallel.launch import (
    Launch,
    devices_record,
    phase,
    quiet_library_notes,
    shared_devices,
    strategy_problems,
    without_deepspeed_build_notes,
)
from hftrain.preflight import gpu_count_problems


def accelerate_environment(preset, *launcher: str) -> dict[str, str]:
    """The environment accelerate 1.15's launcher gives its processes for `preset` (its own parsing and environment
    builders; WORLD_SIZE and LOCAL_WORLD_SIZE are torchrun's: processes in all and per machine)."""

    ds_file = deepspeed_config_file(preset)
    extra = ["--deepspeed_config_file", str(ds_file)] if ds_file else []
    args = launch_command_parser().parse_args(["--config_file", str(preset), *extra, *launcher, "train.py"])
    args, _, _ = _validate_launch_command(args)
    if args.use_deepspeed:
        args.deepspeed_fields_from_accelerate_config = []  # set by launch_command; not read by hftrain
        env = prepare_deepspeed_cmd_env(args)[1]
    elif args.multi_gpu or args.use_fsdp:
        env = prepare_multi_gpu_env(args)
    else:
        env = prepare_simple_launcher_cmd_env(args)[1]
    return {**env, "WORLD_SIZE": str(args.num_processes),
            "LOCAL_WORLD_SIZE": str(args.num_processes // args.num_machines)}


@pytest.mark.parametrize("preset", sorted(PRESET_DIR.glob("*.yaml")), ids=lambda path: path.stem)
def test_a_presets_launch_is_known_before_the_launcher_starts_the_processes(preset):
    """`hftrain launch` checks the launch a preset describes before starting any process: Launch.from_preset gives
    what each process will read from the environment accelerate's launcher gives it, with the command line's
    process and machine counts too."""
    config = yaml.safe_load(preset.read_text())
    ds_file = deepspeed_config_file(preset)
    assert Launch.from_preset(config, str(ds_file) if ds_file else None) == \
        Launch.from_environ(accelerate_environment(preset))
    if config.get("num_machines", 1) == 1 and config.get("distributed_type") != "NO":
        assert Launch.from_preset(config, str(ds_file) if ds_file else None, num_processes=4) == \
            Launch.from_environ(accelerate_environment(preset, "--num_processes", "4"))


def test_a_strategy_accelerate_would_swap_is_known_before_the_launch():
    fsdp, zero = Launch("fsdp2", 2, 2), Launch("deepspeed", 2, 2)
    assert "asks for FSDP but accelerate would select MULTI_CPU" in strategy_problems(fsdp, cuda=False, environ={})[0]
    assert strategy_problems(fsdp, cuda=True, environ={}, gpus=2) == []
    assert strategy_problems(zero, cuda=False, environ={}) == []  # DeepSpeed runs on CPU (gloo)
    assert "unset ACCELERATE_USE_CPU" in strategy_problems(zero, cuda=True, environ={"ACCELERATE_USE_CPU": "true"},
                                                          gpus=2)[0]


def test_more_processes_on_a_machine_than_its_gpus_are_refused_before_the_launch():
    """multi_gpu's default 8 processes on a 4-GPU machine (or 2 machines x 8 with 4 visible on each): each process
    takes the GPU of its local rank, so ranks 4-7 would fail (or share a GPU under NCCL, which refuses it)."""
    one, two = Launch("ddp", 8, 8), Launch("deepspeed", 16, 8)
    (problem,) = strategy_problems(one, cuda=True, environ={}, gpus=4)
    assert problem == ("the launch starts 8 processes on this machine but torch sees 4 CUDA devices here: each "
                       "process needs a GPU of its own; pass --num_processes 4 (the GPUs per machine x machines) or "
                       "make the other GPUs visible")
    (problem,) = strategy_problems(two, cuda=True, environ={"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, gpus=4)
    assert "torch sees 4 CUDA devices here (CUDA_VISIBLE_DEVICES=0,1,2,3)" in problem
    assert "pass --num_processes 8 (the GPUs per machine x machines)" in problem
    assert strategy_problems(one, cuda=True, environ={}, gpus=8) == []
    assert strategy_problems(one, cuda=False, environ={}) == []  # on the CPU: gloo processes, as many as asked


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


def test_only_torchs_deprecation_of_deepspeeds_collectives_is_silenced(monkeypatch, capsys):
    """Issue 49: a training process ignores torch's FutureWarning at all_gather_into_tensor / reduce_scatter_tensor
    (attributed to torch.distributed's own frame), and only it: the same words from another module, another
    torch.distributed deprecation and another category still show. DeepSpeed's op-build line is taken out of what
    its process group's creation prints; every other line stays, in order, also when the block fails."""
    import warnings

    monkeypatch.setattr(warnings, "filters", list(warnings.filters))  # this test's filters only
    quiet_library_notes()
    deprecated = "`torch.distributed.reduce_scatter_tensor` is deprecated. Please use `reduce_scatter_single`."
    with warnings.catch_warnings(record=True) as shown:
        for text, category, module in [
            (deprecated, FutureWarning, "torch.distributed.c10d_logger"),
            (deprecated.replace("reduce_scatter", "all_gather_into"), FutureWarning, "torch.distributed.c10d_logger"),
            (deprecated, FutureWarning, "user_code"),
            ("`torch.distributed.scatter_object_list` is deprecated", FutureWarning, "torch.distributed.c10d_logger"),
            (deprecated, UserWarning, "torch.distributed.c10d_logger"),
        ]:
            warnings.warn_explicit(text, category, "f.py", 1, module=module, registry={})
    assert [(str(w.message)[:40], w.category) for w in shown] == [
        (deprecated[:40], FutureWarning), ("`torch.distributed.scatter_object_list` ", FutureWarning),
        (deprecated[:40], UserWarning)]
    with pytest.raises(RuntimeError), without_deepspeed_build_notes():
        print("before")
        print("DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully")
        print("after: DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully, then something")
        raise RuntimeError("the process group failed")
    assert capsys.readouterr().out == ("before\nafter: DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built "
                                       "successfully, then something\n")


def test_accelerates_deepspeed_launcher_gives_no_threads_where_its_ddp_launcher_does(monkeypatch):
    """Why `hftrain launch` sets OMP_NUM_THREADS for a DeepSpeed preset (cli.launcher_environment): accelerate's
    launcher passes the threads on for DDP, not for DeepSpeed, whose processes torchrun gives 1 with a banner."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the suite's (tests/conftest.py), a user's shell's
    assert "OMP_NUM_THREADS" in accelerate_environment(PRESET_DIR / "cpu_ddp.yaml")
    assert "OMP_NUM_THREADS" not in accelerate_environment(PRESET_DIR / "zero3.yaml")
