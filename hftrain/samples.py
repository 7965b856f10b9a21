"""Generated samples during training (`log_completions` for every objective but grpo, which logs rollouts): at
each evaluation the live model completes a fixed set of eval prompts, so that a run shows how its answers change,
not only a loss.

The prompts are the first `num_completion_prompts` examples of the eval set, cut where training starts: the tokens
before an example's first trained label (a chat's prompt up to its first answer, a preference pair's prompt); an
example trained on every token (plain text) keeps its first half, at most 32 tokens. Completions are greedy (the
same prompts and decoding every time: differences come from the weights), up to `completion_max_new_tokens` new
tokens (default max_completion_length, else 128), through the backend's `generation_context` (every rank
generates; sharded layouts gather the weights as grpo's sampling does). Rows go to `output_dir/completions.jsonl`
(step, prompt, completion), a W&B table (`Table`, with report_to wandb) and the console (`num_completions_to_print`).
"""

from __future__ import annotations

import json

import torch
from transformers import GenerationConfig

from hftrain.data import IGNORE_INDEX
from hftrain.errors import HftrainError
from hftrain.jsonl import keep_through
from hftrain.model import pad_token_id
from hftrain.paths import COMPLETIONS_FILE, STATE_FILE
from hftrain.run_parts import DataRun, TrainRun
from hftrain.tracking import Table

DEFAULT_NEW_TOKENS = 128
TEXT_PROMPT_TOKENS = 32  # an example without a prompt (every token trained): at most this many of its tokens


def prompt_ids(input_ids: list[int], labels: list[int]) -> list[int]:
    """The tokens before the first trained label; half of an example that trains every token (at most 32)."""
    first = next((i for i, label in enumerate(labels) if label != IGNORE_INDEX), len(labels))
    if first == 0:
        return input_ids[:max(1, min(TEXT_PROMPT_TOKENS, len(input_ids) // 2))]
    return input_ids[:first]


class CompletionSamples:
    """log_completions' evaluation add-on, built after the data (`Finetune.setup_data`) from the run's `DataRun` and
    eval set, called with its `TrainRun` at each evaluation."""

    def __init__(self, run: DataRun, eval_set):
        recipe, record = run.recipe, run.backend.record
        if run.processor is not None:
            raise HftrainError("log_completions completes text prompts, but this is an image-text model whose "
                               "prompts hold images; remove log_completions")
        if record.pp_size > 1 or record.sequence_shards > 1:
            raise HftrainError(f"log_completions generates with the model, which {record.name} splits into pipeline "
                               "stages or sequence shards that transformers' generate cannot run; remove "
                               "log_completions (try the final folder with `hftrain chat`)")
        rows = eval_set.select(range(min(recipe.num_completion_prompts, len(eval_set))))
        self.prompts = [prompt_ids(list(r["input_ids"]), list(r["labels"])) for r in rows]
        self.texts = [run.tokenizer.decode(p) for p in self.prompts]
        self.tokenizer, self.backend = run.tokenizer, run.backend
        self.to_print = len(self.prompts) if recipe.num_completions_to_print is None else \
            recipe.num_completions_to_print
        eos = run.tokenizer.eos_token_id
        new_tokens = recipe.completion_max_new_tokens or recipe.max_completion_length or DEFAULT_NEW_TOKENS
        self.config = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, eos_token_id=eos, use_cache=True,
                                       pad_token_id=pad_token_id(run.tokenizer))
        self.file = run.output_dir / COMPLETIONS_FILE
        self.started = False

    def start_file(self, run: TrainRun) -> None:
        """At the first evaluation (nothing is written before training starts): a resumed run keeps the rows up to its
        checkpoint's step, a new one starts the file empty."""
        start = 0
        if run.resume_from is not None:
            start = json.loads((run.resume_from / STATE_FILE).read_text(encoding="utf-8"))["progress"]["step"]
        keep_through(self.file, start)
        self.file.touch()
        self.started = True

    def __call__(self, run: TrainRun) -> dict:
        """Every rank generates (the same prompts, greedy); the main process writes, prints and returns the table."""
        step, device = run.progress.step, run.accelerator.device
        completions = []
        run.model.eval()  # no dropout: the same weights give the same completion on every rank
        try:
            with torch.no_grad(), self.backend.generation_context(run.model) as (module, synced):
                for prompt in self.prompts:
                    ids = torch.tensor([prompt], device=device)
                    out = module.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                          generation_config=self.config, synced_gpus=synced)
                    completions.append(self.tokenizer.decode(out[0, len(prompt):], skip_special_tokens=True))
        finally:
            run.model.train()
        if not run.accelerator.is_main_process:
            return {}
        if not self.started:
            self.start_file(run)
        rows = [{"step": step, "prompt": prompt, "completion": completion}
                for prompt, completion in zip(self.texts, completions)]
        with self.file.open("a", encoding="utf-8") as f:
            f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
        for row in rows[:self.to_print]:
            run.say(f"hftrain: completion at step {step}: {row['prompt']!r} -> {row['completion']!r}")
        return {"completions": Table(["step", "prompt", "completion"], [[r["step"], r["prompt"], r["completion"]]
                                                                        for r in rows])}
