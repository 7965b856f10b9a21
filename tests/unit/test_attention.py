"""hftrain.attention's varlen attention (torch's variable-length FlashAttention for packed rows) and where the preflight
lets it run.

torch's kernel is CUDA-only, so `hftrain.attention.varlen_kernel` is replaced here by tests/varlen_reference.py's
per-document sdpa, with torch 2.12+'s signature (enable_gqa) and with 2.11's (without it). Each result is checked
against a computation that does not go through that reference's code path: sdpa on the (batch, heads, seq, dim)
tensors document by document, or the same examples run one by one through the HF model with sdpa.
"""

from __future__ import annotations

import copy
import dataclasses
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig
from transformers.integrations.sdpa_attention import repeat_kv

import hftrain.attention
from hftrain.attention import VARLEN, VARLEN_MODEL_TYPES, describe, varlen_attention_forward
from hftrain.config import Recipe
from hftrain.data import IGNORE_INDEX, Collator
from hftrain.errors import ConfigError, HftrainError
from hftrain.model import compile_blocks
from hftrain.objectives.sft import CausalLMTokenLoss
from hftrain.parallel.launch import Launch
from hftrain.preflight import attention_choice, preflight, varlen_obstacles
from tests.conftest import REPO
from tests.varlen_reference import Calls, opaque_kernel, reference_kernel

MODEL = REPO / "models" / "tiny-llama"
PAD = 0
ONE = Launch("single", 1, 1)
# (row, start, end) of every segment of 2 rows of 12 tokens: 5 + 1 (one token) + 4 + 2 of padding, then a document
# filling its row (an example truncated to max_length)
SEGMENTS = [(0, 0, 5), (0, 5, 6), (0, 6, 10), (0, 10, 12), (1, 0, 12)]
CU = torch.tensor([0, 5, 6, 10, 12, 24], dtype=torch.int32)


@pytest.fixture(params=[True, False, "cpu"], ids=["torch>=2.12", "torch2.11", "cpu"])
def calls(request, monkeypatch) -> Calls:
    """The reference kernel in place of torch's, with enable_gqa (2.12+) or without (2.11), or hftrain's own kernel on
    a machine without CUDA (`CPU_KERNEL`, recorded as it runs); what it was called with."""
    seen = Calls()
    if request.param == "cpu":
        own = hftrain.attention.CPU_KERNEL

        def recorded(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, **options):
            seen.add(query, key, max_q, max_k, options.get("enable_gqa", False))
            return own.call(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, **options)

        monkeypatch.setattr(hftrain.attention, "CPU_KERNEL", dataclasses.replace(own, call=recorded))
        assert hftrain.attention.kernel_for(cuda=False) is hftrain.attention.CPU_KERNEL
        seen.gqa = True
        return seen
    kernel = reference_kernel(gqa=request.param, calls=seen)
    monkeypatch.setattr(hftrain.attention, "varlen_kernel", lambda: kernel)
    seen.gqa = request.param
    return seen


def qkv(dtype: torch.dtype, rows: int = 2, length: int = 12, heads: int = 4, kv_heads: int = 2, dim: int = 8):
    """Query, key and value as a Llama attention module hands them over: (batch, heads, seq, dim) views of
    (batch, seq, heads, dim) projections."""
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(rows, length, h, dim, generator=g).to(dtype).transpose(1, 2)
                 for h in (heads, kv_heads, kv_heads))


def attention_module(dtype: torch.dtype = torch.float32):
    return SimpleNamespace(is_causal=True, config=SimpleNamespace(dtype=dtype))


def sdpa_by_document(query, key, value, segments, scale):
    """Plain sdpa on each document's slice of the (batch, heads, seq, dim) tensors, key/value heads repeated."""
    groups = query.shape[1] // key.shape[1]
    out = torch.empty(query.shape[0], query.shape[2], query.shape[1], query.shape[3], dtype=query.dtype)
    for row, start, end in segments:
        q, k, v = (t[row:row + 1, :, start:end] for t in (query, key, value))
        o = F.scaled_dot_product_attention(q, repeat_kv(k, groups), repeat_kv(v, groups), is_causal=True,
                                           scale=scale)
        out[row, start:end] = o[0].transpose(0, 1)
    return out


# ------------------------------------------------------------------------------------------ the attention function
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_function_equals_sdpa_document_by_document(calls, dtype):
    """Two rows flattened into one sequence cut by the packer's boundaries (documents of 5, 1 and 4 tokens, padding, a
    document filling its row): the output is sdpa's on each document, in transformers' (batch, seq, heads, dim)
    layout; grouped key/value heads reach the kernel uncopied where it takes enable_gqa and repeated where not."""
    query, key, value = qkv(dtype)
    out, weights = varlen_attention_forward(attention_module(dtype), query, key, value, None, scaling=0.3,
                                            cu_seq_lens_q=CU, cu_seq_lens_k=CU, max_length_q=12, max_length_k=12)
    assert weights is None and out.shape == (2, 12, 4, 8) and out.dtype == dtype
    torch.testing.assert_close(out, sdpa_by_document(query, key, value, SEGMENTS, 0.3), rtol=0, atol=0) \
        if dtype == torch.float32 else \
        torch.testing.assert_close(out, sdpa_by_document(query, key, value, SEGMENTS, 0.3))
    (call,) = calls.seen
    assert call["heads"] == 4 and call["kv_heads"] == (2 if calls.gqa else 4)
    assert call["enable_gqa"] is calls.gqa and call["dtypes"] == (dtype, dtype) and call["max"] == (12, 12)


def test_attention_function_is_causal_within_each_document(calls):
    """A document's first token attends to itself only: sdpa's non-causal output would differ there."""
    query, key, value = qkv(torch.float32)
    out, _ = varlen_attention_forward(attention_module(), query, key, value, None, cu_seq_lens_q=CU, max_length_q=12)
    for row, start, _ in SEGMENTS:
        group = query.shape[1] // key.shape[1]
        torch.testing.assert_close(out[row, start], repeat_kv(value, group)[row, :, start])


def test_rows_without_boundaries_are_one_sequence_each(calls):
    """An unpacked evaluation batch (no cu_seq_lens): each right-padded row is one causal sequence."""
    query, key, value = qkv(torch.float32)
    out, _ = varlen_attention_forward(attention_module(), query, key, value, None)
    torch.testing.assert_close(out, sdpa_by_document(query, key, value, [(0, 0, 12), (1, 0, 12)], None))
    assert calls.seen[0]["max"] == (12, 12)


def test_autocast_hands_the_kernel_its_dtype_and_keeps_it(calls):
    """Under bf16 autocast RoPE's fp32 tables make the query and key fp32: the kernel gets bf16 (FlashAttention has
    no fp32), and the output stays bf16, as sdpa's does under autocast. Without autocast an fp32 query of a bf16 model
    (a QLoRA base, its norms upcast) is computed in bf16 and handed back in fp32."""
    query, key, value = qkv(torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = varlen_attention_forward(attention_module(), query, key, value.bfloat16(), None, cu_seq_lens_q=CU,
                                          max_length_q=12)
    assert calls.seen[-1]["dtypes"] == (torch.bfloat16, torch.bfloat16) and out.dtype == torch.bfloat16
    out, _ = varlen_attention_forward(attention_module(torch.bfloat16), query, key, value, None, cu_seq_lens_q=CU,
                                      max_length_q=12)
    assert calls.seen[-1]["dtypes"] == (torch.bfloat16, torch.bfloat16) and out.dtype == torch.float32


@pytest.mark.parametrize("extra, said", [
    ({"dropout": 0.1}, "no attention dropout"),
    ({"attention_mask": torch.ones(2, 1, 12, 12, dtype=torch.bool)}, "got an attention mask"),
    ({"sliding_window": 8}, "sliding window of 8 tokens and a document here has 12"),
    ({"softcap": 30.0}, "soft-caps"),
])
def test_what_the_kernel_cannot_compute_is_refused(calls, extra, said):
    query, key, value = qkv(torch.float32)
    kwargs = {"attention_mask": None, "cu_seq_lens_q": CU, "max_length_q": 12, **extra}
    with pytest.raises(HftrainError, match=said):
        varlen_attention_forward(attention_module(), query, key, value, **kwargs)
    assert not calls.seen


def test_a_key_value_cache_is_refused(calls):
    query, key, value = qkv(torch.float32)
    with pytest.raises(HftrainError, match="a key/value cache"):
        varlen_attention_forward(attention_module(), query[:, :, -1:], key, value, None)


def test_a_sliding_window_no_document_reaches_is_full_attention(calls):
    query, key, value = qkv(torch.float32)
    out, _ = varlen_attention_forward(attention_module(), query, key, value, None, cu_seq_lens_q=CU, max_length_q=12,
                                      sliding_window=12)
    torch.testing.assert_close(out, sdpa_by_document(query, key, value, SEGMENTS, None))


# --------------------------------------------------------------------------------------------- a tiny Llama
def tiny_llama(attention: str, **overrides) -> LlamaForCausalLM:
    """A random Llama with grouped key/value heads (4 query heads share 2)."""
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=PAD,
                         tie_word_embeddings=False, initializer_range=0.2, attn_implementation=attention, **overrides)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).train()


def twins() -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    """The same weights with varlen and with sdpa."""
    varlen, sdpa = tiny_llama(VARLEN), tiny_llama("sdpa")
    sdpa.load_state_dict(varlen.state_dict())
    return varlen, sdpa


# examples of 6, 1 (one token), 4, 12 (a whole row: truncated to max_length) and 3 + 5 tokens, packed by hand
LENGTHS = [6, 1, 4, 12, 3, 5]
ROWS = [[0, 1, 2], [3], [4, 5]]


def examples() -> Dataset:
    g = torch.Generator().manual_seed(4)
    ids = [torch.randint(3, 64, (n,), generator=g).tolist() for n in LENGTHS]
    labels = [[IGNORE_INDEX] + x[1:] for x in ids]
    labels[2][1:3] = [IGNORE_INDEX, IGNORE_INDEX]  # a prompt
    return Dataset.from_dict({"input_ids": ids, "labels": labels})


def packed_batch(data: Dataset, rows: list[int]) -> dict:
    """The collator's packed micro-batch of `rows`, with the documents' boundaries, as the loop hands it over."""
    collator = Collator(data, PAD, ROWS, packed=True)
    collator.mark_documents = True
    batch = collator(rows)
    batch.pop("num_examples")
    return batch


def grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@contextmanager
def position_ids_never_scanned():
    """transformers' two ways of finding packed documents from position_ids fail if they are reached."""
    import transformers.masking_utils
    import transformers.modeling_flash_attention_utils

    def scanned(*args, **kwargs):
        raise AssertionError("position_ids were scanned for the documents' boundaries")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(transformers.masking_utils, "find_packed_sequence_indices", scanned)
        patch.setattr(transformers.modeling_flash_attention_utils, "prepare_fa_kwargs_from_position_ids", scanned)
        yield


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_packed_rows_through_varlen_equal_the_examples_one_by_one(calls, precision):
    """Forward and backward of a tiny grouped-query Llama: three packed rows (a one-token example, an example filling
    its row, padding) as one micro-batch through the varlen attention give the summed loss and the gradients of the
    six examples run one by one through the same weights with sdpa. The packed rows reach the kernel as one flattened
    sequence (one call per layer) with the collator's boundaries; nothing scans position_ids."""
    data, (varlen, sdpa) = examples(), twins()
    bf16 = precision == "bf16"
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        with position_ids_never_scanned():
            packed = CausalLMTokenLoss(varlen)(**packed_batch(data, [0, 1, 2]))
        separate = sum(CausalLMTokenLoss(sdpa)(torch.tensor([ids]), torch.tensor([lbl]))
                       for ids, lbl in zip(data["input_ids"], data["labels"], strict=True))
    packed.backward()
    separate.backward()
    assert len(calls.seen) == varlen.config.num_hidden_layers and calls.seen[0]["max"] == (12, 12)
    tolerance = {"rtol": 2e-2, "atol": 2e-2} if bf16 else {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(packed, separate, **tolerance)
    expected = grads(sdpa)
    for name, grad in grads(varlen).items():
        scale = expected[name].abs().max()
        assert (grad - expected[name]).abs().max() <= (5e-2 if bf16 else 1e-5) * scale, name


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_one_step_through_varlen_equals_plain_pytorch(calls, precision):
    """One SGD step (lr 1) over two packed micro-batches (accumulation), each loss summed and the step divided by its
    trained tokens as the loop does, equals plain PyTorch's step: the HF model's own mean loss over the six examples
    in one right-padded batch with an attention mask (sdpa), same weights."""
    data, (varlen, sdpa) = examples(), twins()
    bf16 = precision == "bf16"
    micro_batches = [packed_batch(data, [0, 2]), packed_batch(data, [1])]
    tokens = sum(int((b["labels"][:, 1:] != IGNORE_INDEX).sum()) for b in micro_batches)
    loss_fn = CausalLMTokenLoss(varlen)
    for batch in micro_batches:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = loss_fn(**batch)
        (loss / tokens).backward()
    torch.optim.SGD(varlen.parameters(), lr=1.0).step()

    width = max(LENGTHS)
    input_ids = torch.tensor([x + [PAD] * (width - len(x)) for x in data["input_ids"]])
    labels = torch.tensor([x + [IGNORE_INDEX] * (width - len(x)) for x in data["labels"]])
    mask = torch.tensor([[1] * n + [0] * (width - n) for n in LENGTHS])
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        sdpa(input_ids=input_ids, attention_mask=mask, labels=labels).loss.backward()
    torch.optim.SGD(sdpa.parameters(), lr=1.0).step()
    for (name, ours), (_, plain) in zip(varlen.named_parameters(), sdpa.named_parameters(), strict=True):
        step = plain.grad.abs().max()
        assert (ours - plain).abs().max() <= (2e-2 if bf16 else 1e-5) * step, name


@pytest.mark.parametrize("model_type", sorted(VARLEN_MODEL_TYPES))
def test_every_listed_architecture_runs_packed_rows_through_varlen(calls, model_type):
    """Each architecture the preflight admits calls the attention function as Llama does: its packed rows equal its
    examples one by one (forward, fp32), with a sliding window where its config has one (no document reaches it)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, vocab_size=64, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                  max_position_embeddings=64, pad_token_id=PAD, num_local_experts=2,
                                  num_experts_per_tok=1)
    torch.manual_seed(0)
    varlen = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=VARLEN).eval()
    sdpa = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()  # from_config keeps the config
    sdpa.load_state_dict(varlen.state_dict())
    data = examples()
    with torch.no_grad():
        packed = CausalLMTokenLoss(varlen)(**packed_batch(data, [0, 1, 2]))
        separate = sum(CausalLMTokenLoss(sdpa)(torch.tensor([ids]), torch.tensor([lbl]))
                       for ids, lbl in zip(data["input_ids"], data["labels"], strict=True))
    assert calls.seen, model_type
    torch.testing.assert_close(packed, separate, rtol=1e-5, atol=1e-5)


def test_compiled_blocks_compile_once_for_every_packed_layout(monkeypatch):
    """torch_compile with varlen: the blocks are compiled with dynamic shapes from the first call, so micro-batches
    of other lengths, document counts and longest documents run the one graph dynamo captured, without a graph break
    (torch's default captured two: the first shape static, then dynamic), and the compiled loss is the eager one. The
    kernel is the reference inside a custom op, which dynamo cannot look into, as it cannot look into torch's. Dynamo's
    capture and guards are what decide recompiles; the graph runs on its eager backend here (inductor would add ~25 s
    of C++ compilation per graph on a CI core: scripts/measure_compile.py measures it)."""
    from torch._dynamo.utils import counters

    kernel = opaque_kernel()
    monkeypatch.setattr(hftrain.attention, "varlen_kernel", lambda: kernel)
    compile_module = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kwargs: compile_module(self, backend="eager",
                                                                                           **kwargs))
    data, (eager, compiled) = examples(), twins()
    compiled.load_state_dict(eager.state_dict())  # twins() gives the sdpa one the weights; here both are varlen
    compiled.config._attn_implementation = VARLEN
    compile_blocks(compiled, mode=None)
    graphs = counters["stats"]["unique_graphs"]
    for rows in ([0, 1, 2], [0], [1, 2], [2]):
        batch = packed_batch(data, rows)
        with torch.no_grad():
            torch.testing.assert_close(CausalLMTokenLoss(compiled)(**batch), CausalLMTokenLoss(eager)(**batch),
                                       rtol=1e-5, atol=1e-5)
    assert counters["stats"]["unique_graphs"] - graphs == 1


# ----------------------------------------------------------------------------------------------- the preflight
def recipe(**values) -> Recipe:
    return Recipe(**{"model_name_or_path": str(MODEL), "packing": True, "bf16": True, **values})


def varlen_problems(recipe: Recipe, cuda: bool = True, launch: Launch = ONE) -> list[str]:
    """The preflight's refusal, its problems about attn_implementation=varlen."""
    with pytest.raises(ConfigError) as refused:
        preflight(recipe, launch, cuda)
    return [p for p in refused.value.problems if "varlen" in p]


def save_config(folder, config) -> str:
    config.save_pretrained(folder)
    return str(folder)


def test_varlen_runs_where_it_can(monkeypatch):
    """CUDA, bf16 (or fp16, or 16-bit weights), packed rows, a Llama: no problem, and chosen without being named."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for values in ({"attn_implementation": VARLEN}, {}, {"fp16": True, "bf16": False},
                   {"bf16": False, "dtype": "bfloat16"}):
        r = recipe(**values)
        assert preflight(r, ONE, cuda=True) is not None
        assert attention_choice(r, ONE, True, preflight(r, ONE, cuda=True)) == (VARLEN, None)


@pytest.mark.parametrize("values, cuda, said", [
    ({"bf16": False}, True, "computes in bf16 or fp16 only (FlashAttention has no fp32 kernel)"),
    ({"packing": False}, True, "without packing every row is one example"),
    ({"log_completions": True}, True, "cannot generate"),
])
def test_explicit_varlen_that_cannot_run_is_refused_by_the_preflight(monkeypatch, values, cuda, said):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1 if cuda else 0)
    (problem,) = varlen_problems(recipe(attn_implementation=VARLEN, **values), cuda)
    assert problem.startswith(f"attn_implementation={VARLEN} ") and said in problem


@pytest.mark.parametrize("config, said", [
    (lambda: MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=64),
     "attends within 64 tokens, fewer than max_length=512"),
    (lambda: LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, attention_dropout=0.1), "attention_dropout=0.1"),
    (lambda: LlamaConfig(vocab_size=64, hidden_size=1024, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2), "head dimension of at most 256"),
    (lambda: __import__("transformers").GPT2Config(n_embd=32, n_layer=1, n_head=4), "this model is 'gpt2'"),
])
def test_explicit_varlen_with_a_model_it_cannot_run_is_refused(tmp_path, monkeypatch, config, said):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    (problem,) = varlen_problems(Recipe(model_name_or_path=save_config(tmp_path, config()), packing=True, bf16=True,
                                        attn_implementation=VARLEN))
    assert said in problem


@pytest.mark.parametrize("values, launch, said", [
    ({"sp_size": 2}, Launch("deepspeed", 2, 2, deepspeed_config_path="ds.json",
                            deepspeed_config={"zero_optimization": {"stage": 2}}), "DeepSpeed's Ulysses attention"),
    ({"pp_size": 2}, Launch("ddp", 2, 2), "pipeline stages pass"),
    ({"cp_size": 2}, Launch("fsdp2", 2, 2), "torch's ring attention replaces scaled_dot_product_attention only"),
])
def test_explicit_varlen_with_a_layout_it_does_not_combine_with_is_refused(monkeypatch, values, launch, said):
    """Sequence parallelism, the pipeline and context parallelism run their own attention: named, with what to use."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    problems = varlen_problems(recipe(attn_implementation=VARLEN, **values), launch=launch)
    assert any(said in p for p in problems), problems


def test_every_varlen_problem_is_reported_at_once(monkeypatch):
    r = Recipe(model_name_or_path=str(MODEL), attn_implementation=VARLEN, log_completions=True)
    assert len(varlen_problems(r, cuda=False)) == 2  # no packing, generation (hftrain's CPU kernel computes fp32)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert len(varlen_problems(r, cuda=True)) == 3  # and fp32, which FlashAttention does not compute


def test_named_varlen_runs_on_a_machine_without_cuda_in_any_precision():
    """On CPU a named varlen passes the preflight in fp32 and bf16 and runs hftrain's per-document sdpa (the start-up
    line says so); the automatic choice keeps sdpa there and says why."""
    for values in ({"bf16": False}, {}):
        r = recipe(attn_implementation=VARLEN, **values)
        assert preflight(r, ONE, cuda=False) is not None
        assert attention_choice(r, ONE, False, None) == (VARLEN, None)
    assert describe(VARLEN, True, cuda=False) == "varlen (per-document sdpa, packed rows)"
    assert attention_choice(recipe(), ONE, False, None) == (None, "varlen runs on CPU when named")


@pytest.mark.parametrize("values, cuda, note", [
    ({}, False, "varlen runs on CPU when named"),
    ({"bf16": False}, True, "varlen needs bf16/fp16"),
    ({"packing": False}, True, None),
    ({"sp_size": 2}, True, "varlen does not combine with sp_size"),
    ({"attn_implementation": "sdpa"}, True, None),
])
def test_the_automatic_choice_keeps_the_models_attention_where_varlen_cannot_run(values, cuda, note):
    r = recipe(**values)
    chosen, why = attention_choice(r, ONE, cuda, None)
    assert chosen == r.attn_implementation and why == note


def test_the_reference_kernel_stands_in_on_cpu(calls):
    """The tests' kernel runs on CPU: with it, no CUDA obstacle (the test launcher relies on this)."""
    assert [o.short for o in varlen_obstacles(recipe(), ONE, False, None)] == []


def test_start_up_words():
    assert describe(VARLEN, True) == "varlen (torch flash, packed rows)"
    assert describe("sdpa", True, "varlen needs CUDA") == \
        "sdpa (block-diagonal mask over packed rows; varlen needs CUDA)"
    assert describe("flash_attention_2", True) == "flash_attention_2 (packed rows flattened into one)"
    assert describe("sdpa", False) == "sdpa"
    lm = tiny_llama("sdpa")
    assert CausalLMTokenLoss(lm).loss_path == "logits at trained positions"
    assert CausalLMTokenLoss(lm, chunk_tokens=8192).loss_path == "chunked 8192 tokens"


def test_the_field_doc_names_every_architecture_varlen_runs():
    from hftrain.config import Recipe as R

    doc = R.__dataclass_fields__["attn_implementation"].metadata["help"]
    assert all(model_type in doc for model_type in VARLEN_MODEL_TYPES)
    assert VARLEN in R.__dataclass_fields__["attn_implementation"].metadata["choices"]


def test_the_shipped_gpu_recipes_get_varlen_on_a_gpu_without_naming_it():
    """A recipe made for GPUs names no attention and packs its rows: on CUDA in bf16 the automatic choice is varlen
    (issue 50's 'one fast default'), checked against the recipe's own model type (a Qwen2 config built here)."""
    from transformers import Qwen2Config

    from hftrain.config import load_recipe, shipped_recipes

    gpu = [p for p in shipped_recipes() if "launch_preset: single_gpu" in p.read_text()]
    assert gpu, "no shipped recipe for one GPU"
    qwen2 = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2)
    for path in gpu:
        r = load_recipe(["--config", str(path)], for_training=False)
        assert r.attn_implementation is None and r.packing and r.optim == "adamw_torch_fused", path.name
        assert attention_choice(r, ONE, True, qwen2) == (VARLEN, None), path.name
