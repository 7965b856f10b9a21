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
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import torch
from torch import nn

from hftrain.config import Recipe
from hftrain.data import IGNORE_INDEX, Collator, eval_micro_batches
from hftrain.data.batching import BatchPlan, IndexedFeed
from hftrain.data.feeds import TrainingData
from hftrain.errors import HftrainError
from hftrain.objectives.base import Objective
from hftrain.objectives.preference import PreferenceLoss
from hftrain.objectives.reference import build_reference, sequence_log_probs

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


class KTOCollator(Collator):
    """Collates rows as `Collator` does and adds `desirable` (the label per row) and the KL sequences: each row's
    prompt followed by its partner's completion (`kl_input_ids`, `kl_labels`: the completion trained), cut to
    max_length as TRL's collator cuts them. Items are (row, partner) from `KTOPlan`, or plain rows (evaluation), whose
    partner is the previous row of the whole set (`kl_partners` over the set)."""

    def __init__(self, dataset, pad_token_id: int, max_length: int):
        super().__init__(dataset, pad_token_id)
        self.max_length = max_length

    def __call__(self, items: list) -> dict[str, torch.Tensor]:
        pairs = [item if isinstance(item, tuple) else (item, (item - 1) % len(self.dataset)) for item in items]
        batch = super().__call__([row for row, _ in pairs])
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
                ref_logps: torch.Tensor | None = None) -> torch.Tensor:
        if self.kl_pass:
            logps, lengths = sequence_log_probs(self.lm, self.head_only, kl_input_ids, kl_labels)
            ratio = logps - self.reference.log_probs(kl_input_ids, kl_labels)
            real = lengths > 0
            return torch.stack([(ratio * real).sum(), real.sum()]).double()
        logps, lengths = sequence_log_probs(self.lm, self.head_only, input_ids, labels)
        ratio = logps - self.reference.log_probs(input_ids, labels)
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

    def setup_data(self, run) -> TrainingData:
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

    def prepare(self, run) -> None:
        """The frozen copy placed like the policy (full fine-tuning)."""
        if hasattr(run.token_loss.reference, "prepare"):
            run.token_loss.reference.prepare(run.backend)

    def evaluate(self, run) -> dict[str, float]:
        """The eval set's KL reference point (rows rotated over the whole set, every rank a disjoint shard), then
        the loss over the eval set with it."""
        loss, recipe = run.token_loss, run.recipe
        if recipe.loss_type == "kto":
            shards = eval_micro_batches(len(run.eval_set), recipe.per_device_eval_batch_size, run.dp.world,
                                        run.dp.rank)
            device = run.accelerator.device
            batches = ({k: v.to(device) for k, v in run.eval_collator(indices).items() if k != "num_examples"}
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

    def notes(self, run) -> list[str]:
        recipe = run.recipe
        reference = run.token_loss.reference.describe()
        point = ("the KL reference point is estimated over each optimizer step's whole batch (TRL's mismatched "
                 "pairing applied to it; one no-grad pass before the step)" if recipe.loss_type == "kto"
                 else "no KL reference point")
        return [f"objective kto ({recipe.loss_type}), beta {recipe.beta:g}, desirable_weight "
                f"{recipe.desirable_weight:g}, undesirable_weight {recipe.undesirable_weight:g}; reference: "
                f"{reference}; {point}; the loss is the mean over the step's examples"]
