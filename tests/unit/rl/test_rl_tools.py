"""hftrain.rl.tools: loading and checking tools before the model loads, and the multi-turn rollout, on the tiny
tool-calling tokenizer (models/tiny-tools: a Qwen-style template with tools and a response_template in its
tokenizer_config.json). The rollouts are sampled by a scripted policy (token lists chosen from the prompt), and the
masks are checked against the chat template's own rendering of the whole conversation."""

from __future__ import annotations

import re
import time

import pytest
import torch
import yaml
from transformers import AutoTokenizer

from hftrain.data import IGNORE_INDEX
from hftrain.rl.example_tools import calculator
from hftrain.rl.rollouts import Completion, Sampled, collate
from hftrain.rl.tools import (
    ToolLoop,
    ToolRunner,
    load_environment,
    load_tools,
    template_problems,
    tool_suffix_ids,
)
from tests.conftest import REPO

TOOLS_MODEL = REPO / "models" / "tiny-tools"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TOOLS_MODEL)


def call_text(a, op, b) -> str:
    return f'<tool_call>\n{{"name": "calculator", "arguments": {{"a": {a}, "op": "{op}", "b": {b}}}}}\n</tool_call>'


class Scripted:
    """A policy: after a tool result it answers with the result; otherwise it writes `first` (a turn's text)."""

    def __init__(self, tokenizer, first: list[str], answer=lambda result: f"The answer is {result}."):
        self.tokenizer, self.first, self.answer = tokenizer, first, answer
        self.calls: list[list[list[int]]] = []

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def __call__(self, prompts: list[list[int]], seeds: list[int]) -> list[Sampled]:
        self.calls.append(prompts)
        out = []
        for k, p in enumerate(prompts):
            text = self.tokenizer.decode(p)
            if text.endswith("<|im_end|>\n<|im_start|>assistant\n") and "<|im_start|>tool\n" in text:
                result = text.rsplit("<|im_start|>tool\n", 1)[1].split("<|im_end|>")[0]
                ids = self.encode(self.answer(result) + "<|im_end|>")
            else:
                ids = self.encode(self.first[k % len(self.first)] + "<|im_end|>")
            out.append(Sampled(ids, False))
        return out


def prompt_ids(tokenizer, question: str, tools) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], tools=tools,
                                         add_generation_prompt=True, tokenize=True, return_dict=False)


def loop(tokenizer, max_iterations=None, max_completion_length=200, timeout=5.0):
    return ToolLoop(tokenizer, ToolRunner(timeout), max_iterations, max_completion_length, 512)


def test_a_call_its_result_and_the_answer_with_the_template_tokens_masked(tokenizer):
    """The completion is what the chat template renders for the conversation after the prompt (the assistant's call,
    the tool message, the assistant's answer); tool_mask is 0 exactly on the tool message and the next assistant
    header (the template's tokens after the calling turn's <|im_end|>), 1 on what the model wrote; the messages are
    what reward functions see."""
    tools = [calculator]
    prompt = prompt_ids(tokenizer, "What is 6 * 7?", tools)
    policy = Scripted(tokenizer, [call_text(6, "*", 7)])
    [episode] = loop(tokenizer).run(policy, [prompt], lambda i, turn: turn, [{"calculator": calculator}], [tools])
    called = {"name": "calculator", "arguments": {"a": 6, "op": "*", "b": 7}}
    messages = [{"role": "user", "content": "What is 6 * 7?"},
                {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": called}]},
                {"role": "tool", "name": "calculator", "content": "42"},
                {"role": "assistant", "content": "The answer is 42."}]
    whole = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=False)
    assert whole[:len(prompt)] == prompt
    assert episode.completion_ids == whole[len(prompt):-1]  # the template's final "\n" after <|im_end|> is not sampled
    text = tokenizer.decode(episode.completion_ids)
    masked = tokenizer.decode([t for t, m in zip(episode.completion_ids, episode.tool_mask) if m == 0])
    assert masked == "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    assert text.count("<|im_end|>") == 3 and episode.tool_mask[-1] == 1 and not episode.truncated
    assert [c.record() for c in episode.calls] == [{"name": "calculator", "arguments": {"a": 6, "op": "*", "b": 7},
                                                    "result": "42", "failed": False, "kept": True}]
    assert episode.messages == messages[1:]
    assert [len(c) for c in policy.calls] == [1, 1]  # the second turn sampled after the tool result
    answer_starts = episode.tool_mask.index(1, episode.tool_mask.index(0))
    assert policy.calls[1][0] == prompt + episode.completion_ids[:answer_starts]


def test_collated_labels_leave_tool_tokens_untrained(tokenizer):
    prompt = prompt_ids(tokenizer, "What is 6 * 7?", [calculator])
    [e] = loop(tokenizer).run(Scripted(tokenizer, [call_text(6, "*", 7)]), [prompt], lambda i, t: 0,
                              [{"calculator": calculator}], [[calculator]])
    c = Completion(0, 0, 0, e.completion_ids, e.truncated, tool_mask=e.tool_mask)
    batch = collate([prompt], [c], torch.zeros(1), 0, False)
    labels = batch["labels"][0, len(prompt):len(prompt) + len(e.completion_ids)]
    expected = torch.tensor([t if m else IGNORE_INDEX for t, m in zip(e.completion_ids, e.tool_mask)])
    assert torch.equal(labels, expected) and (labels == IGNORE_INDEX).sum() == e.tool_mask.count(0) > 0


def test_errors_unknown_tools_and_timeouts_are_results_and_counted(tokenizer):
    """As TRL: a tool that raises returns {'error': message}; an unknown tool 'Tool X not found.'; a call that runs
    past tool_call_timeout is a failure too; the round's calls run concurrently (two 0.6 s calls take < 1.1 s)."""

    def slow(seconds: float) -> str:
        """Sleep.

        Args:
            seconds: How long.
        """
        time.sleep(seconds)
        return "done"

    tools = {"calculator": calculator, "slow": slow}
    bad_op = call_text(1, "/", 2)
    unknown = '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    two_slow = ('<tool_call>\n{"name": "slow", "arguments": {"seconds": 0.6}}\n</tool_call>'
                '<tool_call>\n{"name": "slow", "arguments": {"seconds": 0.6}}\n</tool_call>')
    too_slow = '<tool_call>\n{"name": "slow", "arguments": {"seconds": 3}}\n</tool_call>'
    prompts = [prompt_ids(tokenizer, "q", list(tools.values()))] * 4
    runner = loop(tokenizer, timeout=1.0)
    started = time.perf_counter()
    episodes = runner.run(Scripted(tokenizer, [bad_op, unknown, two_slow, too_slow]), prompts, lambda i, t: 0,
                          [tools] * 4, [list(tools.values())] * 4)
    assert time.perf_counter() - started < 2.6  # the 3 s call is not waited for beyond its timeout
    records = [[c.record() for c in e.calls] for e in episodes]
    assert records[0] == [{"name": "calculator", "arguments": {"a": 1, "op": "/", "b": 2},
                           "result": str({"error": "unknown operation '/'; use one of + - *"}), "failed": True,
                           "kept": True}]
    assert records[1][0]["result"] == str({"error": "Tool weather not found."}) and records[1][0]["failed"]
    assert [r["result"] for r in records[2]] == ["done", "done"]
    assert records[3][0]["result"] == str({"error": "timed out after 1 s"}) and records[3][0]["failed"]
    assert (runner.calls, runner.failures) == (5, 3)
    assert episodes[0].messages[1] == {"role": "tool", "name": "calculator", "content": records[0][0]["result"]}


def test_the_iteration_cap_and_an_overflowing_result(tokenizer):
    """max_tool_calling_iterations 1: a second turn that calls again stays in the completion, unexecuted. A result
    that would push the completion past max_completion_length is dropped (not appended, still counted, kept False) and
    the completion ends with the calling turn."""
    tools = {"calculator": calculator}
    prompt = prompt_ids(tokenizer, "q", [calculator])
    again = Scripted(tokenizer, [call_text(2, "+", 2)], answer=lambda result: call_text(result, "+", 1))
    runner = loop(tokenizer, max_iterations=1)
    [e] = runner.run(again, [prompt], lambda i, t: 0, [tools], [[calculator]])
    assert len(e.calls) == 1 and e.messages[-1]["tool_calls"][0]["function"]["arguments"] == {"a": 4, "op": "+",
                                                                                                "b": 1}
    assert tokenizer.decode(e.completion_ids).endswith(call_text(4, "+", 1) + "<|im_end|>")

    first = Scripted(tokenizer, [call_text(2, "+", 2)]).encode(call_text(2, "+", 2) + "<|im_end|>")
    short = loop(tokenizer, max_completion_length=len(first) + 3)
    [e] = short.run(Scripted(tokenizer, [call_text(2, "+", 2)]), [prompt], lambda i, t: 0, [tools], [[calculator]])
    assert e.completion_ids == first and e.tool_mask == [1] * len(first) and len(e.messages) == 1
    assert [c.record()["kept"] for c in e.calls] == [False] and short.calls == 1


def test_continuation_cut_to_the_completion_budget(tokenizer):
    prompt = prompt_ids(tokenizer, "q", [calculator])
    policy = Scripted(tokenizer, [call_text(6, "*", 7)], answer=lambda r: "x" * 200)
    [full] = loop(tokenizer).run(policy, [prompt], lambda i, t: 0, [{"calculator": calculator}], [[calculator]])
    budget = full.tool_mask.index(1, full.tool_mask.index(0)) + 5
    [e] = loop(tokenizer, max_completion_length=budget).run(policy, [prompt], lambda i, t: 0,
                                                            [{"calculator": calculator}], [[calculator]])
    assert len(e.completion_ids) == budget and e.completion_ids == full.completion_ids[:budget] and e.truncated


def test_a_process_without_calls_samples_as_often_as_the_others(tokenizer):
    """max_active (the largest count over the processes) > 0 while this process has nothing to continue: it still
    calls the sampler (its first row again, dropped), as ZeRO-3 and FSDP2 generation need."""
    policy = Scripted(tokenizer, ["42"])
    runner = ToolLoop(tokenizer, ToolRunner(1.0), 2, 100, 512, max_active=lambda n: 1)
    [e] = runner.run(policy, [prompt_ids(tokenizer, "q", [calculator])], lambda i, t: 0,
                     [{"calculator": calculator}], [[calculator]])
    assert len(policy.calls) == 3 and e.tool_mask == [1] * len(e.completion_ids) and not e.calls


def test_suffix_ids_match_trl(tokenizer):
    """TRL 1.16's _get_tool_suffix_ids on the same messages, when trl is installed."""
    trl = pytest.importorskip("trl.trainer.grpo_trainer")
    messages = [{"role": "tool", "name": "calculator", "content": "42"}]

    class Host:
        processing_class = _tokenizer = tokenizer
        chat_template, chat_template_kwargs, _is_vlm = None, {}, False

    assert tool_suffix_ids(tokenizer, messages) == trl.GRPOTrainer._get_tool_suffix_ids(Host(), messages)


def write(tmp_path, text: str):
    path = tmp_path / "user_tools.py"
    path.write_text(text)
    return path


def test_tools_and_environments_that_cannot_be_offered_are_named(tmp_path):
    path = write(tmp_path, '''
def untyped(a):
    """Echo.

    Args:
        a: a value
    """
    return a


def undocumented(a: int) -> int:
    return a


class Env:
    def reset(self, **row):
        return None

    def step(self, move: str) -> str:
        """Play a move.

        Args:
            move: The move.
        """
        return move


class NoReset:
    def step(self, move: str) -> str:
        return move
''')
    tools, problems = load_tools([f"{path}:untyped", f"{path}:undocumented", "no_such_module.tool",
                                  "hftrain.rl.example_tools.calculator"])
    assert tools == [calculator] and len(problems) == 3
    assert "untyped" in problems[0] and "type hint" in problems[0]
    assert "undocumented" in problems[1] and "docstring" in problems[1]
    assert "does not load (ModuleNotFoundError" in problems[2]
    factory, probe, problems = load_environment(f"{path}:Env")
    assert not problems and type(probe).__name__ == "Env" and callable(factory)
    _, _, problems = load_environment(f"{path}:NoReset")
    assert any("without a reset method" in p for p in problems) and any("method step" in p for p in problems)


def test_templates_that_cannot_render_or_parse_tools_are_refused(tokenizer):
    assert template_problems(tokenizer, [calculator], "tiny-tools") == []
    plain = AutoTokenizer.from_pretrained(REPO / "models" / "tiny-llama")
    [problem] = template_problems(plain, [calculator], "tiny-llama")
    assert "cannot render a tool call" in problem or "drops the tool call" in problem
    unparsed = AutoTokenizer.from_pretrained(TOOLS_MODEL)
    unparsed.response_template = None
    [problem] = template_problems(unparsed, [calculator], "x")
    assert "no response_template" in problem
    wrong = AutoTokenizer.from_pretrained(TOOLS_MODEL)
    wrong.response_template = {"defaults": {"role": "assistant"}, "start_anchor": "<|im_start|>assistant\n",
                               "fields": {"content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"}}}
    [problem] = template_problems(wrong, [calculator], "x")
    assert "does not parse" in problem


def test_the_two_stage_recipe_and_its_data_agree(tokenizer):
    """recipes/tiny-tools-sft.yaml's data is what models/tiny-tools' chat template renders for the calculator
    conversations that recipes/tiny-tools.yaml's GRPO prompts lead into (the call turn, and the answer after the
    tool result), and both recipes validate."""
    import json

    from hftrain.config import load_recipe

    rows = [json.loads(line) for line in (REPO / "data" / "tool_sft.jsonl").read_text().splitlines()[:40]]
    kinds = set()
    for r in rows:
        question = r["prompt"].split("<|im_start|>user\n")[1].split("<|im_end|>")[0]
        user = [{"role": "user", "content": question}]
        render = lambda messages, **kw: tokenizer.apply_chat_template(messages, tools=[calculator], tokenize=False,
                                                                      **kw)  # noqa: E731
        if "<|im_start|>tool" not in r["prompt"] and not r["completion"].startswith("<tool_call>"):
            kinds.add("guess")
            assert r["prompt"] == render(user, add_generation_prompt=True)
            assert re.fullmatch(r"The answer is \d+\.", r["completion"])
        elif r["completion"].startswith("<tool_call>"):
            kinds.add("call")
            assert r["prompt"] == render(user, add_generation_prompt=True)
            call = tokenizer.parse_response(r["completion"] + "<|im_end|>", prefix=r["prompt"], tools=[calculator])
            assert render(user + [call]) == r["prompt"] + r["completion"] + "<|im_end|>\n"
        else:
            kinds.add("answer")
            head = r["prompt"].split("<|im_start|>tool\n")[0]
            call = tokenizer.parse_response(head.removeprefix(render(user, add_generation_prompt=True)),
                                            prefix=render(user, add_generation_prompt=True), tools=[calculator])
            (a, op, b) = (call["tool_calls"][0]["function"]["arguments"][k] for k in ("a", "op", "b"))
            result = {"name": "calculator", "role": "tool", "content": str(calculator(a, op, b))}
            assert r["prompt"] == render(user + [call, result], add_generation_prompt=True)
            assert r["completion"] == f"The answer is {calculator(a, op, b)}."
    assert kinds == {"call", "answer", "guess"}
    again = ["--overwrite_output_dir", "true"]  # a checkout where the recipes have been run holds their outputs
    sft = load_recipe(["--config", str(REPO / "recipes" / "tiny-tools-sft.yaml"), *again])
    grpo_file = REPO / "recipes" / "tiny-tools.yaml"  # its model is stage 1's output, absent before stage 1 runs
    grpo = load_recipe(["--config", str(grpo_file), "--model_name_or_path", str(TOOLS_MODEL), *again])
    assert sft.dataset_name == "data/tool_sft.jsonl"
    assert yaml.safe_load(grpo_file.read_text())["model_name_or_path"] == f"{sft.output_dir}/final"
    assert grpo.tools == ["hftrain.rl.example_tools.calculator"] and grpo.objective == "grpo"


def test_the_shipped_rewards_read_the_completion_messages():
    from hftrain.rl.example_rewards import call_matches_question, final_answer

    question = [{"role": "user", "content": "What is 6 * 7?"}]
    called = [{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "calculator", "arguments": {"a": 6, "op": "+", "b": 7}}}]},
        {"role": "tool", "name": "calculator", "content": "13"}, {"role": "assistant", "content": "It is 42."}]
    direct = [{"role": "assistant", "content": "42"}]
    assert call_matches_question([question] * 2, [called, direct], None) == [2 / 3, 0.0]
    assert final_answer([question] * 3, [called, direct, called[:1]], None, answer=[42, 41, 42]) == [1.0, 0.0, 0.0]


def test_answered_from_tool_rewards_a_working_call_and_an_answer_stating_its_result():
    from hftrain.rl.example_rewards import answered_from_tool

    call = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "calculator", "arguments": {"a": 6, "op": "+", "b": 7}}}]}
    result = {"role": "tool", "name": "calculator", "content": "13"}
    failed = {"role": "tool", "name": "calculator", "content": str({"error": "unknown operation '/'"})}
    completions = [[call, result, {"role": "assistant", "content": "The answer is 13."}],  # 0.5 + 0.5
                   [call, result, {"role": "assistant", "content": "The answer is 113."}],  # 13 is not stated: 0.5
                   [call, result],  # the answer turn was cut off: 0.5
                   [call, failed, {"role": "assistant", "content": "The answer is 13."}],  # the call failed: 0
                   [{"role": "assistant", "content": "The answer is 13."}]]  # no call: 0
    assert answered_from_tool([[]] * 5, completions, None) == [1.0, 0.5, 0.5, 0.0, 0.0]


def test_a_template_that_rewrites_earlier_turns_is_refused():
    """A template that renders an assistant turn differently once a tool message follows it (not prefix-preserving,
    as Qwen3's thinking removal) cannot have results appended to the sampled tokens: refused up front."""
    shifting = AutoTokenizer.from_pretrained(TOOLS_MODEL)
    shifting.chat_template = shifting.chat_template.replace(
        "{{- '<|im_start|>assistant\\n' + (message.content or '') }}",
        "{{- '<|im_start|>assistant\\n' + ('' if loop.last else 'Y') + (message.content or '') }}")
    assert shifting.chat_template != AutoTokenizer.from_pretrained(TOOLS_MODEL).chat_template
    [problem] = template_problems(shifting, [calculator], "x")
    assert "cannot append a tool result" in problem and "prefix-preserving" in problem


def test_environments_one_per_rollout_reset_with_the_row_and_their_methods_as_tools(tokenizer, tmp_path):
    """environment_factory as TRL: each rollout gets its own instance, reset(prompt=..., **row) before it (the string
    it returns appended to the prompt's last message, the prompt rendered again with the tools), its public methods
    are the rollout's tools (acting on that instance), and get_reward() becomes a reward function named after the
    class that reads each rollout's environment."""
    from types import SimpleNamespace

    from hftrain.rl.rollouts import render_prompt
    from hftrain.rl.tools import Tooling, environment_reward

    path = write(tmp_path, '''
class Counter:
    def reset(self, prompt, start, **row):
        self.total = start
        return f" (start at {start})"

    def add(self, a: int, op: str, b: int) -> int:
        """Add to the counter.

        Args:
            a: The amount.
            op: Ignored.
            b: Ignored.
        """
        self.total += a
        return self.total

    def get_reward(self):
        return float(self.total)
''')
    factory, probe, problems = load_environment(f"{path}:Counter")
    assert not problems
    recipe = SimpleNamespace(max_prompt_length=None, tool_call_timeout=5.0, max_tool_calling_iterations=1,
                             max_completion_length=200)
    tooling = Tooling(recipe, [], factory, probe, tokenizer)
    question = [{"role": "user", "content": "What is 6 * 7?"}]

    def render(value, columns):
        return render_prompt(value, columns, tokenizer, None, tooling.schema_tools)

    prompts = [render(question, {"start": 10}), render(question, {"start": 100})]
    policy = Scripted(tokenizer, [call_text(5, "+", 0).replace("calculator", "add")])
    given = list(prompts)
    out = tooling.rollouts(policy, prompts, lambda i, t: 0, render)
    assert prompts == given  # the caller's list is left as it was; the observations are in what comes back
    prompts, episodes, environments = out.prompts, out.episodes, out.environments
    assert prompts[1].value[-1]["content"] == "What is 6 * 7? (start at 100)"
    assert prompts[1].ids == tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 6 * 7? (start at 100)"}], tools=[probe.add], add_generation_prompt=True,
        tokenize=True, return_dict=False)
    assert [e.calls[0].result for e in episodes] == ["15", "105"]
    assert environments[0] is probe and environments[1] is not probe  # one instance per rollout, the probe reused
    reward = environment_reward(type(probe))
    assert reward.name == "Counter"
    assert reward.func(None, None, None, environments=environments) == [15.0, 105.0]


def test_tools_that_name_nothing_are_reported_with_the_objective_problem(tmp_path):
    """tools / environment_factory given with another objective: one ConfigError names the objective problem and
    every entry Python cannot find (a missing module, a missing file), so that fixing one does not reveal the next;
    with grpo the same entries are refused by the recipe check, before any data or model loads."""
    from hftrain.config import load_recipe
    from hftrain.errors import ConfigError

    specs = ["no_such_module.tool", f"{tmp_path / 'absent.py'}:f", "hftrain.rl.example_tools.calculator"]
    base = ["--model_name_or_path", str(REPO / "models" / "tiny-llama"), "--dataset_name",
            str(REPO / "data" / "chat.jsonl"), "--output_dir", str(tmp_path / "out"), "--tools", *specs,
            "--environment_factory", "no_such_package.sub.Env"]
    with pytest.raises(ConfigError) as info:
        load_recipe(base)
    said = " ".join(str(info.value).split())
    assert "tools is set but objective=sft" in said and "environment_factory is set but objective=sft" in said
    assert "tools entry 'no_such_module.tool' does not load (ModuleNotFoundError: No module named 'no_such_module')" \
        in said
    assert f"tools entry '{tmp_path / 'absent.py'}:f' names the file {tmp_path / 'absent.py'}, which does not exist" \
        in said
    assert "environment_factory 'no_such_package.sub.Env' does not load (ModuleNotFoundError: No module named " \
        "'no_such_package')" in said
    assert "calculator" not in said  # an entry that is found is not reported
    with pytest.raises(ConfigError) as info:
        load_recipe([*base, "--objective", "grpo", "--reward_funcs", "hftrain.rl.example_rewards.final_answer"])
    said = " ".join(str(info.value).split())
    assert "objective=" not in said and "'no_such_module.tool' does not load" in said and "absent.py" in said
