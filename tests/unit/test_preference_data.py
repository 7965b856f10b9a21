"""Preference pairs: formats, exact completion masks, the truncation policy, refusals and collation."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from datasets import Dataset
from transformers import AutoTokenizer

from hftrain.config import Recipe, recipe_from_dict
from hftrain.data import IGNORE_INDEX, Collator, DataSpec, detect_format, tokenize_dataset
from hftrain.data.tokenize import tokenize_pair
from hftrain.errors import HftrainError
from tests.conftest import REPO

MODEL = REPO / "models" / "tiny-llama"
PROMPT = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 2 + 2?"}]
GOOD, BAD = "2 + 2 = 4.", "2 + 2 = 5, I think."


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(str(MODEL))


def spec(**values) -> DataSpec:
    return DataSpec.from_recipe(Recipe(**{"max_length": 512, "objective": "dpo", **values}))


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def chatml(messages: list[dict]) -> str:
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def answer(content: str) -> list[dict]:
    return [{"role": "assistant", "content": content}]


def test_conversational_pair_masks_exactly_the_answer_and_its_end_of_turn(tok):
    """Against a hand-written ChatML rendering: the prompt and the generation prompt are masked, the answer and
    <|im_end|> are trained, the trailing newline is not."""
    row = tokenize_pair({"prompt": PROMPT, "chosen": answer(GOOD), "rejected": answer(BAD)}, 0, tok, spec(), "t")
    for key, content in (("", GOOD), ("rejected_", BAD)):
        prefix = ids(tok, chatml(PROMPT) + "<|im_start|>assistant\n")
        trained = ids(tok, content + "<|im_end|>")
        assert row[f"{key}input_ids"] == prefix + trained + ids(tok, "\n")
        assert row[f"{key}labels"] == [IGNORE_INDEX] * len(prefix) + trained + [IGNORE_INDEX]
    assert row["dropped"] == ""


def test_implicit_prompt_is_the_shared_leading_messages(tok):
    explicit = tokenize_pair({"prompt": PROMPT, "chosen": answer(GOOD), "rejected": answer(BAD)}, 0, tok, spec(), "t")
    implicit = tokenize_pair({"chosen": PROMPT + answer(GOOD), "rejected": PROMPT + answer(BAD)}, 0, tok, spec(), "t")
    assert implicit == explicit


def test_string_pair_trains_completion_and_eos(tok):
    row = tokenize_pair({"prompt": "Q: 2 + 2?\nA:", "chosen": " 4", "rejected": " 5"}, 0, tok, spec(), "t")
    prompt = tok("Q: 2 + 2?\nA:")["input_ids"]
    assert row["input_ids"] == prompt + ids(tok, " 4") + [tok.eos_token_id]
    assert row["labels"] == [IGNORE_INDEX] * len(prompt) + ids(tok, " 4") + [tok.eos_token_id]
    assert row["rejected_input_ids"][:len(prompt)] == prompt


def test_truncation_policy(tok):
    pair = {"prompt": "one two three four five six seven eight", "chosen": " alpha beta gamma delta",
            "rejected": " omega"}
    full = tokenize_pair(pair, 0, tok, spec(), "t")
    prompt_len = full["labels"].index(next(x for x in full["labels"] if x != IGNORE_INDEX))
    # max_prompt_length keeps the prompt's last tokens (those next to the answer)
    cut = tokenize_pair(pair, 0, tok, spec(max_prompt_length=3), "t")
    assert cut["input_ids"] == full["input_ids"][prompt_len - 3:]
    # max_completion_length cuts each completion's end
    short = tokenize_pair(pair, 0, tok, spec(max_completion_length=2), "t")
    assert short["input_ids"] == full["input_ids"][:prompt_len + 2]
    assert short["rejected_input_ids"] == full["rejected_input_ids"][:prompt_len + 2]
    # max_length caps prompt + completion; a prompt that fills it leaves nothing to compare: dropped
    assert tokenize_pair(pair, 0, tok, spec(max_length=prompt_len + 1), "t")["input_ids"] == \
        full["input_ids"][:prompt_len + 1]
    assert tokenize_pair(pair, 0, tok, spec(max_length=prompt_len), "t")["dropped"] == "overlong"
    assert tokenize_pair(pair, 0, tok, spec(max_length=prompt_len + 1, overlong_examples="drop"), "t")["dropped"] \
        == "overlong"


def test_dataset_drops_and_counts_identical_and_overlong_pairs(tok):
    raw = Dataset.from_list([
        {"prompt": PROMPT, "chosen": answer(GOOD), "rejected": answer(BAD)},
        {"prompt": PROMPT, "chosen": answer(GOOD), "rejected": answer(GOOD)},
        {"prompt": PROMPT + [{"role": "user", "content": "word " * 200}], "chosen": answer(GOOD),
         "rejected": answer(BAD)},
    ])
    kept, stats = tokenize_dataset(raw, tok, spec(max_length=64), "preference", "pairs")
    assert len(kept) == 1 and kept.column_names == ["input_ids", "labels", "rejected_input_ids", "rejected_labels"]
    assert (stats["dropped_identical"], stats["dropped_overlong"], stats["examples"]) == (1, 1, 1)
    assert stats["tokens"] == len(kept[0]["input_ids"]) + len(kept[0]["rejected_input_ids"])


@pytest.mark.parametrize("example, message", [
    ({"prompt": "Q", "chosen": "", "rejected": " no"}, "the chosen completion is empty"),
    ({"chosen": " yes", "rejected": " no"}, "string pairs need a prompt column"),
    ({"prompt": "Q", "chosen": answer("a"), "rejected": " no"}, "both be strings or both be message lists"),
    ({"prompt": PROMPT, "chosen": [{"role": "user", "content": "a"}], "rejected": answer("b")},
     "the chosen completion starts with a user message"),
    ({"chosen": answer("a"), "rejected": answer("b")}, "needs a prompt of at least one message"),
])
def test_bad_pairs_are_refused_naming_the_example(tok, example, message):
    with pytest.raises(HftrainError, match="pairs example 0") as err:
        tokenize_pair(example, 0, tok, spec(), "pairs")
    assert message in str(err.value)


def test_a_pair_whose_prompt_tokens_differ_is_refused():
    """A generation prompt ending in a space: BPE merges it into an answer starting with a digit (" 4"), not into one
    starting with a newline, so the two renderings would not share their prompt tokens."""
    tok = AutoTokenizer.from_pretrained(str(MODEL))
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'user' %}U: {{ m['content'] }}\n{% else %}"
                         "A: {{ m['content'] }}\n{% endif %}{% endfor %}{% if add_generation_prompt %}A: {% endif %}")
    pair = {"prompt": [{"role": "user", "content": "hi"}], "chosen": answer("4"), "rejected": answer("\nfive")}
    with pytest.raises(HftrainError, match="prompt tokens differ between the chosen and the rejected"):
        tokenize_pair(pair, 0, tok, spec(), "t")


def test_format_detection_and_objective_checks():
    assert detect_format(["prompt", "chosen", "rejected"], "auto", "text", "messages", "d") == "preference"
    assert detect_format(["chosen", "rejected"], "auto", "text", "messages", "d") == "preference"
    with pytest.raises(HftrainError) as err:
        recipe_from_dict({"objective": "dpo", "packing": True, "loss_type": "ipo", "label_smoothing": 0.1,
                          "use_liger_kernel": True, "dataset_format": "messages"}, for_training=False)
    text = str(err.value)
    for part in ("packing with objective=dpo is refused", "label_smoothing=0.1 applies to objective dpo with "
                 "loss_type sigmoid", "use_liger_kernel and loss_chunk_tokens", "dataset_format must be auto or "
                 "preference"):
        assert part in " ".join(text.split()), part
    with pytest.raises(HftrainError, match="loss_type=hinge is a dpo loss"):
        recipe_from_dict({"loss_type": "hinge"}, for_training=False)
    with pytest.raises(HftrainError,
                       match="precompute_ref_log_probs computes dpo's and kto's reference, but objective=simpo"):
        recipe_from_dict({"objective": "simpo", "precompute_ref_log_probs": True}, for_training=False)
    with pytest.raises(HftrainError, match="max_prompt_length=8 needs objective dpo, simpo, orpo, kto or reward"):
        recipe_from_dict({"max_prompt_length": 8}, for_training=False)


def test_collator_puts_chosen_rows_then_rejected_rows():
    rows = Dataset.from_list([
        {"input_ids": [5, 6, 7], "labels": [IGNORE_INDEX, 6, 7], "rejected_input_ids": [5, 8],
         "rejected_labels": [IGNORE_INDEX, 8]},
        {"input_ids": [9, 10], "labels": [IGNORE_INDEX, 10], "rejected_input_ids": [9, 11, 12, 13],
         "rejected_labels": [IGNORE_INDEX, 11, 12, 13]},
    ])
    batch = Collator(rows, pad_token_id=0)([1, 0])
    assert batch["input_ids"].tolist() == [[9, 10, 0, 0], [5, 6, 7, 0], [9, 11, 12, 13], [5, 8, 0, 0]]
    assert batch["labels"][:, 0].tolist() == [IGNORE_INDEX] * 4 and int(batch["num_examples"]) == 2
    empty = Collator(rows, pad_token_id=0)([])
    assert empty["input_ids"].shape == (2, 1) and (empty["labels"] == IGNORE_INDEX).all()


def test_preview_shows_both_completions_of_a_pair(tmp_path):
    dump = tmp_path / "rows.jsonl"
    proc = subprocess.run([sys.executable, "-m", "hftrain.data", "--config", str(REPO / "recipes" / "tiny-dpo.yaml"),
                           "--show", "1", "--dump", "16", str(dump)], capture_output=True, text=True, cwd=REPO,
                          env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    assert "--- example 0 chosen" in proc.stdout and "--- example 0 rejected" in proc.stdout
    assert "0 identical pairs dropped" in proc.stdout
    rows = [json.loads(line) for line in dump.read_text().splitlines()]
    # one micro-batch of 8 pairs: 8 chosen rows, then the 8 rejected rows of the same pairs (shared prompt tokens)
    for chosen, rejected in zip(rows[:8], rows[8:]):
        prompt = next(i for i, label in enumerate(chosen["labels"]) if label != IGNORE_INDEX)
        assert chosen["input_ids"][:prompt] == rejected["input_ids"][:prompt]
        assert chosen["input_ids"] != rejected["input_ids"]


def test_mixtures_of_preference_datasets_and_what_they_refuse(tok, tmp_path):
    from hftrain.config import DatasetSource
    from hftrain.data import load_datasets

    pairs = str(REPO / "data" / "preference.jsonl")
    recipe = Recipe(objective="dpo", validation_split_percentage=0, max_length=128,
                    dataset_mixture=[DatasetSource(pairs, weight=1.0), DatasetSource(pairs, weight=0.5)])
    train, _, stats = load_datasets(recipe, tok)
    assert len(train) == 400 + 200 and [s["format"] for s in stats["sources"]] == ["preference", "preference"]
    mixed = Recipe(objective="dpo", validation_split_percentage=0,
                   dataset_mixture=[DatasetSource(pairs), DatasetSource(str(REPO / "data" / "chat.jsonl"))])
    with pytest.raises(HftrainError, match="has format messages but objective=dpo trains on preference pairs"):
        load_datasets(mixed, tok)
    with pytest.raises(HftrainError, match="has format preference but objective=sft"):
        load_datasets(Recipe(dataset_name=pairs, validation_split_percentage=0), tok)
