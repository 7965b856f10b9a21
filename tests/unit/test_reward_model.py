"""objective reward's pieces against plain PyTorch and its refusals: RewardLoss's loss, gradient and statistics equal
RewardTrainer's formula computed row by row; the recipe and preflight rules; the margin column through the data."""

from __future__ import annotations

import json
import logging

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, LlamaConfig, LlamaForSequenceClassification

from hftrain.config import Recipe, recipe_from_dict
from hftrain.data import IGNORE_INDEX, Collator
from hftrain.data.tokenize import DataSpec, tokenize_dataset
from hftrain.errors import HftrainError
from hftrain.model import load_as_reward_model
from hftrain.objectives.reward import RewardLoss
from hftrain.preflight import reward_model_problems
from tests.conftest import REPO
from tests.unit.test_objectives import VOCAB, pair_batch

PAD = VOCAB  # a pad id no row contains


def tiny_scorer(seed: int) -> LlamaForSequenceClassification:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB + 1, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, num_labels=1,
                         pad_token_id=PAD)
    model = LlamaForSequenceClassification(config).eval()
    torch.nn.init.normal_(model.score.weight, std=0.5)  # rewards far enough apart for the statistics to mean much
    return model


def padded_pairs(pairs: int) -> tuple[dict[str, torch.Tensor], list[int]]:
    """`pair_batch`'s rows padded with PAD, and each row's real length."""
    batch = pair_batch(pairs)
    lengths = [int((row != IGNORE_INDEX).nonzero().max()) + 1 for row in batch["labels"]]
    for row, length in zip(batch["input_ids"], lengths):
        row[length:] = PAD
    return batch, lengths


def plain_reward_loss(model, batch, lengths, margin, center) -> dict[str, torch.Tensor]:
    """RewardTrainer's compute_loss written out: each row alone, unpadded, scored at its last token; the mean over
    pairs of -log sigmoid(r_c - r_r - m) + center x (r_c + r_r)^2."""
    scores = torch.stack([model(input_ids=ids[:n][None]).logits[0, 0] for ids, n in zip(batch["input_ids"], lengths)])
    half = len(scores) // 2
    chosen, rejected = scores[:half], scores[half:]
    loss = -F.logsigmoid(chosen - rejected - margin).mean() + center * ((chosen + rejected) ** 2).mean()
    return {"loss": loss, "accuracy": (chosen > rejected).float().mean(), "margin": (chosen - rejected).mean(),
            "mean_reward": scores.mean()}


def test_reward_loss_gradient_and_statistics_equal_the_formula_over_two_micro_batches():
    """RewardLoss over micro-batches of 1 and 2 pairs, summed and divided by the step's 3 pairs, gives the loss,
    gradient and TRL-named statistics of the formula over all 3 pairs at once (margins and centering included)."""
    model = tiny_scorer(0)
    whole, lengths = padded_pairs(3)
    margin, center = torch.tensor([0.0, 0.5, -0.25]), 0.01
    expected = plain_reward_loss(model, whole, lengths, margin, center)
    expected["loss"].backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    module = RewardLoss(model, Recipe(objective="reward", center_rewards_coefficient=center)).train()
    first = {k: torch.cat([v[:1], v[3:4]]) for k, v in whole.items()} | {"margin": margin[:1]}
    second = {k: torch.cat([v[1:3], v[4:6]]) for k, v in whole.items()} | {"margin": margin[1:]}
    assert module.loss_units(first) + module.loss_units(second) == 3
    loss = sum(module(**b) for b in (first, second)) / 3
    loss.backward()
    torch.testing.assert_close(loss, expected["loss"], rtol=1e-5, atol=1e-6)
    for a, p in zip(grads, model.parameters()):
        torch.testing.assert_close(p.grad, a, rtol=1e-4, atol=1e-6)
    stats = module.pop_stats()
    assert 0 < float(stats["accuracy"]) < 3  # both kinds of pair: the accuracy compares something
    for name in ("accuracy", "margin", "mean_reward"):
        torch.testing.assert_close(stats[name].float() / 3, expected[name].detach(), rtol=1e-5, atol=1e-6, msg=name)


def test_a_filler_pair_counts_neither_in_the_loss_nor_the_statistics():
    """An empty micro-batch's filler pair (one pad token, no trained label): no loss, no unit, no statistic."""
    model = tiny_scorer(1)
    module = RewardLoss(model, Recipe(objective="reward"))
    filler = {"input_ids": torch.full((2, 1), PAD), "labels": torch.full((2, 1), IGNORE_INDEX)}
    assert module(**filler).item() == 0 and module.loss_units(filler) == 0
    assert all(float(v) == 0 for v in module.pop_stats().values())


@pytest.mark.parametrize("fields, message", [
    ({"objective": "dpo", "center_rewards_coefficient": 0.01}, "center_rewards_coefficient=0.01 is objective reward's"),
    ({"objective": "reward", "center_rewards_coefficient": -1.0}, "center_rewards_coefficient must be >= 0"),
    ({"objective": "reward", "beta": 0.5}, "beta=0.5 has no meaning for objective reward"),
    ({"objective": "reward", "log_completions": True}, "a reward model .objective reward. writes no text"),
    ({"objective": "reward", "eval_tasks": ["arc_easy"]}, "remove eval_tasks"),
    ({"objective": "reward", "packing": True}, "packing with objective=reward is refused"),
    ({"objective": "reward", "streaming": True}, "streaming: true with objective reward is not supported yet"),
])
def test_reward_recipe_refusals(fields, message):
    with pytest.raises(HftrainError, match=message):
        recipe_from_dict(fields, for_training=False)


def test_a_base_without_a_sequence_classification_class_is_refused():
    """The image-text tiny model (llava) has no AutoModelForSequenceClassification class: one paragraph naming it;
    the tiny causal LM (llama) has one."""
    recipe = Recipe(objective="reward", model_name_or_path=str(REPO / "models" / "tiny-vlm"))
    (problem,) = reward_model_problems(recipe, AutoConfig.from_pretrained(REPO / "models" / "tiny-vlm"))
    assert "no sequence-classification class for model type 'llava'" in problem
    assert reward_model_problems(recipe, AutoConfig.from_pretrained(REPO / "models" / "tiny-llama")) == []
    assert reward_model_problems(Recipe(objective="dpo"), AutoConfig.from_pretrained(REPO / "models" / "tiny-vlm")) \
        == []


def pairs_dataset(tmp_path, rows):
    import datasets

    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return datasets.load_dataset("json", data_files=str(path), split="train")


def test_the_margin_column_reaches_the_batch_for_reward_only(tmp_path):
    """objective reward keeps each pair's margin through tokenization and collation, in the pairs' order; dpo drops
    the column; a margin that is not a number names its example."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(REPO / "models" / "tiny-llama")
    rows = [{"prompt": f"Q{i}?", "chosen": f" yes {i}", "rejected": " no", "margin": i / 2} for i in range(4)]
    raw = pairs_dataset(tmp_path, rows)
    for objective, kept in (("reward", True), ("dpo", False)):
        spec = DataSpec.from_recipe(Recipe(objective=objective))
        data, _ = tokenize_dataset(raw, tokenizer, spec, "preference", "pairs")
        assert ("margin" in data.column_names) == kept
    batch = Collator(data if False else tokenize_dataset(raw, tokenizer, DataSpec.from_recipe(
        Recipe(objective="reward")), "preference", "pairs")[0], 0)([3, 1])
    assert batch["margin"].tolist() == [1.5, 0.5] and len(batch["input_ids"]) == 4
    bad = pairs_dataset(tmp_path, [{**rows[0], "margin": "high"}])
    with pytest.raises(HftrainError, match="pairs example 0: margin must be a number"):
        tokenize_dataset(bad, tokenizer, DataSpec.from_recipe(Recipe(objective="reward")), "preference", "pairs")


def test_a_reward_model_folder_is_a_grpo_reward_function(tmp_path):
    """A sequence-classification folder in reward_funcs scores prompt + completion as TRL's GRPOTrainer does with a
    model: the chat-template rendering of each conversation scored alone (no padding) equals the batched call; a
    causal-LM folder and an adapter folder are refused with what they are."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from hftrain.rl.rewards import load_reward_functions, score

    tiny = REPO / "models" / "tiny-llama"
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(tiny, num_labels=1)
    torch.nn.init.normal_(model.score.weight, std=0.5)
    folder = tmp_path / "rm" / "final"
    model.save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    tokenizer.save_pretrained(folder)
    (adapter := tmp_path / "adapter").mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    funcs, problems = load_reward_functions([str(folder), str(tiny), str(adapter)])
    assert [f.name for f in funcs] == ["rm"]
    assert "is a LlamaForCausalLM, not a reward model" in problems[0]
    assert "is a LoRA adapter" in problems[1] and len(problems) == 2
    prompts = [[{"role": "user", "content": "What is 2 + 2?"}]] * 2
    completions = [[{"role": "assistant", "content": "4."}], [{"role": "assistant", "content": "It is 5, I think."}]]
    got = score(funcs, prompts, completions, [[1], [1]], {})[:, 0]
    with torch.no_grad():
        expected = [model(input_ids=torch.tensor([tokenizer.apply_chat_template(p + c, tokenize=True,
                                                                                 return_dict=True)["input_ids"]]))
                    .logits[0, 0] for p, c in zip(prompts, completions)]
    torch.testing.assert_close(got, torch.stack(expected), rtol=1e-5, atol=1e-6)
    assert got[0] != got[1]


def test_the_estimate_counts_a_reward_models_score_head_and_no_vocabulary_logits():
    """--objective reward: the parameters of the model hftrain trains (the real AutoModelForSequenceClassification),
    a hidden -> 1 head in place of the vocabulary head, and activations without the loss's vocabulary logits."""
    from transformers import AutoModelForSequenceClassification

    from hftrain.estimate import estimate, model_shape

    tiny = str(REPO / "models" / "tiny-llama")
    config = AutoConfig.from_pretrained(tiny)
    vocab, hidden = config.vocab_size, config.hidden_size
    lm, rm = model_shape(tiny), model_shape(tiny, reward=True)
    built = AutoModelForSequenceClassification.from_pretrained(tiny, num_labels=1)
    assert rm.params == sum(p.numel() for p in built.parameters()) == lm.params - vocab * hidden + hidden
    assert (rm.head_params, rm.architecture) == (hidden, "LlamaForSequenceClassification")
    as_lm, as_rm = (estimate(shape, 1, 4, 128, "fp32", objective="reward").rows[0] for shape in (lm, rm))
    assert as_lm.activations - as_rm.activations == 2 * 4 * 128 * (vocab - 1) * 12  # 4 pairs: 8 rows
    assert as_rm.weights == 4 * rm.params


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_the_load_report_is_printed_only_when_it_says_more_than_the_head_swap(tmp_path):
    """A causal LM's folder loaded as a reward model: transformers' report of the new score head (MISSING) and the
    unused lm_head (UNEXPECTED) is what objective reward means, so it is held back; a folder that also lacks a body
    weight gets the report, and the weights load the same either way."""
    from safetensors.torch import load_file, save_file
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB + 1, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    whole, lacking = tmp_path / "whole", tmp_path / "lacking"
    lm = LlamaForCausalLM(config)
    lm.save_pretrained(whole)
    lm.save_pretrained(lacking)
    weights = load_file(lacking / "model.safetensors")
    del weights["model.norm.weight"]
    save_file(weights, lacking / "model.safetensors", metadata={"format": "pt"})

    records = _Records()
    logger = logging.getLogger("transformers.modeling_utils")
    logger.addHandler(records)
    try:
        quiet = load_as_reward_model(str(whole), num_labels=1)
        assert not any("LOAD REPORT" in message for message in records.messages)
        load_as_reward_model(str(lacking), num_labels=1)
        reports = [message for message in records.messages if "LOAD REPORT" in message]
    finally:
        logger.removeHandler(records)
    assert len(reports) == 1 and "model.norm.weight" in reports[0] and "score.weight" in reports[0]
    assert torch.equal(quiet.model.layers[0].mlp.up_proj.weight, lm.model.layers[0].mlp.up_proj.weight)
    assert quiet.score.weight.shape == (1, 32)
