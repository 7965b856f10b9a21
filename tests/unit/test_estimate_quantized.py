"""`hftrain estimate` with qat_scheme and fp8: what torchao's fake quantization adds to the activations, counted against
the tensors autograd actually saves (saved_tensors_hooks on a real decoder layer), and float8's weights against
torchao's layer rule written out."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from hftrain import qat
from hftrain.config import Recipe
from hftrain.errors import ConfigError
from hftrain.estimate import build_parser, estimate, model_shape, print_plan
from hftrain.estimate.activations import qat_layer_bytes
from tests.conftest import REPO
from tests.unit.test_fp8 import torchaos_rule

TOKENS, GROUP = 48, 32
CONFIG = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
              num_hidden_layers=1, vocab_size=64)


def saved_bytes(layer: nn.Module, x: torch.Tensor, position, autocast: bool) -> int:
    """Bytes of the distinct storages autograd saves for backward during `layer`'s forward, beyond the parameters and
    the input themselves."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        layer(x, position_embeddings=position)
    own = {p.untyped_storage().data_ptr() for p in layer.parameters()} | {x.untyped_storage().data_ptr()}
    return sum(n for ptr, n in storages.items() if ptr not in own)


@pytest.fixture(scope="module")
def shape(tmp_path_factory):
    folder = tmp_path_factory.mktemp("one-layer")
    LlamaConfig(**CONFIG).save_pretrained(folder)
    return model_shape(str(folder))


@pytest.mark.parametrize("scheme", ["int4_weight_only", "int8_dynamic_activation_int4_weight"])
@pytest.mark.parametrize("mixed", [False, True])
@pytest.mark.parametrize("trained", [True, False])
def test_qat_adds_what_autograd_saves_for_torchaos_fake_quantization(shape, scheme, mixed, trained):
    torch.manual_seed(0)
    config = LlamaConfig(**CONFIG)
    layer = LlamaDecoderLayer(config, 0)
    for p in layer.parameters():
        p.requires_grad_(trained)
    x = torch.randn(1, TOKENS, config.hidden_size, requires_grad=True)
    position = LlamaRotaryEmbedding(config)(x, torch.arange(TOKENS)[None])
    prepared = copy.deepcopy(layer)
    qat.prepare(prepared, Recipe(qat_scheme=scheme, qat_group_size=GROUP))
    measured = saved_bytes(prepared, x, position, mixed) - saved_bytes(layer, x, position, mixed)
    assert qat_layer_bytes(shape, TOKENS, scheme, GROUP, mixed, trained) == measured


def test_the_qat_plan_adds_the_fake_quantization_per_layer_and_keeps_the_layouts_qat_runs_under(shape):
    plain = estimate(shape, gpus=2, batch=2, seq=TOKENS // 2)
    plan = estimate(shape, gpus=2, batch=2, seq=TOKENS // 2, qat=("int8_dynamic_activation_int4_weight", GROUP))
    # every layout but QLoRA's (refused with qat_scheme): DDP, ZeRO and FSDP2 gather whole layers for their forward
    assert [r.strategy for r in plan.rows] == [r.strategy for r in plain.rows if not r.strategy.startswith("QLoRA")]
    assert {"DDP", "FSDP full shard", "ZeRO-3", "LoRA r=16 (DDP)"} <= {r.strategy for r in plan.rows}
    full = qat_layer_bytes(shape, TOKENS, "int8_dynamic_activation_int4_weight", GROUP, True, True)
    frozen = qat_layer_bytes(shape, TOKENS, "int8_dynamic_activation_int4_weight", GROUP, True, False)
    for row in plan.rows:
        extra = frozen if row.strategy.startswith("LoRA") else full
        before = next(r for r in plain.rows if r.strategy == row.strategy)
        assert row.activations == before.activations + shape.layers * extra
        assert row.activations_ckpt == before.activations_ckpt + extra  # only the recomputed layer
        assert (row.weights, row.grads, row.optimizer) == (before.weights, before.grads, before.optimizer)


def test_fp8_drops_the_bf16_copies_of_the_float8_layers_and_keeps_fp8s_layouts():
    """models/llama-3-70b-shape (config only): the float8 weights counted here with torchao's rule on the config's
    dimensions; a single GPU's bf16 autocast copies (2 bytes a weight) are not made for them (Float8Linear casts its
    fp32 weight to float8 itself, one layer at a time)."""
    from transformers import AutoConfig

    folder = str(REPO / "models" / "llama-3-70b-shape")
    config = AutoConfig.from_pretrained(folder)
    h, i = config.hidden_size, config.intermediate_size
    kv = config.num_key_value_heads * (config.head_dim or h // config.num_attention_heads)
    per_layer = {(h, h): 2, (kv, h): 2, (i, h): 2, (h, i): 1}  # (out, in): q o, k v, gate up, down
    float8 = config.num_hidden_layers * sum(count * n * k for (n, k), count in per_layer.items()
                                            if torchaos_rule("tensorwise", n, k))
    shape = model_shape(folder, fp8_recipe="tensorwise")
    assert shape.float8_params == float8
    plain = estimate(model_shape(folder), gpus=8, batch=1, seq=1024)
    plan = estimate(shape, gpus=8, batch=1, seq=1024, fp8="tensorwise")
    assert [r.strategy for r in plan.rows] == ["DDP", "FSDP full shard"]
    ddp, fsdp = plan.rows
    assert ddp.weights == plain.rows[0].weights - 2 * float8
    # FSDP2 gathers the two layers in flight with their float8 weights in 1 byte instead of bf16's 2
    gathered = 2 * float8 / config.num_hidden_layers
    assert fsdp.weights == next(r for r in plain.rows if r.strategy == "FSDP full shard").weights - gathered
    rowwise = estimate(model_shape(folder, fp8_recipe="rowwise"), gpus=8, batch=1, seq=1024, fp8="rowwise")
    assert rowwise.rows[1].weights == next(r for r in plain.rows if r.strategy == "FSDP full shard").weights


def test_the_cli_refuses_what_qat_and_fp8_do_not_run_with():
    def refused(*args):
        with pytest.raises(ConfigError) as caught:
            print_plan(build_parser().parse_args(["--model", str(REPO / "models" / "tiny-llama"), *args]))
        return caught.value.problems

    assert any(p.startswith("--qat_scheme runs under data-parallel layouts only") for p in refused(
        "--qat_scheme", "int4_weight_only", "--gpus", "2", "--sp", "2"))
    assert any(p.startswith("--qat_scheme with --qlora") for p in refused("--qat_scheme", "int4_weight_only",
                                                                           "--qlora"))
    assert any(p.startswith("--fp8 trains full fine-tuning") for p in refused("--fp8", "tensorwise", "--lora"))
    assert any(p.startswith("--fp8 and --qat_scheme") for p in refused("--fp8", "tensorwise", "--qat_scheme",
                                                                          "int4_weight_only"))
