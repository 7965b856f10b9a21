"""Context parallelism (cp_size, torch ring attention under FSDP2) run for real on CPU: gloo processes through the
fsdp2_cp preset and tests/launchers/context_parallel_on_cpu.py.

The launcher forces FSDP2 on the CPU accelerator (as for every FSDP2 test) and registers torch's own ring with the
CPU flash kernel, which torch 2.13's ring does not dispatch (its docstring says why). Everything else is the
product path: accelerate's ParallelismConfig mesh built from the recipe, `maybe_context_parallel` sharding each
micro-batch with torch's load balancer around forward and backward, FSDP2 over dp_shard x cp, the shifted labels and
the group loss. Every run is compared with an independent 1-process run (no launcher, no FSDP, no ring) with the
same micro-batches: per-step losses, gradient norms (clipping active), learning rates, token counts, evaluations and
final weights within 1e-4.
"""

from __future__ import annotations

import pytest

from tests.conftest import FSDP_LAUNCHER, REPO, TINY_CHAT, Run, build_tiny_model, launch, run_script
from tests.e2e.test_sequence_parallel import (
    CHAT,
    LORA,
    ONE_GROUP,
    TWO_GROUPS,
    assert_continues,
    assert_same_steps,
    resume_from_step_2,
    signal_one_rank_then_resume,
)

pytestmark = pytest.mark.launch

CP_LAUNCHER = REPO / "tests" / "launchers" / "context_parallel_on_cpu.py"
CP2 = ["--cp_size", "2"]


@pytest.fixture(scope="module")
def gqa(tmp_path_factory) -> list[str]:
    """The tiny Llama with grouped-query attention (4 query heads, 2 key/value heads), as today's hub models have:
    transformers then calls SDPA with enable_gqa, and the ring passes the smaller key/value blocks."""
    folder = build_tiny_model(tmp_path_factory.mktemp("gqa") / "model", "--num_kv_heads", "2",
                              "--tokenizer", str(REPO / "models" / "tiny-llama"))
    return ["--model_name_or_path", str(folder)]


def launch_cp(output_dir, *args: str, processes: int = 2, **kwargs) -> Run:
    return launch(output_dir, *args, *CP2, preset="fsdp2_cp", processes=processes, script=CP_LAUNCHER, **kwargs)


def assert_context_parallel(run: Run, processes: int, dp_world: int) -> None:
    state = run.state()
    launch_info, layout = state["launch"], state["parallelism"]
    assert (launch_info["distributed_type"], launch_info["num_processes"], launch_info["model_wrapper"],
            launch_info["backend"], launch_info["cp_size"]) == ("FSDP", processes, "FSDPCausalLMTokenLoss", "gloo", 2)
    assert (layout["kind"], layout["cp_size"], layout["dp_world"]) == ("fsdp2", 2, dp_world)
    assert "ring attention context parallel (cp_size=2)" in launch_info["parallelism"]
    assert "activations extra: at most" in run.stdout and "1/2 of each sequence" in run.stdout


@pytest.fixture(scope="module")
def chat_reference(tmp_path_factory, gqa) -> Run:
    return run_script(tmp_path_factory.mktemp("ref") / "chat", *CHAT, *gqa, *ONE_GROUP)


@pytest.fixture(scope="module")
def chat_cp(tmp_path_factory, gqa) -> Run:
    return launch_cp(tmp_path_factory.mktemp("cp") / "chat", *CHAT, *gqa, *ONE_GROUP)


def test_cp2_equals_one_process_on_assistant_only_chat(chat_cp, chat_reference):
    """Right-padded rows of unequal length, assistant-only targets, each row padded to a multiple of 4 and split by
    torch's head-tail load balancer: rank 0 holds quarters 1 and 4, rank 1 quarters 2 and 3; grouped-query
    attention."""
    assert_context_parallel(chat_cp, processes=2, dp_world=1)
    assert chat_cp.state()["effective_batch_size"] == chat_reference.state()["effective_batch_size"] == 16
    assert "ring attention context parallel (cp_size=2) over 2 processes (gloo)" in chat_cp.stdout
    assert_same_steps(chat_cp, chat_reference)


def test_cp2_with_lora_equals_one_process(tmp_path):
    """At learning rate 0.01 (clipping still active): at sequence_parallel's 0.05 this chat run's loss climbs from
    step 3 on, and that unstable update amplifies the ring's float rounding (the first steps agree to 1e-7) to 2e-4
    by step 4."""
    lora = [*LORA, "--learning_rate", "0.01"]
    ref = run_script(tmp_path / "ref", *CHAT, *ONE_GROUP, *lora)
    run = launch_cp(tmp_path / "cp", *CHAT, *ONE_GROUP, *lora)
    assert_context_parallel(run, processes=2, dp_world=1)
    assert_same_steps(run, ref, weights="adapter_model.safetensors")


def test_two_data_parallel_copies_of_a_context_group_equal_one_process(chat_reference, gqa, tmp_path):
    run = launch_cp(tmp_path / "cp-dp", *CHAT, *gqa, *TWO_GROUPS, processes=4)
    assert_context_parallel(run, processes=4, dp_world=2)
    assert "x 2 data-parallel copies over 4 processes" in run.stdout
    assert_same_steps(run, chat_reference)


def test_cp2_checkpoint_resumes_with_cp2_and_on_plain_fsdp2(chat_cp, gqa, tmp_path):
    """Steps 3-4 after resuming at step 2 equal the uninterrupted run: with cp_size 2 again, and on plain FSDP2 over the
    same 2 processes (FSDP2's sharded checkpoint is over all dp_shard x cp ranks, so it loads on either mesh)."""
    again = resume_from_step_2(chat_cp, tmp_path / "cp2", *gqa, *ONE_GROUP, *CP2, preset="fsdp2_cp", processes=2,
                               script=CP_LAUNCHER)
    assert_context_parallel(again, processes=2, dp_world=1)
    assert_continues(again, chat_cp)
    plain = resume_from_step_2(chat_cp, tmp_path / "cp1", *gqa, *TWO_GROUPS, preset="fsdp2", processes=2,
                               script=FSDP_LAUNCHER)
    assert plain.state()["launch"]["cp_size"] == 1 and plain.state()["parallelism"]["dp_world"] == 2
    assert_continues(plain, chat_cp)


def test_a_signal_to_one_rank_of_a_context_group_stops_both_and_the_resume_equals_one_process(tmp_path):
    signal_one_rank_then_resume(tmp_path, CP2, assert_context_parallel, preset="fsdp2_cp", processes=2,
                                script=CP_LAUNCHER)


def test_cp_without_the_cpu_kernel_is_refused_in_one_paragraph(tmp_path):
    """The shipped entry point with the fsdp2_cp preset on a CPU machine: accelerate would raise from inside its
    ParallelismConfig check; hftrain refuses first, on every rank, without a traceback."""
    run = launch(tmp_path / "out", *TINY_CHAT, *CP2, preset="fsdp2_cp", processes=2, check=False)
    assert run.returncode != 0
    first = run.stderr.index("hftrain: error:")
    message = run.stderr[first:].split("\n\n")[0]
    assert "cp_size=2 needs CUDA GPUs" in message and "use sp_size with the cpu_sp preset" in message
    assert "Traceback" not in run.stderr[:first]
    assert not (tmp_path / "out").exists(), "nothing may be written for a refused launch"
