"""Reference models: what an objective compares the policy with (dpo's reference; the place a KL term's reference
comes from, e.g. grpo's).

`build_reference` picks one: the base with the adapters disabled for LoRA/QLoRA (`AdapterReference`, no second
copy), a frozen copy for full fine-tuning (`FrozenReference`, placed by the parallelism backend like the policy), or
log-probs precomputed in one pass before training (`PrecomputedReference`, precompute_ref_log_probs), which are
cached across runs under `HF_HOME/hftrain` (`reference_values`) and saved with every checkpoint.
A row's log-probability (`sequence_log_probs`) is the sum of its trained tokens' log-probs (the prompt and padding
are masked as SFT masks them).
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import json
import os
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from huggingface_hub import constants, try_to_load_from_cache
from safetensors.torch import load_file, save_file
from torch import nn

from hftrain.checkpoint import load_run_tensors
from hftrain.compat.datasets import fingerprint
from hftrain.compat.deepspeed import local_part
from hftrain.config import Recipe
from hftrain.data import IGNORE_INDEX, eval_micro_batches
from hftrain.errors import HftrainError
from hftrain.model import HEAD_ONLY_MODEL_TYPES, WrapsCausalLM
from hftrain.paths import TMP_PREFIX


def sequence_log_probs(lm: nn.Module, head_only: bool, input_ids: torch.Tensor, labels: torch.Tensor,
                       **model_inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-prob of each row's trained tokens, trained tokens per row), in fp32. For the architectures whose
    logits are lm_head(hidden) the head runs on trained positions only. `model_inputs`: what else the model takes
    as it is (an image-text processor's pixel_values, attention_mask, ...: hftrain.data.image_pairs)."""
    targets = labels[:, 1:]
    trained = targets != IGNORE_INDEX
    inputs = {"input_ids": input_ids, "use_cache": False, **model_inputs}
    if head_only:
        hidden = lm.get_decoder()(**inputs).last_hidden_state[:, :-1][trained]
        logits = lm.get_output_embeddings()(hidden)
    else:
        logits = lm(**inputs).logits[:, :-1][trained]
    token_logps = -F.cross_entropy(logits.float(), targets[trained], reduction="none")
    rows = trained.nonzero()[:, 0]
    logps = torch.zeros(len(input_ids), dtype=token_logps.dtype, device=input_ids.device).index_add(0, rows,
                                                                                                    token_logps)
    return logps, trained.sum(dim=1)


def summed_log_probs(head_only: bool) -> Callable[..., torch.Tensor]:
    """dpo's reference computation: `(lm, input_ids, labels) -> each row's summed log-prob of its trained tokens`."""
    return lambda lm, input_ids, labels, **model_inputs: sequence_log_probs(lm, head_only, input_ids, labels,
                                                                            **model_inputs)[0]


class AdapterReference:
    """The reference of a LoRA/QLoRA policy: the same model with its adapters disabled (no second copy). `compute`
    is what the objective reads from it, `(lm, *inputs) -> log-probs` (dpo: `summed_log_probs`, each row's sum;
    grpo: the per-token log-probs)."""

    def __init__(self, lm: nn.Module, compute: Callable[..., torch.Tensor]):
        self.lm, self.compute = lm, compute

    def describe(self) -> str:
        return "the base model with the adapters disabled (no second copy in memory)"

    @torch.no_grad()
    def log_probs(self, *inputs: torch.Tensor, **model_inputs: torch.Tensor) -> torch.Tensor:
        with self.lm.disable_adapter():
            return self.compute(self.lm, *inputs, **model_inputs)


class ReferenceLogProbs(WrapsCausalLM):
    """dpo's frozen copy as a module of its own: `forward` returns each row's summed log-prob, so that a strategy
    that wraps it (ZeRO-3 partitions, FSDP2 shards with this module as root) gathers its weights around that
    forward."""

    def __init__(self, lm: nn.Module, head_only: bool):
        super().__init__()
        self.lm, self.sums = lm.eval().requires_grad_(False), summed_log_probs(head_only)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, **model_inputs: torch.Tensor) -> torch.Tensor:
        return self.sums(self.lm, input_ids, labels, **model_inputs)


def local_bytes(module: nn.Module) -> int:
    """Bytes of `module`'s parameters held on this process (a ZeRO-3 partition, an FSDP2 shard, or all of them)."""
    total = 0
    for p in module.parameters():
        local = p.to_local() if hasattr(p, "to_local") else local_part(p)
        total += local.numel() * local.element_size()
    return total


class FrozenReference:
    """The reference of a fully fine-tuned policy: a frozen copy of the starting model, kept off the policy's module
    tree (not in its state dict, optimizer or wrapper) and prepared by the parallelism backend like the policy
    (`prepare`: replicated for one process, DDP and ZeRO-1/2, partitioned under ZeRO-3, sharded under FSDP2); a
    resumed run copies the rebuilt starting model again. `module` wraps the copy and computes what the objective
    reads from it in its forward (dpo: `ReferenceLogProbs`, grpo: per-token log-probs)."""

    def __init__(self, module: WrapsCausalLM, device: torch.device):
        self.module = module.to(device)
        self.how = "replicated"

    def prepare(self, backend) -> None:
        self.module, self.how = backend.prepare_frozen(self.module)

    def describe(self) -> str:
        size = local_bytes(self.module) / 2**20
        return f"a frozen copy of the starting model, {self.how} (+{size:,.1f} MiB per device)"

    @torch.no_grad()
    def log_probs(self, *inputs: torch.Tensor, **model_inputs: torch.Tensor) -> torch.Tensor:
        return self.module(*inputs, **model_inputs)


class PrecomputedReference:
    """precompute_ref_log_probs: the starting model's log-probs of every pair (dpo) or row and mismatched row (kto),
    computed once before training and carried in each batch by the collator (`ref_logps`, kto's `kl_ref_logps`)."""

    def __init__(self):
        self.what = ""  # what was computed, in words: "400 pairs"
        self.source = "one pass of the starting model before training"  # or the cache / checkpoint it came from

    def describe(self) -> str:
        return (f"precomputed log-probs of {self.what} ({self.source}; saved with every checkpoint; no "
                "reference model in memory)")


REFERENCE_CACHE = Path(constants.HF_HOME) / "hftrain" / "reference_log_probs"
# Recipe fields that change what the starting model computes (the data's own fingerprint covers tokenization)
REFERENCE_KEY_FIELDS = ("model_name_or_path", "model_revision", "trust_remote_code", "dtype", "attn_implementation",
                        "bf16", "fp16", "torch_compile", "use_peft", "use_dora", "load_in_4bit", "load_in_8bit",
                        "bnb_4bit_quant_type", "bnb_4bit_use_double_quant", "bnb_4bit_compute_dtype",
                        "bnb_4bit_quant_storage")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".json")


def _model_files(recipe: Recipe) -> list[str]:
    """(name, size, modification time) of the starting model's files: a local folder's, or the hub snapshot's
    (its folder is named by the commit)."""
    folder = Path(recipe.model_name_or_path).expanduser()
    if not folder.is_dir():
        config = try_to_load_from_cache(recipe.model_name_or_path, "config.json", revision=recipe.model_revision)
        folder = Path(config).parent if isinstance(config, str) else None
    if folder is None:
        return ["not cached"]
    return sorted(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in folder.iterdir()
                  if f.suffix in WEIGHT_SUFFIXES)


def reference_cache_file(recipe: Recipe, sets: dict, key: tuple[str, ...] = ()) -> Path:
    """Where the reference log-probs of these pairs under this starting model are cached across runs, keyed like
    the tokenization cache: the tokenized data's fingerprints, the recipe fields that change the model's outputs,
    the model's files (name, size, modification time) and the code that computes the log-probs; `key`: what else
    decides the values (kto: the mismatched rows the run draws and how they are built)."""
    parts = [json.dumps({k: getattr(recipe, k) for k in REFERENCE_KEY_FIELDS}, sort_keys=True, default=str),
             *_model_files(recipe), inspect.getsource(sequence_log_probs), *key]
    parts += [f"{name}:{fingerprint(data)}:{len(data)}" for name, data in sorted(sets.items())]
    return REFERENCE_CACHE / f"{hashlib.sha256(chr(0).join(parts).encode()).hexdigest()[:32]}.safetensors"


def build_reference(recipe: Recipe, lm: nn.Module, device: torch.device,
                    copy_model: Callable[[nn.Module], nn.Module] = copy.deepcopy):
    """The reference model an objective compares with (dpo's; simpo asks for none): precomputed log-probs with
    precompute_ref_log_probs, the adapter-free base for a peft model, else a frozen copy of the built model (taken
    before any training or checkpoint loading, so a resumed run compares with the same starting model; `copy_model`:
    the parallelism backend's way to copy a model it may already have partitioned)."""
    head_only = lm.config.model_type in HEAD_ONLY_MODEL_TYPES
    if recipe.precompute_ref_log_probs:
        return PrecomputedReference()
    if hasattr(lm, "disable_adapter"):
        return AdapterReference(lm, summed_log_probs(head_only))
    return FrozenReference(ReferenceLogProbs(copy_model(lm), head_only), device)


@torch.no_grad()
def precompute_reference_log_probs(model, loss_fn, dataset, collator, dp, batch_size: int,
                                   device: torch.device) -> torch.Tensor:
    """[pairs, 2] (chosen, rejected) log-probs of every pair of `dataset` under the prepared starting `model`.

    Every data-parallel rank computes a disjoint shard (the same number of forwards on every rank, so sharded models
    stay in step) through the strategy's wrapper; one sum gathers them.
    """
    out = torch.zeros(len(dataset), 2, dtype=torch.float64, device=device)
    loss_fn.collecting = True
    model.eval()
    try:
        for indices in eval_micro_batches(len(dataset), batch_size, dp.world, dp.rank):
            batch = {k: v.to(device) for k, v in collator(indices).items() if k != "num_examples"}
            logps = model(**batch).double()
            if indices:
                half = len(logps) // 2
                out[indices] = torch.stack([logps[:len(indices)], logps[half:half + len(indices)]], dim=1)
    finally:
        loss_fn.collecting = False
        model.train()
    return dp.sum(out).float()


def pair_values_unfit(sets: dict) -> Callable[[dict[str, torch.Tensor]], str | None]:
    """dpo's test of saved or cached values: a [pairs, 2] tensor for every set, else what is missing."""

    def unfit(values: dict[str, torch.Tensor]) -> str | None:
        wrong = [name for name, data in sets.items() if name not in values or values[name].shape != (len(data), 2)]
        return (f"no reference log-probs for the current {' and '.join(wrong)} pairs (saved without "
                "precompute_ref_log_probs, or the data changed)") if wrong else None
    return unfit


def reference_values(recipe: Recipe, sets: dict, accelerator, resume_from: Path | None,
                     compute: Callable[[], dict],
                     unfit: Callable[[dict[str, torch.Tensor]], str | None] | None = None,
                     key: tuple[str, ...] = ()) -> tuple[dict[str, torch.Tensor], str]:
    """({name: reference log-probs}, where they came from) for precompute_ref_log_probs: dpo's [pairs, 2] per set.

    On resume: the values saved in the checkpoint (the model has trained since). Else the cross-run cache when every
    process finds it (one vote: a process that computed alone would leave the others waiting in its forward), else
    `compute()` on every process, written to the cache whole and then renamed. `unfit(values)`: why saved or
    cached values do not serve this run, None when they do (default: dpo's, `pair_values_unfit`); `key`: more of
    the cache key (`reference_cache_file`).
    """
    unfit = unfit or pair_values_unfit(sets)
    if resume_from is not None:
        values = load_run_tensors(resume_from) or {}
        if (why := unfit(values)) is not None:
            raise HftrainError(f"precompute_ref_log_probs: {resume_from} has {why}; resume with the same data and "
                               "settings, or start a new run")
        return values, f"saved in {resume_from}"
    cache = reference_cache_file(recipe, sets, key)
    found = accelerator.reduce(torch.tensor(float(cache.exists()), device=accelerator.device), reduction="sum")
    if int(found) == accelerator.num_processes:
        values = load_file(str(cache))
        if unfit(values) is None:
            return values, f"read from the cache {cache}"
    values = compute()
    if accelerator.is_main_process:
        cache.parent.mkdir(parents=True, exist_ok=True)
        partial = cache.with_name(f"{TMP_PREFIX}{os.getpid()}-{cache.name}")  # two runs may write one key at once
        save_file({k: v.contiguous().cpu() for k, v in values.items()}, str(partial))
        partial.replace(cache)
    return values, f"one pass of the starting model before training, cached in {cache}"
