"""KTO (recipe `objective: kto`): Kahneman-Tversky Optimization on unpaired feedback, as TRL 1.16's KTOTrainer
computes it (trl/trainer/kto_trainer.py), with its KL reference point taken over the optimizer step.

Each row is a prompt, one completion and a label (desirable or not). With r = log pi(y|x) - log ref(y|x), the
completion's summed log-prob ratio, and z the KL reference point:

    loss_type kto:               desirable  w_d (1 - s(beta (r - z)))    undesirable  w_u (1 - s(beta (z - r)))
    loss_type apo_zero_unpaired: desirable  w_d (1 - s(beta r))          undesirable  w_u s(beta r)

and the loss is the mean over the rows. z = max(0, mean over mismatched rows of log pi(y'|x) - log ref(y'|x)),
no gradient, where row k's mismatched completion y' is row k-1's (the first row takes the last one's): TRL's rule
(`add_kl_completion_ids`). TRL applies it within each device's block of per_device_train_batch_size rows and
takes z per micro-batch; here it is applied to the optimizer step's whole batch in the order the batch plan draws
it, and z is computed in one no-grad pass over all the step's micro-batches and data-parallel ranks before the step
trains (`KTOLoss.prepare_step`). So accumulation and processes leave the step unchanged, and a step of one
micro-batch on one process is TRL's. Evaluation takes z over the whole eval set the same way (rotated over the set).

precompute_ref_log_probs (`precompute_kto_reference`): the starting model's log-probs of every row, and of every
mismatched row that some step of the run draws (`KTOPlan.run_pairs`: the plan is deterministic, so the pairs of
every step of every epoch are known before step 1), each keyed by its (row, partner) pair, computed in one pass
before training and carried in each batch by `KTOCollator` (`ref_logps`, `kl_ref_logps`).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import inspect
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import torch
from torch import nn

from hftrain.config import Recipe
from hftrain.data import IGNORE_INDEX, Collator, eval_micro_batches
from hftrain.data.batching import BatchPlan, IndexedFeed
from hftrain.data.feeds import TrainingData
from hftrain.data.image_unpaired import ImageKTOCollator
from hftrain.errors import HftrainError
from hftrain.objectives.base import Objective
from hftrain.objectives.preference import PreferenceLoss
from hftrain.objectives.reference import (
    PrecomputedReference,
    build_reference,
    reference_values,
    sequence_log_probs,
)
from hftrain.parallel.launch import phase
from hftrain.run_parts import DataRun, ModelRun, TrainRun

# statistics TRL's KTOTrainer logs, over the step (training) or the eval set
KTO_STATS = ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")
# evaluation: sums and counts, turned into KTO_STATS' means by `eval_metrics`
KTO_EVAL_SUMS = ("kl", "chosen_rewards", "rejected_rewards", "chosen_logps", "rejected_logps", "chosen", "rejected")


def kl_partners(rows: list) -> list:
    """TRL's mismatched pairing: row k's KL completion is row k-1's, the first row's is the last row's."""
    return rows[-1:] + rows[:-1]


@dataclass(frozen=True)
class KTOPlan(BatchPlan):
    """The batch plan whose micro-batches hold (row, KL partner) pairs, the partner taken over the optimizer step's
    whole batch (`kl_partners` of the step's rows, in the plan's order)."""

    def step_items(self, chunk: list[int]) -> list:
        return list(zip(chunk, kl_partners(chunk)))

    def run_pairs(self, total_steps: int) -> list[tuple[int, int]]:
        """Every (row, partner) pair the run's `total_steps` optimizer steps draw, epoch after epoch (step k is step
        k mod steps_per_epoch of epoch k // steps_per_epoch), sorted. Whatever the processes and accumulation: a
        step's pairs depend on its global batch only."""
        pairs, order = set(), []
        for step in range(total_steps):
            epoch, at = divmod(step, self.steps_per_epoch)
            if at == 0 or not order:
                order = self.epoch_order(epoch)
            pairs.update(self.step_items(order[at * self.global_batch:(at + 1) * self.global_batch]))
        return sorted(pairs)


class KTOCollator(Collator):
    """Collates rows as `Collator` does and adds `desirable` (the label per row) and the KL sequences: each row's
    prompt followed by its partner's completion (`kl_input_ids`, `kl_labels`: the completion trained), cut to
    max_length as TRL's collator cuts them. Items are (row, partner) from `KTOPlan`, or plain rows (evaluation), whose
    partner is the previous row of the whole set (`kl_partners` over the set). With precompute_ref_log_probs
    (`precompute_kto_reference` sets them) each batch also carries the reference's log-probs of its rows
    (`ref_logps`) and, for loss_type kto, of its mismatched rows (`kl_ref_logps`)."""

    def __init__(self, dataset, pad_token_id: int, max_length: int):
        super().__init__(dataset, pad_token_id)
        self.max_length = max_length
        self.row_reference = None  # [rows] precomputed reference log-probs of each row's completion
        self.kl_reference = None  # {(row, partner): the reference log-prob of the mismatched row}

    def __call__(self, items: list) -> dict[str, torch.Tensor]:
        pairs = [item if isinstance(item, tuple) else (item, (item - 1) % len(self.dataset)) for item in items]
        batch = super().__call__([row for row, _ in pairs])
        if self.row_reference is not None:
            batch["ref_logps"] = self.row_reference[[row for row, _ in pairs]] if pairs else torch.zeros(1)
        if self.kl_reference is not None:
            batch["kl_ref_logps"] = torch.tensor([self.kl_value(pair) for pair in pairs] or [0.0])
        if not pairs:
            batch.update(desirable=torch.zeros(1, dtype=torch.bool), kl_input_ids=batch["input_ids"].clone(),
                         kl_labels=batch["labels"].clone())
            return batch
        needed = sorted({i for pair in pairs for i in pair})  # the rows and their partners, each fetched once
        fetched, at = self.dataset[needed], {i: k for k, i in enumerate(needed)}
        ids, labels, starts = fetched["input_ids"], fetched["labels"], fetched["prompt_length"]
        kl_rows = []
        for row, partner in pairs:
            start, other = starts[at[row]], starts[at[partner]]
            kl_ids = (ids[at[row]][:start] + ids[at[partner]][other:])[:self.max_length]
            kl_lbl = ([IGNORE_INDEX] * start + labels[at[partner]][other:])[:self.max_length]
            kl_rows.append((kl_ids, kl_lbl))
        width = max(len(kl_ids) for kl_ids, _ in kl_rows)
        kl_input_ids = torch.full((len(kl_rows), width), self.pad_token_id, dtype=torch.long)
        kl_labels = torch.full_like(kl_input_ids, IGNORE_INDEX)
        for r, (kl_ids, kl_lbl) in enumerate(kl_rows):
            kl_input_ids[r, :len(kl_ids)] = torch.tensor(kl_ids)
            kl_labels[r, :len(kl_lbl)] = torch.tensor(kl_lbl)
        kl_labels[:, 0] = IGNORE_INDEX
        batch.update(desirable=torch.tensor([bool(fetched["desirable"][at[row]]) for row, _ in pairs]),
                     kl_input_ids=kl_input_ids, kl_labels=kl_labels)
        return batch

    def kl_value(self, pair: tuple[int, int]) -> float:
        if pair not in self.kl_reference:  # the precomputed pairs are every pair the plan draws: a defect if not
            raise HftrainError(f"precompute_ref_log_probs: no reference log-prob was computed for the mismatched row "
                               f"of example {pair[0]}'s prompt and example {pair[1]}'s completion")
        return self.kl_reference[pair]


def kto_losses(recipe: Recipe, ratio: torch.Tensor, desirable: torch.Tensor, kl: torch.Tensor) -> torch.Tensor:
    """Each row's weighted KTO loss (TRL's KTOTrainer) from its log-prob ratio r, its label and the reference point."""
    beta = recipe.beta
    if recipe.loss_type == "kto":
        good, bad = 1 - torch.sigmoid(beta * (ratio - kl)), 1 - torch.sigmoid(beta * (kl - ratio))
    else:  # apo_zero_unpaired
        good, bad = 1 - torch.sigmoid(beta * ratio), torch.sigmoid(beta * ratio)
    return torch.where(desirable, recipe.desirable_weight * good, recipe.undesirable_weight * bad)


class KTOLoss(PreferenceLoss):
    """Wraps a causal LM so that `forward` returns the sum of the micro-batch's weighted KTO losses; the loop divides
    by the step's rows. `prepare_step` computes the step's KL reference point first (no gradient), and the step's
    desirable and undesirable counts, so the logged statistics are the step's means."""

    unit = "examples"
    examples_name = "samples"

    def __init__(self, lm: nn.Module, recipe: Recipe, reference):
        super().__init__(lm, recipe, reference)
        self.kl = torch.zeros(())  # the reference point z in use (the step's, or the eval set's)
        self.kl_pass = False  # True while `forward` computes the KL sums of the mismatched rows
        self.step_counts = None  # training: (rows, desirable, undesirable) of the step over all ranks

    def loss_units(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Real rows of the micro-batch: those with a trained token."""
        return (batch["labels"][:, 1:] != IGNORE_INDEX).any(dim=1).sum()

    def kl_sums(self, model: nn.Module, batches, reduce: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """(sum over the mismatched rows of log pi - log ref, their count), summed over `batches` and the ranks;
        through `model`, the strategy's wrapper of this module, so sharded weights are gathered as for training.
        The random state is restored after it, so the training forwards draw the same dropout masks."""
        device = self.kl.device
        local = torch.zeros(2, dtype=torch.float64, device=device)
        self.kl_pass = True
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
                for batch in batches:
                    local += model(**batch)
        finally:
            self.kl_pass = False
        return reduce(local)

    def set_kl(self, sums: torch.Tensor) -> None:
        self.kl = (sums[0] / sums[1].clamp(min=1)).clamp(min=0).float()

    def prepare_step(self, model: nn.Module, micro_batches: list[dict[str, torch.Tensor]],
                     reduce: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """The step's KL reference point (loss_type kto) over all its micro-batches and data-parallel ranks, and its
        rows, desirable and undesirable rows."""
        device = micro_batches[0]["input_ids"].device
        self.kl = self.kl.to(device)
        counts = torch.zeros(3, dtype=torch.float64, device=device)
        for batch in micro_batches:
            real = (batch["labels"][:, 1:] != IGNORE_INDEX).any(dim=1)
            desirable = batch["desirable"] & real
            counts += torch.stack([real.sum(), desirable.sum(), (real & ~desirable).sum()]).double()
        if self.recipe.loss_type == "kto":
            self.set_kl(self.kl_sums(model, micro_batches, reduce))
        else:
            self.kl = torch.zeros((), device=device)
        self.step_counts = reduce(counts).tolist()

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, desirable: torch.Tensor | None = None,
                kl_input_ids: torch.Tensor | None = None, kl_labels: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, real_tokens: torch.Tensor | None = None,
                ref_logps: torch.Tensor | None = None, kl_ref_logps: torch.Tensor | None = None,
                **model_inputs: torch.Tensor) -> torch.Tensor:
        """The micro-batch's summed loss; in the KL pass the sums of its mismatched rows' log-ratios; while
        precomputing (`collecting`) each row's log-prob. `ref_logps` / `kl_ref_logps`: precomputed reference
        log-probs of the rows / mismatched rows (precompute_ref_log_probs), else the reference computes them.
        `model_inputs`: an image-text processor's outputs (hftrain.data.image_unpaired): the rows' per-token ones
        (attention_mask, ...), the KL rows' as `kl_<name>`, and the per-image ones (pixel_values, ...), which both
        read, for the policy and the reference alike."""
        row_inputs = {k: v for k, v in model_inputs.items() if not k.startswith("kl_")}
        if self.collecting:  # as the live reference: under LoRA the base with the adapters disabled
            with self.lm.disable_adapter() if hasattr(self.lm, "disable_adapter") else contextlib.nullcontext():
                return sequence_log_probs(self.lm, self.head_only, input_ids, labels, **row_inputs)[0].detach()
        if self.kl_pass:
            kl_inputs = {**row_inputs, **{k[3:]: v for k, v in model_inputs.items() if k.startswith("kl_")}}
            logps, lengths = sequence_log_probs(self.lm, self.head_only, kl_input_ids, kl_labels, **kl_inputs)
            ratio = logps - self.reference_log_probs(kl_ref_logps, kl_input_ids, kl_labels, **kl_inputs)
            real = lengths > 0
            return torch.stack([(ratio * real).sum(), real.sum()]).double()
        logps, lengths = sequence_log_probs(self.lm, self.head_only, input_ids, labels, **row_inputs)
        ratio = logps - self.reference_log_probs(ref_logps, input_ids, labels, **row_inputs)
        real = lengths > 0
        good, bad = (desirable & real).to(ratio.dtype), (~desirable & real).to(ratio.dtype)
        losses = kto_losses(self.recipe, ratio, desirable, self.kl.to(ratio.device)) * real
        with torch.no_grad():
            rewards = self.recipe.beta * ratio
            sums = torch.stack([rewards @ good, rewards @ bad, logps @ good, logps @ bad, good.sum(), bad.sum()])
            if self.training and self.step_counts is not None:
                stats = self.step_stats(sums, real.sum())
            else:
                stats = torch.cat([(self.kl * real.sum()).reshape(1), sums])
            self.stats = stats if self.stats is None else self.stats + stats
        return losses.sum()

    def reference_log_probs(self, precomputed: torch.Tensor | None, input_ids: torch.Tensor,
                            labels: torch.Tensor, **model_inputs: torch.Tensor) -> torch.Tensor:
        if precomputed is not None:
            return precomputed
        if isinstance(self.reference, PrecomputedReference):
            raise HftrainError("kto needs the reference log-probs of this batch, and none were precomputed")
        return self.reference.log_probs(input_ids, labels, **model_inputs)

    def step_stats(self, sums: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """This micro-batch's share of KTO_STATS x the step's rows: the loop divides the window's sums by its rows,
        so a step's logged value is its mean over its desirable (or undesirable) rows, as TRL's with one
        micro-batch per step."""
        n, chosen, rejected = self.step_counts
        to_chosen, to_rejected = (n / chosen if chosen else 0.0), (n / rejected if rejected else 0.0)
        chosen_rewards, rejected_rewards = sums[0] * to_chosen, sums[1] * to_rejected
        margins = chosen_rewards - rejected_rewards if chosen and rejected else torch.zeros_like(sums[0])
        return torch.stack([self.kl.to(sums.device) * rows, chosen_rewards, rejected_rewards, margins,
                            sums[2] * to_chosen, sums[3] * to_rejected])

    def pop_stats(self) -> dict[str, torch.Tensor]:
        """Training: KTO_STATS' sums since the last call; evaluation: KTO_EVAL_SUMS."""
        stats, self.stats = self.stats, None
        if stats is None:
            return {}
        return dict(zip(KTO_STATS if len(stats) == len(KTO_STATS) else KTO_EVAL_SUMS, stats.double()))

    def eval_metrics(self, loss_sum: float, units: int, stats: dict[str, float]) -> dict[str, float]:
        """eval_loss: the mean over the eval rows; the statistics as TRL names them, each over its rows."""
        chosen, rejected = stats.get("chosen", 0.0), stats.get("rejected", 0.0)
        metrics = {"eval_loss": loss_sum / max(units, 1), "eval_examples": int(units),
                   "eval_kl": stats.get("kl", 0.0) / max(units, 1)}
        if chosen:
            metrics.update({"eval_rewards/chosen": stats["chosen_rewards"] / chosen,
                            "eval_logps/chosen": stats["chosen_logps"] / chosen})
        if rejected:
            metrics.update({"eval_rewards/rejected": stats["rejected_rewards"] / rejected,
                            "eval_logps/rejected": stats["rejected_logps"] / rejected})
        if chosen and rejected:
            metrics["eval_rewards/margins"] = metrics["eval_rewards/chosen"] - metrics["eval_rewards/rejected"]
        return metrics


def balance_warning(recipe: Recipe, desirable: int, undesirable: int) -> str | None:
    """TRL's warning when desirable/undesirable counts differ and neither weight is in the range the KTO paper's
    Eq. (8) recommends (its bounds, rounded as TRL rounds them)."""
    num_desirable = max(desirable, 1)
    num_undesirable = max(desirable + undesirable - num_desirable, 1)
    if num_desirable == num_undesirable:
        return None
    w_d, w_u = recipe.desirable_weight, recipe.undesirable_weight
    d_ratio, u_ratio = num_undesirable * w_u / num_desirable, num_desirable * w_d / num_undesirable
    d_low, d_high = round(d_ratio, 2), round(d_ratio * 1.33, 2)
    u_low, u_high = round(u_ratio / 1.33, 2), round(u_ratio, 2)
    if d_low <= w_d <= d_high or u_low <= w_u <= u_high:
        return None
    return (f"the training set has {desirable} desirable and {undesirable} undesirable examples, and neither "
            f"desirable_weight ({w_d:g}) nor undesirable_weight ({w_u:g}) is in the range the KTO paper recommends "
            f"for it: set EITHER desirable_weight in [{d_low}, {d_high}] OR undesirable_weight in [{u_low}, "
            f"{u_high}] (not both; docs/preference.md)")


class KTO(Objective):
    """kto: `KTOLoss` around the model, its reference as dpo's (adapters disabled under LoRA, else a frozen copy)."""

    name = "kto"

    def setup_data(self, run: DataRun) -> TrainingData:
        """The examples as for dpo, then the plan that pairs each row with its KL partner over the step, the
        collators that build the KL rows, and the label checks: both classes present, TRL's balance warning."""
        data = run.setup_examples()
        recipe = run.recipe
        labels = data.train_set["desirable"]
        desirable = int(sum(labels))
        undesirable = len(labels) - desirable
        if not desirable or not undesirable:
            missing = "desirable (label: true)" if not desirable else "undesirable (label: false)"
            raise HftrainError(
                f"objective kto needs both desirable and undesirable examples, but every one of the "
                f"{len(labels)} training examples is {'undesirable' if not desirable else 'desirable'}: there is no "
                f"{missing} example to learn from (KTO raises the likelihood of desirable completions and lowers that "
                "of undesirable ones relative to the reference point); add examples of the other class, or train "
                "with objective sft on the desirable ones"
            )
        warning = balance_warning(recipe, desirable, undesirable)
        if warning and run.accelerator.is_main_process:
            print(f"hftrain: warning: {warning}", file=sys.stderr)
        plan = KTOPlan(**asdict(data.plan))
        if isinstance(data.collator, ImageKTOCollator):  # image-text rows: their collators build the KL rows
            collator, eval_collator = data.collator, data.eval_collator
        else:
            pad = data.collator.pad_token_id
            collator = KTOCollator(data.train_set, pad, recipe.max_length)
            eval_collator = KTOCollator(data.eval_set, pad, recipe.max_length) if data.eval_set is not None \
                else data.eval_collator
        feed = IndexedFeed(plan, collator, run.dp.rank, recipe.dataloader_num_workers, recipe.dataloader_pin_memory)
        line = (data.data_line[0], f"{data.data_line[1]} ({desirable} desirable, {undesirable} undesirable)")
        return replace(data, feed=feed, plan=plan, collator=collator, eval_collator=eval_collator, data_line=line)

    def build_loss(self, recipe: Recipe, lm: nn.Module, device: torch.device,
                   copy_model: Callable[[nn.Module], nn.Module] = copy.deepcopy) -> KTOLoss:
        return KTOLoss(lm, recipe, build_reference(recipe, lm, device, copy_model))

    def prepare(self, run: ModelRun) -> dict[str, torch.Tensor] | None:
        """The frozen copy placed like the policy (full fine-tuning); with precompute_ref_log_probs, the reference
        log-probs (`precompute_kto_reference`)."""
        if hasattr(run.parts.loss.reference, "prepare"):
            run.parts.loss.reference.prepare(run.backend)
        return precompute_kto_reference(run) if run.recipe.precompute_ref_log_probs else None

    def evaluate(self, run: TrainRun) -> dict[str, float]:
        """The eval set's KL reference point (rows rotated over the whole set, every rank a disjoint shard), then
        the loss over the eval set with it."""
        loss, recipe = run.parts.loss, run.recipe
        if recipe.loss_type == "kto":
            shards = eval_micro_batches(len(run.data.eval_set), recipe.per_device_eval_batch_size, run.dp.world,
                                        run.dp.rank)
            device = run.accelerator.device
            batches = ({k: v.to(device) for k, v in run.data.eval_collator(indices).items() if k != "num_examples"}
                       for indices in shards)
            run.model.eval()
            try:
                loss.kl = loss.kl.to(device)
                loss.set_kl(loss.kl_sums(run.model, batches, run.dp.sum))
            finally:
                run.model.train()
        else:
            loss.kl = torch.zeros(())
        return run.evaluate_loss()

    def notes(self, run: TrainRun) -> list[str]:
        recipe = run.recipe
        reference = run.parts.loss.reference.describe()
        point = ("the KL reference point is estimated over each optimizer step's whole batch (TRL's mismatched "
                 "pairing applied to it; one no-grad pass before the step)" if recipe.loss_type == "kto"
                 else "no KL reference point")
        return [f"objective kto ({recipe.loss_type}), beta {recipe.beta:g}, desirable_weight "
                f"{recipe.desirable_weight:g}, undesirable_weight {recipe.undesirable_weight:g}; reference: "
                f"{reference}; {point}; the loss is the mean over the step's examples"]


@torch.no_grad()
def reference_pass(run: ModelRun, collator: KTOCollator, items: list, ids_key: str, labels_key: str) -> torch.Tensor:
    """[len(items)] summed log-probs of the prepared starting model (`run.model`, under the launch's strategy) of
    each item's row (`input_ids`) or mismatched row (`kl_input_ids`). Every data-parallel rank computes a disjoint
    shard, with the same number of forwards on every rank so that sharded models stay in step; one sum gathers them."""
    device, loss = run.accelerator.device, run.parts.loss
    out = torch.zeros(len(items), dtype=torch.float64, device=device)
    loss.collecting = True
    run.model.eval()
    try:
        for shard in eval_micro_batches(len(items), run.recipe.per_device_eval_batch_size, run.dp.world, run.dp.rank):
            batch = collator([items[i] for i in shard])
            logps = run.model(input_ids=batch[ids_key].to(device), labels=batch[labels_key].to(device)).double()
            if shard:
                out[shard] = logps[:len(shard)]
    finally:
        loss.collecting = False
        run.model.train()
        run.backend.release(run.model)
    return run.dp.sum(out).float()


def precompute_kto_reference(run: ModelRun) -> dict[str, torch.Tensor]:
    """kto's reference log-probs with precompute_ref_log_probs: for the training set and the eval set, `{name}`
    [rows] (each row's completion) and, for loss_type kto, `{name}_kl` with `{name}_kl_pairs` (each mismatched row's
    log-prob and its (row, partner) pair): the training set's pairs are those every step of the run draws
    (`KTOPlan.run_pairs`), the eval set's its rows rotated over the set. From the resumed checkpoint, the cross-run
    cache or one pass of the prepared starting model (`reference_values`); handed to the collators."""
    recipe, data, with_kl = run.recipe, run.data, run.recipe.loss_type == "kto"
    sets = {"train": (data.train_set, data.collator, data.plan.run_pairs(data.total_steps) if with_kl else [])}
    if data.eval_set is not None:
        n = len(data.eval_set)
        sets["eval"] = (data.eval_set, data.eval_collator, [(i, (i - 1) % n) for i in range(n)] if with_kl else [])

    def compute() -> dict[str, torch.Tensor]:
        values = {}
        with phase(run.accelerator, "precomputing reference log-probs", recipe.ddp_timeout):
            for name, (data, collator, pairs) in sets.items():
                values[name] = reference_pass(run, collator, list(range(len(data))), "input_ids", "labels")
                if with_kl:
                    values[f"{name}_kl"] = reference_pass(run, collator, pairs, "kl_input_ids", "kl_labels")
                    values[f"{name}_kl_pairs"] = torch.tensor(pairs, dtype=torch.long).reshape(-1, 2)
        return values

    def unfit(values: dict[str, torch.Tensor]) -> str | None:
        """Saved (resume) or cached values serve this run when they hold every row and every pair it draws."""
        for name, (data, _, pairs) in sets.items():
            if name not in values or values[name].shape != (len(data),):
                return (f"no kto reference log-probs for the current {name} rows (saved without "
                        "precompute_ref_log_probs, or the data changed)")
            saved = values.get(f"{name}_kl_pairs")
            missing = set(pairs) - (set(map(tuple, saved.tolist())) if saved is not None else set())
            if missing:
                return (f"no reference log-probs for {len(missing)} of the {len(pairs)} mismatched (KL) rows this "
                        f"run's {name} {'steps draw' if name == 'train' else 'set pairs'} (they were computed for "
                        "the steps of the run that saved it; this one draws its steps with another global batch, "
                        "seed, train_sampling_strategy or number of steps)")
        return None

    key = (f"kto {recipe.loss_type} max_length={recipe.max_length}", inspect.getsource(KTOCollator),
           *(hashlib.sha256(json.dumps(pairs).encode()).hexdigest() for _, _, pairs in sets.values()))
    values, run.parts.loss.reference.source = reference_values(
        recipe, {name: data for name, (data, _, _) in sets.items()}, run.accelerator, run.resume_from, compute,
        unfit, key)
    for name, (_, collator, _) in sets.items():
        collator.row_reference = values[name].cpu()
        if with_kl:
            collator.kl_reference = dict(zip(map(tuple, values[f"{name}_kl_pairs"].tolist()),
                                             values[f"{name}_kl"].tolist()))
    rows = sum(len(data) for data, _, _ in sets.values())
    kl_rows = sum(len(pairs) for _, _, pairs in sets.values())
    run.parts.loss.reference.what = f"{rows} rows" + (f" and {kl_rows} mismatched (KL) rows" if with_kl else "")
    return values
