"""Image preference pairs (hftrain.data.image_pairs) on the shipped tiny LLaVA and data/image-pairs.jsonl: masks (the
completion trained, image tokens never), TRL's image placement for string prompts, one processor call per pair, and
dpo's loss on a collated micro-batch against a plain PyTorch computation on independent encodings of each side."""

import json
import re

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers import AutoModelForImageTextToText, AutoProcessor
from transformers.utils import is_torchvision_available

from hftrain.config import Recipe
from hftrain.data.image_chats import open_image
from hftrain.data.image_pairs import ImagePairCollator, ImagePairs, prepare_pairs, stream_pair
from hftrain.data.tokenize import IGNORE_INDEX, DataSpec
from hftrain.objectives.preference import PreferenceLoss
from hftrain.objectives.reference import FrozenReference, ReferenceLogProbs
from tests.conftest import REPO

MODEL = REPO / "models" / "tiny-vlm"
DATA = REPO / "data" / "image-pairs.jsonl"
SPEC = DataSpec("text", "messages", assistant_only_loss=True, completion_only_loss=True, max_length=256,
                overlong_examples="truncate")
IMAGE_TOKENS = 16  # the tiny LLaVA's processor writes 16 <image> tokens per image (CLIP tower, 28x28)


@pytest.fixture(scope="module")
def processor():
    return AutoProcessor.from_pretrained(MODEL)


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return [json.loads(line) for line in DATA.read_text().splitlines()]


@pytest.fixture(scope="module")
def pairs(processor, rows) -> ImagePairs:
    return prepare_pairs([dict(row) for row in rows], processor, SPEC, str(DATA))[0]


def answer(side) -> str:
    return side[0]["content"] if isinstance(side[0]["content"], str) else side[0]["content"][0]["text"]


def test_each_side_trains_its_answer_and_never_an_image_token(processor, rows, pairs):
    """Every pair is kept; each side trains exactly its answer and <|im_end|>; the prompt tokens (image expansions
    included) are the same on both sides; string prompts get the row's images (TRL's placement)."""
    assert len(pairs) == len(rows) == 32
    assert sum(isinstance(r["prompt"][0]["content"], str) for r in rows) == 16  # both ways of giving the images
    image_id = processor.tokenizer.convert_tokens_to_ids("<image>")
    for row, pair in zip(rows, pairs.rows):
        for side, ids, labels in (("chosen", pair["input_ids"], pair["labels"]),
                                  ("rejected", pair["rejected_input_ids"], pair["rejected_labels"])):
            trained = [t for t in labels if t != IGNORE_INDEX]
            assert processor.tokenizer.decode(trained) == answer(row[side]) + "<|im_end|>", side
            assert ids.count(image_id) == IMAGE_TOKENS * len(row["images"])
            assert all(label == IGNORE_INDEX for t, label in zip(ids, labels) if t == image_id)
        shared = pair["prompt_tokens"]
        assert pair["input_ids"][:shared] == pair["rejected_input_ids"][:shared]
        assert processor.tokenizer.decode(pair["input_ids"][:shared]).endswith("<|im_start|>assistant\n")


class CountingProcessor:
    """The processor, counting the calls that process images."""

    def __init__(self, processor):
        self.processor, self.tokenizer, self.image_calls = processor, processor.tokenizer, 0

    def __call__(self, *args, **kwargs):
        self.image_calls += kwargs.get("images") is not None
        return self.processor(*args, **kwargs)


def side_log_prob(model, processor, row, side, length: bool = False):
    """A side's summed completion log-prob, encoded independently of hftrain: the processor on the chat template's
    full text with the images; the completion's tokens are those after the prompt rendered with the generation
    prompt, through the last <|im_end|> (the tiny template writes a newline after it, which is not trained)."""
    prompt = row["prompt"]
    if isinstance(prompt[0]["content"], str):  # TRL's placement: the images before the first user message's text
        prompt = [{"role": "user", "content": [*[{"type": "image"}] * len(row["images"]),
                                                {"type": "text", "text": prompt[0]["content"]}]}]
    images = [open_image(path, DATA.parent, "test") for path in row["images"]]
    head = processor.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    full = processor.apply_chat_template([*prompt, *row[side]], tokenize=False)
    inputs = processor(text=[full], images=images, return_tensors="pt", add_special_tokens=False)
    start = processor(text=[head], images=images, return_tensors="pt", add_special_tokens=False)["input_ids"].shape[1]
    ids = inputs["input_ids"][0]
    end = max(i for i, t in enumerate(ids.tolist()) if t == processor.tokenizer.convert_tokens_to_ids("<|im_end|>"))
    logps = model(**inputs).logits[0].float().log_softmax(-1)
    total = sum(logps[i - 1, ids[i]] for i in range(start, end + 1))
    return (total, end + 1 - start) if length else total


def test_dpo_loss_of_a_micro_batch_equals_plain_pytorch(processor, rows, pairs):
    """dpo (sigmoid, beta 0.1) on 3 pairs (one with two images, string and list-of-parts prompts) against a reference
    that differs from the policy: hftrain's summed loss equals the formula on log-probs computed per side from
    independent encodings. The collator processes each pair's images once (3 calls with images for 3 pairs) and
    the rejected rows read the chosen rows' pixels."""
    picked = [0, 1, 3]
    assert len(rows[3]["images"]) == 2 and isinstance(rows[0]["prompt"][0]["content"], str)
    counting = CountingProcessor(processor)
    batch = ImagePairCollator(pairs, counting, processor.tokenizer.pad_token_id)(picked)
    assert counting.image_calls == 3
    assert int(batch.pop("num_examples")) == 3
    images = sum(len(rows[i]["images"]) for i in picked)
    assert batch["pixel_values"].shape[0] == 2 * images
    assert torch.equal(batch["pixel_values"][:images], batch["pixel_values"][images:])

    torch.manual_seed(0)
    policy = AutoModelForImageTextToText.from_pretrained(MODEL).eval()
    reference = AutoModelForImageTextToText.from_pretrained(MODEL).eval()
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    recipe = Recipe(model_name_or_path=str(MODEL), dataset_name=str(DATA), objective="dpo", beta=0.1)
    loss = PreferenceLoss(policy, recipe, FrozenReference(ReferenceLogProbs(reference, False), torch.device("cpu")))
    with torch.no_grad():
        ours = loss(**batch)
        expected = 0.0
        for i in picked:
            lp = {side: side_log_prob(policy, processor, rows[i], side) for side in ("chosen", "rejected")}
            ref = {side: side_log_prob(reference, processor, rows[i], side) for side in ("chosen", "rejected")}
            delta = (lp["chosen"] - ref["chosen"]) - (lp["rejected"] - ref["rejected"])
            expected = expected - F.logsigmoid(0.1 * delta)
    assert int(loss.loss_units({"labels": batch["labels"]})) == 3
    assert ours.item() == pytest.approx(float(expected), rel=1e-5)
    assert abs(ours.item() - 3 * 0.6931) > 1e-3  # the reference differs: the test is not log 2 on both sides

    empty = ImagePairCollator(pairs, processor, 0)([])  # trains nothing, runs the vision tower like the others
    assert int(empty["num_examples"]) == 0 and (empty["labels"] == IGNORE_INDEX).all()
    assert empty["pixel_values"].shape[0] == 2 * len(pairs.rows[0]["images"])


def test_the_preflight_takes_dpo_simpo_and_orpo_and_refuses_the_rest_by_name():
    from hftrain.preflight import model_problems

    def problems(**fields):
        return model_problems(Recipe(model_name_or_path=str(MODEL), dataset_name=str(DATA), **fields))[1]

    assert problems(objective="dpo") == problems(objective="simpo") == problems(objective="orpo") == []
    assert problems(objective="dpo", loss_type="ipo") == []
    words = "a reward model (a sequence classifier) on an image-text model is not"
    assert [p for p in problems(objective="reward") if words in p]
    assert problems(objective="grpo") == []  # prompts with images: hftrain.rl.images (tests/unit/rl/test_rl_images.py)
    refused = problems(objective="dpo", precompute_ref_log_probs=True, max_prompt_length=64)
    assert [p for p in refused if p.startswith("precompute_ref_log_probs with objective=dpo on image preference")]
    assert [p for p in refused if p.startswith("max_prompt_length with objective=dpo on image preference pairs")]


def test_a_streamed_micro_batch_is_the_map_style_one(processor, pairs):
    """streaming: the file read by the stream's reader, each raw pair encoded when it is drawn (`stream_pair`) and kept
    by the row stream as it keeps rows, in JSON (a checkpoint holds them), gives the map-style collator's micro-batches
    of the same pairs: every processor output, both sides' labels and the image token marks."""
    from hftrain.data.image_pairs import StreamImagePairCollator, filler_pair
    from hftrain.data.jsonlines import json_lines_dataset
    from hftrain.data.streaming import RowStream

    def read(example, index):
        return [stream_pair(example, processor, SPEC, DATA.parent, f"example {index}")]

    stream = RowStream(lambda passes: json_lines_dataset([str(DATA)], {}), read, shuffle_buffer=1, seed=0,
                       packing=False, max_length=SPEC.max_length)
    filler = filler_pair(json_lines_dataset([str(DATA)], {}).take(4), processor, SPEC, DATA.parent, str(DATA))
    streamed = StreamImagePairCollator(processor, 0, DATA.parent, str(DATA), filler)
    mapped = ImagePairCollator(pairs, processor, 0)
    for start in (0, 4):
        micro_batch = [stream.next_row() for _ in range(4)]
        micro_batch = json.loads(json.dumps(micro_batch))
        ours, theirs = streamed(micro_batch), mapped(list(range(start, start + 4)))
        assert sorted(ours) == sorted(theirs) and "pixel_values" in ours and "rejected_input_ids" not in ours
        for key, value in theirs.items():
            assert torch.equal(ours[key], value), (start, key)


def test_a_streamed_pairs_file_names_its_bad_lines_and_gives_the_map_style_eval_set(processor, rows, pairs, tmp_path):
    """load_stream with the image-text model's processor on a .jsonl of pairs with a line that is not JSON and a pair
    whose chosen side is not one assistant message: the other pairs come in file order, as prepare_pairs encodes
    them; both bad lines are counted, the first named by file and line; the eval set is read as image pairs."""
    from hftrain.data.streaming import load_stream

    absolute = [{**row, "images": [str(DATA.parent / path) for path in row["images"]]} for row in rows[:6]]
    bad_pair = {**absolute[1], "chosen": [rows[1]["chosen"][0], rows[1]["chosen"][0]]}
    lines = [json.dumps(row) for row in absolute]
    lines[2:2] = ["{not json", json.dumps(bad_pair)]  # lines 3 and 4
    data = tmp_path / "pairs.jsonl"
    data.write_text("\n".join(lines) + "\n")
    recipe = Recipe(model_name_or_path=str(MODEL), dataset_name=str(data), objective="dpo", streaming=True,
                    max_steps=1, max_length=256, train_sampling_strategy="sequential", eval_strategy="steps",
                    eval_dataset_name=str(DATA))
    feed, evaluation, _ = load_stream(recipe, processor.tokenizer, rank=0, world=1, processor=processor)
    streamed = [feed.stream.next_row()[0] for _ in range(6)]
    assert [row["input_ids"] for row in streamed] == [pair["input_ids"] for pair in pairs.rows[:6]]
    assert [row["rejected_labels"] for row in streamed] == [pair["rejected_labels"] for pair in pairs.rows[:6]]
    assert (feed.stream.counts["examples"], feed.stream.counts["bad"]) == (8, 2)
    assert feed.stream.first_bad.startswith(f"pass 1, example 2: {data}, line 3")
    assert isinstance(evaluation, ImagePairs) and len(evaluation) == len(pairs)


def test_simpo_loss_of_a_micro_batch_equals_plain_pytorch(processor, rows, pairs):
    """simpo (reference-free, beta 2, gamma 0.5): the length-normalised margin of the same independent log-probs."""
    batch = ImagePairCollator(pairs, processor, processor.tokenizer.pad_token_id)([2, 3])
    batch.pop("num_examples")
    policy = AutoModelForImageTextToText.from_pretrained(MODEL).eval()
    recipe = Recipe(model_name_or_path=str(MODEL), dataset_name=str(DATA), objective="simpo", beta=2.0,
                    simpo_gamma=0.5)
    with torch.no_grad():
        ours = PreferenceLoss(policy, recipe, None)(**batch)
        expected = 0.0
        for i in (2, 3):
            (c, nc), (r, nr) = (side_log_prob(policy, processor, rows[i], side, length=True)
                                for side in ("chosen", "rejected"))
            expected = expected - F.logsigmoid(2.0 * (c / nc - r / nr - 0.5 / 2.0))
    assert ours.item() == pytest.approx(float(expected), rel=1e-5)


def test_orpo_loss_of_a_micro_batch_equals_plain_pytorch(processor, rows, pairs):
    """orpo (beta 0.1) on 2 pairs: the chosen rows' NLL token mean over every real token after the first except the
    image tokens (TRL's NLL, prompt included; image tokens are never trained), minus beta x the mean log sigmoid of
    the log odds of the mean completion log-probs; from the same independent encodings. The step's NLL tokens come
    from `prepare_step`, as in training."""
    from hftrain.objectives.orpo import ORPOLoss

    picked = [0, 3]
    batch = ImagePairCollator(pairs, processor, processor.tokenizer.pad_token_id)(picked)
    batch.pop("num_examples")
    assert batch["image_tokens"].sum() == 2 * IMAGE_TOKENS * sum(len(rows[i]["images"]) for i in picked)
    policy = AutoModelForImageTextToText.from_pretrained(MODEL)
    recipe = Recipe(model_name_or_path=str(MODEL), dataset_name=str(DATA), objective="orpo", beta=0.1)
    loss = ORPOLoss(policy, recipe).train()
    loss.prepare_step(loss, [batch], lambda x: x)
    image_id, end_id = (processor.tokenizer.convert_tokens_to_ids(t) for t in ("<image>", "<|im_end|>"))
    with torch.no_grad():
        ours = loss(**batch) / len(picked)
        nll, tokens, ratio = 0.0, 0, 0.0
        for i in picked:
            row = rows[i]
            (c, nc), (r, nr) = (side_log_prob(policy, processor, row, side, length=True)
                                for side in ("chosen", "rejected"))
            log_odds = (c / nc - r / nr) - (torch.log1p(-torch.exp(c / nc)) - torch.log1p(-torch.exp(r / nr)))
            ratio = ratio + F.logsigmoid(log_odds)
            prompt = [{"role": "user", "content": [*[{"type": "image"}] * len(row["images"]),
                                                    {"type": "text", "text": row["prompt"][0]["content"]}]}] \
                if isinstance(row["prompt"][0]["content"], str) else row["prompt"]
            inputs = processor(text=[processor.apply_chat_template([*prompt, *row["chosen"]], tokenize=False)],
                               images=[open_image(p, DATA.parent, "test") for p in row["images"]],
                               return_tensors="pt", add_special_tokens=False)
            ids = inputs["input_ids"][0].tolist()
            logps = policy(**inputs).logits[0].float().log_softmax(-1)
            end = max(k for k, t in enumerate(ids) if t == end_id)
            for k in range(1, end + 1):
                if ids[k] != image_id:
                    nll, tokens = nll - logps[k - 1, ids[k]], tokens + 1
        expected = nll / tokens - 0.1 * ratio / len(picked)
    assert ours.item() == pytest.approx(float(expected), rel=1e-5)


def test_the_preview_shows_both_sides_of_each_pair(capsys, rows):
    """python -m hftrain.data --show on recipes/tiny-vlm-dpo.yaml: each pair's chosen and rejected side, its image
    tokens collapsed, only the answer marked as trained; the statistics count the pairs and their images."""
    from hftrain.data.__main__ import preview

    preview(["--config", str(REPO / "recipes" / "tiny-vlm-dpo.yaml"), "--validation_split_percentage", "0",
             "--show", "2"])
    out = capsys.readouterr().out
    for i in (0, 1):
        for side in ("chosen", "rejected"):
            block = out.split(f"--- pair {i}, {side} side")[1].split("---")[0]
            assert re.findall("⟦(.*?)⟧", block, flags=re.S) == [answer(rows[i][side]) + "<|im_end|>"]
            assert f"<image>x{IMAGE_TOKENS * len(rows[i]['images'])}" in block
    assert f"{len(rows)} examples kept with {sum(len(r['images']) for r in rows)} images" in out
    assert "masks: each side's completion" in out


QWEN_VL = pytest.mark.skipif(not is_torchvision_available(), reason="the Qwen-VL families' processors need "
                             "torchvision, which is not installed here; make test-newest runs them")


@pytest.mark.parametrize("arch", ["gemma3", "idefics3", pytest.param("qwen2_vl", marks=QWEN_VL),
                                  pytest.param("qwen2_5_vl", marks=QWEN_VL), pytest.param("qwen3_vl", marks=QWEN_VL)])
def test_dpo_loss_equals_plain_pytorch_for_other_families(arch, image_text_model, rows):
    """The tiny Gemma 3 (token_type_ids per token: the rejected row's are built from the chosen row's prompt),
    Idefics3 (tiles per row, pixel_attention_mask) and, where torchvision is installed, Qwen2-VL / Qwen2.5-VL /
    Qwen3-VL (grid-sized image tokens; pixel_values the images' flat patches with image_grid_thw, and
    mm_token_type_ids: the rejected rows read the same patches) built by scripts/make_tiny_model.py: dpo's loss on a
    collated micro-batch equals the formula on log-probs of independent encodings of each side (the processor on the
    template's text for prompt + completion; trained: the tokens after the prompt rendered with the generation
    prompt, through the last one that is not whitespace), against a reference that differs from the policy."""
    folder = image_text_model(arch)
    try:
        processor = AutoProcessor.from_pretrained(folder)
    except ValueError as e:  # transformers 5.17 marks Idefics3's Pillow image processor as needing torchvision too
        if is_torchvision_available() or "Missing optional dependencies: torchvision" not in str(e):
            raise
        pytest.skip(f"transformers {transformers.__version__} builds {arch}'s processor only with torchvision (5.23 "
                    f"does without): {str(e)[:200]}")
    picked = [0, 1, 3]
    pairs = prepare_pairs([dict(rows[i]) for i in picked], processor, SPEC, str(DATA))[0]
    batch = ImagePairCollator(pairs, processor, processor.tokenizer.pad_token_id)([0, 1, 2])
    batch.pop("num_examples")
    torch.manual_seed(0)
    policy = AutoModelForImageTextToText.from_pretrained(folder).eval()
    reference = AutoModelForImageTextToText.from_pretrained(folder).eval()
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(torch.randn_like(p) * 0.05)

    def log_prob(model, row, side) -> torch.Tensor:
        prompt = row["prompt"]
        if isinstance(prompt[0]["content"], str):
            prompt = [{"role": "user", "content": [*[{"type": "image"}] * len(row["images"]),
                                                    {"type": "text", "text": prompt[0]["content"]}]}]
        images = [open_image(path, DATA.parent, "test") for path in row["images"]]
        head = processor(text=[processor.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)],
                         images=images, return_tensors="pt", add_special_tokens=False)["input_ids"][0].tolist()
        inputs = processor(text=[processor.apply_chat_template([*prompt, *row[side]], tokenize=False)],
                           images=images, return_tensors="pt", add_special_tokens=False)
        ids = inputs["input_ids"][0].tolist()
        assert ids[:len(head)] == head
        end = max(k for k, t in enumerate(ids) if processor.tokenizer.decode([t]).strip())
        logps = model(**inputs).logits[0].float().log_softmax(-1)
        return sum(logps[k - 1, ids[k]] for k in range(len(head), end + 1))

    recipe = Recipe(model_name_or_path=str(folder), dataset_name=str(DATA), objective="dpo", beta=0.1)
    loss = PreferenceLoss(policy, recipe, FrozenReference(ReferenceLogProbs(reference, False), torch.device("cpu")))
    with torch.no_grad():
        ours = loss(**batch)
        expected = 0.0
        for i in picked:
            delta = ((log_prob(policy, rows[i], "chosen") - log_prob(reference, rows[i], "chosen"))
                     - (log_prob(policy, rows[i], "rejected") - log_prob(reference, rows[i], "rejected")))
            expected = expected - F.logsigmoid(0.1 * delta)
    assert ours.item() == pytest.approx(float(expected), rel=1e-5)
    if arch == "gemma3":
        assert batch["token_type_ids"].sum() > 0
