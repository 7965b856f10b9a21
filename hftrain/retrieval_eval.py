"""Retrieval metrics of an embedding model on a local task (recipe `retrieval_eval_dir`, objective embedding): BEIR's
files, a folder with

- `queries.jsonl`: {"_id": ..., "text": ...} per line,
- `corpus.jsonl`: {"_id": ..., "text": ...} per line (a "title" is put before the text, as BEIR's loaders do),
- `qrels.tsv`: query-id, corpus-id, score (a header line; score > 0 marks a relevant document),

read and checked before the model loads (a bad line named by file and line). At each evaluation the live model
embeds every query (with `query_prompt`) and every document, ranks the corpus by cosine similarity, and the row gets
`eval_ndcg@10`, `eval_mrr@10` and `eval_recall@{1,5,10}` (binary relevance, sentence-transformers'
InformationRetrievalEvaluator's definitions), averaged over the queries that have a relevant document. Every rank
embeds the whole (small) set, so sharded models stay in step and every rank gets the same numbers.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import AutoModel, AutoTokenizer

from hftrain.errors import HftrainError
from hftrain.pooling import pool

if TYPE_CHECKING:  # hftrain.objectives imports this module (objective embedding's add-on)
    from hftrain.objectives.base import TrainRun

FILES = ("queries.jsonl", "corpus.jsonl", "qrels.tsv")
CUTOFFS = (1, 5, 10)


@dataclass(frozen=True)
class RetrievalSet:
    query_ids: list[str]
    queries: list[str]
    doc_ids: list[str]
    documents: list[str]
    relevant: list[set[int]]  # per query, the indices of its relevant documents


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
    for line, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        fields = raw.split("\t")
        if line == 1 and fields[0] == "query-id" or not raw.strip():
            continue
        if len(fields) != 3:
            raise HftrainError(f"{path}, line {line}: expected query-id, corpus-id and score separated by tabs")
        query, doc, score = fields
        if query not in query_index or doc not in doc_index:
            raise HftrainError(f"{path}, line {line}: {'query' if query not in query_index else 'document'} "
                               f"{(query if query not in query_index else doc)!r} is not in "
                               f"{'queries' if query not in query_index else 'corpus'}.jsonl")
        try:
            relevant_doc = float(score) > 0
        except ValueError:
            raise HftrainError(f"{path}, line {line}: score {score!r} is not a number") from None
        if relevant_doc:
            relevant[query_index[query]].add(doc_index[doc])
    if not any(relevant):
        raise HftrainError(f"{path} marks no relevant document (score > 0)")
    return RetrievalSet(query_ids, queries, doc_ids, documents, relevant)


def ranking_metrics(scores: torch.Tensor, relevant: list[set[int]]) -> dict[str, float]:
    """NDCG@10, MRR@10 and recall@k of each query's documents ranked by `scores` [queries, documents] (ties: the
    lower index first), averaged over the queries with a relevant document."""
    k_max = min(max(CUTOFFS), scores.shape[1])
    order = torch.sort(scores.float(), dim=1, descending=True, stable=True).indices[:, :k_max].tolist()
    sums = {"ndcg@10": 0.0, "mrr@10": 0.0, **{f"recall@{k}": 0.0 for k in CUTOFFS}}
    counted = 0
    for ranked, wanted in zip(order, relevant, strict=True):
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


def pad_texts(ids: list[list[int]], pad_id: int, side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids of texts right- or left-padded to the longest, and their attention mask."""
    width = max(len(row) for row in ids)
    input_ids = torch.full((len(ids), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for r, row in enumerate(ids):
        span = slice(width - len(row), width) if side == "left" else slice(0, len(row))
        input_ids[r, span], mask[r, span] = torch.tensor(row), 1
    return input_ids, mask


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
            input_ids, mask = pad_texts(ids[start:start + self.batch], self.pad_id, self.side)
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


# ------------------------------------------------------------------------------------ hftrain eval --retrieval
ST_POOLING_NAMES = {"mean": "mean", "cls": "cls", "lasttoken": "last_token"}


def load_encoder(folder: Path):
    """(encoder, tokenizer, pooling, query prompt) of an embedding model's folder as objective embedding writes it
    (sentence-transformers' files beside an AutoModel or a peft adapter), with transformers and peft alone."""
    pooling_file, config_file = folder / "1_Pooling" / "config.json", folder / "config_sentence_transformers.json"
    if not (folder / "modules.json").is_file() or not pooling_file.is_file():
        raise HftrainError(f"{folder} is not an embedding model's folder (no modules.json and 1_Pooling/config.json, "
                           "as objective embedding's final folder has): --retrieval ranks with an embedding model")
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


@torch.no_grad()
def evaluate_folder(folder: Path, task_dir: Path, batch_size: int = 32) -> dict[str, float]:
    """The retrieval metrics of an embedding model's folder on a BEIR-style task (the task checked first)."""
    task = load_retrieval_set(task_dir)
    encoder, tokenizer, pooling, prompt = load_encoder(folder)

    def embed(texts: list[str]) -> torch.Tensor:
        ids = tokenizer(texts, truncation=True)["input_ids"]
        pieces = []
        for start in range(0, len(ids), batch_size):
            input_ids, mask = pad_texts(ids[start:start + batch_size], tokenizer.pad_token_id, tokenizer.padding_side)
            hidden = encoder(input_ids=input_ids, attention_mask=mask).last_hidden_state
            pieces.append(torch.nn.functional.normalize(pool(hidden, mask, pooling).float(), dim=-1))
        return torch.cat(pieces)

    return ranking_metrics(embed([prompt + q for q in task.queries]) @ embed(task.documents).T, task.relevant)
