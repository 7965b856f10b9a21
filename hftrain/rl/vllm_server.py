"""async_worker: vllm_server's client: the HTTP API of a stock `vllm serve` as TRL 1.16's experimental async GRPO
uses it (trl/experimental/async_grpo/vllm_client.py and async_rollout_worker.py) and vLLM documents it
(docs.vllm.ai, "Weight Transfer": the RLHF routes behind VLLM_SERVER_DEV_MODE=1).

- generation: POST /v1/completions, one completion per request with the prompt's token ids, the completion's seed
  (`rollouts.row_seed`, as the transformers worker), `logprobs: 0` (the sampled token's log-prob) and
  `return_token_ids: true`; the completion's tokens and those log-probs (the behaviour log-probs) come back;
- weights: POST /pause, /start_weight_update, /update_weights {update_info: names, dtype_names, shapes},
  /finish_weight_update, /resume, in TRL's order; the tensors themselves travel by vLLM's weight-transfer backend
  (NCCL broadcast on CUDA), which is not written here (`hftrain.fields.grpo.async_problems` refuses the worker kind);
- faults: a request the server refuses (connection refused or reset, a 5xx answer) or leaves unanswered past its
  timeout is retried `retries` times with a doubling pause (TRL retries three times), then `ServerFailure` names the
  server, the route and the last error in one paragraph; a 4xx answer is not retried.

Standard library only (urllib), so the client needs nothing vLLM installs."""

from __future__ import annotations

import json
import queue
import threading
import time
import traceback
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass

import torch

from hftrain.rl.async_worker import SampledWindow, WindowQueue, WorkerFailure, sampling_version
from hftrain.rl.rollouts import Sampling, row_seed


class ServerFailure(Exception):
    """The vLLM server refused, timed out or answered an error; the message names it."""


@dataclass(frozen=True)
class ServedCompletion:
    token_ids: list[int]  # up to and including the stop token
    log_probs: list[float]  # the server's log-prob of each sampled token (the behaviour log-probs)
    truncated: bool  # cut at max_tokens (finish_reason "length")


def weight_update_info(state: dict[str, torch.Tensor]) -> dict:
    """What /update_weights announces before the tensors travel: each parameter's name, dtype and shape in send
    order (TRL's weight_update_info)."""
    return {"names": list(state), "dtype_names": [str(t.dtype).removeprefix("torch.") for t in state.values()],
            "shapes": [list(t.shape) for t in state.values()]}


class VLLMServer:
    """One `vllm serve` at `base_url`: `timeout` seconds per request, `retries` retries of a refused or timed-out
    request (pauses of `backoff`, doubling)."""

    def __init__(self, base_url: str, timeout: float, retries: int, backoff: float = 1.0):
        self.base_url, self.timeout, self.retries, self.backoff = base_url.rstrip("/"), timeout, retries, backoff
        self.model: str | None = None

    def request(self, method: str, path: str, payload: dict | None = None, params: dict | None = None,
                timeout: float | None = None) -> dict:
        url = f"{self.base_url}{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
        data = None if payload is None else json.dumps(payload).encode()
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            req = urllib.request.Request(url, data=data, method=method,
                                         headers={"Content-Type": "application/json"} if data else {})
            try:
                with urllib.request.urlopen(req, timeout=timeout or self.timeout) as answer:
                    body = answer.read()
                return json.loads(body) if body.strip() else {}
            except urllib.error.HTTPError as exc:
                text = exc.read().decode(errors="replace")[:300]
                if exc.code < 500:
                    raise ServerFailure(f"the vLLM server at {self.base_url} answered {method} {path} with HTTP "
                                        f"{exc.code}: {text}") from None
                last = f"HTTP {exc.code}: {text}"
            except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
                reason = getattr(exc, "reason", exc)
                last = f"{type(reason).__name__}: {reason}"
        raise ServerFailure(
            f"the vLLM server at {self.base_url} did not answer {method} {path} after {self.retries + 1} attempts "
            f"({self.timeout:g} s each; last: {last}); check that `vllm serve` runs there (with "
            "VLLM_SERVER_DEV_MODE=1 for the weight-update routes), or raise request_timeout / vllm_server_retries")

    def wait_ready(self, deadline_seconds: float, poll: float = 1.0) -> None:
        """GET /health until it answers 200 (TRL's wait_for_server_ready), then the served model's name
        (/v1/models); ServerFailure after `deadline_seconds`."""
        started = time.monotonic()
        while True:
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=min(5.0, self.timeout)) as answer:
                    if answer.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() - started >= deadline_seconds:
                raise ServerFailure(f"the vLLM server at {self.base_url} was not ready (GET /health) within "
                                    f"vllm_server_timeout {deadline_seconds:g} s; start `vllm serve` there or "
                                    "raise vllm_server_timeout")
            time.sleep(poll)
        self.model = self.request("GET", "/v1/models")["data"][0]["id"]

    def complete(self, prompt_ids: list[int], seed: int, sampling: Sampling, stop_ids: set[int]) -> ServedCompletion:
        """One completion of `prompt_ids` sampled with `seed` (TRL's payload, one completion per request)."""
        payload = {"model": self.model, "prompt": prompt_ids, "max_tokens": sampling.max_completion_length,
                   "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
                   "repetition_penalty": sampling.repetition_penalty, "n": 1, "seed": seed, "logprobs": 0,
                   "return_token_ids": True, "stop_token_ids": sorted(stop_ids), "skip_special_tokens": False}
        choice = self.request("POST", "/v1/completions", payload)["choices"][0]
        ids, logps = list(choice["token_ids"]), [float(x) for x in choice["logprobs"]["token_logprobs"]]
        if len(ids) != len(logps):
            raise ServerFailure(f"the vLLM server at {self.base_url} returned {len(ids)} tokens but {len(logps)} "
                                "log-probs for one completion")
        return ServedCompletion(ids, logps, choice.get("finish_reason") == "length")

    def update_weights(self, info: dict, timeout: float) -> None:
        """The weight-update handshake around one transfer (TRL's pause, start, update, finish, resume)."""
        self.request("POST", "/pause", params={"mode": "keep"})
        self.request("POST", "/start_weight_update", {"is_checkpoint_format": True})
        self.request("POST", "/update_weights", {"update_info": info}, timeout=timeout)
        self.request("POST", "/finish_weight_update", timeout=timeout)
        self.request("POST", "/resume")


class ServerRolloutWorker(WindowQueue):
    """async_worker: vllm_server: the trainer's side of one rank's rollout worker when a vLLM server samples, behind
    the interface of `async_worker.RolloutWorker` (a `WindowQueue`, with its own send, check and kill). A
    thread of the trainer's process walks the windows of `spec` (an `async_worker.WorkerSpec`) in order, as the
    transformers worker does: before window w it brings the server to policy version `sampling_version(w)` (the
    pushes it was given, in order: the handshake of `VLLMServer.update_weights` around `transport(state)`, which
    moves the tensors), then requests each of this rank's rows of w with its row seed and puts the window, with the
    server's log-probs as its behaviour log-probs, in a queue of `bound` windows. A server that fails (after its
    retries) ends the thread; the trainer's next take raises `WorkerFailure` naming the server."""

    def __init__(self, spec, lm, bound: int, server: VLLMServer, transport, sync_timeout: float):
        super().__init__(spec, queue.Queue(maxsize=bound))
        self.lm, self.server, self.transport, self.sync_timeout = lm, server, transport, sync_timeout
        self.pushes: queue.Queue = queue.Queue()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.run, name=f"hftrain-vllm-server-worker-{spec.rank}", daemon=True)
        self.thread.start()

    @property
    def name(self) -> str:
        return f"the rollout worker of process {self.spec.rank} (the vLLM server at {self.server.base_url})"

    def send(self, version: int) -> None:
        """Hand the current weights (a CPU copy) to the thread; it sends them when a window needs them."""
        self.pushes.put((version, {k: v.detach().to("cpu", copy=True) for k, v in self.lm.state_dict().items()}))

    def run(self) -> None:
        spec, plan = self.spec, self.spec.plan
        G, rows, version = plan.num_generations, plan.rank_rows(spec.rank), -1
        try:
            for window in range(spec.first_window, spec.last_window):
                waited = time.perf_counter()
                need = sampling_version(window, spec.weight_sync_steps, spec.max_staleness)
                while version < need:
                    item = self.pushes.get()
                    if item is None:
                        return
                    version, state = item
                    self.server.update_weights(weight_update_info(state), self.sync_timeout)
                    self.transport(state)
                started = time.perf_counter()
                index = plan.window_prompts(window)
                seeds = [row_seed(spec.seed, window, row // G, row % G) for row in rows]
                served = [self.server.complete(spec.prompts[index[row // G]], s, spec.sampling, set(spec.eos_ids))
                          for row, s in zip(rows, seeds)]
                item = SampledWindow(window, version, seeds, [(c.token_ids, c.truncated, c.log_probs) for c in served],
                                     time.perf_counter() - started, started - waited)
                while not self.stopping.is_set():
                    try:
                        self.results.put(item, timeout=0.5)
                        break
                    except queue.Full:
                        continue
                if self.stopping.is_set():
                    return
        except BaseException as exc:  # noqa: BLE001 - reported to the trainer, which stops the run naming it
            self.results.put(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc(limit=4)))

    def check(self, window: int, started_at: float) -> None:
        if not self.thread.is_alive() and self.results.empty():
            raise WorkerFailure(f"{self.name} stopped before generation batch {window}") from None

    def kill(self) -> None:
        """Stop the thread after its current request (a daemon thread: an exiting trainer does not wait for it)."""
        self.stopping.set()
        self.pushes.put(None)
