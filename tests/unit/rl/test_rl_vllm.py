"""grpo's colocated vLLM generation (use_vllm: true, hftrain.rl.vllm_generation) on CPU, without vLLM: a small fake
`vllm` module, put in sys.modules by these tests only, records what hftrain asks of vLLM's `LLM` (its constructor,
one SamplingParams per request, the pushed weights, sleep / wake-up) and returns token ids and log-probs the test
chooses. What vLLM does with them on a GPU is not tested here (docs/grpo.md). Also: TRL's importance-sampling
correction against a plain transcription of TRL 1.16's code, and the recipe's and preflight's refusals."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import sys
import types
from contextlib import contextmanager, nullcontext
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hftrain.config import load_recipe
from hftrain.errors import ConfigError
from hftrain.parallel.base import DataParallel
from hftrain.parallel.launch import Launch
from hftrain.preflight import async_problems, vllm_problems
from hftrain.rl.generation import TransformersGenerator, build_generator
from hftrain.rl.grpo import GRPOLoss, Policy, Rollouts, RolloutSource
from hftrain.rl.loss import LossSettings, per_token_loss, vllm_importance_sampling_ratio
from hftrain.rl.rewards import load_reward_functions
from hftrain.rl.rollouts import Sampling, WindowPlan, render_prompts, row_seed
from hftrain.rl.vllm_generation import VLLMGenerator, sampling_params, vllm_weight_name
from tests.conftest import REPO

TINY = REPO / "models" / "tiny-llama"
EOS = 2


# ------------------------------------------------------------------------------------------------ the fake vllm
class FakeSamplingParams:
    def __init__(self, **kwargs):
        self.kwargs = kwargs


class FakeLogprob:
    def __init__(self, logprob: float, rank: int):
        self.logprob, self.rank = logprob, rank


class FakeLLM:
    """Records every call; `generate` answers request i from the module's `script(prompt_ids, params)`, which gives
    (token ids, log-probs)."""

    def __init__(self, module, **kwargs):
        self.module, self.kwargs, self.events, self.pushed = module, kwargs, [], []
        model = SimpleNamespace(load_weights=self.load_weights)
        self.llm_engine = SimpleNamespace(model_executor=SimpleNamespace(
            driver_worker=SimpleNamespace(model_runner=SimpleNamespace(model=model))))
        module.instances.append(self)

    def load_weights(self, pairs):
        self.events.append("load_weights")
        self.pushed += [(name, tensor.detach().clone()) for name, tensor in pairs]

    def sleep(self, level):
        self.events.append(f"sleep({level})")

    def wake_up(self, tags):
        self.events.append(f"wake_up({','.join(tags)})")

    def reset_prefix_cache(self):
        self.events.append("reset_prefix_cache")

    def generate(self, prompts, sampling_params, use_tqdm):
        self.events.append("generate")
        self.module.generate_calls.append((prompts, sampling_params, use_tqdm))
        outputs = []
        for prompt, params in zip(prompts, sampling_params):
            tokens, logps = self.module.script(prompt["prompt_token_ids"], params)
            completion = SimpleNamespace(token_ids=tokens, logprobs=[{t: FakeLogprob(v, 1)} for t, v in
                                                                      zip(tokens, logps)])
            outputs.append(SimpleNamespace(prompt_token_ids=prompt["prompt_token_ids"], outputs=[completion]))
        return outputs


@pytest.fixture
def fake_vllm(monkeypatch):
    module = types.ModuleType("vllm")
    module.instances, module.generate_calls = [], []
    module.SamplingParams = FakeSamplingParams
    module.LLM = lambda **kwargs: FakeLLM(module, **kwargs)
    module.script = lambda ids, params: ([7, EOS], [-1.0, -2.0])
    monkeypatch.setitem(sys.modules, "vllm", module)
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        # VLLMGenerator sets them: setenv first so that monkeypatch restores (or removes) each afterwards; a
        # WORLD_SIZE left behind would make a later test's process group wait for a second rank
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    return module


def accelerator(index: int = 0):
    return SimpleNamespace(process_index=index, local_process_index=index, num_processes=2, is_main_process=True,
                           device=torch.device("cpu"), gather=lambda t: t, wait_for_everyone=lambda: None)


def recipe(tmp_path, *extra: str):
    return load_recipe(["--config", str(REPO / "recipes" / "tiny-grpo.yaml"), "--model_name_or_path", str(TINY),
                        "--dataset_name", str(REPO / "data" / "prompt_completion.jsonl"),
                        "--output_dir", str(tmp_path / "out"), *extra])


# --------------------------------------------------------------------------------------------- the engine calls
def test_the_engine_is_built_as_trls_colocated_mode(tmp_path, fake_vllm):
    r = recipe(tmp_path, "--use_vllm", "true", "--vllm_gpu_memory_utilization", "0.5", "--vllm_max_model_length",
               "256", "--vllm_model_impl", "transformers", "--per_device_train_batch_size", "8",
               "--gradient_accumulation_steps", "2", "--steps_per_generation", "4")
    lm = AutoModelForCausalLM.from_pretrained(TINY)
    generator = build_generator(r, None, lm, lm, accelerator(1), Sampling(8), {EOS}, 0)
    assert isinstance(generator, VLLMGenerator)
    llm = fake_vllm.instances[0]
    assert llm.kwargs == {
        "model": str(TINY), "revision": "main", "tensor_parallel_size": 1, "gpu_memory_utilization": 0.5,
        "max_model_len": 256, "max_num_seqs": 32, "enable_sleep_mode": False, "model_impl": "transformers",
        "distributed_executor_backend": "external_launcher", "seed": 1, "max_num_batched_tokens": 4096,
        "logprobs_mode": "processed_logprobs", "trust_remote_code": False}
    assert (os.environ["RANK"], os.environ["LOCAL_RANK"], os.environ["WORLD_SIZE"]) == ("1", "1", "2")
    assert os.environ["MASTER_ADDR"] == "localhost" and int(os.environ["MASTER_PORT"]) > 0
    assert llm.events == []  # no sleep without vllm_enable_sleep_mode


def test_each_completion_is_one_request_with_its_own_seed(tmp_path, fake_vllm):
    sampling = Sampling(max_completion_length=5, temperature=0.7, top_p=0.9, top_k=20, repetition_penalty=1.1)
    params = sampling_params(FakeSamplingParams, [11, 12], sampling, {2, 9})
    assert [p.kwargs for p in params] == [
        {"n": 1, "seed": seed, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.0,
         "repetition_penalty": 1.1, "max_tokens": 5, "logprobs": 0, "stop_token_ids": [2, 9]} for seed in (11, 12)]
    assert sampling_params(FakeSamplingParams, [3], Sampling(8), {2})[0].kwargs["top_k"] == 0  # TRL's: 0 = all

    r = recipe(tmp_path, "--use_vllm", "true")
    lm = AutoModelForCausalLM.from_pretrained(TINY)
    generator = VLLMGenerator(r, lm, accelerator(), sampling, {EOS})
    answers = {101: ([5, 6, EOS, 8], [-0.5, -0.25, -1.5, -3.0]), 102: ([5, 6, 7, 8, 9], [-1.0] * 5),
               103: ([EOS], [math.nan])}
    fake_vllm.script = lambda ids, p: answers[p.kwargs["seed"]]
    prompts = [[1, 40, 41], [1, 40, 41], [1, 50]]  # a repeated prompt: two requests, two seeds
    sampled = generator.sample(prompts, [101, 102, 103])
    ((sent, sent_params, use_tqdm),) = fake_vllm.generate_calls
    assert sent == [{"prompt_token_ids": p} for p in prompts] and use_tqdm is False
    assert [p.kwargs["seed"] for p in sent_params] == [101, 102, 103]
    assert [(s.completion_ids, s.truncated) for s in sampled] == [([5, 6, EOS], False), ([5, 6, 7, 8, 9], True),
                                                                  ([EOS], False)]
    assert sampled[0].sampling_logps == [-0.5, -0.25, -1.5] and sampled[1].sampling_logps == [-1.0] * 5
    assert math.isnan(sampled[2].sampling_logps[0])  # vLLM's NaN log-prob stays NaN (no correction there)


def test_weights_are_pushed_before_every_window_and_sleep_mode_wakes_them(tmp_path, fake_vllm):
    r = recipe(tmp_path, "--use_vllm", "true", "--vllm_enable_sleep_mode", "true")
    lm = AutoModelForCausalLM.from_pretrained(TINY)
    generator = VLLMGenerator(r, lm, accelerator(), Sampling(4), {EOS})
    llm = fake_vllm.instances[0]
    assert llm.events == ["sleep(2)"]
    for _ in range(2):
        generator.sample([[1, 40]], [5])
    pushes = len(list(lm.named_parameters()))
    window = ["wake_up(weights)", *["load_weights"] * pushes, "reset_prefix_cache", "wake_up(kv_cache)", "generate",
              "sleep(2)"]
    assert llm.events == ["sleep(2)", *window, *window]


def test_full_model_weights_go_under_their_checkpoint_names(tmp_path, fake_vllm):
    lm = AutoModelForCausalLM.from_pretrained(TINY)
    generator = VLLMGenerator(recipe(tmp_path, "--use_vllm", "true"), lm, accelerator(), Sampling(4), {EOS})
    generator.sync_weights()
    pushed = dict(fake_vllm.instances[0].pushed)
    state = lm.state_dict()
    assert len(pushed) == len(fake_vllm.instances[0].pushed)  # each name once (tied weights once)
    assert set(pushed) <= set(state) and set(state) - set(pushed) <= {"lm_head.weight"}  # tied to the embedding
    assert all(torch.equal(pushed[name], state[name]) for name in pushed)


@pytest.mark.parametrize("dora", [False, True])
def test_a_lora_is_pushed_merged_into_its_base_which_stays_untouched(tmp_path, fake_vllm, dora):
    from peft import LoraConfig, get_peft_model

    base = AutoModelForCausalLM.from_pretrained(TINY)
    expected_names = {name for name, _ in base.named_parameters()}
    lm = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                         modules_to_save=["norm"], use_dora=dora))
    with torch.no_grad():
        for name, param in lm.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:
                param.normal_(0, 0.5)  # a trained adapter and a trained copy of model.norm
    before = {n: p.detach().clone() for n, p in lm.named_parameters()}
    merged = copy.deepcopy(lm).merge_and_unload().state_dict()  # peft's merge
    generator = VLLMGenerator(recipe(tmp_path, "--use_vllm", "true", "--use_peft", "true"), lm, accelerator(),
                              Sampling(4), {EOS})
    generator.sync_weights()
    pushed = dict(fake_vllm.instances[0].pushed)
    assert set(pushed) == expected_names  # base names: no lora_A/B, no base_model.model. prefix, no .base_layer
    assert all(torch.allclose(pushed[name], merged[name], atol=1e-6) for name in pushed)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.allclose(pushed[q], before[f"base_model.model.{q.replace('.weight', '.base_layer.weight')}"])
    trained_norm = before["base_model.model.model.norm.modules_to_save.default.weight"]
    assert torch.equal(pushed["model.norm.weight"], trained_norm)
    assert all(torch.equal(p, before[n]) for n, p in lm.named_parameters())  # nothing in the trained model moved


def test_weight_names_follow_trls_rules():
    assert vllm_weight_name("model.layers.0._checkpoint_wrapped_module.mlp.up_proj.weight") == \
        "model.layers.0.mlp.up_proj.weight"
    assert vllm_weight_name("model.layers.1._orig_mod.self_attn.o_proj.weight") == \
        "model.layers.1.self_attn.o_proj.weight"
    peft = "lora_"
    assert vllm_weight_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight", peft) == \
        "model.layers.0.self_attn.q_proj.weight"
    assert vllm_weight_name("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight", peft) is None
    assert vllm_weight_name("base_model.model.lm_head.modules_to_save.default.weight", peft) == "lm_head.weight"
    assert vllm_weight_name("base_model.model.lm_head.original_module.weight", peft) is None


# ------------------------------------------------------------------------------ rollouts: the same rows layout
@contextmanager
def whole_model(model):
    yield model, False


def rollouts(r, tmp_path, name: str, eos_ids: set[int], generator):
    """Rollouts of 4 prompts stopping at `eos_ids`, sampled by `generator(source, loss module, lm)`."""
    tokenizer = AutoTokenizer.from_pretrained(TINY)
    rows = [json.loads(line) for line in (REPO / "data" / "prompt_completion.jsonl").read_text().splitlines()][:4]
    prompts = render_prompts([{"prompt": row["prompt"]} for row in rows], tokenizer, None)
    funcs, _ = load_reward_functions(r.reward_funcs)
    plan = WindowPlan(len(prompts), r.num_generations, r.per_device_train_batch_size, 1,
                      r.gradient_accumulation_steps, r.steps_per_generation, r.num_iterations, r.order_seed)
    (tmp_path / name).mkdir()
    source = RolloutSource.read(r, plan, prompts, funcs, tokenizer, accelerator(), DataParallel(1, 0, accelerator()),
                                tmp_path / name)
    source = dataclasses.replace(source, eos_ids=frozenset(eos_ids))
    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32)
    loss = GRPOLoss(lm, r, None)
    return Rollouts(source, Policy(loss, loss, generator(source, loss, lm)))


def test_the_vllm_path_writes_the_same_rollout_rows_as_generate_given_the_same_tokens(tmp_path, fake_vllm):
    """One window (2 prompts x 4 completions, 2 micro-batches) sampled by transformers' generate, then by the vLLM
    generator whose fake engine answers each request (by its seed) with the tokens generate sampled and, as its
    log-probs, the trained model's own: the same rollouts.jsonl rows and micro-batches; the vLLM path adds the
    stored old log-probs and importance weights of exactly 1."""
    common = ("--num_generations", "4", "--per_device_train_batch_size", "4", "--steps_per_generation", "2",
              "--max_completion_length", "6", "--mask_truncated_completions", "true")
    plain_recipe = recipe(tmp_path, *common, "--num_iterations", "2")  # stores old log-probs: vLLM's logps below

    def sample_plainly(name: str, eos_ids: set[int]):
        backend = SimpleNamespace(generation_context=whole_model, whole_sequences=nullcontext)
        feed = rollouts(plain_recipe, tmp_path, name, eos_ids, lambda source, model, lm: TransformersGenerator(
            backend, model, source.sampling, source.eos_ids, source.pad_id))
        feed.generate(0)
        return feed, [json.loads(line) for line in feed.file.read_text().splitlines()]

    # the random tiny model seldom samples its EOS: a token it sampled third in the first completion is made a second
    # EOS, so that the window holds ended and truncated completions
    _, probe = sample_plainly("probe", {EOS})
    eos_ids = {EOS, probe[0]["completion_ids"][2]}
    plain, plain_rows = sample_plainly("plain", eos_ids)
    assert {row["truncated"] for row in plain_rows} == {True, False}

    by_seed = {}
    for row, batch in zip(plain_rows, [b for b in plain.buffer for _ in range(len(b["input_ids"]))]):
        i = row["row"] % plain.plan.micro_batch
        start = len(row["prompt_ids"]) - 1
        logps = batch["old_logps"][i, start:start + len(row["completion_ids"])].tolist()
        by_seed[row_seed(plain_recipe.seed, 0, row["group"], row["row"] % 4)] = (row["completion_ids"], logps)
    fake_vllm.script = lambda ids, params: by_seed[params.kwargs["seed"]]

    vllm_recipe = recipe(tmp_path, *common, "--use_vllm", "true")
    fast = rollouts(vllm_recipe, tmp_path, "vllm", eos_ids, lambda source, model, lm: build_generator(
        vllm_recipe, None, model, lm, accelerator(), source.sampling, source.eos_ids, source.pad_id))
    fast.generate(0)
    fast_rows = [json.loads(line) for line in fast.file.read_text().splitlines()]
    assert len(fake_vllm.generate_calls) == 1 and len(fake_vllm.generate_calls[0][1]) == 8  # one call, 8 requests
    assert fast_rows == plain_rows
    assert {k for k in fast_rows[0]} >= {"prompt_ids", "completion_ids", "step", "group", "window", "row"}
    for mine, theirs in zip(fast.buffer, plain.buffer):
        for key in ("input_ids", "labels", "advantages", "num_examples", "old_logps"):
            assert torch.equal(mine[key], theirs[key]), key
        assert mine["sampling_weights"].shape == (len(mine["input_ids"]), 1)  # sequence_mask: one per completion
        assert torch.allclose(mine["sampling_weights"], torch.ones_like(mine["sampling_weights"]))
    assert "sampling_weights" not in plain.buffer[0]
    metrics = fast.generated_metrics[-1]  # TRL's vLLM metrics of the window
    assert metrics["sampling/sampling_logp_difference/mean"] == pytest.approx(0, abs=1e-6)
    assert [metrics[f"sampling/importance_sampling_ratio/{k}"] for k in ("min", "mean", "max")] == \
        pytest.approx([1, 1, 1])
    assert not any(name.startswith("sampling/") for name in plain.generated_metrics[-1])


def test_vllms_log_probs_are_recorded_and_correct_each_completion(tmp_path, fake_vllm):
    """The synchronous vLLM path's off-policy correction (issue 51): the fake engine answers every request with the
    same tokens and log-probs that differ from the trained model's, by more or less depending on the request's seed;
    each completion's rollouts.jsonl row records vLLM's log-probs as its behaviour_logps, and its importance weight is
    TRL's sequence_mask default computed here from a plain forward of the untrained tiny model:
    exp(sum_t (logp_t - vLLM's logp_t)), 0 above clip_max 3. Some completions are kept, some masked."""
    tokens = [7, 9, EOS]
    fake_vllm.script = lambda ids, params: (tokens, [-5.5] * 3 if params.kwargs["seed"] % 2 else [-7.5] * 3)
    r = recipe(tmp_path, "--num_generations", "4", "--per_device_train_batch_size", "4", "--steps_per_generation", "2",
               "--max_completion_length", "6", "--use_vllm", "true")
    feed = rollouts(r, tmp_path, "vllm", {EOS}, lambda source, model, lm: build_generator(
        r, None, model, lm, accelerator(), source.sampling, source.eos_ids, source.pad_id))
    feed.generate(0)
    rows = [json.loads(line) for line in feed.file.read_text().splitlines()]
    weights = [w for batch in feed.buffer for w in batch["sampling_weights"][:, 0].tolist()]
    plain = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32)
    expected = []
    for row in rows:
        seed = row_seed(r.seed, 0, row["group"], row["row"] % 4)
        vllm = [-5.5] * 3 if seed % 2 else [-7.5] * 3
        assert row["completion_ids"] == tokens and row["behaviour_logps"] == vllm
        with torch.no_grad():
            logits = plain(input_ids=torch.tensor([row["prompt_ids"] + tokens])).logits[0, -4:-1]
        logps = torch.log_softmax(logits, -1)[torch.arange(3), torch.tensor(tokens)]
        weight = math.exp((logps - torch.tensor(vllm)).sum().item())
        expected.append(0.0 if weight > 3.0 else weight)
    assert weights == pytest.approx(expected, rel=1e-4, abs=1e-7)
    assert 0 < sum(w > 0 for w in expected) < len(expected)


# ------------------------------------------------------------------------- TRL's importance-sampling correction
def trl_importance_sampling_ratio(old, sampling, mask, mode, clip_min, clip_max):
    """TRL 1.16 grpo_trainer.py, `_generate_and_score_completions`, transcribed (self.* -> arguments)."""
    per_token_logps_diff = (old - sampling) * mask
    per_token_logps_diff = torch.nan_to_num(per_token_logps_diff, nan=0.0)
    sequence_level_is = mode in ["sequence_mask", "sequence_truncate"]
    if sequence_level_is:
        per_sequence_logps_diff = per_token_logps_diff.sum(dim=-1, keepdim=True)
        logps_diff = per_sequence_logps_diff
    else:
        logps_diff = per_token_logps_diff
    ratio = torch.exp(logps_diff)
    if mode in ["sequence_truncate", "token_truncate"]:
        ratio = torch.clamp(ratio, min=clip_min, max=clip_max)
    elif mode in ["sequence_mask", "token_mask"]:
        min_val = clip_min if clip_min is not None else -math.inf
        max_val = clip_max if clip_max is not None else math.inf
        invalid = (ratio < min_val) | (ratio > max_val)
        ratio = ratio.masked_fill(invalid, value=0.0)
    return ratio


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize("clip", [(None, 3.0), (0.5, 2.0), (0.8, None)])
def test_importance_sampling_ratio_is_trls(mode, clip):
    generator = torch.Generator().manual_seed(3)
    old = -torch.rand(4, 6, generator=generator) * 3
    sampling = old + torch.randn(4, 6, generator=generator) * 0.6  # some tokens far enough to clip / mask
    sampling[2] = old[2] - 0.5  # a completion vLLM found much less likely: a sequence ratio of e^4
    sampling[2, 3] = old[2, 3] - 1.5  # with one token's ratio e^1.5 > 3
    sampling[0] = old[0] + 0.5  # and one it found more likely: e^-2 (4 masked tokens)
    sampling[1, 2] = math.nan  # vLLM gave no log-prob there
    mask = torch.ones(4, 6)
    mask[0, 4:] = 0
    mask[3, 1:] = 0
    ours = vllm_importance_sampling_ratio(old, sampling, mask.bool(), mode, *clip)
    theirs = trl_importance_sampling_ratio(old, sampling, mask, mode, *clip)
    assert ours.shape == ((4, 1) if mode.startswith("sequence") else (4, 6))
    assert torch.equal(ours, theirs)
    assert not torch.isnan(ours).any()
    assert ((ours == 0).any() if mode.endswith("_mask") else (ours < 1).any() and (ours > 1).any())


def test_the_correction_weights_each_token_loss_before_the_kl_term():
    """TRL's `_compute_loss`: per_token_loss = -min(...) * importance_sampling_ratio, then + beta * kl."""
    generator = torch.Generator().manual_seed(5)
    logps = (-torch.rand(3, 5, generator=generator) * 2).requires_grad_()
    old = logps.detach() + torch.randn(3, 5, generator=generator) * 0.1
    ref = logps.detach() + torch.randn(3, 5, generator=generator) * 0.1
    adv, mask = torch.tensor([1.0, -0.5, 0.25]), torch.ones(3, 5, dtype=torch.bool)
    weights = torch.rand(3, 5, generator=generator) + 0.5
    settings = LossSettings(beta=0.3)
    loss, ratio, kl = per_token_loss(logps, old, ref, adv, mask, settings, weights)
    rho = torch.exp(logps - old)
    expected = -torch.min(rho * adv[:, None], torch.clamp(rho, 0.8, 1.2) * adv[:, None]) * weights
    expected = expected + 0.3 * (torch.exp(ref - logps) - (ref - logps) - 1) * rho
    assert torch.allclose(loss, expected)
    unweighted, _, _ = per_token_loss(logps, old, ref, adv, mask, settings)
    assert not torch.allclose(unweighted, loss)


# ----------------------------------------------------------------------------------------------- the refusals
def problems(tmp_path, *extra: str) -> str:
    with pytest.raises(ConfigError) as info:
        recipe(tmp_path, *extra)
    return str(info.value)


def test_the_recipe_refuses_what_the_colocated_mode_does_not_run(tmp_path):
    text = problems(tmp_path, "--use_vllm", "true", "--vllm_mode", "server", "--vllm_tensor_parallel_size", "2",
                    "--vllm_gpu_memory_utilization", "1.5", "--use_peft", "true", "--load_in_4bit", "true",
                    "--vllm_importance_sampling_clip_min", "4")
    for expected in ("vllm_mode: server is refused: hftrain implements TRL's colocated mode only",
                     "vllm_tensor_parallel_size=2 is refused", "vllm_gpu_memory_utilization must be in (0, 1]",
                     "use_vllm with load_in_4bit / load_in_8bit (QLoRA) is refused",
                     "vllm_importance_sampling_clip_min (4.0) must be less than vllm_importance_sampling_clip_max"):
        assert expected in text
    assert "use_vllm with tp_size=2 is refused" in problems(tmp_path, "--use_vllm", "true", "--tp_size", "2")
    truncate = problems(tmp_path, "--use_vllm", "true", "--vllm_importance_sampling_mode", "token_truncate",
                        "--vllm_importance_sampling_clip_max", "none")
    assert "vllm_importance_sampling_mode=token_truncate clips the ratio" in truncate
    stray = problems(tmp_path, "--vllm_gpu_memory_utilization", "0.5")
    assert "vllm_gpu_memory_utilization set without use_vllm: true" in stray
    ok = recipe(tmp_path, "--use_vllm", "true", "--use_peft", "true")  # LoRA: merged for each push
    assert (ok.vllm_mode, ok.vllm_gpu_memory_utilization, ok.vllm_tensor_parallel_size, ok.vllm_enable_sleep_mode,
            ok.vllm_importance_sampling_correction, ok.vllm_importance_sampling_mode,
            ok.vllm_importance_sampling_clip_max, ok.vllm_importance_sampling_clip_min) == \
        ("colocate", 0.3, 1, False, True, "sequence_mask", 3.0, None)  # TRL 1.16's defaults


def launch(kind: str, zero_stage: int | None = None) -> Launch:
    return SimpleNamespace(kind=kind, zero_stage=zero_stage)


def test_the_preflight_refuses_a_machine_or_strategy_vllm_cannot_run_on(tmp_path, monkeypatch):
    r = recipe(tmp_path, "--use_vllm", "true")
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else
                        real_find_spec(name, *a))
    text = " ".join(vllm_problems(r, launch("single"), cuda=False))
    assert "use_vllm: true needs a CUDA GPU" in text
    assert "needs the vllm package, which is not installed: pip install 'hftrain[vllm]'" in text
    assert "vllm==0.31.0" in text and "transformers < 5.18, so pip installs transformers 5.17.x beside it" in text
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else
                        real_find_spec(name, *a))
    assert vllm_problems(r, launch("ddp"), cuda=True) == []
    assert vllm_problems(r, launch("deepspeed", 2), cuda=True) == []
    assert "use_vllm with DeepSpeed ZeRO-3 is refused" in vllm_problems(r, launch("deepspeed", 3), cuda=True)[0]
    assert "use_vllm with FSDP2 is refused" in vllm_problems(r, launch("fsdp2"), cuda=True)[0]
    assert vllm_problems(recipe(tmp_path), launch("fsdp2"), cuda=False) == []


def test_the_preflight_refuses_async_lora_under_a_sharding_strategy_before_the_model_loads(tmp_path):
    lora = recipe(tmp_path, "--async_generation", "true", "--use_peft", "true")
    assert "async_generation with use_peft under FSDP2 is refused" in async_problems(lora, launch("fsdp2"))[0]
    assert "under DeepSpeed ZeRO-3 is refused" in async_problems(lora, launch("deepspeed", 3))[0]
    assert async_problems(lora, launch("ddp")) == async_problems(lora, launch("deepspeed", 2)) == []
    assert async_problems(recipe(tmp_path, "--async_generation", "true"), launch("fsdp2")) == []


def test_the_dev_extra_does_not_pull_vllm():
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["vllm"] == ["vllm==0.31.0"]
    assert not any(req.startswith("vllm") or "[vllm" in req for name in extras if name != "vllm"
                   for req in extras[name])


def test_a_generation_window_counts_as_progress_for_the_hang_watchdog(tmp_path):
    """The loop's batches sample a window's completions inside `busy("generation")` (the run passes its watchdog's
    window): a generation longer than hang_timeout is not taken for a stalled step."""
    feed = rollouts(recipe(tmp_path, "--num_generations", "4", "--per_device_train_batch_size", "4",
                           "--steps_per_generation", "2"), tmp_path, "busy", {EOS}, lambda source, model, lm: None)
    events = []

    @contextmanager
    def busy(name):
        events.append(("enter", name))
        yield
        events.append(("leave", name))

    def generate(window):
        events.append(("generate", window))
        feed.window, feed.buffer = window, [{"input_ids": torch.ones(1)}, {"input_ids": torch.ones(1)}]

    feed.busy, feed.generate, feed.truncate_rows = busy, generate, lambda window: None
    assert len(list(feed.loader([(0, 0, 0), (0, 1, 0), (1, 0, 0)]))) == 3
    assert events == [("enter", "generation"), ("generate", 0), ("leave", "generation"),
                      ("enter", "generation"), ("generate", 1), ("leave", "generation")]
