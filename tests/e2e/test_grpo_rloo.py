"""advantage_estimator rloo with beta > 0 and loss_type cispo, end to end on the tiny model that often ends its
completions: the second generation window's advantages (in rollouts.jsonl) equal RLOOTrainer's leave-one-out
advantages recomputed in plain PyTorch from the rows' rewards and the first-order KL of checkpoint-1's log-probs to
the starting model's, and step 2's update equals cispo's step written out (the KL in the reward, none in the loss);
2 processes (DDP) equal one. Runs of 2 steps of 8 completions, with SGD (its update is proportional to the
gradient)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tests.conftest import launch, run_script
from tests.e2e.test_grpo import BASE, ONE_BY_EIGHT, TINY, TWO_PROCS, ending_model, token_log_probs  # noqa: F401

BETA, EPSILON_HIGH = 0.5, 0.5  # cispo's clip at 0.5: the first pass's ratio 1 weighs each token by 0.5


@pytest.fixture(scope="module")
def runs(tmp_path_factory, ending_model):  # noqa: F811 - the imported fixture
    tmp = tmp_path_factory.mktemp("rloo")
    args = [str(ending_model) if a == TINY else a for a in BASE]
    args[args.index("--num_iterations") + 1], args[args.index("--beta") + 1] = "1", str(BETA)
    args[args.index("--max_steps") + 1] = "2"
    args += ["--advantage_estimator", "rloo", "--loss_type", "cispo", "--epsilon_high", str(EPSILON_HIGH),
             "--save_strategy", "steps", "--save_steps", "1", "--checkpoint_preflight", "false"]
    return {"one": run_script(tmp / "one", *args, *ONE_BY_EIGHT),
            # 2 processes x 2 completions x accumulation 2: the window's rewards and KL sums gathered over both
            "two": launch(tmp / "two", *args, *TWO_PROCS, preset="cpu_ddp")}


def test_two_processes_equal_one(runs):
    one, two = runs["one"], runs["two"]
    a = [json.loads(line) for line in (one.output_dir / "rollouts.jsonl").read_text().splitlines()]
    b = [json.loads(line) for line in (two.output_dir / "rollouts.jsonl").read_text().splitlines()]
    assert [r["completion_ids"] for r in a] == [r["completion_ids"] for r in b]
    torch.testing.assert_close(torch.tensor([r["advantage"] for r in b]), torch.tensor([r["advantage"] for r in a]),
                               rtol=1e-5, atol=1e-6)
    got, want = load_file(two.output_dir / "final" / "model.safetensors"), \
        load_file(one.output_dir / "final" / "model.safetensors")
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-4, atol=2e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_rloo_with_kl_in_the_reward_and_cispo_equal_plain_pytorch(runs, ending_model):  # noqa: F811
    run = runs["one"]
    rows = [json.loads(line) for line in (run.output_dir / "rollouts.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["step"] == 2]
    assert len(rows) == 8
    policy = AutoModelForCausalLM.from_pretrained(ending_model, dtype=torch.float32)
    policy.load_state_dict({k.removeprefix("lm."): v for k, v in
                            load_file(run.output_dir / "checkpoint-1" / "model.safetensors").items()})
    reference = AutoModelForCausalLM.from_pretrained(ending_model, dtype=torch.float32)
    with torch.no_grad():
        kl = torch.stack([(token_log_probs(policy, r) - token_log_probs(reference, r)).sum() for r in rows])
    assert kl.abs().max() > 1e-3  # the policy left the reference after step 1
    penalised = torch.tensor([r["reward"] for r in rows]) - BETA * kl
    expected = []
    for i, value in enumerate(penalised.tolist()):  # minus the mean of the group's other rewards
        group = penalised[i // 4 * 4:(i // 4 + 1) * 4].tolist()
        expected.append(value - (sum(group) - value) / 3)
    torch.testing.assert_close(torch.tensor([r["advantage"] for r in rows]), torch.tensor(expected),
                               rtol=1e-4, atol=1e-5)
    # step 2: cispo on the first pass, -min(1, eps_high) A logp summed / completion tokens, no KL term; SGD lr 1
    loss = sum(-EPSILON_HIGH * r["advantage"] * token_log_probs(policy, r).sum() for r in rows)
    (loss / sum(len(r["completion_ids"]) for r in rows)).backward()
    torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
    torch.optim.SGD(policy.parameters(), lr=1.0).step()
    got = {k.removeprefix("lm."): v for k, v in load_file(run.output_dir / "final" / "model.safetensors").items()}
    for name, value in policy.state_dict().items():
        torch.testing.assert_close(got[name], value, rtol=1e-4, atol=2e-6, msg=lambda m, name=name: f"{name}: {m}")
    tokens = sum(len(r["completion_ids"]) for r in rows)
    assert run.train_rows()[1]["kl"] == pytest.approx(kl.sum().item() / tokens, rel=1e-4)  # TRL's kl: token mean
    assert "cispo_clip_ratio" in run.train_rows()[1]
