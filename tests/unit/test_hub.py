"""hftrain.hub and the recipe's hub group, against the fake hub of tests/hub_server.py (huggingface_hub's endpoint
pointed at it): the refusals, and a run's pushes without training (the trained run is tests/e2e/test_hub.py)."""

from __future__ import annotations

import json
import threading
import time

import pytest
from huggingface_hub import constants

from hftrain import trained
from hftrain.config import Recipe, unused_settings, validate
from hftrain.errors import HftrainError
from hftrain.hub import HubPush, preflight_problems
from hftrain.model import build_tokenizer
from hftrain.preflight import model_problems
from tests.conftest import REPO, free_port
from tests.hub_server import FakeHub


@pytest.fixture
def fake_hub(monkeypatch):
    def start(**fail):
        hub = FakeHub(fail=fail)
        monkeypatch.setattr(constants, "ENDPOINT", hub.url)  # what HF_ENDPOINT sets at import
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setenv("HF_TOKEN", "hf_fake_unit_token")
        return hub
    return start


def hub_problems(**fields) -> list[str]:
    return [p for p in validate(Recipe(**fields)) if "hub" in p]


def test_recipe_rules():
    assert hub_problems(push_to_hub=True, hub_model_id="org/name") == []
    assert hub_problems(push_to_hub=True, output_dir="outputs/tiny-chat") == []  # the default repo: the folder name
    assert "not a valid hub repo id" in hub_problems(push_to_hub=True, hub_model_id="org/na--me")[0]
    assert "'my run', which is not a valid hub repo id" in hub_problems(push_to_hub=True, output_dir="out/my run")[0]
    # a recipe that pushes, run with --push_to_hub false: accepted, its hub settings named as unused at start-up
    off = Recipe(hub_model_id="org/m", hub_private_repo=True, hub_token="hf_secret_value")
    assert hub_problems(**vars(off)) == []
    assert unused_settings(off) == ["push_to_hub false: hub_model_id=org/m, hub_private_repo=True, hub_token not used"]


def test_preflight_needs_a_token_and_online_mode(monkeypatch, tmp_path):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "token"))  # no `hf auth login` token
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    problems = preflight_problems(Recipe(push_to_hub=True, hub_model_id="org/name"))
    assert len(problems) == 2 and "none is set" in problems[0] and "HF_HUB_OFFLINE=1" in problems[1]
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    assert preflight_problems(Recipe(push_to_hub=True, hub_model_id="org/name", hub_token="hf_given")) == []
    assert preflight_problems(Recipe()) == []


def test_pushes_at_saves_skip_while_busy_and_a_failed_final_push_is_one_paragraph(fake_hub, tmp_path):
    model, final = tmp_path / "model", tmp_path / "final"
    for folder, content in ((model, b"step 2"), (final, b"final")):
        folder.mkdir()
        (folder / "weights.bin").write_bytes(content)
    lines = []
    with fake_hub(create={3}) as hub:
        push = HubPush(Recipe(push_to_hub=True, hub_model_id="org/m", hub_strategy="all_checkpoints"), True,
                       lines.append, lines.append)
        release = threading.Event()
        push._submit("a slow upload", release.wait)  # an upload in flight: the next save is not pushed by the loop
        assert push.busy()
        release.set()
        push.executor.submit(lambda: None).result()
        assert not push.busy()
        push.at_save(2, model, model, None)  # model to the root, the "checkpoint" to checkpoint-2/
        push.executor.submit(lambda: None).result()
        assert hub.repos["org/m"].branches["main"] == {"weights.bin": b"step 2", "model/weights.bin": b"step 2"}
        with pytest.raises(HftrainError) as refused:
            push.finish(final)  # the third repo creation answers 500
    message = str(refused.value)
    assert message.startswith(f"pushing {final} to the hub repo 'org/m' failed (Server error '500")
    assert f"Push it again with `hf upload org/m {final} .`" in message
    assert hub.repos["org/m"].branches["main"]["weights.bin"] == b"step 2"  # the repo is as it was


def test_a_refused_card_says_what_the_hub_refused(fake_hub, tmp_path):
    """A card the hub's metadata check refuses (as the hub does a base_model that is a path; hftrain's own cards name
    only hub ids there, tests/unit/test_card.py) fails the push with the hub's listed reason, not only huggingface_hub's
    first line."""
    final = tmp_path / "final"
    final.mkdir()
    (final / "README.md").write_text("---\nbase_model: /home/me/models/base\n---\n# a card\n")
    with fake_hub() as hub:
        push = HubPush(Recipe(push_to_hub=True, hub_model_id="org/m"), True, print, print)
        with pytest.raises(HftrainError) as refused:
            push.finish(final)
    assert "failed (Invalid metadata in README.md: \"base_model[0]\" with value \"/home/me/models/base\" is not " \
           "valid. If possible, use a model id from https://hf.co/models); the trained model is saved there" \
        in str(refused.value)
    assert not hub.repos["org/m"].commits


# ------------------------------------------------------------------------------------- a hub out of reach
@pytest.fixture
def hub_out_of_reach(monkeypatch):
    """huggingface_hub online, its endpoint a local port nothing listens on: every connection is refused, as on a
    machine without the hub (what HF_ENDPOINT and HF_HUB_OFFLINE set at import)."""
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return constants.ENDPOINT


def test_a_hub_out_of_reach_fails_each_load_at_once_in_one_paragraph(hub_out_of_reach, tmp_path, capfd, caplog):
    """Issue 49 (9): huggingface_hub retried each file 5 times, 1 to 8 s apart, with two log lines per try (11
    lines, ~25 s) before transformers said it could not connect: 32 s for `hftrain launch`, 41 s for `hftrain eval`.
    One request without retries now ends the load, for the training entry's preflight and tokenizer, and for
    chat / eval's trained folders (an adapter whose base is a hub id)."""
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "nobody-xyz/not-a-model",
                                                             "peft_type": "LORA", "task_type": "CAUSAL_LM"}))
    loads = {
        "preflight": lambda: model_problems(Recipe(model_name_or_path="nobody-xyz/not-a-model"))[1][0],
        "tokenizer": lambda: build_tokenizer(Recipe(model_name_or_path=str(REPO / "models" / "tiny-llama"),
                                                    tokenizer_name_or_path="nobody-xyz/not-a-tokenizer")),
        "chat / eval": lambda: trained.inspect(adapter),
    }
    for name, load in loads.items():
        started = time.monotonic()
        try:
            said = load()
        except HftrainError as error:
            said = str(error)
        seconds = time.monotonic() - started
        assert seconds < 15, f"{name}: {seconds:.1f} s"
        assert f"the hub at {hub_out_of_reach} cannot be reached from this machine" in said, (name, said)
        assert "Check the id" in said and "HF_HUB_OFFLINE=1" in said and "local" in said, (name, said)
    printed = capfd.readouterr().err + "\n".join(record.getMessage() for record in caplog.records)
    assert "Retrying in" not in printed and "thrown while requesting" not in printed, printed
