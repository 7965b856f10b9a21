"""recipes/tiny-vlm.yaml end to end: the tiny LLaVA on the shipped image chats trains, its eval loss falls, the frozen
parts stay as they were, and the final folder loads with transformers' Auto classes, its processor encoding exactly
as the base one."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForImageTextToText, AutoProcessor

from hftrain.data.vision import open_image
from tests.conftest import REPO, run_script

MODEL = REPO / "models" / "tiny-vlm"
DATA = REPO / "data" / "image-chat.jsonl"


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    return run_script(tmp_path_factory.mktemp("tiny-vlm") / "out", "--config", "recipes/tiny-vlm.yaml",
                      "--max_steps", "12", "--eval_steps", "4", "--logging_steps", "4")


def test_the_recipe_trains_and_its_eval_loss_falls(full_run):
    evals = [row["eval_loss"] for row in full_run.metrics() if "eval_loss" in row]
    assert len(evals) == 3 and evals[-1] < evals[0] - 0.5, evals
    assert "frozen: the projector" in full_run.stdout and "the vision tower" in full_run.stdout
    state = json.loads((full_run.output_dir / "final" / "hftrain_state.json").read_text())
    source = state["data"]["sources"][0]
    assert source["format"] == "image_chat" and source["image_tokens"] == 16 * source["images"] > 0
    assert state["data"]["train_examples"] + state["data"]["eval_examples"] == len(DATA.read_text().splitlines())


def test_the_final_folder_loads_with_the_auto_classes(full_run):
    final = full_run.output_dir / "final"
    model = AutoModelForImageTextToText.from_pretrained(final)
    base = AutoModelForImageTextToText.from_pretrained(MODEL)
    trained, start = load_file(final / "model.safetensors"), load_file(MODEL / "model.safetensors")
    assert trained.keys() == start.keys()
    for name, value in start.items():  # frozen: the vision tower and the projector; the language model trained
        frozen = ".vision_tower." in f".{name}" or ".multi_modal_projector." in f".{name}"
        assert torch.equal(trained[name], value) == frozen, name
    assert type(model) is type(base)

    saved, original = AutoProcessor.from_pretrained(final), AutoProcessor.from_pretrained(MODEL)
    row = json.loads(DATA.read_text().splitlines()[0])
    images = [open_image(p, DATA.parent, "test") for p in row["images"]]
    text = original.apply_chat_template(row["messages"], tokenize=False)
    assert saved.apply_chat_template(row["messages"], tokenize=False) == text
    a, b = saved(text=[text], images=images, return_tensors="pt"), original(text=[text], images=images,
                                                                          return_tensors="pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
