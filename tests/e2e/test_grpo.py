"""objective grpo end to end on the tiny model: the shipped recipe learns (its mean reward rises), every completion
is in rollouts.jsonl, TRL's metric names are logged; the first optimizer step equals the same step written in plain
PyTorch from the rollouts' tokens; accumulation 1 x 8 == 4 x 2 == 2 processes x 2 x 2, the 2 processes generating
under DDP, ZeRO-3 and FSDP2, == tensor parallelism over 2 processes == Ulysses sequence parallelism over 2 == ring
attention context parallelism over 2 (each rank sampling the whole completions, training on its slice); a SIGTERM
inside a generation window resumes exactly; LoRA with beta > 0 trains against the adapter-off model (step 2
recomputed with peft), and log_completions' W&B table (offline) holds rollouts.jsonl's rows; bad input (use_vllm
included) is refused in one paragraph before the model loads.

Runs are shared by the assertions (module fixtures); each is 2-3 steps of 8 completions of <= 6 tokens, with SGD: its
update is proportional to the gradient, where AdamW's first step (g / (|g| + eps)) would blow a float rounding
difference in a near-zero gradient up to the size of the learning rate. The exactness runs use a tiny model that
often ends its completions (`ending_model`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from hftrain.report import write_report
from tests.conftest import FAULTY_RANK, FSDP_LAUNCHER, REPO, launch, run_main_cases, run_script, write_jsonl
from tests.model_cards import check_card
from tests.wandb_records import summary

TINY = str(REPO / "models" / "tiny-llama")
CP_LAUNCHER = REPO / "tests" / "launchers" / "context_parallel_on_cpu.py"  # FSDP2 and the ring's CPU kernel
DATA = REPO / "data" / "prompt_completion.jsonl"
REWARD = "hftrain.rl.example_rewards.vowel_share"
BASE = ["--model_name_or_path", TINY, "--dataset_name", str(DATA),
        "--objective", "grpo", "--reward_funcs", REWARD, "--num_generations", "4", "--max_completion_length", "6",
        "--max_steps", "3", "--optim", "sgd", "--learning_rate", "1.0", "--weight_decay", "0",
        "--lr_scheduler_type", "constant", "--max_grad_norm", "1.0",
        "--eval_strategy", "no", "--save_strategy", "no", "--logging_steps", "1", "--report_to", "none",
        "--seed", "3", "--ddp_timeout", "120", "--num_iterations", "2", "--beta", "0.5"]
# num_iterations 2 and beta 0.5 (a frozen copy of the starting model as the reference): step 1 trains the first
# generation window on-policy, step 2 the same rollouts against the stored log-probs and the reference, step 3 a new
# window; the exactness runs compare all of it.
ONE_BY_EIGHT = ["--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "1"]
FOUR_BY_TWO = ["--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "4"]
TWO_PROCS = ["--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2"]
# no dropout: the forward is deterministic, so runs and the plain computation agree
LORA = ["--use_peft", "--lora_r", "4", "--lora_alpha", "8", "--lora_dropout", "0", "--lora_target_modules",
        "q_proj,v_proj"]


def on(model: Path) -> list[str]:
    """BASE with another model."""
    return [str(model) if arg == TINY else arg for arg in BASE]


@pytest.fixture(scope="module")
def ending_model(tmp_path_factory) -> Path:
    """The tiny Llama with a likely EOS: its head's EOS row set to 1.8 x the unit mean of its final hidden states
    on the data's first 50 prompts (about 1 in 2 tokens is EOS, where the random model samples it 1 in 750 times),
    so completions end at different lengths (dapo's token count differs from grpo's completion count), and under
    FSDP2 a rank whose completions have all ended keeps running generate's forwards until the other's have (the
    synced_gpus that transformers 5.23 does not set by itself for accelerate's fully_shard: without it the ranks'
    collectives mismatch and the run aborts)."""
    folder = tmp_path_factory.mktemp("ending-llama")
    shutil.copytree(TINY, folder, dirs_exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(TINY)
    prompts = [json.loads(line)["prompt"] for line in DATA.read_text().splitlines()[:50]]
    with torch.no_grad():
        hidden = torch.cat([model(**tokenizer(p, return_tensors="pt"), output_hidden_states=True).hidden_states[-1][0]
                            for p in prompts])
    mean = hidden.mean(0)
    tensors = load_file(folder / "model.safetensors")
    tensors["lm_head.weight"][tokenizer.eos_token_id] = 1.8 * mean / mean.norm()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def without_eval_strategy(args: list[str]) -> list[str]:
    i = args.index("--eval_strategy")
    return args[:i] + args[i + 2:]


def rollouts(run) -> list[dict]:
    return [json.loads(line) for line in (run.output_dir / "rollouts.jsonl").read_text().splitlines()]


def weights(run, folder: str = "final") -> dict[str, torch.Tensor]:
    """The trained tensors: the model's, or the adapter's for a LoRA run's final folder."""
    adapter = run.output_dir / folder / "adapter_model.safetensors"
    return load_file(adapter if adapter.exists() else run.output_dir / folder / "model.safetensors")


def counted_reward(folder: Path) -> Path:
    """A reward-function file: vowel_share, each call appending "<process rank> <completions scored>" to the file
    named by HFTRAIN_TEST_REWARD_LOG."""
    path = folder / "counted.py"
    path.write_text("import os\n"
                    "from hftrain.rl.example_rewards import vowel_share\n\n\n"
                    "def counted_vowel_share(prompts, completions, completion_ids, **kwargs):\n"
                    "    with open(os.environ['HFTRAIN_TEST_REWARD_LOG'], 'a') as f:\n"
                    "        f.write(f\"{os.environ.get('RANK', '0')} {len(completions)}\\n\")\n"
                    "    return vowel_share(prompts, completions, completion_ids)\n")
    return path


def evaluating(folder: Path) -> list[str]:
    """Evaluation after step 2 and at the end (step 3) on 3 prompts the training data does not start with, 3
    completions per generate call (12 rows: 4 calls, the last of 3 rows on one process, 2 + 1 rows per rank on 2)."""
    prompts = write_jsonl(folder / "eval.jsonl", [json.loads(line) for line in DATA.read_text().splitlines()[-3:]])
    return ["--eval_strategy", "steps", "--eval_steps", "2", "--eval_dataset_name", str(prompts),
            "--per_device_eval_batch_size", "3"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, ending_model):
    tmp = tmp_path_factory.mktemp("grpo")
    base = on(ending_model)
    wandb_dir = tmp / "wandb"
    wandb_dir.mkdir()
    evals = evaluating(tmp)
    return {
        "1x8": run_script(tmp / "1x8", *base, *ONE_BY_EIGHT, "--save_strategy", "steps", "--save_steps", "1",
                          "--checkpoint_preflight", "false", *evals),  # checkpoint-1 is inside the first window
        "4x2": run_script(tmp / "4x2", *base, *FOUR_BY_TWO, *evals),
        "2procs": launch(tmp / "2procs", *base, *TWO_PROCS, *evals, preset="cpu_ddp"),
        # generation under sharded weights: ZeRO-3 gathers them around generate, FSDP2 generates through the shards
        "zero3": launch(tmp / "zero3", *base, *TWO_PROCS, preset="zero3"),
        "fsdp2": launch(tmp / "fsdp2", *base, *TWO_PROCS, preset="fsdp2", processes=2, script=FSDP_LAUNCHER),
        # tensor parallelism: both ranks hold the same 8 completions' rows and generate through the shards together;
        # its reward function is vowel_share that also logs which process scored how many completions
        "tp": launch(tmp / "tp", *base, *ONE_BY_EIGHT, "--tp_size", "2", "--reward_funcs",
                     f"{counted_reward(tmp)}:counted_vowel_share", preset="tp",
                     env={"HFTRAIN_TEST_REWARD_LOG": str(tmp / "tp-rewards.log")}),
        # sequence parallelism (DeepSpeed Ulysses, sp_size 2): both ranks sample the same 8 completions whole, then
        # each trains on its half of every micro-batch's concatenated rows
        "sp": launch(tmp / "sp", *base, *ONE_BY_EIGHT, "--sp_size", "2", preset="cpu_sp"),
        # context parallelism (torch's ring attention under FSDP2, cp_size 2): both ranks sample the same 8
        # completions whole, then each trains on its head-tail chunks of every row, inside the ring's context
        "cp": launch(tmp / "cp", *base, *ONE_BY_EIGHT, "--cp_size", "2", preset="fsdp2_cp", processes=2,
                     script=CP_LAUNCHER),
        # LoRA with beta 0.5: the reference is the adapter-off model; 1x8 also logs to W&B offline with
        # log_completions and keeps every step's checkpoint
        "grpo-1x8": run_script(tmp / "grpo-1x8", *base, *ONE_BY_EIGHT, "--loss_type", "grpo", *LORA,
                               "--save_strategy", "steps", "--save_steps", "1", "--checkpoint_preflight", "false",
                               "--report_to", "wandb", "--log_completions", "true",
                               env={"WANDB_DIR": str(wandb_dir), "WANDB_MODE": "offline"}),
        # and the recipe's default evaluation (eval_strategy steps) without an eval dataset: nothing is evaluated
        "grpo-4x2": run_script(tmp / "grpo-4x2", *without_eval_strategy(base), *FOUR_BY_TWO, "--loss_type", "grpo",
                               *LORA),
    }


def test_rollouts_file_and_metrics(runs):
    run = runs["1x8"]
    rows = rollouts(run)
    assert len(rows) == 2 * 8 and [r["step"] for r in rows] == [s for s in (1, 3) for _ in range(8)]
    assert [r["group"] for r in rows[:8]] == [0, 0, 0, 0, 1, 1, 1, 1]
    for r in rows:
        assert set(r) >= {"step", "group", "prompt_ids", "completion_ids", "prompt", "completion", "rewards", "reward",
                          "advantage"}
        assert 1 <= len(r["completion_ids"]) <= 6 and list(r["rewards"]) == ["vowel_share"]
        assert r["reward"] == pytest.approx(r["rewards"]["vowel_share"])
    for step in (1, 3):  # advantages: (R - group mean) / (group std + 1e-4), std with Bessel's correction
        for group in (0, 1):
            rewards = torch.tensor([r["reward"] for r in rows if (r["step"], r["group"]) == (step, group)])
            adv = [r["advantage"] for r in rows if (r["step"], r["group"]) == (step, group)]
            expected = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
            torch.testing.assert_close(torch.tensor(adv), expected, rtol=1e-4, atol=1e-5)
    metrics = run.train_rows()
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for name in ("reward", "reward_std", "rewards/vowel_share/mean", "rewards/vowel_share/std",
                 "completions/mean_length", "completions/clipped_ratio", "frac_reward_zero_std"):
        assert name in metrics[0] and name in metrics[2], name  # the steps that sample
    for name in ("entropy", "kl", "clip_ratio/region_mean", "clip_ratio/low_mean", "clip_ratio/high_mean"):
        assert all(name in m for m in metrics), name
    for m, step in zip([metrics[0], metrics[2]], (1, 3)):  # reward metrics come with each generation
        step_rows = [r for r in rows if r["step"] == step]
        assert m["reward"] == pytest.approx(sum(r["reward"] for r in step_rows) / 8, rel=1e-5)
        assert m["completions/mean_length"] == pytest.approx(sum(len(r["completion_ids"]) for r in step_rows) / 8)
        assert m["clip_ratio/region_mean"] == 0  # the first pass over a window: every ratio is 1
    assert metrics[0]["kl"] == pytest.approx(0, abs=1e-6) and metrics[2]["kl"] > 0  # the policy left the reference
    assert "reward" not in metrics[1]  # step 2 samples nothing


def eval_rows(run) -> list[dict]:
    return [m for m in run.metrics() if "eval_reward" in m]


def eval_rollouts(run) -> list[dict]:
    return [json.loads(line) for line in (run.output_dir / "eval_rollouts.jsonl").read_text().splitlines()]


def test_evaluation_completes_and_scores_the_eval_prompts_as_trl_names_it(runs, ending_model):
    """TRL's GRPO evaluation: after step 2 and at the end, each of the 3 eval prompts completed 4 times with the
    run's sampling, scored by the reward function, no update; TRL's eval_ metrics. Checked against the reward function
    applied here to the logged completions, and the final evaluation's completions against a plain token-by-token
    sampling loop on the final weights with the same per-row noise; 2 processes (rows split and gathered) and 4 x 2
    accumulation evaluate exactly as 1 process. Without an eval dataset (grpo-4x2, eval_strategy left at its
    default) nothing is evaluated, and the run does not fail."""
    from hftrain.rl.example_rewards import vowel_share
    from hftrain.rl.grpo import EVAL_WINDOW
    from hftrain.rl.rollouts import row_seed

    tokenizer = AutoTokenizer.from_pretrained(ending_model)
    eval_prompts = [json.loads(line)["prompt"] for line in DATA.read_text().splitlines()[-3:]]
    one = runs["1x8"]
    assert [m["step"] for m in eval_rows(one)] == [2, 3] and not one.eval_rows()  # no eval_loss: nothing to score
    assert "eval_reward" in one.stdout and "after 3 steps" in one.stdout
    rows = eval_rollouts(one)
    assert [(r["step"], r["row"]) for r in rows] == [(s, i) for s in (2, 3) for i in range(12)]
    for metrics in eval_rows(one):
        mine = [r for r in rows if r["step"] == metrics["step"]]
        assert [r["prompt"] for r in mine] == [p for p in eval_prompts for _ in range(4)]
        assert all(tokenizer.decode(r["completion_ids"], skip_special_tokens=True) == r["completion"] for r in mine)
        rewards = torch.tensor(vowel_share(None, [r["completion"] for r in mine], None), dtype=torch.float64)
        torch.testing.assert_close(torch.tensor([r["reward"] for r in mine], dtype=torch.float64), rewards)
        groups = rewards.view(3, 4)
        lengths = torch.tensor([len(r["completion_ids"]) for r in mine], dtype=torch.float64)
        ended = [r["completion_ids"][-1] == tokenizer.eos_token_id for r in mine]
        expected = {"eval_reward": rewards.mean(), "eval_reward_std": rewards.std(),
                    "eval_rewards/vowel_share/mean": rewards.mean(), "eval_rewards/vowel_share/std": rewards.std(),
                    "eval_frac_reward_zero_std": (groups.std(dim=1) == 0).double().mean(),
                    "eval_completions/mean_length": lengths.mean(), "eval_completions/min_length": lengths.min(),
                    "eval_completions/max_length": lengths.max(),
                    "eval_completions/clipped_ratio": 1 - sum(ended) / 12}
        for name, value in expected.items():
            assert metrics[name] == pytest.approx(float(value), rel=1e-5, abs=1e-7), name
    assert len({len(r["completion_ids"]) for r in rows}) > 1  # the ending model ends some completions early
    card = check_card(one.output_dir / "final", library="transformers", base_model=ending_model,
                      tags={"grpo", "full"}, rows=one.metrics())
    assert f"| eval mean reward | {eval_rows(one)[-1]['eval_reward']:.4g} |" in card.text  # the final evaluation's
    # the headline is the mean reward, from where it started (issue 49): grpo's loss is about 0 by construction
    rewards = [r for r in one.metrics() if r.get("reward") is not None]
    headline = card.text.split("| --- | --- |")[2].split("\n")[1]
    assert headline == (f"| mean reward | {rewards[-1]['reward']:.4g} (logged at step {rewards[-1]['step']}; "
                        f"{rewards[0]['reward']:.4g} at step {rewards[0]['step']}) |")

    model = AutoModelForCausalLM.from_pretrained(one.output_dir / "final", dtype=torch.float32).eval()
    for r in [r for r in rows if r["step"] == 3]:  # the final evaluation samples from the final weights
        ids, generator = list(r["prompt_ids"]), torch.Generator().manual_seed(row_seed(3, EVAL_WINDOW, r["group"],
                                                                                        r["row"] % 4))
        for _ in range(6):
            with torch.no_grad():
                scores = model(torch.tensor([ids])).logits[0, -1].float()
            uniform = torch.rand(scores.shape[-1], generator=generator)
            ids.append(int((scores - torch.log(-torch.log(uniform.clamp_min(torch.finfo(uniform.dtype).tiny))))
                           .argmax()))
            if ids[-1] == tokenizer.eos_token_id:
                break
        assert ids[len(r["prompt_ids"]):] == r["completion_ids"], r["row"]

    for other in ("2procs", "4x2"):
        assert [(r["step"], r["row"], r["completion_ids"]) for r in eval_rollouts(runs[other])] == \
            [(r["step"], r["row"], r["completion_ids"]) for r in rows], other
        for x, y in zip(eval_rows(one), eval_rows(runs[other]), strict=True):
            assert x == pytest.approx(y, rel=1e-5, abs=1e-7), other
    unevaluated = runs["grpo-4x2"]
    assert not eval_rows(unevaluated) and not (unevaluated.output_dir / "eval_rollouts.jsonl").exists()
    resolved = yaml.safe_load((unevaluated.output_dir / "hftrain_config.yaml").read_text())
    assert (resolved["eval_strategy"], resolved["validation_split_percentage"]) == ("steps", 0)  # TRL's: none held out


def test_first_step_equals_plain_pytorch(runs, ending_model):
    """Step 1 written out: the starting model's log-probs of the rollouts' completion tokens (logits / temperature
    1), the dapo loss -sum(A_i * exp(logp - logp.detach())) / completion tokens (the KL to the reference, the
    starting model itself, is 0 with gradient 0 here), clipping at 1.0, one SGD step."""
    run = runs["1x8"]
    rows = [r for r in rollouts(run) if r["step"] == 1]
    model = AutoModelForCausalLM.from_pretrained(ending_model, dtype=torch.float32)
    loss, tokens = 0.0, sum(len(r["completion_ids"]) for r in rows)
    for r in rows:
        ids = torch.tensor([r["prompt_ids"] + r["completion_ids"]])
        logps = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), dim=-1)
        n = len(r["completion_ids"])
        token_logps = logps[-n:].gather(1, torch.tensor(r["completion_ids"]).unsqueeze(1)).squeeze(1)
        loss = loss - (r["advantage"] * torch.exp(token_logps - token_logps.detach())).sum()
    (loss / tokens).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    got = {k.removeprefix("lm."): v for k, v in weights(run, "checkpoint-1").items()}  # the loss wrapper's names
    for name, value in model.state_dict().items():
        torch.testing.assert_close(got[name], value, rtol=1e-4, atol=2e-6, msg=lambda m, name=name: f"{name}: {m}")


def token_log_probs(model, row) -> torch.Tensor:
    ids = torch.tensor([row["prompt_ids"] + row["completion_ids"]])
    logps = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), dim=-1)
    n = len(row["completion_ids"])
    return logps[-n:].gather(1, torch.tensor(row["completion_ids"]).unsqueeze(1)).squeeze(1)


def test_second_iteration_uses_the_stored_log_probs_and_the_reference(runs, ending_model):
    """num_iterations 2, beta 0.5, full fine-tuning: step 2 trains step 1's rollouts again (no new generation), with
    the ratio against the log-probs stored at generation (the starting model's) and the KL to the frozen starting
    model, written out here from checkpoint-1's weights: rho = exp(logp - logp_start), per token
    -min(rho A, clip(rho, 0.8, 1.2) A) + 0.5 (exp(ref - logp) - (ref - logp) - 1) rho, summed / tokens, one SGD
    step with clipping at 1.0 -> checkpoint-2."""
    run = runs["1x8"]
    rows = rollouts(run)
    assert [r["step"] for r in rows] == [1] * 8 + [3] * 8  # one generation for each two steps
    start = AutoModelForCausalLM.from_pretrained(ending_model, dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(ending_model, dtype=torch.float32)
    model.load_state_dict({k.removeprefix("lm."): v for k, v in weights(run, "checkpoint-1").items()})
    rows = rows[:8]
    loss, tokens = 0.0, sum(len(r["completion_ids"]) for r in rows)
    for r in rows:
        logp = token_log_probs(model, r)
        with torch.no_grad():
            old = ref = token_log_probs(start, r)
        rho = torch.exp(logp - old)
        a = r["advantage"]
        kl = (torch.exp(ref - logp) - (ref - logp) - 1) * rho
        loss = loss + (-torch.min(rho * a, torch.clamp(rho, 0.8, 1.2) * a) + 0.5 * kl).sum()
    (loss / tokens).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    got = {k.removeprefix("lm."): v for k, v in weights(run, "checkpoint-2").items()}
    for name, value in model.state_dict().items():
        torch.testing.assert_close(got[name], value, rtol=1e-4, atol=2e-6, msg=lambda m, name=name: f"{name}: {m}")
    second = run.train_rows()[1]
    assert second["kl"] > 0 and second["clip_ratio/region_mean"] > 0  # the ratios moved away from 1 and clipped


LAUNCHED = {"2procs": ("MULTI_CPU", "DistributedDataParallel"), "zero3": ("DEEPSPEED", "DeepSpeedEngine"),
            "fsdp2": ("FSDP", "FSDPGRPOLoss"), "tp": ("MULTI_CPU", "GRPOLoss"), "sp": ("DEEPSPEED", "DeepSpeedEngine"),
            "cp": ("FSDP", "FSDPGRPOLoss")}


@pytest.mark.parametrize("loss_type, one, other", [("dapo", "1x8", "4x2"), ("dapo", "1x8", "2procs"),
                                                   ("dapo", "1x8", "zero3"), ("dapo", "1x8", "fsdp2"),
                                                   ("dapo", "1x8", "tp"), ("dapo", "1x8", "sp"),
                                                   ("dapo", "1x8", "cp"),
                                                   ("grpo", "grpo-1x8", "grpo-4x2")])
def test_accumulation_and_processes_give_the_same_training(runs, loss_type, one, other):
    """The same completions are sampled (seeded per prompt group), the same advantages computed and the same
    weights trained, whatever the split of the 8 completions of a step over micro-batches and processes, and
    whatever holds the weights while the 2 processes sample: DDP (whole copies), ZeRO-3 (partitions gathered
    around generate), FSDP2 (generate through the shards, one layer gathered at a time) or tensor parallelism
    (tp_size 2: both ranks sample the same 8 completions through the shards, the group's first rank scores them, and
    the window's rewards, rollouts.jsonl and metrics count them once); with num_iterations 2 and beta 0.5 this also
    covers the stored old log-probs and the frozen reference placed like the model (under tp: loaded again, sharded
    the same way)."""
    a, b = runs[one], runs[other]
    if other in LAUNCHED:
        info = b.state()["launch"]
        assert (info["distributed_type"], info["num_processes"], info["model_wrapper"]) == (*LAUNCHED[other][:1], 2,
                                                                                            LAUNCHED[other][1])
        assert info["backend"] == "gloo"
        if other == "tp":
            assert info["tp_size"] == 2 and info["dtensor_parameters"] > 0
            # the reward function ran once per completion, on the group's first rank: 2 windows of 8
            calls = (b.output_dir.parent / "tp-rewards.log").read_text().split()
            assert calls == ["0", "8", "0", "8"], calls
        if other == "zero3":
            assert info["deepspeed_config"]["zero_optimization"]["stage"] == 3
        if other == "sp":
            assert info["sp_size"] == 2 and b.state()["parallelism"]["dp_world"] == 1
            assert "Ulysses sequence parallel (sp_size=2)" in info["parallelism"]
            assert_rows_of_unequal_length(b)
        if other == "cp":  # the stored old log-probs' forward runs inside the ring too, gathered back whole
            assert info["cp_size"] == 2 and b.state()["parallelism"]["dp_world"] == 1
            assert "ring attention context parallel (cp_size=2)" in info["parallelism"]
            assert_rows_padded_for_the_ring(b)
        if other == "fsdp2":
            assert info["sharded_modules"] == ["FSDPGRPOLoss", "FSDPLlamaDecoderLayer"]  # generate's weights: shards
            assert_one_rank_ended_first(b)
    # sp attends over the micro-batch's rows concatenated, through sdpa with a block-diagonal mask, cp through the
    # ring's blocks merged by their logsumexp: float rounding ~1e-7 apart from one process's per-row causal kernel,
    # which two SGD steps at learning rate 1.0 carry to ~1e-5 of step 3's loss and kl (seen: sp 7e-6, cp 6e-7);
    # a mis-sliced token weight moves them by ~1e-1 (tests/unit/rl/test_rl_sliced.py compares the slicing exactly)
    if other in ("sp", "cp"):
        assert_same_training(a, b, loss_abs=1e-5, metric_rel=5e-5)
    else:
        assert_same_training(a, b)


def assert_rows_of_unequal_length(run) -> None:
    """Some micro-batch's completions ended at different lengths, so its concatenated rows are cut by the sequence
    slices inside a completion and the right padding is sliced with them."""
    lengths = {}
    for r in rollouts(run):
        lengths.setdefault(r["step"], set()).add(len(r["completion_ids"]))
    assert any(len(found) > 1 for found in lengths.values()), lengths


def assert_rows_padded_for_the_ring(run) -> None:
    """Some step's micro-batch (its rows as long as its longest) is not a multiple of 2 x cp = 4 tokens wide, so the
    ring's rows were padded with untrained positions, and some completions ended early (the right padding inside a
    row is sharded with it)."""
    widths = {}
    for r in rollouts(run):
        widths[r["step"]] = max(widths.get(r["step"], 0), len(r["prompt_ids"]) + len(r["completion_ids"]))
    assert any(width % 4 for width in widths.values()), widths
    assert_rows_of_unequal_length(run)


def assert_one_rank_ended_first(run) -> None:
    """What synced_gpus is for happened in a 2-process x 2 x 2 run: in some window one rank's completions all ended
    before the other's (generating through shards without it, the ranks' collectives mismatch and the run aborts)."""
    longest = {}
    for r in rollouts(run):
        key = (r["window"], r["row"] // 4)  # rank r holds rows [4r, 4r + 4) of a window (2 x 2 each)
        longest[key] = max(longest.get(key, 0), len(r["completion_ids"]))
    assert any(longest[(w, 0)] != longest[(w, 1)] for w, _ in longest), longest


def assert_same_training(a, b, loss_abs: float = 1e-6, metric_rel: float = 1e-5) -> None:
    """The same rollouts.jsonl rows (tokens, advantages), per-step losses and gradient norms, and trained weights."""
    keys = ("step", "group", "completion_ids", "prompt_ids")
    rows_a, rows_b = rollouts(a), rollouts(b)
    assert [tuple(str(r[k]) for k in keys) for r in rows_a] == [tuple(str(r[k]) for k in keys) for r in rows_b]
    torch.testing.assert_close(torch.tensor([r["advantage"] for r in rollouts(b)]),
                               torch.tensor([r["advantage"] for r in rollouts(a)]), rtol=1e-5, atol=1e-6)
    assert [x["step"] for x in a.train_rows()] == [y["step"] for y in b.train_rows()]
    for x, y in zip(a.train_rows(), b.train_rows()):
        assert x["loss"] == pytest.approx(y["loss"], abs=loss_abs) and x["grad_norm"] == pytest.approx(y["grad_norm"],
                                                                                                   rel=1e-4)
        # the window's metrics count each completion once (reward_std's Bessel correction would show a duplicate)
        for name in ("reward", "reward_std", "completions/mean_length", "frac_reward_zero_std", "kl", "entropy"):
            assert (name in x) == (name in y), name
            if name in x:
                assert x[name] == pytest.approx(y[name], rel=metric_rel, abs=1e-7), name
    wa, wb = weights(a), weights(b)
    for name in wa:
        torch.testing.assert_close(wb[name], wa[name], rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.skipif(not os.environ.get("HFTRAIN_TEST_GRPO_ADAPTERS"),
                    reason="opt-in (HFTRAIN_TEST_GRPO_ADAPTERS=1, ~2.5 min: five runs beyond the CI budget); the "
                           "strategies' generation is tested in CI with full fine-tuning")
def test_adapters_generate_under_sharded_strategies_like_one_process(ending_model, tmp_path):
    """LoRA under ZeRO-3 and FSDP2, QLoRA (4-bit weights stored as float32, sharded) under FSDP2: the grpo loss with
    beta 0.5 (the reference is the adapter-off model) on 2 processes x 2 x 2 equals 1 process x 8: the same rollouts,
    losses and adapter. QLoRA under ZeRO-3 is refused by the preflight for every objective."""
    lora = [*on(ending_model), "--loss_type", "grpo", *LORA]
    qlora = [*lora, "--load_in_4bit", "--bnb_4bit_use_double_quant", "--bnb_4bit_quant_storage", "float32"]
    fsdp2 = {"preset": "fsdp2", "processes": 2, "script": FSDP_LAUNCHER}
    for name, args, presets in (("lora", lora, {"zero3": {"preset": "zero3"}, "fsdp2": fsdp2}),
                                ("qlora", qlora, {"fsdp2": fsdp2})):
        one = run_script(tmp_path / f"{name}-one", *args, *ONE_BY_EIGHT)
        for preset, how in presets.items():
            run = launch(tmp_path / f"{name}-{preset}", *args, *TWO_PROCS, **how)
            info = run.state()["launch"]
            assert (info["distributed_type"], info["num_processes"]) == (LAUNCHED[preset][0], 2), (name, preset)
            assert_same_training(one, run)


@pytest.mark.skipif(not os.environ.get("HFTRAIN_TEST_GRPO_TP_DP"),
                    reason="opt-in (HFTRAIN_TEST_GRPO_TP_DP=1, ~20 s: 4 processes beyond the CI budget); tensor "
                           "parallelism's generation is tested in CI on one tp group of 2")
def test_tensor_parallel_copies_sample_and_train_like_one_process(runs, ending_model, tmp_path):
    """tp_size 2 x 2 data-parallel copies (4 processes, 2 x 2 completions per rank): each tp group samples its own
    half of the window together, the copies' rewards are gathered once per group for the advantages, and the run
    equals 1 process x 8: the same rollouts.jsonl rows (each once), losses, metrics and weights."""
    run = launch(tmp_path / "tp-dp", *on(ending_model), *TWO_PROCS, "--tp_size", "2", preset="cpu_ddp", processes=4)
    info = run.state()["launch"]
    assert (info["num_processes"], info["tp_size"], info["model_wrapper"]) == (4, 2, "GRPOLoss")
    assert run.state()["parallelism"]["dp_world"] == 2
    assert_same_training(runs["1x8"], run)


@pytest.mark.skipif(not os.environ.get("HFTRAIN_TEST_GRPO_DS3_SHARDS"),
                    reason="opt-in (HFTRAIN_TEST_GRPO_DS3_SHARDS=1, ~25 s: one more ZeRO-3 launch beyond the CI "
                           "budget); ZeRO-3's default generation (the gathered model) is tested in CI")
def test_zero3_generates_through_its_partitions_like_one_process(runs, ending_model, tmp_path):
    """ds3_gather_for_generation false (TRL's name): under ZeRO-3 generate runs on the engine's module with its
    partitioning hooks, each layer gathered per token, with synced_gpus; on 2 processes x 2 x 2 it samples and trains
    what 1 process x 8 does, including a window where one rank's completions all ended first (without synced_gpus
    the hooks' all-gathers would mismatch there)."""
    run = launch(tmp_path / "zero3-shards", *on(ending_model), *TWO_PROCS, "--ds3_gather_for_generation",
                 "false", preset="zero3")
    info = run.state()["launch"]
    assert (info["distributed_type"], info["num_processes"], info["deepspeed_config"]["zero_optimization"]["stage"]) \
        == ("DEEPSPEED", 2, 3)
    assert_one_rank_ended_first(run)
    assert_same_training(runs["1x8"], run)


def test_bad_input_is_refused_before_the_model_loads(tmp_path):
    rewards = tmp_path / "rewards.py"
    rewards.write_text("def two_args(prompts, completions):\n    return [0.0] * len(prompts)\n"
                       "def wants_answer(prompts, completions, completion_ids, answer):\n"
                       "    return [0.0] * len(prompts)\n")
    no_prompt = write_jsonl(tmp_path / "no_prompt.jsonl", [{"question": "q", "answer": "a"}] * 8)
    cases = {
        "reward": ([*BASE, *ONE_BY_EIGHT, "--reward_funcs", f"{rewards}:two_args,nope.missing",
                    "--output_dir", str(tmp_path / "reward")], {}),
        "columns": ([*BASE, *ONE_BY_EIGHT, "--reward_funcs", f"{rewards}:wants_answer", "--dataset_name",
                     str(no_prompt), "--output_dir", str(tmp_path / "columns")], {}),
        "groups": ([*BASE, "--per_device_train_batch_size", "3", "--output_dir", str(tmp_path / "groups")], {}),
        "weights": ([*BASE, *ONE_BY_EIGHT, "--reward_weights", "1,2", "--output_dir", str(tmp_path / "weights")], {}),
        "vllm": ([*BASE, *ONE_BY_EIGHT, "--use_vllm", "true", "--output_dir", str(tmp_path / "vllm")], {}),
    }
    out = run_main_cases(cases, tmp_path)
    text = {name: " ".join(run.stderr.split()) for name, run in out.items()}  # the paragraph is wrapped
    for name, run in out.items():
        assert run.returncode != 0 and "Traceback" not in run.stderr, (name, run.stderr)
        assert not (run.output_dir / "final").exists()
    assert "two_args': it cannot take the keyword arguments prompts, completions, completion_ids" in text["reward"]
    assert "'nope.missing' does not load" in text["reward"]
    assert "has no prompt column" in text["columns"]
    assert "wants_answer' with the dataset's columns: it cannot take the keyword arguments prompts, completions, " \
        "completion_ids, question, answer" in text["columns"]  # every problem at once: no **kwargs for question
    assert "3 completions, not whole groups of num_generations=4" in text["groups"]
    assert "reward_weights has 2 weights for 1 reward_funcs" in text["weights"]
    assert "use_vllm: true needs a CUDA GPU" in text["vllm"]  # the preflight, before the model loads
    assert "use_vllm: true needs the vllm package, which is not installed: pip install 'hftrain[vllm]'" in text["vllm"]


def test_tiny_grpo_recipe_learns(tmp_path):
    """recipes/tiny-grpo.yaml as shipped: the mean reward of the last 5 steps is above the first 5 steps'."""
    run = run_script(tmp_path / "tiny-grpo", "--config", str(REPO / "recipes" / "tiny-grpo.yaml"), "--logging_steps",
                     "1")
    rows = run.train_rows()
    rewards = [m["reward"] for m in rows]
    assert len(rewards) == 20
    # the console, in a log (standard error not a terminal): one plain line per logged step with the reward first
    # (the loss is ~0 by construction at num_iterations 1), and the closing line with the last logged reward
    for m in rows:
        assert f"training: step {m['step']}/20: reward {m['reward']:.4f}, loss {m['loss']:.4f}, tokens/s " \
            in run.stderr, run.stderr[-2000:]
    (closing,) = [line for line in run.stdout.splitlines() if line.startswith("hftrain: final model saved")]
    assert closing.endswith(f"; last logged reward {rewards[-1]:.4f}, loss {rows[-1]['loss']:.4f}")
    assert "\rtraining" not in run.stderr
    # every step samples its window (num_iterations 1): its sampling time is generation, not data wait
    assert all(m["generation_time"] > m["data_wait_time"] for m in rows), [
        (m["generation_time"], m["data_wait_time"]) for m in rows]
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.05, rewards
    assert len(rollouts(run)) == 20 * 16
    report = write_report(run.output_dir)
    assert (report.parent / "reward.png").stat().st_size > 0 and "- reward (grpo): first" in report.read_text()
    assert re.search(r"- step time \S+ s: generation \d+%, data wait \d+%", report.read_text())


def test_sigterm_inside_a_generation_window_resumes_exactly(runs, ending_model, tmp_path):
    """The num_iterations 2 run stopped by SIGTERM right after step 1 (tests/e2e/launchers/faulty_rank.py; no periodic
    checkpoints): the stop is voted on in step 2, once step 2's micro-batches (step 1's buffered rollouts) were taken,
    and the preemption checkpoint-1 lies inside the first generation window. It holds the same buffer (rollouts,
    advantages, stored old and reference log-probs) and weights as the uninterrupted run's periodic checkpoint-1.
    Resumed from it: step 2 trains the buffered rollouts, step 3 samples the next window again from the same seeds
    and weights; the same rows in rollouts.jsonl and the same final weights as the uninterrupted run."""
    done = runs["1x8"]
    folder = tmp_path / "preempted"
    stopped = run_script(folder, *on(ending_model), *ONE_BY_EIGHT, "--checkpoint_preflight", "false",
                         script=FAULTY_RANK, env={"HFTRAIN_TEST_FAULTS": "sigterm_after_step_1"}, check=False)
    assert stopped.returncode != 0 and "stopped by SIGTERM after step 1" in stopped.stderr, stopped.stderr[-2000:]
    assert sorted(p.name for p in folder.glob("checkpoint-*")) == ["checkpoint-1"]
    (state,) = (folder / "checkpoint-1").glob("data_stream_process*.json")  # the window's buffer
    assert json.loads(state.read_text()) == json.loads((done.output_dir / "checkpoint-1" / state.name).read_text())
    for name, value in weights(done, "checkpoint-1").items():
        assert torch.equal(weights(stopped, "checkpoint-1")[name], value), name
    assert rollouts(stopped) == rollouts(done)[:8]
    run = run_script(folder, *on(ending_model), *ONE_BY_EIGHT, "--resume_from_checkpoint", "latest")
    assert "resuming from" in run.stdout
    assert rollouts(run) == rollouts(done)
    wa, wb = weights(done), weights(run)
    for name in wa:
        torch.testing.assert_close(wb[name], wa[name], rtol=1e-5, atol=1e-7, msg=lambda m, name=name: f"{name}: {m}")


def test_a_failing_reward_function_stops_the_run_with_a_checkpoint(tmp_path):
    """A reward function that returns the wrong count or a non-number at its second call (step 2): the run
    stops in one paragraph naming it, exits non-zero, and keeps the state after step 1 in checkpoint-1 (the loop's
    collective stop vote, so other ranks would stop with it); step 1's rollouts stay, step 2 writes none."""
    rewards = tmp_path / "late_rewards.py"
    rewards.write_text("calls = []\n"
                       "def short(prompts, completions, completion_ids, **kwargs):\n"
                       "    calls.append(1)\n"
                       "    return [0.5] * (len(completions) - (len(calls) > 1))\n"
                       "def words(prompts, completions, completion_ids, **kwargs):\n"
                       "    calls.append(1)\n"
                       "    return [0.5 if len(calls) == 1 else 'high'] * len(completions)\n")
    cases = {name: ([*BASE, *ONE_BY_EIGHT, "--num_iterations", "1", "--beta", "0", "--reward_funcs",
                     f"{REWARD},{rewards}:{name}", "--output_dir", str(tmp_path / name)], {})
             for name in ("short", "words")}
    out = run_main_cases(cases, tmp_path)
    said = {name: " ".join(run.stderr.split()) for name, run in out.items()}
    for name, run in out.items():
        assert run.returncode != 0 and "Traceback" not in run.stderr, (name, run.stderr)
        assert f"reward function '{rewards}:{name}'" in said[name], said[name]
        assert "(training step 2)" in said[name] and "checkpoint-1" in said[name], said[name]
        checkpoint = run.output_dir / "checkpoint-1"
        assert (checkpoint / "model.safetensors").stat().st_size > 0, sorted(p.name for p in checkpoint.iterdir())
        assert not (run.output_dir / "final").exists() and not (run.output_dir / "checkpoint-2").exists()
        assert {r["step"] for r in rollouts(run)} == {1} and len(rollouts(run)) == 8
    assert "returned 7 rewards for 8 completions" in said["short"]
    assert "returned 'high' for completion 0" in said["words"]


def test_lora_with_beta_trains_against_the_adapter_off_model(runs, ending_model):
    """The grpo-loss LoRA run's step 2 written out with peft and plain transformers: the policy is the base with
    checkpoint-1's adapter, the reference and the stored old log-probs the plain base model (the adapter starts at
    zero, so step 1 sampled from the base); per token -min(rho A, clip(rho, 0.8, 1.2) A) + 0.5 kl, each completion's
    token mean averaged over the 8 completions. The logged loss and kl of step 2 and the adapter after one SGD step
    from its gradient (clipping at 1.0) equal the run's checkpoint-2. With the adapter-on model as the reference the
    kl would be 0."""
    run = runs["grpo-1x8"]
    rows = [r for r in rollouts(run) if r["step"] == 1]
    assert len(rows) == 8
    base = AutoModelForCausalLM.from_pretrained(ending_model, dtype=torch.float32)
    policy = get_peft_model(AutoModelForCausalLM.from_pretrained(ending_model, dtype=torch.float32),
                            LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    trained = {k.removeprefix("lm."): v for k, v in weights(run, "checkpoint-1").items()}
    assert trained and all("lora_" in k for k in trained)  # the checkpoint holds the adapter only
    missing, unexpected = policy.load_state_dict(trained, strict=False)
    assert not unexpected and not [k for k in missing if "lora_" in k]
    loss, kl_sum, tokens = 0.0, 0.0, sum(len(r["completion_ids"]) for r in rows)
    for r in rows:
        logp = token_log_probs(policy, r)
        with torch.no_grad():
            old = ref = token_log_probs(base, r)
        rho = torch.exp(logp - old)
        a = r["advantage"]
        kl = (torch.exp(ref - logp) - (ref - logp) - 1) * rho
        loss = loss + (-torch.min(rho * a, torch.clamp(rho, 0.8, 1.2) * a) + 0.5 * kl).mean() / len(rows)
        kl_sum += kl.sum().item()
    second = run.train_rows()[1]
    assert second["step"] == 2 and kl_sum / tokens > 1e-6
    assert second["kl"] == pytest.approx(kl_sum / tokens, rel=1e-4)
    assert second["loss"] == pytest.approx(loss.item(), rel=1e-4, abs=1e-7)
    loss.backward()
    params = [p for p in policy.parameters() if p.requires_grad]
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    torch.optim.SGD(params, lr=1.0).step()
    got = {k.removeprefix("lm."): v for k, v in weights(run, "checkpoint-2").items()}
    expected = {k: v for k, v in policy.state_dict().items() if "lora_" in k}
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-4, atol=2e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_log_completions_writes_trls_table_to_wandb(runs):
    """log_completions with W&B (offline), the grpo-1x8 run: its history holds a `completions` table at the steps
    that sample (1 and 3), whose files have TRL's columns and the rows of rollouts.jsonl (step, prompt, completion,
    the reward function's value, advantage); metrics.jsonl stays scalar."""
    run = runs["grpo-1x8"]
    (run_file,) = run.output_dir.parent.glob("wandb/wandb/offline-run-*/run-*.wandb")
    # the table's reference is a nested value (wandb writes completions/_type, /path, /nrows, ...), beside the
    # completions/mean_length metrics, as in TRL
    history = [h for h in summary(run_file)["history"] if "completions/_type" in h]
    assert [h["_step"] for h in history] == [1, 3], history
    for h in history:
        assert h["completions/_type"] == "table-file" and h["completions/nrows"] == 8, h
        table = json.loads(Path(run_file.parent, "files", h["completions/path"]).read_text())
        assert table["columns"] == ["step", "prompt", "completion", "vowel_share", "advantage"]
        expected = [[r["step"], r["prompt"], r["completion"], r["rewards"]["vowel_share"], r["advantage"]]
                    for r in rollouts(run) if r["step"] == h["_step"]]
        assert len(table["data"]) == len(expected) == 8
        for got, want in zip(table["data"], expected):
            assert got[:3] == want[:3] and got[3:] == pytest.approx(want[3:], rel=1e-6)
    assert all("completions" not in m for m in run.metrics())
