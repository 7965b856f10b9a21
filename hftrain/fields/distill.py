"""The distill group of the recipe (TRL 1.16's DistillationConfig and GKDConfig names): its fields (`DistillFields`)
and the rules judged from the recipe alone (`problems`); the objective itself is `hftrain/objectives/distill.py`.
beta, temperature, top_p, top_k, repetition_penalty and max_completion_length are shared fields (objective and grpo
groups); distill's defaults of them are `DISTILL_DEFAULTS` (DistillationConfig's)."""

from __future__ import annotations

from dataclasses import dataclass

from hftrain.fields import recipe_field as _f

# DistillationConfig's defaults where they differ from the shared fields' (applied by load_recipe to unset fields)
DISTILL_DEFAULTS = {"beta": 1.0, "max_completion_length": 512}


@dataclass
class DistillFields:
    teacher_model_name_or_path: str | None = _f(
        None, "distill: the teacher, a causal LM folder or hub id sharing the student's tokenizer and vocabulary "
        "(checked from the two folders' tokenizer and config files before the student loads). It is loaded "
        "frozen, in the recipe's dtype, and placed like the student (copied on every process, partitioned under "
        "ZeRO-3, sharded under FSDP2).", group="distill",
    )
    teacher_model_revision: str = _f("main", "distill: hub revision of the teacher.", group="distill")
    lmbda: float = _f(
        0.0, "distill (GKDConfig's lmbda): the share of optimizer steps trained on the student's own completions "
        "of the prompts (on-policy, sampled with temperature / top_p / top_k up to max_completion_length) instead "
        "of the dataset's completions (offline). 0: always the dataset's; 1: always the student's "
        "(DistillationTrainer's way). In between, each optimizer step's choice is drawn from the seed and the "
        "step (the same for all its micro-batches and processes, the same after a resume), not per micro-batch "
        "from a global random state as GKDTrainer does. On-policy completions go to output_dir/rollouts.jsonl.",
        group="distill",
    )


def problems(r) -> list[str]:
    """objective distill's settings (DistillationConfig's rules) and the fields it cannot be combined with;
    other objectives: no distill field set."""
    if r.objective != "distill":
        misplaced = [(r.teacher_model_name_or_path is not None, "teacher_model_name_or_path"),
                     (r.lmbda != 0.0, "lmbda")]
        return [f"{name} is set but objective={r.objective}; it configures objective distill"
                for is_set, name in misplaced if is_set]
    problems = []
    if not r.teacher_model_name_or_path:
        problems.append("objective distill needs teacher_model_name_or_path: the model whose next-token "
                        "distributions the student learns")
    if not 0.0 <= r.beta <= 1.0:
        problems.append(f"distill: beta must be in [0, 1] (0 forward KL, 0.5 JSD, 1 reverse KL), got {r.beta}")
    if not 0.0 <= r.lmbda <= 1.0:
        problems.append(f"distill: lmbda must be in [0, 1] (the share of on-policy micro-batches), got {r.lmbda}")
    if r.temperature <= 0:
        problems.append(f"distill: temperature must be > 0, got {r.temperature}")
    if r.max_completion_length is not None and r.max_completion_length < 1:
        problems.append(f"distill: max_completion_length must be >= 1, got {r.max_completion_length}")
    if r.loss_type != "sigmoid":
        problems.append(f"loss_type={r.loss_type} is a dpo/grpo loss; objective distill's divergence is set by "
                        "beta")
    if r.precompute_ref_log_probs:
        problems.append("precompute_ref_log_probs computes dpo's and kto's reference, but objective=distill")
    if r.packing:
        problems.append("packing with objective distill is refused: the teacher would have to read the packed "
                        "rows' boundaries as the student does; set packing: false")
    if r.use_liger_kernel:
        problems.append("use_liger_kernel with objective distill is refused: the fused kernel computes a "
                        "cross-entropy against labels, not a divergence from the teacher's distribution")
    if r.streaming:
        problems.append("streaming with objective distill is not supported yet; set streaming: false")
    if r.lmbda > 0 and r.dataset_format not in ("auto", "prompt_completion", "messages"):
        problems.append(f"distill with lmbda > 0 samples completions of each row's prompt: dataset_format must be "
                        f"auto, prompt_completion or messages, got {r.dataset_format}")
    return problems
