"""objective grpo with tool calling, end to end on the tiny tool-calling model (models/tiny-tools) with the shipped
calculator tool and final-answer reward; the turns are written by a scripted policy (tests/e2e/launchers/
scripted_tools.py: a random tiny model writes no tool calls), everything after the sampler is the product's.

One generation window of 8 completions trained twice (num_iterations 2: steps 1 and 2), then a second window (step
3): rollouts.jsonl holds each completion with its tool_mask and executed calls; TRL's tools metrics; step 1 equals
plain PyTorch on the logged rollouts with the tool tokens masked; 2 processes x 2 micro-batches x 2 == 1 x 8; a run
resumed from checkpoint-1 (inside the first window) trains what the uninterrupted run trained; bad input is refused
in one paragraph before the model loads.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from hftrain.rl.example_rewards import final_answer
from tests.conftest import REPO, launch, run_main_cases, run_script, write_jsonl

TOOLS_MODEL = REPO / "models" / "tiny-tools"
SCRIPTED = REPO / "tests" / "e2e" / "launchers" / "scripted_tools.py"
BASE = ["--model_name_or_path", str(TOOLS_MODEL), "--dataset_name", str(REPO / "data" / "tool_prompts.jsonl"),
        "--objective", "grpo", "--reward_funcs", "hftrain.rl.example_rewards.final_answer",
        "--tools", "hftrain.rl.example_tools.calculator", "--max_tool_calling_iterations", "2",
        "--num_generations", "4", "--max_completion_length", "128", "--max_steps", "3", "--num_iterations", "2",
        "--beta", "0", "--optim", "sgd", "--learning_rate", "1.0", "--weight_decay", "0",
        "--lr_scheduler_type", "constant", "--max_grad_norm", "1.0", "--eval_strategy", "no", "--logging_steps", "1",
        "--report_to", "none", "--seed", "32", "--ddp_timeout", "120"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("grpo-tools")
    evals = write_jsonl(tmp / "eval.jsonl", [json.loads(line) for line in
                                             (REPO / "data" / "tool_prompts.jsonl").read_text().splitlines()[-2:]])
    one = run_script(tmp / "1x8", *BASE, "--per_device_train_batch_size", "8", "--save_strategy", "steps",
                     "--save_steps", "1", "--checkpoint_preflight", "false", "--eval_strategy", "steps",
                     "--eval_steps", "3", "--eval_dataset_name", str(evals), "--per_device_eval_batch_size", "4",
                     script=SCRIPTED)
    return {
        "1x8": one,
        "2procs": launch(tmp / "2procs", *BASE, "--per_device_train_batch_size", "2", "--gradient_accumulation_steps",
                         "2", "--save_strategy", "no", preset="cpu_ddp", script=SCRIPTED),
        "resumed": run_script(tmp / "resumed", *BASE, "--per_device_train_batch_size", "8", "--save_strategy", "no",
                              "--resume_from_checkpoint", str(one.output_dir / "checkpoint-1"), script=SCRIPTED),
    }


def rollouts(run) -> list[dict]:
    return [json.loads(line) for line in (run.output_dir / "rollouts.jsonl").read_text().splitlines()]


def weights(run, folder: str = "final") -> dict[str, torch.Tensor]:
    return {k.removeprefix("lm."): v for k, v in load_file(run.output_dir / folder / "model.safetensors").items()}


def test_rollouts_hold_the_tool_calls_and_their_mask(runs):
    """Every row: tool_mask as long as completion_ids, 0 exactly on the tool messages and the next assistant header
    (checked on the decoded text), and the executed calls with their results (a failing call's error as its result);
    the reward is final_answer of the completion's messages."""
    tokenizer = AutoTokenizer.from_pretrained(TOOLS_MODEL)
    rows = rollouts(runs["1x8"])
    assert [r["step"] for r in rows] == [1] * 8 + [3] * 8
    kinds = set()
    for r in rows:
        assert len(r["tool_mask"]) == len(r["completion_ids"]) and set(r["tool_mask"]) <= {0, 1}
        masked = tokenizer.decode([t for t, m in zip(r["completion_ids"], r["tool_mask"]) if m == 0])
        results = [c["result"] for c in r["tool_calls"] if c["kept"]]
        assert masked == "".join(f"\n<|im_start|>tool\n{x}<|im_end|>\n<|im_start|>assistant\n" for x in results)
        sampled = tokenizer.decode([t for t, m in zip(r["completion_ids"], r["tool_mask"]) if m == 1])
        assert (sampled.endswith("<|im_end|>") or r["truncated"]) and "<|im_start|>" not in sampled
        for c in r["tool_calls"]:
            if c["name"] == "calculator" and c["arguments"]["op"] != "/":
                a, op, b = c["arguments"]["a"], c["arguments"]["op"], c["arguments"]["b"]
                assert c["result"] == str(eval(f"{a} {op} {b}")) and not c["failed"]  # noqa: S307 - digits only
                kinds.add("call")
            else:
                assert c["failed"] and c["result"].startswith("{'error': ")
                kinds.add("unknown tool" if "not found" in c["result"] else "error")
        kinds.add("no call" if not r["tool_calls"] else "")
        answer = json.loads((REPO / "data" / "tool_prompts.jsonl").read_text().splitlines()[0])  # a row's shape
        assert set(answer) == {"prompt", "answer"}
    assert kinds >= {"call", "error", "unknown tool", "no call"}
    prompts = {json.dumps(json.loads(line)["prompt"]): json.loads(line)["answer"]
               for line in (REPO / "data" / "tool_prompts.jsonl").read_text().splitlines()}
    for r in rows:
        question = r["prompt"].rsplit("<|im_start|>user\n", 1)[1].split("<|im_end|>")[0]
        expected = prompts[json.dumps([{"role": "user", "content": question}])]
        turns = [t for t in r["completion"].split("\n") if t]
        assert r["reward"] == final_answer(None, [[{"role": "assistant", "content": turns[-1]}]], None,
                                           [expected])[0]


def test_tool_metrics_and_lengths_count_model_tokens(runs):
    rows = rollouts(runs["1x8"])
    metrics = runs["1x8"].train_rows()
    for m, step in zip([metrics[0], metrics[2]], (1, 3)):
        mine = [r for r in rows if r["step"] == step]
        calls = [c for r in mine for c in r["tool_calls"]]
        assert m["tools/call_frequency"] == pytest.approx(len(calls) / 8)
        assert m["tools/failure_frequency"] == pytest.approx(sum(c["failed"] for c in calls) / len(calls))
        assert m["completions/mean_length"] == pytest.approx(sum(sum(r["tool_mask"]) for r in mine) / 8)
        assert m["reward"] == pytest.approx(sum(r["reward"] for r in mine) / 8)
    assert "tools/call_frequency" not in metrics[1]  # step 2 samples nothing



def test_evaluation_runs_the_tools_too(runs):
    """The final evaluation completes the 2 eval prompts 4 times each through the same tool loop: eval_rollouts.jsonl
    rows carry their tool_mask and calls, and the eval_ metrics count what they hold (model tokens only)."""
    rows = [json.loads(line) for line in (runs["1x8"].output_dir / "eval_rollouts.jsonl").read_text().splitlines()]
    [metrics] = [m for m in runs["1x8"].metrics() if "eval_reward" in m]
    assert len(rows) == 8 and all(len(r["tool_mask"]) == len(r["completion_ids"]) for r in rows)
    calls = [c for r in rows for c in r["tool_calls"]]
    assert calls and metrics["eval_tools/call_frequency"] == pytest.approx(len(calls) / 8)
    assert metrics["eval_tools/failure_frequency"] == pytest.approx(sum(c["failed"] for c in calls) / len(calls))
    assert metrics["eval_completions/mean_length"] == pytest.approx(sum(sum(r["tool_mask"]) for r in rows) / 8)
    assert metrics["eval_reward"] == pytest.approx(sum(r["reward"] for r in rows) / 8)


def test_first_step_equals_plain_pytorch_with_tool_tokens_masked(runs):
    """dapo: -sum over the model's tokens of A exp(logp - logp.detach()) / the model's tokens of the step (the tool
    tokens neither trained nor counted), clipping at 1, one SGD step -> checkpoint-1."""
    rows = [r for r in rollouts(runs["1x8"]) if r["step"] == 1]
    model = AutoModelForCausalLM.from_pretrained(TOOLS_MODEL, dtype=torch.float32)
    loss, tokens = 0.0, sum(sum(r["tool_mask"]) for r in rows)
    assert tokens < sum(len(r["completion_ids"]) for r in rows)  # some tokens are tool results
    for r in rows:
        ids = torch.tensor([r["prompt_ids"] + r["completion_ids"]])
        logps = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), dim=-1)
        n = len(r["completion_ids"])
        token_logps = logps[-n:].gather(1, torch.tensor(r["completion_ids"]).unsqueeze(1)).squeeze(1)
        mask = torch.tensor(r["tool_mask"], dtype=torch.float32)
        loss = loss - (r["advantage"] * torch.exp(token_logps - token_logps.detach()) * mask).sum()
    (loss / tokens).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    got = weights(runs["1x8"], "checkpoint-1")
    for name, value in model.state_dict().items():
        torch.testing.assert_close(got[name], value, rtol=1e-4, atol=2e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_two_processes_and_a_resume_inside_the_window_train_the_same(runs):
    """2 processes x 2 micro-batches of 2 sample the same rollouts (seeded per row and turn) and train the same
    weights as 1 x 8; a run resumed from checkpint-1 (saved inside the first window: its rollouts kept in the
    checkpoint) trains step 2 on them and samples step 3's window as the uninterrupted run did."""
    one, two, resumed = runs["1x8"], runs["2procs"], runs["resumed"]
    keys = ("step", "row", "completion_ids", "tool_mask", "tool_calls", "reward", "advantage")
    assert [{k: r[k] for k in keys} for r in rollouts(two)] == [{k: r[k] for k in keys} for r in rollouts(one)]
    assert [{k: r[k] for k in keys} for r in rollouts(resumed)] == \
        [{k: r[k] for k in keys} for r in rollouts(one) if r["step"] == 3]
    for other in (two, resumed):
        for name, value in weights(one).items():
            torch.testing.assert_close(weights(other)[name], value, rtol=1e-5, atol=1e-7,
                                       msg=lambda m, name=name: f"{name}: {m}")
    assert "calling tools calculator (up to 2 rounds" in one.stdout


def test_bad_tool_input_is_refused_before_the_model_loads(tmp_path):
    user = tmp_path / "user_tools.py"
    user.write_text("def untyped(a):\n    return a\n")
    common = ["--model_name_or_path", str(TOOLS_MODEL), "--dataset_name", str(REPO / "data" / "tool_prompts.jsonl"),
              "--reward_funcs", "hftrain.rl.example_rewards.final_answer", "--max_steps", "1"]
    cases = {
        "unimportable": ([*common, "--objective", "grpo", "--tools", "no_such.tool"], {}),
        "untyped": ([*common, "--objective", "grpo", "--tools", f"{user}:untyped"], {}),
        "no template": ([*common, "--objective", "grpo", "--tools", "hftrain.rl.example_tools.calculator",
                         "--model_name_or_path", str(REPO / "models" / "tiny-llama")], {}),
        "text prompts": ([*common, "--objective", "grpo", "--tools", "hftrain.rl.example_tools.calculator",
                          "--dataset_name", str(REPO / "data" / "prompt_completion.jsonl"), "--reward_funcs",
                          "hftrain.rl.example_rewards.vowel_share"], {}),
        "sft": (["--model_name_or_path", str(TOOLS_MODEL), "--dataset_name", str(REPO / "data" / "tool_sft.jsonl"),
                 "--tools", "hftrain.rl.example_tools.calculator", "--max_steps", "1"], {}),
    }
    for case in cases.values():
        case[0].extend(["--output_dir", str(tmp_path / "out")])
    results = run_main_cases(cases, tmp_path)
    expected = {"unimportable": "tools entry 'no_such.tool' does not load (ModuleNotFoundError",
                "untyped": "untyped", "no template": "the chat template of",
                "text prompts": "has text prompts; tool calling", "sft": "tools is set but objective=sft"}
    for name, text in expected.items():
        run = results[name]
        assert run.returncode != 0 and text in " ".join(run.stderr.split()), (name, run.stderr)
        assert run.stderr.count("error:") == 1 and "Traceback" not in run.stderr, (name, run.stderr)
        assert "loading model" not in run.stdout.lower(), name
    assert not (tmp_path / "out").exists()
