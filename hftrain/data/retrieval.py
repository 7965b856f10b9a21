"""objective embedding's data: (anchor, positive[, negative...]) rows, sentence-transformers' column names.

A row is a JSON object with `anchor` and `positive` texts and optionally `negative`: one hard-negative text or a list
of them; every row of a dataset has the same number of negatives (a contrastive batch is columns of equal length, as
in sentence-transformers). `dataset_columns` renames columns first (e.g. {query: anchor, document: positive}). A
`.jsonl` file is read line by line here, so a bad row is named by file and line; other sources (a `.json`/`.csv`/
`.parquet` file, a saved folder, a hub id) through `datasets`, a bad row named by its row number.

Each text is tokenized as sentence-transformers' Transformer module does (the tokenizer's own special tokens,
truncation at max_length, no padding here; `EmbeddingCollator` pads a micro-batch on the tokenizer's padding side),
the anchor with the recipe's `query_prompt` in front.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from hftrain.data.jsonlines import BAD_LINE, parse_line
from hftrain.data.sources import load_raw
from hftrain.data.tokenize import IGNORE_INDEX
from hftrain.errors import HftrainError

COLUMNS = ("anchor", "positive", "negative")


def read_rows(name: str, config: str | None, split: str, columns: dict[str, str]) -> list[tuple[str, dict]]:
    """(where, row) of every row of a dataset: `where` names the file and line (a .jsonl file) or the row number."""
    path = Path(name).expanduser()
    if path.is_file() and path.suffix.lower() == ".jsonl":
        rows = []
        with open(path, "rb") as f:
            for line, text in enumerate(f, start=1):
                if not text.strip():
                    continue
                row = parse_line(text, str(path), line, columns)
                if BAD_LINE in row:
                    raise HftrainError(f"{row[BAD_LINE]}; each line must be one JSON object with anchor and "
                                       "positive texts (and optionally negative)")
                rows.append((f"{path}, line {line}", row))
        return rows
    raw = load_raw(name, config, split)
    return [(f"dataset {name!r}, row {i}", {columns.get(k, k): v for k, v in row.items()})
            for i, row in enumerate(raw)]


def row_texts(row: dict, where: str) -> list[str]:
    """[anchor, positive, *negatives] of a row, or an HftrainError naming the row and what is wrong."""
    has = ", ".join(repr(k) for k, v in row.items() if v is not None) or "no field with a value"
    for column in ("anchor", "positive"):
        if row.get(column) is None:
            raise HftrainError(f"{where}: the row has no {column!r} field (or it is null): objective embedding "
                               f"trains on anchor, positive and optionally negative texts; it has {has}. Rename "
                               "columns with dataset_columns, e.g. {query: anchor, document: positive}")
    negatives = row.get("negative")
    negatives = [] if negatives is None else [negatives] if isinstance(negatives, str) else negatives
    if not isinstance(negatives, list):
        raise HftrainError(f"{where}: negative must be a text or a list of texts, got {type(negatives).__name__}")
    texts = [row["anchor"], row["positive"], *negatives]
    for i, text in enumerate(texts):
        column = COLUMNS[min(i, 2)] + (f" {i - 1}" if i >= 2 and len(negatives) > 1 else "")
        if not isinstance(text, str) or not text.strip():
            raise HftrainError(f"{where}: {column} must be a non-empty text, got {text!r:.60}")
    return texts


@dataclass(frozen=True)
class TextRows:
    """A tokenized dataset of contrastive rows: `ids[i][c]` the token ids of row i's column c (anchor, positive,
    negatives...). `len()` is what a BatchPlan counts."""

    ids: list[list[list[int]]]
    columns: int  # 2 + negatives per row
    where: list[str]

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def column_names(self) -> list[str]:
        return ["anchor", "positive", *[f"negative_{i + 1}" for i in range(self.columns - 2)]]


def tokenize_rows(rows: list[tuple[str, dict]], tokenizer, max_length: int, query_prompt: str | None,
                  name: str) -> TextRows:
    """Every row's texts checked and tokenized; refuses rows whose number of negatives differs from the first's."""
    if not rows:
        raise HftrainError(f"dataset {name!r} has no rows")
    texts, where, columns = [], [], None
    for place, row in rows:
        row_columns = row_texts(row, place)
        if columns is None:
            columns, first = len(row_columns), place
        elif len(row_columns) != columns:
            raise HftrainError(f"{place}: the row has {len(row_columns) - 2} negatives, the first row ({first}) "
                               f"{columns - 2}: every row of a contrastive batch needs the same number of negatives "
                               "(sentence-transformers' columns); give every row as many, or none")
        texts.append(row_columns)
        where.append(place)
    prefix = query_prompt or ""
    flat = [prefix + r[0] if c == 0 else r[c] for r in texts for c in range(columns)]
    encoded = tokenizer(flat, truncation=True, max_length=max_length)["input_ids"]
    ids = [encoded[i * columns:(i + 1) * columns] for i in range(len(texts))]
    return TextRows(ids, columns, where)


def pad_texts(texts: list[list[int]], pad_id: int, side: str, counted: list[bool] | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids of texts right- or left-padded to the longest, their attention mask, and the collators' `labels`: a
    leading ignored column, then the ids of each text `counted` flags at its real tokens (the loop counts the real
    tokens from labels[:, 1:]; the loss does not read it)."""
    width = max(len(ids) for ids in texts)
    input_ids = torch.full((len(texts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    labels = torch.full((len(texts), width + 1), IGNORE_INDEX, dtype=torch.long)
    for t, ids in enumerate(texts):
        span = slice(width - len(ids), width) if side == "left" else slice(0, len(ids))
        input_ids[t, span], attention_mask[t, span] = torch.tensor(ids), 1
        if counted is not None and counted[t]:
            labels[t, 1:][span] = torch.tensor(ids)
    return input_ids, attention_mask, labels


class EmbeddingCollator:
    """A micro-batch of b rows -> the texts of each column one after the other (anchors, positives, negatives),
    padded on the tokenizer's side, with their attention mask.

    `rows_per_batch`: pad the batch to this many rows with filler rows (one pad token, `valid` false), so that every
    data-parallel rank gathers embeddings of one shape (a short last step); None pads only an empty batch (to one
    row). `labels` has a leading ignored column, then each text's ids at its real tokens: the loop counts the
    real tokens from it (labels[:, 1:]); the loss does not read it.
    """

    def __init__(self, data: TextRows, pad_token_id: int, padding_side: str, rows_per_batch: int | None = None):
        self.data, self.pad_token_id, self.padding_side = data, pad_token_id, padding_side
        self.rows_per_batch = rows_per_batch

    def __call__(self, row_indices: list[int]) -> dict[str, torch.Tensor]:
        size = max(self.rows_per_batch or len(row_indices), len(row_indices), 1)
        columns = self.data.columns
        rows = [self.data.ids[i] for i in row_indices] + [[[self.pad_token_id]] * columns] * (size - len(row_indices))
        texts = [rows[r][c] for c in range(columns) for r in range(size)]
        counted = [t % size < len(row_indices) for t in range(len(texts))]
        input_ids, attention_mask, labels = pad_texts(texts, self.pad_token_id, self.padding_side, counted)
        valid = torch.arange(size) < len(row_indices)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels, "valid": valid,
                "num_examples": torch.tensor(len(row_indices))}


def labelled(value, where: str) -> float:
    """A pair's relevance label: true/false or a number in [0, 1] (BinaryCrossEntropyLoss's targets)."""
    if isinstance(value, bool) or (isinstance(value, (int, float)) and 0 <= value <= 1):
        return float(value)
    raise HftrainError(f"{where}: label must be true/false or a number in [0, 1] (the pair's relevance), got "
                       f"{value!r:.60}")


def pair_texts(row: dict, where: str) -> tuple[str, list[str], float | None]:
    """(query, passages, label) of a reranker row: a labelled pair (query, passage or document, label) -> one
    passage and its label; a ranked row (query, positive, negative...) -> [positive, *negatives] and None."""
    has = ", ".join(repr(k) for k, v in row.items() if v is not None) or "no field with a value"
    query = row.get("query")
    if not isinstance(query, str) or not query.strip():
        raise HftrainError(f"{where}: the row needs a non-empty 'query' text: objective reranker trains on (query, "
                           f"passage, label) or (query, positive, negative) rows; it has {has}. Rename columns with "
                           "dataset_columns, e.g. {anchor: query}")
    if row.get("label") is not None:
        passage = row.get("passage", row.get("document"))
        if not isinstance(passage, str) or not passage.strip():
            raise HftrainError(f"{where}: a labelled row needs a non-empty 'passage' (or 'document') text; it has "
                               f"{has}")
        return query, [passage], labelled(row["label"], where)
    texts = row_texts({"anchor": query, "positive": row.get("positive"), "negative": row.get("negative")}, where)
    if len(texts) < 3:
        raise HftrainError(f"{where}: a row without a label needs at least one 'negative' text: the listwise loss "
                           "ranks the positive above its negatives (or give passage and label for the binary "
                           f"loss); it has {has}")
    return query, texts[1:], None


@dataclass(frozen=True)
class PairRows:
    """A tokenized reranker dataset: `ids[i][c]` the token ids of row i's pair c (query, passage) as the tokenizer
    encodes a text pair; `labels[i]` the labelled pair's target, or None for ranked rows (pair 0 the positive)."""

    ids: list[list[list[int]]]
    labels: list[float] | None
    columns: int  # pairs per row: 1 (labelled) or 1 + negatives (ranked)
    where: list[str]

    def __len__(self) -> int:
        return len(self.ids)


def templated_pairs(tokenizer, template: str, queries: list[str], passages: list[str], max_length: int,
                    ) -> list[list[int]]:
    """Each (query, passage) filled into `template` ({query} ... {document}) and tokenized whole without special
    tokens (as a chat template renders and tokenizes it: what sentence-transformers' CrossEncoder reads from the
    saved folder); a text longer than max_length loses tokens from the end of its middle (the pair's part), keeping
    as many tokens of the start and the end as the text before {query} and after {document} take alone."""
    start, end = template.index("{query}"), template.index("{document}") + len("{document}")
    prefix, suffix = (len(tokenizer(text, add_special_tokens=False)["input_ids"])
                      for text in (template[:start], template[end:]))
    if max_length - prefix - suffix < 2:
        raise HftrainError(f"max_length {max_length} leaves {max_length - prefix - suffix} tokens for the pair: "
                           f"reranker_template alone takes {prefix + suffix}; raise max_length or shorten it")
    between = template[start + len("{query}"):end - len("{document}")]
    texts = [template[:start] + query + between + passage + template[end:]
             for query, passage in zip(queries, passages)]
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return [ids if len(ids) <= max_length else ids[:max_length - suffix] + ids[len(ids) - suffix:] for ids in encoded]


def pair_ids(tokenizer, queries: list[str], passages: list[str], max_length: int, template: str | None,
             ) -> list[list[int]]:
    """The token ids of (query, passage) pairs as a reranker reads them: tokenizer(query, passage), truncated, as
    sentence-transformers' CrossEncoder tokenizes a plain text pair; with a `template` (reranker_head yes_no):
    `templated_pairs`. Training and the retrieval metrics both tokenize through it."""
    if template is None:
        return tokenizer(queries, passages, truncation=True, max_length=max_length)["input_ids"]
    return templated_pairs(tokenizer, template, queries, passages, max_length)


def tokenize_pairs(rows: list[tuple[str, dict]], tokenizer, max_length: int, name: str,
                   template: str | None = None) -> PairRows:
    """Every reranker row checked (one kind, the same number of negatives) and its pairs tokenized (`pair_ids`)."""
    if not rows:
        raise HftrainError(f"dataset {name!r} has no rows")
    parsed = [(place, *pair_texts(row, place)) for place, row in rows]
    first_place, _, first_passages, first_label = parsed[0]
    def kind(passages: list[str], label: float | None) -> str:
        return "a label" if label is not None else f"{len(passages) - 1} negatives"

    for place, _, passages, label in parsed:
        if (label is None) != (first_label is None) or len(passages) != len(first_passages):
            raise HftrainError(f"{place}: the row has {kind(passages, label)}, the first row ({first_place}) "
                               f"{kind(first_passages, first_label)}: a dataset is all labelled pairs or all ranked "
                               "rows with as many negatives each")
    columns = len(first_passages)
    queries = [query for _, query, passages, _ in parsed for _ in passages]
    passages = [p for _, _, row_passages, _ in parsed for p in row_passages]
    encoded = pair_ids(tokenizer, queries, passages, max_length, template)
    ids = [encoded[i * columns:(i + 1) * columns] for i in range(len(parsed))]
    labels = None if first_label is None else [label for *_, label in parsed]
    return PairRows(ids, labels, columns, [place for place, *_ in parsed])


class RerankerCollator:
    """A micro-batch of b rows -> their pairs row after row (a ranked row's positive first), padded on the
    tokenizer's side; `targets` for labelled pairs; `valid` (an empty batch becomes one filler row, not valid);
    `labels` as EmbeddingCollator's, for the loop's token count."""

    def __init__(self, data: PairRows, pad_token_id: int, padding_side: str):
        self.data, self.pad_token_id, self.padding_side = data, pad_token_id, padding_side

    def __call__(self, row_indices: list[int]) -> dict[str, torch.Tensor]:
        columns = self.data.columns
        rows = [self.data.ids[i] for i in row_indices] or [[[self.pad_token_id]] * columns]
        texts = [ids for row in rows for ids in row]
        input_ids, attention_mask, labels = pad_texts(texts, self.pad_token_id, self.padding_side,
                                                      [bool(row_indices)] * len(texts))
        batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels,
                 "valid": torch.full((len(rows),), bool(row_indices)), "num_examples": torch.tensor(len(row_indices))}
        if self.data.labels is not None:
            batch["targets"] = torch.tensor([self.data.labels[i] for i in row_indices] or [0.0])
        return batch
