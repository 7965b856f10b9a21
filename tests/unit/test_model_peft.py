"""LoRA / DoRA / QLoRA: recipe validation, launch rules and what the builders really produce (tiny model)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from hftrain.config import (
    Recipe,
    load_recipe,
    peft_problems,
    recipe_from_dict,
    recipe_subset,
)
from hftrain.errors import ConfigError, HftrainError
from hftrain.model import build_model, model_summary
from hftrain.objectives.sft import CausalLMTokenLoss
from tests.conftest import REPO

MODEL = REPO / "models" / "tiny-llama"
CHAT = REPO / "data" / "chat.jsonl"
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def valid(tmp_path: Path, **values) -> dict:
    return {"model_name_or_path": str(MODEL), "dataset_name": str(CHAT), "output_dir": str(tmp_path / "out"),
            **values}


def recipe(**values) -> Recipe:
    return Recipe(model_name_or_path=str(MODEL), use_peft=True, lora_r=4, lora_alpha=8, **values)


# ----------------------------------------------------------------------------- validation
def test_defaults_follow_trl_and_peft():
    r = Recipe()
    assert (r.use_peft, r.lora_r, r.lora_alpha, r.lora_dropout) == (False, 16, 32, 0.05)
    assert r.lora_target_modules == ["all-linear"] and r.modules_to_save == []
    assert (r.load_in_4bit, r.load_in_8bit, r.bnb_4bit_quant_type, r.bnb_4bit_quant_storage) == (False, False, "nf4",
                                                                                                  "uint8")
    assert peft_problems(r) == []


def test_every_peft_problem_reported_at_once(tmp_path):
    with pytest.raises(ConfigError) as info:
        recipe_from_dict(valid(tmp_path, use_peft=True, lora_r=0, lora_alpha=0, lora_dropout=1.0,
                               lora_target_modules=["all-linear", "q_proj"], load_in_4bit=True, load_in_8bit=True,
                               bnb_4bit_quant_type="int4", optim="adam8"))
    problems = info.value.problems
    assert len(problems) == 7, problems
    for text in ("lora_r must be >= 1", "lora_alpha must be > 0", "lora_dropout must be in [0, 1)",
                 "mixes all-linear with layer names", "load_in_4bit and load_in_8bit are both true",
                 "bnb_4bit_quant_type='int4' is not one of: nf4, fp4", "optim='adam8'"):
        assert any(text in p for p in problems), text


def test_adapter_switches_without_use_peft_are_refused(tmp_path):
    with pytest.raises(ConfigError) as info:
        recipe_from_dict(valid(tmp_path, load_in_4bit=True, use_dora=True, modules_to_save=["lm_head"]))
    (problem,) = info.value.problems
    assert "use_dora, load_in_4bit, modules_to_save only apply to adapter training" in problem
    assert "quantized weights cannot be trained directly" in problem and "use_peft: true" in problem
    # LoRA hyperparameters alone do not block a full fine-tune: the same recipe flips with use_peft
    assert recipe_from_dict(valid(tmp_path, lora_r=64, lora_alpha=16)).use_peft is False


def test_empty_target_modules_refused():
    problems = peft_problems(recipe(lora_target_modules=[]))
    assert problems == ["lora_target_modules is empty; use all-linear or name the layers (q_proj,v_proj,...)"]


def test_cli_lists_and_flags(tmp_path):
    r = load_recipe(["--model_name_or_path", str(MODEL), "--dataset_name", str(CHAT), "--output_dir",
                     str(tmp_path / "o"), "--use_peft", "--lora_target_modules", "q_proj,v_proj", "--load_in_4bit",
                     "--modules_to_save", "lm_head", "--bnb_4bit_compute_dtype", "bfloat16"])
    assert r.lora_target_modules == ["q_proj", "v_proj"] and r.modules_to_save == ["lm_head"]
    assert r.use_peft and r.load_in_4bit and r.bnb_4bit_compute_dtype == "bfloat16"


def test_recipe_subset_skips_path_validation(tmp_path):
    values = {"model_name_or_path": str(MODEL), "load_in_4bit": "true", "output_dir": str(tmp_path), "bf16": True}
    r = recipe_subset(values, ("model_name_or_path", "load_in_4bit"), source="x")
    assert r.load_in_4bit is True and r.bf16 is False and r.output_dir == Recipe().output_dir


# ------------------------------------------------------------------------------- builders
def linear_shapes() -> dict[str, tuple[int, int]]:
    """(in, out) of every linear layer LoRA targets, read from the base model itself."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(MODEL)
    return {name: (m.in_features, m.out_features) for name, m in base.named_modules()
            if isinstance(m, nn.Linear) and name.split(".")[-1] in TARGETS}


def test_full_builder_trains_everything():
    model = build_model(Recipe(model_name_or_path=str(MODEL)))
    summary = model_summary(model)
    assert summary["method"] == "full" and summary["quantized_linear_layers"] == {}
    assert summary["trainable_parameters"] == summary["parameters"] == sum(p.numel() for p in model.parameters())


def test_lora_builder_trains_only_adapters():
    model = build_model(recipe())
    shapes = linear_shapes()
    assert len(shapes) == 14
    expected = sum(4 * (i + o) for i, o in shapes.values())  # A: r x in, B: out x r
    summary = model_summary(model)
    assert summary["method"] == "lora" and summary["trainable_parameters"] == expected
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    assert model.peft_config["default"].base_model_name_or_path == str(MODEL.resolve())


def test_dora_adds_a_magnitude_per_output_feature():
    summary = model_summary(build_model(recipe(use_dora=True)))
    shapes = linear_shapes()
    assert summary["method"] == "dora"
    assert summary["trainable_parameters"] == sum(4 * (i + o) + o for i, o in shapes.values())


def test_named_targets_and_modules_to_save():
    model = build_model(recipe(lora_target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"]))
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert {n.split(".lora_")[0].split(".")[-1] for n in trained if ".lora_" in n} == {"q_proj", "v_proj"}
    assert any("lm_head.modules_to_save" in n for n in trained)


def test_unknown_target_module_is_a_clear_error():
    with pytest.raises(HftrainError, match="cannot add LoRA adapters .* Check lora_target_modules"):
        build_model(recipe(lora_target_modules=["no_such_proj"]))


def test_qlora_builder_follows_peft_recipe():
    model = build_model(recipe(load_in_4bit=True, bnb_4bit_use_double_quant=True, bnb_4bit_quant_type="fp4",
                               dtype="bfloat16", gradient_checkpointing=True))
    import bitsandbytes as bnb

    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(layers) == 14
    state = layers[0].weight.quant_state
    assert state.quant_type == "fp4" and state.nested  # double quantization
    assert layers[0].weight.dtype == torch.uint8
    summary = model_summary(model)
    assert summary["quantized_linear_layers"] == {"Linear4bit": 14}
    full = sum(p.numel() for p in build_model(Recipe(model_name_or_path=str(MODEL))).parameters())
    assert summary["parameters"] - summary["trainable_parameters"] == full  # 4-bit weights counted unpacked
    # LoRA weights in fp32 although the base was loaded in bf16; non-quantized base weights upcast to fp32
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert p.dtype == torch.float32, name
        elif p.dtype != torch.uint8:
            assert p.dtype == torch.float32, name
    assert model.base_model.model.is_gradient_checkpointing


def test_evaluation_does_not_change_qlora_training_numerics(tmp_path):
    """bitsandbytes repacks 4-bit weights for a bf16 kernel at an eval forward on AVX512-BF16 CPUs (as CI's), and
    fails on layers whose width is not a multiple of 64 (issue 17: an MLP of 80 raised "shape '[64, 2]' is invalid"
    in the final evaluation). The builder keeps the training layout: evaluation works at any width, and the loss
    after an evaluation equals the loss before it."""
    import bitsandbytes as bnb
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(MODEL)
    config.intermediate_size = 80
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    torch.manual_seed(0)
    model = build_model(Recipe(model_name_or_path=str(tmp_path), tokenizer_name_or_path=str(MODEL), use_peft=True,
                               lora_r=4, lora_alpha=8, load_in_4bit=True, lora_dropout=0.0))
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    model.train()
    before = model(input_ids=ids, labels=ids).loss.item()
    model.eval()
    with torch.no_grad():
        model(input_ids=ids, labels=ids)
    model.train()
    after = model(input_ids=ids, labels=ids).loss.item()
    assert after == before
    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert not any(getattr(m.weight.quant_state, "packing_format_for_cpu", False) for m in layers)


def test_qlora_with_float_storage_keeps_one_dtype_for_fsdp():
    model = build_model(recipe(load_in_4bit=True, dtype="bfloat16", bnb_4bit_quant_storage="bfloat16"))
    frozen = {p.dtype for p in model.parameters() if not p.requires_grad}
    assert frozen == {torch.bfloat16}  # packed 4-bit weights included: no fp32 upcast
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
    assert model_summary(model)["quantized_linear_layers"] == {"Linear4bit": 14}


def test_the_start_up_model_state_counts_the_weights_as_stored():
    """The start-up line's model state (`Backend.memory`, on `parameter_counts` of the live model) counts each weight
    in the bytes it is stored in, by hand from the layer shapes: a bf16 base with LoRA adapters in fp32 beside it
    (peft's autocast_adapter_dtype); a QLoRA base's packed nf4 weights with their double-quantized absmax (8 bits
    per 64 weights, fp32 per 256 blocks), every other base weight upcast to fp32."""
    from transformers import AutoModelForCausalLM

    from hftrain.memory import ParameterCounts
    from hftrain.parallel.base import Backend
    from tests.unit.parallel.conftest import fake_accelerator

    shapes = linear_shapes()
    adapters = sum(4 * (i + o) for i, o in shapes.values())
    base = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(MODEL).parameters())
    others = base - sum(i * o for i, o in shapes.values())  # embeddings, norms, head
    lora = recipe(dtype="bfloat16")
    counts = Backend(fake_accelerator(), lora).parameter_counts(build_model(lora))
    assert counts == ParameterCounts(adapters, base + adapters, 4 * adapters, 2 * base + 4 * adapters)
    memory = Backend(fake_accelerator(), lora).memory(counts)
    assert memory["per_device_bytes"] == 2 * base + 4 * adapters + 4 * adapters + 8 * adapters  # + grads, AdamW

    qlora = recipe(dtype="bfloat16", load_in_4bit=True, bnb_4bit_use_double_quant=True)
    counts = Backend(fake_accelerator(), qlora).parameter_counts(build_model(qlora))
    nf4 = sum(i * o // 2 + i * o // 64 + 4 * -(-(i * o // 64) // 256) for i, o in shapes.values())
    assert counts == ParameterCounts(adapters, base + adapters, 4 * adapters, nf4 + 4 * others + 4 * adapters)


def test_8bit_builder():
    model = build_model(recipe(load_in_8bit=True))
    assert model_summary(model)["quantized_linear_layers"] == {"Linear8bitLt": 14}


@pytest.mark.parametrize("values", [{}, {"use_dora": True}, {"load_in_4bit": True}, {"load_in_8bit": True},
                                    {"modules_to_save": ["lm_head"]}])
def test_token_loss_on_peft_models_equals_the_models_own_loss(values):
    """CausalLMTokenLoss calls get_decoder()/get_output_embeddings() directly: through peft and bnb layers it must
    give the model's own loss (sum = mean x tokens) and gradients for the adapters only."""
    lm = build_model(recipe(lora_dropout=0.0, **values))
    for name, p in lm.named_parameters():  # non-zero B so the adapters change the function
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    wrapped = CausalLMTokenLoss(lm)
    torch.manual_seed(0)
    ids = torch.randint(0, 600, (3, 12))
    labels = ids.clone()
    labels[:, :4] = -100
    labels[2, 9:] = -100
    loss_sum = wrapped(input_ids=ids, labels=labels)
    tokens = (labels[:, 1:] != -100).sum()
    with torch.no_grad():
        reference = lm(input_ids=ids, labels=labels).loss * tokens
    torch.testing.assert_close(loss_sum.detach(), reference, rtol=2e-5, atol=1e-5)
    loss_sum.backward()
    for name, p in lm.named_parameters():
        assert (p.grad is not None) == p.requires_grad, name


def test_console_script_dispatches(capsys):
    from hftrain.cli import main

    with pytest.raises(SystemExit) as info:
        main(["merge", "--help"])
    assert info.value.code == 0 and "usage: hftrain merge" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        main(["train"])
    assert info.value.code == 2 and "unknown command 'train'" in capsys.readouterr().err


# --------------------------------------------------------------------- checkpoint keys
def test_checkpoint_keys_checked_before_loading(tmp_path):
    """A checkpoint made by another method (or with foreign weight names) is named, not half-loaded."""
    from safetensors.torch import save_file

    from hftrain.checkpoint import _check_saved_weights
    from hftrain.parallel.base import Backend
    from tests.unit.parallel.conftest import fake_accelerator

    backend = Backend(fake_accelerator(), Recipe())
    lora = CausalLMTokenLoss(build_model(recipe()))
    trained = {n: p.detach().clone() for n, p in lora.named_parameters() if p.requires_grad}
    save_file(trained, str(tmp_path / "model.safetensors"))
    _check_saved_weights(backend, lora, tmp_path)  # exactly the trained weights: fine

    full = CausalLMTokenLoss(build_model(Recipe(model_name_or_path=str(MODEL))))
    with pytest.raises(HftrainError, match="another model or fine-tuning method"):
        _check_saved_weights(backend, full, tmp_path)

    save_file({f"module.{n}": t for n, t in trained.items()}, str(tmp_path / "model.safetensors"))
    with pytest.raises(HftrainError, match="another model or fine-tuning method"):
        _check_saved_weights(backend, lora, tmp_path)
