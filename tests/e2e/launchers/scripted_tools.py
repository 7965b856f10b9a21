"""Test launcher: hftrain.finetune whose grpo completions are written by a scripted tool-calling policy.

    python tests/e2e/launchers/scripted_tools.py <finetune arguments>    (or through accelerate launch)

A random tiny model does not write tool calls, so the tool loop would never run. `ScriptedPolicy` replaces the
run's generator (for one process or DDP, whose generate has no collective): each row's turn is chosen from its
sampling seed, which hftrain derives from the row and the turn, not from the process count or the accumulation, so
every layout gets the same rollouts. For a question "What is a op b?" the first turn is a correct calculator call, a
call with an unknown operation (a failing tool), a call to a tool that does not exist, or a direct answer; after a
tool result the policy answers with it, or with it plus one. Everything after the sampler (parsing, tool execution,
masks, rewards, loss, checkpoints) is the product's. With an image-text model the run's own generate still runs on
every turn's contexts with their prompts' pixels (its tokens are replaced by the script's).
"""

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from hftrain.finetune import Finetune, main  # noqa: E402
from hftrain.parallel import run_process  # noqa: E402
from hftrain.rl.rollouts import Sampled  # noqa: E402

QUESTION = re.compile(r"What is (\d+) ([-+*]) (\d+)\?")


def call(a, op, b, name="calculator") -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {{"a": {a}, "op": "{op}", "b": {b}}}}}\n</tool_call>'


class ScriptedPolicy:
    def __init__(self, tokenizer, model_generator):
        self.tokenizer, self.model_generator = tokenizer, model_generator

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


class ScriptedTools(Finetune):
    def setup_optimizer(self, parts):
        super().setup_optimizer(parts)  # after the objective built the rollouts and their generator
        self.feed.generator = ScriptedPolicy(self.tokenizer, self.feed.generator)


run_process(lambda: main(runner=ScriptedTools))
