"""LoRA and QLoRA under sharded strategies, 2 processes: DeepSpeed ZeRO-3 (LoRA), ZeRO-2 (QLoRA) and FSDP2
(LoRA, QLoRA; forced on CPU through the test launcher, see test_parallelism.py).

Every run is compared with a 1-process run with the same global batch (16 examples per optimizer step): the same
losses, and an adapter file holding the same tensors at full size (not 1/world_size of them, not empty) within
tolerance. peft's own loader (`PeftModel.from_pretrained` on a base loaded by transformers, quantized as in
training) must reproduce the run's final eval loss, which hftrain computed from the sharded in-memory model, and
the reference adapter's logits. Each run also resumes from its checkpoint-3 and must continue like the
uninterrupted run.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import FSDP_LAUNCHER, REPO, Run, launch, run_script, write_jsonl
from tests.e2e.test_peft import adapter_model, eval_loss, first_paragraph, logits

pytestmark = pytest.mark.launch

N_EVAL = 16
QLORA = ["--load_in_4bit", "--bnb_4bit_use_double_quant"]
ONE_PROCESS = ["--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "2"]
TWO_PROCESSES = ["--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "1"]
# bitsandbytes' quantization state, which Linear4bit adds to every state dict next to the packed weight
QUANT_STATE_KEYS = (".weight.absmax", ".weight.quant_map", ".weight.nested_absmax", ".weight.nested_quant_map",
                    ".weight.quant_state.")


@pytest.fixture(scope="module")
def eval_texts() -> list[str]:
    lines = (REPO / "data" / "text.jsonl").read_text().splitlines()[-N_EVAL:]
    return [json.loads(line)["text"] for line in lines]


@pytest.fixture(scope="module")
def args(tmp_path_factory, tiny_model, eval_texts) -> list[str]:
    """The recipe of every run here; lora_dropout 0, since ranks draw other dropout masks than one process."""
    eval_file = write_jsonl(tmp_path_factory.mktemp("eval") / "eval.jsonl", [{"text": t} for t in eval_texts])
    return ["--model_name_or_path", str(tiny_model), "--dataset_name", str(REPO / "data" / "text.jsonl"),
            "--eval_dataset_name", str(eval_file), "--validation_split_percentage", "0", "--max_length", "128",
            "--use_peft", "--lora_r", "8", "--lora_alpha", "16", "--lora_dropout", "0", "--learning_rate", "1e-2",
            "--per_device_eval_batch_size", "8", "--logging_steps", "1", "--max_steps", "6", "--save_steps", "3",
            "--eval_steps", "3"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, args):
    """1-process runs (run on first use, without the launcher: the runs compared with them are launched): 'lora' and
    'qlora'."""
    runs = {}

    def get(method: str) -> Run:
        if method not in runs:
            runs[method] = run_script(tmp_path_factory.mktemp(f"ref-{method}") / "out", *args,
                                  *(QLORA if method == "qlora" else []), *ONE_PROCESS)
        return runs[method]

    return get


# ------------------------------------------------------------------------------------ assertions
def assert_launch(run: Run, distributed_type: str, wrapper: str) -> None:
    info = run.state()["launch"]
    assert (info["distributed_type"], info["num_processes"], info["backend"], info["model_wrapper"]) == \
        (distributed_type, 2, "gloo", wrapper)


def adapter(run: Run) -> dict[str, torch.Tensor]:
    return load_file(run.output_dir / "final" / "adapter_model.safetensors")


def assert_same_adapter(run: Run, ref: Run, rtol: float, atol: float) -> None:
    got, expected = adapter(run), adapter(ref)
    assert expected and got.keys() == expected.keys()
    assert any(v.abs().max() > 0 for k, v in expected.items() if "lora_B" in k), "untrained: a vacuous comparison"
    for name, value in expected.items():
        assert value.numel() > 0 and got[name].shape == value.shape, name  # full size, not a rank's partition
        torch.testing.assert_close(got[name], value, rtol=rtol, atol=atol, msg=lambda m, name=name: f"{name}: {m}")


def assert_same_training(run: Run, ref: Run, rtol: float = 1e-4, atol: float = 1e-5) -> None:
    rows, ref_rows = run.train_rows(), ref.train_rows()
    assert [r["step"] for r in rows] == [r["step"] for r in ref_rows] == [1, 2, 3, 4, 5, 6]
    assert [r["trained_tokens"] for r in rows] == [r["trained_tokens"] for r in ref_rows]
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close(torch.tensor([r[key] for r in rows], dtype=torch.float64),
                                   torch.tensor([r[key] for r in ref_rows], dtype=torch.float64), rtol=rtol, atol=0)
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert_same_adapter(run, ref, rtol, atol)


def assert_reloads(run: Run, ref: Run, tiny_model: Path, eval_texts: list[str], method: str) -> None:
    """peft's loader on the saved adapter: the run's own final eval loss, and the reference adapter's logits."""
    from transformers import AutoTokenizer

    peft_method = "qlora_4bit" if method == "qlora" else "lora"
    reloaded = adapter_model(tiny_model, peft_method, run.output_dir / "final")
    got = eval_loss(reloaded, AutoTokenizer.from_pretrained(run.output_dir / "final"), eval_texts)
    assert got == pytest.approx(run.eval_rows()[-1]["eval_loss"], rel=1e-5)
    expected = logits(adapter_model(tiny_model, peft_method, ref.output_dir / "final"), tiny_model)
    torch.testing.assert_close(logits(reloaded, tiny_model), expected, rtol=0, atol=1e-4)


def resume_from_step_3(run: Run, name: str, *args: str, **launch_kwargs) -> Run:
    """Continue `run` from its checkpoint-3 in a copy of its folder, as a preempted job would, and check that
    steps 4-6 and the final adapter equal the uninterrupted run's."""
    folder = run.output_dir.parent / name
    shutil.copytree(run.output_dir, folder)
    for later in ("final", "checkpoint-6"):
        shutil.rmtree(folder / later)
    resumed = launch(folder, *args, "--resume_from_checkpoint", "latest", **launch_kwargs)
    assert "at step 3" in resumed.stdout
    rows, ref_rows = resumed.train_rows(), run.train_rows()
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    torch.testing.assert_close(torch.tensor([r["loss"] for r in rows[3:]]),
                               torch.tensor([r["loss"] for r in ref_rows[3:]]), rtol=1e-6, atol=1e-6)
    assert_same_adapter(resumed, run, rtol=1e-6, atol=1e-6)
    return resumed


def deepspeed_module_keys(checkpoint: Path) -> set[str]:
    """Keys of the model file DeepSpeed wrote (rank 0's)."""
    files = sorted((checkpoint / "pytorch_model").glob("*model_states.pt"))
    assert files, f"no DeepSpeed model file in {checkpoint}"
    state = torch.load(files[0], map_location="cpu", weights_only=False)
    assert state.get("frozen_param_fragments") is None  # ZeRO-2/3 would otherwise save the frozen base here
    return set(state["module"])


# ------------------------------------------------------------------------------------------- LoRA
def test_lora_under_zero3_saves_a_full_adapter_and_resumes(reference, args, tiny_model, eval_texts, tmp_path):
    ref = reference("lora")
    run = launch(tmp_path / "zero3", *args, *TWO_PROCESSES, preset="zero3")
    assert_launch(run, "DEEPSPEED", "DeepSpeedEngine")
    assert json.loads((run.output_dir / "final" / "ds_config.json").read_text())["zero_optimization"]["stage"] == 3
    summary = ref.state()["model"]  # counted at full size although each rank holds half of every parameter
    assert f"{summary['trainable_parameters']:,} of {summary['parameters']:,} parameters trained" in run.stdout
    # ZeRO-3 reduce-scatters gradients in its own bucket order: last-bit gradient differences, which Adam's
    # normalised update turns into up to ~1/500 of one step (lr 1e-2) on elements whose gradient is near zero
    assert_same_training(run, ref, atol=5e-5)
    assert_reloads(run, ref, tiny_model, eval_texts, "lora")
    keys = deepspeed_module_keys(run.output_dir / "checkpoint-3")  # the trained weights only
    assert keys and all(".lora_" in k for k in keys)
    resume_from_step_3(run, "zero3-resumed", *args, *TWO_PROCESSES, preset="zero3")


def test_lora_under_fsdp2_saves_a_full_adapter_and_resumes(reference, args, tiny_model, eval_texts, tmp_path):
    ref = reference("lora")
    fsdp = {"preset": "fsdp2", "processes": 2, "script": FSDP_LAUNCHER}
    run = launch(tmp_path / "fsdp2", *args, *TWO_PROCESSES, **fsdp)
    assert_launch(run, "FSDP", "FSDPCausalLMTokenLoss")
    assert "FSDPLlamaDecoderLayer" in run.state()["launch"]["sharded_modules"]
    assert_same_training(run, ref)
    assert_reloads(run, ref, tiny_model, eval_texts, "lora")
    shards = sorted(p.name for p in (run.output_dir / "checkpoint-3" / "pytorch_model_fsdp_0").glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"]
    resume_from_step_3(run, "fsdp2-resumed", *args, *TWO_PROCESSES, **fsdp)


# ------------------------------------------------------------------------------------------ QLoRA
def test_qlora_under_zero2_matches_one_process_and_resumes(reference, args, tiny_model, eval_texts, tmp_path):
    ref = reference("qlora")
    run = launch(tmp_path / "zero2", *args, *QLORA, *TWO_PROCESSES, preset="zero2")
    assert_launch(run, "DEEPSPEED", "DeepSpeedEngine")
    assert run.state()["model"]["quantized_linear_layers"] == {"Linear4bit": 14}
    assert_same_training(run, ref)
    assert_reloads(run, ref, tiny_model, eval_texts, "qlora")
    # the engine's model file: adapter weights and bitsandbytes' small quantization state, no 4-bit base weights
    keys = deepspeed_module_keys(run.output_dir / "checkpoint-3")
    assert any(".lora_" in k for k in keys) and all(".lora_" in k or any(q in k for q in QUANT_STATE_KEYS)
                                                    for k in keys), sorted(keys)[:5]
    resume_from_step_3(run, "zero2-resumed", *args, *QLORA, *TWO_PROCESSES, preset="zero2")


def test_qlora_with_zero3_preset_is_refused_before_loading(args, tmp_path):
    """One process of the preset: the refusal depends on the strategy, not on the process count (that a refusal in
    every process is printed once is test_parallelism's test_a_strategy_accelerate_would_silently_swap_is_refused)."""
    out = tmp_path / "out"
    run = launch(out, *args, *QLORA, *TWO_PROCESSES, preset="zero3", processes=1, check=False)
    assert run.returncode != 0
    assert "load_in_4bit with DeepSpeed ZeRO-3 is refused" in first_paragraph(run.stderr)
    assert "Loading weights" not in run.stderr and not out.exists()


def test_qlora_under_fsdp2_shards_the_4bit_weights_and_matches_one_process(reference, args, tiny_model, eval_texts,
                                                                          tmp_path):
    """bnb_4bit_quant_storage = dtype (float32): the packed 4-bit weights are float32 tensors that FSDP2 shards
    like any other parameter (accelerate leaves uint8 ones unsharded, which hftrain refuses)."""
    ref = reference("qlora")
    fsdp = {"preset": "fsdp2", "processes": 2, "script": FSDP_LAUNCHER}
    storage = ["--bnb_4bit_quant_storage", "float32"]
    run = launch(tmp_path / "fsdp2", *args, *QLORA, *storage, *TWO_PROCESSES, **fsdp)
    assert_launch(run, "FSDP", "FSDPCausalLMTokenLoss")
    assert run.state()["model"]["quantized_linear_layers"] == {"Linear4bit": 14}
    # every parameter, the 4-bit weights included, is a DTensor shard
    n_params = len(list(adapter_model(tiny_model, "qlora_4bit", ref.output_dir / "final").parameters()))
    assert run.state()["launch"]["dtensor_parameters"] == n_params
    assert_same_training(run, ref)
    assert_reloads(run, ref, tiny_model, eval_texts, "qlora")
    resume_from_step_3(run, "fsdp2-resumed", *args, *QLORA, *storage, *TWO_PROCESSES, **fsdp)


@pytest.mark.parametrize("flags, expected", [
    (QLORA, "set bnb_4bit_quant_storage: float32"),  # uint8 4-bit weights would stay whole on every rank
    (["--load_in_8bit"], "load_in_8bit with FSDP is refused"),
])
def test_quantized_fsdp2_launches_refused_before_loading(args, tmp_path, flags, expected):
    """One process of the preset, as the ZeRO-3 refusal above."""
    out = tmp_path / "out"
    run = launch(out, *args, *flags, *TWO_PROCESSES, preset="fsdp2", processes=1, script=FSDP_LAUNCHER, check=False)
    assert run.returncode != 0
    assert expected in first_paragraph(run.stderr)
    assert "Loading weights" not in run.stderr and not out.exists()
