"""Pushing to the Hugging Face hub (push_to_hub, hub_model_id, hub_strategy, ... as transformers' Trainer names them).

`upload` is the one way a folder goes to the hub (`hftrain merge --push_to_hub` calls it too): the repo is created if
missing (exist_ok), the branch too when a revision is named, then `HfApi.upload_folder` makes one commit of the
folder. `HubPush` does a training run's pushes on the main process, in one background thread, so that no upload holds
a training step:

- at a checkpoint save (hub_strategy other than end), the model for use as of that step (written by every rank like
  the final model, with its card) goes to the repo's root; with `checkpoint` also checkpoint-N to last-checkpoint/,
  with `all_checkpoints` to checkpoint-N/. A save is skipped while the previous upload still runs (Trainer's rule);
- an upload that fails is reported with one warning line and the next save pushes again (the hub commit is atomic:
  a failed upload leaves the repo as it was, and the local files are never touched);
- at the end the run waits for the uploads in flight (saying so), then pushes output_dir/final with its card and
  its final evaluation, and fails with one paragraph if that push fails (the model stays in final/).

The endpoint is huggingface_hub's (`HF_ENDPOINT`), so a test points it at a local server (tests/hub_server.py).

Loading from the hub: `unreachable_problem` is asked before a model, tokenizer or config is loaded by hub id. When the
hub cannot be reached, huggingface_hub's download falls back to its cache and, for a file not there, tries again
with its backoff (5 retries, 1 + 2 + 4 + 8 + 8 s apart, two log lines each): about 25 s and 11 lines for each file
before transformers' "couldn't connect" error (a config, a tokenizer, a model; `hftrain merge` read the config twice).
One request without retries (a HEAD of the id's config.json, huggingface_hub's `get_hf_file_metadata`, which does
not retry by default) tells in a fraction of a second (a refused connection, a name that does not resolve; at most
HF_HUB_ETAG_TIMEOUT on a network that drops packets) that the hub cannot be reached; the load is then refused with
one paragraph. A model already in the cache is not probed: huggingface_hub loads it without the hub, as before.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from huggingface_hub import HfApi, constants, get_hf_file_metadata, get_token, hf_hub_url, try_to_load_from_cache
from huggingface_hub.errors import HfHubHTTPError
from huggingface_hub.utils import HFValidationError, validate_repo_id

from hftrain.errors import HftrainError, first_line
from hftrain.fields.data import looks_local
from hftrain.fields.hub import repo_id as recipe_repo_id

LAST_CHECKPOINT = "last-checkpoint"  # hub_strategy checkpoint: where the newest checkpoint-N goes in the repo


def token_of(given: str | None) -> str | None:
    """The token a push uses: the one given (hub_token), else HF_TOKEN or `hf auth login`'s (huggingface_hub's own
    lookup)."""
    return given or get_token()


def preflight_problems(recipe) -> list[str]:
    """What the machine must give a run that pushes: a token, and huggingface_hub allowed to go online."""
    if not recipe.push_to_hub:
        return []
    problems = []
    if token_of(recipe.hub_token) is None:
        named = "" if recipe.hub_model_id else " (output_dir's name; hub_model_id chooses another)"
        problems.append(f"push_to_hub needs a hub token with write access to {recipe_repo_id(recipe)!r}{named} and "
                        "none is set: log in with `hf auth login` (`huggingface-cli login`), export HF_TOKEN, or set "
                        "hub_token")
    if offline():
        problems.append("push_to_hub with HF_HUB_OFFLINE=1: huggingface_hub refuses every upload in offline mode; "
                        "unset HF_HUB_OFFLINE for this run or set push_to_hub: false")
    return problems


def offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub reads it (its constant is read once, at import)."""
    return os.environ.get("HF_HUB_OFFLINE", "").upper() in constants.ENV_VARS_TRUE_VALUES


# the files whose presence in the cache makes a hub id loadable without the hub (a model's, a tokenizer's, an adapter's)
CACHE_MARKERS = ("config.json", "tokenizer_config.json", "adapter_config.json")
_ANSWERED: set[str] = set()  # the endpoints that answered a probe in this process: not asked again


def unreachable_problem(what: str, name: str, revision: str | None = None,
                        local: str = "give a local folder instead") -> str | None:
    """Why `what` (model, tokenizer, base model...) `name` cannot be loaded from here when `name` is a hub id that is
    not in the cache and the hub does not answer: one paragraph, or None (a local path, offline mode, already
    cached, the hub answered, or not an id the hub could hold: the load reports those as it does). `local`: how to
    give a local folder instead, in the command's words."""
    if looks_local(name) or offline() or constants.HF_HUB_OFFLINE or constants.ENDPOINT in _ANSWERED:
        return None
    try:
        validate_repo_id(name)
    except HFValidationError:
        return None
    if any(isinstance(try_to_load_from_cache(name, marker, revision=revision), str) for marker in CACHE_MARKERS):
        return None  # huggingface_hub falls back to the cache at once when the hub does not answer
    try:
        get_hf_file_metadata(hf_hub_url(name, "config.json", revision=revision), timeout=constants.HF_HUB_ETAG_TIMEOUT)
    except HfHubHTTPError:
        pass  # the hub answered (a missing repo or file, a gated one): the load names it
    except Exception as exc:  # noqa: BLE001 - the HTTP client's connection errors (httpx's or httpx2's, by version)
        return (f"cannot load {what} {name!r}: the hub at {constants.ENDPOINT} cannot be reached from this machine "
                f"({type(exc).__name__}: {first_line(exc)}) and {name!r} is not in the local cache "
                f"({constants.HF_HUB_CACHE}). Check the id and the network (HF_ENDPOINT, proxy settings), {local}, "
                f"or download it where the hub is reachable (`hf download {name}`) and set "
                "HF_HUB_OFFLINE=1 to load it from the cache")
    _ANSWERED.add(constants.ENDPOINT)
    return None


def reach(what: str, name: str, revision: str | None = None, local: str = "give a local folder instead") -> None:
    """Raise `unreachable_problem` as an HftrainError, if there is one."""
    if (problem := unreachable_problem(what, name, revision, local)) is not None:
        raise HftrainError(problem)


def upload(folder: Path, repo_id: str, message: str, *, token: str | None = None, private: bool | None = None,
           revision: str | None = None, path_in_repo: str | None = None) -> str:
    """Create `repo_id` if missing and commit `folder` into it (at `path_in_repo`); returns the repo id as the hub
    resolved it (a bare name gains the token owner's namespace). Library errors propagate."""
    api = HfApi(token=token)
    resolved = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model").repo_id
    if revision is not None:
        api.create_branch(resolved, branch=revision, exist_ok=True, repo_type="model")
    api.upload_folder(folder_path=str(folder), repo_id=resolved, path_in_repo=path_in_repo, commit_message=message,
                      revision=revision, repo_type="model")
    return resolved


def failure(exc: BaseException) -> str:
    """What a failed upload says: the error's first line and the reasons the hub listed under it (a refused card's
    `- "base_model[0]" with value ... is not valid`), on one line: "<first line>: <reason>; <reason>"."""
    lines = str(exc).strip().splitlines()[1:]
    listed = [line.strip()[2:].rstrip(".") for line in lines if line.strip().startswith("- ")]
    return first_line(exc) + (": " + "; ".join(listed) if listed else "")


def repo_url(repo_id: str) -> str:
    return f"{constants.ENDPOINT}/{repo_id}"


class HubPush:
    """One run's pushes (see the module docstring). Every rank holds one; only the main process uploads.

    `say` prints a line, `warn` a warning line (the run's logger, main process only)."""

    def __init__(self, recipe, main: bool, say: Callable[[str], None], warn: Callable[[str], None]):
        self.requested = recipe.push_to_hub
        self.strategy = recipe.hub_strategy
        self.repo_id = recipe_repo_id(recipe)
        self.kwargs = {"token": recipe.hub_token, "private": recipe.hub_private_repo,
                       "revision": recipe.hub_revision}
        self.uploads = self.requested and main
        self.say, self.warn = say, warn
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hftrain-hub") if self.uploads else None
        self.pending: list[tuple[str, Future]] = []
        self.failed: str | None = None  # the last failure, until an upload succeeds

    @property
    def at_saves(self) -> bool:
        """Whether checkpoint saves push (known on every rank: the model for use is written by all of them)."""
        return self.requested and self.strategy != "end"

    def busy(self) -> bool:
        """An upload still runs (main process; False elsewhere)."""
        return any(not future.done() for _, future in self.pending)

    def at_save(self, step: int, model_dir: Path, checkpoint_dir: Path, checkpoint_written: Future | None) -> None:
        """Upload the model for use written for this save (`model_dir`) and, by the strategy, `checkpoint_dir` (after
        its background write, `checkpoint_written`, has finished)."""
        if not self.uploads:
            return
        message = f"Training in progress, step {step}"
        subfolder = {"checkpoint": LAST_CHECKPOINT, "all_checkpoints": checkpoint_dir.name}.get(self.strategy)

        def push() -> None:
            upload(model_dir, self.repo_id, message, **self.kwargs)
            if subfolder is not None:
                if checkpoint_written is not None:
                    checkpoint_written.result()  # a failed background save is reported by the loop; no upload
                upload(checkpoint_dir, self.repo_id, f"{message}, checkpoint", path_in_repo=subfolder, **self.kwargs)

        self._submit(f"the model at step {step}" + (f" and {checkpoint_dir.name}" if subfolder else ""), push)

    def finish(self, final_dir: Path, model_dir: Path | None = None) -> None:
        """Wait for the uploads in flight, then push `final_dir` (its card written); remove `model_dir`, the folder the
        saves uploaded from. Raises HftrainError if the final push fails."""
        if not self.uploads:
            return
        waiting = [what for what, future in self.pending if not future.done()]
        if waiting:
            self.say(f"hftrain: waiting for the hub upload in flight to {self.repo_id} ({waiting[-1]}) to finish")
        self.executor.shutdown(wait=True)
        self.pending.clear()
        if model_dir is not None:
            shutil.rmtree(model_dir, ignore_errors=True)
        files = sum(1 for p in final_dir.rglob("*") if p.is_file())
        try:
            self.repo_id = upload(final_dir, self.repo_id, "End of training", **self.kwargs)
        except Exception as exc:  # noqa: BLE001 - network, permission, server: one paragraph, the model is kept
            raise HftrainError(
                f"pushing {final_dir} to the hub repo {self.repo_id!r} failed ({failure(exc)}); the trained model "
                f"is saved there. Push it again with `hf upload {self.repo_id} {final_dir} .`"
                f"{' --revision ' + self.kwargs['revision'] if self.kwargs['revision'] else ''}") from None
        self.say(f"hftrain: pushed {final_dir} ({files} files) to {repo_url(self.repo_id)}"
                 f"{' (branch ' + self.kwargs['revision'] + ')' if self.kwargs['revision'] else ''}")

    def _submit(self, what: str, job: Callable[[], object]) -> None:
        if not self.uploads:
            return

        def run() -> None:
            try:
                job()
            except Exception as exc:  # noqa: BLE001 - reported; the next save (or the end) pushes again
                self.failed = f"{what}: {failure(exc)}"
                self.warn(f"hub push to {self.repo_id!r} failed ({self.failed}); the local files are kept and the "
                          "next save (or the end of training) pushes again")
                return
            if self.failed is not None:
                self.say(f"hftrain: hub push to {self.repo_id!r} works again ({what})")
            self.failed = None

        self.pending = [(w, f) for w, f in self.pending if not f.done()]
        self.pending.append((what, self.executor.submit(run)))
