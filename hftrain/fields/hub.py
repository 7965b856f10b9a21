"""The hub group of the recipe (pushing the trained model to the Hugging Face hub, with transformers Trainer's field
names): its fields (`HubFields`) and the rules judged from the recipe alone (`problems`); the uploads are
`hftrain/hub.py`, the model card `hftrain/card.py`. Whether a token exists is a fact of the machine: the preflight
checks it (`hftrain.hub.preflight_problems`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from huggingface_hub.utils import HFValidationError, validate_repo_id

from hftrain.fields import recipe_field as _f

HUB_STRATEGIES = ("end", "every_save", "checkpoint", "all_checkpoints")
SECRET_FIELDS = ("hub_token",)  # never written to a file hftrain saves (hftrain_config.yaml, the model card)


@dataclass
class HubFields:
    push_to_hub: bool = _f(
        False, "Upload the model for use to the hub model repo hub_model_id: output_dir/final with its model card at "
        "the end of training, and during training as hub_strategy says. Uploads run on the main process in the "
        "background and never hold a training step; the run waits for them at the end.", group="hub",
    )
    hub_model_id: str | None = _f(
        None, "Hub repo to push to (org/name, or a name in your own namespace); created if missing. Default: the "
        "output_dir folder's name, as Trainer.", group="hub",
    )
    hub_strategy: str = _f(
        "every_save", "What is pushed when (Trainer's values): end (the final model only), every_save (also the model "
        "as of each checkpoint save, written in the standard format then uploaded; a save is skipped while the "
        "previous upload still runs), checkpoint (every_save, plus the newest checkpoint-N in the repo's "
        "last-checkpoint/ folder, to resume from), all_checkpoints (every_save, plus each checkpoint-N in a folder "
        "of its name).", group="hub", choices=HUB_STRATEGIES,
    )
    hub_private_repo: bool | None = _f(
        None, "Create the repo private (true) or public (false); unset: the hub's default for your namespace. No "
        "effect on a repo that exists.", group="hub",
    )
    hub_token: str | None = _f(
        None, "Hub token with write access. Default: HF_TOKEN or the token saved by `hf auth login` "
        "(`huggingface-cli login`). Never written to the run's files.", group="hub",
    )
    hub_revision: str | None = _f(None, "Branch to push to; default: the repo's main branch.", group="hub")


def repo_id(r) -> str:
    """The repo a run pushes to: hub_model_id, else the output_dir folder's name (as Trainer)."""
    return r.hub_model_id or Path(r.output_dir).expanduser().absolute().name


def unused(r) -> list[str]:
    """A start-up note for hub settings that push_to_hub false leaves without effect (a recipe that pushes, run with
    --push_to_hub false for a try, needs nothing more; the token's value is not shown)."""
    names = [name for name in ("hub_model_id", "hub_private_repo", "hub_token", "hub_revision")
             if getattr(r, name) is not None]
    shown = [name if name in SECRET_FIELDS else f"{name}={getattr(r, name)}" for name in names]
    return [f"push_to_hub false: {', '.join(shown)} not used"] if names and not r.push_to_hub else []


def problems(r) -> list[str]:
    if not r.push_to_hub:
        return []
    target = repo_id(r)
    try:
        validate_repo_id(target)
    except HFValidationError as exc:
        reason = str(exc).replace(" Use `repo_type` argument if needed.", "")
        if r.hub_model_id:
            return [f"hub_model_id {target!r} is not a valid hub repo id: {reason} Give 'name' or 'org/name'"]
        return [f"push_to_hub without hub_model_id pushes to a repo named after output_dir, {target!r}, which is not "
                f"a valid hub repo id: {reason} Set hub_model_id: org/name"]
    return []
