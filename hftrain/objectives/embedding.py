"""Embedding models (recipe `objective: embedding`): a bi-encoder trained contrastively, as sentence-transformers 6's
MultipleNegativesRankingLoss (sentence_transformer/losses/multiple_negatives_ranking.py).

The base is loaded as `AutoModel` (the body; a causal LM's head is dropped: `model.load_as_encoder`). A text's
embedding is its last hidden states pooled (`pooling`: mean of the real tokens, the first token (cls), or the last
real token (last_token)) and L2-normalised, as sentence-transformers' Pooling and Normalize modules compute it. A
micro-batch holds b rows (anchor, positive, negatives...) collated as columns (`data.retrieval.EmbeddingCollator`),
embedded column by column, each at its own longest text's width (as sentence-transformers embeds each column).
For anchor i, with s(x, y) the cosine similarity times `contrastive_scale`, the candidates are every positive and
every negative of the contrastive batch:

    loss_i = -s(a_i, p_i) + log sum_c exp s(a_i, c)
    symmetric_loss: loss_i = -s(a_i, p_i) + (log sum_c exp s(a_i, c) + log sum_j exp s(p_i, a_j)) / 2

The contrastive batch is one micro-batch on every data-parallel rank together: the embeddings are gathered from
every rank (`gather`), whose backward hands each embedding the gradient every rank computed for it (sentence-
transformers' `gather_across_devices=True`), so n processes of b rows equal one process of n*b rows. Each
micro-batch returns the sum of its (valid) anchors' losses and the loop divides by the step's anchors: gradient
accumulation over k micro-batches trains on k *separate* contrastive batches (anchor i's negatives are its own
micro-batch's), the mean of their losses, as sentence-transformers' trainer does with gradient_accumulation_steps.
To make a larger contrastive batch fit in memory, raise per_device_train_batch_size with `mini_batch_size` (the
cached mode: each piece of mini_batch_size texts is embedded inside a non-reentrant `torch.utils.checkpoint`, so
its activations are dropped and recomputed one piece at a time in backward, as CachedMultipleNegativesRankingLoss's
GradCache does; without dropout its loss and gradients are the uncached batch's, with dropout each piece draws its
own masks, as there). Evaluation: the same loss per eval micro-batch on each rank, without gathering.

The final folder is sentence-transformers 6's layout (`write_sentence_transformers_files`): the encoder and tokenizer
at its root (transformers' `AutoModel` loads it), modules.json, sentence_bert_config.json, 1_Pooling/config.json,
2_Normalize/config.json and config_sentence_transformers.json with the query prompt.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from hftrain.config import Recipe
from hftrain.data.batching import BatchPlan, IndexedFeed
from hftrain.data.feeds import TrainingData, total_steps
from hftrain.data.retrieval import EmbeddingCollator, read_rows, tokenize_rows
from hftrain.errors import HftrainError, same_in_every_process
from hftrain.loss import ObjectiveLoss
from hftrain.objectives.base import Objective
from hftrain.parallel.launch import main_process_first, phase
from hftrain.pooling import pool
from hftrain.retrieval_eval import RetrievalEvaluation
from hftrain.run_parts import DataRun, TrainRun

# sentence-transformers' names of the pooling modes (1_Pooling/config.json's pooling_mode)
ST_POOLING = {"mean": "mean", "cls": "cls", "last_token": "lasttoken"}


def used_width(attention_mask: torch.Tensor) -> int:
    """The positions a forward over these rows runs (`EmbeddingLoss.embed`, `RerankerLoss.scores` cut the rest):
    those that are not padding in every row."""
    return int(attention_mask.bool().any(dim=0).sum())


class _GatherWithGradients(torch.autograd.Function):
    """All ranks' equal-shaped tensors concatenated in rank order; backward: the gradients every rank computed for
    this rank's rows, summed (an all-reduce of the whole gradient, then this rank's slice: public collectives that
    gloo and NCCL both have; torch.distributed.nn's all_gather is deprecated in torch 2.13)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        ctx.rows = len(tensor)
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, tensor.contiguous())
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous()
        dist.all_reduce(grad)
        start = dist.get_rank() * ctx.rows
        return grad[start:start + ctx.rows]


def gather(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` of every data-parallel rank, concatenated in rank order, with gradients flowing back to each owner
    (the local one included); the tensor itself when not distributed."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return tensor
    return _GatherWithGradients.apply(tensor)


def contrastive_losses(anchors: torch.Tensor, candidates: list[torch.Tensor], valid: torch.Tensor, scale: float,
                       symmetric: bool, across_ranks: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(each local anchor's loss, whether its positive scored highest), from normalised embeddings: `anchors`
    [b, d], `candidates` [positives, *negatives], each [b, d]; rows where `valid` is false (a short batch's filler)
    are neither anchors nor candidates. `across_ranks`: the candidates (and, symmetric, the anchors) of every rank."""
    b = len(anchors)
    offset = 0
    all_anchors, all_candidates, all_valid = anchors, candidates, valid
    if across_ranks:
        all_anchors = gather(anchors)
        all_candidates = [gather(column) for column in candidates]
        all_valid = gather(valid.to(anchors.dtype)).bool()
        offset = dist.get_rank() * b if len(all_anchors) > b else 0
    local = torch.arange(offset, offset + b, device=anchors.device)
    docs = torch.cat(all_candidates)
    scores = scale * anchors @ docs.T  # [b, n * columns]
    # a filler row's texts are no candidates (a finite fill: an all-filler micro-batch keeps finite gradients)
    lowest = torch.finfo(scores.dtype).min
    scores = scores.masked_fill(~all_valid.repeat(len(candidates))[None], lowest)
    positive = scores[torch.arange(b, device=anchors.device), local]
    log_z = torch.logsumexp(scores, dim=1)
    if symmetric:
        reverse = (scale * candidates[0] @ all_anchors.T).masked_fill(~all_valid[None], lowest)  # [b, n]
        log_z = (log_z + torch.logsumexp(reverse, dim=1)) / 2
    with torch.no_grad():
        best = (scores.argmax(dim=1) == local) & valid
    return torch.where(valid, log_z - positive, 0.0), best


class RowAccuracyLoss(ObjectiveLoss):
    """What the retrieval losses share: `forward` returns the sum of its rows' losses over the real (`valid`) rows,
    the loop divides by the step's real rows (`unit`), and the one statistic is each row's accuracy (embedding: the
    positive scores above every other candidate; reranker: the score's sign agrees with the label, or the positive
    ranks first)."""

    headline = ("loss", "accuracy")

    def __init__(self, lm: nn.Module):
        super().__init__(lm)
        self.stats = None

    def summed(self, losses: torch.Tensor, right: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """The real rows' summed loss; their count of right answers added to the statistics."""
        real = valid.to(losses.dtype)
        with torch.no_grad():
            stats = (right.to(real.dtype) @ real)[None]
            self.stats = stats if self.stats is None else self.stats + stats
        return (losses * real).sum()

    def loss_units(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return batch["valid"].sum()

    def pop_stats(self) -> dict[str, torch.Tensor]:
        stats, self.stats = self.stats, None
        return {} if stats is None else {"accuracy": stats.double()[0]}

    def eval_metrics(self, loss_sum: float, units: int, stats: dict[str, float]) -> dict[str, float]:
        return {"eval_loss": loss_sum / max(units, 1), f"eval_{self.unit}": int(units),
                **{f"eval_{name}": value / max(units, 1) for name, value in stats.items()}}


class EmbeddingLoss(RowAccuracyLoss):
    """The encoder `lm` (an AutoModel) whose `forward` returns the sum of the micro-batch's anchors' contrastive
    losses (the loop divides by the step's anchors)."""

    unit = "anchors"

    def __init__(self, lm: nn.Module, recipe: Recipe):
        super().__init__(lm)
        self.pooling, self.scale, self.symmetric = recipe.pooling, recipe.contrastive_scale, recipe.symmetric_loss
        self.mini_batch_size = recipe.mini_batch_size

    @property
    def loss_path(self) -> str:
        cached = (f"; cached: {self.mini_batch_size} texts per piece, recomputed in backward" if self.mini_batch_size
                  else "")
        return f"{self.pooling} pooling, normalised, in-batch negatives{cached}"

    def embed(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Normalised fp32 embeddings of the rows (sentence-transformers' Transformer -> Pooling -> Normalize). The
        positions that are padding in every row are cut first: the rows run at their own longest text's width, as
        sentence-transformers embeds each column padded to that column's longest text."""
        used = attention_mask.bool().any(dim=0)
        if not bool(used.all()):
            input_ids, attention_mask = input_ids[:, used], attention_mask[:, used]
        hidden = self.lm(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        return F.normalize(pool(hidden, attention_mask, self.pooling).float(), p=2, dim=-1)

    def embed_all(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, rows: int) -> torch.Tensor:
        """Every text's embedding, a column (`rows` texts: the anchors, the positives, each negative column) at a
        time: short queries are not padded to the passages' width. Cached mode (training): mini_batch_size texts at
        a time, each piece's activations dropped after its forward and recomputed in backward (the checkpoint
        replays the piece's random state)."""
        if not (self.mini_batch_size and self.training and torch.is_grad_enabled()):
            return torch.cat([self.embed(ids, mask) for ids, mask in zip(input_ids.split(rows),
                                                                         attention_mask.split(rows), strict=True)])
        pieces = zip(input_ids.split(self.mini_batch_size), attention_mask.split(self.mini_batch_size), strict=True)
        return torch.cat([torch.utils.checkpoint.checkpoint(self.embed, ids, mask, use_reentrant=False)
                          for ids, mask in pieces])

    def forward_shapes(self, batch: dict[str, torch.Tensor]) -> list[tuple[int, int]]:
        """A forward per column (`embed_all`), or per cached piece, each at its own longest text's width (the cached
        mode's recomputation in backward is not counted)."""
        rows = self.mini_batch_size if self.mini_batch_size and self.training else len(batch["valid"])
        return [(len(piece), used_width(piece)) for piece in batch["attention_mask"].split(rows)]

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, valid: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, embed_only: bool = False) -> torch.Tensor:
        """Rows: the b anchors, the b positives, then each negative column's b texts (`EmbeddingCollator`).
        `embed_only`: the rows' embeddings instead (retrieval metrics, called through the prepared model so that
        a sharded one gathers its weights as for the loss)."""
        if embed_only:
            return self.embed(input_ids, attention_mask)
        b = len(valid)
        embeddings = self.embed_all(input_ids, attention_mask, b)
        anchors, *candidates = embeddings.split(b)
        losses, best = contrastive_losses(anchors, candidates, valid, self.scale, self.symmetric,
                                          across_ranks=self.training)
        return self.summed(losses, best, valid)


def held_out(rows: list, percent: float, seed: int, name: str) -> tuple[list, list]:
    """(train, eval) rows: `percent` of them held out by a permutation seeded with `seed`."""
    n_eval = max(1, int(len(rows) * percent / 100))
    if n_eval >= len(rows):
        raise HftrainError(f"dataset {name!r} has {len(rows)} rows, too few to hold out {percent}% for evaluation")
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed)).tolist()
    evaluation = set(order[:n_eval])
    return [r for i, r in enumerate(rows) if i not in evaluation], [rows[i] for i in sorted(evaluation)]


def retrieval_data(run: DataRun, tokenize, collate, columns_words) -> TrainingData:
    """The data phase of objectives embedding and reranker: rows read (`data.retrieval.read_rows`) and tokenized
    (`tokenize(rows, name)`) before the model loads, the eval rows (eval_dataset_name, or validation_split_percentage
    held out with the order seed), the BatchPlan and the feed; `collate(data, pad id, padding side, train)` makes a
    collator, `columns_words(data)` says what a row holds."""
    recipe, tokenizer, world = run.recipe, run.tokenizer, run.dp.world
    if tokenizer.pad_token is None:  # sentence-transformers pads with the saved tokenizer's pad token
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.model_max_length = recipe.max_length  # saved: sentence-transformers truncates where training did
    with phase(run.accelerator, "data preparation", recipe.ddp_timeout), main_process_first(run.accelerator):
        rows = read_rows(recipe.dataset_name, recipe.dataset_config, recipe.dataset_train_split, recipe.dataset_columns)
        eval_rows, eval_name = None, recipe.eval_dataset_name
        if recipe.eval_dataset_name:
            eval_rows = read_rows(recipe.eval_dataset_name, recipe.dataset_config, recipe.eval_split,
                                  recipe.dataset_columns)
        elif recipe.validation_split_percentage > 0 and recipe.eval_strategy != "no":
            rows, eval_rows = held_out(rows, recipe.validation_split_percentage, recipe.order_seed, recipe.dataset_name)
            eval_name = f"{recipe.dataset_name} (held out)"
        if recipe.max_samples is not None:
            rows = rows[:recipe.max_samples]
        train = tokenize(rows, recipe.dataset_name)
        evaluation = None if eval_rows is None else tokenize(eval_rows, eval_name)
    if evaluation is not None and evaluation.columns != train.columns:
        raise HftrainError(f"the eval rows hold {columns_words(evaluation)}, the training rows {columns_words(train)}: "
                           "give both the same columns")
    plan = BatchPlan(len(train), recipe.per_device_train_batch_size, world, recipe.gradient_accumulation_steps,
                     recipe.order_seed, shuffle=recipe.train_sampling_strategy != "sequential")
    if len(train) < plan.global_batch:
        with same_in_every_process():
            raise HftrainError(f"the training set has {len(train)} rows, fewer than one global batch of "
                               f"{plan.global_batch} (per_device_train_batch_size x {world} processes x "
                               "gradient_accumulation_steps); use a smaller batch or more data")
    pad, side = tokenizer.pad_token_id, tokenizer.padding_side
    collator = collate(train, pad, side, True)
    eval_collator = None if evaluation is None else collate(evaluation, pad, side, False)
    feed = IndexedFeed(plan, collator, run.dp.rank, recipe.dataloader_num_workers, recipe.dataloader_pin_memory)
    stats = {"sources": [{"name": recipe.dataset_name, "rows": len(train)}], "columns": columns_words(train),
             "train_examples": len(train), "eval_examples": len(evaluation) if evaluation is not None else 0}
    line = (f"({plan.steps_per_epoch} per epoch)", f"{len(train)} training rows ({columns_words(train)})")
    return TrainingData(feed, plan, total_steps(recipe, plan), line, stats, train, evaluation, None, collator,
                        eval_collator)


def write_sentence_transformers_files(folder: Path, recipe: Recipe, dimension: int) -> None:
    """sentence-transformers 6's files of a folder whose root holds the encoder and tokenizer (what its
    SentenceTransformer.save writes for Transformer -> Pooling -> Normalize)."""
    def write(path: Path, value) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")

    write(folder / "modules.json", [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.base.modules.transformer.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.sentence_transformer.modules.pooling.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.base.modules.normalize.Normalize"},
    ])
    write(folder / "sentence_bert_config.json", {
        "transformer_task": "feature-extraction",
        "modality_config": {"text": {"method": "forward", "method_output_name": "last_hidden_state"}},
        "module_output_name": "token_embeddings"})
    write(folder / "1_Pooling" / "config.json", {"embedding_dimension": dimension,
                                                 "pooling_mode": ST_POOLING[recipe.pooling], "include_prompt": True})
    write(folder / "2_Normalize" / "config.json", {"module_input_name": "sentence_embedding",
                                                   "module_output_name": "sentence_embedding"})
    write(folder / "config_sentence_transformers.json", {
        "model_type": "SentenceTransformer", "prompts": {"query": recipe.query_prompt or "", "document": ""},
        "default_prompt_name": None, "similarity_fn_name": "cosine"})


class Embedding(Objective):
    """embedding: `EmbeddingLoss` around the AutoModel; data: `data.retrieval`."""

    name = "embedding"
    completes_eval_prompts = writes_text = False
    final_use = "encode queries and documents (sentence-transformers)"

    def setup_data(self, run: DataRun) -> TrainingData:
        """The contrastive rows (read, checked and tokenized before the model loads), the plan and the feed; every
        rank's micro-batch padded to per_device_train_batch_size rows (the gathered embeddings have one shape)."""
        recipe = run.recipe
        return retrieval_data(
            run, lambda rows, name: tokenize_rows(rows, run.tokenizer, recipe.max_length, recipe.query_prompt, name),
            lambda data, pad, side, train: EmbeddingCollator(
                data, pad, side, rows_per_batch=recipe.per_device_train_batch_size if train else None),
            lambda data: "anchor, positive" + (f", {data.columns - 2} negative" + "s" * (data.columns > 3)
                                               if data.columns > 2 else ""))

    def build_loss(self, recipe: Recipe, lm: nn.Module, device: torch.device,
                   copy_model: Callable[[nn.Module], nn.Module] = copy.deepcopy) -> EmbeddingLoss:
        return EmbeddingLoss(lm, recipe)

    def notes(self, run: TrainRun) -> list[str]:
        recipe = run.recipe
        loss = ("anchor -> candidates and positive -> anchors (symmetric_loss)" if recipe.symmetric_loss
                else "anchor -> candidates")
        world = run.dp.world
        across = (f", the candidates of all {world} data-parallel ranks gathered (gradients flow back to their owners)"
                  if world > 1 else "")
        accum = (f"; each of the {recipe.gradient_accumulation_steps} accumulated micro-batches is a contrastive "
                 "batch of its own" if recipe.gradient_accumulation_steps > 1 else "")
        prompt = f"; anchors prefixed with query_prompt {recipe.query_prompt!r}" if recipe.query_prompt else ""
        return [f"objective embedding: {recipe.pooling} pooling of {type(run.parts.loss.lm).__name__}'s last hidden "
                f"states, L2-normalised; MultipleNegativesRankingLoss (scale {recipe.contrastive_scale:g}, {loss}) "
                f"over the {recipe.per_device_train_batch_size * world} rows of each micro-batch{across}{accum}"
                f"{prompt}"]

    def eval_addons(self, run: DataRun) -> list:
        """retrieval_eval_dir: the retrieval metrics at each evaluation (its files read and checked now)."""
        return [RetrievalEvaluation(run.recipe, run.tokenizer)] if run.recipe.retrieval_eval_dir else []

    def add_files(self, run: TrainRun, folder: Path) -> None:
        """sentence-transformers' files beside the saved encoder and tokenizer."""
        lm = run.parts.loss.lm
        config = lm.config.get_text_config() if hasattr(lm.config, "get_text_config") else lm.config
        write_sentence_transformers_files(folder, run.recipe, config.hidden_size)
