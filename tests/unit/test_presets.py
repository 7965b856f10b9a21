"""Every shipped launch preset and DeepSpeed config is parsed and validated (the runnable ones also run:
tests/e2e/test_parallelism.py), and DeepSpeed configs that contradict the recipe are refused."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

from hftrain import strategy
from hftrain.config import Recipe

REPO = Path(__file__).resolve().parents[2]
PRESETS = sorted((REPO / "accelerate_configs").glob("*.yaml"))
DS_CONFIGS = sorted((REPO / "ds_configs").glob("*.json"))
PRESET_NAMES = [p.stem for p in PRESETS]
# How each preset is verified (the README table says the same); GPU-only ones are parsed and validated here.
RUN_ON_CPU = {"cpu", "cpu_ddp", "zero2", "zero2_offload", "zero3", "fsdp2", "fsdp2_shard_grad_op",
              "multi_node_ddp", "multi_node_zero3", "tp"}
GPU_ONLY = {"single_gpu", "multi_gpu", "zero1", "zero3_offload", "fsdp2_hybrid_multinode"}


def test_the_issue_presets_are_shipped():
    wanted = {"cpu", "cpu_ddp", "single_gpu", "multi_gpu", "fsdp2", "fsdp2_shard_grad_op", "fsdp2_hybrid_multinode",
              "zero1", "zero2", "zero3", "zero3_offload", "multi_node_ddp", "multi_node_zero3", "tp"}
    assert wanted <= set(PRESET_NAMES)
    assert {p.stem for p in DS_CONFIGS} == {"zero1", "zero2", "zero2_offload", "zero3", "zero3_offload"}
    assert set(PRESET_NAMES) == RUN_ON_CPU | GPU_ONLY, "every preset is either run on CPU or listed as GPU-only"


@pytest.mark.parametrize("preset", PRESETS, ids=PRESET_NAMES)
def test_preset_parses_and_starts_with_its_launch_command(preset):
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(preset))  # accelerate's own parser (unknown keys raise)
    text = preset.read_text()
    header = text.split("\ncompute_environment")[0]
    assert all(line.startswith("#") for line in header.splitlines()), "the comment block comes first"
    assert re.search(rf"^#\s+accelerate launch --config_file accelerate_configs/{preset.stem}\.yaml ", header, re.M)
    assert config.num_processes >= 1 and config.num_machines >= 1
    if config.num_machines > 1:
        assert config.num_processes % config.num_machines == 0
    if str(config.distributed_type).endswith("DEEPSPEED"):
        assert config.mixed_precision is None or "mixed_precision:" not in text, \
            "accelerate refuses mixed_precision next to a deepspeed_config_file"
        ds_file = REPO / config.deepspeed_config["deepspeed_config_file"]
        assert ds_file.exists(), f"{preset.name} points at a missing {ds_file}"
        assert set(config.deepspeed_config) <= {"deepspeed_config_file", "zero3_init_flag",
                                                "deepspeed_multinode_launcher"}
        if config.num_machines > 1:  # torchrun on every node: no pdsh / hostfile needed (works under srun)
            assert config.deepspeed_config["deepspeed_multinode_launcher"] == "standard"
    else:
        assert config.mixed_precision == "no", "precision belongs to the recipe"
    if str(config.distributed_type).endswith("FSDP"):
        fsdp = config.fsdp_config
        assert fsdp["fsdp_version"] == 2 and fsdp["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
        assert fsdp["fsdp_state_dict_type"] == "SHARDED_STATE_DICT"
        parallel = config.parallelism_config
        if parallel:
            sizes = [parallel[f"parallelism_config_{k}_size"] for k in ("dp_replicate", "dp_shard", "tp", "cp")]
            assert sizes[0] * sizes[1] * sizes[2] * sizes[3] == config.num_processes
            assert sizes[0] == config.num_machines, "HYBRID_SHARD replicates across nodes"


def test_fsdp2_presets_differ_only_in_their_sharding():
    from accelerate.commands.config.config_args import load_config_from_file

    full = load_config_from_file(str(REPO / "accelerate_configs" / "fsdp2.yaml")).fsdp_config
    grad_op = load_config_from_file(str(REPO / "accelerate_configs" / "fsdp2_shard_grad_op.yaml")).fsdp_config
    assert full["fsdp_reshard_after_forward"] is True and grad_op["fsdp_reshard_after_forward"] is False
    assert {k: v for k, v in full.items() if k != "fsdp_reshard_after_forward"} == \
        {k: v for k, v in grad_op.items() if k != "fsdp_reshard_after_forward"}


def filled(path: Path, recipe: Recipe, world: int = 1, hidden: int = 64) -> dict:
    config = json.loads(path.read_text())
    strategy.fill_deepspeed_config(config, recipe, world)
    for key in ("bf16", "fp16"):  # what accelerate fills from the recipe's precision
        config[key]["enabled"] = getattr(recipe, key)
    for key, size in strategy.HIDDEN_SIZE_AUTO_KEYS.items():
        if strategy._get(config, key) == "auto":
            strategy._set(config, key, size(hidden))
    return config


@pytest.mark.parametrize("path", DS_CONFIGS, ids=[p.stem for p in DS_CONFIGS])
def test_ds_config_is_valid_for_deepspeed_once_filled_from_the_recipe(path):
    from deepspeed.runtime.config import DeepSpeedConfig

    recipe = Recipe(per_device_train_batch_size=4, gradient_accumulation_steps=3, max_grad_norm=0.0, bf16=True)
    raw = json.loads(path.read_text())
    assert strategy.deepspeed_problems(recipe, raw, world=1) == []
    assert raw["gradient_clipping"] == "auto", "set explicitly: DeepSpeed's default (1.0) differs from the recipe's"
    assert "optimizer" not in raw and "scheduler" not in raw, "the recipe builds the optimizer and schedule"
    config = filled(path, recipe)
    assert "auto" not in json.dumps(config)
    ds = DeepSpeedConfig(copy.deepcopy(config))  # DeepSpeed's validator (rejects unknown zero_optimization keys)
    assert (ds.train_micro_batch_size_per_gpu, ds.gradient_accumulation_steps, ds.train_batch_size) == (4, 3, 12)
    assert ds.gradient_clipping == 0.0  # max_grad_norm=0 reaches DeepSpeed as "no clipping", not its default 1.0
    assert ds.bfloat16_config.enabled and not ds.float16_config.enabled
    assert ds.zero_optimization_stage == int(re.search(r"zero(\d)", path.stem).group(1))
    if "offload" in path.stem:
        assert ds.zero_config.offload_optimizer.device == "cpu"
    if ds.zero_optimization_stage == 3:
        assert ds.zero_config.gather_16bit_weights_on_model_save, "else no consolidated final model"
        assert (ds.zero_config.offload_param is not None) == ("offload" in path.stem)


def test_absent_clipping_and_batch_keys_are_filled_from_the_recipe():
    config = {"zero_optimization": {"stage": 2}}
    strategy.fill_deepspeed_config(config, Recipe(per_device_train_batch_size=2, gradient_accumulation_steps=4,
                                                  max_grad_norm=0.3), world=2)
    assert config == {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 2,
                      "gradient_accumulation_steps": 4, "train_batch_size": 16, "gradient_clipping": 0.3}


def test_a_ds_config_without_zero_optimization_is_refused_before_accelerate_raises():
    assert strategy.deepspeed_problems(Recipe(), {"train_micro_batch_size_per_gpu": "auto"}, world=1) == [
        "the DeepSpeed config has no zero_optimization block; give one with a stage (0-3)"]


def test_contradictions_between_ds_config_and_recipe_are_all_reported():
    recipe = Recipe(per_device_train_batch_size=8, gradient_accumulation_steps=2, max_grad_norm=1.0, optim="sgd")
    config = json.loads((REPO / "ds_configs" / "zero3_offload.json").read_text())
    config.update({"gradient_accumulation_steps": 4, "gradient_clipping": 1.0, "train_batch_size": 16,
                   "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}, "bf16": {"enabled": True}})
    config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = False
    config["zero_optimization"]["sub_group_size"] = "auto"
    problems = strategy.deepspeed_problems(recipe, config, world=2)
    text = " | ".join(problems)
    assert "gradient_accumulation_steps=4 but the recipe gives 2" in text
    assert "train_batch_size=16 but the recipe gives 32" in text
    assert "bf16.enabled=True but the recipe gives False" in text
    assert "'optimizer' block" in text
    assert "zero_optimization.sub_group_size" in text and "optimizer.params.lr" in text  # "auto" we do not fill
    assert "stage3_gather_16bit_weights_on_model_save" in text
    assert "optim=sgd" in text  # accelerate would silently swap SGD for DeepSpeedCPUAdam
    assert not any("gradient_clipping" in p for p in problems)  # 1.0 == max_grad_norm: no contradiction
    assert len(problems) == 7


@pytest.mark.parametrize("stage", [2, 3])
def test_liger_is_refused_under_zero3_only(stage):
    """ZeRO-3 gathers a weight only when its module runs; Liger's fused loss reads lm_head.weight directly."""
    config = {"zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True}}
    problems = strategy.deepspeed_problems(Recipe(use_liger_kernel=True), config, world=2)
    assert problems == ([] if stage == 2 else [p for p in problems if p.startswith("use_liger_kernel under ZeRO-3")])
    assert len(problems) == (stage == 3)


class FakeLaunch:
    """What `strategy.data_parallel` reads from the Accelerator."""

    def __init__(self, kind: str, processes: int, index: int = 0):
        self.distributed_type, self.num_processes, self.process_index = f"DistributedType.{kind}", processes, index


@pytest.mark.parametrize("processes, index, expected", [(2, 1, (1, 0)), (4, 1, (2, 0)), (4, 2, (2, 1)), (6, 5, (3, 2))])
def test_tensor_parallel_groups_of_consecutive_ranks_share_one_data_share(processes, index, expected):
    dp = strategy.data_parallel(FakeLaunch("MULTI_CPU", processes, index), Recipe(tp_size=2))
    assert (dp.world, dp.rank, dp.replicas) == (*expected, 2)


@pytest.mark.parametrize("kind, processes, expected", [
    ("DEEPSPEED", 4, "tp_size=2 with a DEEPSPEED preset: tensor parallelism combined with FSDP or DeepSpeed"),
    ("FSDP", 4, "ParallelismConfig, which needs FSDP2 with a sharded data dimension"),
    ("NO", 1, "tp_size=2 needs tp_size (or a multiple of it) processes on a DDP-type preset"),
    ("MULTI_CPU", 3, "tp_size=2 does not divide the 3 processes of this launch"),
])
def test_tensor_parallel_layouts_hftrain_does_not_run_are_refused(kind, processes, expected):
    with pytest.raises(strategy.HftrainError, match=re.escape(expected)):
        strategy.data_parallel(FakeLaunch(kind, processes), Recipe(tp_size=2))


def test_tensor_parallel_copies_keep_transformers_mesh_without_its_fsdp(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    config = strategy.model_load_kwargs(Recipe(tp_size=2))["distributed_config"]
    assert (config.tp_size, config.dp_replicate_size, config.fsdp_size) == (2, 2, 1)  # the mesh covers 4 ranks
    assert config.dp_size == 1  # transformers applies FSDP2 only when dp_size > 1: hftrain averages the copies
    monkeypatch.setenv("WORLD_SIZE", "2")
    config = strategy.model_load_kwargs(Recipe(tp_size=2))["distributed_config"]
    assert (config.tp_size, config.dp_replicate_size, config.dp_size) == (2, 1, 1)
