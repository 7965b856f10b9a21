"""qat_scheme through the real entry script: the run trains the fake-quantized model, saves final/ (unconverted) and
final-quantized/ (converted; transformers loads it from its config.json), 2 DDP processes and 2 FSDP2 processes train
the same step as one and convert it to the same int4 weights, and a resumed run continues exactly, to the same
converted model."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from hftrain import qat
from hftrain.config import Recipe
from tests.conftest import FSDP_LAUNCHER, REPO, Run, launch, run_script
from tests.e2e import objective_checks as checks

pytestmark = pytest.mark.launch
# 3 steps of 8 rows in file order, no evaluation, a checkpoint at step 2
EXACT = ["--config", str(REPO / "recipes" / "tiny-qat.yaml"), "--max_steps", "3", "--logging_steps", "1",
         "--train_sampling_strategy", "sequential", "--validation_split_percentage", "0", "--save_steps", "2",
         "--learning_rate", "1e-2", "--warmup_steps", "1"]
# one SGD step (see test_two_ddp_processes_equal_one)
SGD = [*EXACT, "--max_steps", "1", "--optim", "sgd", "--learning_rate", "0.5"]
COMPARED = ("loss", "grad_norm")
GROUP = 32  # the recipes' qat_group_size


def assert_same_conversion(run: Run, expected: Run, trained: dict[str, torch.Tensor], boundary: float = 1e-3) -> int:
    """`run`'s final-quantized/ holds `expected`'s: the same tensors (the full-precision ones and the int4 scales
    within rtol 1e-4), and the same int4 values except, by one level, where the weight `expected` converted
    (`trained`: name -> tensor, before rounding) lies within `boundary` of a rounding step from half-way between two
    levels, where the two runs' last-bit differences may round either way. Returns how many values did."""
    ours = load_file(run.output_dir / qat.QUANTIZED_DIR / "model.safetensors")
    theirs = load_file(expected.output_dir / qat.QUANTIZED_DIR / "model.safetensors")
    assert ours.keys() == theirs.keys()
    flipped = 0
    for key, value in theirs.items():
        if not key.endswith("._weight_qdata"):
            torch.testing.assert_close(ours[key], value, rtol=1e-4, atol=1e-6, msg=key)
            continue
        layer = key.removesuffix("._weight_qdata")
        scale = theirs[f"{layer}._weight_scale"].repeat_interleave(GROUP, dim=1)
        position = trained[f"{layer}.weight"] / scale  # the weight in rounding steps
        half_way = (position - position.floor() - 0.5).abs()
        rounded = position.round().clamp(-8, 7).to(value.dtype)
        assert not ((value != rounded) & (half_way > 1e-4)).any(), key  # `trained` is what expected converted
        near = half_way < boundary
        differ = ours[key] != value
        assert (ours[key] - value).abs().max() <= 1 and not (differ & ~near).any(), key
        flipped += int(differ.sum())
    return flipped


def trained_weights(run: Run) -> dict[str, torch.Tensor]:
    return load_file(run.output_dir / "final" / "model.safetensors")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    return run_script(tmp_path_factory.mktemp("qat-one") / "out", *EXACT, "--per_device_train_batch_size", "8")


@pytest.fixture(scope="module")
def one_sgd_step(tmp_path_factory):
    return run_script(tmp_path_factory.mktemp("qat-sgd") / "out", *SGD, "--per_device_train_batch_size", "8")


def test_the_run_saves_the_trained_and_the_converted_model(one_process):
    said = " ".join(one_process.stdout.split())
    assert ("qat int8_dynamic_activation_int4_weight (torchao, int4 weight groups of 32): 14 linear layers "
            "fake-quantized, the head and embeddings in full precision") in said
    quantized = one_process.output_dir / "final-quantized"
    assert f"quantized model (int8_dynamic_activation_int4_weight, torchao) saved to {quantized}" in said
    loaded = AutoModelForCausalLM.from_pretrained(quantized)  # config.json's TorchAoConfig: nothing else passed
    assert type(loaded.model.layers[0].self_attn.q_proj.weight).__name__ == "IntxUnpackedToInt8Tensor"
    # the converted model computes what the trained fake-quantized model computes (final/ prepared again)
    trained = AutoModelForCausalLM.from_pretrained(one_process.output_dir / "final")
    qat.prepare(trained, Recipe(qat_scheme="int8_dynamic_activation_int4_weight", qat_group_size=32))
    ids = torch.randint(3, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(loaded(ids).logits, trained(ids).logits, rtol=1e-5, atol=1e-5)
    start = AutoModelForCausalLM.from_pretrained(REPO / "models" / "tiny-llama")
    assert (start(ids).logits - trained(ids).logits).abs().max() > 1e-3  # it trained


def test_two_ddp_processes_equal_one(tmp_path, one_sgd_step):
    """2 processes x 4 rows = 1 process x 8 rows over one step: the loss, the gradient norm and the updated weights
    (rtol 1e-4), with SGD (AdamW's first step, lr x g / (|g| + eps), turns gradients near eps that differ in their
    last bits into visibly different updates, whatever the model), and the converted model. One step, not three:
    after it the two runs' weights differ in their last fp32 bits (DDP sums the halves of the batch in another
    order), and a weight that sits on an int4 rounding boundary (or an activation on an int8 one) then rounds to the
    neighbouring level in one run and not the other; the next steps follow the quantization's discontinuity, not the
    layout (measured with AdamW: the grad norm 0.04% apart at step 2, 0.8% at step 3)."""
    ddp = launch(tmp_path / "ddp", *SGD, "--per_device_train_batch_size", "4", preset="cpu_ddp")
    assert ddp.state()["launch"]["model_wrapper"] == "DistributedDataParallel"
    checks.assert_same_steps(ddp, one_sgd_step, COMPARED)
    assert_same_conversion(ddp, one_sgd_step, trained_weights(one_sgd_step))


def test_two_fsdp2_processes_equal_one(tmp_path, one_sgd_step):
    """FSDP2 gathers each decoder layer's whole weights before its forward, so torchao's fake quantization sees whole
    weight rows (its groups) as in one process; the step and the converted model are one process's (as DDP above)."""
    fsdp = launch(tmp_path / "fsdp2", *SGD, "--per_device_train_batch_size", "4", preset="fsdp2", processes=2,
                  script=FSDP_LAUNCHER)
    info = fsdp.state()["launch"]
    assert (info["distributed_type"], info["num_processes"], info["dtensor_meshes"]) == ("FSDP", 2, ["dim0=2"])
    checks.assert_same_steps(fsdp, one_sgd_step, COMPARED)
    assert_same_conversion(fsdp, one_sgd_step, trained_weights(one_sgd_step))


def test_qat_resumes_exactly_to_the_same_converted_model(tmp_path, one_process):
    """torchao's fake quantizers keep no state between steps (each forward computes its scales from the current
    weights and activations: tests/unit/test_qat.py), so the checkpoint's weights are all there is to restore; the
    resumed run's converted model is the uninterrupted one's, int4 value for value."""
    resumed = checks.assert_resumes_exactly(tmp_path, one_process, [*EXACT, "--per_device_train_batch_size", "8"],
                                            COMPARED)
    assert assert_same_conversion(resumed, one_process, trained_weights(one_process), boundary=0) == 0
