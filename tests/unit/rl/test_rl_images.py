"""hftrain.rl.images on the tiny LLaVA's processor: prompts with images rendered to the ids TRL 1.16's GRPOTrainer
tokenizes them to (`prepare_multimodal_messages` + the processor's `apply_chat_template`, TRL's own calls), the
window's pixels equal to the processor's, reward functions' prompts in TRL's form, `batch_inputs`' placement of
per-token and per-image outputs, and what is refused by name (the recipe's check and the data's)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoProcessor
from transformers.utils import is_torchvision_available

from hftrain.config import Recipe
from hftrain.errors import HftrainError
from hftrain.rl.images import PromptImages
from hftrain.rl.rollouts import batch_inputs
from tests.conftest import REPO

MODEL = REPO / "models" / "tiny-vlm"
DATA = REPO / "data" / "image-prompts.jsonl"


@pytest.fixture(scope="module")
def processor():
    return AutoProcessor.from_pretrained(MODEL)


def rows(count: int = 2) -> list[dict]:
    return [json.loads(line) for line in DATA.read_text().splitlines()[:count]]


def test_prompts_are_tokenized_as_trl_tokenizes_them(processor):
    """A string prompt (the image placed before its text) and a prompt with an image part: the same ids as TRL's
    tokenization, the image's 16 tokens inside; the window's pixels are the processor's on the opened image; the
    reward functions' prompt is TRL's `prepare_multimodal_messages` output (the same parts and texts, the same
    pixels)."""
    from trl.data_utils import prepare_multimodal_messages

    data = rows()
    images = PromptImages(processor)
    prompts = images.render(data, str(DATA), None)
    assert images.suppressed == (processor.image_token_id,)
    inputs = images.row_inputs(prompts)
    for row, prompt, got in zip(data, prompts, inputs):
        image = Image.open(DATA.parent / row["images"][0])
        messages = prepare_multimodal_messages(row["prompt"], images=[image])
        theirs = processor.apply_chat_template(conversation=[messages], add_generation_prompt=True, tokenize=True,
                                               return_dict=True)
        assert prompt.ids == list(theirs["input_ids"][0]) and prompt.ids.count(processor.image_token_id) == 16
        assert prompt.images == row["images"]  # rollouts.jsonl's names: as the data gives them
        torch.testing.assert_close(got["pixel_values"], processor(text=["<image>"], images=[image.convert("RGB")],
                                                                  return_tensors="pt")["pixel_values"])
        mine = PromptImages.reward_prompt(prompt)
        assert [[{k: v for k, v in p.items() if k != "image"} for p in m["content"]] for m in mine] == \
            [[{k: v for k, v in p.items() if k != "image"} for p in m["content"]] for m in messages]
        ours, trls = ([p["image"] for m in ms for p in m["content"] if p["type"] == "image"] for ms in (mine, messages))
        assert len(ours) == len(trls) == 1
        assert np.array_equal(np.asarray(ours[0].convert("RGB")), np.asarray(trls[0].convert("RGB")))


def test_batch_inputs_place_per_token_outputs_where_each_prompt_sits():
    """Left-padded for generate, at the start of the row for training, 0 elsewhere (a row without images too);
    per-image outputs in row order."""
    one, two = torch.ones(1, 3, 2, 2), 2 * torch.ones(1, 3, 2, 2)
    rows_ = [{"pixel_values": one, "token_type_ids": torch.tensor([[1, 1, 0]])}, {},
             {"pixel_values": two, "token_type_ids": torch.tensor([[0, 1]])}]
    left = batch_inputs(rows_, [3, 4, 2], 5, left=True)
    assert left["token_type_ids"].tolist() == [[0, 0, 1, 1, 0], [0, 0, 0, 0, 0], [0, 0, 0, 0, 1]]
    right = batch_inputs(rows_, [3, 4, 2], 6, left=False)
    assert right["token_type_ids"].tolist() == [[1, 1, 0, 0, 0, 0], [0] * 6, [0, 1, 0, 0, 0, 0]]
    assert torch.equal(left["pixel_values"], torch.cat([one, two])) and torch.equal(right["pixel_values"],
                                                                                    left["pixel_values"])
    # a multi-turn context (tool calling): the prompt's 3 tokens, then 2 of turns and tool results, marked 0 (TRL's
    # tool loop extends the prompt's per-token fields with 0 the same way)
    longer = batch_inputs(rows_[:1], [5], 6, left=True)
    assert longer["token_type_ids"].tolist() == [[0, 1, 1, 0, 0, 0]]


def test_bad_prompts_are_refused_naming_the_row(processor, tmp_path):
    images = PromptImages(processor)
    text = [{"prompt": "What is this?", "images": [str(DATA.parent / "images" / "red-circle.png")]}]
    with pytest.raises(HftrainError, match=r"row 0 has images but a text prompt"):
        images.render(text, "prompts", None)
    two_parts = [{"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "image"}]}],
                  "images": ["images/red-circle.png"]}]
    with pytest.raises(HftrainError, match=r"row 0: 2 image part\(s\) in the prompt but 1 image"):
        images.render(two_parts, str(DATA), None)
    with pytest.raises(HftrainError, match=r"over max_prompt_length=8; a prompt with images is not cut"):
        images.render(rows(1), str(DATA), 8)
    bare = [{"prompt": [{"role": "user", "content": "Hello?"}]}]
    with pytest.raises(HftrainError, match=r"1 of 1 prompts hold no image"):
        PromptImages.check_every_prompt_has_images(images.render(bare, str(DATA), None), "prompts")


def test_the_recipe_check_refuses_what_grpo_with_images_does_not_do_by_name():
    from hftrain.preflight import model_problems

    def problems(**fields):
        return model_problems(Recipe(model_name_or_path=str(MODEL), dataset_name=str(DATA), objective="grpo",
                                     **fields))[1]

    assert problems() == []
    refused = " | ".join(problems(async_generation=True, use_vllm=True, sp_size=2))
    for words in ("async_generation with objective=grpo with the image-text model 'llava' is not supported yet",
                  "use_vllm with objective=grpo", "sp_size 2 with objective=grpo"):
        assert words in refused, words
    # tool calling runs with images (each turn generated with the prompt's pixels)
    assert problems(tools=["x.py:f"]) == [] and problems(environment_factory="x.py:E") == []


@pytest.mark.parametrize("arch", ["gemma3", pytest.param("qwen2_vl", marks=pytest.mark.skipif(
    not is_torchvision_available(), reason="the Qwen-VL families' processors need torchvision, which is not "
    "installed here; make test-newest runs them"))])
def test_a_multi_turn_context_generates_with_its_prompts_pixels(arch, image_text_model):
    """Tool calling's continuations: two contexts of different lengths (each a prompt with its image, then tokens
    standing for a turn and a tool result), left-padded into one generate call with their prompts' processor
    outputs (Gemma 3's token_type_ids, Qwen2-VL's mm_token_type_ids with image_grid_thw: 0 after the prompt). At each
    of 3 steps, each row's logits in generate (seen by an observing processor) equal a plain forward of that row
    alone, unpadded, with the processor's outputs for its prompt; and its sampled token is the argmax of those logits
    plus the row generator's Gumbel noise (RowSeededSampling's draw)."""
    from transformers import AutoModelForImageTextToText, LogitsProcessor

    from hftrain.rl.rollouts import Sampling, generate_rows

    class Observe(LogitsProcessor):
        def __init__(self):
            self.seen = []

        def __call__(self, input_ids, scores):
            self.seen.append(scores.detach().float().clone())
            return scores

    folder = image_text_model(arch)
    processor = AutoProcessor.from_pretrained(folder)
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    images = PromptImages(processor)
    prompts = images.render(rows(2), str(DATA), None)
    extra = processor.tokenizer("Let me check.<|im_end|>\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n",
                                add_special_tokens=False)["input_ids"]
    contexts = [prompts[0].ids + extra, prompts[1].ids + extra[:5]]
    assert len(contexts[0]) != len(contexts[1])
    seeds, eos, observe = [11, 12], {processor.tokenizer.eos_token_id}, Observe()
    got = generate_rows(model, contexts, seeds, Sampling(max_completion_length=3), eos,
                        processor.tokenizer.pad_token_id, extra=[observe], inputs=images.row_inputs(prompts))
    for row, (context, seed, data_row, (tokens, _)) in enumerate(zip(contexts, seeds, rows(2), got)):
        text = processor.apply_chat_template(trl_like(data_row["prompt"]), add_generation_prompt=True, tokenize=False)
        inputs = processor(text=[text], images=[Image.open(DATA.parent / data_row["images"][0]).convert("RGB")],
                           return_tensors="pt", add_special_tokens=False)
        inputs.pop("attention_mask")
        prompt_length = inputs.pop("input_ids").shape[1]
        generator = torch.Generator().manual_seed(seed)
        ids = list(context)
        for step, token in enumerate(tokens):
            extended = {k: torch.cat([v, v.new_zeros(1, len(ids) - prompt_length)], dim=1)
                        if k in ("token_type_ids", "mm_token_type_ids") else v for k, v in inputs.items()}
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([ids]), **extended).logits[0, -1].float()
            torch.testing.assert_close(observe.seen[step][row], logits, rtol=1e-4, atol=1e-4)
            uniform = torch.rand(logits.shape[-1], generator=generator).clamp_min(torch.finfo(torch.float32).tiny)
            assert token == int(torch.argmax(logits - torch.log(-torch.log(uniform))))
            ids.append(token)


def trl_like(prompt: list[dict]) -> list[dict]:
    """A data row's prompt with its image part before the text of a string content (TRL's placement)."""
    return [{"role": m["role"], "content": [{"type": "image"}, {"type": "text", "text": m["content"]}]}
            if isinstance(m["content"], str) else m for m in prompt]
