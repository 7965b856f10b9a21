"""objective embedding through the real entry script, against sentence-transformers 6 on the same rows and the shipped
tiny model: two optimizer steps of one process equal MultipleNegativesRankingLoss + torch's SGD on the whole batch
(losses and final weights), two DDP processes (gloo) equal that same one-process batch (the candidates gathered from
both ranks, gradients back to their owners), and accumulation trains separate contrastive batches, as documented.
The final folder loads with SentenceTransformer (pooling, normalisation, the query prompt) and with transformers, and
both give hftrain's embeddings; the model card says how to load it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.conftest import ENTRY, FSDP_LAUNCHER, REPO, Run, launch, run_script, write_jsonl
from tests.e2e import objective_checks as checks

st = pytest.importorskip("sentence_transformers")
from sentence_transformers.base.modules.transformer import Transformer  # noqa: E402
from sentence_transformers.sentence_transformer import losses  # noqa: E402
from sentence_transformers.sentence_transformer.modules import Normalize, Pooling  # noqa: E402

pytestmark = pytest.mark.launch
MODEL = REPO / "models" / "tiny-llama"
RETRIEVAL_SET = REPO / "data" / "retrieval-eval"  # the shipped queries / corpus / qrels
PROMPT = "query: "
TEXT_ONLY = {"text": {"method": "forward", "method_output_name": "last_hidden_state"}}
# 2 steps of 4 rows in file order, mean pooling, a query prompt, a hard negative per row; plain SGD at a constant
# rate and no clipping, so that the update is the gradient itself (AdamW's first steps would magnify last-bit
# differences of near-zero gradients)
EXACT = ["--model_name_or_path", str(MODEL), "--objective", "embedding", "--pooling", "mean", "--query_prompt", PROMPT,
         "--max_length", "64", "--max_steps", "2", "--logging_steps", "1", "--train_sampling_strategy", "sequential",
         "--validation_split_percentage", "0", "--optim", "sgd", "--learning_rate", "0.5", "--max_grad_norm", "0",
         "--lr_scheduler_type", "constant", "--save_strategy", "no", "--report_to", "none"]


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> tuple[list[dict], str]:
    lines = (REPO / "data" / "retrieval.jsonl").read_text(encoding="utf-8").splitlines()[:12]
    examples = [json.loads(line) for line in lines]
    return examples, str(write_jsonl(tmp_path_factory.mktemp("embedding-data") / "rows.jsonl", examples))


def st_model():
    transformer = Transformer(str(MODEL), modality_config=TEXT_ONLY, module_output_name="token_embeddings")
    return st.SentenceTransformer(modules=[transformer, Pooling(transformer.get_embedding_dimension(), "mean"),
                                           Normalize()])


def reference(examples: list[dict], batch: int, micro: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """(each step's loss, the final weights) of sentence-transformers' MultipleNegativesRankingLoss and torch's SGD,
    steps of `batch` rows in order, each step the mean over its contrastive batches of `micro` rows."""
    model = st_model()
    loss_fn = losses.MultipleNegativesRankingLoss(model, scale=20.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    step_losses = []
    for start in range(0, len(examples), batch):
        total = 0.0
        for first in range(start, start + batch, micro):
            part = examples[first:first + micro]
            features = [model.preprocess([PROMPT + r["anchor"] for r in part]),
                        model.preprocess([r["positive"] for r in part]),
                        model.preprocess([r["negative"] for r in part])]
            loss = loss_fn(features, None) * micro / batch
            loss.backward()
            total += loss.item()
        optimizer.step()
        optimizer.zero_grad()
        step_losses.append(total)
    return step_losses, {name.removeprefix("0.model."): p.detach() for name, p in model.named_parameters()}


def final_weights(run: Run) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(run.output_dir / "final" / "model.safetensors")


def assert_matches(run: Run, expected: tuple[list[float], dict[str, torch.Tensor]]) -> None:
    step_losses, weights = expected
    logged = [row["loss"] for row in run.train_rows()]
    assert logged == pytest.approx(step_losses, rel=1e-5), (logged, step_losses)
    saved = final_weights(run)
    assert saved.keys() == weights.keys()
    for name, value in weights.items():
        torch.testing.assert_close(saved[name], value, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


ONE_PROCESS = ["--per_device_train_batch_size", "4", "--retrieval_eval_dir", str(RETRIEVAL_SET), "--max_steps", "3",
               "--save_strategy", "steps", "--save_steps", "2"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, rows) -> Run:
    """3 steps of 4 rows, a checkpoint at step 2, the retrieval metrics at the final evaluation."""
    return run_script(tmp_path_factory.mktemp("embedding-one") / "out", "--dataset_name", rows[1], *EXACT,
                      *ONE_PROCESS)


def test_one_process_equals_multiple_negatives_ranking_loss(rows, one_process):
    assert_matches(one_process, reference(rows[0], batch=4, micro=4))


def test_a_resumed_run_continues_exactly(tmp_path, rows, one_process):
    """Resumed from checkpoint-2: step 3's loss and the final weights equal the uninterrupted run's."""
    checks.assert_resumes_exactly(tmp_path, one_process, ["--dataset_name", rows[1], *EXACT, *ONE_PROCESS],
                                  ("loss", "grad_norm", "accuracy"))


def test_two_processes_equal_one_process_on_the_whole_batch(tmp_path, rows):
    """2 ranks x 2 rows: each anchor's candidates are all 4 rows' positives and negatives, as in one batch of 4; in
    the cached mode (pieces of 4 of each rank's 6 texts, recomputed in backward under DDP)."""
    run = launch(tmp_path / "out", "--dataset_name", rows[1], *EXACT, "--per_device_train_batch_size", "2",
                 "--mini_batch_size", "4", preset="cpu_ddp", processes=2)
    assert "the candidates of all 2 data-parallel ranks gathered" in run.stdout + run.stderr
    assert_matches(run, reference(rows[0][:8], batch=4, micro=4))


@pytest.mark.parametrize("preset", ["zero3", "fsdp2"])
def test_sharded_presets_equal_one_process_on_the_whole_batch(tmp_path, rows, preset):
    """2 processes x 2 rows with the encoder partitioned (ZeRO-3) or sharded (FSDP2, forced on CPU by the test
    launcher): the gathered candidates and the update are those of one batch of 4 (losses, gathered final weights)."""
    run = launch(tmp_path / "out", "--dataset_name", rows[1], *EXACT, "--per_device_train_batch_size", "2",
                 preset=preset, processes=2, script=FSDP_LAUNCHER if preset == "fsdp2" else ENTRY)
    assert run.state()["launch"]["distributed_type"] == ("DEEPSPEED" if preset == "zero3" else "FSDP")
    assert_matches(run, reference(rows[0][:8], batch=4, micro=4))


def test_accumulation_trains_separate_contrastive_batches(tmp_path, rows):
    """2 micro-batches of 2 rows per step: the mean of two contrastive batches of 2 (each anchor's negatives are its
    own micro-batch's), not one batch of 4, as docs/retrieval.md says."""
    run = run_script(tmp_path / "out", "--dataset_name", rows[1], *EXACT, "--per_device_train_batch_size", "2",
                     "--gradient_accumulation_steps", "2")
    expected = reference(rows[0][:8], batch=4, micro=2)
    assert_matches(run, expected)
    assert expected[0] != pytest.approx(reference(rows[0][:8], batch=4, micro=4)[0], rel=1e-3)


def test_the_final_folder_loads_with_sentence_transformers_and_transformers(rows, one_process):
    """SentenceTransformer(final) encodes as hftrain's pooling on AutoModel.from_pretrained(final) does (mean of the
    real tokens, L2-normalised), encode_query adds the training prompt, and the card names the library and the way
    to load it."""
    from huggingface_hub import ModelCard
    from transformers import AutoModel, AutoTokenizer

    final = one_process.output_dir / "final"
    model = st.SentenceTransformer(str(final))
    texts = [r["positive"] for r in rows[0][:4]]
    encoded = model.encode(texts, convert_to_tensor=True)
    queries = model.encode_query([r["anchor"] for r in rows[0][:2]], convert_to_tensor=True)
    prompted = model.encode([PROMPT + r["anchor"] for r in rows[0][:2]], convert_to_tensor=True)
    torch.testing.assert_close(queries, prompted)

    encoder, tokenizer = AutoModel.from_pretrained(final).eval(), AutoTokenizer.from_pretrained(final)
    with torch.no_grad():  # plain transformers: the mean of each text's real tokens' last hidden states
        plain = []
        for text in texts:
            ids = tokenizer(text, return_tensors="pt")
            plain.append(torch.nn.functional.normalize(encoder(**ids).last_hidden_state[0].mean(0), dim=-1))
    torch.testing.assert_close(encoded, torch.stack(plain), rtol=1e-5, atol=1e-6)

    card = ModelCard.load(final / "README.md")
    assert card.data.library_name == "sentence-transformers" and card.data.pipeline_tag == "sentence-similarity"
    assert f'SentenceTransformer("{final.resolve()}")' in card.text


def test_the_tiny_embedding_recipe_ranks_held_out_answers_above_chance(tmp_path):
    """The shipped recipe, 20 steps: the held-out rows' loss (each question against every answer and near-miss of its
    eval batch) ends well below chance, log(candidates), and the right answer ranks first more than 3x as often as
    by chance."""
    run = run_script(tmp_path / "out", "--config", str(REPO / "recipes" / "tiny-embedding.yaml"), "--max_steps", "20",
                     "--save_strategy", "no")
    final = run.eval_rows()[-1]
    chance = math.log(2 * final["eval_anchors"])  # every positive and hard negative of the one eval batch
    assert final["eval_loss"] < chance - 1.0, (final, chance)
    assert final["eval_accuracy"] > 3 / (2 * final["eval_anchors"])  # the right answer first: 3x chance


# ------------------------------------------------------------------------------------- reranker retrieval metrics
def read_task(folder: Path) -> tuple[dict[str, str], dict[str, str], dict[str, set[str]]]:
    """(query texts, document texts, relevant document ids per query) of a BEIR folder, read here."""
    def texts(name: str) -> dict[str, str]:
        return {row["_id"]: row["text"] for row in map(json.loads, (folder / name).read_text().splitlines())}

    relevant: dict[str, set[str]] = {}
    for line in (folder / "qrels.tsv").read_text().splitlines()[1:]:
        query, doc, score = line.split("\t")
        if float(score) > 0:
            relevant.setdefault(query, set()).add(doc)
    return texts("queries.jsonl"), texts("corpus.jsonl"), relevant


@pytest.fixture(scope="module")
def candidates_task(tmp_path_factory) -> Path:
    """The shipped task with a candidates.tsv: each query's relevant document (left out for every fourth query: a
    first stage's miss) and 5 other documents drawn with seed 0, in a shuffled order."""
    import random
    import shutil

    folder = tmp_path_factory.mktemp("candidates")
    for name in ("queries.jsonl", "corpus.jsonl", "qrels.tsv"):
        shutil.copy(RETRIEVAL_SET / name, folder / name)
    queries, documents, relevant = read_task(folder)
    rng = random.Random(0)
    lines = ["query-id\tcorpus-id"]
    for i, query in enumerate(queries):
        picked = rng.sample(sorted(set(documents) - relevant.get(query, set())), 5)
        picked += sorted(relevant.get(query, set())) if i % 4 else []
        rng.shuffle(picked)
        lines += [f"{query}\t{doc}" for doc in picked]
    (folder / "candidates.tsv").write_text("\n".join(lines) + "\n")
    return folder


def cross_encoder_metrics(model, task: Path, batch_size: int = 64) -> dict[str, float]:
    """sentence-transformers' CrossEncoderRerankingEvaluator on `model` (each query's relevant texts as positives,
    its candidates.tsv documents, or the whole corpus, as documents in order, always_rerank_positives=False: a
    relevant document no candidate is missed), its ndcg@10 and mrr@10; recall@k counted here from the same model's
    scores: the share of a query's relevant documents among its k best-scored documents."""
    from sentence_transformers.cross_encoder.evaluation import CrossEncoderRerankingEvaluator

    queries, documents, relevant = read_task(task)
    assert len(set(documents.values())) == len(documents)  # the evaluator finds positives by their text
    candidates: dict[str, list[str]] = {query: [] for query in queries}
    if (task / "candidates.tsv").is_file():
        for line in (task / "candidates.tsv").read_text().splitlines()[1:]:
            query, doc = line.split("\t")
            candidates[query].append(doc)
    else:
        candidates = {query: list(documents) for query in queries}
    asked = [query for query in queries if relevant.get(query)]
    samples = [{"query": queries[q], "positive": [documents[d] for d in sorted(relevant[q])],
                "documents": [documents[d] for d in candidates[q]]} for q in asked]
    theirs = CrossEncoderRerankingEvaluator(samples, always_rerank_positives=False, batch_size=batch_size,
                                            write_csv=False)(model)
    metrics = {"ndcg@10": theirs["ndcg@10"], "mrr@10": theirs["mrr@10"]}
    recalls: dict[int, list[float]] = {1: [], 5: [], 10: []}
    for q in asked:
        scores = model.predict([(queries[q], documents[d]) for d in candidates[q]], batch_size=batch_size) \
            if candidates[q] else []
        order = sorted(range(len(scores)), key=lambda i: -scores[i])
        for k, values in recalls.items():
            values.append(len(relevant[q] & {candidates[q][i] for i in order[:k]}) / len(relevant[q]))
    return {**metrics, **{f"recall@{k}": sum(values) / len(values) for k, values in recalls.items()}}


def test_reranker_retrieval_metrics_equal_cross_encoder_reranking_evaluator(tmp_path, reranker_run, candidates_task):
    """The reranker recipe with retrieval_eval_dir (the shipped task with candidates.tsv): the final evaluation's
    eval_ndcg@10, eval_mrr@10 and eval_recall@k equal CrossEncoderRerankingEvaluator (and recall counted from
    CrossEncoder.predict) on CrossEncoder(final); `hftrain eval final --retrieval` (transformers alone) gives the
    same on that folder, and on the shipped task without candidates (the whole corpus reranked)."""
    from sentence_transformers import CrossEncoder

    from hftrain.cli import main as cli

    final = reranker_run.output_dir / "final"
    model = CrossEncoder(str(final))
    ours = [r for r in reranker_run.metrics() if "eval_ndcg@10" in r][-1]  # the final evaluation
    for task in (candidates_task, RETRIEVAL_SET):
        theirs = cross_encoder_metrics(model, task)
        cli(["eval", str(final), "--retrieval", str(task), "--output", str(tmp_path / "metrics.json")])
        offline = json.loads((tmp_path / "metrics.json").read_text())
        for name, value in theirs.items():
            assert offline[name] == pytest.approx(value, abs=1e-6), (task, name)
            if task == candidates_task:
                assert ours[f"eval_{name}"] == pytest.approx(value, abs=1e-6), name
    assert 0 < ours["eval_recall@10"] < 1  # a quarter of the relevant documents are no candidates


@pytest.fixture(scope="module")
def reranker_run(tmp_path_factory, candidates_task) -> Run:
    """The reranker recipe, 40 steps, its final evaluation reranking the candidates of `candidates_task`."""
    return run_script(tmp_path_factory.mktemp("reranker") / "out", "--config",
                      str(REPO / "recipes" / "tiny-reranker.yaml"), "--max_steps", "40", "--save_strategy", "no",
                      "--eval_strategy", "no", "--retrieval_eval_dir", str(candidates_task))


def test_the_tiny_reranker_recipe_learns_to_rank_its_training_rows(reranker_run):
    """The shipped recipe (listwise: each question's right answer against its near-miss): the training loss falls from
    chance, log 2, and most rows rank the right answer first."""
    rows = reranker_run.train_rows()
    assert rows[0]["loss"] == pytest.approx(math.log(2), abs=0.05)
    late = rows[-3:]
    assert sum(r["loss"] for r in late) / 3 < math.log(2) - 0.15, late
    assert sum(r["accuracy"] for r in late) / 3 > 0.65, late


# the reranker recipe, 2 steps of 4 ranked rows in file order, plain SGD (as EXACT), its final evaluation reranking
# the candidates of the candidates task
RERANKER_EXACT = ["--config", str(REPO / "recipes" / "tiny-reranker.yaml"), "--max_steps", "2", "--logging_steps", "1",
                  "--train_sampling_strategy", "sequential", "--validation_split_percentage", "0", "--eval_strategy",
                  "no", "--optim", "sgd", "--learning_rate", "0.5", "--max_grad_norm", "0", "--lr_scheduler_type",
                  "constant", "--warmup_steps", "0", "--save_strategy", "no"]


RANKING = ("eval_ndcg@10", "eval_mrr@10", "eval_recall@1", "eval_recall@5", "eval_recall@10")
# 3 steps of 4 rows and a checkpoint at step 2: the one-process run that the distributed runs and the resumed run
# are compared with
RESUMABLE = ["--per_device_train_batch_size", "4", "--max_steps", "3", "--save_strategy", "steps", "--save_steps", "2"]


def final_ranking(run: Run) -> dict[str, float]:
    """The final evaluation's reranking metrics."""
    final = [r for r in run.metrics() if "eval_ndcg@10" in r][-1]
    return {name: final[name] for name in RANKING}


def assert_same_training(run: Run, one: Run) -> None:
    """Each step's loss, the final weights and the final evaluation's reranking metrics of `run` equal `one`'s."""
    assert [r["loss"] for r in run.train_rows()] == pytest.approx([r["loss"] for r in one.train_rows()], rel=1e-5)
    expected, saved = final_weights(one), final_weights(run)
    assert saved.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(saved[name], value, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    assert final_ranking(run) == pytest.approx(final_ranking(one), abs=1e-6)


def launch_two(output_dir: Path, args: list[str], preset: str) -> Run:
    """`args` on 2 processes x 2 rows per step under `preset` (cpu_ddp, zero3, or fsdp2 through the test launcher that
    forces FSDP2 on the CPU), 3 steps; asserts the process count and the wrapper."""
    run = launch(output_dir, *args, "--per_device_train_batch_size", "2", "--max_steps", "3", preset=preset,
                 processes=2, script=FSDP_LAUNCHER if preset == "fsdp2" else ENTRY)
    launched = run.state()["launch"]
    assert launched["num_processes"] == 2
    assert launched["distributed_type"] == {"cpu_ddp": "MULTI_CPU", "zero3": "DEEPSPEED", "fsdp2": "FSDP"}[preset]
    return run


@pytest.fixture(scope="module")
def reranker_one_process(tmp_path_factory, candidates_task) -> Run:
    return run_script(tmp_path_factory.mktemp("reranker-one") / "out", *RERANKER_EXACT, "--retrieval_eval_dir",
                      str(candidates_task), *RESUMABLE)


@pytest.mark.parametrize("preset", ["zero3", "fsdp2"])
def test_a_sharded_reranker_equals_one_process(tmp_path, candidates_task, reranker_one_process, preset):
    """The classifier reranker on 2 processes x 2 rows with the model partitioned (ZeRO-3) or sharded (FSDP2) against
    one process of 4 rows: each step's loss, the final (gathered) weights and the final evaluation's reranking
    metrics (every rank scoring the pairs through the sharded model) are equal."""
    run = launch_two(tmp_path / "two", [*RERANKER_EXACT, "--retrieval_eval_dir", str(candidates_task)], preset)
    assert_same_training(run, reranker_one_process)


def test_a_resumed_reranker_continues_exactly(tmp_path, candidates_task, reranker_one_process):
    """The classifier reranker resumed from checkpoint-2: step 3's loss, grad norm and accuracy, the final weights and
    the final evaluation's reranking metrics equal the uninterrupted run's."""
    resumed = checks.assert_resumes_exactly(
        tmp_path, reranker_one_process, [*RERANKER_EXACT, "--retrieval_eval_dir", str(candidates_task), *RESUMABLE],
        ("loss", "grad_norm", "accuracy"))
    assert final_ranking(resumed) == pytest.approx(final_ranking(reranker_one_process), abs=1e-6)


def merge_and_assert_ranking(run: Run, task: Path, tmp_path: Path, batch_size: int = 64) -> tuple[Path, Path]:
    """`hftrain merge` of a LoRA reranker run's adapter folder into tmp_path/merged; `hftrain eval --retrieval` on
    both folders gives the run's final evaluation's reranking metrics on `task`, which equal
    CrossEncoderRerankingEvaluator on CrossEncoder(merged) (`batch_size` pairs per predict). Returns (adapter,
    merged)."""
    from sentence_transformers import CrossEncoder

    from hftrain.cli import main as cli

    adapter, merged = run.output_dir / "final", tmp_path / "merged"
    assert (adapter / "adapter_config.json").is_file()
    cli(["merge", str(adapter), str(merged)])
    assert not (merged / "adapter_config.json").exists()
    ours = final_ranking(run)
    theirs = cross_encoder_metrics(CrossEncoder(str(merged)), task, batch_size=batch_size)
    for folder in (adapter, merged):
        cli(["eval", str(folder), "--retrieval", str(task), "--output", str(tmp_path / "metrics.json")])
        offline = json.loads((tmp_path / "metrics.json").read_text())
        for name, value in theirs.items():
            assert offline[name] == pytest.approx(ours[f"eval_{name}"], abs=1e-6), (folder, name)
            assert value == pytest.approx(ours[f"eval_{name}"], abs=1e-6), name
    return adapter, merged


def test_a_lora_reranker_adapter_and_its_merge_rank_as_in_training(tmp_path, candidates_task):
    """The classifier reranker with use_peft: `hftrain eval --retrieval` on the adapter folder (peft on its base) and
    on its `hftrain merge` output gives the final evaluation's reranking metrics, and the merged folder's equal
    CrossEncoderRerankingEvaluator on CrossEncoder(merged)."""


    run = run_script(tmp_path / "out", *RERANKER_EXACT, "--retrieval_eval_dir", str(candidates_task),
                     "--per_device_train_batch_size", "4", "--use_peft", "true", "--lora_r", "4", "--lora_dropout", "0",
                     "--learning_rate", "0.05")
    merge_and_assert_ranking(run, candidates_task, tmp_path)


def test_the_reranker_folder_loads_with_cross_encoder_and_transformers(reranker_run):
    """CrossEncoder(final).predict (no activation) equals the logit of AutoModelForSequenceClassification on
    tokenizer(query, passage), one pair at a time; the card names sentence-transformers and CrossEncoder."""
    from huggingface_hub import ModelCard
    from sentence_transformers import CrossEncoder
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    final = reranker_run.output_dir / "final"
    examples = [json.loads(line) for line in
                (REPO / "data" / "retrieval.jsonl").read_text(encoding="utf-8").splitlines()[:3]]
    pairs = [(r["anchor"], text) for r in examples for text in (r["positive"], r["negative"])]
    scores = CrossEncoder(str(final)).predict(pairs, activation_fn=torch.nn.Identity(), convert_to_tensor=True)
    model, tokenizer = AutoModelForSequenceClassification.from_pretrained(final).eval(), \
        AutoTokenizer.from_pretrained(final)
    with torch.no_grad():
        plain = torch.tensor([model(**tokenizer(q, p, return_tensors="pt")).logits.item() for q, p in pairs])
    torch.testing.assert_close(scores.float(), plain, rtol=1e-5, atol=1e-6)
    card = ModelCard.load(final / "README.md")
    assert card.data.library_name == "sentence-transformers" and f'CrossEncoder("{final.resolve()}")' in card.text


def test_retrieval_metrics_equal_information_retrieval_evaluator(tmp_path, one_process):
    """The final evaluation's eval_ndcg@10, eval_mrr@10 and eval_recall@k on the shipped task, and `hftrain eval
    final --retrieval` (transformers alone), equal sentence-transformers' InformationRetrievalEvaluator on
    SentenceTransformer(final) with the same query prompt, reading the BEIR files here."""
    from sentence_transformers.sentence_transformer.evaluation import InformationRetrievalEvaluator

    from hftrain.cli import main as cli

    def texts(name: str) -> dict[str, str]:
        return {row["_id"]: row["text"] for row in map(json.loads, (RETRIEVAL_SET / name).read_text().splitlines())}

    relevant: dict[str, set[str]] = {}
    for line in (RETRIEVAL_SET / "qrels.tsv").read_text().splitlines()[1:]:
        query, doc, score = line.split("\t")
        if float(score) > 0:
            relevant.setdefault(query, set()).add(doc)
    evaluator = InformationRetrievalEvaluator(texts("queries.jsonl"), texts("corpus.jsonl"), relevant,
                                              precision_recall_at_k=[1, 5, 10], query_prompt=PROMPT, name="task",
                                              write_csv=False)
    theirs = evaluator(st.SentenceTransformer(str(one_process.output_dir / "final")))
    ours = [r for r in one_process.metrics() if "eval_ndcg@10" in r][-1]  # the final evaluation (no eval set)
    cli(["eval", str(one_process.output_dir / "final"), "--retrieval", str(RETRIEVAL_SET), "--output",
         str(tmp_path / "metrics.json")])
    offline = json.loads((tmp_path / "metrics.json").read_text())
    for name in ("ndcg@10", "mrr@10", "recall@1", "recall@5", "recall@10"):
        assert ours[f"eval_{name}"] == pytest.approx(theirs[f"task_cosine_{name}"], abs=1e-6), name
        assert offline[name] == pytest.approx(theirs[f"task_cosine_{name}"], abs=1e-6), name


def test_a_lora_embedding_adapter_loads_with_sentence_transformers_and_merges(tmp_path, rows):
    """LoRA (use_peft): step 1's loss is the base's (the adapters start as the identity) and equals
    MultipleNegativesRankingLoss's; the adapter folder loads with SentenceTransformer and `hftrain merge` writes a
    folder that loads with it too, both encoding as peft's PeftModel on AutoModel(base) with mean pooling does."""
    from peft import PeftModel
    from transformers import AutoModel, AutoTokenizer

    from hftrain.cli import main as cli

    run = run_script(tmp_path / "out", "--dataset_name", rows[1], *EXACT, "--per_device_train_batch_size", "4",
                     "--use_peft", "true", "--lora_r", "4", "--lora_dropout", "0", "--learning_rate", "0.1")
    assert run.train_rows()[0]["loss"] == pytest.approx(reference(rows[0][:8], batch=4, micro=4)[0][0], rel=1e-5)
    adapter, merged = run.output_dir / "final", tmp_path / "merged"
    cli(["merge", str(adapter), str(merged)])
    texts = [r["positive"] for r in rows[0][:4]]
    base = AutoModel.from_pretrained(MODEL)
    model, tokenizer = PeftModel.from_pretrained(base, adapter).eval(), AutoTokenizer.from_pretrained(adapter)
    with torch.no_grad():
        plain = torch.stack([torch.nn.functional.normalize(
            model(**tokenizer(text, return_tensors="pt")).last_hidden_state[0].mean(0), dim=-1) for text in texts])
    for folder in (adapter, merged):
        encoded = st.SentenceTransformer(str(folder)).encode(texts, convert_to_tensor=True)
        torch.testing.assert_close(encoded, plain, rtol=1e-4, atol=1e-5, msg=lambda m, f=folder: f"{f}: {m}")
    assert not torch.allclose(plain, st_model().encode(texts, convert_to_tensor=True), atol=1e-4)  # it trained


def test_a_bad_row_is_refused_before_the_model_loads(tmp_path, rows):
    """The entry script on rows whose third line lacks its positive: one paragraph naming file and line, a non-zero
    exit, no traceback, no weights loaded."""
    bad = [*rows[0][:2], {"anchor": "What is 1 + 1?"}, *rows[0][3:8]]
    data = write_jsonl(tmp_path / "rows.jsonl", bad)
    run = run_script(tmp_path / "out", "--dataset_name", str(data), *EXACT, check=False,
                     env={"TRANSFORMERS_VERBOSITY": "info"})  # from_pretrained then logs "loading weights file"
    said = " ".join(run.stderr.split())
    assert run.returncode != 0 and "Traceback" not in run.stderr and "loading weights file" not in run.stderr
    assert f"{data}, line 3: the row has no 'positive' field" in said


def test_chat_and_eval_tasks_refuse_embedding_and_reranker_folders(one_process, reranker_run, capsys):
    """`hftrain chat` / `hftrain eval --tasks` on an embedding model's final folder or checkpoint, or a reranker's:
    one paragraph naming what the folder is and how to use it, before any weights load (chat would otherwise load
    the encoder under a newly drawn language-model head and write noise)."""
    import transformers

    from hftrain.cli import main as cli

    # loading weights would draw transformers' bar on stderr (an in-process run before may have turned bars off)
    transformers.utils.logging.enable_progress_bar()
    embedding, reranker = one_process.output_dir / "final", reranker_run.output_dir / "final"
    checkpoint = one_process.output_dir / "checkpoint-2"
    for argv, what in ((["chat", str(embedding)], "an embedding model (sentence-transformers' SentenceTransformer)"),
                       (["eval", str(embedding), "--tasks", "hellaswag"], "an embedding model"),
                       (["chat", str(checkpoint)], "an embedding model"),
                       (["chat", str(reranker)], "a reranker (sentence-transformers' CrossEncoder)")):
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_:
            cli(argv)
        err = capsys.readouterr().err
        said = " ".join(err.split())
        assert exit_.value.code == 2 and err.count("hftrain: error") == 1 and "Traceback" not in err, err
        assert f"is {what}" in said and "writes no text" in said and "Loading weights" not in err, said


@pytest.fixture(scope="module")
def yes_no_base(tmp_path_factory) -> Path:
    """The shipped tiny Llama with 'yes' and 'no' added to its tokenizer as single tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = tmp_path_factory.mktemp("yes-no-base")
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    tokenizer.add_tokens(["yes", "no"])
    model = AutoModelForCausalLM.from_pretrained(MODEL)
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    model.save_pretrained(base)
    tokenizer.save_pretrained(base)
    return base


def yes_no_args(base: Path, task: Path) -> list[str]:
    return [*RERANKER_EXACT, "--model_name_or_path", str(base), "--reranker_head", "yes_no", "--max_length", "320",
            "--retrieval_eval_dir", str(task)]


@pytest.fixture(scope="module")
def yes_no_one_process(tmp_path_factory, yes_no_base, candidates_task) -> Run:
    return run_script(tmp_path_factory.mktemp("yes-no-one") / "out", *yes_no_args(yes_no_base, candidates_task),
                      *RESUMABLE)


@pytest.mark.parametrize("preset", ["cpu_ddp", "zero3", "fsdp2"])
def test_a_distributed_yes_no_reranker_equals_one_process(tmp_path, yes_no_base, candidates_task, yes_no_one_process,
                                                          preset):
    """reranker_head yes_no (the causal LM scoring its own 'yes'/'no' logits) on 2 processes x 2 rows under DDP,
    ZeRO-3 (partitioned) and FSDP2 (sharded) against one process of 4 rows: each step's loss, the final (gathered)
    weights and the final evaluation's reranking metrics are equal."""
    run = launch_two(tmp_path / "two", yes_no_args(yes_no_base, candidates_task), preset)
    assert_same_training(run, yes_no_one_process)


def test_a_resumed_yes_no_reranker_continues_exactly(tmp_path, yes_no_base, candidates_task, yes_no_one_process):
    """The yes/no reranker resumed from checkpoint-2: step 3's values, the final weights and the final evaluation's
    reranking metrics equal the uninterrupted run's."""
    resumed = checks.assert_resumes_exactly(tmp_path, yes_no_one_process,
                                            [*yes_no_args(yes_no_base, candidates_task), *RESUMABLE],
                                            ("loss", "grad_norm", "accuracy"))
    assert final_ranking(resumed) == pytest.approx(final_ranking(yes_no_one_process), abs=1e-6)


def test_a_yes_no_reranker_folder_scores_as_its_causal_lm(tmp_path, yes_no_base, candidates_task):
    """reranker_head yes_no (the Qwen3-Reranker form) through the entry script, 2 steps on a tiny Llama whose
    tokenizer holds 'yes' and 'no': the final folder loads with AutoModelForCausalLM, and P(yes) of the softmax over
    the 'yes' and 'no' logits at the last position of Qwen3-Reranker's prompt (built here with str.replace) equals
    CrossEncoder(final).predict, one pair at a time; the weights moved. The final evaluation's reranking metrics
    (left-padded batches) and `hftrain eval final --retrieval` (the prompt read back from the folder's chat
    template) equal CrossEncoderRerankingEvaluator on CrossEncoder(final), one pair at a time."""
    from sentence_transformers import CrossEncoder
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hftrain.cli import main as cli
    from hftrain.fields.retrieval import QWEN3_RERANKER_TEMPLATE as TEMPLATE

    base = yes_no_base
    model = AutoModelForCausalLM.from_pretrained(base)
    run = run_script(tmp_path / "out", "--config", str(REPO / "recipes" / "tiny-reranker.yaml"),
                     "--model_name_or_path", str(base), "--reranker_head", "yes_no", "--max_length", "320",
                     "--max_steps", "2", "--save_strategy", "no", "--eval_strategy", "no", "--retrieval_eval_dir",
                     str(candidates_task))
    final = tmp_path / "out" / "final"
    trained, tokenizer = AutoModelForCausalLM.from_pretrained(final).eval(), AutoTokenizer.from_pretrained(final)
    yes, no = tokenizer.convert_tokens_to_ids("yes"), tokenizer.convert_tokens_to_ids("no")
    examples = [json.loads(line) for line in
                (REPO / "data" / "retrieval.jsonl").read_text(encoding="utf-8").splitlines()[:2]]
    pairs = [(r["anchor"], text) for r in examples for text in (r["positive"], r["negative"])]
    with torch.no_grad():
        plain = torch.stack([torch.softmax(trained(**tokenizer(
            TEMPLATE.replace("{query}", q).replace("{document}", p), add_special_tokens=False, return_tensors="pt",
        )).logits[0, -1, [yes, no]], dim=0)[0] for q, p in pairs])
    cross_encoder = CrossEncoder(str(final))
    scores = torch.as_tensor(cross_encoder.predict(pairs, batch_size=1))
    torch.testing.assert_close(scores, plain, rtol=1e-5, atol=1e-6)
    assert not torch.equal(trained.lm_head.weight, model.lm_head.weight)

    ours = [r for r in run.metrics() if "eval_ndcg@10" in r]
    cli(["eval", str(final), "--retrieval", str(candidates_task), "--output", str(tmp_path / "metrics.json")])
    offline = json.loads((tmp_path / "metrics.json").read_text())
    for name, value in cross_encoder_metrics(cross_encoder, candidates_task, batch_size=1).items():
        assert ours[-1][f"eval_{name}"] == pytest.approx(value, abs=1e-6), name
        assert offline[name] == pytest.approx(value, abs=1e-6), name


def test_a_lora_yes_no_reranker_adapter_and_its_merge_score_as_in_training(tmp_path, yes_no_base, candidates_task):
    """The yes/no reranker with use_peft (peft's CAUSAL_LM adapter): `CrossEncoder` on the adapter folder and on its
    `hftrain merge` output predicts, one pair at a time, the P(yes) of peft's PeftModel on the base causal LM at the
    last position of Qwen3-Reranker's prompt (built here with str.replace); `hftrain eval --retrieval` on both
    folders gives the final evaluation's reranking metrics, which equal CrossEncoderRerankingEvaluator on
    CrossEncoder(merged)."""
    from peft import PeftModel
    from sentence_transformers import CrossEncoder
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hftrain.fields.retrieval import QWEN3_RERANKER_TEMPLATE as TEMPLATE

    run = run_script(tmp_path / "out", *yes_no_args(yes_no_base, candidates_task), "--per_device_train_batch_size",
                     "4", "--use_peft", "true", "--lora_r", "4", "--lora_dropout", "0", "--learning_rate", "0.05")
    adapter, merged = merge_and_assert_ranking(run, candidates_task, tmp_path, batch_size=1)
    tokenizer = AutoTokenizer.from_pretrained(yes_no_base)
    yes, no = tokenizer.convert_tokens_to_ids("yes"), tokenizer.convert_tokens_to_ids("no")
    examples = [json.loads(line) for line in
                (REPO / "data" / "retrieval.jsonl").read_text(encoding="utf-8").splitlines()[:2]]
    pairs = [(r["anchor"], text) for r in examples for text in (r["positive"], r["negative"])]

    def p_yes(model) -> torch.Tensor:
        with torch.no_grad():
            return torch.stack([torch.softmax(model(**tokenizer(
                TEMPLATE.replace("{query}", q).replace("{document}", p), add_special_tokens=False,
                return_tensors="pt")).logits[0, -1, [yes, no]], dim=0)[0] for q, p in pairs])

    plain = p_yes(PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(yes_no_base), adapter).eval())
    assert not torch.allclose(plain, p_yes(AutoModelForCausalLM.from_pretrained(yes_no_base).eval()), atol=1e-4)
    for folder in (adapter, merged):
        scores = torch.as_tensor(CrossEncoder(str(folder)).predict(pairs, batch_size=1))
        torch.testing.assert_close(scores, plain, rtol=1e-5, atol=1e-6, msg=lambda m, f=folder: f"{f}: {m}")


def test_a_yes_no_reranker_on_a_tokenizer_without_yes_and_no_is_refused_before_the_model_loads(tmp_path):
    """The shipped tiny Llama spells 'yes' and 'no' in pieces: one paragraph, a non-zero exit, no traceback, no
    weights loaded."""
    run = run_script(tmp_path / "out", "--config", str(REPO / "recipes" / "tiny-reranker.yaml"),
                     "--reranker_head", "yes_no", "--max_length", "320", check=False)
    said = " ".join(run.stderr.split())
    assert run.returncode != 0 and "Traceback" not in run.stderr and "Loading weights" not in run.stderr
    assert "has no single token for them" in said and "reranker_head: classifier" in said, run.stderr[-2000:]
