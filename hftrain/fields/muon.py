"""The Muon group of the recipe (`optim: muon`): its fields and the rules judged from the recipe alone; the optimizer
is built in `hftrain/optim.py` (`MuonWithAdamW`), the launch's refusals (FSDP2, DeepSpeed) are
`hftrain.optim.muon_launch_problems`, run by the preflight.
"""

from __future__ import annotations

from dataclasses import dataclass

from hftrain.fields import recipe_field as _f

MUON_ADJUST_LR = ("match_rms_adamw", "original")  # torch.optim.Muon's adjust_lr_fn values

# Why Muon runs only where every process holds whole weight matrices (the preflight's refusals name it).
WHOLE_MATRICES = ("Muon's Newton-Schulz step orthogonalizes each weight matrix as a whole, and under this layout "
                  "a process holds only a shard of each matrix, so each shard would be orthogonalized on its own "
                  "(a different, wrong update); hftrain does not gather the matrices for the step. Use a layout that "
                  "keeps whole matrices on every process (one process, or DDP: the cpu_ddp and multi_gpu presets), "
                  "or optim: adamw_torch")


@dataclass
class MuonFields:
    muon_momentum: float = _f(
        0.95, "optim: muon: momentum of the Muon update (torch.optim.Muon's momentum; Moonlight and Keller Jordan "
        "use 0.95).", group="training",
    )
    muon_nesterov: bool = _f(True, "optim: muon: Nesterov momentum (torch.optim.Muon's nesterov).", group="training")
    muon_ns_steps: int = _f(
        5, "optim: muon: Newton-Schulz iterations that orthogonalize each update (torch.optim.Muon's ns_steps).",
        group="training",
    )
    muon_adjust_lr: str = _f(
        "match_rms_adamw", "optim: muon: how the Muon update of an A x B matrix is scaled from learning_rate "
        "(torch.optim.Muon's adjust_lr_fn). match_rms_adamw (Moonlight, 'Muon is Scalable for LLM Training', "
        "arXiv 2502.16982): lr x 0.2 x sqrt(max(A, B)), which gives the update the RMS of an AdamW update, so that "
        "the one learning_rate and weight_decay tuned for AdamW serve both optimizers, as Moonlight trains. original "
        "(Keller Jordan's): lr x sqrt(max(1, A / B)); its recipes take a Muon learning rate near 0.02, far above "
        "AdamW's, and hftrain has one learning_rate for both: use it knowingly.",
        group="training", choices=MUON_ADJUST_LR,
    )


def problems(r) -> list[str]:
    """Muon settings that cannot run, judged from the recipe alone."""
    if r.optim != "muon":
        return []
    problems = []
    if not 0 <= r.muon_momentum < 1:
        problems.append(f"muon_momentum must be in [0, 1), got {r.muon_momentum}")
    if not 1 <= r.muon_ns_steps < 100:
        problems.append(f"muon_ns_steps must be in [1, 99] (torch.optim.Muon's limit), got {r.muon_ns_steps}")
    for name, size, layout in (("tp_size", r.tp_size, "tensor parallelism splits each projection's matrix"),
                               ("ep_size", r.ep_size, "expert parallelism splits the experts' weights")):
        if size > 1:
            problems.append(f"optim: muon with {name}={size} is refused ({layout} over processes): {WHOLE_MATRICES}")
    if r.pp_size > 1:
        problems.append(f"optim: muon with pp_size={r.pp_size} is refused: each pipeline stage builds the optimizer "
                        "of its own layers, and the split between Muon (hidden matrices) and AdamW (embeddings, head, "
                        "norms, biases) is not verified on stages; use one process or DDP, or optim: adamw_torch")
    return problems
