"""async_generation with tool calling: the rollout worker runs the multi-turn loop (hftrain.rl.tools) on its rows,
with the calculator tool and an environment (environment_factory) whose method is a tool, whose reset adds to the
prompt and whose get_reward is a reward function read in the trainer from the environments the worker sends back.

The turns are written by the scripted policy of tests/e2e/launchers/scripted_tools.py (a random tiny model writes no
tool calls), in the worker as in the trainer; everything else (the loop, parsing, tool execution, masks, environments,
the worker's weights and behaviour log-probs, rewards, loss) is the product's. With max_staleness 0 the run equals the
synchronous tool run: every rollout (turns, tool results, masks, calls, environment rewards, advantages), the losses
and the final weights; the behaviour log-probs the worker recorded for step 2 are those of checkpoint-1's weights
(plain transformers), null on the tool results' tokens.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tests.conftest import REPO, run_script
from tests.e2e.test_grpo import token_log_probs
from tests.e2e.test_grpo_tools import SCRIPTED, TOOLS_MODEL

ABACUS = '''
from hftrain.rl.example_tools import calculator


class Abacus:
    def reset(self, prompt, answer, **row):
        self.beads = 0
        return " An abacus is at hand."

    def abacus(self, a: int, op: str, b: int) -> int:
        """Compute a op b on the abacus.

        Args:
            a: The left operand.
            op: One of +, - and *.
            b: The right operand.
        """
        self.beads += 1
        return calculator(a, op, b)

    def get_reward(self) -> float:
        return float(self.beads)
'''


def base(environment) -> list[str]:
    """Two steps of one 8-rollout window each; the scripted policy's third kind of turn calls `abacus`, the
    environment's method."""
    return ["--model_name_or_path", str(TOOLS_MODEL), "--dataset_name", str(REPO / "data" / "tool_prompts.jsonl"),
            "--objective", "grpo", "--reward_funcs", "hftrain.rl.example_rewards.final_answer",
            "--tools", "hftrain.rl.example_tools.calculator", "--environment_factory", f"{environment}:Abacus",
            "--max_tool_calling_iterations", "2", "--num_generations", "4", "--max_completion_length", "128",
            "--max_steps", "2", "--num_iterations", "1", "--beta", "0", "--optim", "sgd", "--learning_rate", "1.0",
            "--weight_decay", "0", "--lr_scheduler_type", "constant", "--max_grad_norm", "1.0", "--eval_strategy",
            "no", "--logging_steps", "1", "--report_to", "none", "--seed", "32", "--per_device_train_batch_size", "8",
            "--save_strategy", "steps", "--save_steps", "1", "--checkpoint_preflight", "false"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("grpo-async-tools")
    environment = tmp / "abacus.py"
    environment.write_text(ABACUS)
    return {"sync": run_script(tmp / "sync", *base(environment), script=SCRIPTED),
            "async0": run_script(tmp / "async0", *base(environment), "--async_generation", "true",
                                 "--max_staleness", "0", script=SCRIPTED)}


def rollouts(run) -> list[dict]:
    return [json.loads(line) for line in (run.output_dir / "rollouts.jsonl").read_text().splitlines()]


def test_max_staleness_0_with_tools_and_an_environment_is_the_synchronous_run(runs):
    sync, async0 = runs["sync"], runs["async0"]
    a, b = rollouts(sync), rollouts(async0)
    keys = ("step", "row", "prompt_ids", "prompt", "completion_ids", "completion", "tool_mask", "tool_calls",
            "rewards", "reward", "advantage", "truncated")
    assert len(b) == 16 and [{k: r[k] for k in keys} for r in b] == [{k: r[k] for k in keys} for r in a]
    assert [r["policy_version"] for r in b] == [r["step"] - 1 for r in b]
    # what the rollouts exercise: tool results, failed and dropped calls, the environment's tool and its reset
    calls = [c for r in b for c in r["tool_calls"]]
    assert {c["name"] for c in calls} == {"calculator", "abacus"} and any(c["failed"] for c in calls)
    assert all(0 in r["tool_mask"] for r in b if any(c["kept"] for c in r["tool_calls"]))
    assert all(r["prompt"].endswith("? An abacus is at hand.<|im_end|>\n<|im_start|>assistant\n") for r in b)
    # the environment's reward, read from the environments the worker sent back: its abacus calls in that rollout
    assert [r["rewards"]["Abacus"] for r in b] == [float(sum(c["name"] == "abacus" for c in r["tool_calls"]))
                                                    for r in b]
    assert {r["rewards"]["Abacus"] for r in b} == {0.0, 1.0}
    assert [m["loss"] for m in async0.train_rows()] == pytest.approx([m["loss"] for m in sync.train_rows()],
                                                                     rel=1e-5, abs=1e-7)
    for folder in ("checkpoint-1", "final"):
        got, want = load_file(async0.output_dir / folder / "model.safetensors"), \
            load_file(sync.output_dir / folder / "model.safetensors")
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-7,
                                       msg=lambda m, name=name, folder=folder: f"{folder} {name}: {m}")
    assert "tools/call_frequency" in async0.train_rows()[0]


def test_the_workers_behaviour_log_probs_are_its_pushed_weights_on_the_model_tokens(runs):
    """Step 2's rollouts were sampled after the push of version 1 (the weights after step 1): the worker's behaviour
    log-probs of the model's tokens equal checkpoint-1's log-probs recomputed here over the whole conversation, and
    the tool results' tokens (tool_mask 0, never sampled) have none."""
    run = runs["async0"]
    model = AutoModelForCausalLM.from_pretrained(TOOLS_MODEL, dtype=torch.float32)
    model.load_state_dict({k.removeprefix("lm."): v for k, v in
                           load_file(run.output_dir / "checkpoint-1" / "model.safetensors").items()})
    start = AutoModelForCausalLM.from_pretrained(TOOLS_MODEL, dtype=torch.float32)
    rows = [r for r in rollouts(run) if r["step"] == 2]
    moved = 0.0
    with torch.no_grad():
        for r in rows:
            mask = torch.tensor(r["tool_mask"], dtype=torch.bool)
            assert [v is None for v in r["behaviour_logps"]] == (~mask).tolist()
            behaviour = torch.tensor([v for v in r["behaviour_logps"] if v is not None])
            torch.testing.assert_close(behaviour, token_log_probs(model, r)[mask], rtol=1e-5, atol=1e-5)
            moved = max(moved, (token_log_probs(start, r)[mask] - behaviour).abs().max().item())
    assert moved > 1e-2, moved  # the starting model's log-probs differ: the push reached the worker
