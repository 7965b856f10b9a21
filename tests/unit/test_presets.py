"""Every shipped launch preset and DeepSpeed config is parsed and validated (the runnable ones also run:
tests/e2e/test_parallelism.py), and DeepSpeed configs that contradict the recipe are refused."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import yaml

from hftrain.config import PRESET_DIR, SHIPPED, Recipe
from hftrain.parallel.deepspeed import (
    HIDDEN_SIZE_AUTO_KEYS,
    deepspeed_problems,
    fill_deepspeed_config,
    get_key,
    set_key,
)
from hftrain.presets import cpu_twin, device_problems, needs

PRESETS = sorted(PRESET_DIR.glob("*.yaml"))
DS_CONFIGS = sorted((SHIPPED / "ds_configs").glob("*.json"))
PRESET_NAMES = [p.stem for p in PRESETS]
# How each preset is verified (the README table says the same); GPU-only ones are parsed and validated here.
RUN_ON_CPU = {"cpu", "cpu_ddp", "zero2", "zero2_offload", "zero3", "fsdp2", "fsdp2_shard_grad_op",
              "multi_node_ddp", "multi_node_zero3", "tp", "cpu_sp", "fsdp2_cp", "cpu_pp"}
GPU_ONLY = {"single_gpu", "multi_gpu", "zero1", "zero3_offload", "fsdp2_hybrid_multinode", "zero3_sp", "pp",
            "multi_node_3d"}


def test_the_issue_presets_are_shipped():
    wanted = {"cpu", "cpu_ddp", "single_gpu", "multi_gpu", "fsdp2", "fsdp2_shard_grad_op", "fsdp2_hybrid_multinode",
              "zero1", "zero2", "zero3", "zero3_offload", "multi_node_ddp", "multi_node_zero3", "tp", "cpu_sp"}
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
    if preset.stem not in ("cpu", "cpu_ddp"):  # GPU presets name their devices (issue 17 item 5)
        assert config.gpu_ids is not None and re.search(r"^gpu_ids: ", text, re.M), f"{preset.name} names no gpu_ids"
    if str(config.distributed_type).endswith("DEEPSPEED"):
        assert config.mixed_precision is None or "mixed_precision:" not in text, \
            "accelerate refuses mixed_precision next to a deepspeed_config_file"
        ds_file = SHIPPED / config.deepspeed_config["deepspeed_config_file"]
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

    full = load_config_from_file(str(PRESET_DIR / "fsdp2.yaml")).fsdp_config
    grad_op = load_config_from_file(str(PRESET_DIR / "fsdp2_shard_grad_op.yaml")).fsdp_config
    assert full["fsdp_reshard_after_forward"] is True and grad_op["fsdp_reshard_after_forward"] is False
    assert {k: v for k, v in full.items() if k != "fsdp_reshard_after_forward"} == \
        {k: v for k, v in grad_op.items() if k != "fsdp_reshard_after_forward"}


def filled(path: Path, recipe: Recipe, world: int = 1, hidden: int = 64) -> dict:
    config = json.loads(path.read_text())
    fill_deepspeed_config(config, recipe, world)
    for key in ("bf16", "fp16"):  # what accelerate fills from the recipe's precision
        config[key]["enabled"] = getattr(recipe, key)
    for key, size in HIDDEN_SIZE_AUTO_KEYS.items():
        if get_key(config, key) == "auto":
            set_key(config, key, size(hidden))
    return config


@pytest.mark.parametrize("path", DS_CONFIGS, ids=[p.stem for p in DS_CONFIGS])
def test_ds_config_is_valid_for_deepspeed_once_filled_from_the_recipe(path):
    from deepspeed.runtime.config import DeepSpeedConfig

    recipe = Recipe(per_device_train_batch_size=4, gradient_accumulation_steps=3, max_grad_norm=0.0, bf16=True)
    raw = json.loads(path.read_text())
    assert deepspeed_problems(recipe, raw, world=1) == []
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


# ------------------------------------------------------------------------------------- the layout a preset is for
LAYOUT_FIELDS = ("pp_size", "tp_size", "sp_size", "cp_size")


@pytest.mark.parametrize("preset", PRESETS, ids=PRESET_NAMES)
def test_a_preset_written_for_one_layout_declares_it(preset):
    """The presets whose every example command sets a layout field (their own header says what they are for) declare
    it for hftrain (`# hftrain-needs:`), naming a shipped preset of no layout to use without it; no other does."""
    header = preset.read_text().split("\ncompute_environment")[0]
    examples = []  # each example command, with its continuation lines
    for line in header.splitlines():
        if re.match(r"^#\s+(accelerate|hftrain) launch", line):
            examples.append(line)
        elif examples and re.match(r"^#\s{5,}\S|^#\s{3}--", line) and examples[-1].rstrip().endswith("\\"):
            examples[-1] += line
    in_every = [field for field in LAYOUT_FIELDS if examples and all(f"--{field}" in line for line in examples)]
    declared = needs(preset)
    assert (declared[0] if declared else None) == (in_every[0] if in_every else None), preset.name
    if declared:
        instead = PRESET_DIR / f"{declared[1].split()[0]}.yaml"
        assert instead.is_file() and needs(instead) is None


def test_a_gpu_preset_names_its_cpu_twin():
    """The presets for CUDA GPUs declare it (`# hftrain-device: cuda`) with the preset that trains the same layout on
    the CPU, one the tests run; a GPU machine sees no refusal."""
    declared = {p.stem: cpu_twin(p) for p in PRESETS if cpu_twin(p)}
    assert declared == {"single_gpu": "cpu", "multi_gpu": "cpu_ddp", "pp": "cpu_pp", "zero3_sp": "cpu_sp"}
    assert set(declared.values()) <= RUN_ON_CPU
    assert all(cpu_twin(PRESET_DIR / f"{twin}.yaml") is None for twin in declared.values())
    never = lambda: pytest.fail("a preset of any device asked whether CUDA is there")  # noqa: E731
    assert device_problems(PRESET_DIR / "cpu_ddp.yaml", never, never) == []
    assert device_problems(PRESET_DIR / "multi_gpu.yaml", lambda: True, never) == []


def test_a_recipe_without_the_presets_layout_is_refused(tmp_path, monkeypatch):
    """`--preset cpu_pp` without `--pp_size` trained plain DDP: `hftrain launch` now refuses it before starting any
    process, and a recipe whose launch_preset is cpu_pp refuses a pp_size of 1."""
    from hftrain import cli
    from hftrain.config import recipe_from_dict
    from hftrain.errors import ConfigError
    from hftrain.presets import layout_problems

    (problem,) = layout_problems(PRESET_DIR / "cpu_pp.yaml", Recipe())
    assert "cpu_pp is for pipeline parallelism (pp_size > 1) but the recipe has pp_size=1" in problem
    assert "--preset cpu_ddp" in problem
    assert layout_problems(PRESET_DIR / "cpu_pp.yaml", Recipe(pp_size=2)) == []
    assert layout_problems(PRESET_DIR / "cpu_ddp.yaml", Recipe()) == []
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="launch preset cpu_sp is for sequence parallelism"):
        recipe_from_dict({"launch_preset": "cpu_sp"})
    assert recipe_from_dict({"launch_preset": "cpu_sp", "sp_size": 2}).sp_size == 2

    started = []
    monkeypatch.setattr(cli, "run_launcher", lambda cmd: started.append(cmd) or 0)
    with pytest.raises(SystemExit) as info:
        cli.main(["launch", "--preset", "cpu_pp", "--max_steps", "1"])
    assert info.value.code == 2 and started == []


# ------------------------------------------------------------------------------------- a recipe's stated reason
RECIPES = sorted((SHIPPED / "recipes").glob("*.yaml"))
STATED_SIZE = re.compile(r"(\d+(?:\.\d+)?)M[- ]parameter")  # "0.18M parameters", "0.52M-parameter teacher"


def parameters(folder: Path, objective: str) -> int:
    """The model a recipe trains, as transformers loads it for that objective (reward, reranker: a one-score classifier;
    embedding: the body, AutoModel)."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(folder)
    if objective in ("reward", "reranker"):
        auto = transformers.AutoModelForSequenceClassification
        config.num_labels = 1
    elif objective == "embedding":
        auto = transformers.AutoModel
    elif hasattr(config, "vision_config"):
        auto = transformers.AutoModelForImageTextToText
    else:
        auto = transformers.AutoModelForCausalLM
    return sum(p.numel() for p in auto.from_config(config).parameters())


@pytest.mark.parametrize("recipe", [r for r in RECIPES if "launch_preset_reason" in r.read_text()],
                         ids=lambda path: path.stem)
def test_the_sizes_a_recipes_preset_reason_states_are_its_models(recipe):
    """The start-up line prints a recipe's launch_preset_reason ("the recipe is sized for preset cpu: 0.18M
    parameters ..."): the sizes it states are those of the shipped models it names (the student, then the teacher),
    to two decimals in millions."""
    values = yaml.safe_load(recipe.read_text())
    models = [SHIPPED / values[key] for key in ("model_name_or_path", "teacher_model_name_or_path")
              if key in values and (SHIPPED / values[key] / "config.json").is_file()]
    if not models:
        pytest.skip(f"{values['model_name_or_path']} is not a shipped model folder (a hub id or another run's output)")
    stated = [float(size) for size in STATED_SIZE.findall(values["launch_preset_reason"])]
    counted = [round(parameters(folder, values.get("objective", "sft")) / 1e6, 2) for folder in models]
    assert stated == counted, values["launch_preset_reason"]
