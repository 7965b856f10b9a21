"""async_worker: vllm_server's HTTP client (hftrain/rl/vllm_server.py) against the stand-in `vllm serve`
(tests/vllm_server.py): the completions and their behaviour log-probs equal the transformers worker's for the same
seeds and weights, the weight-update handshake is TRL's, and a server that refuses, fails or times out is retried a
bounded number of times and then named; the recipe refuses the worker kind until its weight transfer is written."""

from __future__ import annotations

import copy
import time

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hftrain.config import ConfigError, load_recipe
from hftrain.rl.async_worker import WorkerFailure, WorkerSpec, sampling_version
from hftrain.rl.rollouts import Sampling, WindowPlan, generate_rows, row_seed
from hftrain.rl.vllm_server import ServerFailure, ServerRolloutWorker, VLLMServer, weight_update_info
from tests.vllm_server import StandInServer

EOS, PAD = 2, 0
SAMPLING = Sampling(max_completion_length=6, temperature=0.7)
PROMPTS = [[5, 9, 11], [7, 3, 20, 31, 8], [40, 41]]


def tiny_lm(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=48, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         eos_token_id=EOS, pad_token_id=PAD)
    return LlamaForCausalLM(config).eval()


def plain_log_probs(model, prompt: list[int], ids: list[int], temperature: float) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0].float()
    logps = torch.log_softmax(logits / temperature, -1)
    return [logps[len(prompt) - 1 + i, t].item() for i, t in enumerate(ids)]


@pytest.fixture
def served():
    server = StandInServer(tiny_lm(0), pad_id=PAD)
    yield server
    server.stop()


def sample(client: VLLMServer, window: int) -> list:
    return [client.complete(p, row_seed(7, window, g, 0), SAMPLING, {EOS}) for g, p in enumerate(PROMPTS)]


def test_completions_and_behaviour_log_probs_equal_the_transformers_workers(served):
    client = VLLMServer(served.url, timeout=30, retries=0)
    client.wait_ready(10)
    reference = tiny_lm(0)  # the transformers worker's copy of the same weights
    for version, window in ((0, 0), (1, 1)):
        if version:  # a weight push: the handshake over HTTP, the tensors by the transport (played by the test)
            trained = tiny_lm(1)
            state = trained.state_dict()
            client.update_weights(weight_update_info(state), timeout=30)
            served.load(copy.deepcopy(state))
            reference.load_state_dict(state)
        got = sample(client, window)
        seeds = [row_seed(7, window, g, 0) for g in range(len(PROMPTS))]
        with torch.no_grad():
            rows = generate_rows(reference, PROMPTS, seeds, SAMPLING, {EOS}, PAD)  # batched, left-padded
        assert [(c.token_ids, c.truncated) for c in got] == rows
        assert any(truncated for _, truncated in rows) or any(ids[-1] == EOS for ids, _ in rows)
        for prompt, c in zip(PROMPTS, got):
            torch.testing.assert_close(c.log_probs, plain_log_probs(reference, prompt, c.token_ids, 0.7))
    assert sample(client, 1) == got  # the seed decides the sample
    assert sample(client, 2) != got


def test_a_weight_push_is_trls_handshake_announcing_every_tensor(served):
    client = VLLMServer(served.url, timeout=30, retries=0)
    state = tiny_lm(1).state_dict()
    info = weight_update_info(state)
    client.update_weights(info, timeout=30)
    assert [route for route, _ in served.calls] == ["/pause", "/start_weight_update", "/update_weights",
                                                    "/finish_weight_update", "/resume"]
    sent = served.calls[2][1]["update_info"]
    assert sent["names"] == list(state) and sent["shapes"] == [list(t.shape) for t in state.values()]
    assert set(sent["dtype_names"]) == {"float32"}
    assert served.calls[1][1] == {"is_checkpoint_format": True}


def test_a_failing_server_is_retried_then_named(served):
    client = VLLMServer(served.url, timeout=30, retries=2, backoff=0.01)
    client.wait_ready(10)
    served.fail["/v1/completions"] = 2
    assert client.complete(PROMPTS[0], 1, SAMPLING, {EOS}).token_ids  # two 500s, then an answer
    served.fail["/v1/completions"] = 3
    with pytest.raises(ServerFailure) as info:
        client.complete(PROMPTS[0], 1, SAMPLING, {EOS})
    assert f"the vLLM server at {served.url} did not answer POST /v1/completions after 3 attempts" in str(info.value)
    assert "HTTP 500" in str(info.value)
    served.fail["/update_weights"] = 1
    with pytest.raises(ServerFailure, match="POST /update_weights"):
        VLLMServer(served.url, timeout=30, retries=0).update_weights({"names": []}, timeout=30)


def test_a_server_that_times_out_is_retried_then_named(served):
    client = VLLMServer(served.url, timeout=0.3, retries=1, backoff=0.01)
    client.wait_ready(10)
    served.delay = 1.0
    started = time.monotonic()
    with pytest.raises(ServerFailure) as info:
        client.complete(PROMPTS[0], 1, SAMPLING, {EOS})
    assert "after 2 attempts (0.3 s each" in str(info.value) and "timed out" in str(info.value)
    assert len([r for r, _ in served.calls if r == "/v1/completions"]) == 2
    assert time.monotonic() - started < 5


def test_a_server_not_started_or_killed_is_named(served):
    client = VLLMServer(served.url, timeout=5, retries=2, backoff=0.01)
    client.wait_ready(10)
    assert client.complete(PROMPTS[0], 1, SAMPLING, {EOS}).token_ids
    served.stop()  # killed mid-run
    with pytest.raises(ServerFailure) as info:
        client.complete(PROMPTS[0], 1, SAMPLING, {EOS})
    assert "did not answer POST /v1/completions after 3 attempts" in str(info.value)
    assert "ConnectionRefusedError" in str(info.value)
    with pytest.raises(ServerFailure, match=f"at {served.url} was not ready .* within vllm_server_timeout 0.5 s"):
        VLLMServer(served.url, timeout=5, retries=0).wait_ready(0.5, poll=0.1)  # never (re)started


def test_recipe_refuses_the_server_worker_until_its_weight_transfer_is_written(tmp_path):
    base = ["--config", "recipes/tiny-grpo-async.yaml", "--output_dir", str(tmp_path / "o")]
    with pytest.raises(ConfigError) as info:
        load_recipe([*base, "--async_worker", "vllm_server", "--vllm_server_retries", "-1"])
    text = str(info.value)
    assert "async_worker: vllm_server is refused" in text and "NCCL weight-transfer backend" in text
    assert "vllm_server_retries must be >= 0" in text
    with pytest.raises(ConfigError, match="vllm_server_base_url set without async_worker: vllm_server"):
        load_recipe([*base, "--vllm_server_base_url", "http://h:1"])
    assert load_recipe(base).async_worker == "transformers"


def worker_spec(prompts, last_window: int, sync: int, stale: int) -> WorkerSpec:
    plan = WindowPlan(num_prompts=len(prompts), num_generations=2, micro_batch=2, world=1, accum=1,
                      steps_per_generation=1, num_iterations=1, seed=3)
    return WorkerSpec(None, torch.float32, prompts, plan, 0, 7, SAMPLING, frozenset({EOS}), PAD, 0.7, False, 0,
                      last_window, sync, stale, 1)


def test_the_server_worker_samples_each_window_with_its_policy_version_as_the_transformers_worker(served):
    """The trainer's calls as grpo makes them (push the version due at the window's step, then take the window):
    each window comes back sampled by sampling_version's weights, with the rows, seeds, tokens and behaviour
    log-probs the transformers worker computes with those weights."""
    spec = worker_spec(PROMPTS + [[12, 13, 14]], 4, 1, 1)
    client = VLLMServer(served.url, timeout=30, retries=0)
    client.wait_ready(10)
    lm = tiny_lm(0)
    worker = ServerRolloutWorker(spec, lm, 1, client, lambda state: served.load(copy.deepcopy(state)), 30)
    reference, G = tiny_lm(0), 2
    for window in range(4):
        lm.load_state_dict(tiny_lm(window).state_dict())  # the weights after `window` steps: version `window`
        worker.push(window)
        item = worker.take(window)
        version = sampling_version(window, 1, 1)
        reference.load_state_dict(tiny_lm(version).state_dict())
        rows = spec.plan.rank_rows(0)
        prompts = [spec.prompts[spec.plan.window_prompts(window)[r // G]] for r in rows]
        seeds = [row_seed(7, window, r // G, r % G) for r in rows]
        with torch.no_grad():
            sampled = generate_rows(reference, prompts, seeds, SAMPLING, {EOS}, PAD)
        assert (item.window, item.version, item.seeds) == (window, version, seeds)
        assert [(ids, truncated) for ids, truncated, _ in item.completions] == sampled
        for prompt, (ids, _, got) in zip(prompts, item.completions):
            torch.testing.assert_close(got, plain_log_probs(reference, prompt, ids, 0.7), atol=1e-5, rtol=1e-5)
    pushes = [route for route, _ in served.calls if route == "/update_weights"]
    assert len(pushes) == 3  # versions 0, 1 and 2 sample windows 0-3; version 3 is never needed
    worker.kill()


def test_a_server_worker_whose_server_dies_names_it_to_the_trainer(served):
    spec = worker_spec(PROMPTS + [[12, 13, 14]], 4, 1, 0)
    client = VLLMServer(served.url, timeout=5, retries=1, backoff=0.01)
    client.wait_ready(10)
    lm = tiny_lm(0)
    worker = ServerRolloutWorker(spec, lm, 1, client, lambda state: served.load(copy.deepcopy(state)), 30)
    worker.push(0)
    assert worker.take(0).window == 0
    served.stop()
    worker.push(1)
    with pytest.raises(WorkerFailure) as info:
        worker.take(1)
    text = str(info.value)
    assert text.startswith(f"the rollout worker of process 0 (the vLLM server at {served.url}) failed: "
                           f"ServerFailure: the vLLM server at {served.url} did not answer POST /pause after 2 "
                           "attempts")
