"""Retrieval throughput: hftrain's `objective: embedding` / `objective: reranker` against sentence-transformers 6's own
SentenceTransformerTrainer (MultipleNegativesRankingLoss) / CrossEncoderTrainer (BinaryCrossEntropyLoss) on the same
rows and the same randomly initialised model, on CPU.

    HF_HUB_OFFLINE=1 .venv/bin/python scripts/bench_retrieval.py [--reps 3 --steps 12 --threads 1 --out DIR]
    ... --quick          # a smoke run: a 2-layer model, 4 steps, one repetition (its numbers mean nothing)
    ... --write-docs     # also replace the marked results section of docs/benchmarks.md
    ... --forward-backward   # instead: one process, both libraries' forward + backward on the same batches

One invocation builds a random Llama (hidden 128, 4 layers, 4 heads, MLP 512, the tokenizer of models/tiny-llama;
about 1M parameters) and saves it twice: as a body (the embedding model; both libraries load it with AutoModel) and
as a one-output sequence classifier with its score head drawn once (the reranker). It generates STEPS x 16 rows of
questions with passages grown from scripts/make_data.py's sentences (queries of one question, passages of 2-12
sentences: short anchors, long documents, as in retrieval data):

- embedding: (anchor, positive, negative) rows, mean pooling, scale 20, no prompt;
- reranker: (query, passage, label) pairs, half of them relevant, binary cross-entropy on the logit.

Both contenders train one epoch of them in file order (hftrain `train_sampling_strategy: sequential`;
sentence-transformers with a sequential batch sampler), 16 rows per step, max_length 256, fp32, AdamW (lr 1e-4,
constant, weight decay 0, clipping at 1.0), seed 42, each run a fresh process with OMP_NUM_THREADS=--threads,
contenders alternating within each repetition (the first rotates).

Measured per run:
- tokens/s over steps 2..N: the real (unpadded) tokens of every text (pair) of steps 2..N, counted here with the
  model's tokenizer as both libraries truncate them (hftrain's logged trained_tokens is checked against the count),
  over the time of steps 2..N. hftrain: its logged step-N row (metrics rows at steps 1 and N only; the window's
  training time: data wait, forward, backward, optimizer). sentence-transformers: the time between its trainer's
  `on_step_end` callbacks of step 1 and step N (data loading with its per-batch tokenization, forward, backward,
  optimizer, the Trainer's bookkeeping).
- peak RSS: the process's maximum resident set (wait4), whole life (hftrain also saves its final folder).
- process wall: start to exit, the same way for both (imports, model load, the epoch; hftrain also saves).
Results go to OUT/bench_retrieval.json; the printed table is what docs/benchmarks.md quotes.

`--forward-backward` measures the compute of a step without either training loop, in this one process: hftrain's
loss module (EmbeddingLoss / RerankerLoss, its rows tokenized and collated by hftrain inside the timing) and
sentence-transformers' loss (its tokenization inside the timing) on the same --steps batches, forward + backward,
alternating batch by batch; separate processes on a shared machine differ run to run by more than the libraries do.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- retrieval bench: begin (written by scripts/bench_retrieval.py) -->", "<!-- retrieval bench: end -->"
SEED = 42
BATCH = 16
MAX_LENGTH = 256
SETTINGS = dict(learning_rate=1e-4, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
                optim="adamw_torch", seed=SEED)
FULL = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, intermediate_size=512)
QUICK = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
CONTENDERS = ("hftrain-embedding", "st-embedding", "hftrain-reranker", "st-reranker")


# ------------------------------------------------------------------------------------------------- setup
def build_models(shape: dict, out: Path) -> int:
    """The embedding model (a Llama body) and the reranker (the same body under a one-output score head), saved
    with the shipped tokenizer truncating at MAX_LENGTH; returns the body's parameter count."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification, LlamaModel

    tokenizer = AutoTokenizer.from_pretrained(REPO / "models" / "tiny-llama")
    tokenizer.model_max_length = MAX_LENGTH
    config = LlamaConfig(vocab_size=len(tokenizer), max_position_embeddings=MAX_LENGTH, bos_token_id=None,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, num_labels=1,
                         **shape)
    torch.manual_seed(SEED)
    body = LlamaModel(config)
    classifier = LlamaForSequenceClassification(config)
    classifier.model.load_state_dict(body.state_dict())
    for model, name in ((body, "embedding-model"), (classifier, "reranker-model")):
        model.save_pretrained(out / name)
        tokenizer.save_pretrained(out / name)
    return sum(p.numel() for p in body.parameters())


def make_rows(steps: int, out: Path) -> dict[str, Path]:
    """STEPS x BATCH rows of each kind (jsonl), from scripts/make_data.py's question/answer sentences."""
    spec = importlib.util.spec_from_file_location("make_data", REPO / "scripts" / "make_data.py")
    make_data = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_data)
    rng = random.Random(SEED)

    def passage(answer: str) -> str:
        return " ".join([answer, *(make_data.qa_pair(rng)[1] for _ in range(rng.randrange(1, 12)))])

    embedding, reranker = [], []
    for i in range(steps * BATCH):
        question, answer = make_data.qa_pair(rng)
        embedding.append({"anchor": question, "positive": passage(answer),
                          "negative": passage(make_data.qa_pair(rng)[1])})
        relevant = i % 2 == 0
        reranker.append({"query": question, "passage": passage(answer if relevant else make_data.qa_pair(rng)[1]),
                         "label": 1.0 if relevant else 0.0})
    paths = {"embedding": out / "embedding.jsonl", "reranker": out / "reranker.jsonl"}
    for kind, rows in (("embedding", embedding), ("reranker", reranker)):
        paths[kind].write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return paths


def count_tokens(kind: str, rows_path: Path, model_dir: Path) -> list[int]:
    """The real tokens of each step's texts (embedding: every anchor, positive and negative; reranker: each pair),
    as both libraries tokenize them (the tokenizer's special tokens, truncation at MAX_LENGTH)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = [json.loads(line) for line in rows_path.read_text(encoding="utf-8").splitlines()]
    if kind == "embedding":
        texts = [r[c] for r in rows for c in ("anchor", "positive", "negative")]
        lengths = [len(ids) for ids in tokenizer(texts, truncation=True, max_length=MAX_LENGTH)["input_ids"]]
        per_row = [sum(lengths[3 * i:3 * i + 3]) for i in range(len(rows))]
    else:
        per_row = [len(ids) for ids in tokenizer([r["query"] for r in rows], [r["passage"] for r in rows],
                                                 truncation=True, max_length=MAX_LENGTH)["input_ids"]]
    return [sum(per_row[s:s + BATCH]) for s in range(0, len(per_row), BATCH)]


# ------------------------------------------------------------------------------------------------- the runners
def hftrain_recipe(kind: str, model: Path, rows: Path, out: Path) -> dict:
    objective = {"objective": "embedding", "pooling": "mean"} if kind == "embedding" else {"objective": "reranker"}
    return {"model_name_or_path": str(model), "dataset_name": str(rows), **objective, "max_length": MAX_LENGTH,
            "per_device_train_batch_size": BATCH, "num_train_epochs": 1, "train_sampling_strategy": "sequential",
            "validation_split_percentage": 0, "eval_strategy": "no", "save_strategy": "no",
            "logging_steps": 10**9,  # metrics rows at step 1 and the last step
            "output_dir": str(out), "overwrite_output_dir": True, "report_to": ["none"], "disable_tqdm": True,
            **SETTINGS}


def run_st(kind: str, model: Path, rows: Path, out: Path) -> dict:
    """sentence-transformers' own trainer on the rows, in file order; the end of each optimizer step timed."""
    import datasets
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules.transformer import Transformer
    from sentence_transformers.base.sampler import DefaultBatchSampler
    from sentence_transformers.cross_encoder import CrossEncoder, CrossEncoderTrainer, CrossEncoderTrainingArguments
    from sentence_transformers.cross_encoder.losses import BinaryCrossEntropyLoss
    from sentence_transformers.sentence_transformer import (
        SentenceTransformerTrainer,
        SentenceTransformerTrainingArguments,
    )
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling
    from transformers import TrainerCallback

    step_ends: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            step_ends.append(time.perf_counter())

    def in_order(dataset, batch_size, drop_last, **kwargs):  # file order, as hftrain's sequential sampling
        return DefaultBatchSampler(torch.utils.data.SequentialSampler(dataset), batch_size=batch_size,
                                   drop_last=drop_last)

    data = datasets.Dataset.from_list([json.loads(line) for line in rows.read_text(encoding="utf-8").splitlines()])
    common = dict(output_dir=str(out), use_cpu=True, per_device_train_batch_size=BATCH, num_train_epochs=1,
                  logging_steps=10**9, save_strategy="no", report_to=[], disable_tqdm=True, batch_sampler=in_order,
                  dataloader_drop_last=False, **SETTINGS)
    if kind == "embedding":
        transformer = Transformer(str(model), module_output_name="token_embeddings",
                                  modality_config={"text": {"method": "forward",
                                                            "method_output_name": "last_hidden_state"}})
        st = SentenceTransformer(modules=[transformer, Pooling(transformer.get_embedding_dimension(), "mean"),
                                          Normalize()])
        trainer = SentenceTransformerTrainer(model=st, args=SentenceTransformerTrainingArguments(**common),
                                             train_dataset=data, loss=MultipleNegativesRankingLoss(st, scale=20.0),
                                             callbacks=[Clock()])
    else:
        transformer = Transformer(str(model), transformer_task="sequence-classification", module_output_name="scores",
                                  modality_config={"text": {"method": "forward", "method_output_name": "logits"}})
        ce = CrossEncoder(modules=[transformer])
        trainer = CrossEncoderTrainer(model=ce, args=CrossEncoderTrainingArguments(**common), train_dataset=data,
                                      loss=BinaryCrossEntropyLoss(ce), callbacks=[Clock()])
    trainer.train()
    return {"steps": len(step_ends), "steady_s": step_ends[-1] - step_ends[0]}


def forward_backward(setup: dict, batches: int, threads: int) -> list[str]:
    """--forward-backward: in this one process, hftrain's loss module and sentence-transformers' loss on the same
    `batches` batches of 16 rows (each library's own collation: hftrain's collator, sentence-transformers'
    tokenization inside the timing), forward + backward alternating batch by batch, the mean seconds of each: the
    compute of a step without the loops around it, less disturbed by other processes than separate runs."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules.transformer import Transformer
    from sentence_transformers.cross_encoder import CrossEncoder
    from sentence_transformers.cross_encoder.losses import BinaryCrossEntropyLoss
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling
    from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer

    from hftrain.config import Recipe
    from hftrain.data.retrieval import EmbeddingCollator, RerankerCollator, tokenize_pairs, tokenize_rows
    from hftrain.objectives.embedding import EmbeddingLoss
    from hftrain.objectives.reranker import RerankerLoss

    torch.set_num_threads(threads)
    lines = ["| model | hftrain, s per batch | sentence-transformers, s per batch | speed, hftrain / "
             "sentence-transformers |", "|---|---|---|---|"]
    for kind in ("embedding", "reranker"):
        model = setup[kind]["model"]
        rows = [json.loads(line) for line in setup[kind]["rows"].read_text(encoding="utf-8").splitlines()]
        tokenizer = AutoTokenizer.from_pretrained(model)
        if kind == "embedding":
            ours = EmbeddingLoss(AutoModel.from_pretrained(model), Recipe(objective="embedding", pooling="mean"))
            transformer = Transformer(str(model), module_output_name="token_embeddings",
                                      modality_config={"text": {"method": "forward",
                                                                "method_output_name": "last_hidden_state"}})
            st = SentenceTransformer(modules=[transformer, Pooling(transformer.get_embedding_dimension(), "mean"),
                                              Normalize()])
            loss = MultipleNegativesRankingLoss(st, scale=20.0)
        else:
            ours = RerankerLoss(AutoModelForSequenceClassification.from_pretrained(model))
            transformer = Transformer(str(model), transformer_task="sequence-classification",
                                      module_output_name="scores",
                                      modality_config={"text": {"method": "forward", "method_output_name": "logits"}})
            st = CrossEncoder(modules=[transformer])
            loss = BinaryCrossEntropyLoss(st)
        ours.train(), st.train()
        seconds = {"hftrain": 0.0, "st": 0.0}
        for step in range(batches):
            part = rows[step * BATCH:(step + 1) * BATCH]
            for name in ("hftrain", "st") if step % 2 else ("st", "hftrain"):
                start = time.perf_counter()
                if name == "st" and kind == "embedding":
                    value = loss([st.preprocess([r[c] for r in part]) for c in ("anchor", "positive", "negative")],
                                 None)
                elif name == "st":
                    value = loss([[r["query"] for r in part], [r["passage"] for r in part]],
                                 torch.tensor([r["label"] for r in part]))
                else:
                    places = [(f"row {i}", r) for i, r in enumerate(part)]
                    data = (tokenize_rows(places, tokenizer, MAX_LENGTH, None, "rows") if kind == "embedding" else
                            tokenize_pairs(places, tokenizer, MAX_LENGTH, "rows"))
                    collate = EmbeddingCollator if kind == "embedding" else RerankerCollator
                    batch = collate(data, tokenizer.pad_token_id, tokenizer.padding_side)(list(range(len(part))))
                    batch.pop("num_examples")
                    value = ours(**batch)
                value.backward()
                seconds[name] += time.perf_counter() - start
        ours_s, theirs_s = seconds["hftrain"] / batches, seconds["st"] / batches
        lines.append(f"| {kind} | {ours_s:.3f} | {theirs_s:.3f} | {theirs_s / ours_s:.2f}x |")
    return lines


# ------------------------------------------------------------------------------------------------- the driver
def launch(cmd: list[str], env: dict, log: Path) -> tuple[float, float]:
    """(process wall seconds, peak RSS MiB) of a child run to its end; a failure stops the benchmark."""
    with open(log, "w", encoding="utf-8") as out:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped by wait4: tell Popen
    if proc.returncode:
        raise SystemExit(f"{cmd} failed (exit {proc.returncode}):\n{log.read_text()[-4000:]}")
    return wall, usage.ru_maxrss / 1024


def one_run(name: str, rep: int, args, setup: dict) -> dict:
    library, kind = name.split("-")
    run_dir = args.out / f"{name}-{rep}"
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    model, rows, tokens = setup[kind]["model"], setup[kind]["rows"], setup[kind]["tokens"]
    steady_tokens = sum(tokens[1:])
    if library == "hftrain":
        recipe = run_dir.parent / f"{name}-{rep}-recipe.json"  # JSON is YAML
        recipe.write_text(json.dumps(hftrain_recipe(kind, model, rows, run_dir)))
        wall, rss = launch([sys.executable, "-m", "hftrain.finetune", "--config", str(recipe)], env,
                           args.out / f"{name}-{rep}.log")
        logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        train = [r for r in logged if "tokens_per_second" in r]
        assert [r["step"] for r in train] == [1, len(tokens)], [r["step"] for r in train]
        counted = train[-1]["trained_tokens"] - train[0]["trained_tokens"]
        assert counted == steady_tokens, (name, counted, steady_tokens)  # the same tokens as counted here
        tokens_per_s = train[-1]["tokens_per_second"]
    else:
        result = args.out / f"{name}-{rep}.json"
        wall, rss = launch([sys.executable, str(Path(__file__).resolve()), "--run", name, "--model", str(model),
                            "--rows", str(rows), "--result", str(result), "--out", str(run_dir)], env,
                           args.out / f"{name}-{rep}.log")
        data = json.loads(result.read_text())
        assert data["steps"] == len(tokens), (name, data)
        tokens_per_s = steady_tokens / data["steady_s"]
    return {"contender": name, "rep": rep, "tokens_per_s": tokens_per_s, "peak_rss_mb": rss, "wall_s": wall}


def table(runs: list[dict]) -> list[str]:
    lines = ["| model | contender | tokens/s (steps 2..N), median [min-max] | peak RSS (MiB), median "
             "| process wall (s), median | runs |", "|---|---|---|---|---|---|"]
    medians = {}
    for name in CONTENDERS:
        mine = [r for r in runs if r["contender"] == name]
        if not mine:
            continue
        speed = [r["tokens_per_s"] for r in mine]
        med = medians[name] = {k: statistics.median(r[k] for r in mine) for k in ("tokens_per_s", "peak_rss_mb",
                                                                                  "wall_s")}
        library, kind = name.split("-")
        label = "hftrain" if library == "hftrain" else ("SentenceTransformerTrainer" if kind == "embedding" else
                                                        "CrossEncoderTrainer")
        lines.append(f"| {kind} | {label} | {med['tokens_per_s']:,.0f} [{min(speed):,.0f}-{max(speed):,.0f}] | "
                     f"{med['peak_rss_mb']:,.0f} | {med['wall_s']:.1f} | {len(mine)} |")
    lines.append("")
    for kind in ("embedding", "reranker"):
        ours, theirs = medians.get(f"hftrain-{kind}"), medians.get(f"st-{kind}")
        if ours and theirs:
            speed, memory = (ours[key] / theirs[key] for key in ("tokens_per_s", "peak_rss_mb"))
            lines.append(f"- {kind}: hftrain / sentence-transformers = {speed:.2f}x tokens/s, {memory:.2f}x peak RSS "
                         "(medians)")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="a smoke run: a tiny model, 4 steps, one repetition")
    parser.add_argument("--contenders", nargs="+", choices=CONTENDERS, default=list(CONTENDERS))
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench-retrieval"))
    parser.add_argument("--write-docs", action="store_true", help="replace the marked section of docs/benchmarks.md")
    parser.add_argument("--forward-backward", action="store_true", help="instead: both libraries' forward + "
                        "backward on the same batches in this one process, alternating (no training loops)")
    parser.add_argument("--run", choices=CONTENDERS, help=argparse.SUPPRESS)  # a child: sentence-transformers' run
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--rows", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.run:
        result = run_st(args.run.split("-")[1], args.model, args.rows, args.out)
        args.result.write_text(json.dumps(result))
        return
    if args.quick:
        args.steps, args.reps = 4, 1
    parameters = build_models(QUICK if args.quick else FULL, args.out)
    rows = make_rows(args.steps, args.out)
    setup = {kind: {"model": args.out / f"{kind}-model", "rows": rows[kind]} for kind in ("embedding", "reranker")}
    for kind, entry in setup.items():
        entry["tokens"] = count_tokens(kind, entry["rows"], entry["model"])
    if args.forward_backward:
        print("\n".join(forward_backward(setup, args.steps, args.threads)))
        return
    load_before = [round(x, 2) for x in os.getloadavg()]
    runs = []
    for rep in range(args.reps):
        order = args.contenders[rep % len(args.contenders):] + args.contenders[:rep % len(args.contenders)]
        runs += [one_run(name, rep, args, setup) for name in order]
    load_after = [round(x, 2) for x in os.getloadavg()]
    import sentence_transformers
    import torch
    import transformers

    environment = (f"{platform.machine()}, {os.cpu_count()} cores, OMP_NUM_THREADS={args.threads}; load average "
                   f"before/after {load_before} / {load_after}; torch {torch.__version__}, transformers "
                   f"{transformers.__version__}, sentence-transformers {sentence_transformers.__version__}")
    workload = (f"Llama body of {parameters:,} parameters, {args.steps} steps x {BATCH} rows, max_length {MAX_LENGTH}; "
                f"real tokens per step: embedding {statistics.mean(setup['embedding']['tokens']):,.0f}, reranker "
                f"{statistics.mean(setup['reranker']['tokens']):,.0f} (means)")
    (args.out / "bench_retrieval.json").write_text(json.dumps({"runs": runs, "environment": environment,
                                                               "workload": workload}, indent=1))
    command = (f"python scripts/bench_retrieval.py --steps {args.steps} --reps {args.reps} --threads {args.threads}"
               + (" --quick" if args.quick else ""))
    lines = table(runs)
    print("\n".join([workload, environment, *lines]))
    if args.write_docs:
        page = (REPO / "docs" / "benchmarks.md").read_text(encoding="utf-8")
        section = "\n".join([BEGIN, f"`{command}` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
                                    f"{environment}). {workload}.", "", *lines, END])
        head, found, rest = page.partition(BEGIN)
        if not found:
            raise SystemExit(f"docs/benchmarks.md has no {BEGIN} marker")
        (REPO / "docs" / "benchmarks.md").write_text(head + section + rest.partition(END)[2], encoding="utf-8")


if __name__ == "__main__":
    main()
