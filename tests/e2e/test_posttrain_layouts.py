"""The post-training objectives (kto, orpo, reward, distill) under QLoRA with DeepSpeed ZeRO-2 on 2 processes: each
equals a 1-process QLoRA run with the same global batch, as tests/e2e/test_peft_sharded.py proves for sft. The same
step losses and gradient norms, and the same final adapter (full-size tensors, within test_peft_sharded's
tolerances). Each objective's shipped tiny recipe and data, 3 steps of its own exactness settings (SGD, clipping,
file order; see its own test file)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import Run, launch, run_script
from tests.e2e.test_distill import EXACT as DISTILL
from tests.e2e.test_kto import EXACT as KTO
from tests.e2e.test_orpo import EXACT as ORPO
from tests.e2e.test_reward import EXACT as REWARD_STEPS
from tests.e2e.test_reward import TINY_REWARD

pytestmark = pytest.mark.launch

# lora_dropout 0: ranks draw other dropout masks than one process; no checkpoint before the final one
QLORA = ["--use_peft", "true", "--lora_dropout", "0", "--load_in_4bit", "--bnb_4bit_use_double_quant",
         "--save_steps", "100"]
# objective: (its exactness arguments, rows per optimizer step)
OBJECTIVES = {"kto": (KTO, 8), "orpo": (ORPO, 4), "reward": ([*TINY_REWARD, *REWARD_STEPS], 4),
              "distill": (DISTILL, 4)}


def assert_same_training(run: Run, ref: Run, rtol: float = 1e-4, atol: float = 1e-5) -> None:
    rows, ref_rows = run.train_rows(), ref.train_rows()
    assert [r["step"] for r in rows] == [r["step"] for r in ref_rows] == [1, 2, 3]
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close(torch.tensor([r[key] for r in rows], dtype=torch.float64),
                                   torch.tensor([r[key] for r in ref_rows], dtype=torch.float64), rtol=rtol, atol=0,
                                   msg=key)
    got = load_file(run.output_dir / "final" / "adapter_model.safetensors")
    expected = load_file(ref.output_dir / "final" / "adapter_model.safetensors")
    assert expected and got.keys() == expected.keys()
    assert any(v.abs().max() > 0 for k, v in expected.items() if "lora_B" in k), "untrained: a vacuous comparison"
    for name, value in expected.items():
        assert value.numel() > 0 and got[name].shape == value.shape, name  # full size, not a rank's partition
        torch.testing.assert_close(got[name], value, rtol=rtol, atol=atol, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("objective", sorted(OBJECTIVES))
def test_qlora_under_zero2_equals_one_process(tmp_path, objective):
    args, rows = OBJECTIVES[objective]
    ref = run_script(tmp_path / "one", *args, *QLORA, "--per_device_train_batch_size", str(rows))
    run = launch(tmp_path / "zero2", *args, *QLORA, "--per_device_train_batch_size", str(rows // 2), preset="zero2",
                 processes=2)
    info = run.state()["launch"]
    assert (info["distributed_type"], info["num_processes"], info["backend"]) == ("DEEPSPEED", 2, "gloo")
    assert "Linear4bit" in run.state()["model"]["quantized_linear_layers"]
    assert_same_training(run, ref)
