"""kto with images (hftrain.data.image_unpaired) on the shipped tiny LLaVA, rows unpaired from data/image-pairs.jsonl:
masks, the KL rows (each row's prompt and pixels with its partner's completion), one processor call per row, and
kto's loss on a collated micro-batch against a plain PyTorch computation on independent encodings; accumulation
(two micro-batches) equals one."""

import json

import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

from hftrain.config import Recipe
from hftrain.data.image_unpaired import ImageKTOCollator, prepare_unpaired
from hftrain.data.tokenize import IGNORE_INDEX, DataSpec
from hftrain.objectives.kto import KTOLoss
from hftrain.objectives.reference import FrozenReference, ReferenceLogProbs
from tests.conftest import REPO
from tests.unit.test_data_image_pairs import CountingProcessor, answer, side_log_prob

MODEL = REPO / "models" / "tiny-vlm"
DATA = REPO / "data" / "image-pairs.jsonl"
SPEC = DataSpec("text", "messages", assistant_only_loss=True, completion_only_loss=True, max_length=256,
                overlong_examples="truncate")


@pytest.fixture(scope="module")
def processor():
    return AutoProcessor.from_pretrained(MODEL)


@pytest.fixture(scope="module")
def raw() -> list[dict]:
    """The first 4 pairs as 8 unpaired rows (TRL's unpairing: chosen desirable, rejected not), in that order."""
    pairs = [json.loads(line) for line in DATA.read_text().splitlines()[:4]]
    return [{"prompt": p["prompt"], "completion": p[side], "label": side == "chosen", "images": p["images"]}
            for p in pairs for side in ("chosen", "rejected")]


@pytest.fixture(scope="module")
def data(processor, raw):
    return prepare_unpaired([dict(row) for row in raw], processor, SPEC, str(DATA))[0]


def test_rows_train_their_completion_and_kl_rows_hold_the_prompt_and_pixels_of_their_row(processor, raw, data):
    """Each row trains its answer and <|im_end|>, never an image token; a KL row is its row's prompt tokens (image
    expansions included) followed by the partner's completion, trained on that completion; the micro-batch holds one
    image encoding per row (one processor call with images each), which the KL rows read."""
    image_id = processor.tokenizer.convert_tokens_to_ids("<image>")
    for source, row in zip(raw, data.rows):
        trained = [t for t in row["labels"] if t != IGNORE_INDEX]
        assert processor.tokenizer.decode(trained) == answer(source["completion"]) + "<|im_end|>"
        assert all(label == IGNORE_INDEX for t, label in zip(row["input_ids"], row["labels"]) if t == image_id)
    assert data["desirable"] == [True, False] * 4

    items = [(0, 7), (3, 0), (6, 3)]  # row 6 (pair 3) has two images
    counting = CountingProcessor(processor)
    batch = ImageKTOCollator(data, counting, processor.tokenizer.pad_token_id)(items)
    assert counting.image_calls == 3 and int(batch["num_examples"]) == 3
    assert batch["pixel_values"].shape[0] == sum(len(raw[i]["images"]) for i, _ in items) == 4
    assert batch["desirable"].tolist() == [True, False, True]
    assert not any(key.startswith("kl_pixel") for key in batch)
    for r, (row, partner) in enumerate(items):
        start, other = data.rows[row]["prompt_length"], data.rows[partner]
        kl_ids = batch["kl_input_ids"][r][batch["kl_attention_mask"][r].bool()].tolist()
        assert kl_ids == data.rows[row]["input_ids"][:start] + other["input_ids"][other["prompt_length"]:]
        assert kl_ids.count(image_id) == 16 * len(raw[row]["images"])  # this row's images, not the partner's
        kl_trained = [t for t in batch["kl_labels"][r].tolist() if t != IGNORE_INDEX]
        assert processor.tokenizer.decode(kl_trained) == answer(raw[partner]["completion"]) + "<|im_end|>"


def test_kto_loss_of_micro_batches_equals_plain_pytorch_and_accumulation_one_batch(processor, raw, data):
    """kto (beta 0.1, desirable_weight 1.5) against a reference that differs from the policy: the KL reference point
    and the summed loss of one collated micro-batch equal TRL's formulas on log-probs from independent encodings
    (each row and each KL row through the processor on its own, with its prompt's images); the same rows as two
    micro-batches give the same reference point and losses that add up to it."""
    items = [(0, 7), (3, 0), (6, 3), (1, 6)]
    collator = ImageKTOCollator(data, processor, processor.tokenizer.pad_token_id)
    torch.manual_seed(0)
    policy = AutoModelForImageTextToText.from_pretrained(MODEL).eval()
    reference = AutoModelForImageTextToText.from_pretrained(MODEL).eval()
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    recipe = Recipe(model_name_or_path=str(MODEL), dataset_name=str(DATA), objective="kto", loss_type="kto",
                    beta=0.1, desirable_weight=1.5)
    loss = KTOLoss(policy, recipe, FrozenReference(ReferenceLogProbs(reference, False), torch.device("cpu")))

    def run(batches):
        batches = [{k: v for k, v in collator(b).items() if k != "num_examples"} for b in batches]
        with torch.no_grad():
            sums = loss.kl_sums(loss, batches, lambda x: x)
            loss.set_kl(sums)
            return sums.tolist(), float(loss.kl), sum(float(loss(**b)) for b in batches)

    with torch.no_grad():
        def ratio(i, completion):
            row = {"prompt": raw[i]["prompt"], "images": raw[i]["images"], "side": raw[completion]["completion"]}
            return side_log_prob(policy, processor, row, "side") - side_log_prob(reference, processor, row, "side")
        kl_sum = sum(float(ratio(i, j)) for i, j in items)
        z = max(0.0, kl_sum / len(items))
        expected = 0.0
        for i, _ in items:
            r = float(ratio(i, i))
            expected += 1.5 * (1 - torch.sigmoid(torch.tensor(0.1 * (r - z)))) if raw[i]["label"] else \
                1 - torch.sigmoid(torch.tensor(0.1 * (z - r)))
    sums, one_kl, one = run([items])
    assert sums == pytest.approx([kl_sum, len(items)], rel=1e-4)
    assert one_kl == pytest.approx(z, rel=1e-4, abs=1e-6)
    assert one == pytest.approx(float(expected), rel=1e-5)
    two_sums, two_kl, two = run([items[:2], items[2:]])
    assert two_sums == pytest.approx(sums, rel=1e-5) and two_kl == pytest.approx(one_kl, rel=1e-5, abs=1e-7)
    assert two == pytest.approx(one, rel=1e-5)


def test_the_preflight_takes_kto_with_images_and_refuses_what_is_not_done():
    from hftrain.preflight import model_problems

    def problems(**fields):
        return model_problems(Recipe(model_name_or_path=str(MODEL), dataset_name=str(DATA), objective="kto",
                                     **fields))[1]

    assert problems() == []
    refused = problems(precompute_ref_log_probs=True)
    assert [p for p in refused if p.startswith("precompute_ref_log_probs with objective=kto on image preference rows")]


def test_the_preview_shows_each_row_with_its_completion_trained(capsys):
    """python -m hftrain.data --show on recipes/tiny-vlm-kto.yaml: each row's image tokens collapsed, only its
    completion marked as trained; the statistics count the rows and their images."""
    import re

    from hftrain.data.__main__ import preview

    rows = [json.loads(line) for line in (REPO / "data" / "image-unpaired.jsonl").read_text().splitlines()]
    preview(["--config", str(REPO / "recipes" / "tiny-vlm-kto.yaml"), "--validation_split_percentage", "0",
             "--show", "2"])
    out = capsys.readouterr().out
    for i in (0, 1):
        block = out.split(f"--- example {i} ")[1].split("---")[0]
        assert re.findall("⟦(.*?)⟧", block, flags=re.S) == [answer(rows[i]["completion"]) + "<|im_end|>"]
        assert f"<image>x{16 * len(rows[i]['images'])}" in block
    assert f"(format image_unpaired): {len(rows)} examples kept with {sum(len(r['images']) for r in rows)} images" \
        in out
    assert "masks: each row's completion" in out
