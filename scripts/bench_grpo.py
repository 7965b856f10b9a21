"""GRPO throughput: hftrain (`objective: grpo`) against TRL 1.16's GRPOTrainer on the same tiny model, prompts and
settings, on CPU.

    HF_HUB_OFFLINE=1 .venv/bin/python scripts/bench_grpo.py [--steps 20 --reps 2 --threads 1 --out /tmp/bench-grpo]
    ... --write-docs   # also replace the marked results section of docs/benchmarks.md

Both train models/tiny-llama (0.18M parameters, fp32, no gradient checkpointing) on the prompts of
data/prompt_completion.jsonl with the shipped reward `hftrain.rl.example_rewards.vowel_share` and the settings of
recipes/tiny-grpo.yaml: num_generations 8, max_completion_length 8, 16 completions per step (2 prompts; batch 16,
no accumulation, steps_per_generation 1), temperature 1, dapo, beta 0, epsilon 0.2, AdamW lr 1e-2 constant, clipping
at 1.0, seed 42, for --steps optimizer steps. Each run is a fresh process (contenders alternate, --reps times),
with OMP_NUM_THREADS=--threads.

Measured per run:
- completions/s and trained tokens/s over steps 2..N (step 1's warm-up excluded): completions sampled and completion
  tokens trained (up to and including the first EOS, the tokens both count in the loss), over the time of steps
  2..N. TRL: the time between its `on_step_end` callbacks of step 1 and step N (generation, scoring, loss, optimizer,
  its per-step metric bookkeeping); tokens counted from the completion_ids its reward function receives. hftrain:
  the sum of its logged `step_time` of steps 2..N (generation, scoring, forward/backward, optimizer; its logging
  excluded), tokens from rollouts.jsonl.
- process wall time: process start to exit, measured the same way from outside for both (imports, model load,
  all steps, saving).
Results go to OUT/bench_grpo.json; the printed table is what docs/benchmarks.md quotes.

`--contenders hftrain hftrain-async trl` adds hftrain with `async_generation: true` (max_staleness 1, its rollout
worker a second process with one torch thread: one core for the worker, one for the trainer on a 2-core machine);
`--completion-length N` changes max_completion_length for every contender (longer completions: more generation
time per step against the same kind of training step), to see how the asynchronous gain follows the ratio of
generation to training time; the table then also gives hftrain's share of generation in its synchronous steps.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- grpo bench: begin (written by scripts/bench_grpo.py) -->", "<!-- grpo bench: end -->"
SETTINGS = dict(num_generations=8, max_completion_length=8, per_device_train_batch_size=16,
                gradient_accumulation_steps=1, temperature=1.0, loss_type="dapo", beta=0.0, epsilon=0.2,
                learning_rate=1e-2, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
                seed=42)
REWARD = "hftrain.rl.example_rewards.vowel_share"


def write_prompts(out: Path) -> Path:
    """The prompt column only: both get the same rows and no other column reaches the reward function."""
    path = out / "prompts.jsonl"
    rows = [json.loads(line)["prompt"] for line in (REPO / "data" / "prompt_completion.jsonl").read_text().splitlines()]
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in rows))
    return path


# ------------------------------------------------------------------------------------------------- the runners
def run_trl(model: Path, prompts: Path, steps: int, out: Path) -> dict:
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from hftrain.rl.example_rewards import vowel_share

    step_ends: list[float] = []
    step_tokens: list[int] = []

    def vowel_share_counted(prompts, completions, completion_ids, **kwargs):
        step_tokens.append(sum(len(ids) for ids in completion_ids))
        return vowel_share(prompts, completions, completion_ids, **kwargs)

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            step_ends.append(time.perf_counter())

    config = GRPOConfig(output_dir=str(out), use_cpu=True, bf16=False, gradient_checkpointing=False,
                        optim="adamw_torch", max_steps=steps, logging_steps=steps, save_strategy="no", report_to=[],
                        disable_tqdm=True, **SETTINGS)
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32),
                          reward_funcs=[vowel_share_counted], args=config,
                          processing_class=AutoTokenizer.from_pretrained(model),
                          train_dataset=datasets.load_dataset("json", data_files=str(prompts), split="train"),
                          callbacks=[Clock()])
    trainer.train()
    return {"steps": len(step_ends), "steady_s": step_ends[-1] - step_ends[0], "step_tokens": step_tokens}


def run_hftrain(model: Path, prompts: Path, steps: int, out: Path, **extra) -> dict:
    recipe = dict(model_name_or_path=str(model), dataset_name=str(prompts), objective="grpo", reward_funcs=[REWARD],
                  optim="adamw_torch", max_steps=steps, logging_steps=1, output_dir=str(out),
                  overwrite_output_dir=True, eval_strategy="no", save_strategy="no", report_to=["none"],
                  disable_tqdm=True, **SETTINGS, **extra)
    path = out.parent / f"{out.name}-recipe.json"  # beside the run's result file, {out.name}.json
    path.write_text(json.dumps(recipe))  # JSON is YAML
    proc = subprocess.run([sys.executable, "-m", "hftrain.finetune", "--config", str(path)], capture_output=True,
                          text=True)
    if proc.returncode:
        raise SystemExit(proc.stderr[-3000:])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    step_time = {r["step"]: r["step_time"] for r in rows if "step_time" in r}
    tokens: dict[int, int] = {}
    for line in (out / "rollouts.jsonl").read_text().splitlines():
        row = json.loads(line)
        tokens[row["step"]] = tokens.get(row["step"], 0) + len(row["completion_ids"])
    generation = sum(r.get("generation_time", 0.0) for r in rows if r.get("step", 0) >= 2)
    return {"steps": len(step_time), "steady_s": sum(step_time[s] for s in range(2, steps + 1)),
            "step_tokens": [tokens[s] for s in sorted(tokens)], "generation_s": generation}


def run_hftrain_async(model: Path, prompts: Path, steps: int, out: Path) -> dict:
    return run_hftrain(model, prompts, steps, out, async_generation=True, max_staleness=1)


RUNNERS = {"hftrain": run_hftrain, "hftrain-async": run_hftrain_async, "trl": run_trl}


# ------------------------------------------------------------------------------------------------- the driver
def one_run(name: str, args, prompts: Path, rep: int) -> dict:
    result = args.out / f"{name}-{rep}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--run", name, "--model", str(args.model), "--steps",
           str(args.steps), "--prompts", str(prompts), "--result", str(result),
           "--out", str(args.out / f"{name}-{rep}"), "--completion-length", str(args.completion_length)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    data = json.loads(result.read_text())
    steady_tokens = sum(data["step_tokens"][1:])
    completions = SETTINGS["per_device_train_batch_size"] * (args.steps - 1)
    assert data["steps"] == args.steps and len(data["step_tokens"]) == args.steps, (name, data)
    return {"contender": name, "rep": rep, "wall_s": wall, "steady_s": data["steady_s"],
            "completions_per_s": completions / data["steady_s"], "tokens_per_s": steady_tokens / data["steady_s"],
            "trained_tokens": sum(data["step_tokens"]),
            "generation_share": data.get("generation_s", 0.0) / data["steady_s"]}


def table(runs: list[dict], contenders: list[str]) -> list[str]:
    lines = ["| contender | completions/s (steps 2..N) | trained tokens/s (steps 2..N) | trained tokens (all steps) "
             "| process wall (s) | runs |", "|---|---|---|---|---|---|"]
    for name in contenders:
        mine = [r for r in runs if r["contender"] == name]
        med = {k: statistics.median(r[k] for r in mine) for k in ("completions_per_s", "tokens_per_s", "wall_s")}
        lines.append(f"| {name} | {med['completions_per_s']:.1f} | {med['tokens_per_s']:.0f} | "
                     f"{', '.join(str(r['trained_tokens']) for r in mine)} | {med['wall_s']:.1f} | {len(mine)} |")
    sync = [r["generation_share"] for r in runs if r["contender"] == "hftrain"]
    if "hftrain-async" in contenders and sync:
        lines.append("")
        lines.append(f"hftrain's synchronous steps spent {statistics.median(sync):.0%} of their time generating "
                     f"(median); max_completion_length {SETTINGS['max_completion_length']}.")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=REPO / "models" / "tiny-llama")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench-grpo"))
    parser.add_argument("--write-docs", action="store_true", help="replace the marked section of docs/benchmarks.md")
    parser.add_argument("--contenders", nargs="+", choices=list(RUNNERS), default=["hftrain", "trl"])
    parser.add_argument("--completion-length", type=int, default=SETTINGS["max_completion_length"])
    parser.add_argument("--run", choices=list(RUNNERS), help=argparse.SUPPRESS)  # a child: one contender
    parser.add_argument("--prompts", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    SETTINGS["max_completion_length"] = args.completion_length
    args.out.mkdir(parents=True, exist_ok=True)
    if args.run:
        sys.path.insert(0, str(REPO))
        result = RUNNERS[args.run](args.model, args.prompts, args.steps, args.out)
        args.result.write_text(json.dumps(result))
        return
    prompts = write_prompts(args.out)
    runs = [one_run(name, args, prompts, rep) for rep in range(args.reps) for name in args.contenders]
    import torch
    import trl

    environment = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, OMP_NUM_THREADS="
                   f"{args.threads}; torch {torch.__version__}, trl {trl.__version__}")
    (args.out / "bench_grpo.json").write_text(json.dumps({"runs": runs, "environment": environment,
                                                          "settings": SETTINGS, "steps": args.steps}, indent=1))
    command = (f"python scripts/bench_grpo.py --steps {args.steps} --reps {args.reps} --threads {args.threads}"
               + (f" --contenders {' '.join(args.contenders)}" if args.contenders != ["hftrain", "trl"] else "")
               + (f" --completion-length {args.completion_length}" if args.completion_length != 8 else "")
               + (" --write-docs" if args.write_docs else ""))
    lines = table(runs, args.contenders)
    print("\n".join(lines))
    if args.write_docs:
        page = (REPO / "docs" / "benchmarks.md").read_text()
        section = "\n".join([BEGIN, f"`{command}` ({time.strftime('%Y-%m-%d', time.gmtime())}; {environment}; "
                                    "medians of the runs):", "", *lines, END])
        head, _, rest = page.partition(BEGIN)
        _, _, tail = rest.partition(END)
        (REPO / "docs" / "benchmarks.md").write_text(head + section + tail)


if __name__ == "__main__":
    main()
