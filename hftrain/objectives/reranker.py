"""Rerankers (recipe `objective: reranker`): a cross-encoder scoring (query, passage) pairs, as sentence-transformers
6's CrossEncoder losses (cross_encoder/losses/).

The base is loaded as `AutoModelForSequenceClassification` with one output (`model.load_as_reward_model`: the body
plus a new `score` head, read at each pair's last real token, `config.pad_token_id` the collator's pad id), each
pair tokenized as the CrossEncoder tokenizes plain text pairs: tokenizer(query, passage). The data decides the loss
(`data.retrieval.pair_texts`), each row's loss summed and the loop dividing by the step's rows:

- labelled pairs (query, passage, label in [0, 1]): binary cross-entropy on the score's logit
  (BinaryCrossEntropyLoss: BCEWithLogits, no pos_weight);
- ranked rows (query, positive, negative...): listwise cross-entropy, the positive's score against its hard
  negatives' (CrossEncoder MultipleNegativesRankingLoss with num_negatives=0, activation_fn=None, scale=1):
  loss = -score(q, p) + log(exp score(q, p) + sum_n exp score(q, n)).

Each row's pairs are its own (no in-batch negatives), so accumulation and data parallelism are exact (the loop's
sum over rows). The final folder is a CrossEncoder's (modules.json with its Transformer in sequence-classification
form, plain text input; config_sentence_transformers.json with the Sigmoid CrossEncoder.predict applies) that
transformers' AutoModelForSequenceClassification loads too. The Qwen3-Reranker form (a decoder's yes/no logits)
is not here yet.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from hftrain.config import Recipe
from hftrain.data.feeds import TrainingData
from hftrain.data.retrieval import RerankerCollator, tokenize_pairs
from hftrain.loss import ObjectiveLoss
from hftrain.model import pad_token_id
from hftrain.objectives.base import Objective
from hftrain.objectives.embedding import retrieval_data

RERANKER_STATS = ("accuracy",)  # labelled: the score's sign agrees with label >= 0.5; ranked: the positive first


class RerankerLoss(ObjectiveLoss):
    """The sequence classifier `lm` whose `forward` returns the sum of the micro-batch's rows' losses."""

    unit = "rows"
    headline = ("loss", "accuracy")

    def __init__(self, lm: nn.Module):
        super().__init__(lm)
        self.head_only = False  # the model's own forward: its score head and pooling
        self.stats = None

    @property
    def loss_path(self) -> str:
        return "one score per (query, passage) pair"

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, valid: torch.Tensor,
                targets: torch.Tensor | None = None, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Rows of pairs row after row (`RerankerCollator`); `targets`: labelled pairs' labels, else ranked rows."""
        scores = self.lm(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits.float()
        scores = scores.reshape(len(valid), -1)
        if targets is not None:
            losses = F.binary_cross_entropy_with_logits(scores[:, 0], targets.to(scores.dtype), reduction="none")
            right = (scores[:, 0] > 0) == (targets >= 0.5)
        else:
            losses = torch.logsumexp(scores, dim=1) - scores[:, 0]
            right = scores.argmax(dim=1) == 0
        real = valid.to(losses.dtype)
        with torch.no_grad():
            stats = (right.to(real.dtype) @ real)[None]
            self.stats = stats if self.stats is None else self.stats + stats
        return (losses * real).sum()

    def loss_units(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return batch["valid"].sum()

    def pop_stats(self) -> dict[str, torch.Tensor]:
        stats, self.stats = self.stats, None
        return {} if stats is None else dict(zip(RERANKER_STATS, stats.double()))

    def eval_metrics(self, loss_sum: float, units: int, stats: dict[str, float]) -> dict[str, float]:
        return {"eval_loss": loss_sum / max(units, 1), "eval_rows": int(units),
                **{f"eval_{name}": value / max(units, 1) for name, value in stats.items()}}


def write_cross_encoder_files(folder: Path) -> None:
    """sentence-transformers 6's files of a CrossEncoder folder whose root holds the sequence classifier."""
    def write(path: Path, value) -> None:
        path.write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")

    write(folder / "modules.json", [{"idx": 0, "name": "0", "path": "",
                                     "type": "sentence_transformers.base.modules.transformer.Transformer"}])
    write(folder / "sentence_bert_config.json", {
        "transformer_task": "sequence-classification",
        "modality_config": {"text": {"method": "forward", "method_output_name": "logits"}},
        "module_output_name": "scores"})
    write(folder / "config_sentence_transformers.json", {
        "model_type": "CrossEncoder", "activation_fn": "torch.nn.modules.activation.Sigmoid", "prompts": {},
        "default_prompt_name": None})


class Reranker(Objective):
    """reranker: `RerankerLoss` around the one-output sequence classifier; data: `data.retrieval`."""

    name = "reranker"
    completes_eval_prompts = writes_text = False
    final_use = "score (query, passage) pairs (sentence-transformers' CrossEncoder)"

    def setup_data(self, run) -> TrainingData:
        recipe = run.recipe
        return retrieval_data(
            run, lambda rows, name: tokenize_pairs(rows, run.tokenizer, recipe.max_length, name),
            lambda data, pad, side, train: RerankerCollator(data, pad, side),
            lambda data: "query, passage, label" if data.labels is not None else
            f"query, positive, {data.columns - 1} negative" + "s" * (data.columns > 2))

    def build_loss(self, recipe: Recipe, lm: nn.Module, device: torch.device,
                   copy_model: Callable[[nn.Module], nn.Module] = copy.deepcopy) -> RerankerLoss:
        return RerankerLoss(lm)

    def prepare(self, run) -> None:
        """The model reads each score at the last token that is not `config.pad_token_id`: the collator's pad id
        (saved with the folder, so that CrossEncoder pools as training did)."""
        config = run.parts.loss.lm.config
        config.get_text_config().pad_token_id = config.pad_token_id = pad_token_id(run.tokenizer)
        return None

    def notes(self, run) -> list[str]:
        data = run.data.train_set
        loss = ("binary cross-entropy on each labelled pair's score" if data.labels is not None else
                f"listwise cross-entropy of each query's positive against its {data.columns - 1} hard negative"
                + "s" * (data.columns > 2))
        return [f"objective reranker: a new score head (num_labels 1) on {type(run.parts.loss.lm).__name__}; {loss}, "
                "the mean over the step's rows"]

    def add_files(self, run, folder: Path) -> None:
        write_cross_encoder_files(folder)
