"""Retrieval metrics on a local task (recipe `retrieval_eval_dir`, objectives embedding and reranker): BEIR's files,
a folder with

- `queries.jsonl`: {"_id": ..., "text": ...} per line,
- `corpus.jsonl`: {"_id": ..., "text": ...} per line (a "title" is put before the text, as BEIR's loaders do),
- `qrels.tsv`: query-id, corpus-id, score (a header line; score > 0 marks a relevant document),
- optionally `candidates.tsv` (rerankers): query-id, corpus-id[, score] per line (a header line allowed), each
  query's documents to rerank, e.g. a first stage's top hits; without it a reranker scores the whole corpus,

read and checked before the model loads (a bad line named by file and line). At each evaluation the live model ranks
documents for every query: an embedding model embeds every query (with `query_prompt`) and every document and ranks
the corpus by cosine similarity; a reranker scores each (query, candidate) pair as training scores a pair and ranks
the candidates by score. The row gets `eval_ndcg@10`, `eval_mrr@10` and `eval_recall@{1,5,10}` (binary relevance,
the definitions of sentence-transformers' InformationRetrievalEvaluator and CrossEncoderRerankingEvaluator: a
relevant document that is no candidate counts as missed, the ideal DCG and recall count every relevant document),
averaged over the queries that have a relevant document. Every rank ranks the whole (small) set, so sharded models
stay in step and every rank gets the same numbers.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from hftrain.data.retrieval import pad_texts, pair_ids
from hftrain.errors import HftrainError
from hftrain.model import pad_token_id
from hftrain.pooling import pool
from hftrain.run_parts import TrainRun

FILES = ("queries.jsonl", "corpus.jsonl", "qrels.tsv")
CANDIDATES = "candidates.tsv"
CUTOFFS = (1, 5, 10)


@dataclass(frozen=True)
class RetrievalSet:
    query_ids: list[str]
    queries: list[str]
    doc_ids: list[str]
    documents: list[str]
    relevant: list[set[int]]  # per query, the indices of its relevant documents
    candidates: list[list[int]] | None = None  # per query, the documents a reranker scores (candidates.tsv)

    def reranked(self) -> list[list[int]]:
        """Per query, the documents a reranker scores: its candidates, or the whole corpus."""
        if self.candidates is not None:
            return self.candidates
        return [list(range(len(self.doc_ids))) for _ in self.query_ids]


def _texts(path: Path) -> tuple[list[str], list[str]]:
    ids, texts = [], []
    for line, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            row = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise HftrainError(f"{path}, line {line}: not JSON ({exc.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("_id"), (str, int)) or \
                not isinstance(row.get("text"), str) or not row["text"].strip():
            raise HftrainError(f"{path}, line {line}: each line must be an object with an _id and a non-empty text "
                               "(BEIR's format)")
        ids.append(str(row["_id"]))
        title = row.get("title")
        texts.append(f"{title} {row['text']}".strip() if isinstance(title, str) and title else row["text"])
    if len(set(ids)) != len(ids):
        raise HftrainError(f"{path}: an _id appears twice")
    return ids, texts


def _id_pairs(path: Path, query_index: dict[str, int], doc_index: dict[str, int], fields: tuple[int, ...],
              expected: str) -> list[tuple[int, int, int, list[str]]]:
    """(line number, query index, document index, the other fields) of each line of a tab-separated file that starts
    with a query id and a corpus id (a header line starting with query-id skipped), or an HftrainError naming the
    line."""
    pairs = []
    for line, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        values = raw.split("\t")
        if line == 1 and values[0] == "query-id" or not raw.strip():
            continue
        if len(values) not in fields:
            raise HftrainError(f"{path}, line {line}: expected {expected} separated by tabs")
        query, doc = values[:2]
        if query not in query_index or doc not in doc_index:
            raise HftrainError(f"{path}, line {line}: {'query' if query not in query_index else 'document'} "
                               f"{(query if query not in query_index else doc)!r} is not in "
                               f"{'queries' if query not in query_index else 'corpus'}.jsonl")
        pairs.append((line, query_index[query], doc_index[doc], values[2:]))
    return pairs


def load_retrieval_set(folder: str | Path) -> RetrievalSet:
    """The task of a BEIR-style folder, or an HftrainError naming the file and line that is wrong."""
    folder = Path(folder)
    missing = [name for name in FILES if not (folder / name).is_file()]
    if missing:
        raise HftrainError(f"retrieval_eval_dir {str(folder)!r} has no {', '.join(missing)}: it needs "
                           f"{', '.join(FILES)} (BEIR's files; docs/retrieval.md)")
    query_ids, queries = _texts(folder / "queries.jsonl")
    doc_ids, documents = _texts(folder / "corpus.jsonl")
    query_index, doc_index = {q: i for i, q in enumerate(query_ids)}, {d: i for i, d in enumerate(doc_ids)}
    relevant: list[set[int]] = [set() for _ in query_ids]
    path = folder / "qrels.tsv"
    for line, query, doc, (score,) in _id_pairs(path, query_index, doc_index, (3,), "query-id, corpus-id and score"):
        try:
            relevant_doc = float(score) > 0
        except ValueError:
            raise HftrainError(f"{path}, line {line}: score {score!r} is not a number") from None
        if relevant_doc:
            relevant[query].add(doc)
    if not any(relevant):
        raise HftrainError(f"{path} marks no relevant document (score > 0)")
    candidates = None
    if (folder / CANDIDATES).is_file():
        candidates = [[] for _ in query_ids]
        for _, query, doc, _ in _id_pairs(folder / CANDIDATES, query_index, doc_index, (2, 3),
                                       "query-id, corpus-id (and optionally a score)"):
            if doc not in candidates[query]:
                candidates[query].append(doc)
        if not any(candidates):
            raise HftrainError(f"{folder / CANDIDATES} names no (query, document) pair")
    return RetrievalSet(query_ids, queries, doc_ids, documents, relevant, candidates)


def ranking_metrics(scores: torch.Tensor, relevant: list[set[int]]) -> dict[str, float]:
    """NDCG@10, MRR@10 and recall@k of each query's documents ranked by `scores` [queries, documents] (ties: the
    lower index first), averaged over the queries with a relevant document."""
    k_max = min(max(CUTOFFS), scores.shape[1])
    return ranked_metrics(torch.sort(scores.float(), dim=1, descending=True, stable=True).indices[:, :k_max].tolist(),
                          relevant)


def reranking_metrics(scores: torch.Tensor, reranked: list[list[int]], relevant: list[set[int]]) -> dict[str, float]:
    """`ranked_metrics` of each query's documents `reranked[q]` ordered by their `scores` (one per pair, query after
    query; ties: the earlier document first)."""
    rankings = []
    for docs, part in zip(reranked, scores.float().split([len(docs) for docs in reranked]), strict=True):
        order = torch.sort(part, descending=True, stable=True).indices[:max(CUTOFFS)].tolist()
        rankings.append([docs[i] for i in order])
    return ranked_metrics(rankings, relevant)


def ranked_metrics(rankings: list[list[int]], relevant: list[set[int]]) -> dict[str, float]:
    """NDCG@10, MRR@10 and recall@k of each query's ranked documents (at least its first 10), averaged over the
    queries with a relevant document; a relevant document outside the ranking counts as missed (the ideal DCG and
    the recall's denominator count every relevant document)."""
    sums = {"ndcg@10": 0.0, "mrr@10": 0.0, **{f"recall@{k}": 0.0 for k in CUTOFFS}}
    counted = 0
    for ranked, wanted in zip(rankings, relevant, strict=True):
        if not wanted:
            continue
        counted += 1
        hits = [doc in wanted for doc in ranked]
        dcg = sum(1 / math.log2(rank + 2) for rank, hit in enumerate(hits[:10]) if hit)
        ideal = sum(1 / math.log2(rank + 2) for rank in range(min(len(wanted), 10)))
        sums["ndcg@10"] += dcg / ideal
        sums["mrr@10"] += next((1 / (rank + 1) for rank, hit in enumerate(hits[:10]) if hit), 0.0)
        for k in CUTOFFS:
            sums[f"recall@{k}"] += sum(hits[:k]) / len(wanted)
    return {name: value / counted for name, value in sums.items()}


class RetrievalEvaluation:
    """An evaluation add-on of objective embedding (`Objective.eval_addons`): the retrieval metrics of the live
    embedding model."""

    def __init__(self, recipe, tokenizer):
        self.task = load_retrieval_set(recipe.retrieval_eval_dir)
        prompt = recipe.query_prompt or ""
        encode = lambda texts: tokenizer(texts, truncation=True, max_length=recipe.max_length)["input_ids"]  # noqa: E731
        self.query_ids = encode([prompt + q for q in self.task.queries])
        self.doc_ids = encode(self.task.documents)
        self.pad_id, self.side, self.batch = tokenizer.pad_token_id, tokenizer.padding_side, \
            recipe.per_device_eval_batch_size

    @torch.no_grad()
    def embed(self, model, ids: list[list[int]], device) -> torch.Tensor:
        pieces = []
        for start in range(0, len(ids), self.batch):
            input_ids, mask, _ = pad_texts(ids[start:start + self.batch], self.pad_id, self.side)
            pieces.append(model(input_ids=input_ids.to(device), attention_mask=mask.to(device), embed_only=True))
        return torch.cat(pieces)

    def __call__(self, run: TrainRun) -> dict[str, float]:
        model, device = run.model, run.accelerator.device
        model.eval()
        try:
            queries, documents = self.embed(model, self.query_ids, device), self.embed(model, self.doc_ids, device)
        finally:
            model.train()
        metrics = ranking_metrics(queries @ documents.T, self.task.relevant)
        return {f"eval_{name}": value for name, value in metrics.items()}


def task_pairs(task: RetrievalSet, tokenizer, max_length: int, template: str | None) -> list[list[int]]:
    """The token ids of every (query, reranked document) pair, query after query, as the reranker trains on a pair."""
    reranked = task.reranked()
    queries = [task.queries[q] for q, docs in enumerate(reranked) for _ in docs]
    return pair_ids(tokenizer, queries, [task.documents[d] for docs in reranked for d in docs], max_length, template)


@torch.no_grad()
def pair_scores(score, ids: list[list[int]], pad_id: int, side: str, batch: int, device=None) -> torch.Tensor:
    """One score per pair: `score(input_ids, attention_mask)` over batches of `batch` padded pairs."""
    pieces = []
    for start in range(0, len(ids), batch):
        input_ids, mask, _ = pad_texts(ids[start:start + batch], pad_id, side)
        pieces.append(score(input_ids.to(device), mask.to(device)).float())
    return torch.cat(pieces)


class RerankingEvaluation:
    """An evaluation add-on of objective reranker: every query's candidates (or the whole corpus) scored by the live
    reranker, pair by pair as training scores them (the yes/no form left-padded), and ranked by score."""

    def __init__(self, recipe, tokenizer, template: str | None):
        self.task = load_retrieval_set(recipe.retrieval_eval_dir)
        self.ids = task_pairs(self.task, tokenizer, recipe.max_length, template)
        self.pad_id, self.batch = tokenizer.pad_token_id, recipe.per_device_eval_batch_size
        self.side = "left" if template is not None else tokenizer.padding_side

    def __call__(self, run: TrainRun) -> dict[str, float]:
        model = run.model
        model.eval()
        try:
            scores = pair_scores(lambda ids, mask: model(input_ids=ids, attention_mask=mask, scores_only=True),
                                 self.ids, self.pad_id, self.side, self.batch, run.accelerator.device)
        finally:
            model.train()
        metrics = reranking_metrics(scores.cpu(), self.task.reranked(), self.task.relevant)
        return {f"eval_{name}": value for name, value in metrics.items()}


# ------------------------------------------------------------------------------------ hftrain eval --retrieval
ST_POOLING_NAMES = {"mean": "mean", "cls": "cls", "lasttoken": "last_token"}


def load_encoder(folder: Path):
    """(encoder, tokenizer, pooling, query prompt) of an embedding model's folder as objective embedding writes it
    (sentence-transformers' files beside an AutoModel or a peft adapter), with transformers and peft alone."""
    pooling_file, config_file = folder / "1_Pooling" / "config.json", folder / "config_sentence_transformers.json"
    if not (folder / "modules.json").is_file() or not pooling_file.is_file():
        raise HftrainError(f"{folder} is neither an embedding model's folder (modules.json and 1_Pooling/config.json, "
                           "as objective embedding's final folder has) nor a reranker's (a CrossEncoder's "
                           "config_sentence_transformers.json): --retrieval ranks with one of them")
    mode = json.loads(pooling_file.read_text(encoding="utf-8")).get("pooling_mode")
    if mode not in ST_POOLING_NAMES:
        raise HftrainError(f"{pooling_file}: pooling_mode {mode!r} is not one hftrain computes (mean, cls, lasttoken)")
    prompts = json.loads(config_file.read_text(encoding="utf-8")).get("prompts", {}) if config_file.is_file() else {}
    if (folder / "adapter_config.json").is_file():
        from peft import PeftModel  # optional heavy: peft imports bitsandbytes

        base = json.loads((folder / "adapter_config.json").read_text(encoding="utf-8"))["base_model_name_or_path"]
        encoder = PeftModel.from_pretrained(AutoModel.from_pretrained(base), str(folder))
    else:
        encoder = AutoModel.from_pretrained(folder)
    return encoder.eval(), AutoTokenizer.from_pretrained(folder), ST_POOLING_NAMES[mode], prompts.get("query") or ""


def is_reranker_folder(folder: Path) -> bool:
    config = folder / "config_sentence_transformers.json"
    return config.is_file() and json.loads(config.read_text(encoding="utf-8")).get("model_type") == "CrossEncoder"


def pair_score(lm: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
               yes_no: tuple[int, int] | None = None) -> torch.Tensor:
    """One score per (query, passage) pair (float32) of a reranker's model: a one-output classifier's output, or, for
    the yes/no form (`yes_no`: the two token ids), logit(yes) - logit(no) at the last position of a left-padded row."""
    if yes_no is None:
        return lm(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits.float()[:, 0]
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    logits = lm(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, logits_to_keep=1,
                use_cache=False).logits[:, -1].float()
    return logits[:, yes_no[0]] - logits[:, yes_no[1]]


def load_reranker(folder: Path):
    """(the score of a batch of pairs, tokenizer, the yes/no form's prompt or None) of a reranker's folder as
    objective reranker writes it, with transformers (and peft, for an adapter) alone: a one-output sequence
    classifier, or a causal LM with a `1_LogitScore` (its prompt read back from the folder's chat template, which
    renders a pair as the template)."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    logit_score = folder / "1_LogitScore" / "config.json"
    auto = AutoModelForCausalLM if logit_score.is_file() else AutoModelForSequenceClassification
    labels = {} if logit_score.is_file() else {"num_labels": 1}
    if (folder / "adapter_config.json").is_file():
        from peft import PeftModel  # optional heavy: peft imports bitsandbytes

        base = json.loads((folder / "adapter_config.json").read_text(encoding="utf-8"))["base_model_name_or_path"]
        model = PeftModel.from_pretrained(auto.from_pretrained(base, **labels), str(folder))
        model.config.pad_token_id = pad_token_id(tokenizer)  # the base's config lacks what training set
    else:
        model = auto.from_pretrained(folder)
    if not logit_score.is_file():
        return functools.partial(pair_score, model.eval()), tokenizer, None
    tokens = json.loads(logit_score.read_text(encoding="utf-8"))
    scorer = functools.partial(pair_score, model.eval(), yes_no=(tokens["true_token_id"], tokens["false_token_id"]))
    template = tokenizer.apply_chat_template([{"role": "query", "content": "{query}"},
                                              {"role": "document", "content": "{document}"}], tokenize=False)
    return scorer, tokenizer, template


@torch.no_grad()
def evaluate_folder(folder: Path, task_dir: Path, batch_size: int = 32) -> dict[str, float]:
    """The retrieval metrics of an embedding model's or a reranker's folder on a BEIR-style task (the task checked
    first)."""
    task = load_retrieval_set(task_dir)
    if is_reranker_folder(folder):
        score, tokenizer, template = load_reranker(folder)
        ids = task_pairs(task, tokenizer, tokenizer.model_max_length, template)
        side = "left" if template is not None else tokenizer.padding_side
        scores = pair_scores(score, ids, tokenizer.pad_token_id, side, batch_size)
        return reranking_metrics(scores, task.reranked(), task.relevant)
    encoder, tokenizer, pooling, prompt = load_encoder(folder)

    def embed(texts: list[str]) -> torch.Tensor:
        ids = tokenizer(texts, truncation=True)["input_ids"]
        pieces = []
        for start in range(0, len(ids), batch_size):
            input_ids, mask, _ = pad_texts(ids[start:start + batch_size], tokenizer.pad_token_id,
                                           tokenizer.padding_side)
            hidden = encoder(input_ids=input_ids, attention_mask=mask).last_hidden_state
            pieces.append(torch.nn.functional.normalize(pool(hidden, mask, pooling).float(), dim=-1))
        return torch.cat(pieces)

    return ranking_metrics(embed([prompt + q for q in task.queries]) @ embed(task.documents).T, task.relevant)
