"""The evaluation group of the recipe (what each evaluation runs besides the eval set's loss): lm-evaluation-harness
tasks on the live model and generated samples of fixed eval prompts. Its fields (`EvaluationFields`) and the rules
judged from the recipe alone (`problems`); the code is `hftrain/eval_tasks.py` (`TaskEvaluation`) and
`hftrain/samples.py` (`CompletionSamples`), which `Finetune.evaluate` runs after the loss.
"""

from __future__ import annotations

from dataclasses import dataclass

from hftrain.fields import recipe_field as _f


@dataclass
class EvaluationFields:
    eval_tasks: list[str] = _f(
        [], "lm-evaluation-harness tasks run on the live model at each evaluation and at the end (eval_strategy's "
        "cadence), without saving it: installed task names (hellaswag, arc_easy, globs) or paths to task YAML files; "
        "results logged as eval/<task>/<metric> to metrics.jsonl and every tracker, the same numbers as `hftrain eval` "
        "on the saved model. Needs pip install 'hftrain[eval]'. The main process evaluates while the others wait: one "
        "process, DDP or DeepSpeed ZeRO-1/2 (layouts that split the model are refused).", group="evaluation",
    )
    eval_tasks_limit: int | None = _f(
        None, "eval_tasks: at most this many examples per task (lm-eval's limit), to keep each evaluation short.",
        group="evaluation",
    )
    eval_tasks_num_fewshot: int | None = _f(
        None, "eval_tasks: few-shot examples per prompt (lm-eval's num_fewshot; default: each task's own).",
        group="evaluation",
    )
    num_completion_prompts: int = _f(
        4, "log_completions (every objective but grpo): how many eval examples' prompts (the first ones of the eval "
        "set) are completed at each evaluation.", group="evaluation",
    )
    completion_max_new_tokens: int | None = _f(
        None, "log_completions (every objective but grpo): the most tokens generated per completion (default: "
        "max_completion_length, else 128).", group="evaluation",
    )
    num_completions_to_print: int | None = _f(
        None, "log_completions (every objective but grpo): how many of those completions are also printed on the "
        "console at each evaluation (TRL's name; default: all, 0: none).", group="evaluation",
    )


def problems(r) -> list[str]:
    problems = []
    evaluates = r.eval_strategy != "no"
    if r.eval_tasks and not evaluates:
        problems.append("eval_tasks run at each evaluation and at the end, but eval_strategy=no never evaluates; set "
                        "eval_strategy: steps (with eval_steps) or epoch, or remove eval_tasks")
    for name in ("eval_tasks_limit", "eval_tasks_num_fewshot"):
        if getattr(r, name) is not None and not r.eval_tasks:
            problems.append(f"{name} is set but eval_tasks is empty; name the tasks or remove {name}")
    if r.eval_tasks_limit is not None and r.eval_tasks_limit < 1:
        problems.append(f"eval_tasks_limit must be >= 1 or unset, got {r.eval_tasks_limit}")
    if r.eval_tasks_num_fewshot is not None and r.eval_tasks_num_fewshot < 0:
        problems.append(f"eval_tasks_num_fewshot must be >= 0 or unset, got {r.eval_tasks_num_fewshot}")
    if r.objective == "grpo":  # grpo's log_completions is its rollouts' table (fields/grpo.py)
        if sample_settings(r):
            problems.append(f"{', '.join(sample_settings(r))} apply to the eval samples of every objective but grpo; "
                            "grpo's log_completions logs its rollouts (rollouts.jsonl): remove them")
        return problems
    if r.log_completions and not (evaluates and (r.eval_dataset_name or r.validation_split_percentage > 0)):
        problems.append("log_completions completes eval prompts at each evaluation, but this run never evaluates; "
                        "set eval_strategy (steps or epoch) with an eval set (eval_dataset_name or "
                        "validation_split_percentage > 0), or remove log_completions")
    if not r.log_completions and sample_settings(r):
        problems.append(f"{', '.join(sample_settings(r))} set without log_completions; add log_completions: true or "
                        "remove them")
    if r.num_completion_prompts < 1:
        problems.append(f"num_completion_prompts must be >= 1, got {r.num_completion_prompts}")
    if r.completion_max_new_tokens is not None and r.completion_max_new_tokens < 1:
        problems.append(f"completion_max_new_tokens must be >= 1 or unset, got {r.completion_max_new_tokens}")
    if r.num_completions_to_print is not None and r.num_completions_to_print < 0:
        problems.append(f"num_completions_to_print must be >= 0 or unset, got {r.num_completions_to_print}")
    return problems


def sample_settings(r) -> list[str]:
    """The log_completions settings changed from their defaults."""
    return [name for name, changed in (("num_completion_prompts", r.num_completion_prompts != 4),
                                       ("completion_max_new_tokens", r.completion_max_new_tokens is not None),
                                       ("num_completions_to_print", r.num_completions_to_print is not None)) if changed]
