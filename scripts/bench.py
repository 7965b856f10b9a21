"""Side-by-side training throughput: hftrain vs transformers Trainer, TRL SFTTrainer and a hand-written loop.

    HF_HUB_OFFLINE=1 .venv/bin/python scripts/bench.py                  # full: ~9M-param Llama, 3 repetitions
    HF_HUB_OFFLINE=1 .venv/bin/python scripts/bench.py --quick --out /tmp/bench   # seconds per contender
    HF_HUB_OFFLINE=1 .venv/bin/python scripts/bench.py --contenders hftrain,trainer --reps 5
    python scripts/bench.py --size gpu --contenders hftrain_gpu,trainer,trl_packing --out DIR   # CUDA: 1B, bf16

Every contender trains the same randomly initialised Llama (built from a config and saved once) for one
epoch of the same generated chat dataset (assistant-only loss, fp32, AdamW, linear decay, clip 1.0), each in
its own fresh process, repetitions alternating between contenders. All of them get the examples tokenized by
hftrain's data pipeline (same tokens, same masks, same datasets cache), so the trained tokens are identical.

Measured per run, the same way for everyone (docs/benchmarks.md explains each number):
- trained tokens/sec: tokens with a label (labels[:, 1:] != -100) in steps 2..N over the time from the end of
  step 1 to the end of step N (the first step's warm-up is excluded, and reported as time to first step);
- time to first step: process start to the end of optimizer step 1 (imports, data, model, step 1);
- wall time: process start to the end of step N;
- peak RSS: the child's maximum resident set (wait4), whole process;
- on a CUDA machine only, two more columns: peak CUDA memory (torch.cuda.max_memory_allocated at the end of the
  run; hftrain's own peak_memory_mb, the same counter) and MFU, which only hftrain reports (its logged `mfu`:
  model FLOPs of every processed token incl. the attention term, over the peak_tflops of hftrain.metrics for the
  GPU); the other runners' MFU is left blank rather than estimated differently.
hftrain runs through its real entry point (`python -m hftrain.finetune --config <recipe>`) and is timed from
its metrics.jsonl (rows at steps 1 and N only); the others run in `--run <contender>` child processes of this
script that record a timestamp at the end of each optimizer step.

Results go to OUT/benchmarks.json (raw) and into the marked results section of OUT/benchmarks.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's hftrain, also when another one is installed in the environment
BEGIN, END = "<!-- bench results: begin (written by scripts/bench.py) -->", "<!-- bench results: end -->"


# ----------------------------------------------------------------------------------------------- settings
@dataclass(frozen=True)
class Size:
    hidden: int
    layers: int
    heads: int
    intermediate: int
    chats: int
    median_tokens: int  # log-normal chat lengths, clipped to [min_tokens, max_tokens]
    min_tokens: int
    max_tokens: int
    max_length: int
    reps: int
    threads: int | None  # OMP_NUM_THREADS for the children; None: torch's default (one per core)
    kv_heads: int | None = None  # None: as many as the attention heads
    vocab_size: int | None = None  # None: the tokenizer's (a larger one is a real model's head; ids stay < 753)
    tie_embeddings: bool = False
    bf16: bool = False  # mixed precision for every contender (fp32 weights, bf16 autocast)
    optim: str = "adamw_torch"
    accum: int = 1  # > 1: every contender takes each step as micro-batches (Trainer/TRL/loop: BATCH/accum x accum;
    #                 packed: 1 row x packed rows), so that long rows fit in GPU memory


FULL = Size(hidden=256, layers=8, heads=8, intermediate=1024, chats=256, median_tokens=230, min_tokens=33,
            max_tokens=900, max_length=1024, reps=3, threads=None)
QUICK = Size(hidden=64, layers=2, heads=4, intermediate=128, chats=32, median_tokens=70, min_tokens=33,
             max_tokens=200, max_length=256, reps=1, threads=1)  # 1 thread: a smoke run on a busy machine
# A Llama-3.2-1B-shaped model (1.24B parameters, its 128k-row tied embedding) at max_length 4096 on one GPU,
# bf16 mixed precision, fused AdamW for everyone; run by scripts/gpu_proof.py (docs/gpu-proof.md)
GPU = Size(hidden=2048, layers=16, heads=32, kv_heads=8, intermediate=8192, vocab_size=128256, tie_embeddings=True,
           chats=256, median_tokens=1000, min_tokens=64, max_tokens=4000, max_length=4096, reps=1, threads=None,
           bf16=True, optim="adamw_torch_fused", accum=4)
# The same with twice the chats (about 56 steps): the first ~10 steps of a run carry Triton's and the allocator's
# warm-up, which one 28-step epoch cannot amortise
GPU_LONG = replace(GPU, chats=512)
SIZES = {"full": FULL, "quick": QUICK, "gpu": GPU, "gpu_long": GPU_LONG}
SCALING = {  # tokens/s and peak memory against sequence length and model size (--scaling), hftrain_accum only
    "8M params, max_length 256": replace(FULL, median_tokens=60, max_tokens=230, max_length=256),
    "8M params, max_length 512": replace(FULL, median_tokens=115, max_tokens=460, max_length=512),
    "8M params, max_length 1024": FULL,
    "34M params, max_length 1024": replace(FULL, hidden=512, intermediate=2048),
}
SCALING_BEGIN, SCALING_END = "<!-- bench scaling: begin (written by scripts/bench.py --scaling) -->", \
    "<!-- bench scaling: end -->"
BATCH = 8  # sequences per optimizer step (packed contenders: as many packed rows as hold about as many tokens)
SEED = 42
LEARNING_RATE = 1e-4


@dataclass(frozen=True)
class Contender:
    kind: str  # hftrain | trainer | trl | loop
    label: str
    options: dict = field(default_factory=dict)
    packed: bool = False
    processes: int = 1  # hftrain only: > 1 launches `accelerate launch` with the cpu_ddp preset, 1 thread each
    lever: bool = False  # not in the default comparison: name it in --contenders


# The recommended setting: each step's BATCH length-grouped sequences in 4 micro-batches, collated by one
# dataloader worker while the main process computes (the levers build on it).
MICRO = {"per_device_train_batch_size": BATCH // 4, "gradient_accumulation_steps": 4}
ACCUM = {"train_sampling_strategy": "group_by_length", **MICRO, "dataloader_num_workers": 1}
GPU_DEFAULT = {"packing": True, "optim": "adamw_torch_fused", "dataloader_num_workers": 1}
CONTENDERS = {
    "hftrain": Contender("hftrain", "hftrain, length-grouped batches (train_sampling_strategy: group_by_length)",
                         {"train_sampling_strategy": "group_by_length"}),
    "hftrain_accum": Contender("hftrain", "hftrain, length-grouped, micro-batches of 2 x 4 accumulation steps, "
                                          "1 dataloader worker", ACCUM),
    "hftrain_fused": Contender("hftrain", "hftrain_accum with optim: adamw_torch_fused",
                               {**ACCUM, "optim": "adamw_torch_fused"}, lever=True),
    "hftrain_ckpt": Contender("hftrain", "hftrain_accum with gradient_checkpointing: true",
                              {**ACCUM, "gradient_checkpointing": True}, lever=True),
    "hftrain_noworker": Contender("hftrain", "hftrain_accum with dataloader_num_workers: 0 (collation in the "
                                             "training process)", {**ACCUM, "dataloader_num_workers": 0}, lever=True),
    "hftrain_compile": Contender("hftrain", "hftrain_accum with torch_compile: true",
                                 {**ACCUM, "torch_compile": True}, lever=True),
    "hftrain_ddp2": Contender("hftrain", "hftrain_accum as 2-process DDP (gloo, 1 thread each): 1 x 4 per process",
                              {**ACCUM, "per_device_train_batch_size": BATCH // 8}, processes=2, lever=True),
    # The GPU settings (docs/gpu-proof.md): packed rows, fused AdamW, one dataloader worker, bf16 from the size, and
    # hftrain's attention for packed rows (varlen on CUDA in bf16, else sdpa). hftrain_gpu_noliger is hftrain's GPU
    # default; each other one changes one lever: Liger's kernels (no fp32 logits), torch.compile, sdpa's block-diagonal
    # mask instead of varlen, the loss in chunks of 8,192 trained tokens (no fp32 logits of the whole micro-batch).
    "hftrain_gpu": Contender("hftrain", "hftrain, packing, Liger kernels, fused AdamW, 1 dataloader worker",
                             {**GPU_DEFAULT, "use_liger_kernel": True}, packed=True, lever=True),
    "hftrain_gpu_noliger": Contender(
        "hftrain", "hftrain's GPU default: packing (varlen attention on CUDA), fused AdamW, 1 dataloader worker; "
        "hftrain_gpu without Liger's kernels", GPU_DEFAULT, packed=True, lever=True),
    "hftrain_gpu_compile": Contender("hftrain", "hftrain, packing, torch_compile, fused AdamW, 1 dataloader worker",
                                     {**GPU_DEFAULT, "torch_compile": True}, packed=True, lever=True),
    "hftrain_gpu_sdpa": Contender("hftrain", "hftrain_gpu_noliger with attn_implementation: sdpa (a block-diagonal "
                                  "mask over each packed row)", {**GPU_DEFAULT, "attn_implementation": "sdpa"},
                                  packed=True, lever=True),
    "hftrain_gpu_chunked": Contender("hftrain", "hftrain_gpu_noliger with loss_chunk_tokens: 8192",
                                     {**GPU_DEFAULT, "loss_chunk_tokens": 8192}, packed=True, lever=True),
    "hftrain_random": Contender("hftrain", "hftrain, random batches padded to the longest",
                                {"train_sampling_strategy": "random"}),
    "hftrain_packed": Contender("hftrain", "hftrain, packing (BFD, padding-free, position_ids)",
                                {"packing": True}, packed=True),
    # packed rows with no block-diagonal mask on CPU: attn_implementation varlen runs there as sdpa over each document
    # (hftrain.attention.CPU_KERNEL), the causal squares of the documents instead of a masked square of each row
    "hftrain_varlen": Contender("hftrain", "hftrain, packing, attn_implementation: varlen (per-document sdpa on CPU), "
                                "1 dataloader worker", {"packing": True, "attn_implementation": "varlen",
                                                        "dataloader_num_workers": 1}, packed=True),
    "hftrain_varlen_compile": Contender("hftrain", "hftrain_varlen with torch_compile: true",
                                        {"packing": True, "attn_implementation": "varlen", "dataloader_num_workers": 1,
                                         "torch_compile": True}, packed=True, lever=True),
    "trainer": Contender("trainer", "transformers Trainer, random batches padded to the longest "
                                    "(DataCollatorForSeq2Seq)"),
    "trl_padding": Contender("trl", "TRL SFTTrainer, random batches padded to the longest",
                             {"packing": False, "padding_free": False}),
    "trl_packing": Contender("trl", "TRL SFTTrainer, packing (bfd, padding-free)",
                             {"packing": True, "packing_strategy": "bfd"}, packed=True),
    "trl_padding_free": Contender("trl", "TRL SFTTrainer, padding-free without packing (batch flattened)",
                                  {"packing": False, "padding_free": True, "max_length": None}),  # already truncated
    "loop": Contender("loop", "hand-written PyTorch loop, hftrain's length-grouped batches, HF model loss"),
    "loop_accum": Contender("loop", "the loop with hftrain_accum's batching: 2 x 4 micro-batches, HF model loss "
                                    "over the step's token count (num_items_in_batch)", MICRO),
}


# ------------------------------------------------------------------------------------------ model and data
def build_model(size: Size, out: Path) -> int:
    """A random Llama with the shipped tiny tokenizer, saved so that every contender loads the same weights."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(REPO / "models" / "tiny-llama")
    config = LlamaConfig(vocab_size=size.vocab_size or len(tokenizer), hidden_size=size.hidden,
                         intermediate_size=size.intermediate, num_hidden_layers=size.layers,
                         num_attention_heads=size.heads, num_key_value_heads=size.kv_heads or size.heads,
                         max_position_embeddings=size.max_length, bos_token_id=None,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         tie_word_embeddings=size.tie_embeddings)
    torch.manual_seed(SEED)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # a 1B model initialises in seconds there
        model = LlamaForCausalLM(config)
    model.save_pretrained(out)
    n_params = sum(p.numel() for p in model.parameters())
    del model
    if torch.cuda.is_available():  # this process holds no GPU memory while the contenders run
        torch.cuda.empty_cache()
    tokenizer.model_max_length = size.max_length
    tokenizer.save_pretrained(out)
    return n_params


def make_chats(size: Size, model_dir: Path, out: Path) -> list[int]:
    """Multi-turn chats whose rendered lengths follow a log-normal spread; returns the token lengths."""
    from transformers import AutoTokenizer

    spec = importlib.util.spec_from_file_location("make_data", REPO / "scripts" / "make_data.py")
    make_data = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_data)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rng = random.Random(SEED)

    def n_tokens(messages: list[dict]) -> int:
        return len(tokenizer(tokenizer.apply_chat_template(messages, tokenize=False), add_special_tokens=False)
                   ["input_ids"])

    # Re-rendering the whole chat after every sentence costs length^2: for long chats (the gpu size) a sentence's
    # own tokens are added instead, and the chat is measured exactly after each turn
    def grown(messages: list[dict], length: int, sentence: str) -> int:
        if size.max_tokens <= 1024:
            return n_tokens(messages)
        return length + len(tokenizer(" " + sentence, add_special_tokens=False)["input_ids"])

    chats, lengths = [], []
    for _ in range(size.chats):
        target = min(size.max_tokens, max(size.min_tokens, int(rng.lognormvariate(math.log(size.median_tokens), 0.75))))
        messages = [{"role": "system", "content": rng.choice(make_data.SYSTEMS)}] if rng.random() < 0.3 else []
        length = 0
        while length < target:  # a new turn: a short question, then an answer grown sentence by sentence
            question, answer = make_data.qa_pair(rng)
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
            length, sentences = n_tokens(messages), rng.randrange(1, 16)
            while length < target and sentences > 0:
                sentence = make_data.qa_pair(rng)[1]
                messages[-1]["content"] += " " + sentence
                length, sentences = grown(messages, length, sentence), sentences - 1
            length = n_tokens(messages)
        chats.append({"messages": messages})
        lengths.append(length)
    out.write_text("".join(json.dumps(c) + "\n" for c in chats), encoding="utf-8")
    return lengths


def base_recipe(model_dir: Path, data: Path, size: Size) -> dict:
    """The hftrain recipe every contender's settings mirror (the data fields also drive the other runners' data)."""
    return {
        "model_name_or_path": str(model_dir), "dataset_name": str(data), "assistant_only_loss": True,
        "max_length": size.max_length, "validation_split_percentage": 0, "num_train_epochs": 1, "max_steps": -1,
        "per_device_train_batch_size": BATCH, "gradient_accumulation_steps": 1, "learning_rate": LEARNING_RATE,
        "lr_scheduler_type": "linear", "warmup_steps": 0, "weight_decay": 0.0, "max_grad_norm": 1.0,
        "optim": size.optim, "bf16": size.bf16, "seed": SEED,
        "logging_steps": 10**9,  # metrics rows at step 1 and the last step
        "report_to": ["none"], "overwrite_output_dir": True,
    }


def packed_batch(lengths: list[int], max_length: int) -> int:
    """Packed rows per step holding about as many tokens as BATCH unpacked sequences."""
    return max(1, round(BATCH * statistics.mean(lengths) / max_length))


def micro_batching(packed: bool, batch: int, accum: int) -> tuple[int, int]:
    """(rows per micro-batch, micro-batches per step) for a step of `batch` rows under a size's `accum`."""
    if accum == 1:
        return batch, 1
    return (1, batch) if packed else (batch // accum, accum)


# ------------------------------------------------------------------------------- child side: the runners
def _runner_data(spec: dict):
    """hftrain's tokenizer and tokenized training set for the benchmark recipe (warm datasets cache)."""
    from hftrain.config import recipe_from_dict
    from hftrain.data import load_datasets
    from hftrain.model import build_tokenizer

    recipe = recipe_from_dict(spec["recipe"], for_training=False)
    tokenizer = build_tokenizer(recipe)
    train, _, _ = load_datasets(recipe, tokenizer)
    return recipe, tokenizer, train


class StepLog:
    """Per optimizer step: end time, trained tokens, batch slots and real tokens (in step order)."""

    def __init__(self):
        self.times: list[float] = []
        self.tokens: list[int] = []
        self.slots: list[int] = []
        self.real: list[int] = []

    def count(self, batches: list[dict], real: int) -> None:
        """The batches of one optimizer step (one batch, or a step's micro-batches) and their unpadded length."""
        self.tokens.append(sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches))
        self.slots.append(sum(b["input_ids"].numel() for b in batches))
        self.real.append(real)

    def dump(self, path: Path, accum: int = 1) -> None:
        """`accum` > 1: the counts are per micro-batch (one collator call each), `accum` of them per step."""
        import torch

        steps = len(self.times)  # batches may be collated ahead of the step that uses them
        per_step = lambda xs: [sum(xs[i:i + accum]) for i in range(0, len(xs), accum)][:steps]  # noqa: E731
        cuda = {"peak_cuda_mb": torch.cuda.max_memory_allocated() / 2**20} if torch.cuda.is_available() else {}
        path.write_text(json.dumps({"step_end_times": self.times, "step_tokens": per_step(self.tokens),
                                    "slots": sum(per_step(self.slots)), "real_tokens": sum(per_step(self.real)),
                                    **cuda}))


def _counting(collate, log: StepLog):
    def wrapped(features):
        batch = collate(features)
        log.count([batch], sum(len(f["input_ids"]) for f in features))
        return batch

    return wrapped


def _hf_arguments(spec: dict, output_dir: Path) -> dict:
    import torch

    r = spec["recipe"]
    rows, accum = spec["micro"]
    return dict(output_dir=str(output_dir), per_device_train_batch_size=rows, gradient_accumulation_steps=accum,
                num_train_epochs=1, max_steps=spec["max_steps"], learning_rate=r["learning_rate"],
                lr_scheduler_type="linear", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, optim=r["optim"],
                logging_steps=10**9, logging_first_step=True, save_strategy="no", report_to="none",
                use_cpu=not torch.cuda.is_available(),
                seed=SEED, dataloader_num_workers=0, bf16=r["bf16"], activation_checkpointing=False)


def run_hf(spec: dict, result: Path) -> None:
    """transformers Trainer or TRL SFTTrainer on the same tokenized examples."""
    import torch
    from transformers import AutoModelForCausalLM, TrainerCallback

    contender = CONTENDERS[spec["contender"]]
    recipe, tokenizer, train = _runner_data(spec)
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    log = StepLog()

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            log.times.append(time.time())

    output_dir = Path(spec["work"]) / "out"
    if contender.kind == "trainer":
        from transformers import DataCollatorForSeq2Seq, Trainer, TrainingArguments

        collate = DataCollatorForSeq2Seq(tokenizer, padding="longest", label_pad_token_id=-100)
        trainer = Trainer(model=model, args=TrainingArguments(**_hf_arguments(spec, output_dir)),
                          train_dataset=train, processing_class=tokenizer, data_collator=collate, callbacks=[Clock()])
    else:
        from trl import SFTConfig, SFTTrainer

        config = SFTConfig(**_hf_arguments(spec, output_dir), **{"max_length": recipe.max_length, **contender.options})
        trainer = SFTTrainer(model=model, args=config, train_dataset=train, processing_class=tokenizer,
                             callbacks=[Clock()])
    trainer.data_collator = _counting(trainer.data_collator, log)
    trainer.train()
    log.dump(result, accum=spec["micro"][1])


def run_loop(spec: dict, result: Path) -> None:
    """The overhead floor: hftrain's length-grouped batches, right padding, the model's own loss, plain AdamW."""
    import torch
    from transformers import AutoModelForCausalLM

    from hftrain.data import BatchPlan

    recipe, tokenizer, train = _runner_data(spec)
    ids, labels = train["input_ids"], train["labels"]
    lengths = [len(x) for x in ids]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # where hftrain and Trainer would train
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32).to(device)
    model.config.use_cache = False
    model.train()
    rows, accum = spec["micro"]
    micro = CONTENDERS[spec["contender"]].options or {"per_device_train_batch_size": rows,
                                                      "gradient_accumulation_steps": accum}
    accum = micro["gradient_accumulation_steps"]
    plan = BatchPlan(len(ids), micro["per_device_train_batch_size"], 1, accum, SEED, shuffle=True,
                     lengths=tuple(lengths))
    total = plan.steps_per_epoch if spec["max_steps"] <= 0 else min(spec["max_steps"], plan.steps_per_epoch)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.learning_rate, weight_decay=0.0,
                                  fused=recipe.optim == "adamw_torch_fused")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: 1 - i / total)
    pad = tokenizer.pad_token_id
    log = StepLog()
    micro_batches = iter(plan.micro_batches(epoch=0, rank=0))
    for _ in range(total):
        batches, real = [], 0
        for rows in [rows for rows in (next(micro_batches) for _ in range(accum)) if rows]:  # a short last step
            width = max(lengths[r] for r in rows)
            batch = {"input_ids": torch.full((len(rows), width), pad), "labels": torch.full((len(rows), width), -100)}
            for i, r in enumerate(rows):
                batch["input_ids"][i, :lengths[r]] = torch.tensor(ids[r])
                batch["labels"][i, :lengths[r]] = torch.tensor(labels[r])
            batches.append(batch)
            real += sum(lengths[r] for r in rows)
        log.count(batches, real)
        step_tokens = log.tokens[-1]
        for batch in batches:  # the model's mean over the whole step's tokens: the same update as one batch
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=recipe.bf16):
                loss = model(**{k: v.to(device) for k, v in batch.items()}, num_items_in_batch=step_tokens).loss
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        log.times.append(time.time())
    log.dump(result)


RUNNERS = {"trainer": run_hf, "trl": run_hf, "loop": run_loop}


# ------------------------------------------------------------------------------ parent side: launching
@dataclass
class Run:
    contender: str
    rep: int
    returncode: int
    start: float
    exit: float
    peak_rss_mb: float
    log: str
    steps: int = 0
    first_step_end: float = 0.0
    last_step_end: float = 0.0
    trained_tokens: int = 0
    steady_tokens: int = 0
    padding: float | None = None  # share of padded batch slots, as counted by a runner
    peak_cuda_mb: float | None = None  # CUDA machines only
    mfu: float | None = None  # hftrain on a GPU whose peak TFLOP/s hftrain.metrics knows

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.steps >= 2 and self.last_step_end > self.first_step_end

    def summary(self) -> dict:
        if not self.ok:
            return {"contender": self.contender, "rep": self.rep, "ok": False, "returncode": self.returncode,
                    "log": self.log}
        return {"contender": self.contender, "rep": self.rep, "ok": True, "steps": self.steps,
                "trained_tokens": self.trained_tokens,
                "tokens_per_second": self.steady_tokens / (self.last_step_end - self.first_step_end),
                "time_to_first_step_s": self.first_step_end - self.start,
                "wall_s": self.last_step_end - self.start, "process_s": self.exit - self.start,
                "peak_rss_mb": self.peak_rss_mb, "log": self.log,
                **{k: v for k, v in (("peak_cuda_mb", self.peak_cuda_mb), ("mfu", self.mfu)) if v is not None}}


def _first_row_time(metrics: Path) -> float | None:
    """When hftrain wrote its step-1 row: the file's mtime while that row is the only one."""
    try:
        stat, text = metrics.stat(), metrics.read_text(encoding="utf-8")
    except OSError:
        return None
    rows = [line for line in text.splitlines() if line.strip()]
    if not rows:
        return None
    return stat.st_mtime if len(rows) == 1 else time.time()  # 2 rows already: only with sub-poll-interval steps


def launch(cmd: list[str], env: dict, log_path: Path, watch: Path | None = None) -> tuple[int, float, float, float,
                                                                                          float | None]:
    """(returncode, start, exit, peak RSS MiB, time hftrain wrote its first metrics row)."""
    with open(log_path, "w", encoding="utf-8") as log:
        start = time.time()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        first_row = None
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if watch is not None and first_row is None:
                first_row = _first_row_time(watch)
            time.sleep(0.02)
        end = time.time()
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped by wait4: tell Popen
    return proc.returncode, start, end, usage.ru_maxrss / 1024, first_row


def child_env(work: Path, threads: int | None) -> dict:
    path = os.pathsep.join([str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p])  # keep a --target site
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(work / "datasets-cache"),
           "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled", "PYTHONPATH": path,
           "PYTHONUNBUFFERED": "1"}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def run_contender(name: str, rep: int, setup: dict, max_steps: int = -1) -> Run:
    contender, work = CONTENDERS[name], Path(setup["work"])
    run_dir = work / "runs" / f"{name}-{rep}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    batch = setup["packed_batch"] if contender.packed else BATCH
    rows, accum = micro_batching(contender.packed, batch, setup.get("accum", 1))
    log_path = run_dir / "log.txt"
    if contender.kind == "hftrain":
        recipe = {**setup["recipe"], "per_device_train_batch_size": rows, "gradient_accumulation_steps": accum,
                  **contender.options, "max_steps": max_steps, "output_dir": str(run_dir / "out")}
        (run_dir / "recipe.yaml").write_text(json.dumps(recipe, indent=1))  # JSON is YAML
        cmd = [sys.executable, "-m", "hftrain.finetune", "--config", str(run_dir / "recipe.yaml")]
        threads = setup["threads"]
        if contender.processes > 1:  # the cores are shared out between the processes
            cmd = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file",
                   str(REPO / "accelerate_configs" / "cpu_ddp.yaml"), "--num_processes", str(contender.processes),
                   "--main_process_port", "0", str(REPO / "hftrain" / "finetune.py"), "--config",
                   str(run_dir / "recipe.yaml")]
            threads = max(1, (os.cpu_count() or 1) // contender.processes)
        metrics = run_dir / "out" / "metrics.jsonl"
        code, start, end, rss, first_row = launch(cmd, child_env(work, threads), log_path, watch=metrics)
        run = Run(name, rep, code, start, end, rss, str(log_path))
        rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
        if code == 0 and len(rows) >= 2 and first_row is not None:
            first, last = rows[0], rows[-1]
            run.steps, run.trained_tokens = last["step"], last["trained_tokens"]
            run.steady_tokens = last["trained_tokens"] - first["trained_tokens"]
            run.first_step_end = first_row
            run.last_step_end = first_row + run.steady_tokens / last["tokens_per_second"]
            if "peak_memory_reserved_mb" in last:  # logged on CUDA only; peak_memory_mb is then max_memory_allocated
                run.peak_cuda_mb, run.mfu = last["peak_memory_mb"], last.get("mfu")
        return run
    spec = {"contender": name, "recipe": setup["recipe"], "model_dir": setup["model_dir"], "batch": batch,
            "micro": [rows, accum], "max_steps": max_steps, "work": str(run_dir)}
    (run_dir / "spec.json").write_text(json.dumps(spec))
    result = run_dir / "result.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--run", name, "--spec", str(run_dir / "spec.json"),
           "--result", str(result)]
    code, start, end, rss, _ = launch(cmd, child_env(work, setup["threads"]), log_path)
    run = Run(name, rep, code, start, end, rss, str(log_path))
    if code == 0 and result.exists():
        data = json.loads(result.read_text())
        times, tokens = data["step_end_times"], data["step_tokens"]
        run.steps, run.trained_tokens, run.steady_tokens = len(times), sum(tokens), sum(tokens[1:])
        run.first_step_end, run.last_step_end = (times[0], times[-1]) if times else (0.0, 0.0)
        run.padding = 1 - data["real_tokens"] / max(data["slots"], 1)
        run.peak_cuda_mb = data.get("peak_cuda_mb")
    return run


def hftrain_padding(setup: dict, options: dict, batch: int, processes: int = 1) -> float:
    """Share of padded slots in hftrain's batches for an epoch, from the same plan the run used."""
    from hftrain.config import recipe_from_dict
    from hftrain.data import load_datasets, row_lengths, training_plan, training_rows
    from hftrain.model import build_tokenizer

    recipe = recipe_from_dict({**setup["recipe"], "per_device_train_batch_size": batch, **options},
                              for_training=False)
    train, _, _ = load_datasets(recipe, build_tokenizer(recipe))
    rows = training_rows(train, recipe.packing, recipe.max_length)
    lengths, plan = row_lengths(train, rows), training_plan(recipe, train, rows, world=processes)
    slots = real = 0
    for rank in range(processes):
        for mb in plan.micro_batches(epoch=0, rank=rank):
            if mb:
                slots += len(mb) * max(lengths[r] for r in mb)
                real += sum(lengths[r] for r in mb)
    return 1 - real / slots


# ------------------------------------------------------------------------------------------- reporting
def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    found = {"python": platform.python_version()}
    for package in ("torch", "transformers", "accelerate", "datasets", "trl", "tokenizers"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = None
    return found


def machine(threads: int | None) -> dict:
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(memory, 1),
            "torch_threads": threads or torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "platform": platform.platform()}


def aggregate(runs: list[Run], paddings: dict) -> dict:
    """Medians over the repetitions of each contender (failed runs are listed, not averaged)."""
    table = {}
    for name in dict.fromkeys(r.contender for r in runs):
        good = [r.summary() for r in runs if r.contender == name and r.ok]
        failed = [r.summary() for r in runs if r.contender == name and not r.ok]
        row = {"label": CONTENDERS[name].label, "ok_runs": len(good), "failed_runs": len(failed),
               "padding": paddings.get(name)}
        if failed:
            row["failed_logs"] = [f["log"] for f in failed]
        if good:
            for key in ("tokens_per_second", "time_to_first_step_s", "wall_s", "process_s", "peak_rss_mb"):
                row[key] = statistics.median(g[key] for g in good)
            row["tokens_per_second_range"] = [min(g["tokens_per_second"] for g in good),
                                              max(g["tokens_per_second"] for g in good)]
            row["steps"], row["trained_tokens"] = good[0]["steps"], good[0]["trained_tokens"]
            for key in CUDA_COLUMNS:  # measured on CUDA machines only
                if all(key in g for g in good):
                    row[key] = statistics.median(g[key] for g in good)
        table[name] = row
    return table


def targets(table: dict) -> list[dict]:
    """The issue's targets, checked for every hftrain setting against the best of each anchor."""
    def best(prefix: str) -> str | None:
        names = [n for n, r in table.items() if n.startswith(prefix) and "tokens_per_second" in r]
        return max(names, key=lambda n: table[n]["tokens_per_second"]) if names else None

    trl, loop, trainer = best("trl"), best("loop"), best("trainer")
    tps = lambda n: table[n]["tokens_per_second"]  # noqa: E731
    checks = []
    for ours in [n for n, r in table.items() if n.startswith("hftrain") and "tokens_per_second" in r]:
        if trainer:
            checks.append((ours, "tokens/s >= 2.0x Trainer", tps(ours) / tps(trainer), 2.0, ">="))
            checks.append((ours, "time to first step <= Trainer's", table[ours]["time_to_first_step_s"]
                           / table[trainer]["time_to_first_step_s"], 1.0, "<="))
        if trl:
            checks.append((ours, f"tokens/s >= 1.5x best TRL ({trl})", tps(ours) / tps(trl), 1.5, ">="))
        if loop:
            checks.append((ours, "tokens/s >= 1.05x hand-written loop", tps(ours) / tps(loop), 1.05, ">="))
        if "trl_packing" in table and "peak_rss_mb" in table["trl_packing"]:
            checks.append((ours, "peak RSS <= TRL packing's",
                           table[ours]["peak_rss_mb"] / table["trl_packing"]["peak_rss_mb"], 1.0, "<="))
    return [{"target": t, "hftrain_setting": ours, "ratio": round(v, 3),
             "met": v >= bound if op == ">=" else v <= bound} for ours, t, v, bound, op in checks]


CUDA_COLUMNS = {"peak_cuda_mb": ("peak CUDA memory (MB)", "{:,.0f}"), "mfu": ("MFU", "{:.1%}")}


def cuda_columns(table: dict) -> list[str]:
    """The CUDA-only columns: shown when some contender measured CUDA memory, i.e. never on a CPU machine."""
    return list(CUDA_COLUMNS) if any("peak_cuda_mb" in row for row in table.values()) else []


def markdown(report: dict) -> str:
    table, env = report["results"], report["environment"]
    extra = cuda_columns(table)

    def cells(row: dict | None) -> str:  # the CUDA columns of one row ("-": not measured, e.g. MFU of non-hftrain)
        return "".join(f" {CUDA_COLUMNS[k][1].format(row[k]) if row and k in row else '-'} |" for k in extra)

    reference = table.get("trainer", {}).get("tokens_per_second")
    lines = [
        f"Command: `{report['command']}`  ",
        f"Date: {report['date']}; {report['mode']} mode, {report['reps']} repetition(s) per contender, alternating; "
        f"load average before/after: {report['load_before']} / {report['load_after']}  ",
        f"Machine: {env['machine']['cpu']}, {env['machine']['cores']} cores, {env['machine']['memory_gib']} GiB, "
        f"torch threads {env['machine']['torch_threads']}, GPU: {env['machine']['cuda'] or 'none'}  ",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in env["versions"].items()) + "  ",
        f"Workload: Llama with {report['model_parameters']:,} parameters, {report['data']['chats']} chats of "
        f"{report['data']['min_tokens']}-{report['data']['max_tokens']} tokens "
        f"(median {report['data']['median_tokens']}), max_length {report['data']['max_length']}, {BATCH} sequences "
        f"per optimizer step ({report['packed_batch']} packed rows for packing), {report.get('precision', 'fp32')}, "
        "AdamW, assistant-only loss, one epoch. Raw numbers: `benchmarks.json`.",
        "",
        "| contender | setting | steps | trained tokens/s (median, min-max) | vs Trainer | time to first step (s) | "
        "wall for N steps (s) | peak RSS (MB) | padding share |" + "".join(f" {CUDA_COLUMNS[k][0]} |" for k in extra),
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |" + " --- |" * len(extra),
    ]
    for name, row in table.items():
        padding = f"{row['padding']:.0%}" if row.get("padding") is not None else "-"
        if "tokens_per_second" not in row:
            lines.append(f"| {name} | {row['label']} | - | failed ({row['failed_runs']} run(s), see log) | - | - | - | "
                         f"- | {padding} |" + cells(None))
            continue
        low, high = row["tokens_per_second_range"]
        ratio = f"{row['tokens_per_second'] / reference:.2f}x" if reference else "-"
        lines.append(f"| {name} | {row['label']} | {row['steps']} | {row['tokens_per_second']:,.0f} ({low:,.0f}-"
                     f"{high:,.0f}) | {ratio} | {row['time_to_first_step_s']:.1f} | {row['wall_s']:.1f} | "
                     f"{row['peak_rss_mb']:,.0f} | {padding} |" + cells(row))
    if report["targets"]:
        settings = list(dict.fromkeys(t["hftrain_setting"] for t in report["targets"]))
        names = list(dict.fromkeys(t["target"] for t in report["targets"]))
        cell = {(t["target"], t["hftrain_setting"]): f"{t['ratio']} {'yes' if t['met'] else 'NO'}"
                for t in report["targets"]}
        lines += ["", "| target (ratio, met) | " + " | ".join(settings) + " |", "| --- |" + " --- |" * len(settings)]
        lines += [f"| {name} | " + " | ".join(cell.get((name, s), "-") for s in settings) + " |" for name in names]
        winners = [s for s in settings if all(t["met"] for t in report["targets"] if t["hftrain_setting"] == s)]
        lines += ["", f"hftrain settings meeting every target: {', '.join(winners) or 'none'}"]
    if report.get("skipped"):
        lines += ["", f"Not run (past the --budget): {', '.join(report['skipped'])}"]
    return "\n".join(lines)


def write_report(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "benchmarks.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    doc = out / "benchmarks.md"
    section = f"{BEGIN}\n{markdown(report)}\n{END}"
    text = doc.read_text(encoding="utf-8") if doc.exists() else f"# Benchmark results\n\n{BEGIN}\n{END}\n"
    if BEGIN not in text or END not in text:
        text = text.rstrip("\n") + f"\n\n{BEGIN}\n{END}\n"
    head, rest = text.split(BEGIN, 1)
    doc.write_text(head + section + rest.split(END, 1)[1], encoding="utf-8")


# ------------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny model and data, 1 repetition, no warm-up "
                        "(= --size quick)")
    parser.add_argument("--size", choices=list(SIZES), help="model and data: full (default), quick, or gpu (a "
                        "1.24B Llama at max_length 4096, bf16, micro-batches: for one CUDA GPU)")
    parser.add_argument("--out", type=Path, help="where benchmarks.md/.json go (default docs/; with --quick "
                        "outputs/bench-quick, so a smoke run never replaces the real results)")
    parser.add_argument("--contenders", default=",".join(n for n, c in CONTENDERS.items() if not c.lever),
                        help="comma-separated subset of: " + ", ".join(CONTENDERS) + " (default: all but the levers)")
    parser.add_argument("--reps", type=int, help="repetitions per contender (default 3, quick 1)")
    parser.add_argument("--work", type=Path, help="working folder (default: a temporary one, removed at the end)")
    parser.add_argument("--no-warmup", dest="warmup", action="store_false",
                        help="skip the untimed 2-step run per contender that warms the datasets and OS caches")
    parser.add_argument("--budget", type=float, help="seconds the whole benchmark may take: a run whose start "
                        "would let the longest run so far end past it is skipped and listed in the report")
    parser.add_argument("--scaling", action="store_true", help="instead of the comparison: hftrain_accum at each "
                        "sequence length and model size of SCALING (one warm run each), into the scaling section")
    parser.add_argument("--run", help=argparse.SUPPRESS)  # child side: run one contender
    parser.add_argument("--spec", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.run:
        spec = json.loads(args.spec.read_text())
        RUNNERS[CONTENDERS[args.run].kind](spec, args.result)
        return

    names = [n.strip() for n in args.contenders.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONTENDERS]
    if unknown or not names:
        parser.error(f"unknown contender(s) {unknown}; choose from {', '.join(CONTENDERS)}")
    size = SIZES[args.size or ("quick" if args.quick else "full")]
    out = args.out or (REPO / "docs" if size is FULL else REPO / "outputs" / f"bench-{args.size or 'quick'}")
    work = args.work or Path(tempfile.mkdtemp(prefix="hftrain-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    os.environ["HF_DATASETS_CACHE"] = str(work / "datasets-cache")  # read by hftrain_padding: the runs' cache
    completed = False  # an exception or a failed run keeps the working folder (and the logs) for inspection
    try:
        command = "HF_HUB_OFFLINE=1 .venv/bin/python scripts/bench.py " + " ".join(sys.argv[1:] if argv is None
                                                                                  else argv)
        runs = scaling(work, out, command) if args.scaling else \
            bench(names, size, args.reps or size.reps, args.warmup and size is not QUICK, work, out, command,
                  args.budget)
        completed = all(r.ok for r in runs)
    finally:
        if args.work is None and completed:
            shutil.rmtree(work, ignore_errors=True)
    if not completed:
        print(f"bench: {sum(not r.ok for r in runs)} run(s) failed; their logs are kept under {work}",
              file=sys.stderr)
        sys.exit(1)


def scaling(work: Path, out: Path, command: str) -> list[Run]:
    """hftrain_accum, one warm repetition per size of SCALING, into OUT/benchmarks.md's scaling section."""
    runs, rows = [], []
    for label, size in SCALING.items():
        folder = work / label.replace(" ", "_").replace(",", "")
        model_dir, data = folder / "model", folder / "chats.jsonl"
        n_params = build_model(size, model_dir)
        lengths = make_chats(size, model_dir, data)
        setup = {"work": str(folder), "model_dir": str(model_dir), "recipe": base_recipe(model_dir, data, size),
                 "packed_batch": packed_batch(lengths, size.max_length), "threads": size.threads}
        run_contender("hftrain_accum", -1, setup, max_steps=2)  # warm tokenization and page caches
        run = run_contender("hftrain_accum", 0, setup)
        runs.append(run)
        done = run.summary()
        print(f"bench: scaling {label}: " + (f"{done['tokens_per_second']:,.0f} trained tokens/s, peak RSS "
              f"{done['peak_rss_mb']:,.0f} MB" if run.ok else f"FAILED, log {run.log}"), flush=True)
        rows.append(f"| {n_params:,} | {size.hidden} x {size.layers} | {size.max_length} | {min(lengths)}-"
                    f"{max(lengths)} (median {int(statistics.median(lengths))}) | "
                    + (f"{done['tokens_per_second']:,.0f} | {done['peak_rss_mb']:,.0f} |" if run.ok
                       else "failed | - |"))
    table = "\n".join([
        f"Command: `{command}`  ",
        f"Date: {time.strftime('%Y-%m-%d %H:%M %Z')}; `hftrain_accum` (length-grouped, 2 x 4 micro-batches), one "
        f"warm run per row, {FULL.chats} chats each",
        "",
        "| parameters | hidden x layers | max_length | chat tokens | trained tokens/s | peak RSS (MB) |",
        "| --- | --- | --- | --- | --- | --- |", *rows])
    out.mkdir(parents=True, exist_ok=True)
    doc = out / "benchmarks.md"
    text = doc.read_text(encoding="utf-8") if doc.exists() else "# Benchmark results\n"
    if SCALING_BEGIN not in text:
        text = text.rstrip("\n") + f"\n\n{SCALING_BEGIN}\n{SCALING_END}\n"
    head, rest = text.split(SCALING_BEGIN, 1)
    doc.write_text(head + f"{SCALING_BEGIN}\n{table}\n{SCALING_END}" + rest.split(SCALING_END, 1)[1],
                   encoding="utf-8")
    print(table)
    return runs


def bench(names: list[str], size: Size, reps: int, warmup: bool, work: Path, out: Path, command: str,
          budget: float | None = None) -> list[Run]:
    """Build the model and data, run every contender `reps` times (alternating), write the report. `budget`
    (seconds from the start): a run is not started when the longest run so far would end past it; the report lists
    the contenders it skipped (a device call with a time limit still returns the runs that fit)."""
    started = time.time()
    model_dir, data = work / "model", work / "chats.jsonl"
    n_params = build_model(size, model_dir)
    lengths = make_chats(size, model_dir, data)
    setup = {"work": str(work), "model_dir": str(model_dir), "recipe": base_recipe(model_dir, data, size),
             "packed_batch": packed_batch(lengths, size.max_length), "threads": size.threads, "accum": size.accum}
    print(f"bench: {n_params:,}-parameter Llama, {len(lengths)} chats of {min(lengths)}-{max(lengths)} tokens "
          f"in {work}; contenders {', '.join(names)}, {reps} repetition(s)", flush=True)
    load_before = [round(x, 2) for x in os.getloadavg()]
    if warmup:
        for name in names:
            run_contender(name, -1, setup, max_steps=2)  # fills the tokenization cache and the page cache
    runs, skipped = [], []
    for rep in range(reps):
        for name in names[rep % len(names):] + names[:rep % len(names)]:  # alternate, rotating who goes first
            longest = max((r.exit - r.start for r in runs), default=0.0)
            if budget is not None and runs and time.time() + longest > started + budget:
                skipped.append(name)
                print(f"bench: {name} rep {rep} skipped: the longest run so far ({longest:.0f} s) would end past the "
                      f"budget of {budget:.0f} s", flush=True)
                continue
            run = run_contender(name, rep, setup)
            runs.append(run)
            done = run.summary()
            print(f"bench: {name} rep {rep}: " + (f"{done['tokens_per_second']:,.0f} trained tokens/s, first step "
                  f"after {done['time_to_first_step_s']:.1f} s, peak RSS {done['peak_rss_mb']:,.0f} MB" if run.ok
                  else f"FAILED (exit {run.returncode}), log {run.log}"), flush=True)
    load_after = [round(x, 2) for x in os.getloadavg()]

    paddings = {}
    for name in dict.fromkeys(r.contender for r in runs):
        contender = CONTENDERS[name]
        counted = [r.padding for r in runs if r.contender == name and r.padding is not None]
        if contender.kind == "hftrain":
            rows, accum = micro_batching(contender.packed, setup["packed_batch"] if contender.packed else BATCH,
                                         setup["accum"])
            paddings[name] = hftrain_padding(setup, {"gradient_accumulation_steps": accum, **contender.options},
                                             rows, contender.processes)
        elif counted:
            paddings[name] = statistics.mean(counted)
    table = aggregate(runs, paddings)
    report = {
        "command": command, "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "mode": next(name for name, known in SIZES.items() if known is size),
        "precision": "bf16" if size.bf16 else "fp32",
        "reps": reps, "load_before": load_before, "load_after": load_after,
        "environment": {"versions": versions(), "machine": machine(size.threads)},
        "model_parameters": n_params, "packed_batch": setup["packed_batch"],
        "data": {"chats": len(lengths), "min_tokens": min(lengths), "max_tokens": max(lengths),
                 "median_tokens": int(statistics.median(lengths)), "max_length": size.max_length},
        "results": table, "targets": targets(table), "runs": [r.summary() for r in runs],
        "skipped": list(dict.fromkeys(skipped)),
    }
    write_report(report, out)
    print(markdown(report))
    print(f"bench: wrote {out / 'benchmarks.md'} and {out / 'benchmarks.json'}")
    return runs


if __name__ == "__main__":
    main()
