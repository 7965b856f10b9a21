"""Image chats on the families beyond LLaVA, each a tiny random model and processor built offline by
scripts/make_tiny_model.py: Gemma 3 (SigLIP tower, pooled image tokens between <start_of_image> and <end_of_image>,
bidirectional attention over an image's tokens through `token_type_ids`), Idefics3 / SmolVLM (each image split
into tiles, many image tokens per image with row/column tags) and, where torchvision is installed (make test-newest),
Qwen2-VL, Qwen2.5-VL and Qwen3-VL (a grid of image tokens per image, its size from the image's, between the
<|vision_start|> and <|vision_end|> the chat template writes; multimodal rotary positions from `image_grid_thw` and
`mm_token_type_ids`). Masks, image token counts against the processor's own, truncation, and hftrain's loss against a
plain transformers forward of the same processor output."""

import argparse
import json
import re
from dataclasses import replace

import datasets
import pytest
import torch
import transformers
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor
from transformers.utils import is_torchvision_available

from hftrain import vision
from hftrain.config import Recipe
from hftrain.data.image_chats import PER_TOKEN_PAD, ImageChatCollator, encode, open_image, prepare
from hftrain.data.tokenize import IGNORE_INDEX, DataSpec
from hftrain.objectives.sft import CausalLMTokenLoss
from tests.conftest import REPO, tiny_model_script

DATA = REPO / "data" / "image-chat.jsonl"
SPEC = DataSpec("text", "messages", assistant_only_loss=True, completion_only_loss=True, max_length=512,
                overlong_examples="truncate")
# what assistant-only training trains of each answer, written out from the families' chat templates: the answer and
# its end-of-turn token (SmolVLM's template puts a space after "Assistant:", which the answer's first token holds)
QWEN_VL = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
ANSWER = {"gemma3": ("", "<end_of_turn>"), "idefics3": (" ", "<end_of_utterance>"),
          **dict.fromkeys(QWEN_VL, ("", "<|im_end|>"))}
# the tokens each family's processor writes for an image (the model fills the first with image features)
IMAGE_VOCABULARY = {"gemma3": ["<image_soft_token>", "<start_of_image>", "<end_of_image>"],
                    "idefics3": ["<image>", "<fake_token_around_image>", "<global-img>",
                                 *(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7))],
                    **dict.fromkeys(QWEN_VL, ["<|image_pad|>", "<|vision_start|>", "<|vision_end|>"])}


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return [json.loads(line) for line in DATA.read_text().splitlines()]


@pytest.fixture(scope="module", params=["gemma3", "idefics3", *QWEN_VL])
def family(request, image_text_model):
    if request.param in QWEN_VL and not is_torchvision_available():
        pytest.skip(f"{request.param}'s processor needs torchvision (its video processor), which is not installed "
                    "here; make test-newest runs it (torch 2.14.1 + torchvision 0.29.1)")
    folder = image_text_model(request.param)
    try:
        return request.param, folder, AutoProcessor.from_pretrained(folder)
    except ValueError as e:  # transformers 5.17 marks Idefics3's Pillow image processor as needing torchvision too
        if is_torchvision_available() or "Missing optional dependencies: torchvision" not in str(e):
            raise
        pytest.skip(f"transformers {transformers.__version__} builds {request.param}'s processor only with "
                    f"torchvision (5.23 does without): {str(e)[:200]}")


def images_of(row) -> list:
    return [open_image(path, DATA.parent, "test") for path in row["images"]]


def expected_image_tokens(arch, processor, images) -> tuple[int, int]:
    """(feature tokens, all tokens the processor writes for these images), from the processor's own counts."""
    counts = processor._get_num_multimodal_tokens(image_sizes=[im.size[::-1] for im in images])
    if arch == "gemma3":  # num_image_tokens: the soft tokens; each image's sequence adds <boi>, <eoi> and newlines
        per_image = len(processor.tokenizer(processor.full_image_sequence, add_special_tokens=False)["input_ids"])
        return sum(counts["num_image_tokens"]), per_image * len(images)
    if arch in QWEN_VL:  # a grid of patches merged 2x2 per <|image_pad|>, between <|vision_start|> and <|vision_end|>
        return sum(counts["num_image_tokens"]), sum(counts["num_image_tokens"]) + 2 * len(images)
    # Idefics3: <image> tokens fill each tile; the expansion around them (tile and row markers, newlines) is counted
    # by the processor itself, from an image alone (its num_image_tokens counted the whole expansion up to 5.24 and
    # the <image> tokens only from 5.25)
    written = sum(len(processor(text=[processor.image_token], images=[[image]], add_special_tokens=False)
                      ["input_ids"][0]) for image in images)
    return processor.image_seq_len * sum(counts["num_image_patches"]), written


def test_the_families_load_through_the_auto_classes_without_torchvision(family):
    arch, folder, processor = family
    recipe = Recipe(model_name_or_path=str(folder), dataset_name=str(DATA))
    assert vision.is_image_text(vision.model_config(recipe))
    assert type(vision.build_processor(recipe)) is type(processor)
    # the Pillow one without torchvision; with it (make test-newest), transformers picks its torchvision backend
    assert type(processor.image_processor).__name__.endswith("ImageProcessor" if is_torchvision_available()
                                                             else "ImageProcessorPil")
    model = AutoModelForImageTextToText.from_pretrained(folder)
    assert type(model).__name__ == {"gemma3": "Gemma3ForConditionalGeneration",
                                    "idefics3": "Idefics3ForConditionalGeneration",
                                    "qwen2_vl": "Qwen2VLForConditionalGeneration",
                                    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
                                    "qwen3_vl": "Qwen3VLForConditionalGeneration"}[arch]
    vision.freeze(model, recipe)  # the vision tower and the projector are found by name in each family
    frozen = {name.split(".")[1] for name, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {"gemma3": {"vision_tower", "multi_modal_projector"},
                      "idefics3": {"vision_model", "connector"}}.get(arch, {"visual"})  # Qwen: merger in visual
    if arch in QWEN_VL:
        assert {name for name, p in model.named_parameters() if ".merger." in name} and all(
            not p.requires_grad for name, p in model.named_parameters() if ".merger." in name)
    targets = vision.lora_targets(model, recipe)  # LoRA's default: the language model's linear layers only
    assert targets and all(t.startswith({"idefics3": "model.text_model."}.get(arch, "model.language_model."))
                           for t in targets)


@pytest.mark.parametrize("assistant_only", [True, False])
def test_masks_train_answers_only_and_never_image_tokens(family, rows, assistant_only):
    arch, _, processor = family
    spec, tokenizer = replace(SPEC, assistant_only_loss=assistant_only), processor.tokenizer
    image_vocabulary = tokenizer.convert_tokens_to_ids(IMAGE_VOCABULARY[arch])
    lead, end = ANSWER[arch]
    layouts = set()
    for i, row in enumerate(rows):
        images = images_of(row)
        out = encode(processor, row["messages"], images, spec, f"row {i}")
        ids, labels = out["inputs"]["input_ids"][0], out["labels"][0]
        features, written = expected_image_tokens(arch, processor, images)
        assert int((ids == image_vocabulary[0]).sum()) == features == out["image_tokens"]
        assert out["added_tokens"] == written
        assert (labels[torch.isin(ids, torch.tensor(image_vocabulary))] == IGNORE_INDEX).all()
        trained = labels != IGNORE_INDEX
        assert labels[0] == IGNORE_INDEX and torch.equal(labels[trained], ids[trained])
        if assistant_only:
            assert tokenizer.decode(ids[trained]) == "".join(
                lead + part["text"] + end for m in row["messages"] if m["role"] == "assistant" for part in m["content"])
        else:  # every token but the first and the images' own
            assert int(trained.sum()) == len(ids) - 1 - written
        parts = [sum(p["type"] == "image" for p in m["content"]) for m in row["messages"]]
        layouts |= {"two in one turn"} if 2 in parts else set()
        layouts |= {"in a later turn"} if any(parts[2:]) else set()
    assert layouts == {"two in one turn", "in a later turn"}


def test_truncation_never_cuts_inside_an_image(family, rows):
    arch, _, processor = family
    row = next(r for r in rows if len(r["images"]) == 2 and len(r["messages"]) == 4)  # image in the later turn
    full = encode(processor, row["messages"], images_of(row), SPEC, "row")
    ids = full["inputs"]["input_ids"][0].tolist()
    feature_id = processor.tokenizer.convert_tokens_to_ids(IMAGE_VOCABULARY[arch][0])
    features = [k for k, t in enumerate(ids) if t == feature_id]
    inside = encode(processor, row["messages"], images_of(row), replace(SPEC, max_length=features[-1]), "row")
    assert inside["dropped"] == "image_cut"
    cut = encode(processor, row["messages"], images_of(row), replace(SPEC, max_length=len(ids) - 2), "row")
    assert cut["dropped"] == "" and cut["truncated"] == 2
    per_token = {k: v for k, v in cut["inputs"].items() if k in ("input_ids", *PER_TOKEN_PAD)}
    assert "input_ids" in per_token and {v.shape[1] for v in per_token.values()} == {len(ids) - 2}
    assert cut["labels"].shape[1] == len(ids) - 2


def test_a_token_merged_across_an_images_edge_is_an_image_token(rows, tmp_path):
    """Gemma 3's processor writes "\n\n" before <start_of_image>; after the template's "user\n" a tokenizer with
    newline merges (as Gemma's has) makes one token of the template's newline and the first of the image's. That token
    is an image token (never trained), and the answers are still trained exactly."""
    script = tiny_model_script()
    corpus = tmp_path / "newlines.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"user\n\n\nword {i}\n\n"}) + "\n" for i in range(50)))
    tokenizer = script.build_tokenizer([corpus, REPO / "data" / "chat.jsonl"], 600)
    assert tokenizer.convert_ids_to_tokens(tokenizer("a\n\n\nb")["input_ids"]) == ["a", "ĊĊ", "Ċ", "b"]
    args = argparse.Namespace(image_size=28, patch_size=7, image_tokens=4, hidden_size=64, num_heads=4, num_layers=2)
    _, processor = script.build_gemma3(tokenizer, dict(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2,
                                                       num_attention_heads=4, pad_token_id=tokenizer.pad_token_id),
                                       args)
    merged = 0
    for i, row in enumerate(rows):
        images = images_of(row)
        out = encode(processor, row["messages"], images, SPEC, f"row {i}")
        ids, labels = out["inputs"]["input_ids"][0], out["labels"][0]
        plain = processor(text=[out["text"]], images=images or None, add_special_tokens=False,
                          return_offsets_mapping=True, return_text_replacement_offsets=True)
        starts = [entry["new_span"][0] for entry in plain["text_replacement_offsets"][0]]
        across = [k for k, (s, e) in enumerate(plain["offset_mapping"][0]) if any(s < start < e for start in starts)]
        merged += len(across)
        assert all(labels[k] == IGNORE_INDEX for k in across)
        answers = [part["text"] for m in row["messages"] if m["role"] == "assistant" for part in m["content"]]
        assert processor.tokenizer.decode(ids[labels != IGNORE_INDEX]) == "".join(a + "<end_of_turn>" for a in answers)
        assert out["image_tokens"] == args.image_tokens * len(images)
    assert merged > 10  # chats that open with an image after "user\n"


def test_collated_batch_equals_a_plain_transformers_forward(family, rows, tmp_path):
    """Every processor output reaches the model (Gemma 3's token_type_ids, Idefics3's pixel_attention_mask and tiles
    padded per row) and hftrain's summed token loss / trained tokens equals transformers' own loss on the processor's
    batch of the same rows; one row has a wide image (Idefics3: fewer tiles than the others)."""
    arch, folder, processor = family
    wide = tmp_path / "wide.png"
    Image.new("RGB", (60, 20), (200, 30, 30)).save(wide)
    odd = {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "And this?"}]},
                        {"role": "assistant", "content": [{"type": "text", "text": "A red bar."}]}],
           "images": [str(wide)]}
    picked = [rows[0], next(r for r in rows if len(r["images"]) == 2), odd, rows[3]]
    chats, _ = prepare(datasets.Dataset.from_list(picked), processor, SPEC, str(DATA))
    batch = ImageChatCollator(chats, processor, processor.tokenizer.pad_token_id)([0, 1, 2, 3])
    assert int(batch.pop("num_examples")) == 4

    plain = processor(text=[r["text"] for r in chats.rows], images=[images_of(r) for r in picked], return_tensors="pt",
                      padding=True, add_special_tokens=False)
    assert set(batch) == set(plain) | {"labels"}
    assert {"gemma3": ["token_type_ids"], "idefics3": ["pixel_attention_mask"]}.get(
        arch, ["image_grid_thw", "mm_token_type_ids"])[0] in batch
    for key in set(plain) - {"input_ids", "attention_mask", "token_type_ids"}:  # per image / per row: as the processor
        assert torch.equal(plain[key], batch[key]), key
    width = plain["input_ids"].shape[1]
    for key in ("input_ids", "attention_mask", "token_type_ids"):
        if key in plain:
            assert torch.equal(plain[key], batch[key][:, :width]), key
    if arch == "idefics3":
        assert len({plain["pixel_attention_mask"][r].flatten(1).any(1).sum().item() for r in range(4)}) > 1
    if arch in QWEN_VL:  # the wide image's grid differs from the square ones'
        assert len({tuple(grid.tolist()) for grid in plain["image_grid_thw"]}) > 1

    model = AutoModelForImageTextToText.from_pretrained(folder).eval()
    labels = batch["labels"][:, :width]
    with torch.no_grad():
        expected = model(**plain, labels=labels).loss  # transformers' mean over the shifted trained tokens
        ours = CausalLMTokenLoss(model)(**batch)
        if arch == "gemma3":  # the comparison sees token_type_ids: without them image tokens attend causally only,
            # which moves the loss by 10x the tolerance below even in this tiny random model
            causal = model(**{k: v for k, v in plain.items() if k != "token_type_ids"}, labels=labels).loss
            assert abs(causal.item() - expected.item()) > 1e-5
        if arch in QWEN_VL:  # the comparison sees the multimodal rotary positions (from image_grid_thw and
            # mm_token_type_ids): plain 1-D positions give another loss
            flat = torch.arange(width).expand(len(picked), width)
            assert abs(model(**plain, labels=labels, position_ids=flat).loss.item() - expected.item()) > 1e-5
    tokens = (batch["labels"][:, 1:] != IGNORE_INDEX).sum()
    assert abs(ours.item() / tokens.item() - expected.item()) < 1e-6


@pytest.mark.skipif(is_torchvision_available(), reason="torchvision is installed: Qwen2-VL's processor can be built")
def test_qwen2_vl_without_torchvision_is_refused_up_front_with_the_reason(tmp_path):
    """transformers 5.23 cannot build a Qwen2-VL processor without torchvision, even with the Pillow image processor
    and no video processor (its constructor checks video_processor=None against a class defined only with
    torchvision): the preflight and the processor loader say so in one paragraph instead of a deep traceback."""
    from transformers import AutoTokenizer, Qwen2VLConfig, Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from hftrain.errors import HftrainError
    from hftrain.preflight import model_problems

    tokenizer = AutoTokenizer.from_pretrained(REPO / "models" / "tiny-llama")
    # the reason, as transformers 5.23 has it (AttributeError) and as 5.17 does (TypeError)
    with pytest.raises((AttributeError, TypeError), match="_extra_content|a BaseVideoProcessor was expected"):
        Qwen2VLProcessor(image_processor=Qwen2VLImageProcessorPil(), tokenizer=tokenizer, video_processor=None)
    Qwen2VLConfig(text_config={"hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
                               "num_key_value_heads": 4, "vocab_size": len(tokenizer)},
                  vision_config={"depth": 1, "embed_dim": 32, "hidden_size": 64, "num_heads": 2}
                  ).save_pretrained(tmp_path)
    recipe = Recipe(model_name_or_path=str(tmp_path), dataset_name=str(DATA))
    _, problems = model_problems(recipe)
    said = [p for p in problems if "needs torchvision" in p]
    assert len(said) == 1 and "'qwen2_vl'" in said[0] and "Qwen2VLProcessor" in said[0] and "0.28" in said[0]
    with pytest.raises(HftrainError, match="'qwen2_vl' needs torchvision"):
        vision.build_processor(recipe)
    # the families tested here are not refused
    assert vision.torchvision_problem(vision.model_config(replace(recipe, model_name_or_path=str(REPO / "models" /
                                                                                                  "tiny-vlm")))) is None


def test_the_preview_collapses_each_familys_feature_tokens(family, capsys):
    """`python -m hftrain.data --show` writes each run of the tokens the model fills with image features as one
    `<token>xN` (Gemma 3's <image_soft_token>, Idefics3's <image> per tile), with the processor's counts."""
    from hftrain.data.__main__ import preview

    arch, folder, processor = family
    preview(["--config", str(REPO / "recipes" / "tiny-vlm.yaml"), "--model_name_or_path", str(folder),
             "--validation_split_percentage", "0", "--show", "1"])
    out = capsys.readouterr().out
    token = IMAGE_VOCABULARY[arch][0]
    runs = [int(n) for n in re.findall(re.escape(token) + r"x(\d+)", out.split("--- statistics")[0])]
    row = json.loads(DATA.read_text().splitlines()[0])
    assert sum(runs) == expected_image_tokens(arch, processor, images_of(row))[0] and len(runs) == {
        "gemma3": 1, "idefics3": 5}.get(arch, 1)  # one image: Gemma 3 one run; Idefics3 4 tiles and the whole image


def test_a_family_whose_pillow_image_processor_needs_torchvision_is_refused_up_front(image_text_model):
    """transformers 5.17 marks Idefics3's Pillow image processor as needing torchvision (5.23 does not), so its
    AutoProcessor fails there: the preflight says so in one paragraph, naming the class, before anything loads; where
    AutoProcessor builds it (5.23, or with torchvision) nothing is refused."""
    from hftrain.errors import HftrainError
    from hftrain.preflight import model_problems

    folder = image_text_model("idefics3")
    try:
        AutoProcessor.from_pretrained(folder)
        failure = None
    except (ValueError, ImportError) as e:
        failure = str(e)
    recipe = Recipe(model_name_or_path=str(folder), dataset_name=str(DATA))
    said = [p for p in model_problems(recipe)[1] if "needs torchvision" in p]
    if failure is None:
        assert said == [] and vision.torchvision_problem(vision.model_config(recipe)) is None
        return
    assert "torchvision" in failure
    assert len(said) == 1 and "'idefics3'" in said[0] and "Idefics3ImageProcessorPil" in said[0]
    with pytest.raises(HftrainError, match="'idefics3' needs torchvision"):
        vision.build_processor(recipe)
