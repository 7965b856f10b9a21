"""hftrain.data.streaming in-process: rows of a stream, their position, resume checks and the recipe's refusals."""

from __future__ import annotations

import datasets
import pytest

from hftrain.config import Recipe, validate
from hftrain.data.streaming import RowStream, StreamCollator, check_resume
from hftrain.errors import HftrainError
from tests.conftest import REPO

N = 23


def source(n: int = N, shards: int = 2):
    """An IterableDataset of n raw examples {"n": i, "text": ...} in `shards` shards."""
    data = datasets.Dataset.from_list([{"n": i, "text": "x" * (i % 7)} for i in range(n)])
    return lambda passes: data.to_iterable_dataset(num_shards=shards)


def tokenize(example: dict, index: int) -> list[dict]:
    """Length 2 + n % 7 tokens; an empty text is a bad example; n % 5 == 4 has no trained token (dropped)."""
    if not example["text"]:
        raise HftrainError(f"example {index} has no text")
    length = 2 + example["n"] % 7
    labels = [-100] * length if example["n"] % 5 == 4 else [example["n"]] * length
    return [{"input_ids": [example["n"]] * length, "labels": labels, "dropped": "" if labels[-1] != -100 else "x"}]


def stream(**kwargs) -> RowStream:
    options = {"shuffle_buffer": 1, "seed": 3, "packing": False, "max_length": 16} | kwargs
    return RowStream(source(), tokenize, **options)


def kept() -> list[int]:
    return [i for i in range(N) if i % 7 and i % 5 != 4]


def ids(rows) -> list[list[int]]:
    return [[example["input_ids"][0] for example in row] for row in rows]


def test_sequential_rows_follow_the_source_and_the_next_pass_starts_over():
    s = stream()
    rows = ids([s.next_row() for _ in range(2 * len(kept()))])
    assert rows == [[i] for i in kept()] * 2
    assert s.passes == 1
    assert s.counts["bad"] == 2 * len([i for i in range(N) if i % 7 == 0]) and "example 0" in s.first_bad
    assert s.counts["dropped"] == 2 * len([i for i in range(N) if i % 7 and i % 5 == 4])


def test_shuffled_and_packed_rows_hold_every_example_once_per_pass_within_max_length():
    s = stream(shuffle_buffer=5, packing=True)
    rows = []
    while s.passes == 0:
        rows.append(s.next_row())
    first_pass = [n for row in ids(rows[:-1]) for n in row]  # the last row was taken from the second pass
    assert sorted(first_pass) == kept() and first_pass != kept()  # shuffled: every example once, another order
    assert all(sum(len(e["input_ids"]) for e in row) <= 16 for row in rows)
    assert any(len(row) > 1 for row in rows)


@pytest.mark.parametrize("options", [{}, {"shuffle_buffer": 5}, {"shuffle_buffer": 5, "packing": True}])
@pytest.mark.parametrize("at", [3, 17])  # in the first pass; in the second
def test_a_stream_loaded_from_its_state_continues_exactly(options, at):
    whole = stream(**options)
    expected = ids([whole.next_row() for _ in range(at + 12)])
    first = stream(**options)
    assert ids([first.next_row() for _ in range(at)]) == expected[:at]
    state = first.state()
    resumed = stream(**options)
    resumed.load_state(state)
    assert ids([resumed.next_row() for _ in range(12)]) == expected[at:]
    assert resumed.counts == whole.counts


def test_the_collator_pads_rows_and_restarts_positions_per_packed_example():
    collator = StreamCollator(pad_token_id=0, packed=True, paired=False)
    rows = [[{"input_ids": [5, 6], "labels": [-100, 6]}, {"input_ids": [7], "labels": [-100]}],
            [{"input_ids": [8, 9, 10], "labels": [-100, 9, 10]}]]
    batch = collator(rows)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 9, 10]]
    assert batch["position_ids"].tolist() == [[0, 1, 0], [0, 1, 2]]
    assert batch["labels"].tolist() == [[-100, 6, -100], [-100, 9, 10]] and int(batch["num_examples"]) == 3


def saved(world: int, disjoint: bool, batch: int = 8) -> list[dict]:
    return [{"version": 1, "rank": r, "world": world, "disjoint": disjoint, "global_batch": batch, "stream": {"r": r}}
            for r in range(world)]


def test_resume_checks():
    # every rank read the whole stream: any process count with the same global batch continues from the same state
    assert check_resume(saved(2, False), 1, False, 8, 0, "ckpt")["stream"] == {"r": 0}
    assert check_resume(saved(2, False), 4, False, 8, 3, "ckpt")["stream"] == {"r": 0}
    # disjoint shards: each rank its own state, only with the saved count
    assert check_resume(saved(2, True), 2, True, 8, 1, "ckpt")["stream"] == {"r": 1}
    refusals = [(saved(2, True), 1, False, 8), (saved(2, True), 4, True, 8), (saved(2, False), 2, False, 16), ([], 1,
                False, 8)]
    messages = []
    for states, world, disjoint, batch in refusals:
        with pytest.raises(HftrainError) as refused:
            check_resume(states, world, disjoint, batch, 0, "ckpt")
        messages.append(str(refused.value))
    assert "Resume with the saved number of data-parallel processes (2)" in messages[0]
    assert "2 ranks reading disjoint shards; this run would have 4 ranks reading disjoint shards" in messages[1]
    assert "global batch of 8 rows per step, this run takes 16" in messages[2]
    assert "saved by a map-style run" in messages[3]


def test_streaming_refusals_are_reported_together():
    problems = validate(Recipe(streaming=True, eval_strategy="epoch", train_sampling_strategy="group_by_length",
                               shuffle_buffer_size=0, max_bad_rows=-1))
    text = "\n".join(problems)
    for expected in ("set max_steps", "eval_strategy=epoch", "group_by_length",
                     "shuffle_buffer_size must be >= 1", "max_bad_rows must be >= 0"):
        assert expected in text, expected
    assert not any("stream" in p for p in validate(Recipe(streaming=True, max_steps=5)))


def test_the_preview_shows_the_streams_first_rows_and_its_bad_examples(tmp_path, capsys):
    """`python -m hftrain.data` with streaming: true: the first rows in the file's order (sequential, unpacked), each
    answer marked as trained, then the bad example met while reading them."""
    import json

    from hftrain.data.__main__ import preview

    answers = ["It is four.", "Paris.", "Blue."]
    chats = [{"messages": [{"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": a}]}
             for i, a in enumerate(answers)]
    bad = {"messages": [{"role": "user", "content": "no answer"}]}
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in [chats[0], bad, *chats[1:]]))
    preview(["--show", "3", "--model_name_or_path", str(REPO / "models" / "tiny-llama"), "--dataset_name", str(data),
             "--validation_split_percentage", "0", "--streaming", "true", "--max_steps", "1",
             "--train_sampling_strategy", "sequential"])
    out = capsys.readouterr().out
    assert "one rank reads 1 shard(s), in the files' order" in out
    rows = out.split("--- row ")[1:]
    assert len(rows) == 3
    for row, (i, answer) in zip(rows, enumerate(answers)):
        assert f"Question {i}?" in row and f"⟦{answer}" in row
    assert "read 4 raw example(s): 1 bad" in out and "the first bad one: pass 1, example 1:" in out


def test_a_mixture_draws_by_weight_tokenizes_each_source_by_its_format_and_resumes_exactly(tmp_path):
    """A chat file (weight 3) and a plain-text file (weight 1) interleaved: about a quarter of the rows are text, each
    source tokenized by its own format (chat answers trained only, every text token trained), and a stream loaded
    from its state after 10 rows continues with the rows the uninterrupted stream gives."""
    import json

    from hftrain.config import DatasetSource
    from hftrain.data.streaming import load_stream
    from hftrain.model import build_tokenizer

    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Question {i}?"},
                                                      {"role": "assistant", "content": f"Answer {i}."}]}) + "\n"
                             for i in range(30)))
    texts = tmp_path / "texts.jsonl"
    texts.write_text("".join(json.dumps({"text": f"plain text number {i}"}) + "\n" for i in range(30)))
    recipe = Recipe(model_name_or_path=str(REPO / "models" / "tiny-llama"), streaming=True, max_steps=1,
                    validation_split_percentage=0, eval_strategy="no", train_sampling_strategy="sequential",
                    dataset_mixture=[DatasetSource(str(chats), weight=3.0), DatasetSource(str(texts), weight=1.0)])
    assert not validate(recipe)
    tokenizer = build_tokenizer(recipe)

    def rows(feed, n):
        return [feed.stream.next_row()[0] for _ in range(n)]

    feed, _, _ = load_stream(recipe, tokenizer, rank=0, world=1)
    assert "mixture of" in feed.description and "(messages/text)" in feed.description
    whole = rows(feed, 40)
    is_text = ["plain text" in tokenizer.decode(r["input_ids"]) for r in whole]
    assert 4 <= sum(is_text) <= 18
    for row, text in zip(whole, is_text):
        trained = sum(label != -100 for label in row["labels"])
        assert trained == len(row["labels"]) - 1 if text else 0 < trained < len(row["labels"]) / 2
    first, _, _ = load_stream(recipe, tokenizer, rank=0, world=1)
    rows(first, 10)
    state = first.stream.state()
    resumed, _, _ = load_stream(recipe, tokenizer, rank=0, world=1)
    resumed.stream.load_state(json.loads(json.dumps(state)))  # through JSON, as a checkpoint stores it
    assert [r["input_ids"] for r in rows(resumed, 30)] == [r["input_ids"] for r in whole[10:]]


def test_worker_processes_give_the_same_batches_and_positions_and_resume_from_either(tmp_path):
    """dataloader_num_workers: 2 (tokenizing and collating in forked workers, packed, shuffled) gives the micro-batches
    and the per-step stream positions of the in-process feed, and a feed with workers started from the in-process
    feed's position after step 3 continues with its steps 4 and 5."""
    import json

    from hftrain.data.streaming import load_stream
    from hftrain.model import build_tokenizer

    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Question {i}?"},
                                                      {"role": "assistant", "content": "Answer " * (i % 9 + 1)}]})
                             + "\n" for i in range(30)))
    options = {"model_name_or_path": str(REPO / "models" / "tiny-llama"), "streaming": True, "max_steps": 5,
               "validation_split_percentage": 0, "eval_strategy": "no", "dataset_name": str(chats), "packing": True,
               "max_length": 64, "shuffle_buffer_size": 5, "per_device_train_batch_size": 2,
               "gradient_accumulation_steps": 2}

    def feed(workers: int):
        recipe = Recipe(**options, dataloader_num_workers=workers)
        made, _, _ = load_stream(recipe, build_tokenizer(recipe), rank=0, world=1)
        made.collator.pad_token_id = 0
        return made

    def steps(made, n):
        batches = made.batches(None)
        out = []
        for _ in range(n):
            out.append([next(batches)["input_ids"].tolist() for _ in range(2)])
            out[-1].append(made.state_dict(made.steps_read)["stream"])
        return out

    alone, workers = feed(0), feed(2)
    assert "in 2 worker process(es)" in workers.description
    expected = steps(alone, 5)
    assert steps(workers, 5) == expected
    at_3 = feed(0)
    steps(at_3, 3)
    resumed = feed(2)
    resumed.start(3, json.loads(json.dumps(at_3.state_dict(3))))
    assert steps(resumed, 2) == expected[3:]


def chat_lines(first: int, n: int) -> list[str]:
    import json

    return [json.dumps({"messages": [{"role": "user", "content": f"Question {i}?"},
                                     {"role": "assistant", "content": f"Answer {i}."}]}) + "\n"
            for i in range(first, first + n)]


def stream_feed(dataset, with_eval: bool = False, **options):
    from hftrain.data.streaming import load_stream
    from hftrain.model import build_tokenizer

    recipe = Recipe(**{"model_name_or_path": str(REPO / "models" / "tiny-llama"), "streaming": True, "max_steps": 1,
                       "validation_split_percentage": 0, "eval_strategy": "no", "dataset_name": str(dataset),
                       **options})
    feed, evaluation, _ = load_stream(recipe, build_tokenizer(recipe), rank=0, world=1)
    return (feed, evaluation) if with_eval else feed


def questions(feed, n: int) -> list[int]:
    """The question numbers of the next n rows (one chat per row)."""
    import re

    from hftrain.model import build_tokenizer

    tokenizer = build_tokenizer(Recipe(model_name_or_path=str(REPO / "models" / "tiny-llama")))
    return [int(re.search(r"Question (\d+)\?", tokenizer.decode(feed.stream.next_row()[0]["input_ids"])).group(1))
            for _ in range(n)]


def test_a_line_that_is_not_json_is_a_counted_bad_example_and_a_resume_seeks_past_the_read_lines(tmp_path):
    """A .jsonl stream with a line that is not JSON, a JSON array line and a blank line: the other lines train in the
    file's order, the two bad lines are counted and the first named by file and line. A stream loaded from its state
    after 5 rows continues with the uninterrupted stream's rows even when every line before the saved position was
    overwritten since (with as many bytes): it seeks to the position instead of reading the file up to it."""
    import json

    lines = chat_lines(0, 12)
    lines[3:3] = ["{this is not json\n", "\n"]
    lines[8:8] = ["[1, 2]\n"]
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(lines))
    whole = stream_feed(data, train_sampling_strategy="sequential")
    assert questions(whole, 12) == list(range(12))
    counts = whole.stream.counts
    assert (counts["examples"], counts["bad"]) == (14, 2)
    assert whole.stream.first_bad.startswith(f"pass 1, example 3: {data}, line 4: not JSON")
    assert questions(whole, 2) == [0, 1]  # the next pass
    first = stream_feed(data, train_sampling_strategy="sequential")
    questions(first, 5)
    state = json.loads(json.dumps(first.stream.state()))
    offset = state["raw"]["examples_iterable"]["offset"]
    text = data.read_bytes()
    assert text[:offset].decode().count("\n") == 7  # 5 chats, the bad line and the blank line read so far
    data.write_bytes(b"x" * (offset - 1) + b"\n" + text[offset:])  # the read part is now one line of garbage
    resumed = stream_feed(data, train_sampling_strategy="sequential")
    resumed.stream.load_state(state)
    assert questions(resumed, 7) == list(range(5, 12))
    assert resumed.stream.counts["bad"] == 2
    # an eval carve-out of the first 30% of the 14 lines that are not blank (4 lines) keeps the 3 chats among them
    data.write_text("".join(lines))
    carved, evaluation = stream_feed(data, with_eval=True, train_sampling_strategy="sequential",
                                     validation_split_percentage=30, eval_strategy="steps")
    assert len(evaluation) == 3 and questions(carved, 2) == [3, 4]
    assert carved.epoch(carved.stream.state()) == 2 / 10  # 2 of the 10 lines after the carve-out drawn


def test_shards_are_shuffled_per_pass_seeded_and_a_resume_across_the_pass_boundary_is_exact(tmp_path):
    """A folder of 4 .jsonl files (3 chats each), random order with a shuffle buffer of 1 (so the rows follow the
    shards): each pass reads every file whole, in a file order that changes from pass to pass and is the same for
    the same data_seed; `epoch` counts passes (and the read part of the current one); a stream loaded from its state
    in the last file of pass 1 continues into pass 2 as the uninterrupted stream does."""
    import json

    for k in range(4):
        (tmp_path / f"part{k}.jsonl").write_text("".join(chat_lines(3 * k, 3)))
    options = {"shuffle_buffer_size": 1, "data_seed": 5}
    whole = stream_feed(tmp_path, **options)
    assert "one rank reads 4 shard(s)" in whole.description
    rows = questions(whole, 36)
    passes = [rows[i:i + 12] for i in range(0, 36, 12)]
    orders = [[p[i] // 3 for i in range(0, 12, 3)] for p in passes]
    for p, order in zip(passes, orders):
        assert sorted(order) == [0, 1, 2, 3] and p == [3 * k + i for k in order for i in range(3)]
    assert len({tuple(o) for o in orders}) > 1 and orders[0] != [0, 1, 2, 3]
    assert questions(stream_feed(tmp_path, **options), 36) == rows  # seeded
    assert questions(stream_feed(tmp_path, shuffle_buffer_size=1, data_seed=6), 36) != rows
    assert questions(stream_feed(tmp_path, train_sampling_strategy="sequential"), 12) == list(range(12))
    assert whole.epoch(whole.stream.state()) == 3.0
    buffered = stream_feed(tmp_path, shuffle_buffer_size=100)  # the whole pass waits in the buffer: 3 of 12 drawn
    questions(buffered, 3)
    assert buffered.epoch(buffered.stream.state()) == 3 / 12
    first = stream_feed(tmp_path, **options)
    questions(first, 10)
    assert first.epoch(first.stream.state()) == 10 / 12
    state = json.loads(json.dumps(first.stream.state()))
    resumed = stream_feed(tmp_path, **options)
    resumed.stream.load_state(state)
    assert questions(resumed, 26) == rows[10:]



def test_a_streamed_bad_row_is_named_by_its_file_and_line(tmp_path):
    """A streamed .jsonl file: the bad rows (no assistant message) are named by their line, blank lines counted, as the
    map-style reader names them; the stream goes on and counts them."""
    import json

    lines = chat_lines(0, 12)
    no_answer = json.dumps({"messages": [{"role": "user", "content": "Question 99?"}]}) + "\n"
    lines[5:5] = ["\n", no_answer, "\n"]  # line 7
    lines[11:11] = [no_answer]  # line 12
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(lines))
    feed = stream_feed(data, train_sampling_strategy="sequential")
    assert questions(feed, 12) == list(range(12))
    assert feed.stream.counts["bad"] == 2
    assert f"{data}, line 7: the conversation has no assistant message" in feed.stream.first_bad
