"""parallel/deepspeed.py: the DeepSpeed JSON filled from the recipe or refused where it contradicts it, ZeRO
checkpoints' model keys, and resuming on another process count."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from hftrain.checkpoint import _check_saved_weights
from hftrain.config import Recipe
from hftrain.errors import HftrainError
from hftrain.memory import ModelState, zero, zero_offload_state
from hftrain.model import build_model
from hftrain.objectives.sft import CausalLMTokenLoss
from hftrain.parallel.deepspeed import DeepSpeedBackend, deepspeed_problems, fill_deepspeed_config
from tests.conftest import REPO, free_port
from tests.unit.parallel.conftest import fake_accelerator

MODEL = REPO / "models" / "tiny-llama"


def test_absent_clipping_and_batch_keys_are_filled_from_the_recipe():
    config = {"zero_optimization": {"stage": 2}}
    recipe = Recipe(per_device_train_batch_size=2, gradient_accumulation_steps=4, max_grad_norm=0.3)
    fill_deepspeed_config(config, recipe, world=2)
    assert config == {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 2,
                      "gradient_accumulation_steps": 4, "train_batch_size": 16, "gradient_clipping": 0.3}


def test_a_ds_config_without_zero_optimization_is_refused_before_accelerate_raises():
    assert deepspeed_problems(Recipe(), {"train_micro_batch_size_per_gpu": "auto"}, world=1) == [
        "the DeepSpeed config has no zero_optimization block; give one with a stage (0-3)"]


def test_contradictions_between_ds_config_and_recipe_are_all_reported():
    recipe = Recipe(per_device_train_batch_size=8, gradient_accumulation_steps=2, max_grad_norm=1.0, optim="sgd")
    config = json.loads((REPO / "ds_configs" / "zero3_offload.json").read_text())
    config.update({"gradient_accumulation_steps": 4, "gradient_clipping": 1.0, "train_batch_size": 16,
                   "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}, "bf16": {"enabled": True}})
    config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = False
    config["zero_optimization"]["sub_group_size"] = "auto"
    problems = deepspeed_problems(recipe, config, world=2)
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


def test_zero_offload_gradients_are_where_deepspeed_keeps_them(tmp_path):
    """The memory model of ZeRO-Offload (the start-up line's and the estimate's: `memory.zero`, `zero_offload_state`)
    against DeepSpeed's own engines on 2 processes (zero_offload_buffers.py): with the optimizer offloaded each process
    keeps a gradient partition for its CPU optimizer, at stage 1 too, fp32 at stages 1-2 and in the 16-bit weights'
    dtype at stage 3; the model counts those bytes in CPU memory and none on the device."""
    from tests.unit.parallel.zero_offload_buffers import SIZES

    # an environment of its own: nothing another test of this worker set reaches the two processes
    env = {key: os.environ[key] for key in ("PATH", "HOME", "TMPDIR", "TORCH_EXTENSIONS_DIR") if key in os.environ}
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "unit" / "parallel" / "zero_offload_buffers.py"),
                           str(free_port()), str(tmp_path / "found.json")], capture_output=True, text=True,
                           timeout=600, cwd=REPO, env={**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-6000:])
    found = json.loads((tmp_path / "found.json").read_text())
    params = sum(i * o + o for i, o in SIZES)
    for stage in (1, 2, 3):
        state = zero_offload_state(ModelState.of(params, params, 2, 12), params, stage)  # bf16 weights, AdamW
        placement = zero(stage, 2, ("optimizer",))
        assert placement.per_device(state).gradients == 0
        assert placement.share("gradients", state.gradients) == found[str(stage)]["bytes"], stage
        assert found[str(stage)]["elements"] == params // 2


def test_deepspeed_checkpoints_name_their_keys_in_the_engine_file(tmp_path):
    """DeepSpeed writes its own model file (pytorch_model/*model_states.pt, the module state under 'module'):
    its keys are checked the same way, since hftrain loads it non-strict (the frozen base is not in it)."""
    config = {"zero_optimization": {"stage": 2}}
    backend = DeepSpeedBackend(fake_accelerator(2, kind="DEEPSPEED", deepspeed_config=config), Recipe())
    checkpoints = backend.checkpoints
    assert checkpoints.saved_model_keys(tmp_path) is None  # no model file hftrain can read (FSDP2's sharded layout)
    lora = CausalLMTokenLoss(build_model(Recipe(model_name_or_path=str(MODEL), use_peft=True, lora_r=4)))
    trained = {n: p.detach().clone() for n, p in lora.named_parameters() if p.requires_grad}
    (tmp_path / "pytorch_model").mkdir()
    torch.save({"module": trained, "dp_world_size": 2}, tmp_path / "pytorch_model" / "mp_rank_00_model_states.pt")
    assert backend.checkpoints.saved_model_keys(tmp_path) == set(trained)
    _check_saved_weights(backend, lora, tmp_path)
    full = CausalLMTokenLoss(build_model(Recipe(model_name_or_path=str(MODEL))))
    with pytest.raises(HftrainError, match="another model or fine-tuning method"):
        _check_saved_weights(backend, full, tmp_path)


@pytest.mark.parametrize("optim", ["adamw_torch", "sgd"])
def test_a_zero_checkpoint_of_another_process_count_resumes_with_adam_state_only(optim):
    config = {"zero_optimization": {"stage": 2}}
    backend = DeepSpeedBackend(fake_accelerator(2, kind="DEEPSPEED", deepspeed_config=config), Recipe(optim=optim))
    checkpoints = backend.checkpoints
    checkpoints.check_resumable({"num_processes": 2, "tp_size": 1})  # same count: the engine loads its own partitions
    if optim == "sgd":
        with pytest.raises(HftrainError, match="written by 4 processes and this run has 2.*reads only Adam"):
            backend.checkpoints.check_resumable({"num_processes": 4, "tp_size": 1})
    else:
        backend.checkpoints.check_resumable({"num_processes": 4, "tp_size": 1})  # converted to a universal checkpoint


def test_the_filled_config_is_what_the_run_records_and_the_engine_keeps_frozen_weights_out():
    config = {"zero_optimization": {"stage": 3}, "gradient_clipping": "auto"}
    backend = DeepSpeedBackend(fake_accelerator(2, kind="DEEPSPEED", deepspeed_config=config),
                               Recipe(max_grad_norm=0.5))
    assert backend.config_used() is config and config["gradient_clipping"] == 0.5
    assert backend.checkpoints.save_kwargs() == {"exclude_frozen_parameters": True}
    assert backend.checkpoints.load_kwargs() == {"load_module_strict": False}
