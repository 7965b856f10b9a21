"""Image chats (hftrain.data.image_chats) on the shipped tiny LLaVA and shapes set: masks, image tokens, truncation,
collation, and hftrain's loss against a plain transformers forward of the same processor output."""

import json
import re
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

from hftrain import vision
from hftrain.config import Recipe
from hftrain.data.image_chats import ImageChatCollator, ImageChats, collate, encode, open_image, prepare
from hftrain.data.tokenize import IGNORE_INDEX, DataSpec
from hftrain.errors import HftrainError
from hftrain.objectives.sft import CausalLMTokenLoss
from tests.conftest import REPO

MODEL = REPO / "models" / "tiny-vlm"
DATA = REPO / "data" / "image-chat.jsonl"
SPEC = DataSpec("text", "messages", assistant_only_loss=True, completion_only_loss=True, max_length=256,
                overlong_examples="truncate")


@pytest.fixture(scope="module")
def processor():
    return AutoProcessor.from_pretrained(MODEL)


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return [json.loads(line) for line in DATA.read_text().splitlines()]


def images_of(row) -> list:
    return [open_image(path, DATA.parent, "test") for path in row["images"]]


def answers(messages) -> str:
    """What assistant-only training must train, written out independently: each answer and its <|im_end|>."""
    return "".join(part["text"] + "<|im_end|>" for m in messages if m["role"] == "assistant" for part in m["content"])


def test_the_shipped_set_has_each_layout(rows):
    counts = [sum(part["type"] == "image" for m in r["messages"] for part in m["content"]) for r in rows]
    later = [any(part["type"] == "image" for m in r["messages"][2:] for part in m["content"]) for r in rows]
    assert all(c == len(r["images"]) for c, r in zip(counts, rows))
    assert 2 in counts and any(later) and any(r["messages"][0]["role"] == "system" for r in rows)
    assert all(isinstance(m["content"], list) for r in rows for m in r["messages"])


@pytest.mark.parametrize("assistant_only", [True, False])
def test_masks_train_answers_only_and_never_image_tokens(processor, rows, assistant_only):
    spec = replace(SPEC, assistant_only_loss=assistant_only)
    image_id = processor.image_token_id
    for i, row in enumerate(rows):
        images = images_of(row)
        out = encode(processor, row["messages"], images, spec, f"row {i}")
        ids, labels = out["inputs"]["input_ids"][0], out["labels"][0]
        # the processor's own count of image tokens for these images
        expected = sum(processor._get_num_multimodal_tokens(image_sizes=[im.size[::-1] for im in images])
                       ["num_image_tokens"])
        assert int((ids == image_id).sum()) == expected == out["image_tokens"] == 16 * len(images)
        assert (labels[ids == image_id] == IGNORE_INDEX).all()
        assert labels[0] == IGNORE_INDEX
        trained = labels != IGNORE_INDEX
        assert torch.equal(labels[trained], ids[trained])
        if assistant_only:
            assert processor.tokenizer.decode(ids[trained]) == answers(row["messages"])
        else:  # every token but the first and the image tokens
            assert int(trained.sum()) == len(ids) - 1 - expected


def test_truncation_never_cuts_inside_an_image(processor, rows):
    row = next(r for r in rows if len(r["images"]) == 2 and len(r["messages"]) == 4)  # image in the later turn
    full = encode(processor, row["messages"], images_of(row), SPEC, "row")
    ids = full["inputs"]["input_ids"][0].tolist()
    image_at = [k for k, t in enumerate(ids) if t == processor.image_token_id]
    inside = encode(processor, row["messages"], images_of(row), replace(SPEC, max_length=image_at[-1]), "row")
    assert inside["dropped"] == "image_cut"
    after = encode(processor, row["messages"], images_of(row), replace(SPEC, max_length=image_at[-1] + 3), "row")
    assert after["dropped"] == "" and after["truncated"] == len(ids) - image_at[-1] - 3
    inputs = after["inputs"]
    widths = {inputs["input_ids"].shape[1], after["labels"].shape[1], inputs["attention_mask"].shape[1]}
    assert widths == {image_at[-1] + 3}
    dropped = encode(processor, row["messages"], images_of(row),
                     replace(SPEC, max_length=image_at[-1] + 3, overlong_examples="drop"), "row")
    assert dropped["dropped"] == "overlong"

    import datasets
    raw = datasets.Dataset.from_list([row, rows[0]])
    chats, stats = prepare(raw, processor, replace(SPEC, max_length=image_at[-1]), str(DATA))
    assert len(chats) == 1 and stats["dropped_image_cut"] == 1 and stats["examples"] == 1


def test_bad_rows_are_named(processor, rows):
    import datasets
    row = dict(rows[0], images=[])
    with pytest.raises(HftrainError, match="example 0: 1 image part.* but 0 image"):
        prepare(datasets.Dataset.from_list([row]), processor, SPEC, str(DATA))
    with pytest.raises(HftrainError, match="cannot read image 'nope.png'"):
        open_image("nope.png", DATA.parent, "example 3")


def test_collated_batch_equals_a_plain_transformers_forward(processor, rows):
    """Every processor output reaches the model, and hftrain's summed token loss / trained tokens equals
    transformers' own loss of the model on the same processor output (batch of rows of different lengths)."""
    import datasets
    picked = [rows[0], next(r for r in rows if len(r["images"]) == 2), rows[3]]
    chats, _ = prepare(datasets.Dataset.from_list(picked), processor, SPEC, str(DATA))
    assert isinstance(chats, ImageChats)
    batch = ImageChatCollator(chats, processor, processor.tokenizer.pad_token_id)([0, 1, 2])
    assert int(batch.pop("num_examples")) == 3
    n_images = sum(len(r["images"]) for r in picked)
    assert set(batch) == {"input_ids", "labels", "attention_mask", "pixel_values"}
    assert batch["pixel_values"].shape[0] == n_images

    model = AutoModelForImageTextToText.from_pretrained(MODEL).eval()
    plain_inputs = processor(text=[r["text"] for r in chats.rows], images=[images_of(r) for r in picked],
                             return_tensors="pt", padding=True, add_special_tokens=False)
    assert torch.equal(plain_inputs["pixel_values"], batch["pixel_values"])
    width = plain_inputs["input_ids"].shape[1]
    assert torch.equal(plain_inputs["input_ids"][plain_inputs["attention_mask"].bool()],
                       batch["input_ids"][batch["attention_mask"].bool()])
    labels = batch["labels"][:, :width]
    with torch.no_grad():
        expected = model(**plain_inputs, labels=labels).loss  # transformers' mean over the shifted trained tokens
        ours = CausalLMTokenLoss(model)(**batch)
    tokens = (batch["labels"][:, 1:] != IGNORE_INDEX).sum()
    assert abs(ours.item() / tokens.item() - expected.item()) < 1e-6

    empty = ImageChatCollator(chats, processor, 0)([])  # trains nothing, runs the vision tower like the others
    assert int(empty["num_examples"]) == 0 and (empty["labels"] == IGNORE_INDEX).all()
    assert empty["pixel_values"].shape[0] == len(picked[0]["images"])


def test_a_micro_batch_without_an_image_still_runs_the_vision_tower(processor, rows):
    """Text-only chats beside image chats: a micro-batch of text-only rows (or none) carries one more row, the set's
    first image chat, training nothing, so every process runs the vision tower (sharded gathers stay matched); the
    loss of the real rows is a plain transformers forward of those rows alone, without images."""
    import datasets
    text_only = [{"messages": [{"role": "user", "content": [{"type": "text", "text": question}]},
                               {"role": "assistant", "content": [{"type": "text", "text": answer}]}], "images": []}
                 for question, answer in (("Name a shape.", "A circle."), ("And a colour?", "Red, as a rule."))]
    picked = [*text_only, rows[0]]
    chats, _ = prepare(datasets.Dataset.from_list(picked), processor, SPEC, str(DATA))
    collator = ImageChatCollator(chats, processor, processor.tokenizer.pad_token_id)
    batch = collator([0, 1])
    assert int(batch.pop("num_examples")) == 2
    assert batch["input_ids"].shape[0] == 3 and (batch["labels"][2] == IGNORE_INDEX).all()
    assert batch["pixel_values"].shape[0] == len(rows[0]["images"])

    model = AutoModelForImageTextToText.from_pretrained(MODEL).eval()
    plain = processor.tokenizer([r["text"] for r in chats.rows[:2]], return_tensors="pt", padding=True,
                                add_special_tokens=False)
    width = plain["input_ids"].shape[1]
    assert torch.equal(plain["input_ids"][plain["attention_mask"].bool()],
                       batch["input_ids"][:2][batch["attention_mask"][:2].bool()])
    with torch.no_grad():
        expected = model(**plain, labels=batch["labels"][:2, :width]).loss  # no image: the tower never runs
        ours = CausalLMTokenLoss(model)(**batch)
    tokens = (batch["labels"][:, 1:] != IGNORE_INDEX).sum()
    assert tokens > 0 and abs(ours.item() / tokens.item() - expected.item()) < 1e-6

    empty = collator([])  # the padded end of an epoch: the filler is the first chat with an image, not row 0
    assert int(empty["num_examples"]) == 0 and (empty["labels"] == IGNORE_INDEX).all()
    assert empty["pixel_values"].shape[0] == len(rows[0]["images"])
    with_image = collator([1, 2])  # an image already in the micro-batch: no filler
    assert with_image["input_ids"].shape[0] == 2 and int(with_image["num_examples"]) == 2


def test_collate_pads_per_token_outputs_and_concatenates_per_image_ones():
    a = {"input_ids": torch.tensor([[1, 2, 3]]), "mm_token_type_ids": torch.tensor([[0, 1, 1]]),
         "image_grid_thw": torch.tensor([[1, 2, 2]]), "pixel_values": torch.ones(4, 5)}
    b = {"input_ids": torch.tensor([[4]]), "mm_token_type_ids": torch.tensor([[0]])}
    batch = collate([a, b], [torch.tensor([[-100, 2, 3]]), torch.tensor([[-100]])], pad_token_id=9)
    assert batch["input_ids"].tolist() == [[1, 2, 3], [4, 9, 9]]
    assert batch["labels"].tolist() == [[-100, 2, 3], [-100, -100, -100]]
    assert batch["mm_token_type_ids"].tolist() == [[0, 1, 1], [0, 0, 0]]
    assert batch["image_grid_thw"].tolist() == [[1, 2, 2]] and batch["pixel_values"].shape == (4, 5)


def test_image_text_models_are_recognised_and_frozen_by_part():
    recipe = Recipe(model_name_or_path=str(MODEL), dataset_name=str(DATA))
    config = vision.model_config(recipe)
    assert vision.is_image_text(config)
    assert not vision.is_image_text(vision.model_config(replace(recipe, model_name_or_path=str(REPO / "models" /
                                                                                                  "tiny-llama"))))
    model = AutoModelForImageTextToText.from_pretrained(MODEL)
    frozen = vision.freeze(model, recipe)
    for name, p in model.named_parameters():
        assert p.requires_grad == (not (name.startswith("model.vision_tower.")
                                        or name.startswith("model.multi_modal_projector."))), name
    assert frozen["vision"] == sum(p.numel() for p in model.model.vision_tower.parameters())
    targets = vision.lora_targets(model, recipe)
    assert targets and all(t.startswith("model.language_model.") for t in targets)
    unfrozen = vision.lora_targets(model, replace(recipe, freeze_projector=False))
    projector = {"model.multi_modal_projector.linear_1", "model.multi_modal_projector.linear_2"}
    assert set(unfrozen) - set(targets) == projector
    said = vision.problems(replace(recipe, packing=True, objective="reward"), config)
    assert len(said) == 2 and "packing" in said[0] and "objective=reward" in said[1]


def test_the_preview_shows_image_rows_with_their_image_tokens_and_masks(capsys, tmp_path, rows):
    from hftrain.data.__main__ import preview

    preview(["--config", str(REPO / "recipes" / "tiny-vlm.yaml"), "--model_name_or_path", str(MODEL),
             "--dataset_name", str(DATA), "--validation_split_percentage", "0", "--show", "40"])
    out = capsys.readouterr().out
    shown = out.split("--- example ")[1:]
    assert len(shown) == len(rows)
    for block in shown:  # the runs of image tokens, collapsed, add up to the example's image token count
        head, body = block.split("\n", 1)
        runs = [int(n) for n in re.findall(r"<image>x(\d+)", body)]
        images = int(re.search(r"(\d+) image\(s\)", head).group(1))
        assert f"= {sum(runs)} image tokens" in head and sum(runs) == 16 * images  # adjacent images share a run
        trained = re.findall("⟦(.*?)⟧", body, flags=re.S)
        assert trained and all(t.endswith("<|im_end|>") and "<image>" not in t for t in trained)
    assert f"{len(rows)} examples kept with {sum(len(r['images']) for r in rows)} images" in out
    with pytest.raises(HftrainError, match="--dump"):
        preview(["--config", str(REPO / "recipes" / "tiny-vlm.yaml"), "--dump", "2", str(tmp_path / "x.jsonl")])


def test_the_preflight_refuses_packing_for_an_image_text_model_and_text_models_say_why_parts_fail():
    from hftrain.data.formats import check_messages
    from hftrain.preflight import model_problems

    _, problems = model_problems(Recipe(model_name_or_path=str(MODEL), dataset_name=str(DATA), packing=True))
    assert [p for p in problems if "packing: true with the image-text model 'llava'" in p]
    _, problems = model_problems(Recipe(model_name_or_path=str(REPO / "models" / "tiny-llama"),
                                        dataset_name=str(DATA), packing=True))
    assert problems == []
    row = json.loads(DATA.read_text().splitlines()[0])
    with pytest.raises(HftrainError, match="TRL's vision format: image chats train an image-text model"):
        check_messages(row["messages"], "example 0")


def test_streamed_image_rows_collate_as_the_map_style_set(processor, rows):
    """streaming: true: a raw image chat becomes a row when read (`stream_row`: ids, labels, rendered text, image
    paths) and is encoded again with its images by the collator; micro-batches equal those of the map-style set's
    collator, the filler row (the stream's first image chat, after a bad and a text-only example) included. Images
    given as anything but paths cannot sit in a checkpointed stream state: refused, naming the example."""
    import datasets

    from hftrain.data.image_chats import StreamImageCollator, filler_row, stream_row

    text_only = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Name a shape."}]},
                              {"role": "assistant", "content": [{"type": "text", "text": "A circle."}]}], "images": []}
    picked = [text_only, rows[0], rows[2]]
    chats, _ = prepare(datasets.Dataset.from_list(picked), processor, SPEC, str(DATA))
    pad = processor.tokenizer.pad_token_id
    mapped = ImageChatCollator(chats, processor, pad)
    streamed = [stream_row(example, processor, SPEC, DATA.parent, f"example {i}") for i, example in enumerate(picked)]
    assert not any(row["dropped"] for row in streamed)
    assert json.loads(json.dumps(streamed)) == streamed  # what a checkpoint holds of them
    filler = filler_row([{"messages": "not a chat"}, text_only, rows[0], rows[2]], processor, SPEC, DATA.parent, "d")
    assert filler == streamed[1]
    collator = StreamImageCollator(processor, pad, DATA.parent, str(DATA), filler)
    for indices in ([0], [0, 1], [1, 2]):  # a text-only micro-batch gets the filler row, as map-style
        ours, theirs = collator([[streamed[i]] for i in indices]), mapped(indices)
        assert sorted(ours) == sorted(theirs)
        for key, value in theirs.items():
            assert torch.equal(ours[key], value), key
    assert collator([[streamed[0]]])["input_ids"].shape[0] == 2
    # on several processes, a filler without an image cannot stand in for a later image chat: stopped, not hung
    late = StreamImageCollator(processor, pad, DATA.parent, str(DATA), streamed[0], processes=2)
    assert late([[streamed[0]]])["input_ids"].shape[0] == 2  # text-only micro-batches still run
    with pytest.raises(HftrainError, match="an image chat came after the stream's first 1000 examples"):
        late([[streamed[1]]])
    assert StreamImageCollator(processor, pad, DATA.parent, str(DATA), streamed[0])([[streamed[1]]])  # one process
    with pytest.raises(HftrainError, match="example 7: a streamed image chat gives its 'images' as file paths"):
        stream_row({**rows[0], "images": images_of(rows[0])}, processor, SPEC, DATA.parent, "example 7")
