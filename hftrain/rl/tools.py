"""Tool calling in objective grpo, as TRL 1.16's GRPOTrainer runs it (`tools`, `environment_factory`,
`max_tool_calling_iterations`): loading and checking the tools before the model loads, and the multi-turn rollout.

Tools are typed Python functions with a Google-style docstring (transformers' `get_json_schema` turns them into the
JSON schemas the chat template renders into the prompt, `apply_chat_template(tools=...)`). An `environment_factory`
(a class, or a callable returning an object) gives one environment per rollout: `reset(**row)` is called with the
dataset row before the rollout (a string it returns is appended to the prompt's last message, as TRL does), its public
methods other than `reset` and `get_reward` are the rollout's tools, and a `get_reward()` method becomes a reward
function named after the class. Reward functions receive `environments=` (one per completion) as TRL passes them.

A rollout (`ToolLoop.run`): the model's turn is sampled; it is parsed with the tokenizer's own `response_template`
(tokenizer_config.json, read by transformers; `tokenizer.parse_response(ids, prefix=..., tools=...)`, a turn that does
not parse being plain text, as TRL's `parse_response`); its tool calls are run, every rollout's calls of the round
concurrently in threads, each with `tool_call_timeout` seconds (a call that raises or times out returns
`{'error': message}` as its result, as TRL, and counts as a failure); the results are appended as `tool` messages: the
tokens the chat template renders after the turn's end of sequence for them, up to and including the next assistant
header (TRL's `_get_tool_suffix_ids`), which are masked out of the loss (tool_mask 0); the model then continues. It
stops at a turn without a call, after `max_tool_calling_iterations` rounds of execution (a turn whose calls go past the
cap stays in the completion, unexecuted), or when the tool messages would push the completion past
`max_completion_length` (or the model's context): those results are dropped and the completion ends where it was; a
continuation is cut to what is left of `max_completion_length`.
"""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

from transformers.utils import get_json_schema

from hftrain.rl.rewards import RewardFunction, load_object
from hftrain.rl.rollouts import Sampled

SPEC_HELP = "give a dotted import path pkg.module.func or path/to/file.py:func"
ENVIRONMENT_MEMBERS = ("reset", "get_reward")  # an environment's methods that are not tools


def schema_problem(func: Callable) -> str | None:
    """Why `func` cannot be offered as a tool (transformers' get_json_schema needs type hints and a docstring that
    describes every argument), or None."""
    try:
        get_json_schema(func)
    except Exception as exc:  # noqa: BLE001 - transformers raises several types; each is the user's function's fault
        return f"{exc} (a tool needs type hints on every argument and a docstring with an Args: line for each)"
    return None


def load_tools(specs: Sequence[str]) -> tuple[list[Callable], list[str]]:
    """(the tool functions, every problem found): each spec imported, callable, with a JSON schema."""
    tools, problems = [], []
    for spec in specs:
        try:
            func = load_object(spec)
        except Exception as exc:  # noqa: BLE001 - any failure of user code while importing is reported the same way
            problems.append(f"tools entry {spec!r} does not load ({type(exc).__name__}: {exc}); {SPEC_HELP}")
            continue
        if not callable(func):
            problems.append(f"tools entry {spec!r} is a {type(func).__name__}, not a function")
            continue
        problem = schema_problem(func)
        if problem:
            problems.append(f"tools entry {spec!r}: {problem}")
            continue
        tools.append(func)
    return tools, problems


def environment_methods(environment) -> list[Callable]:
    """The environment's tools: its public methods (listed on the class, as TRL does) but reset and get_reward."""
    return [getattr(environment, name) for name, _ in inspect.getmembers(type(environment), inspect.isfunction)
            if name not in ENVIRONMENT_MEMBERS and not name.startswith("_")]


def load_environment(spec: str | None) -> tuple[Callable | None, object | None, list[str]]:
    """(the factory, one instance made to check it, problems) of `environment_factory`."""
    if spec is None:
        return None, None, []
    try:
        factory = load_object(spec)
    except Exception as exc:  # noqa: BLE001
        return None, None, [f"environment_factory {spec!r} does not load ({type(exc).__name__}: {exc}); give a "
                            "dotted import path pkg.module.Class or path/to/file.py:Class"]
    if not callable(factory):
        return None, None, [f"environment_factory {spec!r} is a {type(factory).__name__}, not a class or callable"]
    try:
        probe = factory()
    except Exception as exc:  # noqa: BLE001
        return None, None, [f"environment_factory {spec!r} raised {type(exc).__name__}: {exc} when called with no "
                            "arguments; it must make one environment per call"]
    problems = []
    if not callable(getattr(probe, "reset", None)):
        problems.append(f"environment_factory {spec!r} makes a {type(probe).__name__} without a reset method; each "
                        "environment needs reset(**row), called before every rollout")
    methods = environment_methods(probe)
    if not methods:
        problems.append(f"environment_factory {spec!r}: {type(probe).__name__} has no public method besides reset "
                        "and get_reward to offer as a tool")
    for method in methods:
        problem = schema_problem(method)
        if problem:
            problems.append(f"environment_factory {spec!r}: method {method.__name__}: {problem}")
    return factory, probe, problems


def environment_reward(cls: type) -> RewardFunction:
    """An environment's get_reward() as a reward function named after its class (TRL's)."""

    def get_reward(prompts, completions, completion_ids, environments, **kwargs):
        return [e.get_reward() for e in environments]

    return RewardFunction(f"{cls.__name__}.get_reward", cls.__name__, get_reward)


SENTINELS = {"name": "tool_name_a8f3e2b1", "key": "tool_arg_key_b9d4f5c2", "value": "tool_arg_val_d6e7a9f3",
             "content": "tool_content_c4f9a8e2"}


def template_problems(tokenizer, tools: list[Callable], source: str) -> list[str]:
    """Whether the tokenizer can run tool calling: its chat template renders the tools and a whole tool-calling
    exchange (TRL's `supports_tool_calling`: every part of it must show in the text), and its `response_template`
    parses an assistant turn with a tool call back into that call."""
    call = {"type": "function", "function": {"name": SENTINELS["name"],
                                             "arguments": {SENTINELS["key"]: SENTINELS["value"]}}}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "name": SENTINELS["name"], "content": SENTINELS["content"]}]
    fix = ("use a model whose chat template supports tools (e.g. Qwen2.5's, or models/tiny-tools), or give one with "
           "chat_template_path")
    try:
        rendered = tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False)
    except Exception as exc:  # noqa: BLE001 - jinja's errors come in many types
        return [f"the chat template of {source} cannot render a tool call and its result ({type(exc).__name__}: "
                f"{exc}); {fix}"]
    missing = [part for part, text in SENTINELS.items() if text not in rendered]
    if missing:
        return [f"the chat template of {source} drops the tool call's {' and '.join(missing)} when it renders a "
                f"tool-calling conversation; {fix}"]
    if getattr(tokenizer, "response_template", None) is None:
        return [f"the tokenizer of {source} has no response_template (tokenizer_config.json), so the model's tool "
                "calls cannot be parsed from its output; add the template's response_template to "
                "tokenizer_config.json (transformers' chat response parsing; TRL's trl.chat_template_utils has them "
                "for Qwen, Llama 3, GPT-OSS and others)"]
    try:
        prefix = tokenizer.apply_chat_template(messages[:1], tools=tools or None, add_generation_prompt=True,
                                               tokenize=True, return_dict=False)
        whole = tokenizer.apply_chat_template(messages[:2], tools=tools or None, tokenize=True, return_dict=False)
        parsed = tokenizer.parse_response(whole[len(prefix):], prefix=prefix)
    except Exception as exc:  # noqa: BLE001 - the template's or the parser's error, reported as the user's problem
        prefix, whole, parsed = [], [], {"error": f"{type(exc).__name__}: {exc}"}
    calls = parsed.get("tool_calls") or []
    if whole[:len(prefix)] != prefix or len(calls) != 1 or calls[0].get("function", {}).get("name") != \
            SENTINELS["name"] or calls[0]["function"].get("arguments") != {SENTINELS["key"]: SENTINELS["value"]}:
        return [f"the response_template of {source} does not parse the assistant turn its chat template renders for "
                f"a tool call back into that call (got {parsed}); fix response_template in tokenizer_config.json"]
    try:
        tool_suffix_ids(tokenizer, messages[2:])
    except Exception as exc:  # noqa: BLE001
        return [f"the chat template of {source} cannot append a tool result to a sampled turn ({exc}); TRL swaps in a "
                "prefix-preserving training template for such models; give one with chat_template_path"]
    return []


# ------------------------------------------------------------------------------------------------- running calls
@dataclass
class ToolCall:
    """One executed call, as rollouts.jsonl records it."""

    name: str
    arguments: object
    result: str = ""  # the tool message's content: str(return value), or str({'error': ...})
    failed: bool = False
    kept: bool = True  # False: its result would have overflowed max_completion_length and was dropped

    def record(self) -> dict:
        return {"name": self.name, "arguments": self.arguments, "result": self.result, "failed": self.failed,
                "kept": self.kept}


def call_target(call) -> tuple[str, object]:
    """(name, arguments) of a parsed tool call (TRL's {'type': 'function', 'function': {...}} or a flat one)."""
    if not isinstance(call, dict):
        return "unknown", {}
    function = call.get("function", call)
    if not isinstance(function, dict):
        return "unknown", {}
    return str(function.get("name", "unknown")), function.get("arguments", {})


def invoke(func: Callable, arguments) -> object:
    if not isinstance(arguments, dict):
        raise TypeError(f"arguments must be a JSON object, got {arguments!r}")
    result = func(**arguments)
    if inspect.isawaitable(result):  # an async tool runs on its own event loop in the worker thread
        async def wait():
            return await result
        result = asyncio.run(wait())
    return result


class ToolRunner:
    """Runs a round's calls concurrently in a thread pool, each waited for at most `timeout` seconds. A call still
    running at its timeout is reported as failed; its thread cannot be stopped and finishes in the background."""

    def __init__(self, timeout: float, workers: int = 16):
        self.timeout = timeout
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="hftrain-tool")

    def run(self, calls: list[tuple[dict[str, Callable], object]]) -> list[ToolCall]:
        """calls: (the rollout's tools by name, the parsed call) -> the executed calls in the same order."""
        futures, out = [], []
        for tools, call in calls:
            name, arguments = call_target(call)
            record = ToolCall(name, arguments)
            out.append(record)
            if isinstance(call, dict) and call.get("type", "function") != "function":
                futures.append(ValueError(f"Unsupported tool call type: {call.get('type')}"))
            elif name not in tools:
                futures.append(ValueError(f"Tool {name} not found."))
            else:
                futures.append(self.pool.submit(invoke, tools[name], arguments))
        for record, future in zip(out, futures):
            try:
                if isinstance(future, Exception):
                    raise future
                record.result = str(future.result(timeout=self.timeout))
            except FutureTimeout:
                record.result, record.failed = str({"error": f"timed out after {self.timeout:g} s"}), True
            except Exception as exc:  # noqa: BLE001 - a tool's error is its result, as TRL
                record.result, record.failed = str({"error": str(exc)}), True
        return out


# ---------------------------------------------------------------------------------------------- the rollout
@dataclass
class Episode:
    """One multi-turn rollout."""

    prompt_ids: list[int]
    messages: list[dict] = field(default_factory=list)  # the completion's messages (assistant turns and tool results)
    completion_ids: list[int] = field(default_factory=list)
    tool_mask: list[int] = field(default_factory=list)  # 1: sampled by the model, 0: tool result and template
    sampling_logps: list[float] | None = None
    calls: list[ToolCall] = field(default_factory=list)
    pending: list = field(default_factory=list)  # the last turn's parsed calls, not yet run
    truncated: bool = False  # the last turn sampled has no end of sequence


def as_sampled(episode: Episode) -> Sampled:
    """An episode as the rollout source takes a completion: its tokens, mask, executed calls and messages."""
    return Sampled(episode.completion_ids, episode.truncated, episode.sampling_logps, episode.tool_mask,
                   [c.record() for c in episode.calls], episode.messages)


def tool_suffix_ids(tokenizer, tool_messages: list[dict]) -> list[int]:
    """The tokens the chat template adds after an assistant turn's end of sequence for its tool results, up to and
    including the next assistant header (TRL's `_get_tool_suffix_ids`: a dummy conversation rendered with and without
    them)."""
    calls = [{"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]
    dummy = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": calls}]
    prefix = tokenizer.apply_chat_template(dummy, add_generation_prompt=False, tokenize=True, return_dict=False)
    full = tokenizer.apply_chat_template(dummy + tool_messages, add_generation_prompt=True, tokenize=True,
                                         return_dict=False)
    eos = [i for i, token in enumerate(prefix) if token == tokenizer.eos_token_id]
    if eos:  # the turn's own end of sequence is the model's; what the template writes after it is not
        prefix = prefix[:eos[-1] + 1]
    if full[:len(prefix)] != prefix:
        raise ValueError("the chat template renders an assistant turn differently once tool messages follow it "
                         "(not prefix-preserving); tool results cannot be appended to the sampled tokens")
    return full[len(prefix):]


def parse_turn(tokenizer, ids: list[int], prefix: list[int], tools: list[Callable]) -> dict:
    """TRL's `parse_response`: the turn parsed with the response template, or plain text when it does not parse."""
    try:
        parsed = tokenizer.parse_response(ids, prefix=prefix, tools=tools or None)
        if parsed is None:
            raise ValueError("nothing parsed")
        if isinstance(parsed.get("content"), str):
            parsed["content"] = parsed["content"].removesuffix(tokenizer.eos_token)
        parsed["content"] = parsed.get("content") or ""
        for call in parsed.get("tool_calls") or []:
            name, _ = call_target(call)
            if name == "unknown":
                raise ValueError("a tool call without a name")
    except (ValueError, TypeError, KeyError, AttributeError):
        parsed = {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)}
    return parsed


class ToolLoop:
    """The multi-turn rollout of one generation window's rows on this process (module docstring).

    `sample(prompt_ids, seeds)` is the run's generator (every process calls it at once); `max_active(n)` returns the
    largest n over the processes that generate together, so that each calls `sample` as often as the others (ZeRO-3
    and FSDP2 generate with collectives); a process with nothing left to continue samples its first row again and
    drops it."""

    def __init__(self, tokenizer, runner: ToolRunner, max_iterations: int | None, max_completion_length: int,
                 max_model_length: int | None, max_active: Callable[[int], int] = lambda n: n):
        self.tokenizer, self.runner, self.max_iterations = tokenizer, runner, max_iterations
        self.max_completion_length, self.max_model_length, self.max_active = (max_completion_length,
                                                                              max_model_length, max_active)
        self.calls = self.failures = 0  # of the last run, this process (dropped results counted, as TRL)

    def run(self, sample, prompt_ids: list[list[int]], seed: Callable[[int, int], int],
            toolsets: list[dict[str, Callable]], schemas: list[list[Callable]],
            inputs: list[dict] | None = None) -> list[Episode]:
        """One episode per prompt; seed(i, turn): the seed of row i's turn `turn` (0 is the first). `inputs`: an
        image-text model's per-row processor outputs (hftrain.rl.images), handed to `sample` with every turn's rows:
        each continuation (the prompt, its image tokens included, then the turns and tool results so far) is
        generated with its prompt's pixels, as TRL's tool loop does."""
        def draw(ids: list[list[int]], seeds: list[int], rows) -> list:
            return sample(ids, seeds) if inputs is None else sample(ids, seeds, [inputs[i] for i in rows])

        episodes = [Episode(list(p)) for p in prompt_ids]
        first = draw([e.prompt_ids for e in episodes], [seed(i, 0) for i in range(len(episodes))],
                       range(len(episodes)))
        for i, (e, s) in enumerate(zip(episodes, first)):
            e.completion_ids, e.tool_mask = list(s.completion_ids), [1] * len(s.completion_ids)
            e.sampling_logps = list(s.sampling_logps) if s.sampling_logps is not None else None
            e.truncated = s.truncated
            self.add_turn(e, s.completion_ids, e.prompt_ids, schemas[i])
        self.calls = self.failures = 0
        active = [i for i, e in enumerate(episodes) if e.pending]
        turn = 0
        while self.max_iterations is None or turn < self.max_iterations:
            if self.max_active(len(active)) == 0:
                break
            turn += 1
            results = self.runner.run([(toolsets[i], call) for i in active for call in episodes[i].pending])
            self.calls += len(results)
            self.failures += sum(r.failed for r in results)
            continuing, contexts = [], []
            for i in active:
                e = episodes[i]
                mine, results = results[:len(e.pending)], results[len(e.pending):]
                e.pending = []
                e.calls += mine
                tool_messages = [{"role": "tool", "name": r.name, "content": r.result} for r in mine]
                suffix = tool_suffix_ids(self.tokenizer, tool_messages)
                context = e.prompt_ids + e.completion_ids + suffix
                if len(e.completion_ids) + len(suffix) > self.max_completion_length or (
                        self.max_model_length is not None and len(context) >= self.max_model_length):
                    for r in mine:  # dropped, as TRL: the completion ends with the turn that called
                        r.kept = False
                    continue
                e.messages += tool_messages
                e.completion_ids += suffix
                e.tool_mask += [0] * len(suffix)
                if e.sampling_logps is not None:
                    e.sampling_logps += [float("nan")] * len(suffix)
                continuing.append(i)
                contexts.append(context)
            active = continuing
            if self.max_active(len(active)) == 0:
                break
            rows = active or [0]  # nothing to continue here, but the others sample: sample a row and drop it
            sampled = draw(contexts or [episodes[0].prompt_ids], [seed(i, turn) for i in rows], rows)
            for i, context, s in zip(active, contexts, sampled):
                e = episodes[i]
                budget = self.max_completion_length - len(e.completion_ids)
                ids = list(s.completion_ids)[:budget]
                e.truncated = s.truncated or len(ids) < len(s.completion_ids)
                e.completion_ids += ids
                e.tool_mask += [1] * len(ids)
                if e.sampling_logps is not None:
                    e.sampling_logps += (list(s.sampling_logps)[:budget] if s.sampling_logps is not None
                                         else [float("nan")] * len(ids))
                if ids:
                    self.add_turn(e, ids, context, schemas[i])
            active = [i for i in active if episodes[i].pending]
        return episodes

    def add_turn(self, episode: Episode, ids: list[int], prefix: list[int], schema: list[Callable]) -> None:
        message = parse_turn(self.tokenizer, ids, prefix, schema)
        episode.messages.append(message)
        episode.pending = list(message.get("tool_calls") or [])


@dataclass(frozen=True)
class ToolRollouts:
    """`Tooling.rollouts`' answer for this process's rows, in their order."""

    prompts: list  # the prompts, an environment's observation added where its reset returned one
    inputs: list[dict] | None  # an image-text model's per-row processor outputs for those prompts (None: a text model)
    episodes: list[Episode]
    environments: list | None  # one per rollout; None without an environment_factory

    @property
    def sampled(self) -> list[Sampled]:
        return [as_sampled(e) for e in self.episodes]


class Tooling:
    """A grpo run's tool calling: its tools, its environments (one per rollout slot of this process, reset before
    each rollout, as TRL's pool), the executor and the loop."""

    def __init__(self, recipe, tools: list[Callable], factory: Callable | None, probe, tokenizer,
                 max_active: Callable[[int], int] = lambda n: n, max_model_length: int | None = None):
        self.tools, self.factory, self.probe, self.tokenizer = tools, factory, probe, tokenizer
        self.max_prompt_length = recipe.max_prompt_length
        self.pool: list = [probe] if probe is not None else []
        self.loop = ToolLoop(tokenizer, ToolRunner(recipe.tool_call_timeout), recipe.max_tool_calling_iterations,
                             recipe.max_completion_length, max_model_length, max_active)

    @property
    def schema_tools(self) -> list[Callable]:
        """What the prompts are rendered with: the tools and the environment's methods."""
        return self.tools + (environment_methods(self.probe) if self.probe is not None else [])

    def describe(self) -> str:
        names = [t.__name__ for t in self.tools]
        if self.probe is not None:
            names += [f"{type(self.probe).__name__}.{m.__name__}" for m in environment_methods(self.probe)]
        return ", ".join(names)

    def environments(self, n: int) -> list:
        while len(self.pool) < n:
            self.pool.append(self.factory())
        return self.pool[:n]

    def rollouts(self, sample, prompts: list, seed: Callable[[int, int], int], render,
                 inputs: list[dict] | None = None, images=None) -> ToolRollouts:
        """The multi-turn rollouts of this process's rows (`ToolRollouts`). render(value, columns) renders a prompt;
        `inputs`: an image-text model's per-row processor outputs (ToolLoop.run), and `images` its PromptImages: a
        prompt an observation changes is rendered again by the processor with its images, and its processor outputs
        encoded again (the arguments are left as they are)."""
        prompts, inputs = list(prompts), list(inputs) if inputs is not None else None
        environments = [None] * len(prompts)
        if self.factory is not None:
            environments = self.environments(len(prompts))
            for k, (p, env) in enumerate(zip(prompts, environments)):
                observation = env.reset(prompt=p.value, **p.columns)
                if isinstance(observation, str):  # appended to the prompt's last message, as TRL
                    content = p.value[-1]["content"]
                    added = observation if isinstance(content, str) else [{"type": "text", "text": observation}]
                    value = p.value[:-1] + [{**p.value[-1], "content": content + added}]
                    if images is not None:
                        prompts[k] = images.again(p, value, self.schema_tools, self.max_prompt_length)
                        inputs[k] = images.row_inputs([prompts[k]])[0]
                    else:
                        prompts[k] = render(value, p.columns)
        toolsets, schemas = [], []
        for env in environments:
            methods = environment_methods(env) if env is not None else []
            toolsets.append({t.__name__: t for t in self.tools + methods})
            schemas.append(self.tools + methods)
        episodes = self.loop.run(sample, [p.ids for p in prompts], seed, toolsets, schemas, inputs)
        return ToolRollouts(prompts, inputs, episodes, environments if self.factory is not None else None)


def json_safe(value):
    """A tool call's arguments as JSON can hold them (the parser returns JSON values; anything else as text)."""
    try:
        json.dumps(value)
        return value
    except TypeError:
        return str(value)
