"""Tokenization with exact loss masks, the batch plan, evaluation shards and the collator."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers import AutoTokenizer

from hftrain.config import Recipe
from hftrain.data import (
    IGNORE_INDEX,
    BatchPlan,
    Collator,
    detect_format,
    eval_micro_batches,
    make_loader,
    tokenize_dataset,
    tokenize_example,
)
from hftrain.errors import HftrainError

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "models" / "tiny-llama"
END = "<|im_end|>"

THREE_TURNS = [
    {"role": "system", "content": "You answer in one line."},
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": " Blue, like the sky."},  # leading space
    {"role": "user", "content": "And a café?\nJust one."},  # non-ASCII and a newline
    {"role": "assistant", "content": "Café de Flore."},
    {"role": "user", "content": "Count to three."},
    {"role": "assistant", "content": "1\n2\n3"},
]


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(str(MODEL))


@pytest.fixture(scope="module")
def chat_rows():
    with open(REPO / "data" / "chat.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def encode(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def expected_chat(tok, messages: list[dict], assistant_only: bool = True) -> tuple[list[int], list[int]]:
    """input_ids and labels built piece by piece from a hand-written ChatML rendering.

    Each message is `<|im_start|>{role}\\n` + content + `<|im_end|>` + `\\n`; only an assistant's content and
    its `<|im_end|>` are trained. Pieces are tokenized separately (the ChatML markers are special tokens and
    the newline after the role is its own pre-token, so this matches tokenizing the whole text).
    """
    ids, trained = [], []
    for m in messages:
        is_answer = m["role"] == "assistant" or not assistant_only
        for piece, keep in ((f"<|im_start|>{m['role']}\n", not assistant_only), (m["content"], is_answer),
                            (END, is_answer), ("\n", not assistant_only)):
            piece_ids = encode(tok, piece)
            ids += piece_ids
            trained += [keep] * len(piece_ids)
    labels = [i if keep else IGNORE_INDEX for i, keep in zip(ids, trained)]
    labels[0] = IGNORE_INDEX
    return ids, labels


def trained_runs(labels: list[int]) -> list[list[int]]:
    """Maximal runs of consecutive trained labels."""
    runs = []
    for keep, group in itertools.groupby(labels, key=lambda x: x != IGNORE_INDEX):
        if keep:
            runs.append(list(group))
    return runs


def decode(tok, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def chat(messages, recipe=None, tok=None):
    return tokenize_example({"messages": messages}, tok, recipe or Recipe(max_length=512), "messages")


# --------------------------------------------------------------------------- chat masks
def test_handwritten_rendering_matches_the_template(tok):
    rendered = tok.apply_chat_template(THREE_TURNS, tokenize=False)
    by_hand = "".join(f"<|im_start|>{m['role']}\n{m['content']}{END}\n" for m in THREE_TURNS)
    assert rendered == by_hand


def check_chat_example(tok, messages):
    out = chat(messages, tok=tok)
    ids, labels = expected_chat(tok, messages)
    assert out["input_ids"] == ids
    assert out["labels"] == labels
    assert out["num_trained"] == sum(lbl != IGNORE_INDEX for lbl in labels)
    assert out["num_truncated"] == 0
    answers = [m["content"] for m in messages if m["role"] == "assistant"]
    runs = trained_runs(out["labels"])
    assert [decode(tok, r) for r in runs] == [a + END for a in answers]
    assert decode(tok, [lbl for lbl in out["labels"] if lbl != IGNORE_INDEX]) == "".join(a + END for a in answers)
    untrained = decode(tok, [i for i, lbl in zip(out["input_ids"], out["labels"]) if lbl == IGNORE_INDEX])
    for m in messages:
        if m["role"] != "assistant":
            assert m["content"] in untrained  # prompt text is present but never trained
    assert out["labels"][0] == IGNORE_INDEX


def test_handmade_three_turn_conversation(tok):
    check_chat_example(tok, THREE_TURNS)


def test_shipped_chat_examples_of_every_shape(tok, chat_rows):
    seen = {}
    for row in chat_rows:
        shape = tuple(m["role"] for m in row["messages"])
        seen.setdefault(shape, row["messages"])
    assert any(s[0] == "system" for s in seen) and any(s.count("assistant") >= 3 for s in seen)
    for messages in seen.values():
        check_chat_example(tok, messages)


def test_all_shipped_chat_examples(tok, chat_rows):
    for row in chat_rows[::7]:
        out = chat(row["messages"], tok=tok)
        assert (out["input_ids"], out["labels"]) == expected_chat(tok, row["messages"])


def test_labels_are_input_ids_where_trained(tok):
    out = chat(THREE_TURNS, tok=tok)
    assert len(out["labels"]) == len(out["input_ids"])
    assert all(lbl in (IGNORE_INDEX, i) for i, lbl in zip(out["input_ids"], out["labels"]))


def test_conversation_opening_with_the_assistant(tok):
    # A greeting-first conversation: the template renders it, so its answer tokens can be located.
    messages = [{"role": "assistant", "content": "Hello, how can I help?"},
                {"role": "user", "content": "Add 2 and 2."}, {"role": "assistant", "content": "4."}]
    out = chat(messages, tok=tok)
    assert (out["input_ids"], out["labels"]) == expected_chat(tok, messages)


def test_without_assistant_only_loss_everything_but_the_first_token_is_trained(tok):
    out = chat(THREE_TURNS, Recipe(max_length=512, assistant_only_loss=False), tok)
    ids, _ = expected_chat(tok, THREE_TURNS)
    assert out["input_ids"] == ids
    assert out["labels"] == [IGNORE_INDEX] + ids[1:]
    assert out["num_trained"] == len(ids) - 1


def test_template_that_is_not_prefix_stable(tok):
    odd = AutoTokenizer.from_pretrained(str(MODEL))
    # the header depends on the number of messages: earlier text changes as the conversation grows
    odd.chat_template = ("{{ messages|length }} messages\n{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                         "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    messages = THREE_TURNS[1:3]
    with pytest.raises(HftrainError, match="prefix by prefix"):
        chat(messages, Recipe(max_length=512), odd)
    # the error suggests assistant_only_loss=false, which needs no spans: it must then work
    out = chat(messages, Recipe(max_length=512, assistant_only_loss=False), odd)
    text = odd.apply_chat_template(messages, tokenize=False)
    assert out["input_ids"] == encode(tok, text)
    assert out["labels"] == [IGNORE_INDEX] + out["input_ids"][1:]


@pytest.mark.parametrize("messages,problem", [
    ([], "non-empty"),
    ([{"role": "tool", "content": "x"}], "role"),
    ([{"role": "user", "content": 3}], "content"),
    ("not a list", "non-empty"),
])
def test_bad_messages_are_reported(tok, messages, problem):
    with pytest.raises(HftrainError, match=problem):
        chat(messages, tok=tok)


# -------------------------------------------------------------------------- truncation
def test_truncation_keeps_labels_aligned(tok):
    full_ids, full_labels = expected_chat(tok, THREE_TURNS)
    n = len(full_ids)
    first_trained = next(i for i, lbl in enumerate(full_labels) if lbl != IGNORE_INDEX)
    boundaries = sorted({2, 3, first_trained, first_trained + 1, n // 2, n - 1, n, n + 5})
    for max_length in boundaries:
        out = chat(THREE_TURNS, Recipe(max_length=max_length), tok)
        keep = min(max_length, n)
        assert len(out["input_ids"]) == len(out["labels"]) == keep
        assert out["input_ids"] == full_ids[:keep]
        assert out["labels"] == full_labels[:keep]
        assert out["num_truncated"] == max(0, n - max_length)
        assert out["num_trained"] == sum(lbl != IGNORE_INDEX for lbl in full_labels[:keep])


def test_untrainable_examples_are_dropped_and_counted(tok):
    short = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    long_prompt = [{"role": "user", "content": "word " * 80}, {"role": "assistant", "content": "Yes."}]
    three_labels = expected_chat(tok, THREE_TURNS)[1]
    max_length = next(i for i, lbl in enumerate(three_labels) if lbl != IGNORE_INDEX) + 3  # 3 answer tokens kept
    assert len(expected_chat(tok, short)[0]) <= max_length < len(three_labels)
    assert len(encode(tok, f"<|im_start|>user\n{'word ' * 80}")) > max_length  # answer fully cut away
    raw = Dataset.from_list([{"messages": short}, {"messages": long_prompt}, {"messages": THREE_TURNS},
                             {"messages": short}])
    recipe = Recipe(max_length=max_length)
    data, stats = tokenize_dataset(raw, tok, recipe, "train")
    assert stats["format"] == "messages"
    assert stats["dropped_untrainable"] == 1
    assert stats["examples"] == len(data) == 3
    assert stats["truncated_examples"] == 2  # the long prompt and the three-turn conversation
    expected = [expected_chat(tok, m) for m in (short, THREE_TURNS, short)]
    assert data["input_ids"] == [ids[:max_length] for ids, _ in expected]
    assert data["labels"] == [labels[:max_length] for _, labels in expected]
    assert stats["trained_tokens"] == sum(sum(x != IGNORE_INDEX for x in labels[:max_length]) for _, labels in expected)
    assert data.column_names == ["input_ids", "labels"]


def test_every_example_masked_is_an_error(tok):
    no_answer = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    raw = Dataset.from_list([{"messages": no_answer}, {"messages": no_answer}])
    with pytest.raises(HftrainError, match="no trained token"):
        tokenize_dataset(raw, tok, Recipe(max_length=64), "train")


def test_chat_data_needs_a_chat_template(tok):
    plain = AutoTokenizer.from_pretrained(str(MODEL))
    plain.chat_template = None
    raw = Dataset.from_list([{"messages": THREE_TURNS[1:3]}])
    with pytest.raises(HftrainError, match="chat template"):
        tokenize_dataset(raw, plain, Recipe(), "train")


# --------------------------------------------------------------------------------- text
@pytest.mark.parametrize("text", ["What is 4 + 1? 4 + 1 = 5.", "ends with the marker" + END, "x"])
def test_text_appends_eos_exactly_once(tok, text):
    out = tokenize_example({"text": text}, tok, Recipe(max_length=512), "text")
    ids = out["input_ids"]
    body = tok(text)["input_ids"]
    assert ids[-1] == tok.eos_token_id
    assert ids.count(tok.eos_token_id) == 1
    assert ids == (body if body[-1] == tok.eos_token_id else body + [tok.eos_token_id])
    assert decode(tok, ids) == (text if text.endswith(END) else text + END)
    assert out["labels"] == [IGNORE_INDEX] + ids[1:]


def test_text_dataset(tok):
    rows = [{"text": "one two"}, {"text": ""}, {"text": "three"}]
    data, stats = tokenize_dataset(Dataset.from_list(rows), tok, Recipe(max_length=512), "train")
    assert stats["format"] == "text"
    assert stats["dropped_untrainable"] == 1  # "" is only EOS, and the first label is never a target
    assert data["input_ids"] == [encode(tok, "one two") + [tok.eos_token_id], encode(tok, "three") + [tok.eos_token_id]]
    assert stats["trained_tokens"] == sum(len(ids) - 1 for ids in data["input_ids"])


# ------------------------------------------------------------------------------- format
def test_detect_format():
    recipe = Recipe()
    assert detect_format(["messages", "text"], recipe) == "messages"
    assert detect_format(["text", "id"], recipe) == "text"
    assert detect_format(["conv"], Recipe(dataset_messages_field="conv")) == "messages"
    with pytest.raises(HftrainError) as info:
        detect_format(["prompt", "completion"], recipe)
    message = str(info.value)
    for name in ("prompt", "completion", "messages", "text", "dataset_messages_field", "dataset_text_field"):
        assert name in message


# --------------------------------------------------------------------------- batch plan
PLANS = [  # (num_examples, micro_batch, world, accum)
    (20, 2, 1, 1), (20, 2, 2, 2), (23, 2, 2, 2), (17, 3, 2, 1), (17, 1, 3, 2), (5, 4, 2, 3), (64, 4, 2, 4),
]


def per_step(plan: BatchPlan, epoch: int, start_step: int = 0) -> list[list[list[int]]]:
    """steps[s] = every micro-batch of step s, over all ranks; checks each rank gets `accum` per step."""
    by_rank = [list(plan.micro_batches(epoch, rank, start_step)) for rank in range(plan.world)]
    n_steps = plan.steps_per_epoch - start_step
    for batches in by_rank:
        assert len(batches) == n_steps * plan.accum
    return [[mb for batches in by_rank for mb in batches[s * plan.accum:(s + 1) * plan.accum]]
            for s in range(n_steps)]


@pytest.mark.parametrize("n,b,world,accum", PLANS)
def test_sequential_steps_cover_consecutive_ranges(n, b, world, accum):
    plan = BatchPlan(n, b, world, accum, seed=0, shuffle=False)
    g = b * world * accum
    assert plan.global_batch == g and plan.steps_per_epoch == math.ceil(n / g)
    steps = per_step(plan, epoch=0)
    for s, micro in enumerate(steps):
        flat = [i for mb in micro for i in mb]
        assert len(flat) == len(set(flat))
        assert sorted(flat) == list(range(s * g, min((s + 1) * g, n)))
        assert all(len(mb) <= b for mb in micro)


@pytest.mark.parametrize("n,b,world,accum", PLANS)
def test_shuffled_epochs_are_permutations(n, b, world, accum):
    plan = BatchPlan(n, b, world, accum, seed=3, shuffle=True)
    for epoch in range(3):
        flat = [i for micro in per_step(plan, epoch) for mb in micro for i in mb]
        assert sorted(flat) == list(range(n))


def test_shuffle_depends_only_on_seed_and_epoch():
    def order(seed, epoch, b=2, world=1, accum=1):
        return BatchPlan(50, b, world, accum, seed=seed, shuffle=True).epoch_order(epoch)

    assert order(7, 0) == order(7, 0)
    assert order(7, 0) == order(7, 0, b=5, world=2, accum=3)  # not on the batch layout
    assert order(7, 0) != order(7, 1)
    assert order(7, 0) != order(8, 0)
    assert order(7, 1) != list(range(50))
    assert sorted(order(7, 1)) == list(range(50))


def test_same_examples_per_step_for_accumulation_and_processes():
    one_proc = BatchPlan(30, 2, 1, 4, seed=1, shuffle=True)
    four_proc = BatchPlan(30, 2, 4, 1, seed=1, shuffle=True)
    a, b = per_step(one_proc, 2), per_step(four_proc, 2)
    assert [sorted(i for mb in m for i in mb) for m in a] == [sorted(i for mb in m for i in mb) for m in b]


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("n,b,world,accum", PLANS)
def test_start_step_skips_whole_steps(n, b, world, accum, shuffle):
    plan = BatchPlan(n, b, world, accum, seed=5, shuffle=shuffle)
    for rank in range(world):
        full = list(plan.micro_batches(1, rank))
        for k in range(plan.steps_per_epoch + 1):
            assert list(plan.micro_batches(1, rank, start_step=k)) == full[k * accum:]


def test_short_last_step_has_empty_slots():
    plan = BatchPlan(num_examples=10, micro_batch=2, world=2, accum=2, seed=0, shuffle=False)
    rank0, rank1 = list(plan.micro_batches(0, 0)), list(plan.micro_batches(0, 1))
    # step 0: rank r, micro-batch j takes [(j*world + r)*b, +b) of examples 0..7
    assert rank0 == [[0, 1], [4, 5], [8, 9], []]
    assert rank1 == [[2, 3], [6, 7], [], []]


# ------------------------------------------------------------------------------- eval
@pytest.mark.parametrize("n,b,world", [(10, 3, 1), (10, 3, 2), (7, 2, 3), (2, 4, 3), (12, 2, 2), (1, 1, 4)])
def test_eval_shards(n, b, world):
    shards = [eval_micro_batches(n, b, world, rank) for rank in range(world)]
    counts = {len(s) for s in shards}
    assert counts == {math.ceil(n / (b * world))}
    flat = [i for s in shards for mb in s for i in mb]
    assert sorted(flat) == list(range(n))  # disjoint and complete
    assert all(len(mb) <= b for s in shards for mb in s)


# ------------------------------------------------------------------------------ collator
@pytest.fixture
def rows():
    return Dataset.from_list([
        {"input_ids": [5, 6, 7], "labels": [IGNORE_INDEX, 6, 7]},
        {"input_ids": [8], "labels": [IGNORE_INDEX]},
        {"input_ids": [9, 10], "labels": [IGNORE_INDEX, IGNORE_INDEX]},
    ])


def test_collator_right_pads(rows):
    batch = Collator(rows, pad_token_id=1)([1, 0, 2])
    assert batch["input_ids"].dtype == torch.long and batch["labels"].dtype == torch.long
    assert batch["input_ids"].tolist() == [[8, 1, 1], [5, 6, 7], [9, 10, 1]]
    assert batch["labels"].tolist() == [[IGNORE_INDEX] * 3, [IGNORE_INDEX, 6, 7], [IGNORE_INDEX] * 3]


def test_collator_empty_micro_batch(rows):
    batch = Collator(rows, pad_token_id=1)([])
    assert batch["input_ids"].tolist() == [[1]]
    assert batch["labels"].tolist() == [[IGNORE_INDEX]]


def test_loader_yields_collated_index_lists(rows):
    collator = Collator(rows, pad_token_id=0)
    plan = [[0], [], [2, 1]]
    batches = list(make_loader(plan, collator, num_workers=0))
    assert len(batches) == 3
    for got, indices in zip(batches, plan):
        want = collator(indices)
        assert torch.equal(got["input_ids"], want["input_ids"]) and torch.equal(got["labels"], want["labels"])
