"""Test-only entry point: run hftrain/finetune.py with FSDP2 forced on a CPU machine.

accelerate 1.15 selects FSDP only for GPU-like devices: with an FSDP preset on CPU, hftrain refuses
the launch (it would otherwise silently run DDP). This launcher does what accelerate does on GPUs
(see ../shared/cpu-feasibility.md): it lets hftrain create its CPU accelerator, then marks the state
as FSDP with the FullyShardedDataParallelPlugin accelerate builds from the preset's FSDP_* settings.
Everything after that (wrapping, sharded checkpoints, full state dict) is accelerate's own FSDP2 path.
The seam is `Finetune.make_accelerator`, overridden in a subclass.
Used as `accelerate launch --config_file accelerate_configs/fsdp2.yaml tests/launchers/fsdp2_on_cpu.py ...`.
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from accelerate.state import AcceleratorState, PartialState  # noqa: E402
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin  # noqa: E402

from hftrain.finetune import Finetune, main  # noqa: E402
from hftrain.parallel import run_process  # noqa: E402


def force_fsdp2(accelerator) -> None:
    """Mark the CPU accelerator's state as FSDP, with the plugin accelerate builds from the preset's settings."""
    os.environ["ACCELERATE_USE_FSDP"] = "true"  # transformers reads it (e.g. cpu_ram_efficient_loading)
    plugin = FullyShardedDataParallelPlugin()  # from the preset's FSDP_* environment, as accelerate does
    if accelerator.mixed_precision != "no":
        plugin.set_mixed_precision(accelerator.mixed_precision)
    state = AcceleratorState()
    state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    state.fsdp_plugin = plugin


class FSDP2OnCPU(Finetune):
    def make_accelerator(self, launch):
        assert launch.kind == "fsdp2", "launch with an FSDP preset"
        os.environ["ACCELERATE_USE_FSDP"] = "false"  # let hftrain build its CPU (gloo) accelerator
        accelerator = super().make_accelerator(launch)
        force_fsdp2(accelerator)
        return accelerator


if __name__ == "__main__":
    run_process(lambda: main(runner=FSDP2OnCPU))
