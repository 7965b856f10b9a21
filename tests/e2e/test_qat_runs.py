"""qat_scheme through the real entry script: the run trains the fake-quantized model, saves final/ (unconverted) and
final-quantized/ (converted; transformers loads it from its config.json), 2 DDP processes train the same steps as
one, and a resumed run continues exactly."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from hftrain import qat
from hftrain.config import Recipe
from tests.conftest import REPO, launch, run_script
from tests.e2e import objective_checks as checks

pytestmark = pytest.mark.launch
# 3 steps of 8 rows in file order, no evaluation, a checkpoint at step 2
EXACT = ["--config", str(REPO / "recipes" / "tiny-qat.yaml"), "--max_steps", "3", "--logging_steps", "1",
         "--train_sampling_strategy", "sequential", "--validation_split_percentage", "0", "--save_steps", "2",
         "--learning_rate", "1e-2", "--warmup_steps", "1"]
COMPARED = ("loss", "grad_norm")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    return run_script(tmp_path_factory.mktemp("qat-one") / "out", *EXACT, "--per_device_train_batch_size", "8")


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


def test_two_ddp_processes_equal_one(tmp_path):
    """2 processes x 4 rows = 1 process x 8 rows over one step: the loss, the gradient norm and the updated weights
    (rtol 1e-4), with SGD (AdamW's first step, lr x g / (|g| + eps), turns gradients near eps that differ in their
    last bits into visibly different updates, whatever the model). One step, not three: after it the two runs'
    weights differ in their last fp32 bits (DDP sums the halves of the batch in another order), and a weight that
    sits on an int4 rounding boundary (or an activation on an int8 one) then rounds to the neighbouring level in one
    run and not the other; the next steps follow the quantization's discontinuity, not the layout (measured with
    AdamW: the grad norm 0.04% apart at step 2, 0.8% at step 3)."""
    sgd = [*EXACT, "--max_steps", "1", "--optim", "sgd", "--learning_rate", "0.5"]
    one = run_script(tmp_path / "one", *sgd, "--per_device_train_batch_size", "8")
    ddp = launch(tmp_path / "ddp", *sgd, "--per_device_train_batch_size", "4", preset="cpu_ddp")
    assert ddp.state()["launch"]["model_wrapper"] == "DistributedDataParallel"
    checks.assert_same_steps(ddp, one, COMPARED)


def test_qat_resumes_exactly(tmp_path, one_process):
    checks.assert_resumes_exactly(tmp_path, one_process, [*EXACT, "--per_device_train_batch_size", "8"], COMPARED)
