"""The data pipeline (issue 3): formats, masks per template, truncation, mixtures, packing equivalence.

Expected trained characters are derived here from the messages themselves (string positions in the
rendered text, found by the test), independently of hftrain's prefix-rendering + offsets method.
"""

from __future__ import annotations

import json
import shutil

import datasets
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hftrain.config import DatasetSource, Recipe
from hftrain.data import (
    CHATML_TEMPLATE,
    IGNORE_INDEX,
    Collator,
    DataSpec,
    detect_format,
    load_datasets,
    load_raw,
    pack_best_fit_decreasing,
    prepare_chat_template,
    to_canonical,
    tokenize_dataset,
    tokenize_example,
    training_rows,
)
from hftrain.errors import ConfigError, HftrainError
from hftrain.model import fit_embeddings_to_tokenizer
from hftrain.objectives.sft import CausalLMTokenLoss
from tests.conftest import REPO

MODEL = REPO / "models" / "tiny-llama"
# A second template, unlike ChatML: plain-text role headers, EOS ends the assistant turn, and the
# generation prompt ends with a space that BPE merges into the answer's first token.
PLAIN_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}Assistant: {{ m['content'] }}{{ eos_token }}\n"
    "{% else %}{{ m['role'] | capitalize }}: {{ m['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}Assistant: {% endif %}"
)
CONVERSATION = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "2 + 2 = 4."},
    {"role": "user", "content": "Spell ocean backwards. ünïcødé 👋"},
    {"role": "assistant", "content": "ocean backwards is naeco. 日本"},
    {"role": "user", "content": "And stone?"},
    {"role": "assistant", "content": "stone backwards is enots."},
]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(MODEL)


def spec(**kw) -> DataSpec:
    return DataSpec.from_recipe(Recipe(**kw))


def tokenize(tokenizer, example: dict, fmt: str, **kw) -> dict:
    return tokenize_example(example, 0, tokenizer, spec(**kw), fmt, "test")


def trained_char_ranges(tokenizer, text: str, record: dict) -> list[tuple[int, int]]:
    """Character ranges of the trained tokens, by re-tokenizing the rendered text in the test."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    assert enc["input_ids"][: len(record["input_ids"])] == record["input_ids"]
    return [enc["offset_mapping"][i] for i, lbl in enumerate(record["labels"]) if lbl != IGNORE_INDEX]


def expected_assistant_ranges(text: str, messages: list[dict], terminator: str) -> list[tuple[int, int]]:
    """Where each assistant answer and its terminator sit in the rendered text (found by the test)."""
    ranges, cursor = [], 0
    for m in messages:
        at = text.index(m["content"], cursor)
        end = at + len(m["content"])
        if m["role"] == "assistant":
            assert text.startswith(terminator, end)
            ranges.append((at, end + len(terminator)))
        cursor = end
    return ranges


@pytest.mark.parametrize("template, terminator", [(None, "<|im_end|>"), (PLAIN_TEMPLATE, "<|im_end|>")])
def test_assistant_masks_cover_exactly_the_answers(tokenizer, template, terminator):
    tok = AutoTokenizer.from_pretrained(MODEL)
    if template:
        tok.chat_template = template
    record = tokenize(tok, {"messages": CONVERSATION}, "messages")
    text = tok.apply_chat_template(CONVERSATION, tokenize=False)
    trained = trained_char_ranges(tok, text, record)
    answers = expected_assistant_ranges(text, CONVERSATION, terminator)
    covered = {c for s, e in trained for c in range(s, e)}
    for s, e in answers:  # every character of every answer and terminator is trained
        assert set(range(s, e)) <= covered
    outside = covered - {c for s, e in answers for c in range(s, e)}
    assert all(text[c].isspace() for c in outside), "only a merged leading space may be trained outside an answer"
    assert record["labels"][0] == IGNORE_INDEX
    assert record["num_trained"] == sum(lbl != IGNORE_INDEX for lbl in record["labels"])


def test_train_on_everything_when_asked(tokenizer):
    record = tokenize(tokenizer, {"messages": CONVERSATION}, "messages", assistant_only_loss=False)
    assert record["labels"][1:] == record["input_ids"][1:] and record["labels"][0] == IGNORE_INDEX


def test_sharegpt_alpaca_and_messages_agree(tokenizer):
    """The same exchange in three formats gives the same tokens and the same mask."""
    q, a = "What is the capital of Peru?", "The capital of Peru is Lima."
    messages = tokenize(tokenizer, {"messages": [{"role": "user", "content": q},
                                                 {"role": "assistant", "content": a}]}, "messages")
    sharegpt = tokenize(tokenizer, {"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]},
                        "sharegpt")
    alpaca = tokenize(tokenizer, {"instruction": q, "input": "", "output": a}, "alpaca")
    assert messages["input_ids"] == sharegpt["input_ids"] == alpaca["input_ids"]
    assert messages["labels"] == sharegpt["labels"] == alpaca["labels"]
    with_input = to_canonical({"instruction": "Translate.", "input": "bonjour", "output": "hello", "system": "Be nice"},
                              "alpaca", "text", "messages", "x")
    assert with_input["messages"] == [{"role": "system", "content": "Be nice"},
                                      {"role": "user", "content": "Translate.\n\nbonjour"},
                                      {"role": "assistant", "content": "hello"}]


def test_prompt_completion_trains_completion_and_eos_only(tokenizer):
    prompt, completion = "Question: What is 3 + 4?\nAnswer:", " 3 + 4 = 7."
    record = tokenize(tokenizer, {"prompt": prompt, "completion": completion}, "prompt_completion")
    prompt_ids = tokenizer(prompt)["input_ids"]
    completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert record["input_ids"] == prompt_ids + completion_ids  # the prompt tokenized alone, as at inference
    assert record["labels"] == [IGNORE_INDEX] * len(prompt_ids) + completion_ids
    everything = tokenize(tokenizer, {"prompt": prompt, "completion": completion}, "prompt_completion",
                          completion_only_loss=False)
    assert everything["labels"][1:] == everything["input_ids"][1:]


def test_conversational_prompt_completion_trains_the_completion_turns(tokenizer):
    prompt, completion = CONVERSATION[:4], CONVERSATION[4:5]
    record = tokenize(tokenizer, {"prompt": prompt, "completion": completion}, "prompt_completion")
    text = tokenizer.apply_chat_template(prompt + completion, tokenize=False)
    trained = tokenizer.decode([t for t, lbl in zip(record["input_ids"], record["labels"]) if lbl != IGNORE_INDEX])
    assert trained == completion[0]["content"] + "<|im_end|>"
    assert text.count("<|im_end|>") == 5


def test_text_gets_eos_once_and_everything_trained(tokenizer):
    record = tokenize(tokenizer, {"text": "What is 4 + 1? 4 + 1 = 5."}, "text")
    assert record["input_ids"].count(tokenizer.eos_token_id) == 1 and record["input_ids"][-1] == tokenizer.eos_token_id
    assert record["labels"][1:] == record["input_ids"][1:]


# --------------------------------------------------------------------------- truncation
def turn_end_lengths(tokenizer) -> list[int]:
    """Token counts of the conversation rendered through each assistant turn (terminator included)."""
    lengths = []
    for i, m in enumerate(CONVERSATION):
        if m["role"] == "assistant":
            text = tokenizer.apply_chat_template(CONVERSATION[: i + 1], tokenize=False).rstrip()
            lengths.append(len(tokenizer(text, add_special_tokens=False)["input_ids"]))
    return lengths


def test_chat_truncation_ends_on_a_complete_turn(tokenizer):
    ends = turn_end_lengths(tokenizer)
    for max_length in (ends[1], ends[1] + 1, ends[2] - 1):
        record = tokenize(tokenizer, {"messages": CONVERSATION}, "messages", max_length=max_length)
        assert len(record["input_ids"]) == ends[1], "cut right after the second answer's <|im_end|>"
        assert record["input_ids"][-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")
        assert record["labels"][-1] == record["input_ids"][-1]
        assert record["num_truncated"] == ends[2] + 1 - ends[1]  # the full render also ends with a newline
    # no complete turn fits: cut at max_length, keeping the trained prefix of the first answer
    short = tokenize(tokenizer, {"messages": CONVERSATION}, "messages", max_length=ends[0] - 2)
    assert len(short["input_ids"]) == ends[0] - 2 and short["num_trained"] > 0
    # labels stay aligned with input_ids at every boundary
    for max_length in range(2, ends[2] + 3):
        record = tokenize(tokenizer, {"messages": CONVERSATION}, "messages", max_length=max_length)
        full = tokenize(tokenizer, {"messages": CONVERSATION}, "messages", max_length=10_000)
        n = len(record["input_ids"])
        assert n <= max_length and record["input_ids"] == full["input_ids"][:n]
        assert record["labels"][1:] == full["labels"][1:n]


def test_drop_policy_and_statistics(tokenizer):
    ends = turn_end_lengths(tokenizer)
    rows = [{"messages": CONVERSATION}, {"messages": CONVERSATION[1:3]}]
    raw = datasets.Dataset.from_list(rows)
    kept, stats = tokenize_dataset(raw, tokenizer, spec(max_length=ends[1], overlong_examples="drop"), "messages", "t")
    assert len(kept) == 1 and stats["dropped_overlong"] == 1 and stats["truncated_examples"] == 0
    kept, stats = tokenize_dataset(raw, tokenizer, spec(max_length=ends[1]), "messages", "t")
    assert len(kept) == 2 and stats["truncated_examples"] == 1 and stats["dropped_overlong"] == 0
    assert stats["trained_tokens"] == sum(sum(lbl != IGNORE_INDEX for lbl in row) for row in kept["labels"])


def test_all_masked_dataset_is_an_error(tokenizer):
    raw = datasets.Dataset.from_list([{"prompt": "a long prompt " * 20, "completion": " x"}] * 3)
    with pytest.raises(HftrainError, match="no trained token"):
        tokenize_dataset(raw, tokenizer, spec(max_length=8), "prompt_completion", "t")


# ----------------------------------------------------------------------------- formats
@pytest.mark.parametrize("file, fmt", [("chat.jsonl", "messages"), ("text.jsonl", "text"),
                                       ("prompt_completion.jsonl", "prompt_completion"), ("alpaca.jsonl", "alpaca"),
                                       ("sharegpt.jsonl", "sharegpt")])
def test_shipped_files_are_detected(file, fmt):
    columns = list(json.loads((REPO / "data" / file).read_text().splitlines()[0]))
    assert detect_format(columns, "auto", "text", "messages", file) == fmt


@pytest.mark.parametrize("example, fmt, message", [
    ({"messages": [{"role": "human", "content": "hi"}]}, "messages", "role 'human'"),
    ({"messages": [{"role": "user", "content": ["hi"]}, {"role": "assistant", "content": "x"}]}, "messages",
     "content of type list"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "messages", "no assistant message"),
    ({"messages": []}, "messages", "non-empty list"),
    ({"conversations": [{"from": "bot", "value": "hi"}]}, "sharegpt", "from 'bot'"),
    ({"prompt": "p", "completion": ["x"]}, "prompt_completion", "both be strings or both be message lists"),
    ({"text": ""}, "text", "non-empty text"),
])
def test_bad_examples_name_the_problem(example, fmt, message):
    with pytest.raises(HftrainError, match=message):
        to_canonical(example, fmt, "text", "messages", "data.jsonl example 7")


def test_unknown_columns_list_what_each_format_needs():
    with pytest.raises(HftrainError, match=r"columns \['question', 'answer'\].*prompt_completion: prompt, completion"):
        detect_format(["question", "answer"], "auto", "text", "messages", "qa.jsonl")


def test_column_mapping_and_mixture_weights(tmp_path, tokenizer):
    qa = tmp_path / "qa.jsonl"
    qa.write_text("".join(json.dumps({"question": f"Q{i}?", "answer": f" A{i}."}) + "\n" for i in range(40)))
    alpaca = tmp_path / "alpaca.jsonl"  # unique rows, so overlap between splits can be checked by content
    alpaca.write_text("".join(json.dumps({"instruction": f"Count to {i}.", "input": "", "output": f"1 .. {i}"}) + "\n"
                              for i in range(300)))
    recipe = Recipe(model_name_or_path=str(MODEL), validation_split_percentage=10, seed=3, dataset_mixture=[
        DatasetSource(name=str(qa), weight=0.5, columns={"question": "prompt", "answer": "completion"}),
        DatasetSource(name=str(alpaca), weight=2.0),
    ])
    train, evaluation, stats = load_datasets(recipe, AutoTokenizer.from_pretrained(MODEL))
    qa_stats, alpaca_stats = stats["sources"]
    assert (qa_stats["format"], alpaca_stats["format"]) == ("prompt_completion", "alpaca")
    assert qa_stats["examples"] == 36 and alpaca_stats["examples"] == 270  # 10% of each held out first
    assert len(train) == 18 + 540 and len(evaluation) == 4 + 30
    # no held-out example is trained on (weighting happens after the carve-out)
    as_tuples = {tuple(ids) for ids in train["input_ids"]}
    assert not any(tuple(ids) in as_tuples for ids in evaluation["input_ids"])


def test_chatml_fallback_adds_tokens_and_makes_im_end_eos(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.train_from_iterator(["hello world"] * 10, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    base = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="</s>")
    assert base.chat_template is None
    size = len(base)
    note = prepare_chat_template(base, None, needs_chat=True)
    assert "ChatML" in note and len(base) == size + 2
    assert base.eos_token == "<|im_end|>" and base.chat_template == CHATML_TEMPLATE
    record = tokenize_example({"messages": CONVERSATION[1:3]}, 0, base, spec(), "messages", "t")
    trained = [lbl for lbl in record["labels"] if lbl != IGNORE_INDEX]
    assert trained[-1] == base.eos_token_id  # the answer's terminator is the new EOS, and it is trained
    # a model whose vocabulary is smaller than the grown tokenizer is resized, EOS updated for generation
    model = AutoModelForCausalLM.from_pretrained(MODEL)
    model.resize_token_embeddings(size)
    assert fit_embeddings_to_tokenizer(model, base) == size + 2
    assert model.get_input_embeddings().num_embeddings == size + 2
    assert model.generation_config.eos_token_id == base.eos_token_id
    # and a tokenizer that already has a template is left alone
    assert prepare_chat_template(AutoTokenizer.from_pretrained(MODEL), None, needs_chat=True) is None


def test_chat_template_path_overrides_the_tokenizers(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(PLAIN_TEMPLATE)
    tok = AutoTokenizer.from_pretrained(MODEL)
    prepare_chat_template(tok, str(path), needs_chat=True)
    assert tok.apply_chat_template(CONVERSATION[1:3], tokenize=False).startswith("User: What is 2 + 2?\nAssistant: ")


# ------------------------------------------------------------------------------ packing
def test_best_fit_decreasing_packs_every_example_once_within_capacity():
    lengths = [7, 3, 5, 5, 2, 8, 1, 9, 4, 6]
    bins = pack_best_fit_decreasing(lengths, 10)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 10 for b in bins)
    assert len(bins) == 5  # total 50 = five full bins: BFD finds the perfect packing here
    with pytest.raises(ValueError):
        pack_best_fit_decreasing([11], 10)


def test_packed_loss_and_gradients_equal_examples_run_one_by_one(tokenizer):
    """Independent reference: the HF model's own loss on each example alone, times its token count."""
    rows = [json.loads(line) for line in (REPO / "data" / "chat.jsonl").read_text().splitlines()[:12]]
    dataset, _ = tokenize_dataset(datasets.Dataset.from_list(rows), tokenizer, spec(), "messages", "t")
    bins = training_rows(dataset, packing=True, max_length=160)
    assert max(len(b) for b in bins) >= 3, "the test must really pack several examples per row"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(MODEL)
    batch = Collator(dataset, 0, bins, packed=True)(list(range(len(bins))))
    assert batch.pop("num_examples").item() == len(dataset)
    packed = CausalLMTokenLoss(model)(**batch)
    packed.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    reference = 0
    for ids, labels in zip(dataset["input_ids"], dataset["labels"]):
        ids, labels = torch.tensor([ids]), torch.tensor([labels])
        reference = reference + model(input_ids=ids, labels=labels).loss * (labels[:, 1:] != IGNORE_INDEX).sum()
    reference.backward()
    torch.testing.assert_close(packed, reference, rtol=1e-5, atol=1e-4)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6)
    # without restarting positions the examples would attend across each other: a different loss
    del batch["position_ids"]
    contaminated = CausalLMTokenLoss(model)(**batch)
    assert abs(contaminated.item() - packed.item()) > 1e-2


def test_preview_and_dump(tmp_path):
    import subprocess
    import sys

    dump = tmp_path / "rows.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "hftrain.data", "--config", str(REPO / "recipes" / "tiny-chat.yaml"), "--show", "2",
         "--dump", "5", str(dump), "--validation_split_percentage", "0", "--train_sampling_strategy", "sequential",
         "--per_device_train_batch_size", "2"],
        capture_output=True, text=True, cwd=REPO, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("--- example") == 2 and "⟦" in proc.stdout and "length histogram" in proc.stdout
    first_chat = json.loads((REPO / "data" / "chat.jsonl").read_text().splitlines()[0])["messages"]
    answers = [m["content"] for m in first_chat if m["role"] == "assistant"]
    assert all(f"⟦{a}<|im_end|>⟧" in proc.stdout for a in answers)
    rows = [json.loads(line) for line in dump.read_text().splitlines()]
    assert len(rows) == 5 and set(rows[0]) == {"input_ids", "labels"}
    tok = AutoTokenizer.from_pretrained(MODEL)
    trained = tok.decode([t for t, lbl in zip(rows[0]["input_ids"], rows[0]["labels"]) if lbl != IGNORE_INDEX])
    assert trained == "".join(a + "<|im_end|>" for a in answers)
    # rows of one micro-batch are padded to the same width, padding untrained
    assert len(rows[0]["input_ids"]) == len(rows[1]["input_ids"])


def test_preview_takes_no_prefix_of_its_options():
    """The preview's own options (--show, --dump) are not guessed from a prefix: the other arguments are the
    recipe's, whose parser takes no prefixes either."""
    from hftrain.data.__main__ import preview

    with pytest.raises(ConfigError, match="unknown argument '--sho'"):
        preview(["--sho", "1"])


def test_preview_refuses_bad_data_with_one_paragraph(tmp_path):
    import subprocess
    import sys

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "bot", "content": "x"}]}) + "\n")
    proc = subprocess.run([sys.executable, "-m", "hftrain.data", "--dataset_name", str(bad),
                           "--validation_split_percentage", "0"],
                          capture_output=True, text=True, cwd=REPO,
                          env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2
    message = proc.stderr[proc.stderr.index("hftrain: error:"):]
    assert "role 'bot'" in message and "data uses from/value" in message.replace("\n", " ")
    assert "Traceback" not in proc.stderr


def test_copy_of_model_without_template_is_not_needed_for_text(tmp_path, tokenizer):
    """Text data never installs a chat template (a base model stays a base model)."""
    folder = tmp_path / "base"
    shutil.copytree(MODEL, folder)
    (folder / "chat_template.jinja").unlink()
    tok = AutoTokenizer.from_pretrained(folder)
    assert prepare_chat_template(tok, None, needs_chat=False) is None and tok.chat_template is None


def test_marked_text_keeps_multibyte_characters_whole(tokenizer):
    from hftrain.data.__main__ import marked_text

    record = tokenize(tokenizer, {"messages": CONVERSATION}, "messages")
    shown = marked_text(tokenizer, record["input_ids"], record["labels"], color=False)
    assert "⟦ocean backwards is naeco. 日本<|im_end|>⟧" in shown and "ünïcødé 👋" in shown
    assert shown.replace("⟦", "").replace("⟧", "") == tokenizer.decode(record["input_ids"])


def test_tokenization_is_cached_by_content_not_by_unrelated_fields(tmp_path, monkeypatch):
    import hftrain.data.tokenize as tokenize_module

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"example {i} " * (i % 5 + 1)}) + "\n" for i in range(30)))
    calls = []
    real = tokenize_module.tokenize_rows  # called once per raw example (a conversation may give several rows)
    monkeypatch.setattr(tokenize_module, "tokenize_rows", lambda *a, **k: calls.append(1) or real(*a, **k))

    def load(**kw):
        load_datasets(Recipe(model_name_or_path=str(MODEL), dataset_name=str(data), **kw),
                      AutoTokenizer.from_pretrained(MODEL))
        return len(calls)

    first = load()
    assert first == 30
    assert load(learning_rate=1e-3, seed=42) == first  # same data fields: read from the cache
    assert load(max_length=8) == first + 30  # a data field changed: tokenized again


# ------------------------------------------------------------------ naming the bad line or row (issue 36)
def chat_lines(n: int) -> list[str]:
    return [json.dumps({"messages": [{"role": "user", "content": f"question {i}"},
                                     {"role": "assistant", "content": f"answer {i}"}]}) for i in range(n)]


def test_a_line_that_is_not_json_is_named_by_file_and_line(tmp_path):
    """datasets' reader names no line and hftrain said "Give an existing data file" of a file that exists."""
    lines = chat_lines(60)
    lines[41] = lines[41][:-3]  # line 42 cut short
    jsonl = tmp_path / "bad.jsonl"
    jsonl.write_text("\n".join(lines) + "\n")
    with pytest.raises(HftrainError) as info:
        load_datasets(Recipe(model_name_or_path=str(MODEL), dataset_name=str(jsonl)),
                      AutoTokenizer.from_pretrained(MODEL))
    message = str(info.value)
    assert f"{jsonl}, line 42: not JSON" in message and "existing data file" not in message
    lines[41] = "[1, 2]"
    jsonl.write_text("\n".join(lines) + "\n")
    with pytest.raises(HftrainError, match=r"bad.jsonl, line 42: a JSON list, not an object"):
        load_raw(str(jsonl), None, "train")
    array = tmp_path / "bad.json"  # one JSON array over several lines: the line where it stops being JSON
    array.write_text('[\n{"text": "a"},\n{"text": "b"\n{"text": "c"}\n]\n')
    with pytest.raises(HftrainError, match=r"bad.json, line 4 column 1: not JSON"):
        load_raw(str(array), None, "train")


def test_a_line_that_is_not_json_is_named_once_by_hftrain_not_first_by_datasets(tmp_path, capfd, caplog):
    """Issue 49 (7): datasets' JSON builder logged "Failed to load JSON ... in row 299" (pyarrow's 0-based row of
    the block) before raising, so one broken line was named twice, by two numbers, before hftrain's own "line 300"."""
    lines = chat_lines(400)
    lines[299] = lines[299][:-3]  # line 300 cut short
    jsonl = tmp_path / "broken.jsonl"
    jsonl.write_text("\n".join(lines) + "\n")
    with pytest.raises(HftrainError, match=r"broken.jsonl, line 300: not JSON"):
        load_raw(str(jsonl), None, "train")
    printed = capfd.readouterr().err + "".join(record.getMessage() for record in caplog.records)
    assert "row 299" not in printed and "Failed to load JSON" not in printed, printed


def test_a_bad_row_is_named_by_its_file_and_line_not_its_position_after_the_shuffle(tmp_path):
    """The eval hold-out shuffles the rows (and a mixture concatenates its sources): a bad row was named "example
    580" for line 42 of its file. Here line 43 (a blank line before it) has no assistant message."""
    tok = AutoTokenizer.from_pretrained(MODEL)
    lines = chat_lines(100)
    lines[41] = json.dumps({"messages": [{"role": "user", "content": "a question, no answer"}]})
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines[:10]) + "\n\n" + "\n".join(lines[10:]) + "\n")
    good = tmp_path / "good.jsonl"
    good.write_text("\n".join(chat_lines(50)) + "\n")
    for values in ({"dataset_name": str(bad)},  # the 5% hold-out shuffles the rows
                   {"dataset_name": str(bad), "validation_split_percentage": 0},
                   {"dataset_mixture": [DatasetSource(str(good)), DatasetSource(str(bad), weight=0.5)]},
                   {"dataset_name": str(good), "eval_dataset_name": str(bad), "validation_split_percentage": 0}):
        with pytest.raises(HftrainError) as info:
            load_datasets(Recipe(model_name_or_path=str(MODEL), **values), tok)
        message = str(info.value)
        assert message.startswith(f"{bad}, line 43") and "the conversation has no assistant message" in message
        assert ("line 43 (a source of dataset_mixture):" in message) == ("dataset_mixture" in values)


CHAT = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
SHAREGPT = [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]
# format: (objective, a good row, the bad row: one of the format's fields under another name, the field, the rename)
MISSING_FIELD = {
    "messages": ("sft", {"messages": CHAT}, {"conversation": CHAT}, "messages", "{conversation: messages}"),
    "sharegpt": ("sft", {"conversations": SHAREGPT}, {"conversation": SHAREGPT}, "conversations",
                 "{conversation: conversations}"),
    "alpaca": ("sft", {"instruction": "q", "output": "a"}, {"instruction": "q", "response": "a"}, "output",
               "{response: output}"),
    "prompt_completion": ("sft", {"prompt": "q", "completion": " a"}, {"prompt": "q", "answer": " a"}, "completion",
                          "{answer: completion}"),
    "text": ("sft", {"text": "some text"}, {"content": "some text"}, "text", "{content: text}"),
    "preference": ("dpo", {"prompt": "q", "chosen": " a", "rejected": " b"},
                   {"prompt": "q", "chosen": " a", "rejcted": " b"}, "rejected", "{rejcted: rejected}"),
    "preference's prompt": ("dpo", {"prompt": "q", "chosen": " a", "rejected": " b"},
                            {"question": "q", "chosen": " a", "rejected": " b"}, "prompt", "{question: prompt}"),
    "unpaired (kto)": ("kto", {"prompt": "q", "completion": " a", "label": True},
                       {"prompt": "q", "completion": " a", "desirable": False}, "label", "{desirable: label}"),
}


@pytest.mark.parametrize("case", sorted(MISSING_FIELD))
def test_a_row_without_one_of_its_formats_fields_is_named_with_the_field(tmp_path, tokenizer, case):
    """Issue 49 (6): a line of a file whose other lines have the field gets it as None from datasets, and was refused
    for that value's type ("messages must be a non-empty list ... got NoneType", "chosen and rejected must both be
    strings or both be message lists"). Now: its line, the missing field, what the row has and how to map a name."""
    objective, good, bad, field, rename = MISSING_FIELD[case]
    rows = [dict(good, **({"label": i % 2 == 0} if objective == "kto" else {})) for i in range(6)]
    rows[2] = bad
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(HftrainError) as info:
        load_datasets(Recipe(model_name_or_path=str(MODEL), dataset_name=str(data), objective=objective,
                             validation_split_percentage=0), tokenizer)
    message = str(info.value)
    assert message.startswith(f"{data}, line 3: the row has no {field!r} field"), message
    assert "dataset_columns" in message and rename in message, message
    assert all(repr(key) in message for key in bad), message  # what the row has
    if case in ("messages", "text"):  # the option that names the column of these formats
        assert f"dataset_{case}_field" in message, message


@pytest.mark.parametrize("example, fmt, field", [
    ({"prompt": "p", "chosen": " a"}, "preference", "rejected"),
    ({"prompt": "p", "completion": " a"}, "unpaired", "label"),
    ({"conversation": CHAT}, "messages", "messages"),
    ({"prompt": "p"}, "prompt_completion", "completion"),
])
def test_a_streamed_row_without_a_field_names_it(example, fmt, field):
    """hftrain's stream reader leaves a key missing from a line out of the row (no None): the row was a KeyError."""
    with pytest.raises(HftrainError, match=f"d.jsonl, line 9: the row has no {field!r} field"):
        to_canonical(example, fmt, "text", "messages", "d.jsonl, line 9")


def test_a_row_origin_names_rows_in_any_order(tmp_path):
    """RowOrigin reads on from the last row it located (a stream names its bad rows in order): rows asked for in any
    order get the line that counting the file's non-blank lines gives."""
    from hftrain.data.origin import RowOrigin

    data = tmp_path / "d.jsonl"
    text = ["\n", '{"text": "a"}\n', "\n", "\n", '{"text": "b"}\n', '{"text": "c"}\n', "  \n", '{"text": "d"}\n']
    data.write_text("".join(text))
    lines = [i + 1 for i, t in enumerate(text) if t.strip()]  # the line of each row
    origin = RowOrigin("d.jsonl", str(data))
    for row in (2, 0, 3, 3, 1, 3):
        assert origin.describe(row) == f"d.jsonl, line {lines[row]}", row
