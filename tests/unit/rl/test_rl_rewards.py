"""Reward functions (hftrain.rl.rewards), grpo's recipe rules (config.grpo_problems) and the window layout and
micro-batches of hftrain.rl.rollouts, in-process."""

from __future__ import annotations

import math

import pytest
import torch

from hftrain.config import load_recipe
from hftrain.data import IGNORE_INDEX
from hftrain.errors import ConfigError
from hftrain.rl.rewards import RewardFailure, column_problems, load_reward_functions, score
from hftrain.rl.rollouts import Completion, WindowPlan, collate, row_seed

GOOD = "hftrain.rl.example_rewards.vowel_share"


def test_loading_by_dotted_path_and_file(tmp_path):
    file = tmp_path / "my_rewards.py"
    file.write_text("def short(prompts, completions, completion_ids, **kw):\n"
                    "    return [None if not c else -len(c) for c in completions]\n"
                    "def needs_answer(prompts, completions, completion_ids, answer):\n    return [0.0] * len(prompts)\n"
                    "def old_style(completions):\n    return []\nNOT_A_FUNCTION = 3\n")
    funcs, problems = load_reward_functions([GOOD, f"{file}:short"])
    assert problems == [] and [f.name for f in funcs] == ["vowel_share", "short"]
    rewards = score(funcs, ["p", "p"], ["aaxx", ""], [[1], [2]], {})
    assert rewards[0].tolist() == [0.5, -4.0] and rewards[1, 0] == 0.0 and math.isnan(rewards[1, 1])
    _, problems = load_reward_functions(["no_such_module.f", f"{file}:missing", f"{file}:NOT_A_FUNCTION",
                                         f"{file}:old_style", str(tmp_path / "absent.py") + ":f", "justaname",
                                         GOOD, GOOD])
    text = "\n".join(problems)
    assert "'no_such_module.f' does not load (ModuleNotFoundError" in text
    assert "missing' does not load (AttributeError" in text
    assert "NOT_A_FUNCTION' is a int, not a function" in text
    assert "old_style': it cannot take the keyword arguments prompts, completions, completion_ids" in text
    assert "absent.py:f' does not load (OSError: no file" in text
    assert "'justaname' does not load" in text
    assert "two functions named 'vowel_share'" in text
    needs, _ = load_reward_functions([f"{file}:needs_answer"])
    assert column_problems(needs, ["answer"]) == []
    assert "answer" in column_problems(needs, [])[0] and "with the dataset's columns" in column_problems(needs, [])[0]


def test_bad_outputs_name_the_function(tmp_path):
    file = tmp_path / "bad.py"
    file.write_text("def short(prompts, completions, completion_ids, **kw):\n    return [1.0]\n"
                    "def text(prompts, completions, completion_ids, **kw):\n    return ['1', 2]\n"
                    "def nan(prompts, completions, completion_ids, **kw):\n    return [float('nan'), 2]\n"
                    "def scalar(prompts, completions, completion_ids, **kw):\n    return 1.0\n"
                    "def raises(prompts, completions, completion_ids, **kw):\n    return {}['answer']\n")
    for name, message in [("short", "returned 1 rewards for 2 completions"), ("text", "returned '1' for completion 0"),
                          ("nan", "returned nan for completion 0"), ("scalar", "returned a float, not a list"),
                          ("raises", "raises' raised KeyError: 'answer'")]:
        funcs, _ = load_reward_functions([f"{file}:{name}"])
        with pytest.raises(RewardFailure, match=message):
            score(funcs, ["a", "b"], ["x", "y"], [[1], [2]], {})


def _problems(tmp_path, *extra: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_recipe(["--config", "recipes/tiny-grpo.yaml", "--output_dir", str(tmp_path / "o"), *extra])
    return str(info.value)


def test_grpo_recipe_defaults_and_refusals(tmp_path):
    recipe = load_recipe(["--config", "recipes/tiny-grpo.yaml", "--output_dir", str(tmp_path / "o"),
                          "--loss_type", "grpo"])
    assert (recipe.beta, recipe.loss_type, recipe.epsilon, recipe.epsilon_high, recipe.scale_rewards) == \
        (0.0, "grpo", 0.2, None, "group")
    # the default eval_strategy (steps) is accepted: without an eval dataset nothing is held out, as in TRL
    bare = load_recipe(["--objective", "grpo", "--reward_funcs", GOOD, "--output_dir", str(tmp_path / "p")])
    assert (bare.beta, bare.loss_type, bare.max_completion_length, bare.num_generations) == (0.0, "dapo", 512, 8)
    assert (bare.eval_strategy, bare.validation_split_percentage) == ("steps", 0)
    dpo = load_recipe(["--objective", "dpo", "--output_dir", str(tmp_path / "q"),
                       "--dataset_name", "data/preference.jsonl"])
    assert (dpo.beta, dpo.loss_type) == (0.1, "sigmoid")  # dpo keeps its own defaults
    text = _problems(tmp_path, "--reward_funcs", "nope.f", "--reward_weights", "1,2", "--loss_type", "sigmoid",
                     "--num_generations", "1", "--steps_per_generation", "3", "--gradient_accumulation_steps", "2",
                     "--packing", "true", "--eval_strategy", "steps", "--temperature", "0", "--log_completions", "true",
                     "--streaming", "true", "--max_steps", "2")
    for expected in ["reward_weights has 2 weights for 1 reward_funcs",
                     "loss_type=sigmoid is a dpo loss", "num_generations must be >= 2",
                     "steps_per_generation=3 must be a multiple of gradient_accumulation_steps=2",
                     "packing with objective grpo", "temperature must be > 0",
                     "streaming: true with objective grpo is not supported yet",
                     "log_completions logs a W&B table: add wandb to report_to"]:
        assert expected in text, expected
    assert "reward_funcs is set but objective=sft" in _problems(tmp_path, "--objective", "sft")
    assert "ds3_gather_for_generation: false is grpo's generation setting, but objective=sft; remove it" in \
        _problems(tmp_path, "--objective", "sft", "--ds3_gather_for_generation", "false")


def test_new_loss_types_and_rloo_settings(tmp_path):
    """cispo, sapo and advantage_estimator rloo are accepted with TRL's defaults; what belongs to another setting is
    refused, each in one line of the same report."""
    recipe = load_recipe(["--config", "recipes/tiny-grpo.yaml", "--output_dir", str(tmp_path / "o"),
                          "--loss_type", "sapo", "--advantage_estimator", "rloo", "--normalize_advantages", "true"])
    assert (recipe.sapo_temperature_pos, recipe.sapo_temperature_neg) == (1.0, 1.05)  # GRPOConfig's defaults
    load_recipe(["--config", "recipes/tiny-grpo.yaml", "--output_dir", str(tmp_path / "p"), "--loss_type", "cispo",
                 "--epsilon_high", "5.0"])
    text = _problems(tmp_path, "--sapo_temperature_pos", "2", "--normalize_advantages", "true")
    assert "sapo_temperature_pos set but loss_type=dapo" in text
    assert "normalize_advantages is RLOOConfig's (advantage_estimator: rloo)" in text
    text = _problems(tmp_path, "--advantage_estimator", "rloo", "--scale_rewards", "batch", "--loss_type", "sapo",
                     "--sapo_temperature_neg", "0")
    assert "scale_rewards=batch is GRPO's advantage scaling" in text
    assert "sapo_temperature_pos and sapo_temperature_neg must be > 0" in text


def test_window_layout():
    """b=2 per device, 2 processes, S=4 micro-batches per generation, accumulation 2, 2 iterations, G=4: 16
    completions = 4 prompts per window; each window is trained for 4 optimizer steps."""
    plan = WindowPlan(num_prompts=10, num_generations=4, micro_batch=2, world=2, accum=2, steps_per_generation=4,
                      num_iterations=2, seed=0)
    assert (plan.window_size, plan.prompts_per_window, plan.windows_per_epoch, plan.steps_per_window,
            plan.steps_per_epoch, plan.global_batch) == (16, 4, 2, 4, 8, 8)
    assert plan.rank_rows(1) == range(8, 16)
    order = list(plan.micro_batches(epoch=1, rank=0, start_step=3))
    # step 3 of epoch 1: window 2 (the epoch's first), position 3 -> micro-steps 6, 7 -> iteration 1, micro 2, 3
    assert order[:2] == [(2, 2, 1), (2, 3, 1)]
    assert order[2:4] == [(3, 0, 0), (3, 1, 0)] and len(order) == 10
    first, second = plan.window_prompts(0), plan.window_prompts(1)
    assert len(set(first + second)) == 8 and plan.window_prompts(2) != first  # a new permutation per epoch
    assert row_seed(1, 2, 3, 0) == row_seed(1, 2, 3, 0) != row_seed(1, 3, 2, 0) != row_seed(1, 2, 3, 1)


def test_collate_trains_exactly_the_completion_tokens():
    completions = [Completion(0, 0, 0, [7, 8, 2], False), Completion(1, 0, 0, [9, 9, 9, 9], True)]
    batch = collate([[1, 2, 3], [4]], completions, torch.tensor([0.5, -1.0]), pad_id=0, mask_truncated=False)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 7, 8, 2], [4, 9, 9, 9, 9, 0]]
    assert batch["labels"].tolist() == [[IGNORE_INDEX] * 3 + [7, 8, 2], [IGNORE_INDEX, 9, 9, 9, 9, IGNORE_INDEX]]
    masked = collate([[1, 2, 3], [4]], completions, torch.tensor([0.5, -1.0]), pad_id=0, mask_truncated=True)
    assert (masked["labels"][1] == IGNORE_INDEX).all() and masked["num_examples"] == 2
