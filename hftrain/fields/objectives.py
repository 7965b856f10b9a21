"""The objective group of the recipe: its fields (`ObjectiveFields`) and the rules judged from the recipe alone
(`problems`); the objectives themselves are `hftrain/objectives/`.
"""

from __future__ import annotations

from dataclasses import dataclass

from hftrain.fields import GRPO_LOSS_TYPES
from hftrain.fields import recipe_field as _f


@dataclass
class ObjectiveFields:
    objective: str = _f(
        "sft", "What the loop minimises: sft (next-token cross-entropy over trained tokens), dpo (Direct Preference "
        "Optimization on chosen/rejected pairs against a reference model), simpo (SimPO: reference-free, "
        "length-normalised), orpo (ORPO: reference-free, NLL of the chosen answers plus an odds-ratio term), kto (KTO: "
        "unpaired thumbs-up/down feedback against a reference model), reward (a reward model: the base as "
        "AutoModelForSequenceClassification with one output, trained to score chosen above rejected, as TRL's "
        "RewardTrainer), grpo (online RL: completions sampled from the model, scored by reward_funcs, TRL's GRPO "
        "loss), distill (knowledge distillation: the generalized JSD to teacher_model_name_or_path's next-token "
        "distributions, see docs/distillation.md) or embedding (a bi-encoder: the base as AutoModel, its pooled, "
        "normalised vectors trained with sentence-transformers' MultipleNegativesRankingLoss on (anchor, positive[, "
        "negative]) rows, see docs/retrieval.md). dpo, simpo, orpo and reward need preference data (chosen, "
        "rejected and optionally prompt columns; "
        "reward also an optional margin column), kto unpaired data (prompt, completion, label: true/false), see "
        "docs/preference.md; grpo a prompt column, see docs/grpo.md.", group="objective",
        choices=("sft", "dpo", "simpo", "orpo", "kto", "reward", "grpo", "distill", "embedding", "reranker"),
    )
    beta: float = _f(
        0.1, "dpo/simpo temperature: how far the policy may move from the reference (dpo) or the reward scale "
        "(simpo; its paper uses 2.0-2.5). orpo: the weight of the odds-ratio term (TRL's ORPOConfig.beta, the paper's "
        "lambda). grpo: the KL coefficient to the reference, default 0.0 there as in TRL "
        "(0 = no reference model).", group="objective",
    )
    loss_type: str = _f(
        "sigmoid", "dpo loss (TRL's names): sigmoid (the DPO paper), ipo (squared, per-token-normalised log-ratios, "
        "as TRL), hinge (SLiC). grpo (default dapo there, as TRL): dapo (token mean over the step's completion "
        "tokens), grpo (mean of each completion's token mean), bnpo (TRL's per-micro-batch token mean), dr_grpo "
        "(token sum / max_completion_length), cispo (MiniMax-M1: the ratio clipped at epsilon_high, stop-gradient, "
        "times A x log-prob; token mean as dapo; TRL recommends epsilon_high 5.0), sapo (Soft Adaptive Policy "
        "Optimization: a sigmoid gate of temperature sapo_temperature_pos / _neg instead of the clip; mean of each "
        "completion's token mean as grpo); docs/grpo.md has every formula. kto (default kto there, as TRL): kto "
        "(the KTO paper's loss against the step's KL reference point), apo_zero_unpaired (APO-zero, unpaired: no "
        "KL term).", group="objective",
        choices=("sigmoid", "ipo", "hinge", "dapo", "grpo", "bnpo", "dr_grpo", "cispo", "sapo", "kto",
                 "apo_zero_unpaired"),
    )
    desirable_weight: float = _f(
        1.0, "kto: the weight of the desirable (label: true) examples' losses (TRL's KTOConfig.desirable_weight); "
        "with unbalanced data keep desirable_weight x desirables / (undesirable_weight x undesirables) in [1, 4/3] "
        "(the KTO paper's Eq. 8; hftrain warns as TRL does outside it).", group="objective",
    )
    undesirable_weight: float = _f(
        1.0, "kto: the weight of the undesirable (label: false) examples' losses (TRL's "
        "KTOConfig.undesirable_weight).", group="objective",
    )
    label_smoothing: float = _f(
        0.0, "Probability that a pair's preference is flipped (conservative DPO / SimPO), in [0, 0.5); for "
        "loss_type sigmoid and simpo. TRL 1.16's DPOTrainer ignores it for sigmoid: compare with 0.",
        group="objective",
    )
    simpo_gamma: float = _f(0.5, "simpo target reward margin (TRL's simpo_gamma).", group="objective")
    precompute_ref_log_probs: bool = _f(
        False, "dpo: compute the reference log-probs of every training and eval pair once, before training, with the "
        "starting model under the launch's own strategy, then train without a reference model in memory (saves the "
        "frozen copy of full fine-tuning). Saved in every checkpoint and restored on resume. kto: of every row and "
        "of every mismatched (KL) row the run's steps will draw.",
        group="objective",
    )
    center_rewards_coefficient: float | None = _f(
        None, "reward: adds this x the mean of (r_chosen + r_rejected)^2 to the loss, pulling the rewards toward mean "
        "zero (TRL's RewardConfig.center_rewards_coefficient; its recommended value 0.01). Unset: no such term.",
        group="objective",
    )
    max_prompt_length: int | None = _f(
        None, "Preference data and grpo: keep at most this many prompt tokens (the last ones, next to the answer).",
        group="objective",
    )
    max_completion_length: int | None = _f(
        None, "Preference data: cut each completion to this many tokens (from the end). max_length then caps "
        "prompt + completion; a pair whose prompt leaves no completion token is dropped and counted. grpo: the "
        "most tokens generated per completion (default 512 there, as TRL).",
        group="objective",
    )


KTO_LOSS_TYPES = ("kto", "apo_zero_unpaired")


def kto_problems(r) -> list[str]:
    """kto's settings: its loss types, weights, and what its step-wide KL pairing cannot be combined with."""
    problems = []
    if r.loss_type not in KTO_LOSS_TYPES:
        problems.append(f"loss_type={r.loss_type} is not a kto loss; objective kto takes loss_type kto or "
                        "apo_zero_unpaired")
    for name in ("desirable_weight", "undesirable_weight"):
        if getattr(r, name) <= 0:
            problems.append(f"{name} must be > 0, got {getattr(r, name)}")
    if r.streaming:
        problems.append("streaming with objective kto is refused: the KL reference point pairs rows across the whole "
                        "optimizer step, which needs map-style data; set streaming: false")
    return problems


def problems(r) -> list[str]:
    """dpo / simpo settings and what a preference objective cannot be combined with (grpo's: fields/grpo.py)."""
    problems, preference = [], r.objective in ("dpo", "simpo", "orpo", "kto", "reward")
    problems += reward_problems(r)
    # their own groups judge beta and the lengths (fields/grpo.py, distill.py, retrieval.py)
    if r.objective in ("grpo", "distill", "embedding", "reranker"):
        return problems
    if r.objective == "kto":
        problems += kto_problems(r)
    elif r.loss_type in KTO_LOSS_TYPES:
        problems.append(f"loss_type={r.loss_type} is a kto loss, but objective={r.objective}; set objective: kto")
    if (r.desirable_weight, r.undesirable_weight) != (1.0, 1.0) and r.objective != "kto":
        problems.append("desirable_weight and undesirable_weight weight kto's losses, but "
                        f"objective={r.objective}")
    if r.beta <= 0:
        problems.append(f"beta must be > 0, got {r.beta}")
    if not 0 <= r.label_smoothing < 0.5:
        problems.append(f"label_smoothing must be in [0, 0.5), got {r.label_smoothing}")
    if r.label_smoothing > 0 and not (r.objective == "simpo" or (r.objective == "dpo" and r.loss_type == "sigmoid")):
        problems.append(f"label_smoothing={r.label_smoothing} applies to objective dpo with loss_type sigmoid, or "
                        f"simpo; here objective={r.objective}, loss_type={r.loss_type}")
    if r.precompute_ref_log_probs and r.objective not in ("dpo", "kto"):
        problems.append(f"precompute_ref_log_probs computes dpo's and kto's reference, but objective={r.objective}")
    if r.loss_type != "sigmoid" and r.objective not in ("dpo", "kto") and r.loss_type not in KTO_LOSS_TYPES:
        problems.append(f"loss_type={r.loss_type} is a {'grpo' if r.loss_type in GRPO_LOSS_TYPES else 'dpo'} loss, "
                        f"but objective={r.objective}; set objective: "
                        f"{'grpo' if r.loss_type in GRPO_LOSS_TYPES else 'dpo'}")
    for name in ("max_prompt_length", "max_completion_length"):
        value = getattr(r, name)
        if value is not None and (value < 1 or not preference):
            problems.append(f"{name}={value} needs objective dpo, simpo, orpo, kto or reward and a value >= 1")
    if not preference:
        return problems
    if r.packing:
        problems.append(f"packing with objective={r.objective} is refused: "
                        + ("each completion's log-probability is scored as a whole sequence, one per row"
                           if r.objective == "kto" else "a pair's chosen and rejected must be compared as whole "
                           "sequences, one per row") + "; set packing: false")
    if r.use_liger_kernel or r.loss_chunk_tokens:
        problems.append(f"objective={r.objective} needs each sequence's log-probability; use_liger_kernel and "
                        "loss_chunk_tokens compute one summed cross-entropy: turn them off")
    if r.objective == "kto" and r.dataset_format not in ("auto", "unpaired"):
        problems.append(f"objective=kto trains on unpaired feedback: dataset_format must be auto or unpaired, got "
                        f"{r.dataset_format}")
    elif r.objective != "kto" and r.dataset_format not in ("auto", "preference"):
        problems.append(f"objective={r.objective} trains on preference pairs: dataset_format must be auto or "
                        f"preference, got {r.dataset_format}")
    return problems


def reward_problems(r) -> list[str]:
    """objective reward's settings, and what a reward model (a score per sequence, no text) cannot be combined with."""
    if r.objective != "reward":
        return [f"center_rewards_coefficient={r.center_rewards_coefficient} is objective reward's; here "
                f"objective={r.objective}"] if r.center_rewards_coefficient is not None else []
    problems = []
    if r.center_rewards_coefficient is not None and r.center_rewards_coefficient < 0:
        problems.append(f"center_rewards_coefficient must be >= 0 (TRL recommends 0.01), got "
                        f"{r.center_rewards_coefficient}")
    if r.beta != 0.1:
        problems.append(f"beta={r.beta} has no meaning for objective reward (its loss has no temperature); remove it")
    if r.eval_tasks:
        problems.append("eval_tasks runs lm-evaluation-harness on a causal LM; a reward model (objective reward) "
                        "writes no text: remove eval_tasks")
    if r.log_completions:
        problems.append("log_completions completes eval prompts with the trained model; a reward model (objective "
                        "reward) writes no text: remove log_completions (eval_accuracy says how it ranks the eval "
                        "pairs)")
    if r.streaming:
        problems.append("streaming: true with objective reward is not supported yet; set streaming: false")
    for name, value in (("pp_size", r.pp_size), ("tp_size", r.tp_size), ("cp_size", r.cp_size),
                        ("sp_size", r.sp_size)):
        if value > 1:
            problems.append(f"{name}={value} with objective reward is refused: the model is split along a causal "
                            "LM's layout there, verified for the language-model head only; use DDP, ZeRO or FSDP2")
    return problems
