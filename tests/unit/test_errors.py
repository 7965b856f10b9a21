"""hftrain/errors.py: a library's message cut to the sentence hftrain's error goes on after."""

from __future__ import annotations

import pytest

from hftrain.config import Recipe
from hftrain.errors import ConfigError, HftrainError, first_line
from hftrain.model import build_full_model


def test_first_line_is_one_line_without_its_closing_period():
    assert first_line(OSError("couldn't find them in the cached files.\nCheck your connection.")) == \
        "couldn't find them in the cached files"
    assert first_line(ValueError("no period here")) == "no period here"
    assert first_line(ValueError("...")) == "..."
    assert first_line(KeyError()) == "KeyError"


def test_an_unreachable_hub_model_reads_as_one_sentence_then_the_advice(monkeypatch):
    """transformers' offline message ends with a period; hftrain's sentence continues after it ("..files.. Give")."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HftrainError) as error:
        build_full_model(Recipe(model_name_or_path="nobody-xyz/not-a-model"))
    message = str(error.value)
    assert message.startswith("cannot load model 'nobody-xyz/not-a-model': ") and ". Give a local folder" in message
    assert ".." not in message


def test_a_config_error_reports_each_source_under_its_own_header_and_sourceless_problems_first():
    error = ConfigError(["a"], "recipe r.yaml", groups=[("command line", ["b", "c"]), (None, ["cannot load model 'x'"]),
                                                          ("recipe r.yaml", ["d"])])
    assert str(error) == ("cannot load model 'x'; invalid recipe r.yaml, 2 problems: (1) a (2) d; invalid command "
                          "line, 2 problems: (1) b (2) c")
    assert error.problems == ["cannot load model 'x'", "a", "d", "b", "c"]
    assert str(ConfigError(["a"])) == "invalid recipe, 1 problem: (1) a"  # as before: one source
