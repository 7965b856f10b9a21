"""Issue 38's pieces without a run: the evaluation group's recipe rules, eval_tasks' refusal of layouts in which no
process holds the whole model, lm-eval's results as metrics, the samples' prompts, and `hftrain.trained.inspect` on
folders that are not trained models."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from hftrain import trained
from hftrain.config import Recipe, validate
from hftrain.data import IGNORE_INDEX
from hftrain.errors import HftrainError
from hftrain.eval_tasks import TaskEvaluation, metrics
from hftrain.fields.evaluation import problems
from hftrain.parallel.base import Backend, Parallelism
from hftrain.parallel.launch import Launch
from hftrain.preflight import evaluation_problems
from hftrain.samples import CompletionSamples, prompt_ids
from tests.unit.parallel.conftest import fake_accelerator


@pytest.mark.parametrize(("fields", "said"), [
    ({"eval_tasks": ["arc_easy"], "eval_strategy": "no", "validation_split_percentage": 0},
     "eval_tasks run at each evaluation and at the end, but eval_strategy=no"),
    ({"eval_tasks_limit": 10}, "eval_tasks_limit is set but eval_tasks is empty"),
    ({"eval_tasks": ["arc_easy"], "eval_tasks_limit": 0}, "eval_tasks_limit must be >= 1"),
    ({"log_completions": True, "validation_split_percentage": 0}, "log_completions completes eval prompts at each "
     "evaluation, but this run never evaluates"),
    ({"num_completions_to_print": 2}, "num_completions_to_print set without log_completions"),
    ({"log_completions": True, "num_completion_prompts": 0}, "num_completion_prompts must be >= 1"),
    ({"objective": "grpo", "reward_funcs": ["a.b"], "num_completion_prompts": 2, "validation_split_percentage": 0},
     "num_completion_prompts apply to the eval samples of every objective but grpo"),
])
def test_evaluation_group_rules(fields, said):
    found = problems(Recipe(**fields))
    assert len(found) == 1 and said in found[0], found
    assert found[0] in validate(Recipe(**fields))


def test_evaluation_group_accepts_its_defaults_and_a_usual_setting():
    assert problems(Recipe()) == []
    assert problems(Recipe(eval_tasks=["hellaswag"], eval_tasks_limit=100, log_completions=True,
                           num_completions_to_print=1, completion_max_new_tokens=32)) == []


@pytest.mark.parametrize(("record", "said"), [
    (Parallelism("fsdp2", "FSDP2 FULL_SHARD", 2, 1, "gloo", dp_world=2, sharded=("weights", "gradients")),
     "FSDP2 FULL_SHARD shards the weights"),
    (Parallelism("tp", "tensor parallel (tp_size=2)", 2, 1, "gloo", tp_size=2), "splits the model over 2 processes"),
    (Parallelism("fsdp2", "FSDP2 + context parallel", 2, 1, "gloo", cp_size=2), "splits each sequence over 2"),
])
def test_eval_tasks_refuses_layouts_without_a_whole_model(record, said):
    backend = Backend(fake_accelerator(record.processes), Recipe(eval_tasks=["arc_easy"]))
    backend.record = record
    with pytest.raises(HftrainError, match="no process holds it whole") as error:
        TaskEvaluation(backend.recipe, backend)
    assert said in str(error.value) and "hftrain eval output_dir/final" in str(error.value)


def test_lm_evals_results_become_eval_task_metric_keys():
    results = {"results": {"gsm8k": {"alias": "gsm8k", "exact_match,strict-match": 0.25,
                                     "exact_match_stderr,strict-match": 0.1, "sample_len": 8},
                           "arc_easy": {"acc,none": 0.5, "acc_stderr,none": "N/A"}}}
    assert metrics(results) == {"eval/gsm8k/exact_match,strict-match": 0.25,
                                "eval/gsm8k/exact_match_stderr,strict-match": 0.1, "eval/arc_easy/acc": 0.5}


def test_a_samples_prompt_ends_where_training_starts():
    x = IGNORE_INDEX
    assert prompt_ids([5, 6, 7, 8, 9], [x, x, x, 8, 9]) == [5, 6, 7]
    assert prompt_ids(list(range(100)), list(range(100))) == list(range(32))  # plain text: half, at most 32
    assert prompt_ids([4, 5, 6, 7], [4, 5, 6, 7]) == [4, 5]


def test_inspect_refuses_what_is_not_a_trained_folder(tmp_path):
    with pytest.raises(HftrainError, match="is not a folder"):
        trained.inspect(tmp_path / "missing")
    with pytest.raises(HftrainError, match="is not a model folder: it holds neither config.json"):
        trained.inspect(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(HftrainError, match="has config.json but no weights"):
        trained.inspect(tmp_path)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": None}))
    with pytest.raises(HftrainError, match="names no base model"):
        trained.inspect(adapter)


def test_completions_file_continues_from_the_resumed_checkpoint(tmp_path):
    """A resumed run keeps completions.jsonl's rows up to its checkpoint's step (later ones were made by the run
    that was cut short); a new run starts the file empty."""
    checkpoint = tmp_path / "checkpoint-2"
    checkpoint.mkdir()
    (checkpoint / "hftrain_state.json").write_text(json.dumps({"progress": {"step": 2}}))
    samples = CompletionSamples.__new__(CompletionSamples)  # only the file's part: no model, no eval set
    samples.file = tmp_path / "completions.jsonl"
    rows = [{"step": s, "prompt": "p", "completion": "c"} for s in (1, 2, 3)]
    samples.file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    samples.start_file(SimpleNamespace(resume_from=checkpoint))
    assert [json.loads(line)["step"] for line in samples.file.read_text().splitlines()] == [1, 2]
    samples.start_file(SimpleNamespace(resume_from=None))
    assert samples.file.read_text() == ""


@pytest.mark.parametrize(("launch", "fields", "said"), [
    (Launch("fsdp2", 2, 2), {}, "but FSDP2 shards the weights, so no process holds it whole"),
    (Launch("ddp", 4, 4), {"tp_size": 2}, "but tp_size=2 splits the model"),
    (Launch("ddp", 2, 2), {"sp_size": 2}, "but sp_size=2 splits the sequences"),
])
def test_the_preflight_refuses_eval_tasks_where_no_process_holds_the_model(launch, fields, said):
    """Before any process starts (`hftrain launch` runs the preflight first): the same rule as TaskEvaluation's."""
    found = evaluation_problems(Recipe(eval_tasks=["arc_easy"], **fields), launch, None)
    assert len(found) == 1 and said in found[0] and "hftrain eval output_dir/final" in found[0], found
    assert evaluation_problems(Recipe(eval_tasks=["arc_easy"]), Launch("ddp", 2, 2), None) == []
    assert evaluation_problems(Recipe(eval_tasks=["arc_easy"]), Launch("single", 1, 1), None) == []


def test_the_preflight_refuses_completions_from_a_split_model():
    found = evaluation_problems(Recipe(log_completions=True, pp_size=2), Launch("ddp", 2, 2), None)
    assert len(found) == 1 and "log_completions generates with transformers' generate" in found[0]
    # grpo's log_completions is its rollouts' table, which a sequence-parallel grpo run writes like any other
    grpo = Recipe(objective="grpo", reward_funcs=["hftrain.rl.example_rewards.vowel_share"], log_completions=True,
                  sp_size=2)
    assert evaluation_problems(grpo, Launch("deepspeed", 2, 2), None) == []
