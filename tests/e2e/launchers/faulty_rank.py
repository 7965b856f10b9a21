"""Test launcher: hftrain.finetune with faults injected on rank 1, so the rank checks have something to find.

    accelerate launch ... tests/e2e/launchers/faulty_rank.py <finetune arguments>
    HFTRAIN_TEST_FAULTS=slow_forward,diverge

slow_forward: rank 1 sleeps 0.1 s before each forward (a slow GPU, a throttled node).
diverge:      after its 3rd optimizer step rank 1 adds 1e-3 to one parameter (a replica drifting apart).
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
if int(os.environ["RANK"]) == 1:
    if "slow_forward" in faults:
        forward = CausalLMTokenLoss.forward

        def slow_forward(self, *args, **kwargs):
            time.sleep(0.1)
            return forward(self, *args, **kwargs)

        CausalLMTokenLoss.forward = slow_forward
    if "diverge" in faults:
        adamw_step, calls = torch.optim.AdamW.step, []

        def drifting_step(self, *args, **kwargs):
            result = adamw_step(self, *args, **kwargs)
            calls.append(1)
            if len(calls) == 3:
                with torch.no_grad():
                    self.param_groups[0]["params"][0].add_(1e-3)
            return result

        torch.optim.AdamW.step = drifting_step

finetune.main()
