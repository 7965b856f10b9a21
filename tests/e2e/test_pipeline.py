"""Pipeline parallelism (pp_size, parallel/pipeline/) through `accelerate launch` with the cpu_pp preset (2 gloo
processes, one 2-stage pipeline; GPipe on 4: two data-parallel copies of the pipeline; pp2xtp2 on 4: each stage's
layers split by transformers' tp plan; the 3D layout, pp2xtp2xdp2 on 8, continuing a one-process checkpoint, and
opt-in from step 1) against one process on the same global batch of 16 examples.

The model is a 4-layer tiny Llama built by scripts/make_tiny_model.py, and the same weights with tied input/output
embeddings. The data is the assistant-only chat set: the 4 microbatches of 2 rows of each per-device batch hold
unequal numbers of trained tokens, so a per-microbatch mean (Megatron's default, #4590) would differ from the
step's token-weighted loss. Steps use accumulation 2 and max_grad_norm 0.5 (the norms are 2-4: clipping is active),
so the norm summed over stages (and tp shards), the tied gradient summed between the first and the last stage and
the loss normalisation all show in the per-step numbers and the final weights. The layouts share one reference per
model; the refusals (the layout ones, and resumes that cross layouts a pipeline cannot read) run in one process
(tests/e2e/main_cases.py). QLoRA on packed rows with gradient checkpointing runs once under pp and once on one process
(without checkpointing), and the pp run's checkpoint-2 continues on one process.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import FSDP_LAUNCHER, REPO, TINY_CHAT, Run, build_tiny_model, launch, run_main_cases, run_script

pytestmark = pytest.mark.launch

COMMON = [*TINY_CHAT, "--max_steps", "4", "--logging_steps", "1", "--eval_steps", "2",
          "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "2", "--max_grad_norm", "0.5",
          "--max_length", "128", "--ddp_timeout", "60"]
PP = ["--pp_size", "2", "--pp_microbatches", "4"]
# The untied reference needs no checkpoints; the tied one saves checkpoint-2 (accelerate's files, resumed under pp) and
# so do the pp runs (DCP under HF names; 1F1B's is resumed on one process)
NO_SAVES, SAVES = ["--save_steps", "100", "--checkpoint_preflight", "false"], ["--save_steps", "2"]
REF_SAVES = {"tied": ["--save_steps", "2", "--checkpoint_preflight", "false"], "untied": NO_SAVES}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    """{"untied": 4-layer tiny Llama, "tied": the same with lm_head = embed_tokens (config and weights)}."""
    root = tmp_path_factory.mktemp("pp-models")
    untied = build_tiny_model(root / "untied", "--num_layers", "4", "--tokenizer", str(REPO / "models" / "tiny-llama"))
    tied = root / "tied"
    shutil.copytree(untied, tied)
    config = json.loads((tied / "config.json").read_text())
    (tied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    weights = load_file(tied / "model.safetensors")
    del weights["lm_head.weight"]
    save_file(weights, tied / "model.safetensors", metadata={"format": "pt"})
    return {"untied": untied, "tied": tied}


# name: (schedule, data-parallel copies, tp_size, model). The global batch stays 16 (per-device rows / copies).
LAYOUTS = {
    "1F1B": ("1F1B", 1, 1, "tied"),
    "GPipe": ("GPipe", 2, 1, "untied"),  # pp 2 x 2 data-parallel copies on 4 processes
    # each stage's layers split by transformers' tp plan over 2 processes (4 in all), on the tied model
    "pp2xtp2": ("1F1B", 1, 2, "tied"),
    "Interleaved1F1B": ("Interleaved1F1B", 1, 1, "untied"),
    # two stages per process in a V (rank 0: stages 0 and 3, so the tied embedding and head are one tensor there),
    # the backward split into input and weight gradients, evaluation in a forward-only order; with gradient
    # checkpointing (each decoder layer recomputed inside the split backward: the same numbers as without)
    "ZBVZeroBubble": ("ZBVZeroBubble", 1, 1, "tied"),
}
EXTRA = {"ZBVZeroBubble": ["--gradient_checkpointing", "true"]}  # layout-specific recipe fields
THREE_D = {"pp2xtp2xdp2": ("1F1B", 2, 2, "untied")}  # 8 processes: opt-in (test_3d_trains_like_one_process)
DUALPIPEV = {"DualPipeV": ("DualPipeV", 1, 1, "untied")}  # ZBV's V and split backward: opt-in (test_dualpipev_...)
# pp 2 x FSDP2 on 4 processes (the fsdp2 preset through tests/launchers/fsdp2_on_cpu.py): each stage sharded over its
# 2 data-parallel ranks (test_pp2_x_fsdp2_...)
PP_FSDP2 = {"pp2xfsdp2": ("1F1B", 2, 1, "tied")}


def launch_layout(folder, name: str, models: dict) -> Run:
    schedule, copies, tp, kind = {**LAYOUTS, **THREE_D, **DUALPIPEV}[name]
    return launch(folder, *COMMON, *SAVES, *PP, "--pp_schedule", schedule, "--tp_size", str(tp),
                  "--per_device_train_batch_size", str(8 // copies), "--model_name_or_path", str(models[kind]),
                  *EXTRA.get(name, []), preset="cpu_pp", processes=2 * copies * tp)


@pytest.fixture(scope="module")
def references(models, tmp_path_factory) -> dict[str, Run]:
    """One process per model: {"ref-tied": ..., "ref-untied": ...}."""
    root = tmp_path_factory.mktemp("pp-refs")
    return {f"ref-{kind}": run_script(root / f"ref-{kind}", *COMMON, *REF_SAVES[kind], "--model_name_or_path",
                                      str(path)) for kind, path in models.items()}


@pytest.fixture(scope="module")
def runs(models, references, tmp_path_factory) -> dict[str, Run]:
    """The references, then the layouts under pp 2."""
    root = tmp_path_factory.mktemp("pp-runs")
    return {**references, **{name: launch_layout(root / name, name, models) for name in LAYOUTS}}


def close(a: list[float], b: list[float], tol: float = 1e-4) -> None:
    torch.testing.assert_close(torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64),
                               rtol=tol, atol=tol)


@pytest.mark.parametrize("name", LAYOUTS)
def test_pp2_trains_like_one_process(runs, name):
    """Per-step loss, gradient norm (clipped: above 0.5), learning rate, evaluation and final weights. pp2xtp2: the
    norm sums the stages and the tp shards (replicated tensors once), and the tied gradient, a vocabulary shard on
    the last stage and a whole tensor on the first, is summed whole."""
    assert_pp_run(runs[name], runs[f"ref-{LAYOUTS[name][3]}"], name)
    assert runs[name].state()["model"]["checkpointed_layers"] == (4 if name in EXTRA else 0)


@pytest.mark.skipif(not os.environ.get("HFTRAIN_TEST_3D"),
                    reason="opt-in (HFTRAIN_TEST_3D=1, ~35-60 s: 8 gloo processes on the CI's 2 cores, beyond its "
                           "budget); in CI the 3D layout continues a one-process checkpoint (test_resume_across_pp_"
                           "layouts[one-to-3d]), and pp x tp and pp x copies run from step 1 (test_pp2_trains_like_"
                           "one_process)")
def test_3d_trains_like_one_process(references, models, tmp_path):
    """pp 2 x tp 2 x 2 data-parallel copies (8 processes, the untied model): one DeviceMesh ("pp", "dp", "tp"), the
    token count summed over the 2 copies only, the copies' gradients averaged shard by shard."""
    assert_pp_run(launch_layout(tmp_path / "3d", "pp2xtp2xdp2", models), references["ref-untied"], "pp2xtp2xdp2")


@pytest.mark.skipif(not os.environ.get("HFTRAIN_TEST_DUALPIPEV"),
                    reason="opt-in (HFTRAIN_TEST_DUALPIPEV=1, ~25 s: one more 2-process launch beyond the CI budget); "
                           "its V placement, split backward and forward-only evaluation are ZBVZeroBubble's, which "
                           "runs in CI: test_pp2_trains_like_one_process[ZBVZeroBubble]")
def test_dualpipev_trains_like_one_process(references, models, tmp_path):
    """DualPipeV (torch's overlapped forward/backward pairs on the V placement), the untied model."""
    assert_pp_run(launch_layout(tmp_path / "dualpipev", "DualPipeV", models), references["ref-untied"], "DualPipeV")


def assert_pp_run(run: Run, ref: Run, name: str) -> None:
    schedule, copies, tp, _ = {**LAYOUTS, **THREE_D, **DUALPIPEV, **PP_FSDP2}[name]
    fsdp2 = name in PP_FSDP2
    info = run.state()["launch"]
    assert (info["distributed_type"], info["num_processes"], info["backend"], info["model_wrapper"]) == \
        ("FSDP" if fsdp2 else "MULTI_CPU", 2 * copies * tp, "gloo", "PipelineStages")
    assert run.state()["parallelism"]["dp_world"] == copies
    assert (info["pp_size"], info["pp_schedule"], info["pp_microbatches"], info["tp_size"]) == (2, schedule, 4, tp)
    # rank 0 holds the embedding and layers 0-1: with tp, DTensors (the tp plan's 7 linear layers each, the embedding);
    # under FSDP2 every one of its 19 weights (the embedding, 9 per layer) is a DTensor
    assert info["dtensor_parameters"] == (15 if tp > 1 else 19 if fsdp2 else 0)
    stages = 2 if schedule in ("1F1B", "GPipe") else 4  # Interleaved1F1B and the V schedules: two per process
    assert info["pp_stages"]["stages"] == stages
    layers = [layer for start, stop in info["pp_stages"]["layers"] for layer in range(start, stop)]
    assert layers == [0, 1, 2, 3]  # every layer on exactly one stage
    # full fine-tuning: rank 0 read only its stages' layers from the checkpoint (the others stayed on the meta device)
    owned = sorted(layer for s in info["pp_stages"]["mine"] for layer in range(*info["pp_stages"]["layers"][s]))
    assert info["pp_stages"]["layers_read"] == owned and len(owned) < 4
    rows, ref_rows = run.train_rows(), ref.train_rows()
    assert [r["step"] for r in rows] == [r["step"] for r in ref_rows] == [1, 2, 3, 4]
    assert [r["learning_rate"] for r in rows] == [r["learning_rate"] for r in ref_rows]
    assert [r["trained_tokens"] for r in rows] == [r["trained_tokens"] for r in ref_rows]
    if copies == 1:  # one pipeline sees one process's micro-batches: the same tokens, counted once, not per stage
        close([r["total_tokens_per_second"] * r["step_time"] for r in rows],
              [r["total_tokens_per_second"] * r["step_time"] for r in ref_rows], 1e-9)
    assert min(r["grad_norm"] for r in ref_rows) > 0.5  # clipping active on every step
    close([r["loss"] for r in rows], [r["loss"] for r in ref_rows])
    close([r["grad_norm"] for r in rows], [r["grad_norm"] for r in ref_rows])
    close([r["eval_loss"] for r in run.eval_rows()], [r["eval_loss"] for r in ref.eval_rows()])
    final, expected = load_file(run.output_dir / "final" / "model.safetensors"), \
        load_file(ref.output_dir / "final" / "model.safetensors")
    assert final.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(final[name], value, rtol=1e-4, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
    assert "desync" not in run.stdout + run.stderr


@pytest.fixture(scope="module")
def pp_fsdp2(models, tmp_path_factory) -> Run:
    """pp 2 x FSDP2 (FULL_SHARD) on 4 processes, the tied model, checkpoint-2 saved (after the checkpoint preflight's
    round trip): one run for every assertion below."""
    schedule, copies, _, kind = PP_FSDP2["pp2xfsdp2"]
    return launch(tmp_path_factory.mktemp("pp-fsdp2") / "run", *COMMON, *SAVES, *PP, "--pp_schedule", schedule,
                  "--per_device_train_batch_size", str(8 // copies), "--model_name_or_path", str(models[kind]),
                  preset="fsdp2", processes=4, script=FSDP_LAUNCHER)


def test_pp2_x_fsdp2_trains_like_one_process_with_sharded_stages(pp_fsdp2, references):
    """Each stage's weights sharded by FSDP2 over its 2 data-parallel ranks equal one process: per-step loss, gradient
    norm (clipped; summed over stages and shards), learning rate, evaluation and final weights. FSDP2's reduce-scatter
    averages over the 2 ranks where the copies' mean was, and the tied embedding's gradient is summed block by block
    between the first and the last stage. Sharded, not copied: the main process's weights are Shard(0) DTensors on the
    stage's "dp" mesh, and checkpoint-2 holds each stage's tensors as 2 blocks (one per rank) under their HF names."""
    from torch.distributed.checkpoint import FileSystemReader

    run = pp_fsdp2
    assert_pp_run(run, references["ref-tied"], "pp2xfsdp2")
    layout = ("pipeline parallel (pp_size=2, 1F1B, 4 microbatches) x FSDP2 FULL_SHARD (each stage over 2 "
              "data-parallel ranks) over 4 processes (gloo)")
    assert f"hftrain: {layout}" in run.stdout
    info = run.state()["launch"]
    assert (info["dtensor_meshes"], info["dtensor_placements"]) == (["dp=2"], ["Shard(dim=0)"])
    assert "FSDPLlamaDecoderLayer" in info["sharded_modules"]
    metadata = FileSystemReader(str(run.output_dir / "checkpoint-2" / "pipeline_state")).read_metadata()
    weights = {k.removeprefix("model.lm."): v for k, v in metadata.state_dict_metadata.items()
               if k.startswith("model.")}
    # every HF name once; the tied head also under its own name (the last stage's tensor, as pp saves it)
    assert set(weights) == {*load_file(references["ref-tied"].output_dir / "final" / "model.safetensors"),
                            "lm_head.weight"}
    for name in ("model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight", "model.layers.3.mlp.up_proj.weight"):
        chunks = weights[name].chunks
        assert len(chunks) == 2 and sum(c.sizes[0] for c in chunks) == weights[name].size[0], name


def test_pp2_x_fsdp2_checkpoint_continues_on_pp4(pp_fsdp2, references, models, tmp_path):
    """checkpoint-2 of the pp 2 x FSDP2 run (DCP: each stage's weights and AdamW moments as 2 blocks) continued on
    pp 4 without FSDP2 (the cpu_pp preset: 4 stages of one layer, rank 0 the embedding and layer 0, rank 3 layer 3 and
    the tied head), each rank reading its names from the other layout's blocks: steps 3-4 and the final weights equal
    the uninterrupted run and one process. (The FSDP2 stages' own load is checked before step 1 of every run that
    saves: the checkpoint preflight's round trip.)"""
    tied = ["--model_name_or_path", str(models["tied"])]
    resumed = launch(tmp_path / "pp4", *COMMON, *NO_SAVES, "--pp_size", "4", "--pp_microbatches", "4", *tied,
                     "--resume_from_checkpoint", str(pp_fsdp2.output_dir / "checkpoint-2"), preset="cpu_pp",
                     processes=4)
    info = resumed.state()["launch"]
    assert (info["num_processes"], info["pp_size"], info["distributed_type"]) == (4, 4, "MULTI_CPU")
    assert info["pp_stages"]["layers"] == [[0, 1], [1, 2], [2, 3], [3, 4]]
    rows, again, ref_rows = pp_fsdp2.train_rows(), resumed.train_rows(), references["ref-tied"].train_rows()
    assert [r["step"] for r in again] == [3, 4]
    assert [(r["learning_rate"], r["trained_tokens"]) for r in again] == \
        [(r["learning_rate"], r["trained_tokens"]) for r in ref_rows[2:]]
    for key in ("loss", "grad_norm"):
        close([r[key] for r in again], [r[key] for r in rows[2:]], 1e-5)
        close([r[key] for r in again], [r[key] for r in ref_rows[2:]])
    final = load_file(resumed.output_dir / "final" / "model.safetensors")
    for run, tol in ((pp_fsdp2, 1e-5), (references["ref-tied"], 1e-4)):
        expected = load_file(run.output_dir / "final" / "model.safetensors")
        assert final.keys() == expected.keys()
        for key, value in expected.items():
            torch.testing.assert_close(final[key], value, rtol=tol, atol=tol, msg=lambda m, n=key: f"{n}: {m}")


@pytest.mark.parametrize("name", ["1F1B", "pp2xtp2"])
def test_final_pipeline_model_loads_at_full_size(runs, models, name):
    """The pp run's final folder is one from_pretrained model with every layer (tied head included), gathered from
    the stages and, under pp x tp, from the tp shards."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(runs[name].output_dir / "final")
    reference = AutoModelForCausalLM.from_pretrained(models["tied"])
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert len(model.model.layers) == 4
    assert {n: p.shape for n, p in model.named_parameters()} == {n: p.shape for n, p in reference.named_parameters()}
    assert not torch.equal(model.model.layers[3].mlp.up_proj.weight, reference.model.layers[3].mlp.up_proj.weight)


def test_pipeline_checkpoint_holds_hf_names(runs):
    """checkpoint-2 of a pp run: torch.distributed.checkpoint's folder with every stage's HF parameter names."""
    from torch.distributed.checkpoint import FileSystemReader

    folder = runs["GPipe"].output_dir / "checkpoint-2" / "pipeline_state"
    keys = set(FileSystemReader(str(folder)).read_metadata().state_dict_metadata)
    weights = {k.removeprefix("model.") for k in keys if k.startswith("model.")}
    expected = set(load_file(runs["ref-untied"].output_dir / "final" / "model.safetensors"))
    assert {k.removeprefix("lm.") for k in weights} == expected


@pytest.fixture(scope="module")
def resumed(runs, models, tmp_path_factory) -> dict[str, Run]:
    """checkpoint-2 of the pp 2 x tp 2 run (DCP: every stage's tensors, the tp-sharded ones in shards) continued on one
    process and under tp 2 without pp (converted to one process's files, then cut into each rank's blocks), and
    checkpoint-2 of the one-process run continued in 3D: pp 2 x tp 2 x 2 data-parallel copies on 8
    processes with Interleaved1F1B (4 stages: the numbering of the whole model's optimizer mapped onto each rank's
    two stages, whole tensors placed as the parameters' DTensor shards; each copy trains on half of the global batch
    of 16 and the copies average their gradients shard by shard); both on the tied model (the head's weight and
    state come from the embedding's, and back). The 3D layout's steps 3-4 are its CI
    exactness check (steps 1-4 from scratch: the opt-in test_3d_trains_like_one_process)."""
    root = tmp_path_factory.mktemp("pp-resumed")
    tied = ["--model_name_or_path", str(models["tied"])]
    return {
        "pp2xtp2-to-one": run_script(root / "pp2xtp2-to-one", *COMMON, *NO_SAVES, *tied, "--resume_from_checkpoint",
                                     str(runs["pp2xtp2"].output_dir / "checkpoint-2")),
        "pp2xtp2-to-tp": launch(root / "pp2xtp2-to-tp", *COMMON, *NO_SAVES, *tied, "--tp_size", "2",
                                "--per_device_train_batch_size", "16", "--gradient_accumulation_steps", "1",
                                "--resume_from_checkpoint", str(runs["pp2xtp2"].output_dir / "checkpoint-2"),
                                preset="tp"),
        "one-to-3d": launch(root / "one-to-3d", *COMMON, *NO_SAVES, *PP, "--pp_schedule", "Interleaved1F1B",
                            "--tp_size", "2", "--per_device_train_batch_size", "4", *tied, "--resume_from_checkpoint",
                            str(runs["ref-tied"].output_dir / "checkpoint-2"), preset="cpu_pp", processes=8),
    }


@pytest.mark.parametrize("name", ["pp2xtp2-to-one", "pp2xtp2-to-tp", "one-to-3d"])
def test_resume_across_pp_layouts(runs, resumed, name):
    """Steps 3-4 after the other layout's checkpoint-2 equal the uninterrupted one-process run: step 3's loss checks
    the weights, step 4's loss and grad norm and the final weights the optimizer state (AdamW's moments and step, by
    HF name), the learning rates the scheduler."""
    run, ref = resumed[name], runs["ref-tied"]
    info = run.state()["launch"]
    pp = name == "one-to-3d"
    assert (info["num_processes"], info["pp_size"], info["tp_size"], info["model_wrapper"]) == \
        {"one-to-3d": (8, 2, 2, "PipelineStages"), "pp2xtp2-to-tp": (2, 1, 2, "CausalLMTokenLoss"),
         "pp2xtp2-to-one": (1, 1, 1, "CausalLMTokenLoss")}[name]
    if pp:
        assert info["pp_stages"]["stages"] == 4 and info["dtensor_parameters"] > 0
        assert run.state()["parallelism"]["dp_world"] == 2  # two copies of the 4-process pipeline
        assert "effective batch 16 = 4 per device x 2 accumulation x 2 data-parallel groups" in run.stdout
        assert [r["trained_tokens"] for r in run.train_rows()] == [r["trained_tokens"] for r in ref.train_rows()[2:]]
    rows, ref_rows = run.train_rows(), ref.train_rows()[2:]
    assert [r["step"] for r in rows] == [r["step"] for r in ref_rows] == [3, 4]
    assert [r["learning_rate"] for r in rows] == [r["learning_rate"] for r in ref_rows]
    close([r["loss"] for r in rows], [r["loss"] for r in ref_rows])
    close([r["grad_norm"] for r in rows], [r["grad_norm"] for r in ref_rows])
    final, expected = load_file(run.output_dir / "final" / "model.safetensors"), \
        load_file(ref.output_dir / "final" / "model.safetensors")
    assert final.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(final[key], value, rtol=1e-4, atol=1e-4, msg=lambda m, n=key: f"{n}: {m}")
    assert not list(runs["pp2xtp2"].output_dir.glob(".unpipelined-*"))  # the converted copy is removed


# QLoRA (LoRA adapters on a 4-bit NF4 base) under pp: each stage trains the adapters of its layers. lora_dropout 0:
# dropout draws differ between one process and the stages' processes. Packed rows (593 chats in 218 rows): the
# documents' position_ids travel between the stages, so attention stays inside each document.
QLORA = ["--use_peft", "true", "--lora_dropout", "0", "--load_in_4bit", "true", "--packing", "true"]


@pytest.fixture(scope="module")
def adapters(models, tmp_path_factory) -> dict[str, Run]:
    """QLoRA on the untied 4-layer model: one process (saves checkpoint-2), pp 2 (1F1B) with gradient checkpointing
    (saves checkpoint-2, with the checkpoint preflight's round trip), and the pp run's checkpoint-2 continued on one
    process."""
    root = tmp_path_factory.mktemp("pp-qlora")
    model = ["--model_name_or_path", str(models["untied"])]
    out = {"ref": run_script(root / "ref", *COMMON, *QLORA, *model, *REF_SAVES["tied"]),
           "pp": launch(root / "pp", *COMMON, *QLORA, *model, *SAVES, *PP, "--gradient_checkpointing", "true",
                        preset="cpu_pp", processes=2)}
    out["pp-to-one"] = run_script(root / "pp-to-one", *COMMON, *QLORA, *model, *NO_SAVES, "--resume_from_checkpoint",
                                  str(out["pp"].output_dir / "checkpoint-2"))
    return out


def assert_same_adapter(folder, expected_folder) -> dict:
    final, expected = load_file(folder / "adapter_model.safetensors"), \
        load_file(expected_folder / "adapter_model.safetensors")
    assert final.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(final[key], value, rtol=1e-4, atol=1e-4, msg=lambda m, n=key: f"{n}: {m}")
    return final


def test_pp2_packed_qlora_with_gradient_checkpointing_trains_like_one_process(adapters, models):
    """Per-step loss, gradient norm (clipped), learning rate, evaluation and the saved adapter (every stage's LoRA
    weights under peft's names) equal one process without gradient checkpointing, on packed rows (attention across
    documents would change every loss); the adapter loads with peft on one process with every layer's trained
    weights."""
    from peft import PeftModel, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    run, ref = adapters["pp"], adapters["ref"]
    info, model = run.state()["launch"], run.state()["model"]
    assert (info["distributed_type"], info["num_processes"], info["model_wrapper"], info["pp_size"]) == \
        ("MULTI_CPU", 2, "PipelineStages", 2)
    assert (model["method"], model["quantized_linear_layers"], model["checkpointed_layers"]) == \
        ("lora", {"Linear4bit": 28}, 4)  # 7 projections x 4 layers; every decoder layer recomputes in backward
    # adapters: every rank reads every layer (peft's initial draws as one process's), then keeps its stage's
    assert info["pp_stages"]["layers_read"] == [0, 1, 2, 3]
    assert ref.state()["model"]["checkpointed_layers"] == 0
    # the whole pipeline's counts (each stage's added), as one process counts them
    for r in (run, ref):
        assert "69,632 of 330,432 parameters trained" in r.stdout and "593 training examples in 218 rows" in r.stdout
    rows, ref_rows = run.train_rows(), ref.train_rows()
    assert [r["step"] for r in rows] == [r["step"] for r in ref_rows] == [1, 2, 3, 4]
    assert [r["learning_rate"] for r in rows] == [r["learning_rate"] for r in ref_rows]
    assert min(r["grad_norm"] for r in ref_rows) > 0.5  # clipping active
    close([r["loss"] for r in rows], [r["loss"] for r in ref_rows])
    close([r["grad_norm"] for r in rows], [r["grad_norm"] for r in ref_rows])
    close([r["eval_loss"] for r in run.eval_rows()], [r["eval_loss"] for r in ref.eval_rows()])
    saved = assert_same_adapter(run.output_dir / "final", ref.output_dir / "final")
    assert {k.split(".layers.")[1].split(".")[0] for k in saved} == {"0", "1", "2", "3"}  # both stages' layers
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(models["untied"]), run.output_dir / "final")
    state = get_peft_model_state_dict(loaded)
    assert state.keys() == saved.keys()
    for key, value in saved.items():
        torch.testing.assert_close(state[key], value, rtol=0, atol=0)
        assert "lora_B" not in key or value.abs().sum() > 0  # trained (peft initialises lora_B to zeros)


def test_pp_qlora_checkpoint_holds_the_adapter_and_resumes_on_one_process(adapters):
    """checkpoint-2 of the pp run holds the adapter weights only (the 4-bit base is rebuilt from the base model), by
    the names one process saves; continued on one process, steps 3-4 and the final adapter equal the uninterrupted
    one-process run (step 4 and the adapter depend on the restored AdamW moments)."""
    from torch.distributed.checkpoint import FileSystemReader

    run, ref = adapters["pp-to-one"], adapters["ref"]
    folder = adapters["pp"].output_dir / "checkpoint-2" / "pipeline_state"
    keys = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    weights = {k.removeprefix("model.") for k in keys if k.startswith("model.")}
    assert weights == set(load_file(ref.output_dir / "checkpoint-2" / "model.safetensors"))  # lm.base_model...lora_*
    assert (run.state()["launch"]["num_processes"], run.state()["launch"]["pp_size"]) == (1, 1)
    rows, ref_rows = run.train_rows(), ref.train_rows()[2:]
    assert [r["step"] for r in rows] == [r["step"] for r in ref_rows] == [3, 4]
    assert [r["learning_rate"] for r in rows] == [r["learning_rate"] for r in ref_rows]
    close([r["loss"] for r in rows], [r["loss"] for r in ref_rows])
    close([r["grad_norm"] for r in rows], [r["grad_norm"] for r in ref_rows])
    assert_same_adapter(run.output_dir / "final", ref.output_dir / "final")


# Resumes that cross layouts a pipeline cannot read, refused in the preflight from the checkpoint's launch record
# (hftrain_state.json): the pp 1F1B run's checkpoint-2 under a DeepSpeed launch, and a checkpoint whose record says
# tensor parallelism / FSDP2 (a copy of the one-process checkpoint-2 with that record) under pp.
ZERO2 = {"WORLD_SIZE": "2", "ACCELERATE_USE_DEEPSPEED": "true",
         "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(REPO / "ds_configs" / "zero2.json")}
RESUME_REFUSALS = {  # name: (extra argv, environment, checkpoint: (run, launch record override), text of the refusal)
    "pp_checkpoint_under_deepspeed": ([], ZERO2, ("1F1B", {}),
                                      "was written with pp_size=2 and this run shards the model with DeepSpeed"),
    "tp_checkpoint_under_pp": (PP, {}, ("ref-tied", {"tp_size": 2}),
                               "was written with tensor parallelism and this run has pp_size=2"),
    "fsdp2_checkpoint_under_pp": (PP, {}, ("ref-tied", {"sharded_modules": ["FSDPModule"]}),
                                  "was written with FSDP2 and this run has pp_size=2"),
    # `latest`: the newest intact checkpoint of output_dir (a damaged newer one is passed over, as at resume)
    "latest_fsdp2_checkpoint_under_pp": (PP, {}, ("ref-tied", {"sharded_modules": ["FSDPModule"]}),
                                         "resume_from_checkpoint latest ("),
}


TINY_LLAMA = json.loads((REPO / "models" / "tiny-llama" / "config.json").read_text())
REFUSALS = {  # name: (extra argv, environment, config.json override or None, text(s) of the refusal)
    "no_pp_plan": (PP, {}, {"model_type": "gpt2", "n_layer": 4, "n_embd": 64, "n_head": 4},
                   "has no pipeline plan"),
    "granite": (PP, {}, {"model_type": "granite", "embedding_multiplier": 12.0},
                "is not one whose forward hftrain has checked"),
    "few_layers": (["--pp_size", "2", "--pp_schedule", "Interleaved1F1B"], {}, None,
                   "needs 4 stages of at least one layer each, and the model has 2 layers"),
    "v_microbatches": (["--pp_size", "2", "--pp_schedule", "DualPipeV", "--pp_microbatches", "3"], {}, None,
                       "needs at least as many microbatches as stages (4)"),
    "microbatches": (["--pp_size", "2", "--pp_microbatches", "1"], {}, None,
                     "need at least as many microbatches as processes"),
    "dpo": (["--pp_size", "2", "--objective", "dpo", "--dataset_name", str(REPO / "data" / "preference.jsonl")], {},
            None, "with objective=dpo"),
    "sp": (["--pp_size", "2", "--sp_size", "2"], {}, None, "pipeline parallelism composes with tensor parallelism "
           "(tp_size) and data-parallel copies only"),
    "pp_tp_processes": ([*PP, "--tp_size", "2"], {"WORLD_SIZE": "2"}, None,
                        "pp_size=2 x tp_size=2 does not divide the 2 processes"),
    # pp x FSDP2 runs (test_pp2_x_fsdp2_...), FSDP2 x TP without pp too (tests/e2e/test_fsdp_tp.py); tp inside
    # FSDP2-sharded stages is not built
    "pp_tp_fsdp2": ([*PP, "--tp_size", "2"], {"WORLD_SIZE": "4", "ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"},
                    None, "and tp_size=2: tensor parallelism inside FSDP2-sharded stages is not built"),
    "deepspeed": (PP, ZERO2, None, "pp_size=2 with a deepspeed preset"),
    "odd_processes": (PP, {"WORLD_SIZE": "3"}, None, "pp_size=2 does not divide the 3 processes"),
}


@pytest.fixture(scope="module")
def refusals(runs, tmp_path_factory) -> dict[str, Run]:
    root = tmp_path_factory.mktemp("pp-refused")
    cases = {}
    for name, (args, env, (run, record), _) in RESUME_REFUSALS.items():
        folder = runs[run].output_dir / "checkpoint-2"
        latest = name.startswith("latest")
        if record:
            folder = shutil.copytree(folder, root / name / ("out" if latest else "") / "checkpoint-2", symlinks=True)
            state = json.loads((folder / "hftrain_state.json").read_text())
            state["launch"].update(record)
            (folder / "hftrain_state.json").write_text(json.dumps(state))
            marker = json.loads((folder / "hftrain_complete.json").read_text())  # still intact for `latest`
            marker["files"]["hftrain_state.json"] = (folder / "hftrain_state.json").stat().st_size
            (folder / "hftrain_complete.json").write_text(json.dumps(marker))
        if latest:  # a newer checkpoint that was never completed: resume's `latest` passes over it
            (root / name / "out" / "checkpoint-3").mkdir()
        cases[name] = (["--config", str(REPO / "recipes" / "tiny-chat.yaml"), "--output_dir", str(root / name / "out"),
                        "--resume_from_checkpoint", "latest" if latest else str(folder), *args], env)
    for name, (args, env, config, _) in REFUSALS.items():
        model = REPO / "models" / "tiny-llama"
        if config is not None:  # a config only: a refusal after the weights load would fail on their absence
            model = root / name / "model"
            model.mkdir(parents=True)
            (model / "config.json").write_text(json.dumps({**TINY_LLAMA, **config}))
        cases[name] = (["--config", str(REPO / "recipes" / "tiny-chat.yaml"), "--output_dir", str(root / name / "out"),
                        "--model_name_or_path", str(model), *args], env)
    return run_main_cases(cases, root)


@pytest.mark.parametrize("name", [*REFUSALS, *RESUME_REFUSALS])
def test_refused_before_the_weights_load(refusals, name):
    run, expected = refusals[name], {**REFUSALS, **RESUME_REFUSALS}[name][3]
    assert run.returncode == 2, run.stderr
    message = " ".join(run.stderr.split())  # the paragraph is wrapped
    texts = (expected,) if isinstance(expected, str) else expected  # every problem reported at once
    assert all(text in message for text in texts) and "Traceback" not in message
    if name.startswith("latest"):  # the intact checkpoint-2 is named; nothing was added to the folder
        assert f"latest ({run.output_dir / 'checkpoint-2'})" in message
        assert sorted(p.name for p in run.output_dir.iterdir()) == ["checkpoint-2", "checkpoint-3"]
    else:
        assert not run.output_dir.exists()
