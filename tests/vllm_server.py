"""A stand-in `vllm serve` on 127.0.0.1 for the vLLM-server rollout worker's tests: the routes TRL 1.16's async GRPO
calls (trl/experimental/async_grpo/vllm_client.py, async_rollout_worker.py) with vLLM's request and answer shapes,
generating with transformers on a tiny model.

- GET /health -> 200; GET /v1/models -> {"data": [{"id": name, "max_model_len": n}]}
- POST /v1/completions {model, prompt: token ids, max_tokens, temperature, top_p, top_k, repetition_penalty, seed,
  logprobs: 0, return_token_ids, stop_token_ids} -> {"choices": [{token_ids, logprobs: {token_logprobs},
  finish_reason: "stop" | "length"}]}: one completion sampled by hftrain's row-seeded sampler with the request's
  seed; the log-probs are the served model's log-softmax(logits / temperature) of each sampled token (vLLM's
  `--logprobs-mode processed_logprobs` with top_k / top_p off)
- POST /pause, /resume, /start_weight_update, /update_weights {update_info}, /finish_weight_update: recorded in
  `calls`; the tensors, which vLLM receives by NCCL, arrive here by `load(state_dict)` (the test plays the transport)

`fail` {route: n} answers the next n requests of a route with 500; `delay` seconds stalls every completion (a
server that times out); `stop()` kills it (later requests are refused).
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse

import torch

from hftrain.rl.rollouts import Sampling, generate_rows

NAME = "tiny-standin"


class StandInServer:
    def __init__(self, model, pad_id: int = 0, max_model_len: int = 256):
        self.model, self.pad_id, self.max_model_len = model.eval(), pad_id, max_model_len
        self.calls: list[tuple[str, dict]] = []
        self.fail: dict[str, int] = {}
        self.delay = 0.0
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def answer(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                route = urlparse(self.path).path
                if route == "/health":
                    return self.answer(200, {})
                if route == "/v1/models":
                    return self.answer(200, {"data": [{"id": NAME, "max_model_len": server.max_model_len}]})
                return self.answer(404, {"error": route})

            def do_POST(self):
                route = urlparse(self.path).path
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                server.calls.append((route, body))
                if server.fail.get(route, 0) > 0:
                    server.fail[route] -= 1
                    return self.answer(500, {"error": "injected"})
                if route == "/v1/completions":
                    time.sleep(server.delay)
                    return self.answer(200, server.complete(body))
                if route in ("/pause", "/resume", "/start_weight_update", "/update_weights", "/finish_weight_update"):
                    return self.answer(200, {})
                return self.answer(404, {"error": route})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def complete(self, body: dict) -> dict:
        assert body["model"] == NAME and body["n"] == 1 and body["logprobs"] == 0 and body["return_token_ids"]
        sampling = Sampling(body["max_tokens"], body["temperature"], body["top_p"], body["top_k"],
                            body["repetition_penalty"])
        prompt = list(body["prompt"])
        with self.lock, torch.no_grad():
            [(ids, truncated)] = generate_rows(self.model, [prompt], [body["seed"]], sampling,
                                               set(body["stop_token_ids"]), self.pad_id)
            logits = self.model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].float()
            logps = torch.log_softmax(logits / body["temperature"], -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
        return {"choices": [{"token_ids": ids, "logprobs": {"token_logprobs": logps.tolist()},
                             "finish_reason": "length" if truncated else "stop"}]}

    def load(self, state: dict) -> None:
        with self.lock:
            self.model.load_state_dict(state)

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
