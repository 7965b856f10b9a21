"""push_to_hub for real, against a fake hub on 127.0.0.1 (tests/hub_server.py) that huggingface_hub reaches through
HF_ENDPOINT: what arrived is compared with the run's folders byte for byte. The refusals (no token, a repo id the hub
would refuse) run in one process through `main`, before anything loads.

The failing request is the first repo creation (each upload creates the repo if missing, exist_ok): huggingface_hub
itself retries a 500 on preupload and commit (5 times with backoff, 23 s at worst), so a one-off 500 there never
reaches hftrain; a 500 on create_repo does, and the upload fails as any failed upload does.
"""

from __future__ import annotations

import json
import re

import pytest

from tests.conftest import REPO, TINY_CHAT, launch, run_main_cases
from tests.hub_server import FakeHub
from tests.model_cards import check_card

pytestmark = pytest.mark.launch
TOKEN = "hf_fake_token_for_tests"


def folder_files(folder, prefix: str = "") -> dict[str, bytes]:
    return {prefix + str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_push_during_and_after_training_with_a_failed_upload_retried(tmp_path):
    """DDP over 2 processes: both write the model for use at a save (gathered as for the final save), only the main
    process uploads (each push arrives once)."""
    out = tmp_path / "out"
    with FakeHub(fail={"create": {1}}) as hub:
        run = launch(out, *TINY_CHAT, "--per_device_train_batch_size", "4", "--max_steps", "8", "--logging_steps", "2",
                     "--save_steps", "2", "--eval_steps", "4", "--push_to_hub", "--hub_model_id", "org/tiny-push",
                     "--hub_private_repo", "true", "--hub_strategy", "checkpoint", preset="cpu_ddp", processes=2,
                     env={"HF_ENDPOINT": hub.url, "HF_TOKEN": TOKEN, "HF_HUB_OFFLINE": "0"})
    assert run.state()["launch"]["num_processes"] == 2
    assert f"pushing to {hub.url}/org/tiny-push (hub_strategy checkpoint)" in run.stdout
    # the first save's upload failed: reported once, in one line, and training went on
    failures = [line for line in run.stderr.splitlines() if "hub push to 'org/tiny-push' failed" in line]
    assert len(failures) == 1 and "500" in failures[0] and "the next save" in failures[0], run.stderr[-3000:]
    assert "Traceback" not in run.stderr

    repo = hub.repos["org/tiny-push"]
    assert repo.private is True and hub.tokens == {TOKEN}
    messages = [message for _, message, _ in repo.commits]
    assert messages[-1] == "End of training"
    in_training = [int(m.split()[-1]) for m in messages if re.fullmatch(r"Training in progress, step \d+", m)]
    assert in_training and in_training[0] > 2, messages  # step 2's upload failed; a later save pushed again
    assert "Training in progress, step 2" not in messages
    assert len(messages) == len(set(messages)) and hub.counts["create"] == len(messages) + 1  # one uploader

    # the repo's root is output_dir/final, byte for byte (card included); last-checkpoint/ the newest pushed
    # checkpoint-N, byte for byte
    files = repo.branches["main"]
    root = {k: v for k, v in files.items() if not k.startswith("last-checkpoint/")}
    assert root == folder_files(out / "final")
    pushed = max(int(m.split()[-2].rstrip(",")) for m in messages if m.endswith(", checkpoint"))
    assert {k: v for k, v in files.items() if k.startswith("last-checkpoint/")} == \
        folder_files(out / f"checkpoint-{pushed}", "last-checkpoint/")
    assert not (out / ".hub-upload").exists() and not list(out.glob(".tmp-*"))
    assert f"pushed {out / 'final'} (" in run.stdout and f"{hub.url}/org/tiny-push" in run.stdout

    # the card names the repo, loads it in its quick start, and carries the final evaluation
    card = check_card(out / "final", library="transformers", base_model=REPO / "models" / "tiny-llama",
                      tags={"sft", "full"}, rows=run.metrics())
    assert card.data.model_name == "org/tiny-push" and 'from_pretrained("org/tiny-push")' in card.text
    assert json.loads(files["hftrain_state.json"])["progress"]["step"] == 8
    assert b"hf_fake" not in b"".join(files.values())  # the token is in no file


def test_push_refusals_before_anything_loads(tmp_path):
    """No token anywhere (no HF_TOKEN, no `hf auth login` file under HF_HOME) and repo ids the hub's validator refuses:
    one paragraph each, exit 2, nothing written."""
    base = [*TINY_CHAT, "--max_steps", "1"]
    cases = {
        "no_token": [*base, "--output_dir", str(tmp_path / "a"), "--push_to_hub", "--hub_model_id", "org/name"],
        "bad_repo_id": [*base, "--output_dir", str(tmp_path / "b"), "--push_to_hub", "--hub_model_id", "org/x/y"],
        "bad_default_repo_id": [*base, "--output_dir", str(tmp_path / "my run"), "--push_to_hub"],
    }
    runs = run_main_cases({name: (argv, {}) for name, argv in cases.items()}, tmp_path,
                          process_env={"HF_HOME": str(tmp_path / "hf_home")})
    for name, run in runs.items():
        assert run.returncode == 2 and run.stderr.startswith("hftrain: error:"), (name, run.stderr)
        assert run.stderr.count("hftrain: error:") == 1 and "Traceback" not in run.stderr
        assert not run.output_dir.exists()
    message = {name: " ".join(run.stderr.split()) for name, run in runs.items()}
    assert "push_to_hub needs a hub token with write access to 'org/name' and none is set" in message["no_token"]
    assert "`hf auth login`" in message["no_token"] and "HF_TOKEN" in message["no_token"]
    assert "push_to_hub with HF_HUB_OFFLINE=1" in message["no_token"]  # both problems of the machine at once
    assert "hub_model_id 'org/x/y' is not a valid hub repo id" in message["bad_repo_id"]
    assert "pushes to a repo named after output_dir, 'my run', which is not a valid hub repo id" in \
        message["bad_default_repo_id"] and "Set hub_model_id" in message["bad_default_repo_id"]
