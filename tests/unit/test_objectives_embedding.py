"""objectives embedding and reranker against sentence-transformers 6 on the same rows and the same tiny random models
(a Llama body and a BERT built here; the Llama as a one-output classifier): the loss and the weights after one torch
optimizer step equal MultipleNegativesRankingLoss's (each pooling, plain and symmetric, with a hard negative and a
query prompt) and the CrossEncoder losses' (binary, listwise), the cached mode equals the uncached loss and
gradients (and CachedMultipleNegativesRankingLoss's loss), a short batch's filler rows change nothing, and bad rows
are refused naming the file and line."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from hftrain.config import Recipe
from hftrain.data.retrieval import EmbeddingCollator, read_rows, tokenize_rows
from hftrain.errors import HftrainError
from hftrain.objectives.embedding import EmbeddingLoss
from tests.conftest import REPO

st = pytest.importorskip("sentence_transformers")
from sentence_transformers.base.modules.transformer import Transformer  # noqa: E402
from sentence_transformers.sentence_transformer import losses  # noqa: E402
from sentence_transformers.sentence_transformer.modules import Normalize, Pooling  # noqa: E402

PROMPT = "query: "
TEXT_ONLY = {"text": {"method": "forward", "method_output_name": "last_hidden_state"}}
ST_POOLING = {"mean": "mean", "cls": "cls", "last_token": "lasttoken"}


@pytest.fixture(scope="module")
def encoders(tmp_path_factory) -> dict[str, str]:
    """Folders of two tiny random encoders with the shipped tokenizer: the shipped tiny Llama (AutoModel reads its
    body) and a 2-layer BERT drawn here (no dropout: both libraries then compute the same function)."""
    from transformers import AutoTokenizer, BertConfig, BertModel

    tokenizer = AutoTokenizer.from_pretrained(REPO / "models" / "tiny-llama")
    torch.manual_seed(0)
    bert = BertModel(BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                intermediate_size=64, max_position_embeddings=128, hidden_dropout_prob=0.0,
                                attention_probs_dropout_prob=0.0, pad_token_id=tokenizer.pad_token_id))
    folder = tmp_path_factory.mktemp("bert")
    bert.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return {"llama": str(REPO / "models" / "tiny-llama"), "bert": str(folder)}


def rows(count: int) -> list[dict]:
    lines = (REPO / "data" / "retrieval.jsonl").read_text(encoding="utf-8").splitlines()[:count]
    return [json.loads(line) for line in lines]


def hftrain_side(folder: str, recipe: Recipe, examples: list[dict], rows_per_batch: int | None = None):
    """(EmbeddingLoss around AutoModel, the collated batch of `examples`)."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    data = tokenize_rows([(f"row {i}", r) for i, r in enumerate(examples)], tokenizer, recipe.max_length,
                         recipe.query_prompt, "rows")
    batch = EmbeddingCollator(data, tokenizer.pad_token_id, tokenizer.padding_side, rows_per_batch)(
        list(range(len(examples))))
    batch.pop("num_examples")
    return EmbeddingLoss(AutoModel.from_pretrained(folder), recipe), batch


def st_side(folder: str, pooling: str, examples: list[dict]):
    """(a SentenceTransformer Transformer -> Pooling -> Normalize of `folder`, the features of the three columns as
    its trainer makes them: the prompt prefixed to the anchors). The Transformer reads plain text, as hftrain's final
    folder declares it (sentence-transformers 6 would otherwise render text through a chat template the tokenizer
    has, as a user message)."""
    transformer = Transformer(folder, modality_config=TEXT_ONLY, module_output_name="token_embeddings")
    model = st.SentenceTransformer(modules=[transformer, Pooling(transformer.get_embedding_dimension(),
                                                                 ST_POOLING[pooling]), Normalize()])
    columns = [[PROMPT + r["anchor"] for r in examples], [r["positive"] for r in examples],
               [r["negative"] for r in examples]]
    return model, [model.preprocess(texts) for texts in columns]


def parameters(module) -> dict[str, torch.Tensor]:
    """The encoder's parameters by transformers' names (sentence-transformers' `0.model.`, hftrain's `lm.`)."""
    return {name.removeprefix("0.model.").removeprefix("lm."): p.detach().clone()
            for name, p in module.named_parameters()}


def one_sgd_step_equal(ours: torch.nn.Module, loss: torch.Tensor, theirs: torch.nn.Module,
                       expected: torch.Tensor) -> dict[str, torch.Tensor]:
    """The two losses equal, and every weight after one SGD step (lr 0.5) from each one's gradient; returns ours
    after the step (by transformers' names, `parameters`)."""
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    for module, value in ((ours, loss), (theirs, expected)):
        optimizer = torch.optim.SGD(module.parameters(), lr=0.5)
        value.backward()
        optimizer.step()
    after, theirs_after = parameters(ours), parameters(theirs)
    assert after.keys() == theirs_after.keys()
    for name, value in after.items():
        torch.testing.assert_close(value, theirs_after[name], rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    return after


@pytest.mark.parametrize(("encoder", "pooling", "symmetric"), [
    ("llama", "last_token", False), ("llama", "mean", True), ("bert", "cls", False), ("bert", "mean", False),
])
def test_loss_and_update_equal_multiple_negatives_ranking_loss(encoders, encoder, pooling, symmetric):
    """6 rows (anchor with a prompt, positive, hard negative): hftrain's summed loss / 6 is sentence-transformers'
    mean loss, and one SGD step from each library's gradient gives the same weights (SGD: AdamW's first step,
    ~lr x sign(gradient), would magnify last-bit differences of near-zero gradients)."""
    examples = rows(6)
    recipe = Recipe(objective="embedding", pooling=pooling, symmetric_loss=symmetric, query_prompt=PROMPT,
                    max_length=64)
    ours, batch = hftrain_side(encoders[encoder], recipe, examples)
    theirs, features = st_side(encoders[encoder], pooling, examples)
    directions = ("query_to_doc", "doc_to_query") if symmetric else ("query_to_doc",)
    reference = losses.MultipleNegativesRankingLoss(theirs, scale=20.0, directions=directions,
                                                    partition_mode="per_direction" if symmetric else "joint")
    before = parameters(ours)
    assert before.keys() == parameters(theirs).keys()
    for name, value in parameters(theirs).items():
        torch.testing.assert_close(value, before[name], rtol=0, atol=0)

    ours.train(), theirs.train()
    after = one_sgd_step_equal(ours, ours(**batch) / 6, theirs, reference(features, None))
    for name, value in after.items():
        # rows of tokens no text holds keep their embedding; BERT's pooler is not used by sentence embeddings
        assert not torch.equal(value, before[name]) or name.endswith("embed_tokens.weight") or \
            name.startswith("pooler."), name


@pytest.mark.parametrize("symmetric", [False, True])
def test_cached_mode_equals_the_uncached_loss_and_gradients(encoders, symmetric):
    """mini_batch_size 5 on 6 rows x 3 texts (pieces of 5, 5, 5, 3 texts): the same loss and parameter gradients as
    the uncached batch, and the loss of sentence-transformers' CachedMultipleNegativesRankingLoss."""
    examples = rows(6)
    recipe = Recipe(objective="embedding", pooling="mean", symmetric_loss=symmetric, query_prompt=PROMPT,
                    max_length=64)
    plain, batch = hftrain_side(encoders["llama"], recipe, examples)
    cached = copy.deepcopy(plain)
    cached.mini_batch_size = 5
    plain.train(), cached.train()
    losses_ = [module(**batch) for module in (plain, cached)]
    torch.testing.assert_close(losses_[1], losses_[0], rtol=1e-6, atol=1e-6)
    for value in losses_:
        value.backward()
    grads = [{n: p.grad for n, p in module.named_parameters()} for module in (plain, cached)]
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")

    theirs, features = st_side(encoders["llama"], "mean", examples)
    directions = ("query_to_doc", "doc_to_query") if symmetric else ("query_to_doc",)
    reference = losses.CachedMultipleNegativesRankingLoss(theirs, scale=20.0, mini_batch_size=5,
                                                          directions=directions,
                                                          partition_mode="per_direction" if symmetric else "joint")
    torch.testing.assert_close(losses_[1].detach() / 6, reference(features, None).detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mini_batch_size", [None, 5])
def test_the_counted_forwards_are_the_forwards_the_model_runs(encoders, mini_batch_size):
    """What the run counts as processed tokens and FLOPs (`forward_shapes`) is the (rows, width) of each forward
    the model runs in training, seen by a hook on it: a column of texts at a time at its longest text's width
    (some narrower than the collated batch), or the cached mode's pieces of 5 texts."""
    recipe = Recipe(objective="embedding", pooling="mean", query_prompt=PROMPT, max_length=64,
                    mini_batch_size=mini_batch_size)
    loss, batch = hftrain_side(encoders["llama"], recipe, rows(6))
    seen = []
    loss.lm.register_forward_pre_hook(lambda module, args, kwargs: seen.append(tuple(kwargs["input_ids"].shape)),
                                      with_kwargs=True)
    loss.train()(**batch)
    assert loss.forward_shapes(batch) == seen and len(seen) == (4 if mini_batch_size else 3)
    if mini_batch_size is None:
        assert min(width for _, width in seen) < batch["input_ids"].shape[1]


def test_filler_rows_of_a_short_batch_change_nothing(encoders):
    """4 rows padded to 6 (a short last step: filler rows of one pad token, not valid) give the loss and gradients of
    the 4 rows alone, and count 4 anchors."""
    examples = rows(4)
    recipe = Recipe(objective="embedding", pooling="last_token", max_length=64)
    short, padded_batch = hftrain_side(encoders["llama"], recipe, examples, rows_per_batch=6)
    whole, batch = hftrain_side(encoders["llama"], recipe, examples)
    assert padded_batch["input_ids"].shape[0] == 18 and short.loss_units(padded_batch) == 4
    values = [short(**padded_batch), whole(**batch)]
    torch.testing.assert_close(values[0], values[1], rtol=1e-6, atol=1e-6)
    for value in values:
        value.backward()
    for (name, p), q in zip(short.named_parameters(), whole.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def tokenize_embedding_rows(rows, tokenizer, name):
    return tokenize_rows(rows, tokenizer, 32, None, name)


def tokenize_reranker_rows(rows, tokenizer, name):
    from hftrain.data.retrieval import tokenize_pairs

    return tokenize_pairs(rows, tokenizer, 32, name)


@pytest.mark.parametrize(("tokenize", "line", "says"), [
    (tokenize_embedding_rows, '{"anchor": "a", "positive": "b", "negative": "c"}\nnot json\n', "line 2: not JSON"),
    (tokenize_embedding_rows, '{"anchor": "a", "positive": "b"}\n\n{"query": "a", "positive": "b"}\n',
     "line 3: the row has no 'anchor'"),
    (tokenize_embedding_rows, '{"anchor": "a", "positive": "b", "negative": "c"}\n{"anchor": "a", "positive": "b"}\n',
     "line 2: the row has 0 negatives, the first row"),
    (tokenize_embedding_rows, '{"anchor": "a", "positive": ""}\n', "line 1: positive must be a non-empty text"),
    (tokenize_embedding_rows, '{"anchor": "a", "positive": "b", "negative": 3}\n',
     "line 1: negative must be a text or a list"),
    (tokenize_reranker_rows, '{"query": "a", "passage": "b", "label": 2}\n',
     "line 1: label must be true/false or a number in [0, 1]"),
    (tokenize_reranker_rows, '{"query": "a", "passage": "b", "label": 1}\n{"query": "a", "positive": "b", '
     '"negative": "c"}\n', "line 2: the row has 1 negatives, the first row"),
    (tokenize_reranker_rows, '{"query": "a", "positive": "b"}\n',
     "line 1: a row without a label needs at least one 'negative'"),
    (tokenize_reranker_rows, '{"anchor": "a", "positive": "b", "negative": "c"}\n',
     "line 1: the row needs a non-empty 'query' text"),
])
def test_bad_embedding_and_reranker_rows_are_refused_naming_the_file_and_line(tmp_path, tokenize, line, says):
    from transformers import AutoTokenizer

    path = tmp_path / "rows.jsonl"
    path.write_text(line, encoding="utf-8")
    tokenizer = AutoTokenizer.from_pretrained(REPO / "models" / "tiny-llama")
    with pytest.raises(HftrainError) as refused:
        tokenize(read_rows(str(path), None, "train", {}), tokenizer, str(path))
    assert f"{path}, {says}" in str(refused.value)


# ------------------------------------------------------------------------------------------------- reranker
@pytest.fixture(scope="module")
def classifier(tmp_path_factory) -> str:
    """The shipped tiny Llama as a one-output sequence classifier (its score head drawn with seed 0), pad id set."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(REPO / "models" / "tiny-llama", num_labels=1)
    tokenizer = AutoTokenizer.from_pretrained(REPO / "models" / "tiny-llama")
    model.config.pad_token_id = tokenizer.pad_token_id
    folder = tmp_path_factory.mktemp("classifier")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("labelled", [True, False])
def test_reranker_loss_and_update_equal_cross_encoder_losses(classifier, labelled):
    """6 rows: labelled pairs (query, passage, label) against BinaryCrossEntropyLoss, ranked rows (query, positive,
    negative) against CrossEncoder MultipleNegativesRankingLoss's scoring and loss of the hard negatives, without
    in-batch negatives, activation or scale (listwise cross-entropy); the CrossEncoder reads plain text pairs, as
    hftrain's folder declares. The loss / 6 and the weights after one SGD step are equal."""
    from sentence_transformers.cross_encoder import CrossEncoder
    from sentence_transformers.cross_encoder import losses as ce_losses
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from hftrain.data.retrieval import RerankerCollator, tokenize_pairs
    from hftrain.objectives.reranker import RerankerLoss

    examples = rows(6)
    if labelled:  # the positive and the negative as two labelled pairs, alternating
        data_rows = [{"query": r["anchor"], "passage": r["positive"] if i % 2 else r["negative"], "label": i % 2}
                     for i, r in enumerate(examples)]
    else:
        data_rows = [{"query": r["anchor"], "positive": r["positive"], "negative": r["negative"]} for r in examples]
    tokenizer = AutoTokenizer.from_pretrained(classifier)
    data = tokenize_pairs([(f"row {i}", r) for i, r in enumerate(data_rows)], tokenizer, 64, "rows")
    batch = RerankerCollator(data, tokenizer.pad_token_id, tokenizer.padding_side)(list(range(6)))
    batch.pop("num_examples")
    ours = RerankerLoss(AutoModelForSequenceClassification.from_pretrained(classifier))

    transformer = Transformer(classifier, transformer_task="sequence-classification", module_output_name="scores",
                              modality_config={"text": {"method": "forward", "method_output_name": "logits"}})
    theirs = CrossEncoder(modules=[transformer])
    queries = [r["query"] for r in data_rows]
    if labelled:
        reference = ce_losses.BinaryCrossEntropyLoss(theirs)
        inputs = [queries, [r["passage"] for r in data_rows]]
        targets = torch.tensor([float(r["label"]) for r in data_rows])
    else:
        # its forward with the hard negatives only (num_negatives=0 is refused by torch.multinomial there): the
        # scores of each column, then its own calculate_loss
        listwise = ce_losses.MultipleNegativesRankingLoss(theirs, activation_fn=None, scale=1.0)

        def reference(inputs, targets):
            return listwise.calculate_loss([listwise.call_model_with_columns(inputs[0], column)
                                            for column in inputs[1:]], len(inputs[0]))
        inputs = [queries, [r["positive"] for r in data_rows], [r["negative"] for r in data_rows]]
        targets = None
    before = parameters(ours)
    ours.train(), theirs.train()
    after = one_sgd_step_equal(ours, ours(**batch) / 6, theirs, reference(inputs, targets))
    assert not torch.equal(after["score.weight"], before["score.weight"])


@pytest.mark.parametrize("count", [5, 1])
def test_a_reranker_micro_batch_runs_in_two_length_sorted_halves(classifier, count):
    """A micro-batch of `count` labelled pairs of different lengths: the model runs twice, on the shorter half of the
    pairs at that half's longest pair's width (narrower than the micro-batch's longest pair), then on the longer half
    (a lone pair: itself twice); the summed loss and the gradients equal plain PyTorch on each pair alone (the
    classifier on its unpadded tokens, binary cross-entropy on the logit)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from hftrain.data.retrieval import RerankerCollator, tokenize_pairs
    from hftrain.objectives.reranker import RerankerLoss

    data_rows = [{"query": r["anchor"], "passage": r["positive"] * (1 + i % 3), "label": i % 2}
                 for i, r in enumerate(rows(count))]
    tokenizer = AutoTokenizer.from_pretrained(classifier)
    data = tokenize_pairs([(f"row {i}", r) for i, r in enumerate(data_rows)], tokenizer, 64, "rows")
    batch = RerankerCollator(data, tokenizer.pad_token_id, tokenizer.padding_side)(list(range(count)))
    batch.pop("num_examples")
    ours = RerankerLoss(AutoModelForSequenceClassification.from_pretrained(classifier)).train()
    theirs = AutoModelForSequenceClassification.from_pretrained(classifier).train()
    widths = []
    ours.lm.register_forward_pre_hook(lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape),
                                      with_kwargs=True)
    loss = ours(**batch)
    lengths = sorted(len(pair[0]) for pair in data.ids)
    half = (count + 1) // 2
    expected_widths = [(half, lengths[half - 1]), (count - half, lengths[-1])] if count > 1 else [(1, lengths[0])] * 2
    assert [tuple(w) for w in widths] == expected_widths
    assert ours.forward_shapes(batch) == expected_widths  # what the run counts as processed tokens and FLOPs
    if count > 1:
        assert lengths[half - 1] < batch["input_ids"].shape[1]
    expected = sum(torch.nn.functional.binary_cross_entropy_with_logits(
        theirs(input_ids=torch.tensor([pair[0]])).logits[0, 0], torch.tensor(float(r["label"])))
        for pair, r in zip(data.ids, data_rows, strict=True))
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    loss.backward()
    expected.backward()
    ours_grads = {n.removeprefix("lm."): p.grad for n, p in ours.named_parameters()}
    for name, p in theirs.named_parameters():
        torch.testing.assert_close(ours_grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize(("files", "says"), [
    ({"queries.jsonl": '{"_id": "q0", "text": "a"}\n{"_id": "q1"}\n'}, "queries.jsonl, line 2: each line must be"),
    ({"qrels.tsv": "query-id\tcorpus-id\tscore\nq0\td9\t1\n"}, "qrels.tsv, line 2: document 'd9' is not in"),
    ({"qrels.tsv": "query-id\tcorpus-id\tscore\nq0 d0 1\n"}, "qrels.tsv, line 2: expected query-id, corpus-id"),
    ({"candidates.tsv": "query-id\tcorpus-id\nq0\td0\nq0\td9\n"}, "candidates.tsv, line 3: document 'd9' is not in"),
])
def test_a_bad_retrieval_task_is_refused_naming_the_file_and_line(tmp_path, files, says):
    from hftrain.retrieval_eval import load_retrieval_set

    good = {"queries.jsonl": '{"_id": "q0", "text": "a"}\n', "corpus.jsonl": '{"_id": "d0", "text": "b"}\n',
            "qrels.tsv": "query-id\tcorpus-id\tscore\nq0\td0\t1\n"}
    for name, text in {**good, **files}.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    with pytest.raises(HftrainError) as refused:
        load_retrieval_set(tmp_path)
    assert f"{tmp_path}/{says}" in str(refused.value)


# ------------------------------------------------------------------------- reranker_head yes_no (Qwen3-Reranker)
@pytest.fixture(scope="module")
def yes_no_lm(tmp_path_factory) -> str:
    """The shipped tiny Llama with "yes" and "no" added to its tokenizer as single tokens, their embedding and
    output rows drawn with seed 0 (so the two logits differ)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(REPO / "models" / "tiny-llama")
    tokenizer.add_tokens(["yes", "no"])
    model = AutoModelForCausalLM.from_pretrained(REPO / "models" / "tiny-llama")
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    torch.manual_seed(0)
    with torch.no_grad():
        for weights in (model.get_input_embeddings().weight, model.get_output_embeddings().weight):
            weights[-2:] = torch.randn_like(weights[-2:]) * 0.5
    folder = tmp_path_factory.mktemp("yes_no")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("labelled", [True, False])
def test_yes_no_reranker_loss_and_update_equal_plain_pytorch(yes_no_lm, tmp_path, labelled):
    """6 rows scored the Qwen3-Reranker way (its template, P(yes) = softmax over the 'yes' and 'no' logits at the
    last position), each pair computed alone in plain PyTorch from the causal LM's logits (the prompt built with
    str.replace): the binary cross-entropy on P(yes) / the listwise cross-entropy on log P(yes) - log P(no) equal
    hftrain's left-padded batch loss / 6, and the weights after one SGD step are equal. The folder hftrain writes
    beside the model (write_yes_no_cross_encoder_files) makes sentence-transformers' CrossEncoder tokenize a pair
    as hftrain did and predict the same P(yes)."""
    from pathlib import Path

    from sentence_transformers.cross_encoder import CrossEncoder
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hftrain.data.retrieval import RerankerCollator, tokenize_pairs
    from hftrain.fields.retrieval import QWEN3_RERANKER_TEMPLATE as TEMPLATE
    from hftrain.objectives.reranker import RerankerLoss, write_yes_no_cross_encoder_files, yes_no_token_ids

    examples = rows(6)
    if labelled:
        data_rows = [{"query": r["anchor"], "passage": r["positive"] if i % 2 else r["negative"], "label": i % 2}
                     for i, r in enumerate(examples)]
        pairs = [[(r["query"], r["passage"])] for r in data_rows]
    else:
        data_rows = [{"query": r["anchor"], "positive": r["positive"], "negative": r["negative"]} for r in examples]
        pairs = [[(r["query"], r["positive"]), (r["query"], r["negative"])] for r in data_rows]
    tokenizer = AutoTokenizer.from_pretrained(yes_no_lm)
    yes, no = tokenizer.convert_tokens_to_ids("yes"), tokenizer.convert_tokens_to_ids("no")
    data = tokenize_pairs([(f"row {i}", r) for i, r in enumerate(data_rows)], tokenizer, 512, "rows", TEMPLATE)
    batch = RerankerCollator(data, tokenizer.pad_token_id, "left")(list(range(6)))
    batch.pop("num_examples")
    assert yes_no_token_ids(tokenizer, yes_no_lm) == (yes, no)
    ours = RerankerLoss(AutoModelForCausalLM.from_pretrained(yes_no_lm), (yes, no))
    theirs = AutoModelForCausalLM.from_pretrained(yes_no_lm)

    def log_p_yes_no(query: str, passage: str) -> torch.Tensor:
        text = TEMPLATE.replace("{query}", query).replace("{document}", passage)
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        return torch.log_softmax(theirs(input_ids=ids).logits[0, -1, [yes, no]], dim=0)

    def reference() -> torch.Tensor:
        if labelled:
            log_p = torch.stack([log_p_yes_no(*row[0]) for row in pairs])
            targets = torch.tensor([float(r["label"]) for r in data_rows])
            return -(targets * log_p[:, 0] + (1 - targets) * log_p[:, 1]).mean()
        scores = torch.stack([torch.stack([log_p_yes_no(*pair) @ torch.tensor([1.0, -1.0]) for pair in row])
                              for row in pairs])
        return -torch.log_softmax(scores, dim=1)[:, 0].mean()

    before = parameters(ours)
    after = one_sgd_step_equal(ours, ours(**batch) / 6, theirs, reference())
    assert not torch.equal(after["lm_head.weight"], before["lm_head.weight"])

    ours.lm.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    write_yes_no_cross_encoder_files(Path(tmp_path), TEMPLATE, (yes, no))
    cross_encoder = CrossEncoder(str(tmp_path))
    flat = [pair for row in pairs for pair in row]
    assert cross_encoder[0].preprocess([flat[0]])["input_ids"][0].tolist() == data.ids[0][0]
    with torch.no_grad():
        expected_p = torch.stack([log_p_yes_no(*pair)[0].exp() for pair in flat])
    torch.testing.assert_close(torch.as_tensor(cross_encoder.predict(flat, batch_size=1)), expected_p,
                               rtol=1e-5, atol=1e-6)


def test_yes_no_reranker_refuses_a_tokenizer_without_single_yes_and_no_tokens():
    """The shipped tiny Llama's tokenizer spells 'yes' and 'no' in several pieces: refused in one paragraph naming
    the model, the pieces and the way out."""
    from transformers import AutoTokenizer

    from hftrain.objectives.reranker import yes_no_token_ids

    tokenizer = AutoTokenizer.from_pretrained(REPO / "models" / "tiny-llama")
    with pytest.raises(HftrainError) as refused:
        yes_no_token_ids(tokenizer, "models/tiny-llama")
    message = str(refused.value)
    assert "\n" not in message and "the tokenizer of models/tiny-llama has no single token" in message
    assert f"'yes' is encoded as 3 tokens {tokenizer('yes', add_special_tokens=False)['input_ids']}" in message
    assert "reranker_head: classifier" in message


@pytest.mark.parametrize(("fields", "says"), [
    ({"objective": "reranker", "reranker_head": "yes_no", "reranker_template": "Q: {query}"},
     "reranker_template must hold {query} and then {document}, once each"),
    ({"objective": "reranker", "reranker_template": "{query} {document}"},
     "reranker_template is set but reranker_head=classifier"),
    ({"objective": "embedding", "reranker_head": "yes_no"}, "reranker_head is set but objective=embedding"),
])
def test_bad_yes_no_settings_are_refused(fields, says):
    from hftrain.fields.retrieval import problems

    recipe = Recipe(model_name_or_path="m", dataset_name="d", output_dir="o", **fields)
    assert any(says in problem for problem in problems(recipe)), problems(recipe)


def test_a_long_templated_pair_keeps_the_template_start_and_end(yes_no_lm, tmp_path):
    """A pair too long for max_length: max_length tokens, ending with the tokens of the text after {document}
    tokenized alone (Qwen3's starts with the special <|im_end|>: the prompt's last tokens, where the score is read,
    survive) and starting with those of the text before {query} but its last (its trailing space merges with the
    query's first word), as sentence-transformers' CrossEncoder truncates it on the folder hftrain writes (its
    tokenizer's model_max_length the run's max_length); a max_length the template alone fills is refused."""
    import shutil
    from pathlib import Path

    from sentence_transformers.cross_encoder import CrossEncoder
    from transformers import AutoTokenizer

    from hftrain.data.retrieval import templated_pairs
    from hftrain.fields.retrieval import QWEN3_RERANKER_TEMPLATE as TEMPLATE
    from hftrain.objectives.reranker import write_yes_no_cross_encoder_files, yes_no_token_ids

    tokenizer = AutoTokenizer.from_pretrained(yes_no_lm)
    head, tail = TEMPLATE.split("{query}")[0], TEMPLATE.split("{document}")[1]
    head_ids, tail_ids = (tokenizer(text, add_special_tokens=False)["input_ids"] for text in (head, tail))
    [ids] = templated_pairs(tokenizer, TEMPLATE, ["What is 8 + 1?"], ["nine " * 200], 300)
    assert len(ids) == 300 and ids[:len(head_ids) - 1] == head_ids[:-1] and ids[-len(tail_ids):] == tail_ids
    folder = Path(shutil.copytree(yes_no_lm, tmp_path / "folder"))
    tokenizer.model_max_length = 300
    tokenizer.save_pretrained(folder)
    write_yes_no_cross_encoder_files(folder, TEMPLATE, yes_no_token_ids(tokenizer, yes_no_lm))
    pair = ("What is 8 + 1?", "nine " * 200)
    assert CrossEncoder(str(folder))[0].preprocess([pair])["input_ids"][0].tolist() == ids
    with pytest.raises(HftrainError, match="max_length 40 leaves"):
        templated_pairs(tokenizer, TEMPLATE, ["q"], ["d"], 40)


def test_the_pair_chat_template_renders_any_template_text_as_str_replace_does():
    """Quotes, backslashes, braces, jinja syntax, tabs and non-ASCII letters in reranker_template come out of the
    saved chat template (transformers' apply_chat_template on query/document messages) as str.replace fills them."""
    from transformers import AutoTokenizer

    from hftrain.objectives.reranker import pair_chat_template

    template = 'Ünïcode "q" \\ {{x}} {% raw %}\n<Q>: {query}\n<D>: {document}\nend\t'
    tokenizer = AutoTokenizer.from_pretrained(REPO / "models" / "tiny-llama")
    tokenizer.chat_template = pair_chat_template(template)
    messages = [{"role": "query", "content": "What is {x}?"}, {"role": "document", "content": "It's \"{{ y }}\"."}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert rendered == template.replace("{query}", "What is {x}?").replace("{document}", "It's \"{{ y }}\".")


def test_a_yes_no_reranker_on_a_model_without_a_causal_lm_class_is_refused():
    """The image-text tiny model (llava) has no AutoModelForCausalLM class: one paragraph naming it, before loading;
    the tiny Llama passes, and the classifier head is not judged by this rule."""
    from transformers import AutoConfig

    from hftrain.preflight import yes_no_reranker_problems

    vlm = AutoConfig.from_pretrained(REPO / "models" / "tiny-vlm")
    recipe = Recipe(objective="reranker", reranker_head="yes_no", model_name_or_path=str(REPO / "models" / "tiny-vlm"))
    (problem,) = yes_no_reranker_problems(recipe, vlm)
    assert "no causal-LM class for model type 'llava'" in problem and "\n" not in problem
    assert yes_no_reranker_problems(recipe, AutoConfig.from_pretrained(REPO / "models" / "tiny-llama")) == []
    assert yes_no_reranker_problems(Recipe(objective="reranker"), vlm) == []


# ------------------------------------------------------------------------------ LoRA / QLoRA (4-bit) retrieval models
def quantized(name: str, auto, **kwargs):
    """`auto.from_pretrained(name)` with its linear layers in bitsandbytes' 4 bits (nf4, fp32 compute), as the
    reference of a QLoRA step; the bf16 repacking of AVX512-BF16 CPUs turned off (not the layout training uses)."""
    from transformers import BitsAndBytesConfig

    model = auto.from_pretrained(name, quantization_config=BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32), **kwargs)
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    return model


def plain_lora(model, task_type: str, **extra):
    """peft's LoRA on `model` (r 4, alpha 8, no dropout, the attention and MLP projections), the adapter weights
    to be overwritten with hftrain's initial ones."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, task_type=task_type,
                                            target_modules=LORA_TARGETS, **extra))


LORA_TARGETS = ["q_proj", "v_proj", "down_proj"]


def start_equal(ours: torch.nn.Module, reference: torch.nn.Module) -> list[str]:
    """Copy hftrain's trainable parameters (the adapters drawn at random, a new score head) into the reference;
    returns their names. Every other parameter must already be equal (the 4-bit weights quantized alike)."""
    mine = dict(ours.named_parameters())
    trained = [name for name, p in mine.items() if p.requires_grad]
    theirs = dict(reference.named_parameters())
    assert sorted(name for name, p in theirs.items() if p.requires_grad) == sorted(trained)
    with torch.no_grad():
        for name, p in theirs.items():
            if name in trained or name.startswith("base_model.model.score.original_module"):
                p.copy_(mine[name])
            else:
                assert torch.equal(p, mine[name]), name
    return trained


def sgd_step_equal(ours_loss: torch.Tensor, ours: torch.nn.Module, reference_loss: torch.Tensor,
                   reference: torch.nn.Module, trained: list[str]) -> None:
    """The two losses equal, and the trained weights after one SGD step from each one's gradient (which moved)."""
    torch.testing.assert_close(ours_loss, reference_loss, rtol=1e-5, atol=1e-6)
    before = {name: p.detach().clone() for name, p in ours.named_parameters() if name in trained}
    for module, value in ((ours, ours_loss), (reference, reference_loss)):
        optimizer = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=0.5)
        value.backward()
        optimizer.step()
    after, theirs = dict(ours.named_parameters()), dict(reference.named_parameters())
    for name in trained:
        torch.testing.assert_close(after[name], theirs[name], rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    assert any(not torch.equal(after[name], before[name]) for name in trained if "lora_B" in name)


def test_a_qlora_embedding_step_equals_plain_pytorch_on_the_same_4bit_base():
    """hftrain's builder (use_peft, load_in_4bit) and EmbeddingLoss on 6 rows against peft's LoRA on the tiny Llama's
    body loaded in 4 bits by transformers, the loss written here in plain PyTorch (mean of each text's real
    tokens, normalised, 20 x cosine against every positive and hard negative, cross-entropy): equal loss, and equal
    adapters after one SGD step."""
    from transformers import AutoModel, AutoTokenizer

    from hftrain.model import build_peft_model

    examples = rows(6)
    recipe = Recipe(model_name_or_path=str(REPO / "models" / "tiny-llama"), objective="embedding", pooling="mean",
                    use_peft=True, load_in_4bit=True, lora_r=4, lora_alpha=8, lora_dropout=0.0,
                    lora_target_modules=LORA_TARGETS, max_length=64)
    torch.manual_seed(0)
    ours = EmbeddingLoss(build_peft_model(recipe), recipe)
    assert "Linear4bit" in {type(m).__name__ for m in ours.lm.modules()}
    tokenizer = AutoTokenizer.from_pretrained(recipe.model_name_or_path)
    data = tokenize_rows([(f"row {i}", r) for i, r in enumerate(examples)], tokenizer, 64, None, "rows")
    batch = EmbeddingCollator(data, tokenizer.pad_token_id, tokenizer.padding_side)(list(range(6)))
    batch.pop("num_examples")
    reference = plain_lora(quantized(recipe.model_name_or_path, AutoModel), "FEATURE_EXTRACTION")
    trained = start_equal(ours.lm, reference)

    def embed(texts: list[str]) -> torch.Tensor:
        encoded = tokenizer(texts, padding=True, return_tensors="pt")
        hidden = reference(**encoded).last_hidden_state
        mask = encoded["attention_mask"].unsqueeze(-1).float()
        return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)

    anchors = embed([r["anchor"] for r in examples])
    candidates = torch.cat([embed([r["positive"] for r in examples]), embed([r["negative"] for r in examples])])
    expected = torch.nn.functional.cross_entropy(20.0 * anchors @ candidates.T, torch.arange(6))
    ours.train()
    sgd_step_equal(ours(**batch) / 6, ours.lm, expected, reference, trained)


def test_a_qlora_reranker_step_equals_plain_pytorch_on_the_same_4bit_base(classifier):
    """The classifier reranker with use_peft and load_in_4bit (peft's SEQ_CLS adapter, the score head trained whole)
    on 6 labelled pairs, against peft's LoRA on the same classifier loaded in 4 bits by transformers and binary
    cross-entropy on its logit of tokenizer(query, passage) written here: equal loss, equal trained weights after
    one SGD step."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from hftrain.data.retrieval import RerankerCollator, tokenize_pairs
    from hftrain.model import build_peft_model
    from hftrain.objectives.reranker import RerankerLoss

    examples = rows(6)
    pairs = [{"query": r["anchor"], "passage": r["positive"] if i % 2 else r["negative"], "label": i % 2}
             for i, r in enumerate(examples)]
    recipe = Recipe(model_name_or_path=classifier, objective="reranker", use_peft=True, load_in_4bit=True, lora_r=4,
                    lora_alpha=8, lora_dropout=0.0, lora_target_modules=LORA_TARGETS, max_length=64)
    ours = RerankerLoss(build_peft_model(recipe))
    assert "Linear4bit" in {type(m).__name__ for m in ours.lm.modules()}
    tokenizer = AutoTokenizer.from_pretrained(classifier)
    data = tokenize_pairs([(f"row {i}", r) for i, r in enumerate(pairs)], tokenizer, 64, "rows")
    batch = RerankerCollator(data, tokenizer.pad_token_id, tokenizer.padding_side)(list(range(6)))
    batch.pop("num_examples")
    reference = plain_lora(quantized(classifier, AutoModelForSequenceClassification, num_labels=1), "SEQ_CLS")
    trained = start_equal(ours.lm, reference)
    assert any("score" in name for name in trained)  # the new head is trained whole
    encoded = tokenizer([p["query"] for p in pairs], [p["passage"] for p in pairs], padding=True, return_tensors="pt")
    logits = reference(**encoded).logits[:, 0]
    expected = torch.nn.functional.binary_cross_entropy_with_logits(
        logits, torch.tensor([float(p["label"]) for p in pairs]))
    ours.train()
    sgd_step_equal(ours(**batch) / 6, ours.lm, expected, reference, trained)


def test_a_lora_yes_no_reranker_step_equals_plain_pytorch(yes_no_lm):
    """reranker_head yes_no with use_peft (peft's CAUSAL_LM adapter; the LM head, whose 'yes' and 'no' rows give the
    score, stays frozen) on 6 ranked rows, against peft's LoRA on the same causal LM with each pair scored alone in
    plain PyTorch (Qwen3-Reranker's prompt by str.replace, log P(yes) - log P(no) at the last position, the
    listwise cross-entropy): equal loss, equal adapters after one SGD step, the LM head unchanged."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hftrain.data.retrieval import RerankerCollator, tokenize_pairs
    from hftrain.fields.retrieval import QWEN3_RERANKER_TEMPLATE as TEMPLATE
    from hftrain.model import build_peft_model
    from hftrain.objectives.reranker import RerankerLoss

    examples = rows(6)
    data_rows = [{"query": r["anchor"], "positive": r["positive"], "negative": r["negative"]} for r in examples]
    recipe = Recipe(model_name_or_path=yes_no_lm, objective="reranker", reranker_head="yes_no", use_peft=True,
                    lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_target_modules=LORA_TARGETS, max_length=512)
    tokenizer = AutoTokenizer.from_pretrained(yes_no_lm)
    yes, no = tokenizer.convert_tokens_to_ids("yes"), tokenizer.convert_tokens_to_ids("no")
    torch.manual_seed(0)
    ours = RerankerLoss(build_peft_model(recipe), (yes, no))
    data = tokenize_pairs([(f"row {i}", r) for i, r in enumerate(data_rows)], tokenizer, 512, "rows", TEMPLATE)
    batch = RerankerCollator(data, tokenizer.pad_token_id, "left")(list(range(6)))
    batch.pop("num_examples")
    reference = plain_lora(AutoModelForCausalLM.from_pretrained(yes_no_lm), "CAUSAL_LM")
    trained = start_equal(ours.lm, reference)
    assert all("lora_" in name for name in trained)
    head = ours.lm.get_output_embeddings().weight.detach().clone()

    def score(query: str, passage: str) -> torch.Tensor:
        ids = tokenizer(TEMPLATE.replace("{query}", query).replace("{document}", passage), add_special_tokens=False,
                        return_tensors="pt")["input_ids"]
        return torch.log_softmax(reference(input_ids=ids).logits[0, -1, [yes, no]], dim=0) @ torch.tensor([1.0, -1.0])

    scores = torch.stack([torch.stack([score(r["query"], r["positive"]), score(r["query"], r["negative"])])
                          for r in data_rows])
    expected = -torch.log_softmax(scores, dim=1)[:, 0].mean()
    ours.train()
    sgd_step_equal(ours(**batch) / 6, ours.lm, expected, reference, trained)
    assert torch.equal(ours.lm.get_output_embeddings().weight, head)


def test_reranking_metrics_equal_cross_encoder_reranking_evaluator():
    """Random scores of 12 queries' candidate lists (3 to 14 documents of 40; one or two relevant among them, and for
    every fourth query a relevant document that is no candidate): NDCG@10 and MRR@10 equal sentence-transformers'
    CrossEncoderRerankingEvaluator on the same scores (documents: each candidate list in order, positives: every
    relevant document, always_rerank_positives=False); recall@k equals the share of relevant documents among the k
    best-scored candidates, counted here."""
    from types import SimpleNamespace

    from sentence_transformers.cross_encoder.evaluation import CrossEncoderRerankingEvaluator

    from hftrain.retrieval_eval import reranking_metrics

    generator = torch.Generator().manual_seed(0)
    texts = [f"document {i}" for i in range(40)]
    reranked, relevant = [], []
    for q in range(12):
        docs = torch.randperm(40, generator=generator)[:int(torch.randint(3, 15, (1,), generator=generator))].tolist()
        wanted = set(docs[-1 - q % 2:])
        if q % 4 == 0:
            wanted.add(next(d for d in range(40) if d not in docs))
        reranked.append(docs)
        relevant.append(wanted)
    scores = torch.randn(sum(len(docs) for docs in reranked), generator=generator)
    ours = reranking_metrics(scores, reranked, relevant)

    def predict(pairs, **kwargs):  # the evaluator's model: the same scores, pair for pair
        assert [text for _, text in pairs] == [texts[d] for docs in reranked for d in docs]
        return scores.numpy()

    model = SimpleNamespace(predict=predict, model_card_data=SimpleNamespace(set_evaluation_metrics=lambda *a: None))
    samples = [{"query": f"query {q}", "positive": [texts[d] for d in sorted(relevant[q])],
                "documents": [texts[d] for d in reranked[q]]} for q in range(12)]
    theirs = CrossEncoderRerankingEvaluator(samples, always_rerank_positives=False, write_csv=False)(model)
    assert ours["ndcg@10"] == pytest.approx(theirs["ndcg@10"], abs=1e-12)
    assert ours["mrr@10"] == pytest.approx(theirs["mrr@10"], abs=1e-12)
    parts = scores.split([len(docs) for docs in reranked])
    for k in (1, 5, 10):
        shares = [len(wanted & {docs[i] for i in part.argsort(descending=True)[:k].tolist()}) / len(wanted)
                  for docs, part, wanted in zip(reranked, parts, relevant, strict=True)]
        assert ours[f"recall@{k}"] == pytest.approx(sum(shares) / len(shares), abs=1e-12), k
