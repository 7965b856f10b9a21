"""Tokenization with exact loss masks, the batch plan, evaluation shards and the collator."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch
from datasets import Dataset
from transformers import AutoTokenizer

from hftrain.config import Recipe
from hftrain.data import (
    IGNORE_INDEX,
    BatchPlan,
    Collator,
    DataSpec,
    detect_format,
    eval_micro_batches,
    make_loader,
    pack_best_fit_decreasing,
    prepare_chat_template,
    tokenize_dataset,
    tokenize_example,
)
from hftrain.data.streaming import StreamCollator
from hftrain.errors import HftrainError
from tests.conftest import REPO

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


def spec(**values) -> DataSpec:
    return DataSpec.from_recipe(Recipe(**{"max_length": 512, **values}))


def encode(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def expected_chat(tok, messages: list[dict], assistant_only: bool = True):
    """(input_ids, labels, token index after each assistant turn) from a hand-written ChatML rendering.

    Each message is `<|im_start|>{role}\\n` + content + `<|im_end|>` + `\\n`; only an assistant's content and
    its `<|im_end|>` are trained. Pieces are tokenized separately (the ChatML markers are special tokens and
    the newline after the role is its own pre-token, so this matches tokenizing the whole text).
    """
    ids, trained, turn_ends = [], [], []
    for m in messages:
        is_answer = m["role"] == "assistant" or not assistant_only
        for piece, keep in ((f"<|im_start|>{m['role']}\n", not assistant_only), (m["content"], is_answer),
                            (END, is_answer), ("\n", not assistant_only)):
            piece_ids = encode(tok, piece)
            ids += piece_ids
            trained += [keep] * len(piece_ids)
            if piece == END and m["role"] == "assistant":
                turn_ends.append(len(ids))
    labels = [i if keep else IGNORE_INDEX for i, keep in zip(ids, trained, strict=True)]
    labels[0] = IGNORE_INDEX
    return ids, labels, turn_ends


def trained_runs(labels: list[int]) -> list[list[int]]:
    """Maximal runs of consecutive trained labels."""
    runs = []
    for keep, group in itertools.groupby(labels, key=lambda x: x != IGNORE_INDEX):
        if keep:
            runs.append(list(group))
    return runs


def decode(tok, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def chat(messages, data_spec=None, tokenizer=None):
    return tokenize_example({"messages": messages}, 0, tokenizer, data_spec or spec(), "messages", "test")


def text_example(text, tokenizer, data_spec=None):
    return tokenize_example({"text": text}, 0, tokenizer, data_spec or spec(), "text", "test")


# --------------------------------------------------------------------------- chat masks
def test_handwritten_rendering_matches_the_template(tok):
    rendered = tok.apply_chat_template(THREE_TURNS, tokenize=False)
    by_hand = "".join(f"<|im_start|>{m['role']}\n{m['content']}{END}\n" for m in THREE_TURNS)
    assert rendered == by_hand


def check_chat_example(tok, messages):
    out = chat(messages, tokenizer=tok)
    ids, labels, _ = expected_chat(tok, messages)
    assert out["input_ids"] == ids
    assert out["labels"] == labels
    assert out["num_trained"] == sum(lbl != IGNORE_INDEX for lbl in labels)
    assert out["num_truncated"] == 0 and out["dropped"] == ""
    answers = [m["content"] for m in messages if m["role"] == "assistant"]
    runs = trained_runs(out["labels"])
    assert [decode(tok, r) for r in runs] == [a + END for a in answers]
    assert decode(tok, [lbl for lbl in out["labels"] if lbl != IGNORE_INDEX]) == "".join(a + END for a in answers)
    untrained = decode(tok, [i for i, lbl in zip(out["input_ids"], out["labels"], strict=True) if lbl == IGNORE_INDEX])
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
    for row in chat_rows:
        out = chat(row["messages"], tokenizer=tok)
        assert (out["input_ids"], out["labels"]) == expected_chat(tok, row["messages"])[:2]


def test_labels_are_input_ids_where_trained(tok):
    out = chat(THREE_TURNS, tokenizer=tok)
    assert len(out["labels"]) == len(out["input_ids"])
    assert all(lbl in (IGNORE_INDEX, i) for i, lbl in zip(out["input_ids"], out["labels"], strict=True))


def test_conversation_opening_with_the_assistant(tok):
    # A greeting that opens the conversation answers nothing: it is context, and only the later answer trains.
    messages = [{"role": "assistant", "content": "Hello, how can I help?"},
                {"role": "user", "content": "Add 2 and 2."}, {"role": "assistant", "content": "4."}]
    out = chat(messages, tokenizer=tok)
    ids, labels = expected_chat(tok, messages)[:2]
    assert out["input_ids"] == ids
    trained = tok.decode([t for t, lbl in zip(out["input_ids"], out["labels"]) if lbl != IGNORE_INDEX])
    assert trained == "4.<|im_end|>"


def test_without_assistant_only_loss_everything_but_the_first_token_is_trained(tok):
    out = chat(THREE_TURNS, spec(assistant_only_loss=False), tok)
    ids, _, _ = expected_chat(tok, THREE_TURNS)
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
        chat(messages, spec(), odd)
    # the error suggests assistant_only_loss=false, which needs no spans: it must then work
    out = chat(messages, spec(assistant_only_loss=False), odd)
    text = odd.apply_chat_template(messages, tokenize=False)
    assert out["input_ids"] == encode(tok, text)
    assert out["labels"] == [IGNORE_INDEX] + out["input_ids"][1:]


@pytest.mark.parametrize("messages,problem", [
    ([], "non-empty"),
    ([{"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"}], "role"),
    ([{"role": "user", "content": 3}, {"role": "assistant", "content": "y"}], "content"),
    ([{"role": "user", "content": "x"}], "no assistant"),
    ("not a list", "non-empty"),
])
def test_bad_messages_are_reported(tok, messages, problem):
    with pytest.raises(HftrainError, match=problem):
        chat(messages, tokenizer=tok)


# -------------------------------------------------------------------------- truncation
def test_truncation_keeps_labels_aligned(tok):
    full_ids, full_labels, turn_ends = expected_chat(tok, THREE_TURNS)
    n = len(full_ids)
    first_trained = next(i for i, lbl in enumerate(full_labels) if lbl != IGNORE_INDEX)
    boundaries = sorted({2, 3, first_trained, first_trained + 1, turn_ends[0], turn_ends[0] + 1, n // 2,
                         turn_ends[1], n - 1, n, n + 5})
    for max_length in boundaries:
        out = chat(THREE_TURNS, spec(max_length=max_length), tok)
        # documented policy: cut after the last complete assistant turn that fits, else at max_length
        fitting = [end for end in turn_ends if end <= max_length]
        keep = n if n <= max_length else (fitting[-1] if fitting else max_length)
        assert len(out["input_ids"]) == len(out["labels"]) == keep, max_length
        assert out["input_ids"] == full_ids[:keep]
        assert out["labels"] == full_labels[:keep]
        assert out["num_tokens"] == n
        trained = sum(lbl != IGNORE_INDEX for lbl in full_labels[:keep])
        assert out["num_trained"] == trained
        assert out["dropped"] == ("" if trained else "no_trained_tokens")
        assert out["num_truncated"] == (n - keep if trained else 0)


def test_truncated_answer_keeps_its_tokens_up_to_max_length(tok):
    messages = [{"role": "user", "content": "Go."}, {"role": "assistant", "content": "word " * 40}]
    ids, labels, _ = expected_chat(tok, messages)
    max_length = len(ids) - 5
    out = chat(messages, spec(max_length=max_length), tok)
    assert len(out["input_ids"]) == max_length  # no complete turn fits: cut at max_length
    assert out["labels"] == labels[:max_length]


def test_text_truncation(tok):
    text = "one two three four five six seven eight nine ten"
    full = encode(tok, text) + [tok.eos_token_id]
    for max_length in (2, 5, len(full) - 1, len(full), len(full) + 3):
        out = text_example(text, tok, spec(max_length=max_length))
        keep = min(max_length, len(full))
        assert out["input_ids"] == full[:keep]
        assert out["labels"] == [IGNORE_INDEX] + full[1:keep]
        assert out["num_truncated"] == len(full) - keep


def test_overlong_examples_dropped_on_request(tok):
    out = chat(THREE_TURNS, spec(max_length=10, overlong_examples="drop"), tok)
    assert out["dropped"] == "overlong" and out["num_trained"] == 0


def test_untrainable_examples_are_dropped_and_counted(tok):
    short = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    long_prompt = [{"role": "user", "content": "word " * 80}, {"role": "assistant", "content": "Yes."}]
    three_labels = expected_chat(tok, THREE_TURNS)[1]
    max_length = next(i for i, lbl in enumerate(three_labels) if lbl != IGNORE_INDEX) + 3  # 3 answer tokens kept
    assert len(expected_chat(tok, short)[0]) <= max_length < len(three_labels)
    assert len(encode(tok, f"<|im_start|>user\n{'word ' * 80}")) > max_length  # answer fully cut away
    raw = Dataset.from_list([{"messages": short}, {"messages": long_prompt}, {"messages": THREE_TURNS},
                             {"messages": short}])
    data, stats = tokenize_dataset(raw, tok, spec(max_length=max_length), "messages", "train")
    assert stats["format"] == "messages"
    assert stats["dropped_untrainable"] == 1
    assert stats["dropped_overlong"] == 0
    assert stats["examples"] == len(data) == 3
    assert stats["truncated_examples"] == 1  # the three-turn conversation (the dropped one is not counted)
    expected = [expected_chat(tok, m)[:2] for m in (short, THREE_TURNS, short)]
    assert data["input_ids"] == [ids[:max_length] for ids, _ in expected]
    assert data["labels"] == [labels[:max_length] for _, labels in expected]
    assert stats["trained_tokens"] == sum(sum(x != IGNORE_INDEX for x in labels[:max_length]) for _, labels in expected)
    assert stats["tokens"] == sum(len(ids[:max_length]) for ids, _ in expected)
    assert data.column_names == ["input_ids", "labels"]


def test_every_example_masked_is_an_error(tok):
    long_prompt = [{"role": "user", "content": "word " * 80}, {"role": "assistant", "content": "Yes."}]
    raw = Dataset.from_list([{"messages": long_prompt}, {"messages": long_prompt}])
    with pytest.raises(HftrainError, match="no trained token"):
        tokenize_dataset(raw, tok, spec(max_length=16), "messages", "train")


def test_chatml_fallback_for_a_tokenizer_without_template(tok):
    plain = AutoTokenizer.from_pretrained(str(MODEL))
    plain.chat_template = None
    plain.eos_token = "<|endoftext|>"
    note = prepare_chat_template(plain, None, needs_chat=True)
    assert note and "ChatML" in note
    assert plain.eos_token == END
    assert plain.apply_chat_template(THREE_TURNS, tokenize=False) == tok.apply_chat_template(THREE_TURNS,
                                                                                             tokenize=False)
    assert prepare_chat_template(tok, None, needs_chat=True) is None  # a template is kept as it is


# --------------------------------------------------------------------------------- text
@pytest.mark.parametrize("text", ["What is 4 + 1? 4 + 1 = 5.", "ends with the marker" + END, "x"])
def test_text_appends_eos_exactly_once(tok, text):
    out = text_example(text, tok)
    ids = out["input_ids"]
    body = tok(text)["input_ids"]
    assert ids[-1] == tok.eos_token_id
    assert ids.count(tok.eos_token_id) == 1
    assert ids == (body if body[-1] == tok.eos_token_id else body + [tok.eos_token_id])
    assert decode(tok, ids) == (text if text.endswith(END) else text + END)
    assert out["labels"] == [IGNORE_INDEX] + ids[1:]


def test_text_dataset(tok):
    rows = [{"text": "one two"}, {"text": "three"}]
    data, stats = tokenize_dataset(Dataset.from_list(rows), tok, spec(), "text", "train")
    assert stats["format"] == "text" and stats["dropped_untrainable"] == 0
    assert data["input_ids"] == [encode(tok, "one two") + [tok.eos_token_id], encode(tok, "three") + [tok.eos_token_id]]
    assert stats["trained_tokens"] == sum(len(ids) - 1 for ids in data["input_ids"])


def test_empty_text_is_reported(tok):
    with pytest.raises(HftrainError, match="non-empty text"):
        text_example("", tok)


# ------------------------------------------------------------------------------- format
def detect(columns, explicit="auto", text_field="text", messages_field="messages"):
    return detect_format(columns, explicit, text_field, messages_field, "my-data")


def test_detect_format():
    assert detect(["messages", "text"]) == "messages"
    assert detect(["text", "id"]) == "text"
    assert detect(["conv"], messages_field="conv") == "messages"
    assert detect(["prompt", "completion"]) == "prompt_completion"
    assert detect(["instruction", "input", "output"]) == "alpaca"
    assert detect(["conversations"]) == "sharegpt"
    assert detect(["messages", "text"], explicit="text") == "text"
    with pytest.raises(HftrainError) as info:
        detect(["question", "answer"])
    message = str(info.value)
    for name in ("question", "answer", "my-data", "messages", "text", "dataset_columns", "dataset_format"):
        assert name in message
    with pytest.raises(HftrainError, match="'text'"):
        detect(["messages"], explicit="text")


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
    assert batch["num_examples"].item() == 3
    assert "position_ids" not in batch


def test_collator_empty_micro_batch(rows):
    batch = Collator(rows, pad_token_id=1)([])
    assert batch["input_ids"].tolist() == [[1]]
    assert batch["labels"].tolist() == [[IGNORE_INDEX]]
    assert batch["num_examples"].item() == 0


def test_collator_packed_rows(rows):
    packed = Collator(rows, pad_token_id=1, rows=[[0, 1], [2]], packed=True)
    batch = packed([1, 0])
    assert batch["input_ids"].tolist() == [[9, 10, 1, 1], [5, 6, 7, 8]]
    assert batch["labels"].tolist() == [[IGNORE_INDEX] * 4, [IGNORE_INDEX, 6, 7, IGNORE_INDEX]]
    assert batch["position_ids"].tolist() == [[0, 1, 0, 1], [0, 1, 2, 0]]  # restart per example and in padding
    assert batch["num_examples"].item() == 3


def test_collator_marks_the_documents_of_the_flattened_micro_batch(rows):
    """mark_documents (varlen attention): int32 cumulative lengths over the micro-batch flattened row after row, each
    example a segment (a one-token one too) and each row's padding one more, a row that its examples fill ending
    without one; the longest segment as a Python int, so that no device sync reads it."""
    packed = Collator(rows, pad_token_id=1, rows=[[0, 1], [2]], packed=True)
    assert "cu_seq_lens_q" not in packed([1, 0])
    packed.mark_documents = True
    batch = packed([1, 0])  # row [2]: 2 tokens + 2 of padding; row [0, 1]: 3 + 1, filling the width of 4
    assert batch["cu_seq_lens_q"].tolist() == [0, 2, 4, 7, 8] and batch["cu_seq_lens_q"].dtype == torch.int32
    assert torch.equal(batch["cu_seq_lens_k"], batch["cu_seq_lens_q"])
    assert batch["max_length_q"] == batch["max_length_k"] == 3 and type(batch["max_length_q"]) is int
    empty = packed([])  # an epoch's short last step: the one-token filler row is one segment
    assert empty["cu_seq_lens_q"].tolist() == [0, 1] and empty["max_length_q"] == 1


def test_document_boundaries_are_where_position_ids_restart():
    """Random packings of examples of 1-9 tokens into rows of 12, several rows per micro-batch: the collator's
    boundaries are exactly the positions where the flattened position_ids restart at 0 (what transformers would scan
    them from), and the longest segment is the longest run."""
    g = torch.Generator().manual_seed(5)
    lengths = torch.randint(1, 10, (60,), generator=g).tolist()
    data = Dataset.from_dict({"input_ids": [[3] * n for n in lengths], "labels": [[3] * n for n in lengths]})
    bins = pack_best_fit_decreasing(lengths, 12)
    collator = Collator(data, pad_token_id=0, rows=bins, packed=True)
    collator.mark_documents = True
    for start in range(0, len(bins), 3):
        batch = collator(list(range(start, min(start + 3, len(bins)))))
        flat = batch["position_ids"].flatten()
        starts = (flat == 0).nonzero().flatten().tolist()
        assert batch["cu_seq_lens_q"].tolist() == starts + [len(flat)]
        assert batch["max_length_q"] == max(b - a for a, b in zip(starts, starts[1:] + [len(flat)]))


def test_stream_collator_marks_documents_too():
    collator = StreamCollator(0, packed=True, paired=False)
    collator.mark_documents = True
    batch = collator([[{"input_ids": [5, 6], "labels": [IGNORE_INDEX, 6]}, {"input_ids": [7], "labels": [7]}]])
    assert batch["cu_seq_lens_q"].tolist() == [0, 2, 3] and batch["max_length_q"] == 2


def test_the_loop_moves_tensors_and_keeps_host_numbers(rows):
    """The loader (pinned or not) and the loop's copy to the device keep max_length_q a Python int."""
    from hftrain.finetune import to_device

    packed = Collator(rows, pad_token_id=1, rows=[[0, 1], [2]], packed=True)
    packed.mark_documents = True
    (batch,) = list(make_loader([[0, 1]], packed, num_workers=0, pin_memory=True))
    moved = to_device(batch, torch.device("cpu"))
    assert moved["max_length_q"] == 3 and type(moved["max_length_q"]) is int
    assert torch.equal(moved["cu_seq_lens_q"], batch["cu_seq_lens_q"])


def naive_best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Longest first (ties: lower index); each into the open bin with the least room that still fits it
    (ties: the older bin), else a new bin."""
    bins, room = [], []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        fits = [b for b in range(len(bins)) if room[b] >= lengths[i]]
        if fits:
            b = min(fits, key=lambda b: (room[b], b))
        else:
            b = len(bins)
            bins.append([])
            room.append(capacity)
        bins[b].append(i)
        room[b] -= lengths[i]
    return bins


@pytest.mark.parametrize("lengths,capacity", [([5, 3, 2, 8, 1, 7], 8), ([4] * 7, 10), ([1], 1), ([], 4),
                                              ([6, 5, 4, 3, 2, 1, 9, 9, 2], 10), ([3, 7, 3, 7, 5, 5], 10)])
def test_best_fit_packing(lengths, capacity):
    bins = pack_best_fit_decreasing(lengths, capacity)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))  # each example exactly once
    assert all(b and sum(lengths[i] for i in b) <= capacity for b in bins)
    assert bins == naive_best_fit_decreasing(lengths, capacity)


def test_best_fit_packing_random():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 60, (300,), generator=g).tolist()
    bins = pack_best_fit_decreasing(lengths, 64)
    assert bins == naive_best_fit_decreasing(lengths, 64)
    assert len(bins) <= math.ceil(sum(lengths) / 64) * 1.25  # close to the lower bound


def test_packing_rejects_an_example_longer_than_a_row():
    with pytest.raises(ValueError):
        pack_best_fit_decreasing([3, 9], 8)


def test_loader_yields_collated_index_lists(rows):
    collator = Collator(rows, pad_token_id=0)
    plan = [[0], [], [2, 1]]
    batches = list(make_loader(plan, collator, num_workers=0, pin_memory=False))
    assert len(batches) == 3
    for got, indices in zip(batches, plan, strict=True):
        want = collator(indices)
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("cuda", [False, True])
def test_loader_pins_memory_only_when_asked_and_cuda_is_available(rows, monkeypatch, cuda):
    """dataloader_pin_memory: pinned batches only help host-to-GPU copies, so without CUDA the loader never pins."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    collator = Collator(rows, pad_token_id=0)
    assert make_loader([[0]], collator, num_workers=0, pin_memory=True).pin_memory is cuda
    assert make_loader([[0]], collator, num_workers=0, pin_memory=False).pin_memory is False
