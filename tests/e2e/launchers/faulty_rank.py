"""Test launcher: hftrain.finetune with faults injected on one rank, so the checks have something to find.

    accelerate launch ... tests/e2e/launchers/faulty_rank.py <finetune arguments>
    HFTRAIN_TEST_FAULTS=slow_forward,diverge

slow_forward: rank 1 sleeps 0.1 s before each forward (a slow GPU, a throttled node).
diverge:      after its 3rd optimizer step rank 1 adds 1e-3 to one parameter (a replica drifting apart).
stuck_data:   rank 0 sleeps HFTRAIN_TEST_STALL seconds before preparing the data (a huge tokenization job).
stuck_step:   rank 1 sleeps HFTRAIN_TEST_STALL seconds in its 3rd forward (a hung device, a stuck input).
Faults live here, in the test tree, never in the product code.
"""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import torch  # noqa: E402

from hftrain import finetune  # noqa: E402
from hftrain.model import CausalLMTokenLoss  # noqa: E402

faults = set(os.environ["HFTRAIN_TEST_FAULTS"].split(","))
stall = float(os.environ.get("HFTRAIN_TEST_STALL", "0"))
rank = int(os.environ["RANK"])


def wrap(owner, name: str, before) -> None:
    """Call `before(call_number)` ahead of every call of owner.name."""
    original, calls = getattr(owner, name), []

    def wrapped(*args, **kwargs):
        calls.append(1)
        before(len(calls))
        return original(*args, **kwargs)

    setattr(owner, name, wrapped)


if rank == 1 and "slow_forward" in faults:
    wrap(CausalLMTokenLoss, "forward", lambda n: time.sleep(0.1))
if rank == 1 and "diverge" in faults:
    adamw_step, steps = torch.optim.AdamW.step, []

    def drifting_step(self, *args, **kwargs):
        result = adamw_step(self, *args, **kwargs)
        steps.append(1)
        if len(steps) == 3:
            with torch.no_grad():
                self.param_groups[0]["params"][0].add_(1e-3)
        return result

    torch.optim.AdamW.step = drifting_step
if rank == 0 and "stuck_data" in faults:
    wrap(finetune, "load_datasets", lambda n: time.sleep(stall))
if rank == 1 and "stuck_step" in faults:
    wrap(CausalLMTokenLoss, "forward", lambda n: time.sleep(stall) if n == 3 else None)

finetune.main()
