"""fp8: which linear layers torchao's float8 training gets (computed without converting, on models of real dimensions
built on the meta device), that the conversion swaps exactly those, and the refusals before anything loads."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hftrain import fp8
from hftrain.config import Recipe, validate
from tests.conftest import REPO, run_script

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def meta_llama(hidden: int, intermediate: int, kv_heads: int, vocab: int = 32000) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=1,
                         num_attention_heads=hidden // 128, num_key_value_heads=kv_heads)
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def torchaos_rule(recipe: str, out_features: int, in_features: int) -> bool:
    """torchao 0.18's advice (torchao/float8 README's performance tables, as its auto filter encodes them): both
    dimensions multiples of 16, and large enough to pay."""
    n, k = out_features, in_features
    if n % 16 or k % 16:
        return False
    if recipe == "tensorwise":
        return not (k <= 4096 and n <= 1024)
    return n > 2048 and k > 1024 and not (n <= 4096 and k <= 2048)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("hidden, intermediate, kv_heads", [(4096, 14336, 8), (2048, 8192, 16), (4096, 14344, 8)])
def test_the_layers_chosen_follow_torchaos_rule_and_never_the_head(recipe, hidden, intermediate, kv_heads):
    model = meta_llama(hidden, intermediate, kv_heads)
    chosen, kept = fp8.float8_layers(model, recipe)
    shapes = {name: m.weight.shape for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    expected = {name for name, (n, k) in shapes.items() if name != "lm_head" and torchaos_rule(recipe, n, k)}
    assert set(chosen) == expected and set(kept) == set(shapes) - expected
    assert "lm_head" in kept  # 32000 x 4096 would pass the size rule: excluded as the head
    if (recipe, hidden, intermediate) == ("tensorwise", 4096, 14336):  # Llama-3-8B's shapes
        assert set(kept) == {"lm_head", "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj"}
    if intermediate % 16:  # 14344 is not a multiple of 16: the MLP stays in high precision
        assert not any(p in name for name in chosen for p in ("gate_proj", "up_proj", "down_proj"))


def test_the_conversion_swaps_exactly_the_chosen_layers():
    from torchao.float8.float8_linear import Float8Linear

    model = meta_llama(4096, 14336, 8)
    chosen, kept = fp8.float8_layers(model, "tensorwise")
    note = fp8.convert(model, Recipe(fp8=True, bf16=True))
    assert note == ("fp8 tensorwise (torchao float8): 5 linear layers in float8, 3 kept in high precision (the head "
                    "and those too small or not multiples of 16)")
    swapped = {name for name, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert swapped == set(chosen) and len(chosen) == 5


def test_the_preflight_refuses_machines_without_float8_tensor_cores():
    on = Recipe(fp8=True, bf16=True)
    (cpu,) = fp8.preflight_problems(on, cuda=False, capability=None, launch_kind="single")
    assert cpu.startswith("fp8 needs a CUDA GPU with compute capability >= 8.9 (Ada, Hopper or later")
    (ampere,) = fp8.preflight_problems(on, cuda=True, capability=(8, 0), launch_kind="single")
    assert "this one has 8.0: it has no float8 tensor cores" in ampere
    assert fp8.preflight_problems(on, cuda=True, capability=(8, 9), launch_kind="fsdp2") == []
    assert fp8.preflight_problems(on, cuda=True, capability=(9, 0), launch_kind="ddp") == []
    (ds,) = fp8.preflight_problems(on, cuda=True, capability=(9, 0), launch_kind="deepspeed")
    assert ds.startswith("fp8 with DeepSpeed is refused")
    assert fp8.preflight_problems(Recipe(), cuda=False, capability=None, launch_kind="single") == []


def test_recipes_fp8_cannot_run_with_are_refused():
    base = {"model_name_or_path": str(REPO / "models" / "tiny-llama"), "fp8": True}
    assert validate(Recipe(**base, bf16=True)) == []
    (peft,) = validate(Recipe(**base, use_peft=True))
    assert peft.startswith("fp8 with use_peft is refused")
    (both,) = validate(Recipe(**base, qat_scheme="int4_weight_only"))
    assert both.startswith("fp8 with qat_scheme=int4_weight_only is refused")


def test_the_entry_script_refuses_fp8_on_cpu_before_the_model_loads(tmp_path):
    run = run_script(tmp_path / "out", "--max_steps", "1", "--fp8", "true", "--bf16", "true", check=False)
    said = " ".join(run.stderr.split())
    assert run.returncode == 2, said[-2000:]
    assert "fp8 needs a CUDA GPU with compute capability >= 8.9" in said and "Traceback" not in run.stderr
    assert not (tmp_path / "out").exists()


def test_fsdp2s_float8_all_gather_is_chosen_for_tensorwise_under_fsdp2_only():
    on = Recipe(fp8=True, bf16=True)
    assert fp8.float8_all_gather(on, "fsdp2")
    assert not fp8.float8_all_gather(on, "ddp") and not fp8.float8_all_gather(on, "single")
    assert not fp8.float8_all_gather(Recipe(fp8=True, bf16=True, fp8_recipe="rowwise"), "fsdp2")  # torchao: no
    assert not fp8.float8_all_gather(Recipe(fp8=True, bf16=True, fp8_fsdp_all_gather=False), "fsdp2")
    assert not fp8.float8_all_gather(Recipe(), "fsdp2")


def test_with_the_float8_all_gather_the_chosen_layers_weights_are_torchaos_float8_gathered_weights():
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    model = meta_llama(4096, 14336, 8)
    chosen, kept = fp8.float8_layers(model, "tensorwise")
    note = fp8.convert(model, Recipe(fp8=True, bf16=True), all_gather=True)
    assert note.endswith("(the head and those too small or not multiples of 16); FSDP2 gathers their weights in float8")
    modules = dict(model.named_modules())
    assert {n for n in chosen + kept if isinstance(modules[n].weight, WeightWithDynamicFloat8CastTensor)} == set(chosen)


def test_the_float8_scales_are_recomputed_after_each_optimizer_step_under_fsdp2(tmp_path):
    """A one-process gloo FSDP2 on CPU: after the optimizer's step, the hook has set every float8-gathered weight's
    scale to torchao's tensorwise scale of the updated weight (float8 max / max |w|, written out here)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False), torch.nn.Linear(32, 16, bias=False))
        convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        fp8.precompute_scales_after_step(optimizer, model)
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        optimizer.step()
        for layer in model:
            weight = layer.weight.full_tensor()
            expected = (torch.finfo(torch.float8_e4m3fn).max / weight.abs().max().double()).float()
            # where torchao keeps it: on the DTensor's local WeightWithDynamicFloat8CastTensor (to_local() wraps anew)
            torch.testing.assert_close(layer.weight._local_tensor._precomputed_scale, expected, rtol=0, atol=0)
    finally:
        dist.destroy_process_group()
