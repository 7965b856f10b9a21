"""preflight.py: every machine, launch and model problem of a run, reported together before any heavy work."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from hftrain.config import Recipe
from hftrain.errors import ConfigError
from hftrain.model import LIGER_MODEL_TYPES
from hftrain.parallel.launch import Launch
from hftrain.parallel.pipeline import pipeline_problems
from hftrain.preflight import (
    context_parallel_problems,
    fsdp2_tp_shard_problems,
    host_memory_problems,
    launch_problems,
    liger_problems,
    machine_problems,
    model_problems,
    preflight,
    quantization_problems,
    sequence_parallel_problems,
    tensor_parallel_problems,
)
from hftrain.stages import resume_layout_problem
from tests.conftest import REPO
from tests.unit.test_model import tiny_config_kwargs


@pytest.fixture(autouse=True)
def a_transformers_with_every_feature(monkeypatch):
    """These tests check the layout rules, which do not depend on the transformers installed; on one older than a
    feature needs (the lower end, make test-lower) the preflight refuses that feature first (tests/unit/test_versions.py
    checks that refusal)."""
    import hftrain.preflight

    monkeypatch.setattr(hftrain.preflight, "feature_problem", lambda key: None)

MODEL = REPO / "models" / "tiny-llama"
ONE = Launch("single", 1, 1)


def machine(recipe: Recipe, cuda_available: bool) -> list[str]:
    """The machine's problems with a recipe on one process (Liger's rules included)."""
    return machine_problems(recipe, cuda_available) + liger_problems(recipe, cuda_available, ONE, None)


def deepspeed(stage: int, world: int = 2, **config) -> Launch:
    ds = {"zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True}, **config}
    return Launch("deepspeed", world, world, deepspeed_config_path="ds.json", deepspeed_config=ds)


def qlora(**values) -> Recipe:
    return Recipe(model_name_or_path=str(MODEL), use_peft=True, lora_r=4, lora_alpha=8, **values)


# ---------------------------------------------------------------------------------------------------- machine
def test_fp16_refused_without_cuda():
    problems = machine(Recipe(fp16=True), cuda_available=False)
    assert len(problems) == 1 and "fp16" in problems[0] and "CUDA" in problems[0]
    assert machine(Recipe(fp16=True), cuda_available=True) == []
    assert machine(Recipe(bf16=True), cuda_available=False) == []


@pytest.fixture
def packages(monkeypatch):
    """Pretend exactly the named optional packages are installed (the others keep their real answer)."""
    import importlib.util

    real = importlib.util.find_spec
    present: set[str] = set()
    missing: set[str] = set()

    def find_spec(name, *args, **kwargs):
        if name in present:
            return importlib.machinery.ModuleSpec(name, None)
        if name in missing:
            return None
        return real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)

    def set_packages(installed=(), absent=()):
        present.clear()
        missing.clear()
        present.update(installed)
        missing.update(absent)

    return set_packages


def test_torch_compile_on_cpu_needs_the_compiler_inductor_runs(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-xyz")
    (problem,) = machine(Recipe(torch_compile=True), cuda_available=False)
    assert problem.startswith("torch_compile on CPU needs a C++ compiler") and "no-such-compiler-xyz" in problem
    assert machine(Recipe(torch_compile=True), cuda_available=True) == []  # CUDA kernels are Triton's
    assert machine(Recipe(), cuda_available=False) == []
    monkeypatch.setenv("CXX", sys.executable)  # any executable on the path counts as found
    assert machine(Recipe(torch_compile=True), cuda_available=False) == []


def test_flash_attention_refused_without_cuda(packages):
    packages(installed=["flash_attn"])
    problems = machine(Recipe(attn_implementation="flash_attention_2"), cuda_available=False)
    assert problems == ["attn_implementation=flash_attention_2 needs a CUDA GPU; use sdpa"]
    assert machine(Recipe(attn_implementation="sdpa"), cuda_available=False) == []
    assert machine(Recipe(attn_implementation="flash_attention_2"), cuda_available=True) == []


def test_flash_attention_refused_without_the_flash_attn_package(packages):
    packages(absent=["flash_attn"])
    (problem,) = machine(Recipe(attn_implementation="flash_attention_2"), cuda_available=True)
    assert "flash-attn package, which is not installed" in problem
    assert "pip install flash-attn --no-build-isolation" in problem and "use sdpa" in problem


def test_liger_refused_without_cuda(packages):
    packages(installed=["liger_kernel"])
    (problem,) = machine(Recipe(use_liger_kernel=True), cuda_available=False)
    assert problem.startswith("use_liger_kernel needs a CUDA GPU: Liger's kernels are Triton GPU kernels;")
    assert machine(Recipe(use_liger_kernel=True), cuda_available=True) == []


def test_liger_refused_without_the_liger_kernel_package(packages):
    packages(absent=["liger_kernel"])
    (problem,) = machine(Recipe(use_liger_kernel=True), cuda_available=True)
    assert "liger_kernel package is not installed" in problem
    assert "pip install liger-kernel==0.8.5" in problem and "[cuda]" in problem
    assert machine(Recipe(), cuda_available=True) == []  # off: the package is not needed


def test_the_extras_a_run_needs_are_named_when_missing(packages):
    """deepspeed, bitsandbytes and wandb are extras of hftrain's (pyproject.toml), not default dependencies: a run that
    needs one that is missing is refused before anything starts, naming the setting, the package and the extra."""
    needs = Recipe(model_name_or_path=str(MODEL), use_peft=True, load_in_4bit=True, optim="paged_adamw_8bit",
                   report_to=["wandb"], sp_size=2)
    packages(absent=["deepspeed", "bitsandbytes", "wandb"])
    found = launch_problems(needs, deepspeed(2))
    named = [p for p in found if "which is not installed" in p]
    assert len(named) == 5, found
    for setting, package, extra in (("the DeepSpeed preset", "deepspeed", "deepspeed"),
                                    ("sp_size=2 (DeepSpeed's Ulysses attention)", "deepspeed", "deepspeed"),
                                    ("load_in_4bit", "bitsandbytes", "quantization"),
                                    ("optim=paged_adamw_8bit", "bitsandbytes", "quantization"),
                                    ("report_to: wandb", "wandb", "wandb")):
        said = f"{setting} needs the {package} package, which is not installed: pip install 'hftrain[{extra}]'"
        assert any(p.startswith(said) for p in named), setting
    assert not [p for p in launch_problems(Recipe(model_name_or_path=str(MODEL)), Launch("ddp", 2, 2))
                if "which is not installed" in p]  # a plain run needs none of them
    packages(installed=["deepspeed", "bitsandbytes", "wandb"])
    assert not [p for p in launch_problems(needs, deepspeed(2)) if "which is not installed" in p]


def test_every_machine_problem_reported_at_once(packages):
    """On a CPU machine without the packages: fp16, flash attention (GPU and package) and Liger (GPU and package)."""
    packages(absent=["flash_attn", "liger_kernel"])
    recipe = Recipe(fp16=True, attn_implementation="flash_attention_2", use_liger_kernel=True)
    problems = machine(recipe, cuda_available=False)
    assert len(problems) == 5, problems
    assert sum("flash_attention_2" in p for p in problems) == 2
    assert sum(p.startswith("use_liger_kernel") for p in problems) == 2
    assert any(p.startswith("fp16") for p in problems)


def test_dora_with_8bit_refused_on_cpu_only():
    r = qlora(use_dora=True, load_in_8bit=True)
    (problem,) = machine(r, cuda_available=False)
    assert "use_dora with load_in_8bit fails on CPU" in problem
    assert machine(r, cuda_available=True) == []
    assert machine(qlora(use_dora=True, load_in_4bit=True), cuda_available=False) == []


# ----------------------------------------------------------------------------------------------------- launch
FSDP2 = Launch("fsdp2", 2, 2)


@pytest.mark.parametrize("launch, values, expected", [
    (deepspeed(3), {"load_in_4bit": True}, "load_in_4bit with DeepSpeed ZeRO-3 is refused"),
    (deepspeed(3), {"load_in_8bit": True}, "load_in_8bit with DeepSpeed ZeRO-3 is refused"),
    (FSDP2, {"load_in_8bit": True}, "load_in_8bit with FSDP is refused"),
    (FSDP2, {"load_in_4bit": True}, "set bnb_4bit_quant_storage: float32"),
    (FSDP2, {"load_in_4bit": True, "dtype": "bfloat16", "bnb_4bit_quant_storage": "float32"},
     "bnb_4bit_quant_storage=float32 and dtype=bfloat16: set bnb_4bit_quant_storage: bfloat16"),
])
def test_quantized_launch_refusals(launch, values, expected):
    (problem,) = quantization_problems(qlora(**values), launch)
    assert expected in problem


@pytest.mark.parametrize("launch, values", [
    (deepspeed(2), {"load_in_4bit": True}),  # QLoRA + ZeRO-2: the 4-bit base is frozen, not partitioned
    (deepspeed(3), {}),  # LoRA without quantization under ZeRO-3
    (FSDP2, {"load_in_4bit": True, "dtype": "bfloat16", "bnb_4bit_quant_storage": "bfloat16"}),
    (Launch("ddp", 2, 2), {"load_in_4bit": True}),
    (Launch("ddp", 2, 2), {"load_in_8bit": True}),
    (ONE, {"load_in_8bit": True}),
])
def test_quantized_launches_allowed(launch, values):
    assert quantization_problems(qlora(**values), launch) == []


@pytest.mark.parametrize("launch, tp, expected", [
    (deepspeed(2, world=4), 2, "tp_size=2 with a DEEPSPEED preset: tensor parallelism combined with DeepSpeed"),
    (ONE, 2, "tp_size=2 needs tp_size (or a multiple of it) processes on a DDP-type preset"),
    (Launch("ddp", 3, 3), 2, "tp_size=2 does not divide the 3 processes of this launch"),
    # FSDP2 x TP: a whole number of TP groups, at least two of them (the fsdp dimension)
    (Launch("fsdp2", 2, 2), 2, "needs a multiple of tp_size processes, at least 4; this launch is 2"),
    (Launch("fsdp2", 6, 6), 4, "needs a multiple of tp_size processes, at least 8; this launch is 6"),
])
def test_tensor_parallel_layouts_hftrain_does_not_run_are_refused(launch, tp, expected):
    (problem,) = tensor_parallel_problems(Recipe(tp_size=tp), launch)
    assert expected in problem
    assert tensor_parallel_problems(Recipe(tp_size=2), Launch("ddp", 4, 4)) == []


@pytest.mark.parametrize("launch", [Launch("fsdp2", 4, 4), Launch("fsdp2", 8, 8), Launch("fsdp2", 16, 8)])
def test_fsdp2_x_tensor_parallel_is_allowed_with_two_or_more_data_parallel_shards(launch):
    assert tensor_parallel_problems(Recipe(tp_size=2), launch) == []


@pytest.mark.parametrize("values, expected", [
    ({"fp16": True}, "fp16 with tp_size=2 under FSDP2: transformers' FSDP2 x TP mixed precision is bf16 only"),
    ({"objective": "dpo"}, "objective dpo with tp_size=2 under FSDP2 is refused"),
    # grpo runs under cp alone; tp x cp (FSDP2 x TP underneath) stays refused for it
    ({"objective": "grpo", "cp_size": 2}, "objective grpo with tp_size=2 under FSDP2 is refused"),
])
def test_fsdp2_x_tensor_parallel_refuses_what_it_does_not_run(values, expected):
    (problem,) = tensor_parallel_problems(Recipe(tp_size=2, **values), Launch("fsdp2", 4, 4))
    assert expected in problem


def test_fsdp2_x_tp_refuses_a_dimension_its_loader_and_fsdp2_would_cut_differently():
    """The tiny model (753-token vocabulary): fsdp 2 x tp 2 loads (tests/e2e/test_fsdp_tp.py), fsdp 4 x tp 2 would
    fail inside transformers' from_pretrained on ranks 6 and 7 (tests/unit/parallel/test_tensor.py loads it)."""
    from transformers import AutoConfig

    tiny = AutoConfig.from_pretrained(REPO / "models" / "tiny-llama")
    assert fsdp2_tp_shard_problems(Recipe(tp_size=2), Launch("fsdp2", 4, 4), tiny) == []
    (problem,) = fsdp2_tp_shard_problems(Recipe(tp_size=2, cp_size=2), Launch("fsdp2", 8, 8), tiny)
    assert problem.startswith("tp_size=2 x fsdp_size=4 (FSDP2 x TP over 8 processes) cannot load this model: "
                              "vocab_size 753 split over 2 x 4 ranks")
    tiny.vocab_size = 768
    assert fsdp2_tp_shard_problems(Recipe(tp_size=2), Launch("fsdp2", 8, 8), tiny) == []
    assert fsdp2_tp_shard_problems(Recipe(tp_size=2), Launch("ddp", 8, 8), tiny) == []  # no FSDP2: nothing to cut


def test_pp_refuses_a_load_the_machines_memory_cannot_hold():
    """A Llama-3.2-1B-shaped model (1.24B parameters: 16 layers of 60.8M, a tied 262.7M embedding). Full fine-tuning
    under pp 2 (1F1B): each stage holds 8 layers, and each process reads them, the embedding and the norms: 0.75B
    parameters, 2.8 GiB in float32, 22.3 GiB for 8 processes. With adapters each process reads the whole model:
    4.6 GiB, 36.8 GiB for 8."""
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True)
    gib = 2**30
    (problem,) = host_memory_problems(Recipe(pp_size=2), Launch("ddp", 8, 8), config, available=16 * gib)
    assert problem.startswith("pp_size=2: each process reads its stages' layers, the embeddings and the head into "
                              "host memory while it loads (0.75B of the model's 1.24B parameters in float32: 2.8 GiB)")
    assert "the 8 processes of this machine need 22.3 GiB at once and 16.0 GiB is available" in problem
    assert host_memory_problems(Recipe(pp_size=2), Launch("ddp", 8, 8), config, available=24 * gib) == []
    (problem,) = host_memory_problems(Recipe(pp_size=2, use_peft=True), Launch("ddp", 8, 8), config,
                                      available=24 * gib)
    assert "reads the whole model (adapters are added over it) into host memory while it loads (1.24B of the " \
           "model's 1.24B parameters in float32: 4.6 GiB), so the 8 processes of this machine need 36.8 GiB" in problem
    # bfloat16 and tp 2: the stage's 0.75B in 2 bytes over 2 ranks, 0.7 GiB per process, 5.6 GiB for the machine
    assert host_memory_problems(Recipe(pp_size=2, tp_size=2, dtype="bfloat16"), Launch("ddp", 16, 8), config,
                                available=6 * gib) == []
    assert host_memory_problems(Recipe(), Launch("ddp", 8, 8), config, available=gib) == []  # not pp: not checked


def llama(layers: int = 4):
    from transformers import LlamaConfig

    return LlamaConfig(num_hidden_layers=layers)


@pytest.mark.parametrize("launch, values", [
    (Launch("fsdp2", 4, 4), {}),  # pp 2 x FSDP2 over 2 ranks per stage
    (Launch("fsdp2", 6, 6), {"pp_schedule": "GPipe"}),  # 3 ranks per stage
    (Launch("fsdp2", 8, 8), {"pp_schedule": "Interleaved1F1B"}),  # two FSDP2 roots per process
    (Launch("fsdp2", 4, 4), {"gradient_checkpointing": True}),
    (Launch("fsdp2", 4, 4), {"use_peft": True}),  # LoRA: the frozen base sharded too, the adapter gathered to save
])
def test_pp_x_fsdp2_is_allowed(launch, values):
    assert pipeline_problems(Recipe(pp_size=2, **values), launch, llama()) == []


@pytest.mark.parametrize("launch, values, expected", [
    (Launch("fsdp2", 8, 8), {"tp_size": 2},
     "and tp_size=2: tensor parallelism inside FSDP2-sharded stages is not built"),
    (Launch("fsdp2", 2, 2), {}, "needs a multiple of pp_size processes, at least 4 (2 data-parallel ranks per stage); "
                                "this launch is 2"),
    (Launch("fsdp2", 5, 5), {}, "needs a multiple of pp_size processes, at least 4"),
    (Launch("fsdp2", 4, 4), {"pp_schedule": "ZBVZeroBubble"}, "and pp_schedule=ZBVZeroBubble: its V puts the first"),
    (Launch("fsdp2", 4, 4), {"pp_schedule": "DualPipeV", "pp_microbatches": 4}, "and pp_schedule=DualPipeV"),
    (Launch("fsdp2", 4, 4), {"use_peft": True, "load_in_4bit": True, "bnb_4bit_quant_storage": "float32"},
     "and QLoRA (load_in_4bit / load_in_8bit): bitsandbytes' quantized weights under torch's fully_shard"),
    (Launch("fsdp2", 4, 4, fsdp_offload=True), {}, "and fsdp_offload_params: true: CPU offload of sharded stages"),
    (deepspeed(2, world=4), {}, "pp_size=2 with a deepspeed preset: hftrain's pipeline runs with data-parallel copies"),
])
def test_pipeline_layouts_hftrain_does_not_run_are_refused(launch, values, expected):
    (problem,) = pipeline_problems(Recipe(pp_size=2, **values), launch, llama())
    assert expected in problem


def test_pipeline_checkpoints_resume_under_pp_x_fsdp2_and_not_under_fsdp2_alone():
    """A pp checkpoint (DCP under HF names, any sharding) resumes under pp with FSDP2 per stage; FSDP2 without pp does
    not read it, and a pp run does not read FSDP2's own sharded files."""
    pp_fsdp2 = {"pp_size": 2, "tp_size": 1, "deepspeed_config": None, "sharded_modules": ["FSDPLlamaDecoderLayer"]}
    assert resume_layout_problem(pp_fsdp2, 2, "FSDP2") is None
    assert resume_layout_problem(pp_fsdp2, 4, None) is None  # pp x DDP copies, another pp_size
    assert resume_layout_problem(pp_fsdp2, 1, None) is None  # one process / DDP: converted (stages.unpipelined)
    assert "this run shards the model with FSDP2" in resume_layout_problem(pp_fsdp2, 1, "FSDP2")
    fsdp2 = {**pp_fsdp2, "pp_size": 1}
    assert "was written with FSDP2 and this run has pp_size=2" in resume_layout_problem(fsdp2, 2, "FSDP2")


@pytest.mark.parametrize("launch, values, expected", [
    (Launch("ddp", 2, 2), {}, "sp_size=2 needs a DeepSpeed preset (cpu_sp on CPU; zero3_sp on GPUs)"),
    (Launch("fsdp2", 2, 2), {}, "this launch is fsdp2. For ring attention under FSDP2 use cp_size"),
    (deepspeed(2, world=3), {}, "sp_size=2 does not divide the 3 processes of this launch"),
    (deepspeed(2), {"attn_implementation": "eager"}, "DeepSpeed's Ulysses refuses eager attention"),
    (deepspeed(2), {"sp_size": 8}, "sp_size=8 cannot split this model's 4 attention heads (4 key/value heads)"),
])
def test_sequence_parallel_layouts_that_cannot_work_are_refused(launch, values, expected):
    config = model_problems(Recipe(model_name_or_path=str(MODEL)))[0]
    world = 8 if values.get("sp_size") == 8 else launch.world
    launch = Launch(launch.kind, world, world, deepspeed_config_path=launch.deepspeed_config_path,
                    deepspeed_config=launch.deepspeed_config)
    (problem,) = sequence_parallel_problems(Recipe(**{"sp_size": 2, **values}), launch, config)
    assert expected in problem
    assert sequence_parallel_problems(Recipe(sp_size=2), deepspeed(2, world=4), config) == []  # sp 2 x dp 2


@pytest.mark.parametrize("launch, values, expected", [
    (deepspeed(2), {}, "cp_size=2 needs an FSDP2 preset (fsdp2_cp)"),
    (Launch("fsdp2", 3, 3), {}, "cp_size=2 does not divide the 3 processes"),
    (Launch("fsdp2", 2, 2), {"attn_implementation": "eager"}, "replaces scaled_dot_product_attention only"),
    (Launch("fsdp2", 2, 2), {"packing": True}, "would attend across packed examples (axolotl #3608)"),
    (Launch("fsdp2", 2, 2, preset_mesh={"dp_replicate": 1, "dp_shard": 1, "tp": 1, "cp": 4}), {},
     "the launch preset's parallelism_config (dp_replicate_size 1, dp_shard_size 1, tp_size 1, cp_size 4) disagrees "
     "with the recipe (cp_size=2)"),
])
def test_context_parallel_layouts_that_cannot_work_are_refused(launch, values, expected):
    config = model_problems(Recipe(model_name_or_path=str(MODEL)))[0]
    problems = context_parallel_problems(Recipe(cp_size=2, **values), launch, config)
    assert len(problems) == 1 and expected in problems[0]


def test_context_parallel_refuses_masks_it_would_drop_and_a_router_loss_it_would_split():
    from transformers import MistralConfig, MixtralConfig

    (problem,) = context_parallel_problems(Recipe(cp_size=2), Launch("fsdp2", 2, 2), MistralConfig(sliding_window=16))
    assert "attention layers are ['sliding_attention']" in problem and "full causal attention" in problem
    (problem,) = context_parallel_problems(Recipe(cp_size=2), Launch("fsdp2", 2, 2), MixtralConfig(sliding_window=None))
    assert "mixture-of-experts router loss" in problem
    assert context_parallel_problems(Recipe(cp_size=2, router_aux_loss_coef=0.0), Launch("fsdp2", 2, 2),
                                     MixtralConfig(sliding_window=None)) == []


def test_a_context_parallel_layout_that_can_work_passes_and_cp_on_a_preset_alone_is_refused():
    config = model_problems(Recipe(model_name_or_path=str(MODEL)))[0]
    assert context_parallel_problems(Recipe(cp_size=2), Launch("fsdp2", 4, 4), config) == []  # cp 2 x dp 2
    mesh = {"dp_replicate": 1, "dp_shard": 2, "tp": 1, "cp": 2}
    (problem,) = context_parallel_problems(Recipe(), Launch("fsdp2", 4, 4, preset_mesh=mesh), config)
    assert "disagrees with the recipe (cp_size=1)" in problem


def test_context_parallel_needs_cuda_where_the_accelerator_is_made():
    """accelerate refuses a ParallelismConfig on a CPU accelerator with a traceback; hftrain says why first."""
    from hftrain.errors import HftrainError
    from hftrain.parallel.launch import make_accelerator, parallelism_config

    assert parallelism_config(Recipe(cp_size=2), Launch("fsdp2", 8, 8)).dp_shard_size == 4
    assert parallelism_config(Recipe(), Launch("fsdp2", 8, 8)) is None
    # tp x cp: hftrain builds the mesh in its backend (accelerate's TP preparation is broken with transformers 5)
    assert parallelism_config(Recipe(cp_size=2, tp_size=2), Launch("fsdp2", 8, 8)) is None
    for recipe in (Recipe(cp_size=2), Recipe(cp_size=2, tp_size=2)):
        with pytest.raises(HftrainError, match="cp_size=2 needs CUDA GPUs"):
            make_accelerator(recipe, Launch("fsdp2", 4, 4))


@pytest.mark.parametrize("launch, expected", [
    (Launch("fsdp2", 6, 6), ["tp_size=2 with cp_size=2 under FSDP2 needs a multiple of tp_size x cp_size = 4 "
                             "processes"]),
    (Launch("fsdp2", 4, 4), []),  # one data-parallel rank: fsdp over its 2 context ranks
    (Launch("fsdp2", 8, 8), []),  # 2 data-parallel ranks
    (Launch("fsdp2", 16, 8), []),
])
def test_tp_x_cp_needs_whole_groups_of_tp_x_cp_processes(launch, expected):
    problems = tensor_parallel_problems(Recipe(tp_size=2, cp_size=2), launch)
    assert [p for p in problems if not any(e in p for e in expected)] == [] and len(problems) == len(expected)
    assert context_parallel_problems(Recipe(cp_size=2, tp_size=2), launch, None) == []  # cp alone divides them


def test_tp_x_cp_needs_an_fsdp2_preset():
    (problem,) = context_parallel_problems(Recipe(cp_size=2, tp_size=2), Launch("ddp", 4, 4), None)
    assert problem.startswith("cp_size=2 needs an FSDP2 preset (fsdp2_cp)")


def test_preset_precision_must_leave_precision_to_the_recipe():
    (problem,) = launch_problems(Recipe(), Launch("single", 1, 1, mixed_precision="bf16"))
    assert "the accelerate preset sets mixed_precision=bf16 but the recipe has bf16=False" in problem
    assert launch_problems(Recipe(bf16=True), Launch("single", 1, 1, mixed_precision="bf16")) == []


def test_a_deepspeed_preset_without_its_json_and_a_contradicting_json_are_refused():
    (problem,) = launch_problems(Recipe(), Launch("deepspeed", 2, 2))
    assert "names no deepspeed_config_file" in problem
    (problem,) = launch_problems(Recipe(gradient_accumulation_steps=2), deepspeed(2, gradient_accumulation_steps=4))
    assert "gradient_accumulation_steps=4 but the recipe gives 2" in problem


# ------------------------------------------------------------------------------------------------------ model
def test_a_missing_model_is_reported_from_its_config(tmp_path):
    config, (problem,) = model_problems(Recipe(model_name_or_path=str(tmp_path)))  # an empty folder
    assert config is None and problem.startswith(f"cannot load model {str(tmp_path)!r}")


def test_max_length_must_fit_the_model():
    config, problems = model_problems(Recipe(model_name_or_path=str(MODEL), max_length=32))
    assert problems == []
    limit = config.max_position_embeddings
    _, (problem,) = model_problems(Recipe(model_name_or_path=str(MODEL), max_length=limit + 1))
    assert f"max_length={limit + 1} is above the model's max_position_embeddings={limit}" in problem


def test_loss_chunking_is_refused_for_models_with_their_own_logit_transform(tmp_path):
    from transformers import Gemma2Config

    Gemma2Config(**tiny_config_kwargs(), head_dim=8, final_logit_softcapping=2.0).save_pretrained(tmp_path)
    _, (problem,) = model_problems(Recipe(model_name_or_path=str(tmp_path), max_length=32, loss_chunk_tokens=8))
    assert "loss_chunk_tokens=8 needs logits that are exactly lm_head" in problem and "'gemma2'" in problem
    assert model_problems(Recipe(model_name_or_path=str(tmp_path), max_length=32))[1] == []  # its own path


def with_saved_quantization(folder: Path, quantization: dict) -> Path:
    """A copy of the tiny model's config whose config.json declares `quantization`."""
    config = json.loads((MODEL / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
    return folder


def test_a_model_folder_that_claims_gguf_quantization_is_refused_before_training(tmp_path):
    # transformers would load it, train it, then refuse save_pretrained ("quantized with gguf and is not
    # serializable"): the converted SmolLM2 folder of older convert_gguf.py versions did exactly this
    folder = str(with_saved_quantization(tmp_path, {"quant_method": "gguf"}))
    for use_peft in (False, True):
        _, (problem,) = model_problems(Recipe(model_name_or_path=folder, max_length=32, use_peft=use_peft))
        assert "quant_method 'gguf'" in problem and "Delete the quantization_config entry" in problem


def test_full_fine_tuning_of_a_model_saved_quantized_is_refused_lora_is_not(tmp_path):
    folder = str(with_saved_quantization(tmp_path, {"quant_method": "bitsandbytes", "load_in_4bit": True}))
    _, (problem,) = model_problems(Recipe(model_name_or_path=folder, max_length=32, use_peft=False))
    assert "was saved quantized (bitsandbytes)" in problem and "use_peft: true" in problem
    assert model_problems(Recipe(model_name_or_path=folder, max_length=32, use_peft=True))[1] == []


# ------------------------------------------------------------------------------------------------------ Liger
def test_liger_is_refused_for_models_without_liger_kernels_or_with_their_own_logit_transform(tmp_path, packages):
    from transformers import AutoConfig, Gemma2Config

    packages(installed=["liger_kernel"])
    gemma = Gemma2Config(**tiny_config_kwargs(), head_dim=8, final_logit_softcapping=2.0)
    (problem,) = liger_problems(Recipe(use_liger_kernel=True), True, ONE, gemma)
    assert "use_liger_kernel" in problem and "'gemma2'" in problem and "set use_liger_kernel: false" in problem
    assert ", ".join(sorted(LIGER_MODEL_TYPES)) in problem
    assert liger_problems(Recipe(use_liger_kernel=True), True, ONE, AutoConfig.from_pretrained(MODEL)) == []


@pytest.mark.parametrize("stage", [2, 3])
def test_liger_is_refused_under_zero3_only(stage, packages):
    """ZeRO-3 gathers a weight only when its module runs; Liger's fused loss reads lm_head.weight directly."""
    packages(installed=["liger_kernel"])
    problems = liger_problems(Recipe(use_liger_kernel=True), True, deepspeed(stage), None)
    assert problems == ([] if stage == 2 else [p for p in problems if p.startswith("use_liger_kernel under ZeRO-3")])
    assert len(problems) == (stage == 3)


def test_liger_with_loss_chunking_is_refused(packages):
    packages(installed=["liger_kernel"])
    (problem,) = liger_problems(Recipe(use_liger_kernel=True, loss_chunk_tokens=8), True, ONE, None)
    assert problem.startswith("use_liger_kernel with loss_chunk_tokens=8")


# ------------------------------------------------------------------------------------------------ all at once
def test_every_problem_of_machine_launch_and_model_comes_in_one_error(monkeypatch, packages):
    packages(absent=["flash_attn"])
    recipe = Recipe(model_name_or_path=str(MODEL), fp16=True, max_length=10**6, tp_size=2,
                    attn_implementation="flash_attention_2")
    with pytest.raises(ConfigError) as info:
        preflight(recipe, Launch("single", 1, 1, mixed_precision="bf16"), cuda=False)
    text = str(info.value)
    assert text.startswith("invalid recipe for this machine and launch, 6 problems:"), text
    for part in ("fp16 needs a CUDA GPU", "flash_attention_2 needs a CUDA GPU", "flash-attn package",
                 "mixed_precision=bf16", "tp_size=2 needs tp_size", "max_length=1000000"):
        assert part in text
    assert preflight(Recipe(model_name_or_path=str(MODEL)), ONE, cuda=False).model_type == "llama"


def test_a_model_that_cannot_be_loaded_is_the_models_problem_not_the_recipes(monkeypatch):
    """Issue 49 (8): a hub model that cannot be loaded read "invalid recipe for this machine and launch, 1 problem:
    (1) cannot load model ...", as if the recipe were wrong for the machine. It comes first, as itself, saying what to
    do; the recipe's own problems for this launch follow under their header."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # as the suite runs: the id is neither local nor cached
    with pytest.raises(ConfigError) as info:
        preflight(Recipe(model_name_or_path="nobody-xyz/not-a-model"), ONE, cuda=False)
    text = str(info.value)
    assert text.startswith("cannot load model 'nobody-xyz/not-a-model': "), text
    assert "invalid recipe" not in text and "check the id" in text and "HF_HUB_OFFLINE" in text
    assert "Give a local folder" in text
    with pytest.raises(ConfigError) as info:
        preflight(Recipe(model_name_or_path="nobody-xyz/not-a-model", fp16=True), ONE, cuda=False)
    text = str(info.value)
    assert text.startswith("cannot load model 'nobody-xyz/not-a-model': "), text
    assert "; invalid recipe for this machine and launch, 1 problem: (1) fp16 needs a CUDA GPU" in text, text
    assert len(info.value.problems) == 2


def test_a_library_outside_its_checked_versions_is_the_environments_problem_not_the_recipes(monkeypatch):
    """Issue 49 (1): a transformers that hftrain's gates refuse read "invalid recipe for this machine and launch":
    it is the installed library's problem and says which install fixes it."""
    from hftrain import compat

    real = compat.installed_version
    monkeypatch.setattr(compat, "installed_version",
                        lambda library: "5.99.0" if library == "transformers" else real(library))
    compat.within.cache_clear()
    try:
        with pytest.raises(ConfigError) as info:
            preflight(Recipe(model_name_or_path=str(REPO / "models" / "tiny-llama")), ONE, cuda=False)
    finally:
        compat.within.cache_clear()
    text = str(info.value)
    assert text.startswith("loading a model (the checkpoint-name conversions it keeps) relies on transformers"), text
    assert "invalid recipe" not in text and "transformers 5.99.0 is installed: pip install 'transformers>=" in text


def test_sequence_parallel_refuses_a_router_loss_before_the_weights_load():
    from transformers import MixtralConfig

    moe = MixtralConfig(num_attention_heads=4, num_key_value_heads=2, sliding_window=None)
    (problem,) = sequence_parallel_problems(Recipe(sp_size=2), deepspeed(2), moe)
    assert "sp_size=2 with a mixture-of-experts router loss" in problem
    assert sequence_parallel_problems(Recipe(sp_size=2, router_aux_loss_coef=0.0), deepspeed(2), moe) == []


def test_ulysses_splits_heads_as_deepspeed_needs():
    from hftrain.estimate import ulysses_splits

    assert ulysses_splits(8, 2, 2) and ulysses_splits(8, 2, 4) and ulysses_splits(8, 8, 8)  # kv divides or replicates
    assert not ulysses_splits(8, 3, 2) and not ulysses_splits(6, 6, 4)
