"""Expert parallelism (issue 37): `--ep_size 2` on the 2-process CPU preset (cpu_ddp, gloo's all-to-all), alone and
beside `--tp_size 2`, equals one process on the same global batch, and checkpoints move between ep sizes.

A tiny Qwen3-MoE (2 layers, 4 experts, 2 per token, router_aux_loss_coef 0.1) loads with transformers'
`DistributedConfig(ep_size=2, fsdp_size=2, ep_implementation="all_to_all")`: each rank holds 2 of every layer's 4
experts and sends each (token, expert) pair to its expert's rank, the dense weights FSDP2-sharded by transformers. One
launch (3 steps, 2 examples x 2 ranks x 2 accumulation = 8, the router loss over the whole step, a checkpoint at 2)
against one process with 4 examples x 2 accumulation: losses, router losses, gradient norms (every step clipped at
max_grad_norm 1.0), learning rates, token counts, the final evaluation and the final weights, which
`from_pretrained` loads at full size (4 experts per layer). Checkpoint 2 of each continues to step 3 on another ep
size, equal to the uninterrupted one-process run (step 3, final evaluation, final weights): the launch's on one process
and at ep 1 on its 2 processes (DDP), the one-process run's at ep 2. LoRA on the attention of an expert-parallel
model (adapters whole on every rank, outside transformers' FSDP2 units, averaged over the ranks) equals one process too
(2 steps). tp 2 x ep 2 on the same 2 processes (one batch shared by the pair, 4 examples x 2 accumulation) equals the
same one-process run, and its checkpoint 2 continues on one process. A tiny Mixtral under pp 2 (without the router
loss) equals one process and its checkpoint 2 continues at ep 2. Thirteen runs serve every assertion.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.conftest import REPO, TINY_CHAT, Run, launch, run_script
from tests.unit.test_moe import tiny

pytestmark = pytest.mark.launch

STEPS = [*TINY_CHAT, "--max_steps", "3", "--logging_steps", "1", "--save_steps", "2", "--eval_steps", "3",
         "--learning_rate", "1e-2", "--warmup_steps", "0", "--validation_split_percentage", "2"]
COMMON = [*STEPS, "--router_aux_loss_scope", "step"]
NO_ROUTER_LOSS = [*STEPS, "--router_aux_loss_coef", "0"]  # what a pipeline can train (its stages split the routers)
ONE_PROCESS = ["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2"]
DATA_PARALLEL = ["--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2"]
EXPERT_PARALLEL = [*DATA_PARALLEL, "--ep_size", "2"]
# tp 2 x ep 2 on 2 processes: the pair shares one batch, so the one process's batch and accumulation
EXPERT_TENSOR_PARALLEL = [*ONE_PROCESS, "--tp_size", "2", "--ep_size", "2"]
# lora_dropout 0: dropout draws differ between one process and two, whatever the layout
LORA = [*TINY_CHAT, "--max_steps", "2", "--logging_steps", "1", "--router_aux_loss_scope", "step", "--learning_rate",
        "1e-2", "--warmup_steps", "0", "--validation_split_percentage", "0", "--eval_strategy", "no", "--use_peft",
        "true", "--lora_target_modules", "q_proj", "v_proj", "--lora_dropout", "0"]


def close(a: list[float], b: list[float], rtol: float) -> None:
    torch.testing.assert_close(torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64),
                               rtol=rtol, atol=0)


def weights_close(run: Run, ref: Run, tol: float) -> None:
    params, expected = (load_file(r.output_dir / "final" / "model.safetensors") for r in (run, ref))
    assert params.keys() == expected.keys()
    for name, value in expected.items():  # full shapes: the final folder holds every expert, not this rank's
        torch.testing.assert_close(params[name], value, rtol=tol, atol=tol, msg=lambda m, name=name: f"{name}: {m}")


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-qwen3-moe")
    tiny("qwen3_moe", router_aux_loss_coef=0.1).save_pretrained(folder)  # a coefficient that makes the aux count
    AutoTokenizer.from_pretrained(REPO / "models" / "tiny-llama").save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def reference(tmp_path_factory, moe) -> Run:
    return run_script(tmp_path_factory.mktemp("one") / "one", *COMMON, *ONE_PROCESS, "--model_name_or_path", str(moe))


@pytest.fixture(scope="module")
def ep_run(tmp_path_factory, moe) -> Run:
    return launch(tmp_path_factory.mktemp("ep") / "ep", *COMMON, *EXPERT_PARALLEL, "--model_name_or_path", str(moe),
                  preset="cpu_ddp", processes=2)


def test_expert_parallel_equals_one_process(ep_run, reference):
    run, ref = ep_run, reference
    # what ran: the experts split over the 2 ranks (transformers' expert mesh), the rest FSDP2-sharded
    layout = ("expert parallel (ep_size=2: 1/2 of every MoE layer's experts per process), dense weights FSDP2 "
              "FULL_SHARD (fsdp_size=2) over 2 processes (gloo)")
    assert f"hftrain: {layout} on cpu:0" in run.stdout
    info = run.state()["launch"]
    assert (info["distributed_type"], info["num_processes"], info["ep_size"]) == ("MULTI_CPU", 2, 2)
    assert info["dtensor_meshes"] == ["efsdp=1 x ep=2", "fsdp=2"]
    assert "FSDPQwen3MoeExperts" in info["sharded_modules"]
    assert "effective batch 8 = 2 per device x 2 accumulation x 2 processes" in run.stdout

    rows, ref_rows = run.train_rows(), ref.train_rows()
    assert [r["step"] for r in rows] == [r["step"] for r in ref_rows] == [1, 2, 3]
    assert [(r["learning_rate"], r["trained_tokens"]) for r in rows] == \
        [(r["learning_rate"], r["trained_tokens"]) for r in ref_rows]
    assert min(r["grad_norm"] for r in ref_rows) > 1.0  # the recipe's max_grad_norm: every step is clipped
    for key in ("loss", "aux_loss", "grad_norm"):
        close([r[key] for r in rows], [r[key] for r in ref_rows], 1e-4)
    close([r["eval_loss"] for r in run.eval_rows()], [r["eval_loss"] for r in ref.eval_rows()], 1e-4)
    weights_close(run, ref, 1e-4)
    model = AutoModelForCausalLM.from_pretrained(run.output_dir / "final")  # every expert once, full size
    assert model.model.layers[0].mlp.experts.gate_up_proj.shape[0] == 4


def test_expert_parallel_with_tensor_parallel_equals_one_process(reference, moe, tmp_path):
    """tp 2 x ep 2 on 2 processes: one batch per micro-batch, shared by the tensor-parallel pair that is also the expert
    group (transformers' `AllToAllEP`: each rank dispatches its half of the batch's tokens), the dense weights split
    by tensor parallelism, the experts by expert parallelism, no copies; held as tensor parallelism's layout under the
    DDP-type preset. Two micro-batches a step: the per-head q_norm / k_norm, whose partial gradients transformers
    sums after each backward, count each micro-batch once (`compat.transformers.accumulation_safe_partial_gradients`).
    Its checkpoint-2 continues on one process."""
    run = launch(tmp_path / "ep-tp", *COMMON, *EXPERT_TENSOR_PARALLEL, "--model_name_or_path", str(moe),
                 preset="cpu_ddp", processes=2)
    layout = ("expert parallel (ep_size=2: 1/2 of every MoE layer's experts per process), dense weights tensor "
              "parallel (tp_size=2) over 2 processes (gloo)")
    assert f"hftrain: {layout} on cpu:0" in run.stdout
    info = run.state()["launch"]
    assert (info["num_processes"], info["tp_size"], info["ep_size"]) == (2, 2, 2)
    assert info["dtensor_meshes"] == ["ep=2", "tp=2"]
    assert "effective batch 8 = 4 per device x 2 accumulation x 1 data-parallel group" in run.stdout
    rows, ref_rows = run.train_rows(), reference.train_rows()
    assert [(r["step"], r["learning_rate"], r["trained_tokens"]) for r in rows] == \
        [(r["step"], r["learning_rate"], r["trained_tokens"]) for r in ref_rows]
    for key in ("loss", "aux_loss", "grad_norm"):  # every step clipped (test_expert_parallel_equals_one_process)
        close([r[key] for r in rows], [r[key] for r in ref_rows], 1e-4)
    close([r["eval_loss"] for r in run.eval_rows()], [r["eval_loss"] for r in reference.eval_rows()], 1e-4)
    weights_close(run, reference, 1e-4)
    model = AutoModelForCausalLM.from_pretrained(run.output_dir / "final")  # every expert once, whole projections
    assert model.model.layers[0].mlp.experts.gate_up_proj.shape[0] == 4
    resumed = continued(run, tmp_path / "resumed", *ONE_PROCESS, "--model_name_or_path", str(moe), processes=1)
    equals_the_uninterrupted_run(resumed, reference)


def continued(run: Run, folder: Path, *args: str, processes: int, common: list[str] = COMMON) -> Run:
    """`run`'s checkpoint-2 (its final folder removed) continued to step 3 with `common` and `args`, in `folder`."""
    shutil.copytree(run.output_dir, folder)
    shutil.rmtree(folder / "final")
    args = (*common, *args, "--resume_from_checkpoint", "latest")
    resumed = run_script(folder, *args) if processes == 1 else launch(folder, *args, preset="cpu_ddp",
                                                                       processes=processes)
    assert "resuming from" in resumed.stdout and "at step 2" in resumed.stdout
    return resumed


def equals_the_uninterrupted_run(resumed: Run, ref: Run) -> None:
    again, ref_rows = resumed.train_rows(), ref.train_rows()
    assert [r["step"] for r in again] == [1, 2, 3]  # steps 1-2 in the metrics the checkpoint's run wrote
    for key in ("loss", "aux_loss", "grad_norm"):
        close([again[-1][key]], [ref_rows[-1][key]], 1e-4)
    close([r["eval_loss"] for r in resumed.eval_rows()], [r["eval_loss"] for r in ref.eval_rows()], 1e-4)
    weights_close(resumed, ref, 1e-4)


@pytest.mark.parametrize(("layout", "processes"), [(ONE_PROCESS, 1), (DATA_PARALLEL, 2)], ids=["one", "ddp"])
def test_its_checkpoint_continues_without_expert_parallelism(ep_run, reference, moe, tmp_path, layout, processes):
    """ep 2 -> one process, and -> ep 1 on the same 2 processes (DDP): the full state as accelerate's files."""
    resumed = continued(ep_run, tmp_path / "resumed", *layout, "--model_name_or_path", str(moe), processes=processes)
    assert (resumed.state()["launch"]["ep_size"], resumed.state()["launch"]["num_processes"]) == (1, processes)
    equals_the_uninterrupted_run(resumed, reference)


def test_a_one_process_checkpoint_continues_at_ep_2(reference, moe, tmp_path):
    """ep 1 (one process: accelerate's whole files) -> ep 2: each rank cuts its experts and shards from them."""
    resumed = continued(reference, tmp_path / "resumed", *EXPERT_PARALLEL, "--model_name_or_path", str(moe),
                        processes=2)
    assert "expert parallel (ep_size=2" in resumed.stdout
    assert resumed.state()["launch"]["ep_size"] == 2
    equals_the_uninterrupted_run(resumed, reference)


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-mixtral")
    tiny("mixtral").save_pretrained(folder)
    AutoTokenizer.from_pretrained(REPO / "models" / "tiny-llama").save_pretrained(folder)
    return folder


def test_a_pipeline_checkpoint_of_mixtral_continues_at_ep_2(mixtral, tmp_path):
    """Mixtral (pp refuses Qwen3-MoE, whose forward hftrain has not checked for work outside the pipeline plan) under
    pp 2 (1F1B, 2 microbatches) equals one process, without the router loss (a stage holds only its own layers'
    routers: refused under pp); its checkpoint-2 (DCP by HF names, each stage's experts) continues at ep 2 on 2
    processes, converted to one process's files and then cut into each rank's experts and shards: equal to the
    uninterrupted runs (step 3, the final evaluation, the final weights)."""
    model = ("--model_name_or_path", str(mixtral))
    one = run_script(tmp_path / "one", *NO_ROUTER_LOSS, *ONE_PROCESS, *model)
    pp = launch(tmp_path / "pp", *NO_ROUTER_LOSS, *ONE_PROCESS, *model, "--pp_size", "2", "--pp_microbatches", "2",
                preset="cpu_pp", processes=2)
    assert "aux_loss" not in pp.train_rows()[0]
    resumed = continued(pp, tmp_path / "resumed", *EXPERT_PARALLEL, *model, processes=2, common=NO_ROUTER_LOSS)
    launches = [{key: run.state()["launch"][key] for key in ("distributed_type", "num_processes", "model_wrapper",
                                                              "pp_size", "ep_size")} for run in (pp, resumed)]
    assert launches == [
        {"distributed_type": "MULTI_CPU", "num_processes": 2, "model_wrapper": "PipelineStages", "pp_size": 2,
         "ep_size": 1},
        {"distributed_type": "MULTI_CPU", "num_processes": 2, "model_wrapper": "FSDPCausalLMTokenLoss", "pp_size": 1,
         "ep_size": 2}]
    for run in (pp, resumed):
        rows, ref_rows = run.train_rows(), one.train_rows()
        assert [(r["step"], r["learning_rate"], r["trained_tokens"]) for r in rows] == \
            [(r["step"], r["learning_rate"], r["trained_tokens"]) for r in ref_rows]
        for key in ("loss", "grad_norm"):
            close([r[key] for r in rows], [r[key] for r in ref_rows], 1e-4)
        close([r["eval_loss"] for r in run.eval_rows()], [r["eval_loss"] for r in one.eval_rows()], 1e-4)
        weights_close(run, one, 1e-4)


def test_lora_on_the_attention_of_an_expert_parallel_model_equals_one_process(moe, tmp_path):
    run = launch(tmp_path / "ep-lora", *LORA, *EXPERT_PARALLEL, "--model_name_or_path", str(moe), preset="cpu_ddp",
                 processes=2)
    ref = run_script(tmp_path / "one-lora", *LORA, *ONE_PROCESS, "--model_name_or_path", str(moe))
    assert "expert parallel (ep_size=2" in run.stdout and "lora fine-tuning" in run.stdout
    rows, ref_rows = run.train_rows(), ref.train_rows()
    assert [r["step"] for r in rows] == [1, 2]
    for key in ("loss", "aux_loss", "grad_norm"):
        close([r[key] for r in rows], [r[key] for r in ref_rows], 1e-5)
    adapter, expected = (load_file(r.output_dir / "final" / "adapter_model.safetensors") for r in (run, ref))
    assert adapter.keys() == expected.keys() and all("self_attn" in name for name in adapter)
    for name, value in expected.items():
        torch.testing.assert_close(adapter[name], value, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
