"""Full fine-tuning of models whose input and output embeddings are tied (SmolLM2, Qwen2.5-0.5B, Llama-3.2-1B, Gemma).

A tied model holds `lm_head.weight` and `model.embed_tokens.weight` as one tensor; its checkpoint files hold it once
(safetensors drops the alias). Every run here saves checkpoints (save_steps 2 of 4 steps) with the checkpoint
preflight on, which once refused them all before step 1 ("1 missing, e.g. ['lm.lm_head.weight']"). Each resume from
checkpoint-2 must give the uninterrupted run's losses and final weights, and the final folder must load with
`from_pretrained` as one tied tensor again. The uninterrupted runs of each strategy are compared with one process;
the tiny models are built by the shipped scripts/make_tiny_model.py --tie.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tests.conftest import (
    FSDP_LAUNCHER,
    REPO,
    TINY_CHAT,
    Run,
    build_tiny_model,
    launch,
    launch_env,
    run_script,
)
from tests.e2e.test_parallelism import assert_launch, close, params_close

pytestmark = pytest.mark.launch

COMMON = [*TINY_CHAT, "--max_steps", "4", "--save_steps", "2", "--logging_steps", "1", "--eval_steps", "100",
          "--warmup_steps", "1", "--checkpoint_preflight", "true"]
ONE_PROCESS = ["--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "2"]
TWO_PROCESSES = ["--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "1"]
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


@pytest.fixture(scope="module")
def tied(tmp_path_factory) -> dict[str, list[str]]:
    """{arch: the recipe arguments that train a tiny tied model of that architecture}."""
    root = tmp_path_factory.mktemp("tied")
    llama = build_tiny_model(root / "llama", "--tie")
    models = {"llama": llama}
    for arch in ("qwen2", "gemma"):  # on the Llama's tokenizer: no second BPE training
        models[arch] = build_tiny_model(root / arch, "--arch", arch, "--tie", "--tokenizer", str(llama))
    models = {arch: ["--model_name_or_path", str(folder)] for arch, folder in models.items()}
    return models


def resume_from_step_2(run: Run, name: str, *args: str, runner=launch, **launch_kwargs) -> Run:
    """Continue `run` from its checkpoint-2 in a copy of its folder, as a preempted job would."""
    folder = run.output_dir.parent / name
    shutil.copytree(run.output_dir, folder)
    for later in ("final", "checkpoint-4"):
        shutil.rmtree(folder / later)
    resumed = runner(folder, *args, "--resume_from_checkpoint", "latest", **launch_kwargs)
    assert "resuming from" in resumed.stdout and "at step 2" in resumed.stdout
    return resumed


def final_weights(run: Run) -> dict[str, torch.Tensor]:
    return load_file(run.output_dir / "final" / "model.safetensors")


def assert_trained_and_tied(run: Run) -> None:
    """The run saved both checkpoints after the preflight, and its final folder loads as one tied tensor."""
    assert "checkpoint preflight: a " in run.stdout  # the round trip ran, and passed
    assert sorted(p.name for p in run.output_dir.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    assert [r["step"] for r in run.train_rows()] == [1, 2, 3, 4]
    assert HEAD not in final_weights(run)  # saved once, under the embedding's name
    model = AutoModelForCausalLM.from_pretrained(run.output_dir / "final")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    torch.testing.assert_close(model.lm_head.weight.detach(), final_weights(run)[EMBED], rtol=0, atol=0)


def assert_same_training(run: Run, ref: Run, rtol: float, atol: float) -> None:
    rows, ref_rows = run.train_rows(), ref.train_rows()
    assert [(r["step"], r["learning_rate"], r["trained_tokens"]) for r in rows] == \
        [(r["step"], r["learning_rate"], r["trained_tokens"]) for r in ref_rows]
    close([r["loss"] for r in rows], [r["loss"] for r in ref_rows], rtol)
    params_close(final_weights(run), final_weights(ref), rtol, atol)
    assert rows[-1]["loss"] < rows[0]["loss"]


def assert_continues(resumed: Run, run: Run, rtol: float = 0, atol: float = 0) -> None:
    """Steps 3-4 after resuming equal the uninterrupted run's: losses, schedule, tokens and final weights."""
    rows, ref_rows = resumed.train_rows(), run.train_rows()
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [(r["learning_rate"], r["trained_tokens"]) for r in rows[2:]] == \
        [(r["learning_rate"], r["trained_tokens"]) for r in ref_rows[2:]]
    close([r["loss"] for r in rows[2:]], [r["loss"] for r in ref_rows[2:]], rtol)
    params_close(final_weights(resumed), final_weights(run), rtol, atol)
    assert_trained_and_tied(resumed)


@pytest.fixture(scope="module")
def one_process(tied, tmp_path_factory) -> Run:
    """The tied Llama on one process: the reference of every strategy below."""
    return run_script(tmp_path_factory.mktemp("one") / "llama", *COMMON, *tied["llama"], *ONE_PROCESS)


def test_one_process_saves_checkpoints_of_a_tied_model(one_process):
    """(Its resume on one process is the DDP test's 2 -> 1 and the Qwen2 / Gemma tests' 1 -> 1.)"""
    assert_launch(one_process, "NO", 1, "CausalLMTokenLoss")
    assert_trained_and_tied(one_process)
    # the checkpoint's model file holds the tied tensor once, under the embedding's name
    saved = load_file(one_process.output_dir / "checkpoint-2" / "model.safetensors")
    assert f"lm.{EMBED}" in saved and f"lm.{HEAD}" not in saved


@pytest.mark.parametrize("arch", ["qwen2", "gemma"])
def test_other_tied_architectures_resume_exactly(tied, tmp_path, arch):
    run = run_script(tmp_path / arch, *COMMON, *tied[arch], *ONE_PROCESS)
    assert_trained_and_tied(run)
    resumed = resume_from_step_2(run, f"{arch}-resumed", *COMMON, *tied[arch], *ONE_PROCESS, runner=run_script)
    assert_continues(resumed, run)


def test_ddp_trains_like_one_process_and_resumes_on_one(one_process, tied, tmp_path):
    ddp = launch(tmp_path / "ddp", *COMMON, *tied["llama"], *TWO_PROCESSES, preset="cpu_ddp")
    assert_launch(ddp, "MULTI_CPU", 2, "DistributedDataParallel")
    assert_trained_and_tied(ddp)
    assert_same_training(ddp, one_process, rtol=1e-5, atol=1e-6)
    two_to_one = resume_from_step_2(ddp, "ddp-two-to-one", *COMMON, *tied["llama"], *ONE_PROCESS, runner=run_script)
    assert_launch(two_to_one, "NO", 1, "CausalLMTokenLoss")
    assert_continues(two_to_one, ddp, rtol=1e-5, atol=1e-6)  # other reduction order than the 2-process run


def test_zero2_trains_like_one_process_and_resumes(one_process, tied, tmp_path):
    """DeepSpeed's engine writes the model file itself; its final weights are gathered copies, saved once. Its
    checkpoint-2 (the engine's own layout, not hftrain's safetensors) resumes into the uninterrupted run: the issue
    lists ZeRO-2 among the strategies whose tied checkpoints must resume, so the ~20 s resume stays in CI."""
    run = launch(tmp_path / "zero2", *COMMON, *tied["llama"], *TWO_PROCESSES, preset="zero2")
    assert_launch(run, "DEEPSPEED", 2, "DeepSpeedEngine")
    assert_trained_and_tied(run)
    assert_same_training(run, one_process, rtol=1e-5, atol=1e-5)
    resumed = resume_from_step_2(run, "zero2-resumed", *COMMON, *tied["llama"], *TWO_PROCESSES, preset="zero2")
    assert_continues(resumed, run)


def test_fsdp2_keeps_the_tie_when_sharding_and_resumes_on_one_process(one_process, tied, tmp_path):
    """accelerate's FSDP2 preparation moves the model to the meta device, which unties it, and re-ties it through the
    prepared module's tie_weights: trained as one tensor, the run equals one process (130,432 parameters, not the
    178,624 of an untied copy)."""
    run = launch(tmp_path / "fsdp2", *COMMON, *tied["llama"], *TWO_PROCESSES, preset="fsdp2", processes=2,
                 script=FSDP_LAUNCHER)
    assert_launch(run, "FSDP", 2, "FSDPCausalLMTokenLoss")
    n = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tied["llama"][1]).parameters())  # tied: once
    assert f"full fine-tuning, {n:,} of {n:,} parameters trained" in run.stdout  # counted after sharding
    assert_trained_and_tied(run)
    assert_same_training(run, one_process, rtol=1e-5, atol=1e-5)
    two_to_one = resume_from_step_2(run, "fsdp2-two-to-one", *COMMON, *tied["llama"], *ONE_PROCESS, preset="fsdp2",
                                    processes=1, script=FSDP_LAUNCHER)
    assert_launch(two_to_one, "FSDP", 1, "FSDPCausalLMTokenLoss")
    assert_continues(two_to_one, run, rtol=1e-5, atol=1e-5)


def test_lora_with_the_tied_head_in_modules_to_save_trains_one_copy_and_resumes(tied, tmp_path):
    """modules_to_save lm_head on a tied model: peft's trained copies of the head and the embedding are one tensor
    (ensure_weight_tying), as in the base; the checkpoint holds it once, resumes exactly, and the adapter reloads
    with plain peft as one tensor again."""
    args = [*COMMON, *tied["llama"], *ONE_PROCESS, "--use_peft", "true", "--modules_to_save", "lm_head"]
    run = run_script(tmp_path / "lora", *args)
    assert "this model ties its input embedding and output projection" in run.stdout
    assert "checkpoint preflight: a " in run.stdout
    resumed = resume_from_step_2(run, "lora-resumed", *args, runner=run_script)
    rows, ref_rows = resumed.train_rows(), run.train_rows()
    assert [r["loss"] for r in rows[2:]] == [r["loss"] for r in ref_rows[2:]]
    adapter = load_file(resumed.output_dir / "final" / "adapter_model.safetensors")
    assert adapter.keys() == load_file(run.output_dir / "final" / "adapter_model.safetensors").keys()
    params_close(adapter, load_file(run.output_dir / "final" / "adapter_model.safetensors"), rtol=0, atol=0)

    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(tied["llama"][1])
    model = PeftModel.from_pretrained(base, run.output_dir / "final").eval()
    head = model.base_model.model.lm_head.modules_to_save["default"].weight
    embed = model.base_model.model.model.embed_tokens.modules_to_save["default"].weight
    assert head is embed  # one trained tensor
    torch.testing.assert_close(head.detach(), adapter[f"base_model.model.{EMBED}"], rtol=0, atol=0)
    start = AutoModelForCausalLM.from_pretrained(tied["llama"][1]).model.embed_tokens.weight
    assert not torch.equal(head.detach(), start.detach())  # trained, not the base's

    # merged into the base: a standard tied folder, the trained tensor saved once, the adapter model's logits
    merged = tmp_path / "merged"
    subprocess.run([sys.executable, "-m", "hftrain.merge", str(run.output_dir / "final"), str(merged)], check=True,
                   capture_output=True, cwd=REPO, env=launch_env())
    assert HEAD not in load_file(merged / "model.safetensors")
    plain = AutoModelForCausalLM.from_pretrained(merged)
    assert plain.lm_head.weight is plain.model.embed_tokens.weight
    ids = torch.arange(3, 40).unsqueeze(0)
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, model(input_ids=ids).logits, rtol=0, atol=1e-5)
