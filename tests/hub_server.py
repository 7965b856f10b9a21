"""A fake Hugging Face hub on 127.0.0.1 for the push tests: the endpoints huggingface_hub 2.4's `create_repo`,
`create_branch` and `upload_folder` call (read from its hf_api.py, _commit_api.py and _upload_pipeline.py), recording
what arrived.

- POST /api/repos/create            {name, organization, visibility, type} -> {"url": endpoint/namespace/name}
- POST /api/models/<repo>/branch/<branch>
- POST /api/models/<repo>/preupload/<revision> {files: [{path, sample, size}]} -> every file "regular" (inline in
  the commit, no LFS / Xet transfer)
- POST /api/models/<repo>/commit/<revision>    x-ndjson: a header line, then {"key": "file", "value": {path, content
  (base64)}} per file -> {commitUrl, commitOid}
- POST /api/validate-yaml (the non-Xet commit path checks a README's metadata first): as the hub, it refuses a card
  whose `base_model` or `datasets` names something other than a repo id (a local path: the hub's 400 "is not valid.
  If possible, use a dataset id from https://hf.co/datasets", the failure of TRL's, transformers' and axolotl's
  pushes from a local base model)

`fail` makes chosen requests answer 500: {route: {n, ...}} fails the n-th request (from 1) of that route ("create",
"branch", "preupload", "commit"). A request without an `Authorization: Bearer` header gets 401.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import yaml

USER = "tester"  # the namespace a bare repo name lands in (the token's owner)
ROUTE = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/(?P<route>preupload|commit|branch)/(?P<rev>[^?]+)")


REPO_ID = re.compile(r"^(?!.*(--|\.\.))[\w.-]{1,96}(/[\w.-]{1,96})?$")  # huggingface_hub's validate_repo_id


def card_metadata_errors(readme: str) -> list[dict]:
    """The hub's refusals of a README's front matter that hftrain's cards could meet: base_model and datasets entries
    must be repo ids."""
    if not readme.startswith("---\n"):
        return []
    metadata = yaml.safe_load(readme.split("---\n", 2)[1]) or {}
    errors = []
    for key, kind in (("base_model", "model"), ("datasets", "dataset")):
        values = metadata.get(key) or []
        for i, value in enumerate([values] if isinstance(values, str) else values):
            if not REPO_ID.match(str(value)):
                errors.append({"message": f'"{key}[{i}]" with value "{value}" is not valid. If possible, use a '
                                          f"{kind} id from https://hf.co/{kind}s."})
    return errors


@dataclass
class Repo:
    private: bool | None
    branches: dict[str, dict[str, bytes]] = field(default_factory=lambda: {"main": {}})
    commits: list[tuple[str, str, list[str]]] = field(default_factory=list)  # (branch, message, paths)


class FakeHub:
    def __init__(self, fail: dict[str, set[int]] | None = None):
        self.fail = fail or {}
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str, int]] = []  # (route, path, status)
        self.tokens: set[str] = set()
        self.counts: dict[str, int] = {}
        self.lock = threading.Lock()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_POST(self):  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                status, answer = hub.handle(self.path, self.headers, body)
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    # ------------------------------------------------------------------------------------------- handling
    def handle(self, path: str, headers, body: bytes) -> tuple[int, dict]:
        with self.lock:
            route = "create" if path == "/api/repos/create" else "validate-yaml" if path == "/api/validate-yaml" \
                else (m.group("route") if (m := ROUTE.match(path)) else "unknown")
            self.counts[route] = self.counts.get(route, 0) + 1
            status, answer = self._answer(route, path, headers, body)
            self.requests.append((route, path, status))
            return status, answer

    def _answer(self, route: str, path: str, headers, body: bytes) -> tuple[int, dict]:
        auth = headers.get("Authorization", "")
        if not auth.startswith("Bearer "):
            return 401, {"error": "Invalid credentials in Authorization header"}
        self.tokens.add(auth.removeprefix("Bearer "))
        if self.counts[route] in self.fail.get(route, ()):
            return 500, {"error": "Internal Error (fake hub: failing this request on purpose)"}
        if route == "create":
            payload = json.loads(body)
            repo_id = f"{payload.get('organization') or USER}/{payload['name']}"
            visibility = payload.get("visibility")
            self.repos.setdefault(repo_id, Repo(private=None if visibility is None else visibility == "private"))
            return 200, {"url": f"{self._endpoint(headers)}/{repo_id}", "name": repo_id}
        if route == "validate-yaml":
            errors = card_metadata_errors(json.loads(body)["content"])
            return (400 if errors else 200), {"errors": errors, "warnings": []}
        match = ROUTE.match(path)
        if match is None:
            return 404, {"error": f"fake hub: no endpoint {path}"}
        repo = self.repos.get(match.group("repo"))
        if repo is None:
            return 404, {"error": "Repository not found"}
        revision = match.group("rev")
        if route == "branch":
            repo.branches.setdefault(revision, dict(repo.branches["main"]))
            return 200, {}
        if revision not in repo.branches:
            return 404, {"error": f"Invalid rev id: {revision}"}
        if route == "preupload":
            files = json.loads(body)["files"]
            return 200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False, "oid": None}
                                   for f in files]}
        lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
        header = lines[0]["value"]
        paths = []
        for line in lines[1:]:
            if line["key"] != "file":
                return 400, {"error": f"fake hub: unsupported commit operation {line['key']}"}
            repo.branches[revision][line["value"]["path"]] = base64.b64decode(line["value"]["content"])
            paths.append(line["value"]["path"])
        repo.commits.append((revision, header["summary"], paths))
        oid = hashlib.sha1(f"{match.group('repo')}{len(repo.commits)}".encode()).hexdigest()
        return 200, {"commitUrl": f"{self._endpoint(headers)}/{match.group('repo')}/commit/{oid}", "commitOid": oid}

    def _endpoint(self, headers) -> str:
        return f"http://{headers.get('Host')}"
