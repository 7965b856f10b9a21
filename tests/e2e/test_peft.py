"""LoRA, DoRA, QLoRA (4-bit) and 8-bit LoRA through `accelerate launch`, adapter round trips and `hftrain.merge`.

References are computed here with transformers + peft directly (the base loaded and quantized as the recipe says,
`PeftModel.from_pretrained` on the saved adapter, the HF model's own loss), never with hftrain's loss or loaders.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from tests.conftest import REPO, launch, run_main_cases, run_script, write_jsonl
from tests.hub_server import FakeHub
from tests.model_cards import check_card

pytestmark = pytest.mark.launch
N_EVAL = 16
METHODS = {  # the flags that turn the same recipe into each method
    "lora": [],
    "dora": ["--use_dora"],
    "qlora_4bit": ["--load_in_4bit", "--bnb_4bit_use_double_quant"],
    "lora_8bit": ["--load_in_8bit", "--optim", "paged_adamw_8bit"],
}
QUANTIZED = {"qlora_4bit": "Linear4bit", "lora_8bit": "Linear8bitLt"}
CARD_TAGS = {"lora": "lora", "dora": "dora", "qlora_4bit": "qlora", "lora_8bit": "lora"}  # the method's hub tag


@pytest.fixture(scope="module")
def eval_texts() -> list[str]:
    lines = (REPO / "data" / "text.jsonl").read_text().splitlines()[-N_EVAL:]
    return [json.loads(line)["text"] for line in lines]


@pytest.fixture(scope="module")
def eval_file(tmp_path_factory, eval_texts) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("eval") / "eval.jsonl", [{"text": t} for t in eval_texts])


def common_args(tiny_model: Path, eval_file: Path) -> list[str]:
    return ["--model_name_or_path", str(tiny_model), "--dataset_name", str(REPO / "data" / "text.jsonl"),
            "--eval_dataset_name", str(eval_file), "--validation_split_percentage", "0", "--max_length", "128",
            "--use_peft", "--lora_r", "8", "--lora_alpha", "16", "--learning_rate", "1e-2",
            "--per_device_train_batch_size", "8", "--per_device_eval_batch_size", "8", "--logging_steps", "1"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_model, eval_file):
    """One 16-step run per method (run on first use, shared by the tests of this module). Without the launcher:
    the methods are the property here, the 2-process and refusal tests below go through it."""
    runs = {}

    def get(method: str):
        if method not in runs:
            runs[method] = run_script(tmp_path_factory.mktemp(method) / "out", *common_args(tiny_model, eval_file),
                                  *METHODS[method], "--max_steps", "16", "--eval_steps", "8", "--save_steps", "8")
        return runs[method]

    return get


# ------------------------------------------------------------------ independent references
def bnb_config(method: str):
    from transformers import BitsAndBytesConfig

    if method == "qlora_4bit":
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                  bnb_4bit_compute_dtype=torch.float32)
    if method == "lora_8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    return None


def base_model(tiny_model: Path, method: str | None = None):
    from transformers import AutoModelForCausalLM

    config = bnb_config(method) if method else None
    model = AutoModelForCausalLM.from_pretrained(tiny_model, quantization_config=config).eval()
    for module in model.modules():  # bf16 repacking on AVX512-BF16 CPUs is not the layout the adapter trained on
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    return model


def adapter_model(tiny_model: Path, method: str, adapter: Path):
    from peft import PeftModel

    return PeftModel.from_pretrained(base_model(tiny_model, method), str(adapter)).eval()


@torch.no_grad()
def eval_loss(model, tokenizer, texts: list[str]) -> float:
    """Token-weighted mean next-token loss of the texts (EOS appended), from the HF model's own loss."""
    rows = [tokenizer(t)["input_ids"] + [tokenizer.eos_token_id] for t in texts]
    width = max(map(len, rows))
    input_ids = torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r in rows])
    attention_mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss.item()


@torch.no_grad()
def logits(model, tiny_model: Path) -> torch.Tensor:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    texts = ["What is 3 + 4? 3 + 4 = 7.", "Spell ocean backwards. ocean backwards is naeco."]
    enc = tokenizer(texts, padding=True, return_tensors="pt")
    return model(**enc).logits[enc["attention_mask"].bool()]


# ------------------------------------------------------------------------------ training
@pytest.mark.parametrize("method", METHODS)
def test_each_method_trains_and_saves_an_adapter(trained, tiny_model, eval_texts, method):
    from transformers import AutoTokenizer

    run = trained(method)
    state = run.state()
    assert (state["launch"]["distributed_type"], state["launch"]["num_processes"]) == ("NO", 1)
    summary = state["model"]
    assert summary["method"] == ("dora" if method == "dora" else "lora")
    assert summary["quantized_linear_layers"] == ({QUANTIZED[method]: 14} if method in QUANTIZED else {})
    assert f"{summary['trainable_parameters']:,} of {summary['parameters']:,} parameters trained" in run.stdout
    base = {"qlora_4bit": " of a 4-bit quantized base", "lora_8bit": " of an 8-bit quantized base"}.get(method, "")
    assert f"{summary['method']} fine-tuning{base}, " in run.stdout
    assert "FutureWarning" not in run.stderr, run.stderr[-2000:]  # transformers' note to peft, around peft's calls

    rows = run.train_rows()
    assert [r["step"] for r in rows] == list(range(1, 17))
    assert sum(r["loss"] for r in rows[-4:]) < sum(r["loss"] for r in rows[:4]) - 4 * 0.1, "loss did not fall"
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    untrained = eval_loss(base_model(tiny_model, method if method in QUANTIZED else None), tokenizer, eval_texts)
    evals = [r["eval_loss"] for r in run.eval_rows()]
    assert len(evals) == 2 and evals[1] < evals[0] < untrained - 0.05
    # each evaluation is printed, not only the last; in a log, one plain line per logged step instead of a bar
    assert f"hftrain: eval_loss {evals[0]:.4f} at step 8\n" in run.stdout
    assert f"hftrain: eval_loss {evals[1]:.4f} after 16 steps\n" in run.stdout
    assert [line.split(":")[1] for line in run.stderr.splitlines() if line.startswith("training: step")] == \
        [f" step {step}/16" for step in range(1, 17)]

    final = run.output_dir / "final"
    names = {p.name for p in final.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json", "chat_template.jinja"} <= names
    assert not names & {"model.safetensors", "pytorch_model.bin"}  # adapter only, no base copy
    adapter_keys = set(load_file(final / "adapter_model.safetensors"))
    assert adapter_keys and all(".lora_" in k for k in adapter_keys)
    # checkpoint-8 holds the trained weights only: adapter-sized, no frozen or quantized base tensors
    with safe_open(str(run.output_dir / "checkpoint-8" / "model.safetensors"), framework="pt") as f:
        checkpoint_keys = set(f.keys())
    assert checkpoint_keys and all(".lora_" in k for k in checkpoint_keys)
    assert len(checkpoint_keys) == len(adapter_keys)
    # a model card instead of peft's empty template; the adapter's quick start (peft's AutoPeftModel) runs
    check_card(final, library="peft", base_model=tiny_model, tags={"sft", CARD_TAGS[method]},
               rows=run.metrics(), run_quick_start=method == "lora")


@pytest.mark.parametrize("method", METHODS)
def test_adapter_round_trip_gives_the_trained_model(trained, tiny_model, eval_texts, method):
    """peft's own loader on the saved adapter (base quantized as in training) reproduces the run's final eval loss,
    which hftrain computed from the in-memory model just before saving."""
    from transformers import AutoTokenizer

    run = trained(method)
    reloaded = adapter_model(tiny_model, method, run.output_dir / "final")
    got = eval_loss(reloaded, AutoTokenizer.from_pretrained(run.output_dir / "final"), eval_texts)
    assert got == pytest.approx(run.eval_rows()[-1]["eval_loss"], rel=1e-5)


def test_qlora_resume_reproduces_uninterrupted_run(trained, tiny_model, eval_file, tmp_path):
    """Resuming from a trained-weights-only checkpoint (the 4-bit base is rebuilt from the base model)."""
    full = trained("qlora_4bit")
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(full.output_dir, resumed_dir)
    for later in ("final", "checkpoint-16"):  # as if preempted after step 8's checkpoint
        shutil.rmtree(resumed_dir / later)
    resumed = launch(resumed_dir, *common_args(tiny_model, eval_file), *METHODS["qlora_4bit"], "--max_steps", "16",
                     "--eval_steps", "8", "--save_steps", "100", "--resume_from_checkpoint", "latest")
    assert "at step 8" in resumed.stdout
    for a, b in zip(full.train_rows()[8:], resumed.train_rows()[8:], strict=True):
        assert a["step"] == b["step"] and abs(a["loss"] - b["loss"]) < 1e-6
    p_full = load_file(full.output_dir / "final" / "adapter_model.safetensors")
    p_resumed = load_file(resumed_dir / "final" / "adapter_model.safetensors")
    for name in p_full:
        torch.testing.assert_close(p_resumed[name], p_full[name], rtol=0, atol=1e-7)


def test_qlora_two_process_ddp_with_checkpointing_matches_one_process(tmp_path, tiny_model, eval_file):
    """QLoRA + 2-rank DDP + non-reentrant gradient checkpointing: real DDP, same steps as 1 rank x 2 accumulation."""
    common = [*common_args(tiny_model, eval_file), *METHODS["qlora_4bit"], "--lora_dropout", "0",
              "--gradient_checkpointing", "--max_steps", "6", "--per_device_train_batch_size", "4"]
    one = run_script(tmp_path / "one", *common, "--gradient_accumulation_steps", "2")
    two = launch(tmp_path / "two", *common, preset="cpu_ddp")
    info = two.state()["launch"]
    assert (info["distributed_type"], info["num_processes"], info["backend"]) == ("MULTI_CPU", 2, "gloo")
    assert info["model_wrapper"] == "DistributedDataParallel"
    assert two.state()["model"]["quantized_linear_layers"] == {"Linear4bit": 14}
    torch.testing.assert_close(torch.tensor([r["loss"] for r in two.train_rows()]),
                               torch.tensor([r["loss"] for r in one.train_rows()]), rtol=1e-5, atol=1e-6)
    assert two.train_rows()[-1]["loss"] < two.train_rows()[0]["loss"]
    a1 = load_file(one.output_dir / "final" / "adapter_model.safetensors")
    a2 = load_file(two.output_dir / "final" / "adapter_model.safetensors")
    assert a1.keys() == a2.keys()
    for name in a1:
        torch.testing.assert_close(a2[name], a1[name], rtol=1e-4, atol=1e-6)


# --------------------------------------------------------------------------------- merge
def run_merge(*args: str, check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "hftrain.merge", *args], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}, timeout=600)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.parametrize("method", METHODS)
def test_merged_model_equals_the_adapter_model(trained, tiny_model, tmp_path, method):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = trained(method)
    merged_dir = tmp_path / "merged"
    proc = run_merge(str(run.output_dir / "final"), str(merged_dir))
    assert f"into the {'dequantized' if method in QUANTIZED else 'full-precision'} base" in proc.stdout
    assert "FutureWarning" not in proc.stderr and "Setting accelerator" not in proc.stderr, proc.stderr[-2000:]

    # a standard folder: no quantization or peft leftovers, the base's tensor names, one float dtype
    config = json.loads((merged_dir / "config.json").read_text())
    assert "quantization_config" not in config and config["architectures"] == ["LlamaForCausalLM"]
    merged_tensors = load_file(merged_dir / "model.safetensors")
    assert merged_tensors.keys() == load_file(tiny_model / "model.safetensors").keys()
    assert {t.dtype for t in merged_tensors.values()} == {torch.float32}
    assert AutoTokenizer.from_pretrained(merged_dir).chat_template

    check_card(merged_dir, library="transformers", base_model=tiny_model,
               tags={"sft", "merge", CARD_TAGS[method]}, rows=run.metrics())

    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    got = logits(merged, tiny_model)
    expected = logits(adapter_model(tiny_model, method, run.output_dir / "final"), tiny_model)
    effect = (expected - logits(base_model(tiny_model, method if method in QUANTIZED else None), tiny_model)).abs()
    assert effect.max() > 0.1, "the adapter changes nothing: the comparison would be vacuous"
    if method == "lora_8bit":
        # LLM.int8 also quantizes activations, so the 8-bit model differs from any float model by ~1e-2;
        # the merge itself is exact against the dequantized base + unmerged adapter
        from peft import PeftModel

        dequantized = base_model(tiny_model, method).dequantize(dtype=torch.float32)
        unmerged = PeftModel.from_pretrained(dequantized, str(run.output_dir / "final")).eval()
        torch.testing.assert_close(got, logits(unmerged, tiny_model), rtol=0, atol=1e-5)
        assert (got - expected).abs().max() < 0.05
        return
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    if method == "qlora_4bit":
        # sharp: merging into the original (never quantized) weights misses the trained model by far more
        from peft import PeftModel

        naive = PeftModel.from_pretrained(base_model(tiny_model), str(run.output_dir / "final")).merge_and_unload()
        assert (logits(naive, tiny_model) - expected).abs().max() > 1e-2


def test_merge_dtype_and_push_to_hub_dry_run(trained, tmp_path):
    run = trained("lora")
    merged_dir = tmp_path / "merged-bf16"
    proc = run_merge(str(run.output_dir / "final"), str(merged_dir), "--dtype", "bfloat16", "--push_to_hub",
                     "someone/tiny-lora-merged", "--private", "--dry_run")
    assert "would upload" in proc.stdout and "https://huggingface.co/someone/tiny-lora-merged (private)" in proc.stdout
    assert "model.safetensors" in proc.stdout and "config.json" in proc.stdout
    assert {t.dtype for t in load_file(merged_dir / "model.safetensors").values()} == {torch.bfloat16}
    record = json.loads((merged_dir / "hftrain_merge.json").read_text())
    assert record["dtype"] == "bfloat16" and record["merged_into"] == "full-precision base"

    # the same push for real, to a local fake hub: the repo is created private and holds the merged folder, card
    # included, byte for byte
    pushed_dir = tmp_path / "merged-pushed"
    with FakeHub() as hub:
        proc = run_merge(str(run.output_dir / "final"), str(pushed_dir), "--push_to_hub", "someone/tiny-lora-merged",
                         "--private", env={"HF_ENDPOINT": hub.url, "HF_TOKEN": "hf_fake_token", "HF_HUB_OFFLINE": "0"})
    assert f"uploaded {len(list(pushed_dir.iterdir()))} files to" in proc.stdout
    repo = hub.repos["someone/tiny-lora-merged"]
    assert repo.private is True and [message for _, message, _ in repo.commits] == ["Upload model merged with hftrain"]
    assert repo.branches["main"] == {p.name: p.read_bytes() for p in pushed_dir.iterdir()}
    card = check_card(pushed_dir, library="transformers", base_model=Path(record["base_model_name_or_path"]),
                      tags={"merge", "lora"})
    assert 'from_pretrained("someone/tiny-lora-merged")' in card.text


def test_merge_silences_only_its_libraries_notes(trained, tmp_path):
    """The FutureWarning transformers raises at peft's reads and DeepSpeed's accelerator warning are silenced where
    hftrain triggers them; a warning of the calling program, after the merge, still shows."""
    run = trained("lora")
    code = ("import sys, warnings; from hftrain.merge import main; main(sys.argv[1:]); "
            "warnings.warn('the caller deprecates something', FutureWarning)")
    proc = subprocess.run([sys.executable, "-c", code, str(run.output_dir / "final"), str(tmp_path / "merged")],
                          capture_output=True, text=True, cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"},
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "FutureWarning: the caller deprecates something" in proc.stderr
    assert proc.stderr.count("Warning") == 1 and "Setting accelerator" not in proc.stderr, proc.stderr


def test_merge_refuses_bad_input(tmp_path):
    proc = run_merge(str(tmp_path), str(tmp_path / "merged"), check=False)
    assert proc.returncode == 2 and proc.stderr.startswith("hftrain: error:") and "adapter_config.json" in proc.stderr
    assert "Traceback" not in proc.stderr
    # a push that cannot work is refused before the merge loads anything: a repo id the hub refuses, no token
    proc = run_merge(str(tmp_path), str(tmp_path / "merged"), "--push_to_hub", "a/b/c", check=False,
                     env={"HF_HOME": str(tmp_path / "hf_home"), "HF_TOKEN": ""})
    message = " ".join(proc.stderr.split())
    assert proc.returncode == 2 and message.startswith("hftrain: error: invalid command line, 3 problems")
    assert "--push_to_hub 'a/b/c' is not a valid hub repo id" in message and "none is set" in message
    assert "HF_HUB_OFFLINE=1" in message and "Traceback" not in message and not (tmp_path / "merged").exists()


# ------------------------------------------------------------------------ refused combos
def first_paragraph(stderr: str) -> str:
    lines = stderr[stderr.index("hftrain: error:"):].splitlines()
    paragraph = []
    for line in lines:
        if not line.strip() or line.startswith(("Traceback", "subprocess.")):
            break
        paragraph.append(line)
    return " ".join(paragraph)


@pytest.mark.parametrize("args, expected", [
    (["--load_in_4bit", "--load_in_8bit"],
     ["load_in_4bit, load_in_8bit only apply to adapter training", "load_in_4bit and load_in_8bit are both true"]),
    (["--use_peft", "--use_dora", "--load_in_8bit"], ["use_dora with load_in_8bit fails on CPU"]),
])
def test_refused_combinations_through_the_launcher(tmp_path, args, expected):
    out = tmp_path / "out"
    run = launch(out, "--config", str(REPO / "recipes" / "tiny-chat.yaml"), *args, check=False)
    assert run.returncode != 0
    message = first_paragraph(run.stderr)
    assert all(text in message for text in expected), message
    assert "Traceback" not in run.stderr[: run.stderr.index("hftrain: error:")]
    assert not out.exists()


QUANTIZED_UNDER_PRESET = {  # what `accelerate launch` passes for a ZeRO-3 / FSDP preset (environment variables)
    "zero3": ({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(REPO / "ds_configs" /
                                                                                          "zero3.json")},
              "load_in_4bit with DeepSpeed ZeRO-3 is refused"),
    "fsdp2": ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}, "set bnb_4bit_quant_storage: float32"),
}


@pytest.fixture(scope="module")
def quantized_refusals(tmp_path_factory) -> dict:
    """Both cases through `hftrain.finetune.main(argv)` in one Python process (tests/e2e/main_cases.py)."""
    root = tmp_path_factory.mktemp("quantized-refused")
    cases = {name: (["--config", str(REPO / "recipes" / "tiny-chat.yaml"), "--output_dir", str(root / name / "out"),
                     "--use_peft", "--load_in_4bit"], env) for name, (env, _) in QUANTIZED_UNDER_PRESET.items()}
    return run_main_cases(cases, root)


@pytest.mark.parametrize("preset", QUANTIZED_UNDER_PRESET)
def test_quantized_launch_refused_before_loading(quantized_refusals, preset):
    """What `accelerate launch` passes for a ZeRO-3 / FSDP preset (environment variables), without those presets."""
    run, expected = quantized_refusals[preset], QUANTIZED_UNDER_PRESET[preset][1]
    assert run.returncode == 2
    assert expected in first_paragraph(run.stderr) and "Traceback" not in run.stderr
    assert not run.output_dir.exists()
