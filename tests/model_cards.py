"""Checks of the model card (README.md) in a folder hftrain wrote for use, shared by the e2e tests that already
produce such folders (a full fine-tune, each adapter method, a merge): the card is read back with the hub's own
parser, and its quick start is run as a user would paste it."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

from huggingface_hub import ModelCard

from hftrain.card import shipped_model


def check_card(folder: Path, *, library: str, base_model: str | Path, tags: set[str], rows: list[dict] | None = None,
               run_quick_start: bool = False) -> ModelCard:
    """The card parses, carries the hub metadata, has no template placeholder, and states the run's final train and
    eval losses as metrics.jsonl (`rows`) logged them at the final step. `base_model`: a hub id, which the metadata
    names, or a local folder (a Path), which the body names and the metadata does not (the hub takes only ids); one of
    hftrain's shipped models by its name, not its path."""
    card = ModelCard.load(folder / "README.md")
    data = card.data.to_dict()
    assert (data["library_name"], data["pipeline_tag"]) == (library, "text-generation")
    if isinstance(base_model, Path) and shipped_model(str(base_model)) is not None:  # named, not by its path
        intro = card.text.split("## Quick start")[0]
        assert "base_model" not in data and f"of hftrain's shipped `{shipped_model(str(base_model))}`" in intro
        assert str(base_model.resolve()) not in intro
    elif isinstance(base_model, Path):
        assert "base_model" not in data and f"of the local model `{base_model.resolve()}`" in card.text, data
    else:
        assert data["base_model"] == base_model
    assert {"hftrain", *tags} <= set(data["tags"]), data["tags"]
    assert "More Information Needed" not in card.text and "TODO" not in card.text
    for section in ("## Quick start", "## Framework versions"):
        assert section in card.text
    if rows:
        train = [r for r in rows if r.get("loss") is not None]
        last_step = max(r["step"] for r in rows)
        assert f"| train loss | {train[-1]['loss']:.4g} (logged at step {train[-1]['step']})" in card.text
        evals = [r for r in rows if "eval_loss" in r and r["step"] == last_step]
        if evals:
            assert f"| eval loss | {evals[-1]['eval_loss']:.4g} (after step {last_step})" in card.text
        title = "Train and eval loss" if any("eval_loss" in r for r in rows) else "Train loss"  # eval shown if run
        assert f"![{title}](loss.png)" in card.text
        assert (folder / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if run_quick_start:
        assert run_snippet(card.text).endswith("\n")  # it loaded the folder, generated and printed
    return card


def run_snippet(text: str) -> str:
    """Run the card's python block (a few new tokens instead of 64); returns what it printed."""
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1).replace("max_new_tokens=64", "max_new_tokens=4")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "<model card quick start>", "exec"), {})  # noqa: S102 - the card's own snippet
    return out.getvalue()
