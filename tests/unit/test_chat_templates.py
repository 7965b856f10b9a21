"""Assistant-only masks under the real chat templates of popular model families (issue 14).

The templates in chat_templates/ are the families' own Jinja text (most copied from TRL 1.16's
`trl/chat_templates`, which stores them byte for byte as the model repositories ship them, GPT-OSS's harmony
template included; Mistral v3
without its tool branches, Phi-4, SmolLM2 and OLMo 2 written out from their tokenizer_config.json; SmolLM3 and
Mistral-Nemo's tekken template whole, as their hub repositories publish them, from verbatim public mirrors, each
opening with a `{# source: ... #}` line that does not change the rendering).
For each family a hand-written Python renderer below produces the same text as segments, each marked
trained or not: what the model writes after the generation prompt (answer and end-of-turn token) is
trained. The test checks the renderer against the template (the text must be identical) and then
hftrain's labels against the tokens that hold trained characters of the renderer's segments, token for
token. Nothing of hftrain's method (prefix rendering, offsets) is used to compute the expectation.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import datasets
import pytest
from transformers import AutoTokenizer

from hftrain.config import Recipe
from hftrain.data import IGNORE_INDEX, DataSpec, tokenize_dataset
from hftrain.data.tokenize import tokenize_rows
from hftrain.errors import HftrainError
from tests.conftest import REPO

MODEL = REPO / "models" / "tiny-llama"
TEMPLATES = Path(__file__).resolve().parent / "chat_templates"

SYSTEM = {"role": "system", "content": "Réponds brièvement. 简短回答。"}
TURNS = [
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "2 + 2 = 4."},
    {"role": "user", "content": "Spell ocean backwards. ünïcødé 👋"},
    {"role": "assistant", "content": "ocean backwards is naeco. 日本"},
    {"role": "user", "content": "And stone?"},
    {"role": "assistant", "content": "stone backwards is enots."},
]
# Reasoning data as Qwen3 and DeepSeek-R1 write it: the answer follows the </think> block.
THINKING = [
    {"role": "user", "content": "Is 17 prime? ünï"},
    {"role": "assistant", "content": "<think>\n17 has no divisor below √17 ≈ 4.1.\n</think>\n\nYes, 17 is prime."},
    {"role": "user", "content": "And 21? 日本"},
    {"role": "assistant", "content": "<think>\n21 = 3 × 7.\n</think>\n\nNo: 21 = 3 × 7."},
]

Segments = list[tuple[str, bool]]  # (text, trained)


def answer(m: dict) -> str:
    return m["content"]


def split_system(messages: list[dict]) -> tuple[str | None, list[dict]]:
    if messages[0]["role"] == "system":
        return messages[0]["content"], messages[1:]
    return None, messages


# ---- independent renderers: the template's output as trained / untrained segments --------------------------


def llama3_1(messages: list[dict]) -> Segments:
    system, rest = split_system(messages)
    out = [("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
            "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
            + (system or "").strip() + "<|eot_id|>", False)]
    for m in rest:
        out.append((f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n", False))
        out.append((m["content"].strip() + "<|eot_id|>", m["role"] == "assistant"))
    return out


def chatml(default_system: str | None, think: bool = False) -> Callable[[list[dict]], Segments]:
    """Qwen2.5 and SmolLM2 (a default system prompt), Qwen3 (reasoning kept after the last user turn only)."""

    def render(messages: list[dict]) -> Segments:
        system, rest = split_system(messages)
        if system is None:
            system = default_system
        out = [] if system is None else [(f"<|im_start|>system\n{system}<|im_end|>\n", False)]
        last_user = max(i for i, m in enumerate(rest) if m["role"] == "user")
        for i, m in enumerate(rest):
            out.append((f"<|im_start|>{m['role']}\n", False))
            text = m["content"]
            if think and m["role"] == "assistant":
                reasoning, _, text = text.rpartition("</think>")
                reasoning, text = reasoning.replace("<think>", "").strip("\n"), text.lstrip("\n")
                if i > last_user:  # the turn being answered: its reasoning is what the model writes first
                    text = f"<think>\n{reasoning}\n</think>\n\n{text}"
            out.append((text + "<|im_end|>", m["role"] == "assistant"))
            out.append(("\n", False))
        return out

    return render


def gemma(messages: list[dict]) -> Segments:
    """Gemma 2 (no system role) and Gemma 3 (the system text opens the first user turn)."""
    system, rest = split_system(messages)
    out = [("<bos>", False)]
    for i, m in enumerate(rest):
        role = "model" if m["role"] == "assistant" else m["role"]
        prefix = system + "\n\n" if system is not None and i == 0 else ""
        out.append((f"<start_of_turn>{role}\n{prefix}", False))
        out.append((m["content"].strip() + "<end_of_turn>", m["role"] == "assistant"))
        out.append(("\n", False))
    return out


def mistral_v3(messages: list[dict]) -> Segments:
    system, rest = split_system(messages)
    assert system is None, "Mistral v3 moves the system prompt into the last user turn: tested for refusal"
    out = [("<s>", False)]
    for m in rest:
        if m["role"] == "user":
            out.append((f"[INST] {m['content']}[/INST]", False))
        else:  # the model writes the space after [/INST] too
            out.append((" " + m["content"].strip() + "</s>", True))
    return out


def mistral_tekken(messages: list[dict]) -> Segments:
    """Mistral-Nemo (tekken): no space around [INST] / [/INST], the answer is not stripped."""
    system, rest = split_system(messages)
    assert system is None, "Mistral-Nemo puts the system prompt into a final user turn only: tested for refusal"
    out = [("<s>", False)]
    for m in rest:
        if m["role"] == "user":
            out.append((f"[INST]{m['content']}[/INST]", False))
        else:
            out.append((m["content"] + "</s>", True))
    return out


def smollm3(messages: list[dict]) -> Segments:
    """SmolLM3: a metadata header with today's date and the reasoning mode (/think unless the system prompt says
    /no_think; both words are cut from the instructions). Without tools the template never closes the system turn
    with <|im_end|>. In /think mode an answer is rendered as written (reasoning kept in every turn); in /no_think
    mode the generation prompt ends in an empty <think> block, which is context."""
    system, rest = split_system(messages)
    assert system is not None, "the suite's SmolLM3 conversations carry a system prompt (no long default text here)"
    mode = "/no_think" if "/no_think" in system else "/think"
    instructions = system.replace("/no_think", "").replace("/think", "").rstrip()
    out = [("<|im_start|>system\n## Metadata\n\nKnowledge Cutoff Date: June 2025\n"
            f"Today Date: {datetime.date.today():%d %B %Y}\nReasoning Mode: {mode}\n\n"
            f"## Custom Instructions\n\n{instructions}\n\n", False)]
    opens = "<|im_start|>assistant\n" + ("" if mode == "/think" else "<think>\n\n</think>\n")
    for m in rest:
        if m["role"] == "user":
            out.append((f"<|im_start|>user\n{m['content']}<|im_end|>\n", False))
        else:
            out += [(opens, False), (m["content"].lstrip("\n") + "<|im_end|>", True), ("\n", False)]
    return out


def phi3(messages: list[dict]) -> Segments:
    out = []
    for m in messages:
        out.append((f"<|{m['role']}|>\n", False))
        out.append((m["content"] + "<|end|>", m["role"] == "assistant"))
        out.append(("\n", False))
    return [*out, ("<|endoftext|>", False)]  # closes the conversation; the model stops at <|end|>


def phi4(messages: list[dict]) -> Segments:
    out = []
    for m in messages:
        out.append((f"<|im_start|>{m['role']}<|im_sep|>", False))
        out.append((m["content"] + "<|im_end|>", m["role"] == "assistant"))
    return out


def olmo2(messages: list[dict]) -> Segments:
    out = [("<|endoftext|>", False)]
    for i, m in enumerate(messages):
        out.append((f"<|{m['role']}|>\n", False))
        if m["role"] == "assistant":
            out.append((m["content"] + "<|endoftext|>", True))
            if i < len(messages) - 1:
                out.append(("\n", False))
        else:
            out.append((m["content"] + "\n", False))
    return out


def deepseek_r1_training(messages: list[dict]) -> Segments:
    """TRL's training variant of the R1-distill template: reasoning kept, the prompt ends in <think>\\n."""
    system, rest = split_system(messages)
    out = [("<｜begin▁of▁sentence｜>" + (system or ""), False)]
    for m in rest:
        if m["role"] == "user":
            out.append(("<｜User｜>" + m["content"], False))
        else:
            assert m["content"].startswith("<think>\n")
            out.append(("<｜Assistant｜><think>\n", False))
            out.append((m["content"][len("<think>\n"):] + "<｜end▁of▁sentence｜>", True))
    return out


def gpt_oss(messages: list[dict]) -> Segments:
    """GPT-OSS harmony: a system header with today's date, the system prompt as the developer's instructions. The
    generation prompt is `<|start|>assistant`: the model writes the channel, the answer and `<|return|>`; a past turn
    ends in `<|end|>` instead (harmony's history form, not what the model wrote), which is context."""
    system, rest = split_system(messages)
    out = [("<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\nKnowledge cutoff: "
            f"2024-06\nCurrent date: {datetime.date.today():%Y-%m-%d}\n\nReasoning: medium\n\n# Valid channels: "
            "analysis, commentary, final. Channel must be included for every message.<|end|>", False)]
    if system is not None:
        out.append((f"<|start|>developer<|message|># Instructions\n\n{system}\n\n<|end|>", False))
    for i, m in enumerate(rest):
        if m["role"] == "user":
            out.append((f"<|start|>user<|message|>{m['content']}<|end|>", False))
        elif i == len(rest) - 1:
            out += [("<|start|>assistant", False), (f"<|channel|>final<|message|>{m['content']}<|return|>", True)]
        else:
            out += [("<|start|>assistant", False), (f"<|channel|>final<|message|>{m['content']}", True),
                    ("<|end|>", False)]
    return out


def glm4_moe(messages: list[dict]) -> Segments:
    """GLM-4-MoE (TRL's training variant, with {% generation %} markers): no end-of-turn token, the model ends its
    turn by writing the next role marker; reasoning is kept after the last user turn only, earlier turns render an
    empty <think></think>."""
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    out = [("[gMASK]<sop>", False)]
    for i, m in enumerate(messages):
        opens = i == 0 or messages[i - 1]["role"] != "assistant"  # else the previous answer wrote the marker
        if m["role"] != "assistant":
            out.append(((f"<|{m['role']}|>" if opens else "") + "\n" + m["content"], False))
            continue
        reasoning, _, text = m["content"].rpartition("</think>")
        reasoning = reasoning.replace("<think>", "").strip()
        think = f"\n<think>{reasoning}</think>" if i > last_user and reasoning else "\n<think></think>"
        after = "<|system|>" if i + 1 < len(messages) and messages[i + 1]["role"] == "system" else "<|user|>"
        out += [("<|assistant|>", False), (think + "\n" + text.strip() + after, True)]
    return out


@dataclass
class Family:
    template: str
    renderer: Callable[[list[dict]], Segments]
    bos: str | None
    eos: str
    specials: tuple[str, ...]
    system: bool = True  # does the template take a system message
    system_prompt: str = SYSTEM["content"]
    data: tuple[dict, ...] = tuple(TURNS)
    rewrites_past_turns: bool = False  # Qwen3: a turn renders differently once a later user turn follows
    own_mask: bool = False  # the template's {% generation %} mask is used where prefixes fail: one example


LLAMA3 = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
CHATML = ("<|im_start|>", "<|im_end|>")
GEMMA = ("<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>")
DEEPSEEK = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>")
FAMILIES = {
    "llama3.1": Family("llama3_1", llama3_1, "<|begin_of_text|>", "<|eot_id|>", LLAMA3),
    "qwen2.5": Family("qwen2_5", chatml("You are Qwen, created by Alibaba Cloud. You are a helpful assistant."),
                      None, "<|im_end|>", CHATML),
    "qwen3": Family("qwen3", chatml(None, think=True), None, "<|im_end|>", CHATML, data=tuple(THINKING),
                    rewrites_past_turns=True),
    "qwen3-plain": Family("qwen3", chatml(None, think=True), None, "<|im_end|>", CHATML, rewrites_past_turns=True),
    "smollm2": Family("smollm2", chatml("You are a helpful AI assistant named SmolLM, trained by Hugging Face"),
                      None, "<|im_end|>", CHATML),
    "smollm3": Family("smollm3", smollm3, None, "<|im_end|>", CHATML, data=tuple(THINKING),
                      system_prompt=SYSTEM["content"] + " /think"),
    "smollm3-no-think": Family("smollm3", smollm3, None, "<|im_end|>", CHATML,
                               system_prompt=SYSTEM["content"] + " /no_think"),
    "gemma2": Family("gemma", gemma, "<bos>", "<eos>", GEMMA, system=False),
    "gemma3": Family("gemma3", gemma, "<bos>", "<eos>", GEMMA),
    "mistral-v3": Family("mistral_v3", mistral_v3, "<s>", "</s>", ("<s>", "</s>", "[INST]", "[/INST]"), system=False),
    "mistral-nemo": Family("mistral_nemo", mistral_tekken, "<s>", "</s>", ("<s>", "</s>", "[INST]", "[/INST]"),
                           system=False),
    "phi3": Family("phi3", phi3, None, "<|endoftext|>", ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")),
    "phi3.5": Family("phi3_5", phi3, None, "<|endoftext|>", ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")),
    "phi4": Family("phi4", phi4, None, "<|im_end|>", ("<|im_start|>", "<|im_sep|>", "<|im_end|>")),
    "olmo2": Family("olmo2", olmo2, "<|endoftext|>", "<|endoftext|>", ("<|system|>", "<|user|>", "<|assistant|>")),
    "gpt-oss": Family("gptoss", gpt_oss, None, "<|return|>", ("<|start|>", "<|message|>", "<|channel|>", "<|end|>")),
    "glm4-moe-training": Family("glm4moe_training", glm4_moe, None, "<|endoftext|>",
                                ("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>"), data=tuple(THINKING),
                                rewrites_past_turns=True, own_mask=True),
    "deepseek-r1-distill-training": Family("deepseek_r1_distill_training", deepseek_r1_training, DEEPSEEK[0],
                                           DEEPSEEK[1], DEEPSEEK, data=tuple(THINKING)),
}


def family_tokenizer(family: Family):
    """The tiny byte-level BPE tokenizer with the family's markers as single special tokens."""
    tok = AutoTokenizer.from_pretrained(MODEL)
    tok.add_special_tokens({"additional_special_tokens": [t for t in family.specials if t not in (family.bos,
                                                                                                  family.eos)]})
    tok.add_special_tokens({"eos_token": family.eos, **({"bos_token": family.bos} if family.bos else {})})
    tok.chat_template = (TEMPLATES / f"{family.template}.jinja").read_text(encoding="utf-8")
    return tok


def conversation(family: Family) -> list[dict]:
    return ([{"role": "system", "content": family.system_prompt}] if family.system else []) + list(family.data)


def expected_row(tok, segments: Segments) -> tuple[list[int], list[int]]:
    """(input_ids, labels) from the renderer: a token is trained when it holds a trained character."""
    text = "".join(s for s, _ in segments)
    trained, at = [], 0
    for s, keep in segments:
        if keep:
            trained.append((at, at + len(s)))
        at += len(s)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    labels = [t if any(a < e and b > s for s, e in trained) else IGNORE_INDEX
              for t, (a, b) in zip(enc["input_ids"], enc["offset_mapping"])]
    labels[0] = IGNORE_INDEX
    return enc["input_ids"], labels


def rows_of(tok, messages: list[dict], **recipe) -> list[dict]:
    return tokenize_rows({"messages": messages}, 0, tok, DataSpec.from_recipe(Recipe(**recipe)), "messages", "t")


def expected_rows(family: Family, tok, messages: list[dict], policy: str) -> list[tuple[list[int], list[int]]]:
    """Policy `all`: one example per assistant turn when the template rewrites earlier turns (each rendered
    through that turn), else one example (also when the template marks the turns with {% generation %}: every
    turn as the whole conversation renders it); `last`: the conversation through its last turn, that turn trained."""
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if policy == "last":
        segments = family.renderer(messages[: turns[-1] + 1])
        last_start = max(k for k, (_, keep) in enumerate(segments) if keep)
        return [expected_row(tok, [(s, keep and k == last_start) for k, (s, keep) in enumerate(segments)])]
    if not family.rewrites_past_turns or family.own_mask:
        return [expected_row(tok, family.renderer(messages))]
    rows = []
    for i in turns:
        segments = family.renderer(messages[: i + 1])
        last_start = max(k for k, (_, keep) in enumerate(segments) if keep)
        rows.append(expected_row(tok, [(s, keep and k == last_start) for k, (s, keep) in enumerate(segments)]))
    return rows


@pytest.mark.parametrize("name", list(FAMILIES))
def test_renderer_reproduces_the_template(name):
    """The hand-written renderer is the template: same text for every prefix of the conversation."""
    family = FAMILIES[name]
    tok = family_tokenizer(family)
    messages = conversation(family)
    for n in range(2, len(messages) + 1):
        if messages[n - 1]["role"] != "assistant":
            continue
        rendered = tok.apply_chat_template(messages[:n], tokenize=False)
        assert rendered == "".join(s for s, _ in family.renderer(messages[:n])), n


@pytest.mark.parametrize("policy", ["all", "last"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_masks_equal_the_independent_renderer(name, policy):
    family = FAMILIES[name]
    tok = family_tokenizer(family)
    messages = conversation(family)
    rows = rows_of(tok, messages, train_on_turns=policy)
    expected = expected_rows(family, tok, messages, policy)
    assert len(rows) == len(expected)
    for row, (ids, labels) in zip(rows, expected):
        assert row["input_ids"] == ids
        assert row["labels"] == labels, tok.decode([t for t in row["labels"] if t != IGNORE_INDEX])
        assert row["num_trained"] == sum(t != IGNORE_INDEX for t in labels) > 0


def test_end_of_turn_tokens_are_trained_and_closing_eos_is_not():
    """Phi-3: every <|end|> is trained (the model stops there), the conversation's closing EOS never is."""
    tok = family_tokenizer(FAMILIES["phi3"])
    (row,) = rows_of(tok, [SYSTEM, *TURNS])
    trained = [t for t in row["labels"] if t != IGNORE_INDEX]
    assert trained.count(tok.convert_tokens_to_ids("<|end|>")) == 3
    assert tok.eos_token_id in row["input_ids"] and tok.eos_token_id not in trained


def test_qwen3_past_reasoning_is_dropped_from_context_and_kept_in_the_trained_turn():
    tok = family_tokenizer(FAMILIES["qwen3"])
    rows = rows_of(tok, THINKING)
    assert [r["method"] for r in rows] == ["expanded", ""]
    second = tok.decode(rows[1]["input_ids"])
    assert "√17" not in second and "Yes, 17 is prime." in second  # past turn as the model sees it at inference
    assert "21 = 3 × 7.\n</think>" in tok.decode([t for t in rows[1]["labels"] if t != IGNORE_INDEX])
    assert rows[0]["extra_tokens"] == len(rows[0]["input_ids"]) and rows[1]["extra_tokens"] == 0


def test_smollm3_keeps_reasoning_in_every_turn_and_no_think_prompts_are_context():
    """SmolLM3 (/think) renders past answers as written, reasoning included: one example, every turn's reasoning
    trained (its {% generation %} markers would also train the role header, so prefixes are preferred). /no_think: the
    empty <think> block closing the generation prompt is context, the answer after it is trained."""
    tok = family_tokenizer(FAMILIES["smollm3"])
    (row,) = rows_of(tok, conversation(FAMILIES["smollm3"]))
    trained = tok.decode([t for t in row["labels"] if t != IGNORE_INDEX])
    assert row["method"] == "prefix" and "√17 ≈ 4.1.\n</think>" in trained and "21 = 3 × 7.\n</think>" in trained
    assert "<|im_start|>" not in trained
    (row,) = rows_of(tok, conversation(FAMILIES["smollm3-no-think"]))
    trained = tok.decode([t for t in row["labels"] if t != IGNORE_INDEX])
    assert "think>" not in trained and "Reasoning Mode: /no_think" in tok.decode(row["input_ids"])
    assert tok.decode(row["input_ids"]).count("<think>\n\n</think>\n") == 3


def test_generation_markers_give_the_mask_where_prefixes_fail():
    """Build item 1(a): GLM-4-MoE drops past reasoning, so no prefix rendering holds every turn; its {% generation %}
    markers (TRL's training template) give the mask, one example, past turns trained as the conversation renders
    them (the test above compares the tokens with the renderer); `last` needs no markers."""
    tok = family_tokenizer(FAMILIES["glm4-moe-training"])
    assert [r["method"] for r in rows_of(tok, [SYSTEM, *THINKING])] == ["generation"]
    assert [r["method"] for r in rows_of(tok, [SYSTEM, *THINKING], train_on_turns="last")] == ["last"]
    tok.chat_template = tok.chat_template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    assert [r["method"] for r in rows_of(tok, [SYSTEM, *THINKING])] == ["expanded", ""]


def test_expansion_cost_is_in_the_statistics():
    tok = family_tokenizer(FAMILIES["qwen3"])
    raw = datasets.Dataset.from_list([{"messages": THINKING}] * 3)
    for policy, examples in (("all", 6), ("last", 3)):
        data, stats = tokenize_dataset(raw, tok, DataSpec.from_recipe(Recipe(train_on_turns=policy)), "messages", "t")
        assert stats["examples"] == len(data) == examples
        first = rows_of(tok, THINKING, train_on_turns=policy)
        assert stats["expansion_extra_tokens"] == 3 * first[0]["extra_tokens"]
        assert stats["mask_methods"] == {"expanded" if policy == "all" else "last": 3}


@pytest.mark.parametrize("name, messages", [("deepseek-r1-distill", THINKING), ("mistral-v3", [SYSTEM, *TURNS]),
                                            ("mistral-nemo", [SYSTEM, *TURNS])])
def test_templates_that_hide_the_turn_are_refused_with_the_way_out(name, messages):
    """R1-distill's own template drops the reasoning from every turn, the last included, while its generation
    prompt opens <think>: no rendering holds the turn as the model writes it. Mistral v3 moves the system prompt
    into the last user turn only, Mistral-Nemo into a user turn that ends the conversation only (a conversation
    ending in an answer renders without it). None can be located: refused, naming chat_template_path."""
    family = FAMILIES["deepseek-r1-distill-training"] if name.startswith("deepseek") else FAMILIES[name]
    tok = family_tokenizer(family)
    tok.chat_template = (TEMPLATES / f"{name.replace('-distill', '_distill').replace('-', '_')}.jinja").read_text()
    for policy in ("all", "last"):
        with pytest.raises(HftrainError, match="chat_template_path"):
            rows_of(tok, messages, train_on_turns=policy)
    (row,) = rows_of(tok, messages, assistant_only_loss=False)  # every token trained: any template works
    assert row["num_trained"] == len(row["input_ids"]) - 1


def test_template_files_are_the_families_own():
    """Guards the data: the copied templates still carry the lines that make each family what it is."""
    text = {p.stem: p.read_text(encoding="utf-8") for p in TEMPLATES.glob("*.jinja")}
    assert "loop.index0 > ns.last_query_index" in text["qwen3"]
    assert "{% else %}{{ eos_token }}{% endif %}" in text["phi3"]
    assert "content.split('</think>')[-1]" in text["deepseek_r1_distill"]
    assert "<|start|>assistant<|channel|>final<|message|>\" + message.content + \"<|return|>" in text["gptoss"]
    assert '{%- if "/no_think" in system_message -%}' in text["smollm3"]
    assert "{%- if loop.last and system_message is defined %}" in text["mistral_nemo"]
    assert "{% generation %}" in text["deepseek_r1_distill_training"].replace("{%- generation %}", "{% generation %}")
    assert json.dumps(sorted(text)) == json.dumps(sorted(
        ["deepseek_r1_distill", "deepseek_r1_distill_training", "gemma", "gemma3", "glm4moe_training", "gptoss",
         "llama3_1", "mistral_nemo", "mistral_v3", "olmo2", "phi3", "phi3_5", "phi4", "qwen2_5", "qwen3", "smollm2",
         "smollm3"]))


@pytest.mark.parametrize("name", ["smollm3", "mistral-nemo"])
def test_source_line_does_not_change_the_rendering(name):
    """The templates copied from the hub open with a `{# source: ... #}` comment; without it they render the same."""
    family = FAMILIES[name]
    tok = family_tokenizer(family)
    messages = [{"role": "system", "content": family.system_prompt}, *family.data]
    stripped = tok.chat_template.split("\n", 1)[1]
    assert tok.chat_template.startswith("{# source: ") and "license Apache-2.0 #}" in tok.chat_template
    for n in (len(messages) - 1, len(messages)):
        for prompt in (False, True):
            kwargs = {"tokenize": False, "add_generation_prompt": prompt}
            assert tok.apply_chat_template(messages[:n], **kwargs) == tok.apply_chat_template(
                messages[:n], chat_template=stripped, **kwargs)


def test_preview_shows_the_policy_and_the_cost_of_expanding(tmp_path, capsys):
    from hftrain.data.__main__ import preview

    tok = family_tokenizer(FAMILIES["qwen3"])
    tok.save_pretrained(tmp_path / "tok")
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": THINKING}) + "\n" + json.dumps({"messages": TURNS}) + "\n")
    expanded = rows_of(tok, THINKING)[0]["extra_tokens"] + rows_of(tok, TURNS)[0]["extra_tokens"]
    args = ["--show", "0", "--model_name_or_path", str(tmp_path / "tok"), "--dataset_name", str(data),
            "--validation_split_percentage", "0"]
    preview(args)
    out = capsys.readouterr().out
    assert "masks (assistant_only_loss: true, train_on_turns: all): 2 example(s) expanded" in out
    assert f"Expanding cost {expanded} tokens" in out
    preview([*args, "--train_on_turns", "last"])
    out = capsys.readouterr().out
    assert "train_on_turns: last): 2 example(s) final assistant turn only" in out and "Expanding" not in out
