"""The retrieval group of the recipe: objective embedding's fields (`RetrievalFields`, sentence-transformers' names
where it has one) and the rules judged from the recipe alone (`problems`); the objective itself is
`hftrain/objectives/embedding.py`, its data `hftrain/data/retrieval.py`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hftrain.fields import recipe_field as _f

POOLINGS = ("mean", "cls", "last_token")
RERANKER_HEADS = ("classifier", "yes_no")
# Qwen3-Reranker's prompt (its model card), the instruction its card uses by default
QWEN3_RERANKER_TEMPLATE = (
    '<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct '
    'provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n<Instruct>: Given a web '
    'search query, retrieve relevant passages that answer the query\n<Query>: {query}\n<Document>: {document}'
    '<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n')


@dataclass
class RetrievalFields:
    pooling: str = _f(
        "mean", "embedding: how a text's token states become one vector (sentence-transformers' Pooling): mean (of the "
        "real tokens), cls (the first token: BERT-like encoders) or last_token (the last real token: decoder "
        "embedders such as Qwen3-Embedding, whose tokenizer appends the EOS token the model pools; the text is "
        "tokenized as the saved tokenizer does, so training and sentence-transformers' encode agree). The vector is "
        "L2-normalised.", group="retrieval", choices=POOLINGS,
    )
    contrastive_scale: float = _f(
        20.0, "embedding: sentence-transformers' MultipleNegativesRankingLoss `scale`, the factor on the cosine "
        "similarities before the softmax (1 / temperature; 20 = temperature 0.05, its default).", group="retrieval",
    )
    symmetric_loss: bool = _f(
        False, "embedding: add the positive -> anchors direction (MultipleNegativesRankingLoss with directions "
        "query_to_doc and doc_to_query, partition_mode per_direction: the old MultipleNegativesSymmetricRankingLoss);"
        " false: anchor -> candidates only (InfoNCE).", group="retrieval",
    )
    query_prompt: str | None = _f(
        None, "embedding: an instruction prefixed to every anchor (query) text, e.g. 'Instruct: Given a question, "
        "retrieve passages that answer it\\nQuery: ' for Qwen3-Embedding; saved as the final folder's "
        "sentence-transformers prompt 'query', so model.encode_query adds it. Unset: anchors as written.",
        group="retrieval",
    )
    mini_batch_size: int | None = _f(
        None, "embedding: the cached-gradient mode (GradCache, as sentence-transformers' "
        "CachedMultipleNegativesRankingLoss): the texts of a micro-batch are embedded this many at a time without "
        "keeping their activations, and recomputed one piece at a time in backward, so per_device_train_batch_size "
        "(the contrastive batch) can grow far past what fits in memory at the cost of a second forward. The loss "
        "and update equal the uncached ones. Unset: uncached.", group="retrieval",
    )
    retrieval_eval_dir: str | None = _f(
        None, "embedding and reranker: a folder of BEIR's files (queries.jsonl, corpus.jsonl, qrels.tsv) ranked by "
        "the live model at each evaluation: eval_ndcg@10, eval_mrr@10, eval_recall@1/5/10 (sentence-transformers' "
        "InformationRetrievalEvaluator's and CrossEncoderRerankingEvaluator's definitions). An embedding model ranks "
        "the whole corpus; a reranker scores each query's candidates.tsv lines (query-id, corpus-id: e.g. a first "
        "stage's hits), or the whole corpus without that file. data/retrieval-eval is a tiny one. Read and checked "
        "before the model loads.", group="retrieval",
    )
    reranker_head: str = _f(
        "classifier", "reranker: what scores a (query, passage) pair. classifier: a new one-output score head "
        "(AutoModelForSequenceClassification) read at the pair's last token, the pair tokenized as a text pair; "
        "yes_no: the Qwen3-Reranker form, the causal LM itself (AutoModelForCausalLM, no new weights) reading "
        "reranker_template filled with the pair, the score the logit of the token 'yes' minus that of 'no' at the "
        "last position (sigmoid of it = P(yes) of the softmax over the two: sentence-transformers' LogitScore). The "
        "tokenizer must hold 'yes' and 'no' as single tokens.", group="retrieval", choices=RERANKER_HEADS,
    )
    reranker_template: str = _f(
        QWEN3_RERANKER_TEMPLATE, "reranker with reranker_head yes_no: the prompt a pair is scored in, {query} and "
        "{document} (once each, in that order) replaced by its texts; the default is Qwen3-Reranker's, with its "
        "default instruction (rewrite the '<Instruct>: ...' line for your task). The filled text is tokenized whole "
        "without special tokens (as the chat template saved with the final folder renders it for "
        "sentence-transformers' CrossEncoder); a longer text than max_length loses tokens from the end of the pair "
        "part, keeping the template's end, where the score is read.", group="retrieval",
    )


def template_problems(template: str) -> list[str]:
    """What makes `template` unusable as a yes/no reranker's prompt."""
    counts = {name: template.count("{" + name + "}") for name in ("query", "document")}
    if counts != {"query": 1, "document": 1} or template.index("{query}") > template.index("{document}"):
        return [f"reranker_template must hold {{query}} and then {{document}}, once each (it holds {{query}} "
                f"{counts['query']} times, {{document}} {counts['document']} times, in that order or not): hftrain "
                "fills them with each pair's texts"]
    return []


def problems(r) -> list[str]:
    """objectives embedding's and reranker's settings and what whole texts scored one by one cannot be combined
    with; other objectives: no retrieval field set."""
    defaults = RetrievalFields.__dataclass_fields__
    misplaced = [f"{name} is set but objective={r.objective}; it configures objective embedding"
                 for name in ("pooling", "contrastive_scale", "symmetric_loss", "query_prompt", "mini_batch_size")
                 if getattr(r, name) != defaults[name].default]
    if r.objective not in ("embedding", "reranker") and r.retrieval_eval_dir:
        misplaced.append(f"retrieval_eval_dir is set but objective={r.objective}; it configures objectives "
                         "embedding and reranker")
    head = [f"{name} is set but objective={r.objective}; it configures objective reranker"
            for name in ("reranker_head", "reranker_template")
            if r.objective != "reranker" and getattr(r, name) != defaults[name].default]
    if r.objective == "reranker" and r.reranker_head == "classifier" and (
            r.reranker_template != defaults["reranker_template"].default):
        head.append("reranker_template is set but reranker_head=classifier (a text pair, no prompt); it configures "
                    "reranker_head yes_no")
    if r.objective == "reranker" and r.reranker_head == "yes_no":
        head += template_problems(r.reranker_template)
    if r.objective not in ("embedding", "reranker"):
        return misplaced + head
    problems = (misplaced if r.objective == "reranker" else []) + head
    if r.contrastive_scale <= 0:
        problems.append(f"contrastive_scale must be > 0 (sentence-transformers' scale), got {r.contrastive_scale}")
    if r.mini_batch_size is not None and r.mini_batch_size < 1:
        problems.append(f"mini_batch_size must be >= 1 or unset, got {r.mini_batch_size}")
    if r.retrieval_eval_dir and not Path(r.retrieval_eval_dir).expanduser().is_dir():
        problems.append(f"retrieval_eval_dir {r.retrieval_eval_dir!r} is not a folder")
    what = f"objective {r.objective}"
    if r.packing:
        problems.append(f"packing with {what} is refused: each text (pair) is scored as a whole sequence of its "
                        "own; set packing: false")
    if r.streaming:
        problems.append(f"streaming with {what} is not supported yet; set streaming: false")
    if r.dataset_mixture:
        problems.append(f"dataset_mixture with {what} is not supported yet; name one file in dataset_name")
    if r.dataset_format != "auto":
        problems.append(f"{what} reads its own rows (docs/retrieval.md): leave dataset_format at auto, got "
                        f"{r.dataset_format}")
    if r.train_sampling_strategy == "group_by_length":
        problems.append(f"train_sampling_strategy=group_by_length with {what} is refused: sorting rows by length "
                        "makes a batch's negatives easy and its order unlike the data's; use random or sequential")
    if r.use_liger_kernel or r.loss_chunk_tokens:
        problems.append("use_liger_kernel and loss_chunk_tokens fuse a language-model head's cross-entropy; "
                        f"{what} has no such head: turn them off")
    for name in ("pp_size", "tp_size", "cp_size", "sp_size"):
        if getattr(r, name) > 1:
            problems.append(f"{name}={getattr(r, name)} with {what} is refused: verified for whole sequences on "
                            "data-parallel ranks only (the embeddings are gathered over them); use DDP, ZeRO or "
                            "FSDP2")
    if r.eval_tasks:
        problems.append(f"eval_tasks runs lm-evaluation-harness on a causal LM; {what} writes no text: remove "
                        "eval_tasks")
    if r.log_completions:
        problems.append(f"log_completions completes prompts with the trained model; {what} writes no text: remove "
                        "log_completions")
    if r.beta != 0.1 or r.loss_type != "sigmoid":
        problems.append(f"beta and loss_type configure dpo, kto, orpo and grpo, not {what} (docs/retrieval.md): "
                        "remove them")
    return problems
