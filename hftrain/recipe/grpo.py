"""The grpo group of the recipe (TRL GRPOConfig's names and defaults): its fields (`GRPOFields`) and the rules judged
from the recipe alone (`problems`); the reward functions are imported and checked by the objective before the
model loads (`hftrain/objectives/grpo.py`, pieces in `hftrain/rl/`). beta, loss_type, max_prompt_length and
max_completion_length are the objective group's fields, shared with dpo; their grpo defaults are
`OBJECTIVE_DEFAULTS`."""

from __future__ import annotations

from dataclasses import dataclass

from hftrain.recipe import GRPO_LOSS_TYPES as LOSS_TYPES
from hftrain.recipe import recipe_field as _f

# GRPOConfig's defaults where they differ from DPOConfig's for the fields the two share; load_recipe applies them
# to the fields a grpo recipe and its command line leave unset, so the resolved recipe shows them
OBJECTIVE_DEFAULTS = {"grpo": {"beta": 0.0, "loss_type": "dapo", "max_completion_length": 512}}


@dataclass
class GRPOFields:
    reward_funcs: list[str] = _f(
        [], "grpo: the reward functions, each a dotted import path pkg.module.func or path/to/file.py:func, called "
        "as TRL does: f(prompts, completions, completion_ids, **dataset_columns) -> list[float | None].",
        group="grpo",
    )
    reward_weights: list[float] | None = _f(
        None, "grpo: one weight per reward function (default: all 1); the reward is the weighted sum.", group="grpo",
    )
    num_generations: int = _f(8, "grpo: completions sampled per prompt (a group).", group="grpo")
    temperature: float = _f(
        1.0, "grpo: sampling temperature; the trained log-probs use the logits divided by it, as TRL.", group="grpo",
    )
    top_p: float = _f(1.0, "grpo: nucleus sampling probability mass (1 = off).", group="grpo")
    top_k: int = _f(0, "grpo: sample from the k most likely tokens only (0 = off).", group="grpo")
    repetition_penalty: float = _f(1.0, "grpo: generate's repetition penalty (1 = off).", group="grpo")
    epsilon: float = _f(0.2, "grpo: lower clipping range of the importance ratio, 1 - epsilon.", group="grpo")
    epsilon_high: float | None = _f(
        None, "grpo: upper clipping range, 1 + epsilon_high (default: epsilon; DAPO uses 0.28).", group="grpo",
    )
    scale_rewards: str = _f(
        "group", "grpo: advantages (R - group mean) divided by the group's reward std (group), the whole "
        "generation batch's (batch) or not at all (none).", group="grpo", choices=("group", "batch", "none"),
    )
    num_iterations: int = _f(
        1, "grpo: optimisation passes over each generation batch; every pass uses the log-probs stored at "
        "generation as the ratio's denominator (PPO-style).", group="grpo",
    )
    steps_per_generation: int | None = _f(
        None, "grpo: micro-batches per process that one generation batch feeds (default: "
        "gradient_accumulation_steps, one generation per optimizer step); a multiple of "
        "gradient_accumulation_steps.", group="grpo",
    )
    mask_truncated_completions: bool = _f(
        False, "grpo: completions cut at max_completion_length (no EOS) train no token.", group="grpo",
    )
    importance_sampling_level: str = _f(
        "token", "grpo: one importance ratio per token, or per completion (sequence: GSPO).", group="grpo",
        choices=("token", "sequence"),
    )
    log_completions: bool = _f(
        False, "grpo: also log TRL's table of completions (step, prompt, completion, each reward, advantage) of the "
        "latest generation batch to W&B with each metrics row; needs wandb in report_to (rollouts.jsonl always has "
        "every completion).", group="grpo",
    )
    use_vllm: bool = _f(
        False, "grpo: sample with vLLM (TRL's colocated mode) instead of transformers' generate. Not available: "
        "hftrain has not implemented it, because no CUDA GPU was available to test it; true is refused. Generation "
        "uses transformers' generate under every strategy (DDP, ZeRO-3 gathered, FSDP2, LoRA/QLoRA).", group="grpo",
    )
    ds3_gather_for_generation: bool = _f(
        True, "grpo, DeepSpeed ZeRO-3 (TRL's name and default): true gathers the whole model on every process for "
        "each generation batch (fast sampling; one full copy of the weights per process meanwhile); false samples "
        "through the ZeRO-3 partitions, each layer gathered by DeepSpeed's hooks for every generated token (memory as "
        "a training forward, for a model whose weights do not fit one device whole; slower). Other strategies never "
        "gather the whole model for generation (one process, DDP and ZeRO-1/2 hold it whole already, FSDP2 and "
        "tensor parallelism generate through their shards), so there false changes nothing, as in TRL.",
        group="grpo",
    )


VLLM_REFUSED = ("use_vllm: true is refused: hftrain does not implement vLLM generation (TRL's colocated mode needs a "
                "CUDA GPU and vLLM, and none was available to test it); remove use_vllm: completions are sampled with "
                "transformers' generate under every strategy (DDP, ZeRO-3 gathered, FSDP2, LoRA/QLoRA)")


def problems(r) -> list[str]:
    """objective grpo's settings (GRPOConfig's rules) and what it cannot be combined with yet. Other objectives:
    reward_funcs unset."""
    if r.objective != "grpo":
        misplaced = [(r.reward_funcs, f"reward_funcs is set but objective={r.objective}; set objective: grpo"),
                     (r.use_vllm, f"use_vllm is grpo's generation setting, but objective={r.objective}; remove it"),
                     (not r.ds3_gather_for_generation, "ds3_gather_for_generation: false is grpo's generation "
                      f"setting, but objective={r.objective}; remove it")]
        return [message for is_set, message in misplaced if is_set]
    problems = [VLLM_REFUSED] if r.use_vllm else []
    if r.loss_type not in LOSS_TYPES:
        problems.append(f"loss_type={r.loss_type} is a dpo loss; grpo takes {', '.join(LOSS_TYPES)}")
    if not r.reward_funcs:
        problems.append("objective grpo needs reward_funcs: a list of pkg.module.func or path/to/file.py:func")
    if r.reward_weights is not None and len(r.reward_weights) != len(r.reward_funcs):
        problems.append(f"reward_weights has {len(r.reward_weights)} weights for {len(r.reward_funcs)} reward_funcs; "
                        "give one per function, or none (all 1)")
    checks = [
        (r.beta >= 0, f"beta must be >= 0 (0 = no reference model), got {r.beta}"),
        (r.num_generations >= 2, f"num_generations must be >= 2 (a group's advantages need two completions), got "
         f"{r.num_generations}"),
        (r.temperature > 0, f"temperature must be > 0, got {r.temperature}"),
        (0 < r.top_p <= 1, f"top_p must be in (0, 1], got {r.top_p}"),
        (r.top_k >= 0, f"top_k must be >= 0 (0 = off), got {r.top_k}"),
        (r.repetition_penalty > 0, f"repetition_penalty must be > 0, got {r.repetition_penalty}"),
        (r.epsilon > 0, f"epsilon must be > 0, got {r.epsilon}"),
        (r.epsilon_high is None or r.epsilon_high > 0, f"epsilon_high must be > 0, got {r.epsilon_high}"),
        (r.num_iterations >= 1, f"num_iterations must be >= 1, got {r.num_iterations}"),
        (r.max_completion_length is not None and r.max_completion_length >= 1,
         f"max_completion_length must be >= 1, got {r.max_completion_length}"),
        (r.max_prompt_length is None or r.max_prompt_length >= 1,
         f"max_prompt_length must be >= 1 or unset, got {r.max_prompt_length}"),
        (r.steps_per_generation is None or (r.steps_per_generation >= 1
                                            and r.steps_per_generation % r.gradient_accumulation_steps == 0),
         f"steps_per_generation={r.steps_per_generation} must be a multiple of gradient_accumulation_steps="
         f"{r.gradient_accumulation_steps}: a generation batch then feeds whole optimizer steps"),
        (not r.packing, "packing with objective grpo is refused: each completion is one row; set packing: false"),
        (not (r.use_liger_kernel or r.loss_chunk_tokens), "objective grpo needs per-token log-probs; use_liger_kernel "
         "and loss_chunk_tokens compute one summed cross-entropy: turn them off"),
        (not r.precompute_ref_log_probs, "precompute_ref_log_probs is dpo's; grpo's reference log-probs are computed "
         "with each generation"),
        (r.label_smoothing == 0, "label_smoothing is a dpo/simpo setting; remove it with objective grpo"),
        (not r.dataset_mixture, "objective grpo reads one dataset_name (with a prompt column); dataset_mixture is not "
         "supported with it yet"),
        (not r.eval_dataset_name and (r.validation_split_percentage == 0 or r.eval_strategy == "no"),
         "objective grpo has no evaluation yet (it would generate): set eval_strategy: no and remove "
         "eval_dataset_name"),
        (not r.log_completions or "wandb" in r.report_to, "log_completions logs a W&B table: add wandb to report_to, "
         "or remove log_completions (output_dir/rollouts.jsonl has every completion)"),
        (not r.router_aux_loss_coef, "objective grpo does not add a router load-balancing loss yet; remove "
         "router_aux_loss_coef"),
    ]
    return problems + [message for ok, message in checks if not ok]
