"""The token-sum loss wrapper against the model's own loss, and the model/tokenizer builders."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from hftrain.compat import transformers as compat_transformers
from hftrain.config import Recipe
from hftrain.data import IGNORE_INDEX
from hftrain.errors import HftrainError
from hftrain.model import (
    DTYPES,
    LIGER_KERNELS,
    LIGER_MODEL_TYPES,
    build_full_model,
    build_model,
    build_peft_model,
    build_tokenizer,
    compile_blocks,
    model_summary,
    pad_token_id,
    repeated_blocks,
)
from hftrain.objectives.sft import CausalLMTokenLoss
from tests.conftest import REPO

MODEL = REPO / "models" / "tiny-llama"
PAD = 0


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(MODEL))
    model.train()  # dropout is 0 in this config, so train mode is deterministic
    return model


def padded_batch(vocab: int):
    """3 right-padded rows of lengths 9, 5, 7 with some labels masked (prompt-like prefix, one hole)."""
    g = torch.Generator().manual_seed(1)
    lengths = [9, 5, 7]
    width = max(lengths)
    input_ids = torch.full((3, width), PAD, dtype=torch.long)
    labels = torch.full((3, width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((3, width), dtype=torch.long)
    for row, n in enumerate(lengths):
        ids = torch.randint(3, vocab, (n,), generator=g)
        input_ids[row, :n] = ids
        labels[row, :n] = ids
        mask[row, :n] = 1
    labels[:, 0] = IGNORE_INDEX
    labels[0, 1:4] = IGNORE_INDEX  # a prompt
    labels[2, 5] = IGNORE_INDEX  # a hole in the middle
    return input_ids, labels, mask


def reference_sum(model, input_ids, labels, mask) -> torch.Tensor:
    """The model's own mean loss over shifted trained labels, times their number."""
    n = (labels[:, 1:] != IGNORE_INDEX).sum()
    return model(input_ids=input_ids, attention_mask=mask, labels=labels, use_cache=False).loss * n


def compare_with_model_loss(model, param_names, chunk_tokens: int = 0):
    input_ids, labels, mask = padded_batch(model.config.vocab_size)
    params = dict(model.named_parameters())

    model.zero_grad(set_to_none=True)
    ours = CausalLMTokenLoss(model, chunk_tokens)(input_ids, labels)
    ours.backward()
    our_grads = {name: params[name].grad.clone() for name in param_names}

    model.zero_grad(set_to_none=True)
    reference = reference_sum(model, input_ids, labels, mask)
    reference.backward()
    assert ours.ndim == 0
    assert ours.item() == pytest.approx(reference.item(), rel=1e-5)
    for name in param_names:
        torch.testing.assert_close(our_grads[name], params[name].grad, rtol=1e-4, atol=1e-6)
    model.zero_grad(set_to_none=True)


def test_token_loss_equals_model_loss_times_tokens(tiny):
    compare_with_model_loss(tiny, ["model.layers.0.self_attn.q_proj.weight", "lm_head.weight",
                                   "model.embed_tokens.weight", "model.norm.weight"])


@pytest.mark.parametrize("chunk_tokens", [1, 5, 7])
def test_chunked_loss_equals_model_loss_times_tokens(tiny, chunk_tokens):
    """loss_chunk_tokens: the head and cross-entropy per chunk of trained tokens, logits recomputed in backward;
    same loss and gradients as the model's own full-logits loss (chunks of 1, uneven, and a short last one)."""
    compare_with_model_loss(tiny, ["model.layers.0.self_attn.q_proj.weight", "lm_head.weight",
                                   "model.embed_tokens.weight", "model.norm.weight"], chunk_tokens)


def test_chunked_loss_never_holds_the_whole_logits(tiny):
    """The largest logits tensor built in forward and backward is one chunk's, not the micro-batch's."""
    input_ids, labels, _ = padded_batch(tiny.config.vocab_size)
    trained = int((labels[:, 1:] != IGNORE_INDEX).sum())
    head, shapes = tiny.get_output_embeddings(), []
    handle = head.register_forward_hook(lambda module, args, out: shapes.append(tuple(out.shape)))
    try:
        CausalLMTokenLoss(tiny, chunk_tokens=4)(input_ids, labels).backward()
    finally:
        handle.remove()
        tiny.zero_grad(set_to_none=True)
    rows = [s[0] for s in shapes]
    assert max(rows) == 4 and sum(rows) == 2 * trained  # every chunk once in forward, once again in backward


def test_token_loss_is_a_sum_over_rows(tiny):
    input_ids, labels, _ = padded_batch(tiny.config.vocab_size)
    loss = CausalLMTokenLoss(tiny)
    with torch.no_grad():
        whole = loss(input_ids, labels)
        rows = sum(loss(input_ids[i:i + 1], labels[i:i + 1]) for i in range(3))
    assert whole.item() == pytest.approx(rows.item(), rel=1e-5)


def test_fully_masked_row_gives_zero(tiny):
    loss = CausalLMTokenLoss(tiny)
    value = loss(torch.tensor([[PAD]]), torch.tensor([[IGNORE_INDEX]]))
    assert value.item() == 0.0
    value.backward()  # an empty micro-batch still runs backward (ranks stay in step)


def test_packed_row_equals_separate_examples(tiny):
    """position_ids restarting at 0 inside a row keep packed examples from attending to each other."""
    g = torch.Generator().manual_seed(2)
    vocab = tiny.config.vocab_size
    examples = [torch.randint(3, vocab, (n,), generator=g) for n in (6, 4, 7)]
    masks = [torch.ones(len(e), dtype=torch.bool) for e in examples]
    masks[1][:2] = False  # a prompt in the second example
    labels = [torch.where(m, e, IGNORE_INDEX) for e, m in zip(examples, masks, strict=True)]
    for lbl in labels:
        lbl[0] = IGNORE_INDEX  # first token of every example is never a target, also when packed
    packed_ids = torch.cat(examples + [torch.tensor([PAD, PAD])])[None]
    packed_labels = torch.cat(labels + [torch.tensor([IGNORE_INDEX, IGNORE_INDEX])])[None]
    position_ids = torch.cat([torch.arange(len(e)) for e in examples] + [torch.arange(2)])[None]
    loss = CausalLMTokenLoss(tiny)
    with torch.no_grad():
        packed = loss(packed_ids, packed_labels, position_ids=position_ids)
        separate = sum(reference_sum(tiny, e[None], lbl[None], torch.ones(1, len(e), dtype=torch.long))
                       for e, lbl in zip(examples, labels, strict=True))
    assert packed.item() == pytest.approx(separate.item(), rel=1e-5)


def tiny_config_kwargs():
    return dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=4, max_position_embeddings=64, pad_token_id=PAD, tie_word_embeddings=False,
                initializer_range=0.2)  # large enough weights that the logit transform matters


def test_token_loss_with_logit_softcapping():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    config = Gemma2Config(**tiny_config_kwargs(), head_dim=8, final_logit_softcapping=2.0,
                          attn_logit_softcapping=None, attention_dropout=0.0)
    model = Gemma2ForCausalLM(config).train()
    assert not CausalLMTokenLoss(model).head_only
    compare_with_model_loss(model, ["lm_head.weight", "model.layers.1.mlp.down_proj.weight"])


def test_token_loss_with_logits_scaling():
    """Granite models divide the lm_head output by `config.logits_scaling` (8 or 16 in released checkpoints)."""
    from transformers import GraniteConfig, GraniteForCausalLM

    torch.manual_seed(0)
    config = GraniteConfig(**tiny_config_kwargs(), logits_scaling=8.0)
    model = GraniteForCausalLM(config).train()
    compare_with_model_loss(model, ["lm_head.weight", "model.layers.0.self_attn.q_proj.weight"])


# ------------------------------------------------------------------------------ builders
def test_build_full_model_and_tokenizer():
    recipe = Recipe(model_name_or_path=str(MODEL), gradient_checkpointing=True)
    model = build_full_model(recipe)
    assert model.config.use_cache is False
    assert model.is_gradient_checkpointing
    assert all(p.requires_grad and p.dtype == torch.float32 for p in model.parameters())
    tokenizer = build_tokenizer(recipe)
    assert tokenizer.eos_token == "<|im_end|>"
    assert pad_token_id(tokenizer) == tokenizer.pad_token_id == 0


def test_build_model_in_bfloat16():
    model = build_full_model(Recipe(model_name_or_path=str(MODEL), dtype="bfloat16"))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


@pytest.mark.skipif(compat_transformers.STAGE_LOAD.problem() is not None,
                    reason=str(compat_transformers.STAGE_LOAD.problem()))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_stage_load_reads_only_its_decoder_layers(dtype, capfd):
    """A pipeline stage's load (layers={1} of the tiny model's 2): layer 1, the embeddings, the final norm and the
    head equal the whole model's load; layer 0 stays on the meta device (no memory) with its names, shapes and dtype;
    the class is transformers' own; the other layer's checkpoint keys are not reported as unexpected."""
    recipe = Recipe(model_name_or_path=str(MODEL), dtype=dtype, gradient_checkpointing=True)
    whole = dict(build_full_model(recipe).named_parameters())
    capfd.readouterr()
    stage = build_model(recipe, {}, layers={1})
    assert type(stage) is type(AutoModelForCausalLM.from_pretrained(MODEL)) and stage.is_gradient_checkpointing
    assert "UNEXPECTED" not in "".join(capfd.readouterr())
    params = dict(stage.named_parameters())
    assert params.keys() == whole.keys()  # the whole model's names, in order
    for name, value in params.items():
        assert value.shape == whole[name].shape and value.dtype == whole[name].dtype == DTYPES[dtype], name
        if name.startswith("model.layers.0."):
            assert value.is_meta, name
        else:
            assert not value.is_meta and torch.equal(value, whole[name]), name
    with pytest.raises(HftrainError, match="per-stage load"):
        build_model(Recipe(model_name_or_path=str(MODEL), use_peft=True), {}, layers={1})


def test_missing_model_is_a_user_error(tmp_path):
    recipe = Recipe(model_name_or_path=str(tmp_path))  # an empty folder
    with pytest.raises(HftrainError, match="cannot load model"):
        build_full_model(recipe)
    with pytest.raises(HftrainError, match="cannot load tokenizer"):
        build_tokenizer(recipe)


def test_pad_token_fallbacks():
    assert pad_token_id(SimpleNamespace(pad_token_id=5, eos_token_id=2)) == 5
    assert pad_token_id(SimpleNamespace(pad_token_id=None, eos_token_id=2)) == 2
    assert pad_token_id(SimpleNamespace(pad_token_id=None, eos_token_id=None)) == 0


def test_compile_blocks_compiles_each_decoder_layer_in_place_and_keeps_parameter_names():
    """Regional compilation: the decoder layers (not embeddings, norm or head) get a compiled call, the state dict
    keys stay those of the eager model (checkpoints and `from_pretrained` see no `_orig_mod`), and the compiled
    model computes the same loss and gradients."""
    torch.manual_seed(0)
    eager = AutoModelForCausalLM.from_pretrained(str(MODEL))
    compiled = AutoModelForCausalLM.from_pretrained(str(MODEL))
    keys = list(compiled.state_dict())
    assert repeated_blocks(compiled) == list(compiled.model.layers)
    assert compile_blocks(compiled, mode=None) == compiled.config.num_hidden_layers
    assert list(compiled.state_dict()) == keys
    assert model_summary(compiled)["compiled_blocks"] == compiled.config.num_hidden_layers
    assert model_summary(eager)["compiled_blocks"] == 0
    input_ids, labels, _ = padded_batch(compiled.config.vocab_size)
    losses = []
    for model in (eager, compiled):
        loss = CausalLMTokenLoss(model)(input_ids=input_ids, labels=labels)
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-5)
    for (name, a), (_, b) in zip(eager.named_parameters(), compiled.named_parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_repeated_blocks_takes_the_outermost_list_only():
    inner = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)])
    layer = torch.nn.Sequential(torch.nn.Linear(2, 2))
    layer.experts = inner
    outer = torch.nn.ModuleList([layer, torch.nn.Sequential(torch.nn.Linear(2, 2))])
    model = torch.nn.Module()
    model.layers = outer
    assert repeated_blocks(model) == list(outer)  # the experts inside a layer are compiled with it


def test_compile_blocks_without_repeated_blocks_is_a_clear_error():
    with pytest.raises(HftrainError, match="torch_compile found no repeated blocks .* in Linear; set torch_compile"):
        compile_blocks(torch.nn.Linear(2, 2), mode=None)


class PlainTorchFusedLinearCE(torch.nn.Module):
    """Stands in for LigerFusedLinearCrossEntropyLoss(reduction="sum"), whose Triton kernels need a GPU: the same
    call signature forward(lin_weight, _input, target, bias=None) and the same result, in plain torch."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def forward(self, lin_weight, _input, target, bias=None):
        if not len(_input):  # liger-kernel 0.8.5: chunk_size = next_power_of_2(cdiv(0, inc)) = 0, then cdiv(0, 0)
            raise ZeroDivisionError("integer division or modulo by zero")
        self.calls.append((lin_weight, _input.detach().clone(), target.clone(), bias))
        logits = torch.nn.functional.linear(_input, lin_weight, bias)
        return torch.nn.functional.cross_entropy(logits.float(), target, ignore_index=IGNORE_INDEX, reduction="sum")


def test_liger_loss_wiring_passes_head_weight_trained_hidden_and_targets(tiny, monkeypatch):
    """Verifies hftrain's wiring of the fused loss, not Liger itself (its kernels cannot run on CPU): with
    use_liger_kernel the head loss calls the fused function with (lm_head.weight, hidden states at trained positions,
    their targets, the head's bias) and gets the same summed loss and gradients as the default path."""
    fake = PlainTorchFusedLinearCE()
    monkeypatch.setattr("hftrain.objectives.sft.liger_fused_linear_cross_entropy", lambda: fake)
    input_ids, labels, _ = padded_batch(tiny.config.vocab_size)
    params = dict(tiny.named_parameters())
    names = ["lm_head.weight", "model.norm.weight", "model.layers.1.mlp.down_proj.weight"]

    def loss_and_grads(wrapper):
        tiny.zero_grad(set_to_none=True)
        loss = wrapper(input_ids, labels)
        loss.backward()
        grads = {n: params[n].grad.clone() for n in names}
        tiny.zero_grad(set_to_none=True)
        return loss, grads

    fused_loss, fused_grads = loss_and_grads(CausalLMTokenLoss(tiny, fused_cross_entropy=True))
    plain_loss, plain_grads = loss_and_grads(CausalLMTokenLoss(tiny))

    (weight, hidden, targets, bias), = fake.calls
    trained = labels[:, 1:] != IGNORE_INDEX
    assert weight is tiny.lm_head.weight and bias is None  # Llama's head has no bias
    with torch.no_grad():
        expected_hidden = tiny.model(input_ids=input_ids, use_cache=False).last_hidden_state[:, :-1][trained]
    torch.testing.assert_close(hidden, expected_hidden)
    assert torch.equal(targets, labels[:, 1:][trained])
    assert fused_loss.item() == pytest.approx(plain_loss.item(), rel=1e-6)
    for name in names:
        torch.testing.assert_close(fused_grads[name], plain_grads[name])


def test_liger_loss_of_a_micro_batch_without_trained_tokens_is_zero_with_the_head_in_the_graph(tiny, monkeypatch):
    """An epoch's last step can hold a micro-batch whose labels are all ignored (the GPU proof's 1.24B run died at
    its last step so, inside Liger): the loss is 0, Liger is not called with no rows, and the head and the decoder
    still get (zero) gradients, as every rank's backward must reach the same parameters."""
    fake = PlainTorchFusedLinearCE()
    monkeypatch.setattr("hftrain.objectives.sft.liger_fused_linear_cross_entropy", lambda: fake)
    input_ids, labels, _ = padded_batch(tiny.config.vocab_size)
    tiny.zero_grad(set_to_none=True)
    loss = CausalLMTokenLoss(tiny, fused_cross_entropy=True)(input_ids, torch.full_like(labels, IGNORE_INDEX))
    loss.backward()
    assert loss.item() == 0.0 and fake.calls == []
    for name in ("lm_head.weight", "model.layers.1.mlp.down_proj.weight"):
        grad = dict(tiny.named_parameters())[name].grad
        assert grad is not None and not grad.any()
    tiny.zero_grad(set_to_none=True)


def test_liger_loss_is_refused_when_the_head_is_an_adapter(tiny, monkeypatch):
    """The fused loss reads lm_head.weight directly: a LoRA adapter on the head would silently not train."""
    from peft import LoraConfig, get_peft_model

    monkeypatch.setattr("hftrain.objectives.sft.liger_fused_linear_cross_entropy", PlainTorchFusedLinearCE)
    fresh = AutoModelForCausalLM.from_pretrained(str(MODEL))
    peft_model = get_peft_model(fresh, LoraConfig(r=2, target_modules=["lm_head"]))
    with pytest.raises(HftrainError, match="plain Linear layer.*remove lm_head from lora_target_modules"):
        CausalLMTokenLoss(peft_model, fused_cross_entropy=True)


@pytest.mark.parametrize("use_peft", [False, True])
def test_builders_apply_liger_kernels_to_the_loaded_base(monkeypatch, use_peft):
    """use_liger_kernel patches the base model the builder loaded (before adapters are added), and only then."""
    patched = []
    monkeypatch.setattr("hftrain.model.apply_liger_kernels", lambda model: patched.append(type(model).__name__))
    build = build_peft_model if use_peft else build_full_model
    build(Recipe(model_name_or_path=str(MODEL), use_peft=use_peft))
    assert patched == []
    build(Recipe(model_name_or_path=str(MODEL), use_peft=use_peft, use_liger_kernel=True))
    assert patched == ["LlamaForCausalLM"]


def test_liger_kernel_names_match_the_installed_liger():
    """LIGER_KERNELS are keyword arguments of Liger's per-architecture functions, for every supported type."""
    monkey_patch = pytest.importorskip(
        "liger_kernel.transformers.monkey_patch",
        reason="liger-kernel is not installed (it needs Triton, i.e. a CUDA machine; pip install '.[cuda]')")
    import inspect

    for model_type in LIGER_MODEL_TYPES:
        parameters = inspect.signature(monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN[model_type]).parameters
        assert "fused_linear_cross_entropy" in parameters and "model" in parameters, model_type
        assert {"rope", "rms_norm"} <= set(parameters) and set(parameters) & {"swiglu", "geglu"}, model_type
    assert LIGER_KERNELS["fused_linear_cross_entropy"] is False


def packed_rows(vocab: int):
    """Two packed rows of 3 + 2 examples (and a padded tail), position_ids restarting per example."""
    g = torch.Generator().manual_seed(3)
    rows = [(5, 4, 3), (7, 3)]
    width = 14
    input_ids = torch.full((2, width), PAD)
    labels = torch.full((2, width), IGNORE_INDEX)
    position_ids = torch.zeros((2, width), dtype=torch.long)
    for r, lengths in enumerate(rows):
        offset = 0
        for n in lengths:
            ids = torch.randint(3, vocab, (n,), generator=g)
            input_ids[r, offset:offset + n] = ids
            labels[r, offset + 1:offset + n] = ids[1:]
            position_ids[r, offset:offset + n] = torch.arange(n)
            offset += n
        position_ids[r, offset:] = torch.arange(width - offset)
    return input_ids, labels, position_ids


def test_packed_rows_flattened_into_one_row_give_the_same_loss(tiny):
    """What hftrain does for flash attention (which finds packed examples only in a batch of one row) is exact:
    here checked with sdpa, which keeps examples apart in either shape."""
    input_ids, labels, position_ids = packed_rows(tiny.config.vocab_size)
    rows, flat = CausalLMTokenLoss(tiny), CausalLMTokenLoss(tiny)
    flat.flatten_packed = True
    seen = []
    handle = tiny.model.register_forward_pre_hook(lambda m, args, kwargs: seen.append(kwargs["input_ids"].shape),
                                                  with_kwargs=True)
    try:
        with torch.no_grad():
            by_rows = rows(input_ids, labels, position_ids=position_ids)
            flattened = flat(input_ids, labels, position_ids=position_ids)
    finally:
        handle.remove()
    assert seen == [(2, 14), (1, 28)]
    assert flattened.item() == pytest.approx(by_rows.item(), rel=1e-5)


def test_flash_attention_models_get_flattened_packed_rows():
    def stub(attn):
        lm = torch.nn.Module()
        lm.config = SimpleNamespace(model_type="llama", _attn_implementation=attn)
        return lm

    assert CausalLMTokenLoss(stub("flash_attention_2")).flatten_packed
    assert not CausalLMTokenLoss(stub("sdpa")).flatten_packed
    assert not CausalLMTokenLoss(stub(None)).flatten_packed
