"""Test launcher: hftrain.finetune whose grpo completions are written by a scripted tool-calling policy.

    python tests/e2e/launchers/scripted_tools.py <finetune arguments>    (or through accelerate launch)

A random tiny model does not write tool calls, so the tool loop would never run. `ScriptedPolicy` replaces the
run's generator (for one process or DDP, whose generate has no collective): each row's turn is chosen from its
sampling seed, which hftrain derives from the row and the turn, not from the process count or the accumulation, so
every layout gets the same rollouts. For a question "What is a op b?" the first turn is a correct calculator call, a
call with an unknown operation (a failing tool), a call to a tool that does not exist, or a direct answer; after a
tool result the policy answers with it, or with it plus one. Everything after the sampler (parsing, tool execution,
masks, rewards, loss, checkpoints) is the product's. With an image-text model the run's own generate still runs on
every turn's contexts with their prompts' pixels (its tokens are replaced by the script's). With async_generation the
rollout worker process samples each turn with the same policy: `ScriptedWorker`, its entry, replaces there the
functions it samples with (the worker process imports this file without running it; nothing of hftrain's changes).
"""

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from hftrain.finetune import Finetune, main  # noqa: E402
from hftrain.parallel import run_process  # noqa: E402
from hftrain.rl import async_worker  # noqa: E402
from hftrain.rl.rollouts import Sampled  # noqa: E402

WORKER_MAIN = async_worker.worker_main  # the product's worker process, before ScriptedTools replaces it
QUESTION = re.compile(r"What is (\d+) ([-+*]) (\d+)\?")


def call(a, op, b, name="calculator") -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {{"a": {a}, "op": "{op}", "b": {b}}}}}\n</tool_call>'


class ScriptedPolicy:
    def __init__(self, tokenizer, model_generator=None):
        self.tokenizer, self.model_generator = tokenizer, model_generator  # None: the worker's (text only)

    def describe(self) -> str:
        return "a scripted tool-calling policy"

    def turn(self, prompt: list[int], seed: int) -> str:
        text = self.tokenizer.decode(prompt)
        if text.endswith("<|im_start|>assistant\n") and "<|im_start|>tool\n" in text:
            result = text.rsplit("<|im_start|>tool\n", 1)[1].split("<|im_end|>")[0]
            if not result.lstrip("-").isdigit():
                return "I cannot tell."
            return f"The answer is {int(result) + seed % 2}."
        a, op, b = QUESTION.findall(text)[-1]
        return [call(a, op, b), call(a, "/", b), call(a, op, b, name="abacus"), f"It is {a}."][seed % 4]

    def sample(self, prompts, seeds, inputs=None):
        if inputs is not None:  # an image-text model: the run's generate still runs on each turn's contexts with
            # their prompts' pixels (its tokens replaced by the script's), and says so for the test
            self.model_generator.sample(prompts, seeds, inputs)
            print(f"scripted turn: generate ran on {len(prompts)} contexts with "
                  f"{sum(len(x.get('pixel_values', ())) for x in inputs)} images", flush=True)
        return [Sampled(self.tokenizer(self.turn(p, s) + "<|im_end|>", add_special_tokens=False)["input_ids"], False)
                for p, s in zip(prompts, seeds)]


class ScriptedWorker:
    """The rollout worker process's entry (`async_worker.worker_main`, which the trainer's RolloutWorker starts with
    spawn: this object is pickled, and the worker imports this file to unpickle it): in the worker process only, the
    module-level samplers the worker calls become the scripted policy's turns, whatever the worker's model, then the
    product's worker runs. A turn's behaviour log-probs are the worker's model's, one forward over the rows
    (`behaviour_log_probs`), since the script, not the model, wrote the tokens."""

    def __init__(self, tokenizer):
        self.policy = ScriptedPolicy(tokenizer)

    def __call__(self, spec, control, results, progress):
        def scripted_rows(model, prompts, seeds, *args, **kwargs):  # as rollouts.generate_rows: (tokens, truncated)
            return [(s.completion_ids, s.truncated) for s in self.policy.sample(prompts, seeds)]

        def scripted_rows_with_logps(model, prompts, seeds, *args, **kwargs):  # rollouts.generate_rows_with_logps
            rows = scripted_rows(model, prompts, seeds)
            behaviour = async_worker.behaviour_log_probs(model, prompts, rows, spec.plan.micro_batch, spec.pad_id,
                                                         spec.temperature, spec.mask_truncated)
            return [(ids, truncated, logps) for (ids, truncated), logps in zip(rows, behaviour)]

        async_worker.generate_rows, async_worker.generate_rows_with_logps = scripted_rows, scripted_rows_with_logps
        WORKER_MAIN(spec, control, results, progress)


class ScriptedTools(Finetune):
    def setup_optimizer(self, parts):
        # the trainer's RolloutWorker (async_generation) starts its process with this entry instead of the product's
        async_worker.worker_main = ScriptedWorker(self.tokenizer)
        super().setup_optimizer(parts)  # after the objective built the rollouts and their generator
        self.feed.generator = ScriptedPolicy(self.tokenizer, self.feed.generator)


if __name__ == "__main__":
    run_process(lambda: main(runner=ScriptedTools))
