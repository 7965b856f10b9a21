"""hftrain.card on hand-made run files (no training): the hub metadata each kind of folder gets, what the body takes
from the run files and metrics, and what it must leave out. The cards of real runs are checked where e2e tests already
produce them (tests/model_cards.py: a full fine-tune, each adapter method, merges, a pushed run)."""

from __future__ import annotations

import json

import yaml
from huggingface_hub import ModelCard

from hftrain.card import build_card, merged_card, recipe_settings, run_card, shipped_model, write_card
from hftrain.config import DEFAULT_MODEL, Recipe
from tests.conftest import REPO

STATE = {
    "progress": {"step": 6, "epoch": 0, "trained_tokens": 1234},
    "model": {"method": "lora", "trainable_parameters": 100, "parameters": 1000},
    "parallelism": {"name": "DDP", "processes": 2, "dp_world": 2},
    "launch": {"device": "cpu", "mixed_precision": "no"},
    "effective_batch_size": 8,
    "data": {"sources": [{"name": "org/chat-data"}]},
    "versions": {"hftrain": "0.1.0", "torch": "2.13.0"},
}


def recipe(**changes) -> dict:
    return {**Recipe().to_record(), **changes}


def test_adapter_card_metadata_and_body(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    (base / "README.md").write_text("---\nlicense: apache-2.0\n---\n# base\n")
    rows = [{"step": 5, "epoch": 0.5, "loss": 2.0}, {"step": 6, "epoch": 0.6, "loss": 1.5},
            {"step": 6, "eval_loss": 1.75, "eval_perplexity": 5.75}]
    r = recipe(model_name_or_path=str(base), use_peft=True, load_in_4bit=True, lora_r=8, lora_alpha=16,
               dataset_name="org/chat-data", eval_dataset_name="data/eval.jsonl", hub_token="hf_secret_value_123")
    card, figure = build_card(tmp_path, r, STATE, rows, kind="adapter", device_hours=0.25, name="org/m",
                              load_from="org/m")
    data = card.data.to_dict()
    assert "base_model" not in data and data["library_name"] == "peft"  # a local folder: the hub takes only ids
    assert f"This is a peft adapter of the local model `{base.resolve()}`" in card.text
    assert '`PeftModel.from_pretrained(base, "org/m")`' in card.text  # its adapter_config names a local path
    assert data["tags"] == ["hftrain", "sft", "qlora"] and data["datasets"] == ["org/chat-data"]
    assert data["license"] == "apache-2.0" and data["pipeline_tag"] == "text-generation"
    text = card.text
    assert "LoRA adapters (r=8, alpha=16) on all-linear over a nf4 4-bit quantized base" in text
    assert "| strategy | DDP, 2 processes on cpu |" in text and "| tokens trained | 1,234 |" in text
    assert "| steps | 6 optimizer steps (0.6 epochs) |" in text
    assert "8 examples per step (8 per device x 2 data-parallel x 1 accumulation)" in text
    assert "| train loss | 1.5 (logged at step 6) |" in text and "| eval loss | 1.75 (after step 6) |" in text
    assert "| device-hours | 0.25 |" in text and figure == "loss.png"
    assert 'AutoPeftModelForCausalLM.from_pretrained("org/m")' in text
    assert "hf_secret" not in text and "hub_token" not in text
    settings = yaml.safe_load(text.split("```yaml\n")[1].split("```")[0])
    assert settings["lora_r"] == 8 and "learning_rate" not in settings  # only what differs from the defaults


def test_base_model_is_a_hub_id_or_absent(tmp_path):
    """The hub refuses a card whose base_model is not a repo id (tests/hub_server.py checks pushed cards the same
    way): a hub id is named as given, a folder inside a hub cache by its repo (read from the cache layout, as
    huggingface_hub's scan_cache does), any other folder only in the body."""
    snapshot = tmp_path / "hub" / "models--Org--Some-Model-1.5B" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    elsewhere = tmp_path / "models" / "mine"
    elsewhere.mkdir(parents=True)
    expected = {"Org/Some-Model-1.5B": "Org/Some-Model-1.5B", str(snapshot): "Org/Some-Model-1.5B",
                str(elsewhere): None, str(tmp_path / "gone" / "model"): None}
    for base, hub_id in expected.items():
        card, _ = build_card(tmp_path, recipe(model_name_or_path=base), STATE, [], kind="model", device_hours=None,
                             name="run")
        assert card.data.to_dict().get("base_model") == hub_id, base
        if hub_id is not None:
            assert f"[{hub_id}](https://huggingface.co/{hub_id})" in card.text
    card, _ = build_card(tmp_path, recipe(model_name_or_path=str(snapshot), use_peft=True), STATE, [],
                         kind="adapter", device_hours=None, name="org/m", load_from="org/m")
    assert f"[Org/Some-Model-1.5B](https://huggingface.co/Org/Some-Model-1.5B) (the local copy `{snapshot}`)" in \
        card.text and "PeftModel.from_pretrained(base" in card.text  # adapter_config names the snapshot's path


def test_grpo_rewards_and_a_final_step_without_evaluation(tmp_path):
    rows = [{"step": 4, "loss": 0.1, "reward": 0.5, "reward_std": 0.25}, {"step": 2, "eval_loss": 3.0},
            {"step": 4, "eval_reward": 0.75}]
    card, _ = build_card(tmp_path, recipe(objective="grpo"), {**STATE, "progress": {"step": 4}}, rows, kind="model",
                         device_hours=None, name="run")
    assert "| mean reward | 0.5 (logged at step 4) |" in card.text and "| reward std | 0.25 |" in card.text
    assert "eval loss" not in card.text  # the step-2 evaluation is not the final one
    assert "| eval mean reward | 0.75 |" in card.text  # grpo's evaluation scores completions
    assert card.data.to_dict()["library_name"] == "transformers" and "grpo" in card.data.tags


def results(card: ModelCard) -> list[str]:
    """The rows of the card's results table."""
    table = card.text.split("## Results")[1].split("\n\n")[1]
    return [line for line in table.splitlines() if not line.startswith(("| |", "| ---"))]


def test_a_grpo_cards_headline_is_its_mean_reward_and_its_figure_shows_no_eval_it_has_not(tmp_path):
    """Issue 49: a GRPO card led with a train loss of 9e-08 (its policy-gradient loss is about 0 by construction)
    and showed a "Train and eval loss" picture for a run without eval: the mean reward comes first, from where it
    started, and the figure is the train loss's."""
    rows = [{"step": 1, "loss": 2e-07, "reward": 0.25, "reward_std": 0.1}, {"step": 10, "loss": 5e-08, "reward": 0.5,
                                                                           "reward_std": 0.2},
            {"step": 11, "loss": 9e-08}]  # a step that samples nothing logs no reward
    card, figure = build_card(tmp_path, recipe(objective="grpo"), {**STATE, "progress": {"step": 11}}, rows,
                              kind="model", device_hours=None, name="run")
    shown = results(card)
    assert shown[0] == "| mean reward | 0.5 (logged at step 10; 0.25 at step 1) |"
    assert shown[-1].startswith("| train loss | 9e-08 (logged at step 11); grpo's loss is about 0 by construction")
    assert figure == "loss.png" and "![Train loss](loss.png)" in card.text and "eval loss" not in card.text
    sft = [{"step": 5, "loss": 2.0}, {"step": 6, "loss": 1.5}, {"step": 6, "eval_loss": 1.75}]
    card, _ = build_card(tmp_path, recipe(), STATE, sft, kind="model", device_hours=None, name="run")
    assert results(card)[0].startswith("| train loss | 1.5") and "![Train and eval loss](loss.png)" in card.text


def test_a_reward_cards_metrics_have_one_naming(tmp_path):
    """Issue 49: the reward card showed "accuracy" beside raw eval_accuracy / eval_margin: each metric in words, an
    evaluation's as "eval <words>"."""
    rows = [{"step": 6, "loss": 0.5, "accuracy": 0.75, "margin": 1.25, "mean_reward": 0.1},
            {"step": 6, "eval_loss": 0.625, "eval_accuracy": 0.875, "eval_margin": 0.5, "eval_mean_reward": 0.2}]
    card, _ = build_card(tmp_path, recipe(objective="reward"), STATE, rows, kind="model", device_hours=None,
                         name="run")
    assert results(card) == ["| train loss | 0.5 (logged at step 6) |", "| eval loss | 0.625 (after step 6) |",
                             "| accuracy | 0.75 |", "| eval accuracy | 0.875 |", "| margin | 1.25 |",
                             "| eval margin | 0.5 |"]
    dpo = [{"step": 6, "loss": 0.5, "rewards/accuracies": 0.75, "rewards/margins": 0.25},
           {"step": 6, "eval_loss": 0.625, "eval_rewards/accuracies": 0.5, "eval_rewards/margins": 0.125}]
    card, _ = build_card(tmp_path, recipe(objective="dpo"), STATE, dpo, kind="model", device_hours=None, name="run")
    assert results(card)[2:] == ["| reward accuracy | 0.75 |", "| eval reward accuracy | 0.5 |",
                                 "| reward margin | 0.25 |", "| eval reward margin | 0.125 |"]
    assert "eval_" not in card.text.split("## Results")[1].split("## Recipe")[0]


def test_a_base_model_shipped_with_hftrain_is_named_as_such_not_by_its_path(tmp_path):
    """Issue 49: the card named the tiny model installed with the package by its site-packages path. hftrain's
    shipped models are named so, from the installed package's folder or the checkout's (the same files)."""
    for base in (DEFAULT_MODEL, REPO / "models" / "tiny-llama"):
        for kind in ("model", "adapter"):
            card, _ = build_card(tmp_path, recipe(model_name_or_path=str(base), use_peft=kind == "adapter"), STATE,
                                 [], kind=kind, device_hours=None, name="org/m", load_from="org/m")
            assert "This is a" in card.text and " of hftrain's shipped `tiny-llama` (a tiny model inside the " \
                "hftrain package, hftrain/shipped/models/tiny-llama;" in card.text
            assert str(base) not in card.text and str(base.resolve()) not in card.text
            assert "base_model" not in card.data.to_dict()
    assert shipped_model(str(tmp_path)) is None and shipped_model("org/model") is None


def test_eval_tasks_results_are_in_the_final_results(tmp_path):
    """eval_tasks' lm-eval metrics of the final evaluation (eval/<task>/<metric>, with their stderr) are results,
    also in a run without an eval set (no eval_loss in the row)."""
    rows = [{"step": 6, "loss": 1.5}, {"step": 3, "eval/arc_easy/acc": 0.25},
            {"step": 6, "eval/arc_easy/acc": 0.5, "eval/arc_easy/acc_stderr": 0.125,
             "eval/gsm8k/exact_match,strict-match": 0.75}]
    card, _ = build_card(tmp_path, recipe(eval_tasks=["arc_easy", "gsm8k"]), STATE, rows, kind="model",
                         device_hours=None, name="run")
    assert "| arc_easy acc (lm-eval) | 0.5 ± 0.125 |" in card.text
    assert "| gsm8k exact_match,strict-match (lm-eval) | 0.75 |" in card.text
    assert "0.25" not in card.text  # not the final evaluation


def test_no_metrics_says_so_and_draws_nothing(tmp_path):
    card, figure = build_card(tmp_path, recipe(), STATE, [], kind="model", device_hours=None, name="run")
    assert figure is None and "No metrics.jsonl was found" in card.text and "loss.png" not in card.text


def test_run_card_is_written_atomically_and_parses(tmp_path):
    folder, out = tmp_path / "out" / "final", tmp_path / "out"
    folder.mkdir(parents=True)
    Recipe(output_dir=str(out), hub_token="hf_secret_value_123").dump(folder / "hftrain_config.yaml")
    (folder / "hftrain_state.json").write_text(json.dumps(STATE))
    (out / "metrics.jsonl").write_text('{"step": 5, "loss": 2.0}\n{"step": 6, "loss": 1.5}\n{"step": 6, "lo')
    path = run_card(folder, out, kind="model", device_hours=1.0)
    assert ModelCard.load(path).data.model_name == "out"
    assert sorted(p.name for p in folder.iterdir()) == ["README.md", "hftrain_config.yaml", "hftrain_state.json",
                                                        "loss.png"]
    assert "hf_secret" not in path.read_text() and "hf_secret" not in (folder / "hftrain_config.yaml").read_text()
    (folder / "loss.png").unlink()
    run_card(folder, out, kind="model", device_hours=1.0, curve=False)  # a card the final evaluation rewrites
    assert "loss.png" not in path.read_text() and not (folder / "loss.png").exists()
    write_card(folder, ModelCard("---\ntags: [x]\n---\nnew"), None, [])
    assert ModelCard.load(path).text.strip() == "new"


def test_merged_card_of_an_adapter_from_elsewhere(tmp_path):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}))
    merged = tmp_path / "merged"
    merged.mkdir()
    record = {"adapter": str(adapter), "base_model_name_or_path": "org/base", "merged_into": "full-precision base",
              "dtype": "float32"}
    card = ModelCard.load(merged_card(merged, adapter, record))
    assert card.data.base_model == "org/base" and card.data.tags == ["hftrain", "lora", "merge"]
    assert "not trained by hftrain" in card.text and "None" not in card.text


def test_recipe_settings_leave_out_defaults_and_credentials():
    values = Recipe(learning_rate=1e-3, hub_token="hf_abcdefgh12345").to_dict()
    assert recipe_settings(values) == {"learning_rate": 1e-3}
