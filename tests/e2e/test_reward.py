"""objective reward through the real entry script: the shipped recipe trains a reward model whose final folder loads
with AutoModelForSequenceClassification and ranks held-out pairs better than the base, TRL's RewardTrainer gives the
same steps and score head (full with margins and centering, LoRA), one step is the same whatever its split into
micro-batches and processes, a resumed run continues exactly, and data without a rejected column is refused before
the model loads. `hftrain merge` merges a LoRA reward adapter into a sequence classifier, and `hftrain chat` / `eval`
refuse reward folders, saying how to score with them."""

from __future__ import annotations

import json
import random
import shutil
import sys

import pytest
import torch
from huggingface_hub import ModelCard

from tests.conftest import ENTRY, FSDP_LAUNCHER, REPO, Run, launch, run_script, write_jsonl
from tests.e2e import objective_checks as checks
from tests.model_cards import run_snippet

pytestmark = pytest.mark.launch
TINY_REWARD = ["--config", str(REPO / "recipes" / "tiny-reward.yaml")]
# 3 steps of 4 pairs in file order, each with a margin, centering on, clipping active, no evaluation; SGD with
# momentum as tests/e2e/test_orpo.py (AdamW's first steps would magnify the last-bit differences of an all-reduce)
EXACT = ["--max_steps", "3", "--logging_steps", "1", "--train_sampling_strategy", "sequential",
         "--validation_split_percentage", "0", "--optim", "sgd", "--sgd_momentum", "0.9", "--learning_rate", "0.5",
         "--max_grad_norm", "0.5", "--warmup_steps", "0", "--save_steps", "2", "--center_rewards_coefficient", "0.01"]
COMPARED = ("loss", "grad_norm", "accuracy", "margin", "mean_reward")


@pytest.fixture(scope="module")
def margin_pairs(tmp_path_factory) -> list[str]:
    """The recipe with the first 12 shipped pairs, each with a margin column."""
    lines = (REPO / "data" / "preference.jsonl").read_text(encoding="utf-8").splitlines()[:12]
    rows = [{**json.loads(line), "margin": 0.25 * (i % 3)} for i, line in enumerate(lines)]
    data = write_jsonl(tmp_path_factory.mktemp("reward-data") / "pairs.jsonl", rows)
    return [*TINY_REWARD, "--dataset_name", str(data), *EXACT]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, margin_pairs) -> Run:
    """1 process x 4 pairs per step, a checkpoint at step 2: what the other layouts and the resume are compared with."""
    return run_script(tmp_path_factory.mktemp("reward-one") / "out", *margin_pairs, "--per_device_train_batch_size",
                      "4")


def pair_scores(folder, pairs: list[dict], tokenizer) -> torch.Tensor:
    """[pairs, 2] rewards of (chosen, rejected) from a folder loaded with plain transformers, one sequence at a time
    through the tokenizer's chat template (no hftrain code)."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    with torch.no_grad():
        return torch.tensor([[model(input_ids=torch.tensor([tokenizer.apply_chat_template(
            pair["prompt"] + pair[side], tokenize=True, return_dict=True)["input_ids"]])).logits.item()
            for side in ("chosen", "rejected")] for pair in pairs])


def fresh_pairs(count: int, seed: int) -> list[dict]:
    """`count` pairs drawn by scripts/make_data.py's generator with another seed, none equal to a shipped pair."""
    sys.path.insert(0, str(REPO / "scripts"))
    from make_data import preference_example

    shipped = set((REPO / "data" / "preference.jsonl").read_text(encoding="utf-8").splitlines())
    rng, pairs = random.Random(seed), []
    while len(pairs) < count:
        pair = preference_example(rng)
        if json.dumps(pair) not in shipped and pair not in pairs:
            pairs.append(pair)
    return pairs


def test_tiny_reward_recipe_learns_to_rank_held_out_pairs(tmp_path):
    """The shipped recipe on the shipped pairs, evaluated on 200 pairs it never saw (fresh draws of the data's
    generator): train accuracy rises, and the final folder, loaded with AutoModelForSequenceClassification, ranks the
    held-out pairs better than the base (its head drawn with the run's seed) does, as the run's eval_accuracy says."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, set_seed

    held_out = fresh_pairs(200, seed=2026)
    run = run_script(tmp_path / "out", *TINY_REWARD, "--eval_dataset_name",
                     str(write_jsonl(tmp_path / "held_out.jsonl", held_out)), "--validation_split_percentage", "0",
                     "--eval_steps", "1000")
    said = " ".join((run.stdout + run.stderr).split())
    assert ("objective reward: a new score head (num_labels 1) on LlamaForSequenceClassification in place of the "
            "language-model head" in said)
    assert "LOAD REPORT" not in said  # transformers' report of that very head swap is held back
    rows = run.train_rows()
    assert rows[-1]["accuracy"] > rows[0]["accuracy"] and rows[-1]["loss"] < rows[0]["loss"] - 0.1
    final = run.output_dir / "final"
    card = ModelCard.load(final / "README.md")  # the model card says what the folder is and how to score with it
    assert card.data.pipeline_tag == "text-classification" and "reward" in card.data.tags
    assert "trained with hftrain by reward modelling" in card.text and "| eval accuracy |" in card.text
    assert "| accuracy |" in card.text and "eval_" not in card.text.split("## Results")[1].split("## Recipe")[0]
    float(run_snippet(card.text))  # its quick start loads the folder and prints a conversation's reward
    tokenizer = AutoTokenizer.from_pretrained(final)
    trained = pair_scores(final, held_out, tokenizer)
    set_seed(42)
    base = AutoModelForSequenceClassification.from_pretrained(REPO / "models" / "tiny-llama", num_labels=1)
    base.config.pad_token_id = tokenizer.pad_token_id
    base.save_pretrained(tmp_path / "base")
    before = pair_scores(tmp_path / "base", held_out, tokenizer)
    accuracy = (trained[:, 0] > trained[:, 1]).float().mean().item()
    assert accuracy > (before[:, 0] > before[:, 1]).float().mean().item() + 0.1
    assert accuracy == pytest.approx(run.eval_rows()[-1]["eval_accuracy"], abs=0.011)  # a near-tie may flip


@pytest.fixture(scope="module")
def trl_compared(tmp_path_factory):
    """scripts/compare_trl_reward.py's folder (hftrain's runs in hftrain-0, full, and hftrain-1, LoRA) and results."""
    out = tmp_path_factory.mktemp("compare-reward")
    return out, checks.compare_with_trl(out, "compare_trl_reward.py")


def test_equal_to_trl_reward_trainer(trl_compared):
    """scripts/compare_trl_reward.py: TRL 1.16's RewardTrainer and hftrain on the same pairs, order and
    hyperparameters, full (with margins and center_rewards_coefficient) and LoRA: per-step loss, accuracy, margin and
    mean reward within 1e-4, and the trained score heads within 1e-5."""
    compared = trl_compared[1]
    assert sorted(compared) == ["full, margin, centered", "lora"]
    for name, runs in compared.items():
        assert runs["trl"]["steps"][-1]["margin"] != runs["trl"]["steps"][0]["margin"]  # both trained
        checks.assert_steps_match_trl(name, runs["trl"]["steps"], runs["hftrain"]["steps"])
        torch.testing.assert_close(torch.tensor(runs["hftrain"]["score"]), torch.tensor(runs["trl"]["score"]),
                                   rtol=1e-4, atol=1e-5, msg=name)


def test_a_lora_reward_adapter_merges_into_a_reward_model_and_chat_refuses_reward_folders(trl_compared, tmp_path,
                                                                                           capsys):
    """`hftrain merge` on the LoRA reward adapter: a folder AutoModelForSequenceClassification loads (one output, the
    pad token training read scores at), scoring held-out pairs as peft's own AutoPeftModelForSequenceClassification
    scores them with the adapter; its card's quick start runs. `hftrain chat` refuses the full reward model, the
    adapter, the merged folder and a checkpoint, and `hftrain eval` the adapter: one paragraph each, before any
    model loads, naming how to score with it."""
    from peft import AutoPeftModelForSequenceClassification
    from transformers import AutoTokenizer

    from hftrain.cli import main as cli

    out = trl_compared[0]
    adapter, full, merged = out / "hftrain-1" / "final", out / "hftrain-0" / "final", tmp_path / "merged"
    capsys.readouterr()
    cli(["merge", str(adapter), str(merged)])
    assert "(a reward model: it loads with AutoModelForSequenceClassification)" in " ".join(
        capsys.readouterr().out.split())
    tokenizer = AutoTokenizer.from_pretrained(adapter)
    config = json.loads((merged / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"] and config["id2label"] == {"0": "LABEL_0"}
    assert config["pad_token_id"] == tokenizer.pad_token_id is not None
    pairs = fresh_pairs(6, seed=7)
    with torch.no_grad():
        peft_model = AutoPeftModelForSequenceClassification.from_pretrained(adapter, num_labels=1).eval()
        expected = torch.tensor([[peft_model(input_ids=torch.tensor([tokenizer.apply_chat_template(
            pair["prompt"] + pair[side], tokenize=True, return_dict=True)["input_ids"]])).logits.item()
            for side in ("chosen", "rejected")] for pair in pairs])
    merged_scores = pair_scores(merged, pairs, tokenizer)
    torch.testing.assert_close(merged_scores, expected, rtol=1e-5, atol=1e-5)
    assert merged_scores.std() > 0  # not a constant head
    float(run_snippet(ModelCard.load(merged / "README.md").text))  # AutoModelForSequenceClassification's quick start
    checkpoint = tmp_path / "checkpoint-3"  # what inspect reads of a checkpoint: its run files
    checkpoint.mkdir()
    for name in ("hftrain_config.yaml", "hftrain_state.json"):
        shutil.copy(adapter / name, checkpoint / name)
    for argv, what in ((["chat", str(full)], "a LlamaForSequenceClassification with one output"),
                       (["chat", str(merged)], "a LlamaForSequenceClassification with one output"),
                       (["chat", str(adapter)], "a LoRA adapter of a sequence classifier (task_type SEQ_CLS)"),
                       (["eval", str(adapter), "--tasks", "hellaswag"], "a LoRA adapter of a sequence classifier"),
                       (["chat", str(checkpoint)], "a checkpoint of an objective reward run")):
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_:
            cli(argv)
        err = capsys.readouterr().err
        said = " ".join(err.split())
        assert exit_.value.code == 2 and err.count("hftrain: error") == 1 and "Traceback" not in err, err
        assert f"is a reward model ({what}" in said and "writes no text" in said, said
        assert "Loading weights" not in err  # refused from the folder's small files
        assert ("hftrain merge" in said) == (argv[1] == str(adapter)), said  # an adapter: merge it first


def test_reward_step_is_the_same_over_micro_batches_and_processes(tmp_path, margin_pairs, one_process):
    """4 pairs per step as 1 x 4, 2 micro-batches x 2 and 2 DDP processes x 2: the same losses (margins and
    centering included), statistics, clipped norms and weights."""
    assert one_process.train_rows()[-1]["grad_norm"] > 0.5  # clipping was active
    checks.assert_same_over_micro_batches_and_processes(tmp_path, one_process, margin_pairs, COMPARED, rows=4)


@pytest.mark.parametrize("preset", ["zero3", "fsdp2"])
def test_reward_under_sharded_presets_equals_one_process(tmp_path, margin_pairs, one_process, preset):
    """2 sharded processes x 2 pairs = 1 process x 4 pairs, full fine-tuning: the score head and the body
    partitioned (ZeRO-3) or sharded (FSDP2), the same losses, statistics, clipped norms and gathered final weights."""
    run = launch(tmp_path / "out", *margin_pairs, "--per_device_train_batch_size", "2", preset=preset, processes=2,
                 script=FSDP_LAUNCHER if preset == "fsdp2" else ENTRY)
    assert run.state()["launch"]["distributed_type"] == ("DEEPSPEED" if preset == "zero3" else "FSDP")
    checks.assert_same_steps(run, one_process, COMPARED)


def test_reward_resumes_exactly(tmp_path, margin_pairs, one_process):
    """Resumed from checkpoint-2, step 3 and the final weights equal the uninterrupted run's."""
    checks.assert_resumes_exactly(tmp_path, one_process, [*margin_pairs, "--per_device_train_batch_size", "4"],
                                  COMPARED)


def test_reward_data_without_rejected_is_refused_before_the_model_loads(tmp_path):
    pairs = [{"prompt": f"What is {i} + 1?", "chosen": f" {i + 1}."} for i in range(8)]
    run = run_script(tmp_path / "out", "--model_name_or_path", str(REPO / "models" / "tiny-llama"), "--dataset_name",
                     str(write_jsonl(tmp_path / "pairs.jsonl", pairs)), "--objective", "reward", check=False)
    said = " ".join(run.stderr.split())
    assert run.returncode != 0 and "Traceback" not in run.stderr and "Loading weights" not in run.stderr
    assert "(dpo, simpo, orpo, reward) needs both a chosen and a rejected column, this one has only chosen" in said
