"""FSDP2: parameters, gradients and optimizer state sharded over the processes, one shard group per transformer layer.

accelerate wraps the model with `fully_shard` from the preset's FSDP settings; it finds the layer classes to wrap
in the prepared module's `_no_split_modules`, which the loss wrapper forwards from the causal LM. Checkpoints are
sharded `torch.distributed.checkpoint` folders (one file per rank), checked by their own loader.
"""

from __future__ import annotations

from accelerate.utils.fsdp_utils import fsdp2_prepare_model
from torch.distributed.fsdp import CPUOffloadPolicy

from hftrain.parallel.base import ALL_PARTS, Backend, Parallelism


class FSDP2Backend(Backend):
    def make_record(self, **layout) -> Parallelism:
        plugin = self.accelerator.state.fsdp_plugin
        full_shard = plugin.reshard_after_forward is True  # SHARD_GRAD_OP keeps the weights gathered
        sharded = ALL_PARTS if full_shard else ("gradients", "optimizer")
        offloaded = ALL_PARTS if isinstance(plugin.cpu_offload, CPUOffloadPolicy) else ()  # OffloadPolicy(): none
        name = "FSDP2 " + ("FULL_SHARD" if full_shard else "SHARD_GRAD_OP") + (" + offload" if offloaded else "")
        return super().make_record(kind="fsdp2", name=name, sharded=sharded, offloaded=offloaded)

    def prepare_frozen(self, module):
        """Sharded like the trained model, by accelerate's own FSDP2 preparation (one shard group per layer, the
        module as root), without registering it with the accelerator (its checkpoints hold the trained model only)."""
        return fsdp2_prepare_model(self.accelerator, module).eval(), "sharded over the processes (FSDP2)"

    def full_state_dict(self, model) -> dict | None:
        return self.accelerator.get_state_dict(model)  # the full state dict, gathered on the main process

    def clip_grad_norm(self, model, max_norm: float) -> float | None:
        norm = self.accelerator.clip_grad_norm_(model.parameters(), max_norm)
        return None if norm is None else float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
