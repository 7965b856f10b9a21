"""Run files written with each checkpoint, finding / resolving checkpoints, clearing a previous run."""

from __future__ import annotations

import dataclasses
import importlib.metadata as md
import json
import platform
import threading
from pathlib import Path

import pytest
import torch
import transformers
import yaml

from hftrain import checkpoint, ties
from hftrain.checkpoint import (
    BackgroundSaves,
    Progress,
    checkpoints,
    clear_run,
    load_checkpoint,
    resolve_resume,
    save_checkpoint,
    write_run_files,
)
from hftrain.config import Recipe, recipe_from_dict
from hftrain.errors import HftrainError
from hftrain.optim import build_scheduler, lr_factor
from hftrain.parallel.base import Backend
from hftrain.parallel.checkpoint_io import AccelerateCheckpoints
from hftrain.paths import COMPLETE_FILE, CONFIG_FILE, MODEL_FILE, STATE_FILE
from tests.conftest import REPO

MODEL = REPO / "models" / "tiny-llama"
CHAT = REPO / "data" / "chat.jsonl"


def a_recipe(out: Path, **values) -> Recipe:
    return Recipe(model_name_or_path=str(MODEL), dataset_name=str(CHAT), output_dir=str(out), **values)


def make_checkpoint(folder: Path, complete: bool = True) -> Path:
    """A folder with a state file; `complete` adds the manifest that save_checkpoint writes last."""
    folder.mkdir(parents=True)
    (folder / STATE_FILE).write_text("{}", encoding="utf-8")
    if complete:
        manifest = {"files": {STATE_FILE: (folder / STATE_FILE).stat().st_size}}
        (folder / COMPLETE_FILE).write_text(json.dumps(manifest), encoding="utf-8")
    return folder


# ----------------------------------------------------------------------------- run files
def test_run_files_round_trip(tmp_path):
    recipe = a_recipe(tmp_path / "out", learning_rate=3e-4, adam_epsilon=1e-7, warmup_ratio=0.1, max_steps=17,
                      lr_scheduler_type="cosine", report_to=["tensorboard"], eval_steps=5, run_name=None,
                      num_train_epochs=2.5, bf16=True)
    folder = tmp_path / "files"
    folder.mkdir()
    progress = Progress(step=12, epoch=1, step_in_epoch=3, trained_tokens=4567, world_size=2, nan_skipped_steps=1)
    write_run_files(folder, recipe, progress, {"launch": {"deepspeed_config": None}, "best_eval_loss": 1.25})

    loaded = yaml.safe_load((folder / CONFIG_FILE).read_text(encoding="utf-8"))
    assert set(loaded) == {f.name for f in dataclasses.fields(Recipe)}
    assert recipe_from_dict(loaded) == recipe

    state = json.loads((folder / STATE_FILE).read_text(encoding="utf-8"))
    assert state["progress"] == {"step": 12, "epoch": 1, "step_in_epoch": 3, "trained_tokens": 4567, "world_size": 2,
                                 "nan_skipped_steps": 1}
    assert Progress(**state["progress"]) == progress
    assert state["best_eval_loss"] == 1.25
    versions = state["versions"]
    assert versions["torch"] == torch.__version__
    assert versions["transformers"] == transformers.__version__
    assert versions["python"] == platform.python_version()
    assert versions["hftrain"] == md.version("hftrain")


def test_run_files_inside_output_dir_load_back_for_resume(tmp_path):
    out = tmp_path / "out"
    recipe = a_recipe(out, max_steps=4)
    folder = out / "checkpoint-4"
    folder.mkdir(parents=True)
    write_run_files(folder, recipe, Progress(step=4), RUN_INFO)
    loaded = yaml.safe_load((folder / CONFIG_FILE).read_text(encoding="utf-8"))
    # the folder now holds a run: the saved recipe loads back once pointed at it
    resumed = recipe_from_dict({**loaded, "resume_from_checkpoint": "latest"})
    assert resumed == dataclasses.replace(recipe, resume_from_checkpoint="latest")


# ---------------------------------------------------------------------------- discovery
def test_checkpoints_complete_and_numeric_order(tmp_path):
    for step in (10, 2, 9, 100):
        make_checkpoint(tmp_path / f"checkpoint-{step}")
    make_checkpoint(tmp_path / ".tmp-checkpoint-200")  # an interrupted save, even with a state file
    make_checkpoint(tmp_path / "checkpoint-300", complete=False)  # no hftrain_state.json
    make_checkpoint(tmp_path / "checkpoint-best")  # not a step
    (tmp_path / "checkpoint-400").write_text("a file")
    make_checkpoint(tmp_path / "final")
    assert [p.name for p in checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-9", "checkpoint-10",
                                                       "checkpoint-100"]


def test_checkpoints_of_missing_folder(tmp_path):
    assert checkpoints(tmp_path / "nothing") == []


def test_resolve_resume_latest(tmp_path):
    out = tmp_path / "out"
    for step in (9, 10):
        make_checkpoint(out / f"checkpoint-{step}")
    make_checkpoint(out / "checkpoint-11", complete=False)
    make_checkpoint(out / ".tmp-checkpoint-12")
    assert resolve_resume(a_recipe(out, resume_from_checkpoint="latest")) == out / "checkpoint-10"
    assert resolve_resume(a_recipe(out)) is None


def test_resolve_resume_latest_without_checkpoint(tmp_path):
    out = tmp_path / "out"
    make_checkpoint(out / "checkpoint-3", complete=False)
    with pytest.raises(HftrainError, match="no complete, intact checkpoint"):
        resolve_resume(a_recipe(out, resume_from_checkpoint="latest"))


def test_resolve_resume_explicit_folder(tmp_path):
    good = make_checkpoint(tmp_path / "out" / "checkpoint-5")
    bad = make_checkpoint(tmp_path / "out" / "checkpoint-6", complete=False)
    assert resolve_resume(a_recipe(tmp_path / "other", resume_from_checkpoint=str(good))) == good
    with pytest.raises(HftrainError, match=COMPLETE_FILE):
        resolve_resume(a_recipe(tmp_path / "out", resume_from_checkpoint=str(bad)))


# ------------------------------------------------------------------------------- clearing
def test_clear_run_removes_only_run_artefacts(tmp_path):
    out = tmp_path / "out"
    make_checkpoint(out / "checkpoint-1")
    make_checkpoint(out / "checkpoint-20", complete=False)
    make_checkpoint(out / ".tmp-checkpoint-21")
    make_checkpoint(out / "final")
    (out / "final" / "model.safetensors").write_text("w")
    (out / "metrics.jsonl").write_text("{}\n")
    kept = {"notes.txt": "mine", "hftrain_config.yaml": "x: 1", "my-checkpoint-list.txt": "keep"}
    for name, text in kept.items():
        (out / name).write_text(text)
    (out / "runs").mkdir()
    (out / "runs" / "events").write_text("tb")
    clear_run(out)
    assert sorted(p.name for p in out.iterdir()) == sorted([*kept, "runs"])
    assert all((out / name).read_text() == text for name, text in kept.items())
    assert (out / "runs" / "events").read_text() == "tb"


def test_clear_run_on_a_fresh_folder(tmp_path):
    clear_run(tmp_path / "never-created")  # nothing to clear, nothing created
    (tmp_path / "data.txt").write_text("x")
    clear_run(tmp_path)
    assert list(tmp_path.iterdir()) == [tmp_path / "data.txt"]


# ------------------------------------------------------------------ save / load (one rank)
RUN_INFO = {"launch": {"deepspeed_config": None, "num_processes": 1, "tp_size": 1}, "effective_batch_size": 4}


class OneProcess:
    """The part of `Accelerator` that checkpoint.py uses, for a single process."""

    is_main_process = True
    num_processes = 1
    process_index = 0
    distributed_type = "NO"
    step = 0
    device = torch.device("cpu")

    def __init__(self):
        self.loaded = []

    def wait_for_everyone(self):
        pass

    def register_save_state_pre_hook(self, hook):
        class Handle:
            def remove(self):
                pass
        return Handle()

    model = torch.nn.Linear(2, 2)

    def save_state(self, path):
        from safetensors.torch import save_file

        Path(path).mkdir(parents=True, exist_ok=True)
        save_file(self.model.state_dict(), str(Path(path) / "model.safetensors"))

    def load_state(self, path, **kwargs):
        self.loaded.append(path)

    def reduce(self, tensor, reduction):
        return tensor


def test_save_checkpoint_is_renamed_into_place_and_pruned(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    recipe = a_recipe(out, save_total_limit=2)
    backend = Backend(OneProcess(), recipe)
    for step in (1, 2, 3, 4):
        path = save_checkpoint(backend, out, recipe, Progress(step=step), RUN_INFO)
        assert path == out / f"checkpoint-{step}"
        assert (path / STATE_FILE).exists() and (path / CONFIG_FILE).exists() and (path / "model.safetensors").exists()
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-3", "checkpoint-4"]


def test_save_then_load(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    acc = OneProcess()
    progress = Progress(step=7, epoch=2, step_in_epoch=1, trained_tokens=99, world_size=1)
    recipe = a_recipe(out, lr_scheduler_type="cosine", warmup_steps=2)
    scheduler = build_scheduler(recipe, torch.optim.SGD(acc.model.parameters(), lr=recipe.learning_rate), 20)
    for _ in range(progress.step):
        scheduler.optimizer.step()
        scheduler.step()
    run_info = {**RUN_INFO, "scheduler": scheduler.state_dict()}
    backend = Backend(acc, recipe)
    path = save_checkpoint(backend, out, recipe, progress, {**run_info, "note": "x"})
    (path / "stale").write_text("old")
    path = save_checkpoint(backend, out, recipe, progress, {**run_info, "note": "y"})  # same step again: replaced
    assert not (path / "stale").exists()
    from hftrain.data import BatchPlan

    plan = BatchPlan(40, 2, 1, 2, seed=0, shuffle=True)  # same global batch (4) as saved: same position
    fresh = build_scheduler(recipe, torch.optim.SGD(acc.model.parameters(), lr=recipe.learning_rate), 20)
    loaded, extra = load_checkpoint(backend, acc.model, fresh, path, plan)
    assert acc.loaded == [str(path)]
    assert loaded == progress
    # the schedule continues where it was: the learning rate of step 8, computed independently
    assert fresh.get_last_lr() == scheduler.get_last_lr() == \
        [pytest.approx(recipe.learning_rate * lr_factor("cosine", 8, 20, 2))]
    assert "scheduler" not in extra
    assert acc.step == progress.step * plan.accum  # accelerate's micro-batch counter follows this run's layout
    assert extra["note"] == "y" and extra["effective_batch_size"] == 4
    assert checkpoint.resolve_resume(a_recipe(out, resume_from_checkpoint="latest")) == path


def test_latest_skips_a_damaged_newest_checkpoint(tmp_path):
    out = tmp_path / "out"
    older = make_checkpoint(out / "checkpoint-4")
    newest = make_checkpoint(out / "checkpoint-8")
    (newest / STATE_FILE).write_text("{}" + " " * 10, encoding="utf-8")  # size differs from the manifest
    assert checkpoint.verify(newest) == [f"{STATE_FILE} has 12 bytes, 2 were written"]
    with pytest.warns(UserWarning, match="skipping damaged checkpoint .*checkpoint-8"):
        assert resolve_resume(a_recipe(out, resume_from_checkpoint="latest")) == older
    (older / STATE_FILE).unlink()
    assert checkpoint.verify(older) == [f"{STATE_FILE} is missing"]


class GatedWrites(AccelerateCheckpoints):
    """Background writes that start when the test opens `gate`, and then fail if `fail` says so."""

    gate: threading.Event
    fail = False

    def background_save(self, model, optimizer, folder, stager):
        folder.mkdir(parents=True, exist_ok=True)
        gate, fail = self.gate, self.fail

        def write():
            gate.wait(60)
            if fail:
                raise OSError("No space left on device")
            (folder / "model.safetensors").write_bytes(b"weights")

        return write


def with_checkpoints(component, recipe: Recipe) -> Backend:
    """One process's backend whose checkpoint I/O is `component`."""
    backend = Backend(OneProcess(), recipe)
    backend.checkpoints = component(backend)
    return backend


def test_resume_latest_without_a_checkpoint_in_a_folder_holding_a_run_advises_what_works(tmp_path):
    """The other half of the dead end: resume_from_checkpoint=latest in a folder that holds a run but no complete
    checkpoint advised dropping resume_from_checkpoint, which the output_dir check then refused."""
    out = tmp_path / "out"
    (out / "final").mkdir(parents=True)
    with pytest.raises(HftrainError, match="holds no complete") as info:
        resolve_resume(Recipe(output_dir=str(out), resume_from_checkpoint="latest"))
    message = str(info.value)
    assert "overwrite_output_dir" in message and "another output_dir" in message, message
    with pytest.raises(HftrainError, match="holds no complete") as info:  # an empty folder: start fresh
        resolve_resume(Recipe(output_dir=str(tmp_path / "empty"), resume_from_checkpoint="latest"))
    assert "drop resume_from_checkpoint" in str(info.value)


def test_a_background_save_appears_only_once_written_and_a_failed_one_is_reported_by_the_next_save(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    recipe = a_recipe(out)
    latest = a_recipe(out, resume_from_checkpoint="latest")
    backend = with_checkpoints(GatedWrites, recipe)
    backend.checkpoints.gate = threading.Event()
    saves = BackgroundSaves(backend, None, None, requested=True)
    first = save_checkpoint(backend, out, recipe, Progress(step=1), RUN_INFO, saves=saves, background=True)
    assert (out / ".tmp-checkpoint-1" / STATE_FILE).exists() and not first.exists()  # staged, not written
    with pytest.raises(HftrainError, match="holds no complete"):
        resolve_resume(latest)  # `latest` never points at a checkpoint still being written
    backend.checkpoints.gate.set()
    saves.wait()
    assert checkpoint.verify(first) == [] and resolve_resume(latest) == first

    backend.checkpoints.gate, backend.checkpoints.fail = threading.Event(), True
    save_checkpoint(backend, out, recipe, Progress(step=2), RUN_INFO, saves=saves, background=True)
    backend.checkpoints.gate.set()
    with pytest.raises(HftrainError, match=r"writing checkpoint .*checkpoint-2 in the background failed \(No space"):
        save_checkpoint(backend, out, recipe, Progress(step=3), RUN_INFO, saves=saves)  # waits for the one in flight
    assert not (out / "checkpoint-2").exists() and resolve_resume(latest) == first  # the previous one stays intact


def test_background_saves_are_off_where_the_backend_saves_synchronously(tmp_path):
    class Synchronous(AccelerateCheckpoints):
        def synchronous(self):
            return "this backend's files are written by collectives"

    out = tmp_path / "out"
    out.mkdir()
    backend = with_checkpoints(Synchronous, a_recipe(out))
    saves = BackgroundSaves(backend, None, None, requested=True)
    assert not saves.enabled and saves.executor is None
    path = save_checkpoint(backend, out, backend.recipe, Progress(step=1), RUN_INFO, saves=saves, background=True)
    assert checkpoint.verify(path) == []  # written in the loop: complete on return


@pytest.mark.parametrize("requested, by_default, expected", [
    (None, False, False),  # one process / DDP: the staged copy would be the whole state on rank 0
    (None, True, True),  # FSDP2: each rank stages its shard
    (True, False, True), (False, True, False),  # an explicit setting wins
])
def test_async_checkpointing_unset_takes_the_backends_default(tmp_path, requested, by_default, expected):
    backend = with_checkpoints(GatedWrites, a_recipe(tmp_path))
    backend.checkpoints.async_by_default = by_default
    assert BackgroundSaves(backend, None, None, requested=requested).enabled is expected


def test_only_fsdp2_writes_in_the_background_by_default():
    from hftrain.parallel.base import Backend
    from hftrain.parallel.deepspeed import DeepSpeedBackend
    from hftrain.parallel.fsdp import FSDP2Backend

    assert FSDP2Backend.checkpoint_io.async_by_default is True
    assert not any(io.async_by_default for io in (Backend.checkpoint_io, DeepSpeedBackend.checkpoint_io,
                                                   Backend.laid_out_checkpoint_io))  # tensor parallel's full state


# ----------------------------------------------------------------------------- tied embeddings
class Wrapped(torch.nn.Module):
    """The loss wrapper's layout: the causal LM under `lm`."""

    def __init__(self, tie: bool):
        super().__init__()
        config = transformers.LlamaConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                          num_attention_heads=2, tie_word_embeddings=tie)
        self.lm = transformers.LlamaForCausalLM(config)


def test_tied_aliases_are_found_by_identity_and_by_the_models_declaration():
    tied, untied = Wrapped(tie=True), Wrapped(tie=False)
    assert tied.lm.lm_head.weight is tied.lm.model.embed_tokens.weight  # what transformers built: one tensor
    assert ties.tied_groups(tied) == [{"lm.model.embed_tokens.weight", "lm.lm_head.weight"}]
    assert ties.declared_ties(tied) == [("lm.lm_head.weight", "lm.model.embed_tokens.weight")]
    assert ties.tied_groups(untied) == [] and ties.declared_ties(untied) == []
    assert ties.broken_ties(tied) == []
    tied.lm.lm_head.weight = torch.nn.Parameter(tied.lm.lm_head.weight.detach().clone())  # two copies now
    assert ties.broken_ties(tied) == ["lm.lm_head.weight / lm.model.embed_tokens.weight"]
    assert ties.tied_groups(tied) == []


@pytest.mark.parametrize("kept", ["lm.model.embed_tokens.weight", "lm.lm_head.weight"])
def test_a_checkpoint_holding_a_tied_weight_under_one_name_matches_the_run(tmp_path, kept):
    """safetensors keeps a shared tensor once (accelerate's save_state drops the alias): either name restores both."""
    model = Wrapped(tie=True)
    state = {k: v for k, v in model.state_dict().items() if k not in ties.tied_groups(model)[0] - {kept}}
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / MODEL_FILE))
    backend = Backend(OneProcess(), a_recipe(tmp_path))
    checkpoint._check_saved_weights(backend, model, tmp_path)  # no error
    # without either name the weight is missing, and both names are reported
    del state[kept]
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / MODEL_FILE))
    with pytest.raises(HftrainError, match=r"\(2 missing, e.g. \['lm.lm_head.weight', 'lm.model.embed_tokens"):
        checkpoint._check_saved_weights(backend, model, tmp_path)


def test_a_load_that_unties_the_embeddings_is_refused(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    model = Wrapped(tie=True)

    class Untying(OneProcess):
        def save_state(self, path):
            from safetensors.torch import save_model

            Path(path).mkdir(parents=True, exist_ok=True)
            save_model(model, str(Path(path) / "model.safetensors"))  # drops the alias, as accelerate does

        def load_state(self, path, **kwargs):  # a loader that materialised the alias as its own tensor
            model.lm.lm_head.weight = torch.nn.Parameter(model.lm.lm_head.weight.detach().clone())

    recipe = a_recipe(out)
    backend = Backend(Untying(), recipe)
    scheduler = build_scheduler(recipe, torch.optim.SGD(model.parameters(), lr=1.0), 4)
    path = save_checkpoint(backend, out, recipe, Progress(step=1), {**RUN_INFO, "scheduler": scheduler.state_dict()})
    from hftrain.data import BatchPlan

    with pytest.raises(HftrainError, match="left the model.s tied input and output embeddings as separate tensors"):
        load_checkpoint(backend, model, scheduler, path, BatchPlan(40, 2, 1, 2, seed=0, shuffle=True))


def test_a_checkpoint_of_another_number_of_optimizer_groups_is_refused_before_loading(tmp_path):
    """A ZeRO-3 checkpoint saved while hftrain put every partitioned parameter in one group (no weight decay) does
    not fit the two groups a run builds now: refused in one paragraph, nothing loaded (torch's optimizer loader raised
    'loaded state dict has a different number of parameter groups' from inside DeepSpeed)."""
    out = tmp_path / "out"
    out.mkdir()
    acc = OneProcess()
    recipe = a_recipe(out)
    one_group = build_scheduler(recipe, torch.optim.SGD(acc.model.parameters(), lr=recipe.learning_rate), 20)
    backend = Backend(acc, recipe)
    path = save_checkpoint(backend, out, recipe, Progress(step=3), {**RUN_INFO, "scheduler": one_group.state_dict()})
    params = list(acc.model.parameters())
    two_groups = build_scheduler(recipe, torch.optim.SGD([{"params": params[:1]}, {"params": params[1:]}],
                                                         lr=recipe.learning_rate), 20)
    from hftrain.data import BatchPlan

    with pytest.raises(HftrainError, match="holds an optimizer of 1 parameter group.*this run builds 2") as error:
        load_checkpoint(backend, acc.model, two_groups, path, BatchPlan(40, 2, 1, 2, seed=0, shuffle=True))
    assert "start the run again" in str(error.value) and "\n" not in str(error.value)
    assert acc.loaded == []
