"""A TRL recipe moves over (issue 14 item 4): the non-default fields of a real `trl.SFTConfig` are mapped onto
Recipe fields when hftrain has their meaning and refused with the reason otherwise; none is ignored."""

from __future__ import annotations

import warnings

import pytest
from transformers import TrainingArguments

from hftrain.config import FIELDS, recipe_from_dict
from hftrain.errors import ConfigError
from hftrain.from_trl import MAPPED, REFUSED

# TrainingArguments' name for it: activation_checkpointing from transformers 5.23, gradient_checkpointing before
CHECKPOINTING_FIELD = next(name for name in ("activation_checkpointing", "gradient_checkpointing")
                           if name in TrainingArguments.__dataclass_fields__)
ACCEPTED = dict(
    learning_rate=1e-4, num_train_epochs=2, per_device_train_batch_size=4, gradient_accumulation_steps=2,
    lr_scheduler_type="cosine", warmup_steps=0.1, logging_steps=5, logging_first_step=True, seed=3, data_seed=7,
    eval_strategy="epoch", save_strategy="no", shuffle_dataset=True, max_length=256, packing=True,
    **{CHECKPOINTING_FIELD: False}, gradient_checkpointing_kwargs={"use_reentrant": False}, project="tulu",
    model_init_kwargs={"dtype": "bfloat16", "attn_implementation": "sdpa", "revision": "v1.0"},
    assistant_only_loss=True, dataset_text_field="body", max_grad_norm=0.5, weight_decay=0.01,
)
REFUSED_HERE = dict(
    neftune_noise_alpha=5.0, label_smoothing_factor=0.1, hub_always_push=True, packing_strategy="wrapped",
    save_only_model=True, tf32=False, eval_on_start=True, dataloader_drop_last=True, padding_free=True,
    lr_scheduler_kwargs={"min_lr": 1e-6},
)


def sft_config(**kw):
    import trl

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trl.SFTConfig(output_dir="out", use_cpu=True, bf16=False, **kw)


def non_default(config, default) -> dict:
    """The fields a user set: those that differ from a default SFTConfig, as TRL writes them out (to_dict)."""
    mine, base = config.to_dict(), default.to_dict()
    return {k: v for k, v in mine.items() if v != base[k]}


@pytest.fixture(scope="module")
def default():
    return sft_config()


def test_non_default_sft_fields_map_onto_the_recipe(tmp_path, default):
    values = non_default(sft_config(**ACCEPTED), default)
    assert set(ACCEPTED) <= set(values)  # each value set is one TRL would not use by default
    values["output_dir"] = str(tmp_path / "out")
    recipe = recipe_from_dict(values, for_training=False)
    assert (recipe.learning_rate, recipe.num_train_epochs, recipe.lr_scheduler_type) == (1e-4, 2, "cosine")
    assert recipe.warmup_ratio == 0.1 and recipe.warmup_steps == 0  # transformers 5 reads warmup_steps < 1 as a ratio
    assert (recipe.seed, recipe.data_seed, recipe.order_seed) == (3, 7, 7)
    assert (recipe.eval_strategy, recipe.save_strategy) == ("epoch", "no")
    assert recipe.train_sampling_strategy == "random"
    assert recipe.gradient_checkpointing is False
    assert (recipe.dtype, recipe.attn_implementation, recipe.model_revision) == ("bfloat16", "sdpa", "v1.0")
    assert recipe.project_name == "tulu" and recipe.dataset_text_field == "body"
    assert (recipe.max_length, recipe.packing, recipe.max_grad_norm, recipe.weight_decay) == (256, True, 0.5, 0.01)


def test_every_non_default_field_is_mapped_or_refused_by_name(tmp_path, default):
    values = non_default(sft_config(**ACCEPTED, **REFUSED_HERE), default)
    values["output_dir"] = str(tmp_path / "out")
    with pytest.raises(ConfigError) as info:
        recipe_from_dict(values, for_training=False)
    problems = info.value.problems
    for name in REFUSED_HERE:
        (problem,) = [p for p in problems if p.startswith(name)]
        assert "not accepted: " in problem and "hftrain" in problem.split("not accepted: ")[1], problem
    assert len(problems) == len(REFUSED_HERE), problems  # the accepted ones raised nothing


def test_all_sft_config_fields_are_known():
    """Every field of TRL 1.16's SFTConfig is a Recipe field, translated, or refused with a reason: no unknowns."""
    import dataclasses

    import trl

    names = {f.name for f in dataclasses.fields(trl.SFTConfig)}
    unknown = names - set(FIELDS) - set(MAPPED) - set(REFUSED)
    assert not unknown, sorted(unknown)


@pytest.mark.parametrize("values, message", [
    ({"model_init_kwargs": {"device_map": "auto"}}, "'device_map' (hftrain places the model"),
    ({"model_init_kwargs": {"torch_dtype": "auto"}}, "dtype 'auto'"),
    ({"shuffle_dataset": True, "train_sampling_strategy": "sequential"}, "keep one"),
    ({"eval_strategy": "epoch", "eval_steps": 5}, "eval_steps=5 applies to eval_strategy=steps"),
    ({"save_strategy": "best"}, "save_strategy"),
])
def test_contradictions_and_unmappable_values_are_one_paragraph_problems(tmp_path, values, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        recipe_from_dict({**values, "output_dir": str(tmp_path)}, for_training=False)


def test_output_router_logits_false_turns_the_router_loss_off(tmp_path):
    for values in ({"output_router_logits": False}, {"model_init_kwargs": {"output_router_logits": False}}):
        recipe = recipe_from_dict({**values, "output_dir": str(tmp_path)}, for_training=False)
        assert recipe.router_aux_loss_coef == 0.0
    assert recipe_from_dict({"output_router_logits": True, "output_dir": str(tmp_path)},
                            for_training=False).router_aux_loss_coef is None  # the model config's coefficient


def test_trl_cli_model_and_script_fields(tmp_path):
    """TRL's CLI dataclasses (ModelConfig, ScriptArguments): the real field names, mapped or refused by name."""
    import trl

    model_fields = set(trl.ModelConfig.__dataclass_fields__)
    script_fields = set(trl.ScriptArguments.__dataclass_fields__)
    assert {"lora_modules_to_save", "use_bnb_nested_quant", "lora_task_type", "lora_target_parameters"} <= model_fields
    assert {"dataset_test_split", "dataset_streaming", "ignore_bias_buffers"} <= script_fields
    recipe = recipe_from_dict({"use_peft": True, "lora_modules_to_save": ["lm_head"], "use_bnb_nested_quant": True,
                               "lora_task_type": "CAUSAL_LM", "dataset_streaming": False,
                               "ignore_bias_buffers": False, "output_dir": str(tmp_path)}, for_training=False)
    assert recipe.modules_to_save == ["lm_head"] and recipe.bnb_4bit_use_double_quant is True
    with pytest.raises(ConfigError) as refused:
        recipe_from_dict({"dataset_test_split": "test", "lora_target_parameters": ["experts.gate_up_proj"],
                          "lora_task_type": "SEQ_CLS", "dataset_streaming": True, "output_dir": str(tmp_path)},
                         for_training=False)
    text = " ".join(str(refused.value).split())
    for part in ("dataset_test_split (a TRL/TrainingArguments field) is not accepted: hftrain evaluates on "
                 "eval_dataset_name", "lora_target_parameters (a TRL/TrainingArguments field)",
                 "lora_task_type='SEQ_CLS'", "dataset_streaming=True"):
        assert part in text, part


def test_trl_grpo_rloo_and_async_field_names(tmp_path):
    """GRPOConfig's cispo / sapo settings, RLOOConfig's normalize_advantages and AsyncGRPOConfig's pipeline fields:
    the real TRL 1.16 names, with their defaults, are the recipe's."""
    import trl
    from trl.experimental.async_grpo import AsyncGRPOConfig

    grpo, rloo, asynchronous = (trl.GRPOConfig.__dataclass_fields__, trl.RLOOConfig.__dataclass_fields__,
                                AsyncGRPOConfig.__dataclass_fields__)
    for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
        assert grpo[name].default == FIELDS[name].default
    assert rloo["normalize_advantages"].default == FIELDS["normalize_advantages"].default
    for name in ("max_staleness", "weight_sync_steps", "max_inflight_tasks", "vllm_server_base_url",
                 "vllm_server_timeout", "request_timeout"):
        assert asynchronous[name].default == FIELDS[name].default, name
    recipe = recipe_from_dict({"objective": "grpo", "reward_funcs": ["hftrain.rl.example_rewards.vowel_share"],
                               "dataset_name": "data/prompt_completion.jsonl", "loss_type": "sapo",
                               "sapo_temperature_neg": 1.2, "output_dir": str(tmp_path)}, for_training=False)
    assert (recipe.loss_type, recipe.sapo_temperature_neg) == ("sapo", 1.2)
    with pytest.raises(ConfigError, match="loss_type='luspo'.*TRL's luspo and vespo are not written"):
        recipe_from_dict({"objective": "grpo", "reward_funcs": ["hftrain.rl.example_rewards.vowel_share"],
                          "loss_type": "luspo", "output_dir": str(tmp_path)}, for_training=False)
