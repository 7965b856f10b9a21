"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL through the real entry script, where torchvision is installed (their processors'
video processor needs it: `make test-newest`, torch 2.14.1 + torchvision 0.29.1; skipped with that reason elsewhere).

Per family, a tiny random model built by scripts/make_tiny_model.py and 4 steps of recipes/tiny-vlm.yaml: full
fine-tuning on one process (the final folder loads with the Auto classes, the vision tower and merger are the base's,
its processor encodes as the base one, plain transformers on the final weights gives the logged eval loss), the same on
two DDP processes with half the rows each (the one-process losses), and LoRA (adapters on the language model only;
the saved adapter on the base, through plain transformers + peft, gives the logged eval loss). The masks, counts and
the loss against transformers' own are in tests/unit/test_vision_families.py.

Preference and RL training, for Qwen2-VL, Qwen2.5-VL and Qwen3-VL (grid-sized image tokens: the processor's
image_grid_thw says how many each image has; pixel_values are the images' flat patches, concatenated row after row;
the model derives its multimodal rotary positions from image_grid_thw and mm_token_type_ids): dpo equals TRL 1.16's
DPOTrainer (scripts/compare_trl_vlm_dpo.py, every part trained: the rejected rows read the same patches as the chosen
ones), kto its KTOTrainer (scripts/compare_trl_vlm_kto.py, 2 accumulated micro-batches a step), and grpo's two
steps equal the plain-PyTorch recomputation from rollouts.jsonl and its first step TRL's GRPOTrainer, tool calling
with images included, with the LLaVA tests' helpers (tests/e2e/test_vision_dpo.py, test_vision_kto.py,
test_vision_grpo.py); dpo's loss on a collated micro-batch against independent encodings:
tests/unit/test_data_image_pairs.py."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForImageTextToText
from transformers.utils import is_torchvision_available

from hftrain import vision
from tests.conftest import launch, run_script
from tests.e2e.test_vision import DATA, adapter_eval_loss, assert_processor_encodes_like_its_base, plain_eval_loss
from tests.e2e.test_vision_dpo import assert_equal_to_trl_dpo
from tests.e2e.test_vision_grpo import BASE as GRPO_BASE
from tests.e2e.test_vision_grpo import (
    ENVIRONMENT,
    assert_first_step_equals_trl,
    assert_tools_with_images_equal_trl,
    assert_two_steps_equal_plain_pytorch,
)
from tests.e2e.test_vision_grpo import MODEL as LLAVA
from tests.e2e.test_vision_kto import assert_equal_to_trl_kto

pytestmark = pytest.mark.skipif(
    not is_torchvision_available(), reason="the Qwen-VL families' processors need torchvision (their video "
    "processor), which is not installed here; make test-newest runs them (torch 2.14.1 + torchvision 0.29.1)")

STEPS = ("--config", "recipes/tiny-vlm.yaml", "--max_steps", "4", "--eval_steps", "2", "--logging_steps", "1")


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def family(request, image_text_model, tmp_path_factory):
    """(arch, base folder, the one-process full fine-tuning run) per family."""
    base = image_text_model(request.param)
    run = run_script(tmp_path_factory.mktemp(request.param) / "one", *STEPS, "--model_name_or_path", str(base))
    return request.param, base, run


def test_full_fine_tuning_trains_the_language_model_and_reproduces_its_eval_loss(family):
    arch, base, run = family
    source = run.state()["data"]["sources"][0]
    assert source["format"] == "image_chat" and source["image_tokens"] >= 4 * source["images"] > 0
    assert "frozen: " in run.stdout and "the vision tower" in run.stdout and "the projector" in run.stdout
    final = run.output_dir / "final"
    model = AutoModelForImageTextToText.from_pretrained(final).eval()
    assert type(model) is type(AutoModelForImageTextToText.from_pretrained(base))
    trained, start = load_file(final / "model.safetensors"), load_file(base / "model.safetensors")
    assert trained.keys() == start.keys()
    for name, value in start.items():  # the vision tower and its merger frozen, the language model trained
        assert torch.equal(trained[name], value) == (vision.part_of(name) in ("vision", "projector")), name
    row = next(json.loads(line) for line in DATA.read_text().splitlines() if len(json.loads(line)["images"]) == 2)
    assert_processor_encodes_like_its_base(final, base, row)

    loss_sum, tokens, *_ = plain_eval_loss(model, final)  # image_grid_thw and mm_token_type_ids reach the model
    logged = run.eval_rows()[-1]
    assert logged["step"] == 4 and logged["eval_tokens"] == tokens
    assert abs(loss_sum / tokens - logged["eval_loss"]) < 1e-5
    assert logged["eval_loss"] < run.eval_rows()[0]["eval_loss"]


def test_two_ddp_processes_train_like_one(family, tmp_path):
    """4 rows per process x 2 processes = the one-process run's 8 rows per step: the same train and eval losses."""
    arch, base, one = family
    two = launch(tmp_path / "two", *STEPS, "--model_name_or_path", str(base), "--per_device_train_batch_size", "4",
                 preset="cpu_ddp")
    assert two.state()["launch"]["model_wrapper"] == "DistributedDataParallel"
    assert two.state()["launch"]["num_processes"] == 2
    for key, rows in (("loss", lambda run: run.train_rows()), ("eval_loss", lambda run: run.eval_rows())):
        assert [r["step"] for r in rows(two)] == [r["step"] for r in rows(one)]
        torch.testing.assert_close(torch.tensor([r[key] for r in rows(two)]),
                                   torch.tensor([r[key] for r in rows(one)]), rtol=1e-5, atol=1e-6)


def test_a_lora_adapter_on_the_language_model_reproduces_the_logged_eval_loss(family, tmp_path):
    arch, base, _ = family
    run = run_script(tmp_path / "lora", *STEPS, "--model_name_or_path", str(base), "--use_peft", "true",
                     "--learning_rate", "1e-2")
    final = run.output_dir / "final"
    targets = json.loads((final / "adapter_config.json").read_text())["target_modules"]
    assert targets and all(vision.part_of(t) == "language" and ".language_model." in t for t in targets)
    loss_sum, tokens, *_ = adapter_eval_loss(AutoModelForImageTextToText.from_pretrained(base), final)
    logged = run.eval_rows()[-1]
    assert logged["eval_tokens"] == tokens
    assert abs(loss_sum / tokens - logged["eval_loss"]) < 1e-5
    assert logged["eval_loss"] < run.eval_rows()[0]["eval_loss"]


PREFERENCE_FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]


@pytest.mark.parametrize("arch", PREFERENCE_FAMILIES)
def test_dpo_with_images_equals_trl_dpo_trainer(arch, image_text_model, tmp_path):
    """3 steps of 4 pairs, sigmoid, every part trained (the vision tower's blocks and merger too): per-step loss,
    rewards and log-probs, and the final weights, against TRL's DPOTrainer on the same pairs."""
    assert_equal_to_trl_dpo(tmp_path, image_text_model(arch), ["sigmoid full"])


@pytest.mark.parametrize("arch", PREFERENCE_FAMILIES)
def test_kto_with_images_equals_trl_kto_trainer_with_accumulation(arch, image_text_model, tmp_path):
    """12 unpaired rows, 3 steps, every part trained, hftrain's steps as 2 accumulated micro-batches: each KL row
    reads its own row's patches and image_grid_thw (its mm_token_type_ids built from its row's prompt); per-step loss,
    KL reference point, rewards and log-probs, and the final weights, against TRL's KTOTrainer."""
    assert_equal_to_trl_kto(tmp_path, image_text_model(arch))


@pytest.fixture(scope="module", params=PREFERENCE_FAMILIES)
def grpo_run(request, image_text_model, tmp_path_factory):
    """(base folder, 2 grpo steps of 8 completions on the LLaVA test's settings, checkpoint-1 saved)."""
    base = image_text_model(request.param)
    run = run_script(tmp_path_factory.mktemp(f"grpo-{request.param}") / "run",
                     *[str(base) if a == str(LLAVA) else a for a in GRPO_BASE], "--per_device_train_batch_size", "8",
                     "--save_strategy", "steps", "--save_steps", "1", "--checkpoint_preflight", "false")
    return base, run


def test_grpo_two_steps_equal_plain_pytorch(grpo_run):
    """Each prompt's grid-sized image tokens in its ids (never sampled); the policy's and the reference's log-probs
    recomputed from rollouts.jsonl with the processor's outputs (image_grid_thw, mm_token_type_ids extended over the
    completion), dapo's loss with beta's KL, clipping, SGD: checkpoint-1 and the final weights."""
    base, run = grpo_run
    assert_two_steps_equal_plain_pytorch(run, base)


def test_grpo_first_step_equals_trl_grpo_trainer(grpo_run, tmp_path):
    """TRL's own prompt ids (its processor call with the images) looked up in rollouts.jsonl, its pixels, its
    advantages, loss and SGD update: the weights of hftrain's checkpoint-1."""
    base, run = grpo_run
    assert_first_step_equals_trl(run, base, tmp_path)


def test_grpo_tool_calling_with_images_equals_trl_grpo_trainer(image_text_model, tmp_path):
    """Qwen2-VL: each turn's context (the prompt's grid-sized image tokens, the turns and tool results so far) is
    generated with the prompt's patches, image_grid_thw and mm_token_type_ids (0 after the prompt); one step equals
    TRL's GRPOTrainer with the same tool (tests/e2e/test_vision_grpo.py's assert_tools_with_images_equal_trl)."""
    assert_tools_with_images_equal_trl(image_text_model("qwen2_vl"), tmp_path)


def test_grpo_environment_with_images_equals_trl_grpo_trainer(image_text_model, tmp_path):
    """Qwen2-VL with environment_factory: the observation lengthens each prompt after its image, so its
    mm_token_type_ids are encoded again with it (for generate and the forward); one step equals TRL's GRPOTrainer
    with the same environment class."""
    (tmp_path / "calculator_env.py").write_text(ENVIRONMENT)
    assert_tools_with_images_equal_trl(image_text_model("qwen2_vl"), tmp_path,
                                       environment=tmp_path / "calculator_env.py")
