"""Rerankers (recipe `objective: reranker`): a cross-encoder scoring (query, passage) pairs, as sentence-transformers
6's CrossEncoder losses (cross_encoder/losses/).

Two heads score a pair (`reranker_head`):

- classifier: the base loaded as `AutoModelForSequenceClassification` with one output (`model.load_as_reward_model`:
  the body plus a new `score` head, read at each pair's last real token, `config.pad_token_id` the collator's pad
  id), each pair tokenized as the CrossEncoder tokenizes plain text pairs: tokenizer(query, passage);
- yes_no (the Qwen3-Reranker form): the causal LM itself (`AutoModelForCausalLM`) reads `reranker_template` filled
  with the pair (`data.retrieval.templated_pairs`), left-padded, position ids counting real tokens only (so a pair
  scores as it does alone); the score is logit("yes") - logit("no") at the last position, whose sigmoid is P(yes)
  of the softmax over the two (sentence-transformers' LogitScore with its Sigmoid activation).

The data decides the loss
(`data.retrieval.pair_texts`), each row's loss summed and the loop dividing by the step's rows:

- labelled pairs (query, passage, label in [0, 1]): binary cross-entropy on the score's logit
  (BinaryCrossEntropyLoss: BCEWithLogits, no pos_weight);
- ranked rows (query, positive, negative...): listwise cross-entropy, the positive's score against its hard
  negatives' (CrossEncoder MultipleNegativesRankingLoss with num_negatives=0, activation_fn=None, scale=1):
  loss = -score(q, p) + log(exp score(q, p) + sum_n exp score(q, n)).

Each row's pairs are its own (no in-batch negatives), so accumulation and data parallelism are exact (the loop's
sum over rows), and a training micro-batch is scored in two forwards, its shorter and its longer half of pairs, each
at its own longest pair's width (`RerankerLoss.halves_scores`: less padding than one forward at the longest
pair's). The final folder is a CrossEncoder's (modules.json with its Transformer in sequence-classification
form, plain text input; config_sentence_transformers.json with the Sigmoid CrossEncoder.predict applies) that
transformers' AutoModelForSequenceClassification loads too; the yes/no reranker's folder is the causal LM
(AutoModelForCausalLM loads it) with a CrossEncoder's Transformer (text-generation) and LogitScore, and a chat
template that renders a (query, document) pair as `reranker_template` does. With `retrieval_eval_dir` each
evaluation reranks a local task's candidates with the live model (`retrieval_eval.RerankingEvaluation`: each pair
scored by `RerankerLoss.scores`, as in training).
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
from hftrain.errors import HftrainError
from hftrain.model import build_tokenizer, pad_token_id
from hftrain.objectives.base import Objective
from hftrain.objectives.embedding import RowAccuracyLoss, retrieval_data, used_width
from hftrain.retrieval_eval import RerankingEvaluation, pair_score
from hftrain.run_parts import DataRun, ModelRun, TrainRun

YES_NO = ("yes", "no")


def yes_no_token_ids(tokenizer, model: str) -> tuple[int, int]:
    """The ids of the tokens "yes" and "no" (as Qwen3-Reranker's code and sentence-transformers' CrossEncoder
    look them up), or an HftrainError when either is not one token of the vocabulary."""
    ids, wrong = [], []
    for token in YES_NO:
        token_id = tokenizer.convert_tokens_to_ids(token)
        encoded = tokenizer(token, add_special_tokens=False)["input_ids"]
        if token_id is None or token_id == tokenizer.unk_token_id or encoded != [token_id]:
            wrong.append(f"{token!r} is encoded as {len(encoded)} tokens {encoded}")
        ids.append(token_id)
    if wrong:
        raise HftrainError(
            f"reranker_head yes_no scores a pair by the logits of the tokens 'yes' and 'no' at the last position (the "
            f"Qwen3-Reranker form), but the tokenizer of {model} has no single token for them: "
            f"{'; '.join(wrong)}. Use a model whose vocabulary holds both (Qwen3, Qwen2.5, Llama 3...), or "
            "reranker_head: classifier (a new score head, any tokenizer).")
    return ids[0], ids[1]


def halves(attention_mask: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(the pairs ordered by length, [the shorter half's indices, the longer half's]); a lone pair is both halves."""
    order = torch.argsort(attention_mask.sum(dim=-1), stable=True)
    half = (len(order) + 1) // 2
    return order, [order[:half], order[half:] if len(order) > 1 else order]


class RerankerLoss(RowAccuracyLoss):
    """The reranker `lm` whose `forward` returns the sum of the micro-batch's rows' losses: a one-output sequence
    classifier, or (`yes_no`: the ids of "yes" and "no") a causal LM fed left-padded pairs."""

    unit = "rows"

    def __init__(self, lm: nn.Module, yes_no: tuple[int, int] | None = None):
        super().__init__(lm)
        self.head_only = False  # the model's own forward: its score head and pooling
        self.yes_no = yes_no

    def scores(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """One score per pair (float32): the classifier's output, or logit(yes) - logit(no) at the last position; the
        positions that are padding in every pair are cut first (the pairs run at their own longest pair's width)."""
        used = attention_mask.bool().any(dim=0)
        if not bool(used.all()):
            input_ids, attention_mask = input_ids[:, used], attention_mask[:, used]
        return pair_score(self.lm, input_ids, attention_mask, self.yes_no)

    def halves_scores(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """`scores` of a training micro-batch in two forwards: the shorter half of its pairs, then the longer half,
        each at its own longest pair's width, so that short pairs are not padded to the longest of the micro-batch
        (each pair's score is its own: the loss and gradients are those of one forward). Always two forwards, so
        that every rank of a sharded model gathers its weights as often; a lone pair is scored twice, the second
        weighted 0."""
        order, parts = halves(attention_mask)
        scores = [self.scores(input_ids[part], attention_mask[part]) for part in parts]
        if len(order) == 1:
            return scores[0] + 0 * scores[1].sum()
        return torch.cat(scores)[torch.argsort(order)]

    def forward_shapes(self, batch: dict[str, torch.Tensor]) -> list[tuple[int, int]]:
        """The two halves' forwards (`halves_scores`), each at its own longest pair's width."""
        mask = batch["attention_mask"]
        return [(len(part), used_width(mask[part])) for part in halves(mask)[1]]

    @property
    def loss_path(self) -> str:
        return "one score per (query, passage) pair"

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, valid: torch.Tensor | None = None,
                targets: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                scores_only: bool = False) -> torch.Tensor:
        """Rows of pairs row after row (`RerankerCollator`); `targets`: labelled pairs' labels, else ranked rows.
        `scores_only`: each pair's score instead (retrieval metrics, called through the prepared model so that a
        sharded one gathers its weights as for the loss)."""
        if scores_only:
            return self.scores(input_ids, attention_mask)
        scores = self.halves_scores(input_ids, attention_mask).reshape(len(valid), -1)
        if targets is not None:
            losses = F.binary_cross_entropy_with_logits(scores[:, 0], targets.to(scores.dtype), reduction="none")
            right = (scores[:, 0] > 0) == (targets >= 0.5)
        else:
            losses = torch.logsumexp(scores, dim=1) - scores[:, 0]
            right = scores.argmax(dim=1) == 0
        return self.summed(losses, right, valid)


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


def pair_chat_template(template: str) -> str:
    """A jinja chat template rendering a (query, document) message pair (sentence-transformers' pair roles) as
    `template` fills it; the fixed text is emitted as jinja string literals."""
    start, end = template.index("{query}"), template.index("{document}")

    def literal(text: str) -> str:
        return "{{ " + json.dumps(text, ensure_ascii=False) + " }}" if text else ""

    def role(name: str) -> str:
        return ('{{ messages | selectattr("role", "eq", "' + name + '") | map(attribute="content") | first }}')
    return (literal(template[:start]) + role("query") + literal(template[start + len("{query}"):end])
            + role("document") + literal(template[end + len("{document}"):]))


def write_yes_no_cross_encoder_files(folder: Path, template: str, yes_no: tuple[int, int]) -> None:
    """sentence-transformers 6's files of a CrossEncoder on a causal LM: its Transformer (text-generation, a pair
    as query/document messages through the chat template) and LogitScore (logit yes - logit no), Sigmoid on top;
    the chat template written as chat_template.jinja (transformers reads it with the tokenizer)."""
    def write(path: Path, value) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")

    write(folder / "modules.json", [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.base.modules.transformer.Transformer"},
        {"idx": 1, "name": "1", "path": "1_LogitScore",
         "type": "sentence_transformers.cross_encoder.modules.logit_score.LogitScore"}])
    write(folder / "sentence_bert_config.json", {
        "transformer_task": "text-generation",
        "modality_config": {"text": {"method": "forward", "method_output_name": "logits"},
                            "message": {"method": "forward", "method_output_name": "logits", "format": "flat"}},
        "module_output_name": "causal_logits"})
    write(folder / "1_LogitScore" / "config.json", {"true_token_id": yes_no[0], "false_token_id": yes_no[1],
                                                     "module_input_name": "causal_logits"})
    write(folder / "config_sentence_transformers.json", {
        "model_type": "CrossEncoder", "activation_fn": "torch.nn.modules.activation.Sigmoid", "prompts": {},
        "default_prompt_name": None})
    (folder / "chat_template.jinja").write_text(pair_chat_template(template), encoding="utf-8")


class Reranker(Objective):
    """reranker: `RerankerLoss` around the one-output sequence classifier; data: `data.retrieval`."""

    name = "reranker"
    completes_eval_prompts = writes_text = False
    final_use = "score (query, passage) pairs (sentence-transformers' CrossEncoder)"

    def setup_data(self, run: DataRun) -> TrainingData:
        """The pairs tokenized; with reranker_head yes_no the tokenizer's "yes" and "no" checked first (before the
        model loads) and the pairs filled into reranker_template, left-padded (the score is read at the last
        position)."""
        recipe = run.recipe
        yes_no = recipe.reranker_head == "yes_no"
        if yes_no:
            yes_no_token_ids(run.tokenizer, recipe.tokenizer_name_or_path or recipe.model_name_or_path)
        template = recipe.reranker_template if yes_no else None
        return retrieval_data(
            run, lambda rows, name: tokenize_pairs(rows, run.tokenizer, recipe.max_length, name, template),
            lambda data, pad, side, train: RerankerCollator(data, pad, "left" if yes_no else side),
            lambda data: "query, passage, label" if data.labels is not None else
            f"query, positive, {data.columns - 1} negative" + "s" * (data.columns > 2))

    def build_loss(self, recipe: Recipe, lm: nn.Module, device: torch.device,
                   copy_model: Callable[[nn.Module], nn.Module] = copy.deepcopy) -> RerankerLoss:
        if recipe.reranker_head == "classifier":
            return RerankerLoss(lm)
        name = recipe.tokenizer_name_or_path or recipe.model_name_or_path
        return RerankerLoss(lm, yes_no_token_ids(build_tokenizer(recipe), name))

    def prepare(self, run: ModelRun) -> None:
        """The classifier reads each score at the last token that is not `config.pad_token_id`: the collator's pad
        id (saved with the folder, so that CrossEncoder pools as training did)."""
        if run.recipe.reranker_head != "classifier":
            return None
        config = run.parts.loss.lm.config
        config.get_text_config().pad_token_id = config.pad_token_id = pad_token_id(run.tokenizer)
        return None

    def notes(self, run: TrainRun) -> list[str]:
        data = run.data.train_set
        loss = ("binary cross-entropy on each labelled pair's score" if data.labels is not None else
                f"listwise cross-entropy of each query's positive against its {data.columns - 1} hard negative"
                + "s" * (data.columns > 2))
        head = (f"a new score head (num_labels 1) on {type(run.parts.loss.lm).__name__}"
                if run.recipe.reranker_head == "classifier" else
                f"logit('yes') - logit('no') of {type(run.parts.loss.lm).__name__} at the last position of "
                "reranker_template (Qwen3-Reranker's form)")
        return [f"objective reranker: {head}; {loss}, the mean over the step's rows"]

    def eval_addons(self, run: DataRun) -> list:
        """retrieval_eval_dir: each query's candidates (or the whole corpus) reranked by the live model at each
        evaluation (its files read and checked, the pairs tokenized, now)."""
        recipe = run.recipe
        if not recipe.retrieval_eval_dir:
            return []
        template = recipe.reranker_template if recipe.reranker_head == "yes_no" else None
        return [RerankingEvaluation(recipe, run.tokenizer, template)]

    def add_files(self, run: TrainRun, folder: Path) -> None:
        if run.recipe.reranker_head == "classifier":
            write_cross_encoder_files(folder)
        else:
            write_yes_no_cross_encoder_files(folder, run.recipe.reranker_template, run.parts.loss.yes_no)
