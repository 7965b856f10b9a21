"""hftrain/finetune.py's phase object without launching: the start-up lines, the phase order, `main`'s exits, and
the size limit that keeps the entry script and the backends readable (issue 13 items 1 and 6)."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest

from hftrain import finetune
from hftrain.config import Recipe
from hftrain.errors import HftrainError
from hftrain.finetune import Finetune
from hftrain.memory import ParameterCounts
from hftrain.objectives import objective_for
from hftrain.parallel.base import Backend, Parallelism
from hftrain.preemption import EXIT_PREEMPTED, Preempted
from tests.conftest import REPO
from tests.unit.parallel.conftest import fake_accelerator

MAX_FUNCTION_LINES = 60
MEMORY = {"per_device_gib": 0.003, "offloaded_gib": 0.0, "device_memory_gib": 15.6,
          "activations": "activations extra: at most 2,048 tokens per device"}


class Printed:
    def __init__(self):
        self.lines: list[str] = []

    def print(self, message: str) -> None:
        self.lines.append(message)


def described(record: Parallelism | None = None, resume_from: Path | None = None, notes=(), summary=None,
              attention_note: str | None = None, loss_path: str = "logits at trained positions",
              **recipe) -> list[str]:
    """The lines `describe_run` prints for a run set up as the phases before it would leave it."""
    run = Finetune(Recipe(per_device_train_batch_size=2, gradient_accumulation_steps=4, **recipe))
    run.accelerator = fake_accelerator(record.processes if record else 1)
    run.backend = Backend(run.accelerator, run.recipe)
    if record is not None:
        run.backend.record = record
    run.dp = SimpleNamespace(world=record.dp_world if record else 1)
    run.run_info = {"memory_estimate": MEMORY, "launch": {"model_wrapper": "CausalLMTokenLoss"}}
    run.parameters = ParameterCounts.uniform(1_000, 160_000, 4)
    run.parts = SimpleNamespace(notes=list(notes), loss=SimpleNamespace(loss_path=loss_path),
                                summary={"method": "full", "quantized_linear_layers": {}, "attention": "sdpa",
                                         "compiled_blocks": 0, **(summary or {})})
    run.attention_note = attention_note
    run.data = SimpleNamespace(plan=SimpleNamespace(global_batch=8 * run.dp.world, steps_per_epoch=5), total_steps=10,
                               data_line=("(5 per epoch)", "40 training examples in 40 rows"))  # map-style data's
    run.resume_from, run.progress = resume_from, SimpleNamespace(step=6)
    run.logger = Printed()
    run.train_run = SimpleNamespace()  # what the objective's notes read: sft's none
    run.describe_run()
    return run.logger.lines


def test_one_process_is_described_in_words():
    lines = described()
    assert lines[0].startswith("hftrain: 1 process, no distribution on cpu, model wrapped as CausalLMTokenLoss; ")
    assert "effective batch 8 = 2 per device x 4 accumulation x 1 process; 10 optimizer steps (5 per epoch)" in lines[0]
    assert "full fine-tuning, 1,000 of 160,000 parameters trained; 40 training examples in 40 rows" in lines[0]
    assert lines[-1] == ("hftrain: parallelism 1 process, no distribution: model state ~0.003 GiB per device "
                         "(+0.0 GiB offloaded to CPU; activations extra: at most 2,048 tokens per device) of 15.6 GiB")
    assert "NO" not in " ".join(lines) and "process(es)" not in " ".join(lines)  # not accelerate's enum name


def test_ddp_is_described_with_its_process_count_and_process_group_backend():
    lines = described(Parallelism("ddp", "DDP", 2, 1, "gloo", dp_world=2))
    assert lines[0].startswith("hftrain: DDP over 2 processes (gloo) on cpu, ")
    assert "effective batch 16 = 2 per device x 4 accumulation x 2 processes" in lines[0]
    assert lines[-1].startswith("hftrain: parallelism DDP over 2 processes (gloo): model state ")


def test_a_quantized_base_is_named_with_its_bits():
    lines = described(summary={"method": "lora", "quantized_linear_layers": {"Linear4bit": 14}})
    assert "lora fine-tuning of a 4-bit quantized base, 1,000 of 160,000 parameters trained" in lines[0]
    lines = described(summary={"method": "lora", "quantized_linear_layers": {"Linear8bitLt": 14}})
    assert "lora fine-tuning of an 8-bit quantized base" in lines[0]


def test_a_launch_with_more_processes_than_the_recipes_preset_says_what_it_multiplied():
    """A recipe sized for the one-process `cpu` preset launched on 4 DDP processes: 4x its effective batch."""
    lines = described(Parallelism("ddp", "DDP", 4, 1, "gloo", dp_world=4), launch_preset="cpu")
    assert ("effective batch 32 = 2 per device x 4 accumulation x 4 processes (the recipe's launch_preset cpu runs 1 "
            "process: effective batch 8 there)") in lines[0]
    assert "launch_preset" not in described(Parallelism("ddp", "DDP", 2, 1, "gloo", dp_world=2),
                                            launch_preset="cpu_ddp")[0]


def test_resume_notes_and_preset_reason_are_in_the_start_up_lines():
    lines = described(resume_from=Path("out/checkpoint-6"), notes=["a note from the model builder"],
                      launch_preset="cpu", launch_preset_reason="small enough for one process")
    assert lines[0].endswith("; resuming from out/checkpoint-6 at step 6")
    assert lines[2] == "hftrain: a note from the model builder"
    assert lines[3].endswith("; the recipe is sized for preset cpu: small enough for one process")
    assert len(lines) == 4


def test_the_attention_compile_and_loss_path_are_one_start_up_line():
    """Which attention the loaded model runs (and, for packed rows that kept sdpa, why not varlen), torch.compile
    and the loss's path to the logits."""
    assert described()[1] == "hftrain: attention sdpa; compile off; loss logits at trained positions"
    assert described(summary={"attention": "varlen"}, packing=True, loss_path="chunked 8192 tokens")[1] == \
        "hftrain: attention varlen (per-document sdpa, packed rows); compile off; loss chunked 8192 tokens"  # CPU
    line = described(packing=True, attention_note="varlen needs CUDA", torch_compile=True,
                     summary={"compiled_blocks": 2})[1]
    assert line == ("hftrain: attention sdpa (block-diagonal mask over packed rows; varlen needs CUDA); compile on "
                    "(2 blocks, mode default, dynamic shapes; the first step's time is reported); loss logits at "
                    "trained positions")


def test_run_calls_the_phases_in_order():
    calls = []

    class Recorded(Finetune):
        pass

    for name in ("setup", "setup_data", "setup_model", "setup_optimizer", "describe_run", "check_checkpoints", "train",
                 "finish"):
        setattr(Recorded, name, lambda self, *parts, name=name: calls.append(name) or Path("final"))
    assert Recorded(Recipe()).run() == Path("final")
    assert calls == ["setup", "setup_data", "setup_model", "setup_optimizer", "describe_run", "check_checkpoints",
                     "train", "finish"]


@pytest.mark.parametrize(("error", "code", "said"), [
    (HftrainError("the data is empty"), 2, "hftrain: error: the data is empty"),
    (Preempted("SIGTERM", 3, "out/checkpoint-3"), EXIT_PREEMPTED, "hftrain: stopped by SIGTERM after step 3"),
])
def test_main_turns_a_refusal_or_a_preemption_into_one_line_and_its_exit_code(tmp_path, capsys, error, code, said):
    class Failing(Finetune):
        def run(self):
            raise error

    with pytest.raises(SystemExit) as exited:
        finetune.main(["--output_dir", str(tmp_path / "out")], runner=Failing)
    assert exited.value.code == code
    assert capsys.readouterr().err.startswith(said)


def test_no_function_in_the_entry_script_or_the_backends_exceeds_60_lines():
    too_long = []
    for path in [REPO / "hftrain" / "finetune.py", *sorted((REPO / "hftrain" / "parallel").glob("*.py"))]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                if node.end_lineno - start + 1 > MAX_FUNCTION_LINES:
                    too_long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} "
                                    f"({node.end_lineno - start + 1} lines)")
    assert not too_long, "split these into named steps:\n" + "\n".join(too_long)


def rescue_run(processes: int = 1, scheduler_steps: int = 12, applied_in_backward: bool = False) -> Finetune:
    """A run that has completed 12 steps, with a save that records what it was asked to do."""
    run = Finetune(Recipe())
    run.accelerator = fake_accelerator(processes)
    run.backend = SimpleNamespace(step_applied_in_backward=applied_in_backward)
    run.progress = SimpleNamespace(step=12)
    run.scheduler = SimpleNamespace(last_epoch=scheduler_steps)
    run.saved = []
    run.save_checkpoint = lambda: run.saved.append(run.progress.step) or Path("out/checkpoint-12")
    return run


def test_an_error_before_the_update_saves_the_last_completed_step():
    run = rescue_run()
    with pytest.raises(HftrainError, match=r"training step 13 failed \(ValueError: bad batch\); the trained state "
                                           r"after step 12 is kept in out/checkpoint-12"):
        run.rescue(ValueError("bad batch\nand pages more"))
    assert run.saved == [12]


@pytest.mark.parametrize("why", ["two processes", "schedule moved past the step", "engine stepped in backward"])
def test_no_rescue_when_the_state_may_not_be_the_last_completed_step(why):
    run = {"two processes": lambda: rescue_run(processes=2),
           "schedule moved past the step": lambda: rescue_run(scheduler_steps=13),  # failed after optimizer.step()
           "engine stepped in backward": lambda: rescue_run(applied_in_backward=True)}[why]()
    error = ValueError("bad batch")
    with pytest.raises(ValueError) as raised:
        run.rescue(error)
    assert raised.value is error and run.saved == []


def test_the_model_phase_hands_what_it_built_to_the_optimizer_phase_as_one_value():
    handed = []

    class Recorded(Finetune):
        def setup_model(self):
            return "the model phase's ModelParts"

        def setup_optimizer(self, parts):
            handed.append(parts)

    for name in ("setup", "setup_data", "describe_run", "check_checkpoints", "train", "finish"):
        setattr(Recorded, name, lambda self: None)
    Recorded(Recipe()).run()
    assert handed == ["the model phase's ModelParts"]


def test_the_entry_points_help_names_it_as_it_was_started(monkeypatch):
    """Issue 49: the help called itself hftrain.finetune whatever started it (`hftrain finetune` passes its own
    name: tests/unit/test_config.py)."""
    monkeypatch.setattr(finetune.sys, "argv", ["hftrain/finetune.py", "--help"])
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    assert finetune.entry_prog(as_module=False) == "python hftrain/finetune.py"
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")  # set by accelerate launch in every process it starts
    assert finetune.entry_prog(as_module=False) == "accelerate launch [options] hftrain/finetune.py"
    assert finetune.entry_prog(as_module=True) == "python -m hftrain.finetune"


def finished(tmp_path, **recipe) -> list[str]:
    """The lines `finish` prints for a run whose final model is saved (no evaluation, no hub push)."""
    run = Finetune(Recipe(output_dir=str(tmp_path / "out dir"), **recipe))
    printed = Printed()
    printed.close = lambda: None
    run.logger, run.output_dir, run.processor = printed, Path(run.recipe.output_dir), None
    run.data, run.eval_addons = SimpleNamespace(eval_set=None), []
    run.meter = SimpleNamespace(device_hours=lambda: 0.25)
    run.hub = SimpleNamespace(at_saves=False, finish=lambda *args: None)
    run.save_final = lambda: run.output_dir / "final"
    run.finish()
    return printed.lines


def test_the_run_ends_saying_how_to_talk_to_the_model_and_make_the_report(tmp_path):
    """Issue 49: `make demo` ended on "final model saved to ..." without a word on what to do with it."""
    out = tmp_path / "out dir"
    lines = finished(tmp_path)
    assert lines[0].startswith(f"hftrain: final model saved to {out / 'final'}; 0.2500 device-hours")
    assert lines[-1] == (f"hftrain: next: hftrain chat '{out / 'final'}' to talk to the model; hftrain report "
                         f"'{out}' for plots and a summary of the run")  # quoted: the folder's name has a space
    assert finetune.next_steps(Path("outputs/rm"), objective_for(Recipe(objective="reward")).writes_text) == (
        "score conversations with outputs/rm/final as its README.md shows; hftrain report outputs/rm for plots and a "
        "summary of the run")  # hftrain chat refuses a reward model: it writes no text
    assert finetune.next_steps(Path("outputs/vlm"), True, processor=object()) == (
        "hftrain report outputs/vlm for plots and a summary of the run")  # an image-text model: not through chat
