"""Test launcher: hftrain.finetune with faults injected on one rank, so the checks have something to find.

    accelerate launch ... tests/e2e/launchers/faulty_rank.py <finetune arguments>
    HFTRAIN_TEST_FAULTS=slow_forward,diverge

slow_forward: rank 1 sleeps 0.1 s before each forward (a slow GPU, a throttled node).
diverge:      after its 3rd optimizer step rank 1 adds 1e-3 to one parameter (a replica drifting apart).
stuck_data:   rank 0 sleeps HFTRAIN_TEST_STALL seconds before preparing the data (a huge tokenization job).
stuck_step:   rank 1 sleeps HFTRAIN_TEST_STALL seconds in its 3rd forward (a hung device, a stuck input).
slow_step:    rank 1 sleeps HFTRAIN_TEST_SLOW seconds in its 3rd forward (a slow step that is no hang).
hung_kernel:  the last rank's 3rd forward launches a CUDA kernel that spins for about 20 minutes (a hung GPU).
step_error:   the first forward of step 13 raises on rank 0 (a bad batch, a device error), after 12 completed steps.
final_save:   saving the final model's tokenizer raises (a full disk, a library that cannot serialise the model).
final_eval:   the final evaluation raises (bitsandbytes' CPU inference path did on some shapes).
unloadable_checkpoint: loading a checkpoint raises (a strategy whose state cannot be read back).
no_op_load:   loading a checkpoint silently restores nothing.
sigterm_after_step_N: rank 1 (rank 0 with one process) sends itself SIGTERM right after its Nth optimizer step, so
              the stop is voted on in step N + 1, after step N + 1's micro-batches were taken (a streamed run must save
              the position before them; a grpo run inside a generation window, the window's buffered rollouts).
Faults live here, in the test tree, never in the product code: `FaultyRank` overrides the phase object's seams.
"""

import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import torch  # noqa: E402

from hftrain.finetune import Finetune, main  # noqa: E402
from hftrain.parallel import run_process  # noqa: E402

faults = set(os.environ["HFTRAIN_TEST_FAULTS"].split(","))
stall = float(os.environ.get("HFTRAIN_TEST_STALL", "0"))
slow = float(os.environ.get("HFTRAIN_TEST_SLOW", "0"))
rank = int(os.environ.get("RANK", "0"))  # unset when run without accelerate's launcher (one process)
sigterm_step = next((int(f.removeprefix("sigterm_after_step_")) for f in faults if f.startswith("sigterm_after_step_")),
                    None)


def before_each_call(function, before):
    """`function` preceded by `before(call_number)` on every call."""
    calls = []

    def wrapped(*args, **kwargs):
        calls.append(1)
        before(len(calls))
        return function(*args, **kwargs)

    return wrapped


def fail(what):
    def raising(*args, **kwargs):
        raise RuntimeError(f"injected fault: {what}")

    return raising


class FaultyRank(Finetune):
    def setup_data(self):
        super().setup_data()
        if "final_save" in faults:  # only the final save writes the tokenizer
            self.tokenizer.save_pretrained = fail("cannot write the tokenizer")

    def final_evaluation(self, final_dir):
        if "final_eval" in faults:
            self.evaluate = fail("the final evaluation")
        super().final_evaluation(final_dir)

    def load_datasets(self, tokenizer):
        if rank == 0 and "stuck_data" in faults:
            time.sleep(stall)
        return super().load_datasets(tokenizer)

    def setup_model(self):
        parts = super().setup_model()
        model = parts.loss  # what the backend wraps: its forward is what each micro-batch calls
        if rank == 1 and "slow_forward" in faults:
            model.forward = before_each_call(model.forward, lambda n: time.sleep(0.1))
        if rank == 0 and "step_error" in faults:
            def fail_in_step_13(n):
                if self.progress.step == 12:
                    raise RuntimeError("injected fault: a forward failed")

            model.forward = before_each_call(model.forward, fail_in_step_13)
        if rank == 1 and "stuck_step" in faults:
            model.forward = before_each_call(model.forward, lambda n: time.sleep(stall) if n == 3 else None)
        if rank == self.accelerator.num_processes - 1 and "hung_kernel" in faults:
            model.forward = before_each_call(model.forward, lambda n: torch.cuda._sleep(2 ** 41) if n == 3 else None)
        if rank == 1 and "slow_step" in faults:
            model.forward = before_each_call(model.forward, lambda n: time.sleep(slow) if n == 3 else None)
        return parts

    def setup_optimizer(self, parts):
        super().setup_optimizer(parts)
        if "unloadable_checkpoint" in faults:
            self.backend.checkpoints.load_kwargs = lambda: {"no_such_option": True}
        if "no_op_load" in faults:
            self.accelerator.load_state = lambda *args, **kwargs: None
        if rank == 1 and "diverge" in faults:
            inner = self.optimizer.optimizer  # accelerate's AcceleratedOptimizer wraps torch's AdamW

            def drift_after_third(n):
                if n == 4:  # the 3rd step is done: drift before the 4th
                    with torch.no_grad():
                        inner.param_groups[0]["params"][0].add_(1e-3)

            inner.step = before_each_call(inner.step, drift_after_third)

    def after_step(self, step):
        super().after_step(step)
        if sigterm_step is not None and rank == min(1, self.accelerator.num_processes - 1) \
                and self.progress.step == sigterm_step:
            os.kill(os.getpid(), signal.SIGTERM)


run_process(lambda: main(runner=FaultyRank))
