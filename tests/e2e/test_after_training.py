"""After training (issue 38, parts 3-5): `hftrain chat` and `hftrain eval` on trained folders, eval_tasks and
log_completions during training, each against an independent computation:

- chat's greedy replies equal transformers' `generate` on the same chat template, turn after turn (the conversation
  kept, /reset honoured), for a full final folder, an adapter folder and the checkpoint-N of both runs;
- `hftrain eval`'s results (metrics and every example's log-likelihoods) equal `lm_eval.simple_evaluate` loading the
  same folder itself, on a local YAML task over a local jsonl file (lm-eval never reaches the hub);
- eval_tasks' final row equals that same `simple_evaluate` on the saved final model (the live model, not saved first);
- log_completions' completions.jsonl rows equal `generate` of the final model on each prompt, and its W&B (offline)
  table holds them.

Two short runs shared by every test (module fixtures): full fine-tuning with eval_tasks, log_completions and W&B
offline (2 steps, an evaluation at each), and LoRA (2 steps); each saves checkpoint-2, the state of its final folder.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.conftest import REPO, launch, launch_env, run_script, write_jsonl
from tests.wandb_records import summary

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is in the eval and dev extras (pip install -e '.[dev]')")
from lm_eval.tasks import TaskManager  # noqa: E402

from hftrain import chat as chat_tool  # noqa: E402
from hftrain import trained  # noqa: E402
from hftrain.cli import main as cli  # noqa: E402

TASK = "tiny_choice"
LIMIT = 8
TINY_CHAT = ["--config", str(REPO / "recipes" / "tiny-chat.yaml"), "--max_steps", "2", "--save_steps", "2",
             "--disable_tqdm", "true", "--checkpoint_preflight", "false"]
TURNS = ["What is the capital of Germany?", "And of France?", "/reset", "How many letters are in green?"]


@pytest.fixture(scope="module")
def task_file(tmp_path_factory) -> Path:
    """A local multiple-choice task: 8 sums, 3 choices each, as a YAML over a jsonl file."""
    folder = tmp_path_factory.mktemp("tasks")
    data = write_jsonl(folder / "sums.jsonl", [
        {"question": f"What is {a} plus {b}?", "choices": [str(a + b), str(a + b + 1), str(a * b + 7)], "answer": i % 3}
        for i, (a, b) in enumerate([(1, 2), (3, 4), (2, 2), (5, 1), (6, 3), (7, 2), (4, 4), (8, 1)])])
    path = folder / f"{TASK}.yaml"
    path.write_text(f"task: {TASK}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
                    "test_split: test\noutput_type: multiple_choice\n"
                    "doc_to_text: \"Question: {{question}}\\nAnswer:\"\ndoc_to_choice: \"{{choices}}\"\n"
                    "doc_to_target: answer\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    return path


@pytest.fixture(scope="module")
def full(tmp_path_factory, task_file):
    tmp = tmp_path_factory.mktemp("full")
    return run_script(tmp / "run", *TINY_CHAT, "--eval_steps", "1", "--eval_tasks", str(task_file),
                      "--eval_tasks_limit", str(LIMIT), "--log_completions", "true", "--num_completion_prompts", "2",
                      "--completion_max_new_tokens", "6", "--report_to", "wandb",
                      env={"WANDB_DIR": str(tmp), "WANDB_MODE": "offline"})


@pytest.fixture(scope="module")
def lora(tmp_path_factory):
    # a large learning rate: the adapter's answers differ from the base model's after 2 steps
    return run_script(tmp_path_factory.mktemp("lora") / "run", *TINY_CHAT, "--use_peft", "true",
                      "--learning_rate", "0.1")


@pytest.fixture(scope="module")
def reference_eval(full, task_file) -> dict:
    """lm-eval on its own: simple_evaluate loads the saved final folder itself."""
    return lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={full.output_dir / 'final'},dtype=float32",
                                   tasks=[str(task_file)], task_manager=TaskManager(include_defaults=False),
                                   limit=LIMIT, device="cpu")


def generate_replies(model, tokenizer, turns: list[str], system: str | None, max_new_tokens: int) -> list[str]:
    """The conversation replayed with transformers alone: the template over every message so far, greedy."""
    start = [{"role": "system", "content": system}] if system else []
    messages, replies = list(start), []
    for text in turns:
        if text == "/reset":
            messages = list(start)
            continue
        messages.append({"role": "user", "content": text})
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)
        out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
        reply = tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
        messages.append({"role": "assistant", "content": reply})
        replies.append(reply)
    return replies


def chat_in_process(folder: Path, turns: list[str], *options: str) -> str:
    args = chat_tool.build_arg_parser().parse_args([str(folder), *options])
    out = io.StringIO()
    chat_tool.chat(args, stdin=io.StringIO("".join(t + "\n" for t in turns)), out=out, err=io.StringIO())
    return out.getvalue()


def test_chat_scripted_equals_generate_on_the_template(full):
    """`hftrain chat final` with turns piped in: every reply is transformers' greedy generate of the conversation
    so far (system message, earlier turns and replies), /reset starting over; only the replies reach stdout."""
    final = full.output_dir / "final"
    proc = subprocess.run([sys.executable, "-m", "hftrain.cli", "chat", str(final), "--system", "Answer briefly.",
                           "--max_new_tokens", "12"], input="".join(t + "\n" for t in TURNS), capture_output=True,
                          text=True, cwd=REPO, env=launch_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr
    model = AutoModelForCausalLM.from_pretrained(final).eval()
    replies = generate_replies(model, AutoTokenizer.from_pretrained(final), TURNS, "Answer briefly.", 12)
    assert proc.stdout == "".join(r + "\n" for r in replies)
    assert any(replies), "the tiny model's replies are all empty: the comparison would prove little"
    assert "/reset starts over" in proc.stderr and "greedy" in proc.stderr


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_chat_adapter_and_checkpoints(full, lora):
    """An adapter folder (base from adapter_config.json) loads as PeftModel on its base (the same logits, not the
    base's) and chats as transformers' generate with it; each run's checkpoint-2 (saved at the last step: the final
    folder's weights) loads with the final folder's logits and answers as it does."""
    from peft import PeftModel

    final = lora.output_dir / "final"
    base_name = json.loads((final / "adapter_config.json").read_text())["base_model_name_or_path"]
    base = AutoModelForCausalLM.from_pretrained(base_name, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 5, 9, 42, 7, 3]])
    base_logits = logits(base, ids)
    adapter = PeftModel.from_pretrained(base, final).eval()
    tokenizer = AutoTokenizer.from_pretrained(final)
    for folder in (final, lora.output_dir / "checkpoint-2"):
        loaded = trained.load(folder)
        torch.testing.assert_close(logits(loaded.model, ids), logits(adapter, ids), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(logits(adapter, ids), base_logits, atol=1e-4)  # the adapter is applied
    expected = generate_replies(adapter, tokenizer, TURNS, None, 10)
    for folder in (final, lora.output_dir / "checkpoint-2"):
        assert chat_in_process(folder, TURNS, "--max_new_tokens", "10") == "".join(r + "\n" for r in expected)
    full_final = full.output_dir / "final"
    model = AutoModelForCausalLM.from_pretrained(full_final).eval()
    torch.testing.assert_close(logits(trained.load(full.output_dir / "checkpoint-2").model, ids), logits(model, ids),
                               rtol=1e-5, atol=1e-6)
    full_expected = generate_replies(model, AutoTokenizer.from_pretrained(full_final), TURNS, None, 10)
    assert chat_in_process(full.output_dir / "checkpoint-2", TURNS, "--max_new_tokens", "10") == \
        "".join(r + "\n" for r in full_expected)


def test_chat_exit_ends_the_conversation(full):
    out = chat_in_process(full.output_dir / "final", ["Hello", "/exit", "Never answered"], "--max_new_tokens", "3")
    assert out.count("\n") == 1


def test_eval_equals_simple_evaluate(full, task_file, reference_eval, tmp_path):
    """`hftrain eval final --tasks task.yaml`: lm-eval's table on the console and, in --output, the results of
    simple_evaluate on the same folder: every metric and every example's log-likelihoods."""
    out = tmp_path / "results.json"
    proc = subprocess.run([sys.executable, "-m", "hftrain.cli", "eval", str(full.output_dir / "final"), "--tasks",
                           str(task_file), "--limit", str(LIMIT), "--output", str(out), "--log_samples"],
                          capture_output=True, text=True, cwd=REPO, env=launch_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert f"|{TASK}|" in proc.stdout.replace(" ", "") and "acc_norm" in proc.stdout
    got = json.loads(out.read_text())
    want = reference_eval["results"][TASK]
    assert {k: v for k, v in got["results"][TASK].items() if "," in k} == \
        pytest.approx({k: v for k, v in want.items() if "," in k}, abs=0)
    samples, reference = got["samples"][TASK], reference_eval["samples"][TASK]
    assert len(samples) == len(reference) == LIMIT
    for mine, theirs in zip(samples, reference):
        assert mine["doc_id"] == theirs["doc_id"]
        assert [r[0][0] for r in mine["resps"]] == pytest.approx([float(r[0][0]) for r in theirs["resps"]], abs=1e-5)


def test_eval_tasks_during_training(full, reference_eval):
    """eval_tasks ran at each evaluation (steps 1 and 2) on the live model; the final row equals simple_evaluate on
    the saved final folder; the numbers are in metrics.jsonl and W&B as eval/<task>/<metric>."""
    rows = [r for r in full.metrics() if f"eval/{TASK}/acc" in r]
    assert [r["step"] for r in rows] == [1, 2]
    want = reference_eval["results"][TASK]
    assert rows[-1][f"eval/{TASK}/acc"] == want["acc,none"]
    assert rows[-1][f"eval/{TASK}/acc_norm"] == want["acc_norm,none"]
    assert rows[-1][f"eval/{TASK}/acc_stderr"] == pytest.approx(want["acc_stderr,none"])
    assert "eval_loss" in rows[-1]
    card = (full.output_dir / "final" / "README.md").read_text()
    assert f"| {TASK} acc (lm-eval) | {want['acc,none']:.4g} ± " in card  # the model card's results
    (run_file,) = full.output_dir.parent.glob("wandb/offline-run-*/run-*.wandb")
    logged = [h for h in summary(run_file)["history"] if f"eval/{TASK}/acc" in h]
    assert [h["_step"] for h in logged] == [1, 2]
    assert logged[-1][f"eval/{TASK}/acc"] == want["acc,none"]


def test_completions_at_each_evaluation(full):
    """completions.jsonl: the first 2 eval prompts completed at steps 1 and 2; the last ones equal greedy generate
    of the final model on the same prompt tokens; W&B's `completions` table at each evaluation holds the rows."""
    rows = [json.loads(line) for line in (full.output_dir / "completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 1, 2, 2]
    assert [r["prompt"] for r in rows[:2]] == [r["prompt"] for r in rows[2:]]
    assert all(r["prompt"].endswith("<|im_start|>assistant\n") for r in rows)  # cut where the answer starts
    final = full.output_dir / "final"
    model, tokenizer = AutoModelForCausalLM.from_pretrained(final).eval(), AutoTokenizer.from_pretrained(final)
    for row in rows[2:]:
        ids = tokenizer(row["prompt"], add_special_tokens=False, return_tensors="pt").input_ids
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
        assert row["completion"] == tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert "hftrain: completion at step 2:" in full.stdout
    (run_file,) = full.output_dir.parent.glob("wandb/offline-run-*/run-*.wandb")
    tables = [h for h in summary(run_file)["history"] if "completions/_type" in h]
    assert [h["_step"] for h in tables] == [1, 2]
    table = json.loads(Path(run_file.parent, "files", tables[-1]["completions/path"]).read_text())
    assert table["columns"] == ["step", "prompt", "completion"]
    assert table["data"] == [[r["step"], r["prompt"], r["completion"]] for r in rows[2:]]
    assert all("completions" not in m for m in full.metrics())


@pytest.mark.launch
def test_eval_tasks_and_completions_under_ddp(tmp_path, task_file):
    """2 DDP processes: the main process runs lm-eval on its whole replica while the other waits, so the final row
    equals simple_evaluate on the saved folder; completions are written once, by the main process."""
    run = launch(tmp_path / "run", *TINY_CHAT, "--eval_tasks", str(task_file), "--eval_tasks_limit", str(LIMIT),
                 "--log_completions", "true", "--num_completion_prompts", "2", "--completion_max_new_tokens", "4",
                 preset="cpu_ddp", processes=2)
    want = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={run.output_dir / 'final'},dtype=float32",
                                   tasks=[str(task_file)], task_manager=TaskManager(include_defaults=False),
                                   limit=LIMIT, device="cpu")["results"][TASK]
    (row,) = [r for r in run.metrics() if f"eval/{TASK}/acc" in r]  # eval_steps 30: the final evaluation only
    assert (row["step"], row[f"eval/{TASK}/acc"], row[f"eval/{TASK}/acc_norm"]) == \
        (2, want["acc,none"], want["acc_norm,none"])
    rows = [json.loads(line) for line in (run.output_dir / "completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 2]


# ------------------------------------------------------------------------------------------------- bad input
def refused(capsys, *argv: str) -> str:
    """`hftrain ...`'s one-paragraph refusal: exit status 2, stderr only that paragraph."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        cli(list(argv))
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("hftrain: error:") and "Traceback" not in err, err
    return " ".join(err.split())


def test_bad_folders_and_tasks_are_one_paragraph(full, lora, tmp_path, capsys):
    """Not a model (a run's output_dir: its final folder named), an adapter whose base is gone, an unknown task
    (close names offered), a sharded checkpoint (what to do named): refused before any model loads."""
    message = refused(capsys, "chat", str(full.output_dir))
    assert "is not a model folder" in message and str(full.output_dir / "final") in message
    moved = tmp_path / "adapter"
    moved.mkdir()
    for f in (lora.output_dir / "final").iterdir():
        (moved / f.name).write_bytes(f.read_bytes())
    config = json.loads((moved / "adapter_config.json").read_text())
    (moved / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": "/gone/tiny-llama"}))
    message = refused(capsys, "eval", str(moved), "--tasks", "arc_easy")
    assert "'/gone/tiny-llama'" in message and "--base_model_name_or_path" in message
    message = refused(capsys, "eval", str(full.output_dir / "final"), "--tasks", "arc_eazy")
    assert "lm-eval knows no task 'arc_eazy'" in message and "arc_easy" in message
    sharded = tmp_path / "checkpoint-2"
    sharded.mkdir()
    for name in ("hftrain_config.yaml", "hftrain_state.json", "hftrain_complete.json"):
        (sharded / name).write_bytes((full.output_dir / "checkpoint-2" / name).read_bytes())
    state = json.loads((sharded / "hftrain_state.json").read_text())
    state["parallelism"].update(kind="fsdp2", name="FSDP2 FULL_SHARD")
    (sharded / "hftrain_state.json").write_text(json.dumps(state))
    message = refused(capsys, "chat", str(sharded))
    assert "FSDP2 FULL_SHARD" in message and f"--resume_from_checkpoint {sharded} --max_steps 2" in message
