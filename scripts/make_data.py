"""Generate the small datasets shipped under data/ (deterministic; re-run to regenerate).

    python scripts/make_data.py [OUT_DIR]

chat.jsonl              {"messages": [{role, content}...]}: single and multi-turn, some with a system
                        prompt; the last 24 are long (12 turns) or non-ASCII (unicode names, emoji)
text.jsonl              {"text": ...}: short documents for plain causal-LM training
prompt_completion.jsonl {"prompt": ..., "completion": ...}
alpaca.jsonl            {"instruction": ..., "input": ..., "output": ...} (input often empty)
sharegpt.jsonl          {"conversations": [{"from": human|gpt|system, "value": ...}...]}
preference.jsonl        {"prompt": [messages], "chosen": [assistant], "rejected": [assistant]}: the right answer
                        against a plausible wrong one (another sum, capital, spelling or count)
unpaired.jsonl          {"prompt": [messages], "completion": [assistant], "label": bool}: unpaired feedback (kto),
                        the right answer rated true or a plausible wrong one rated false, about half each
tool_prompts.jsonl      {"prompt": [user question], "answer": int}: arithmetic for grpo with the calculator tool
tool_sft.jsonl          {"prompt": ..., "completion": ...}: the calculator call, a guessed answer without it, or the
                        answer after its result, as models/tiny-tools' chat template renders them
                        (recipes/tiny-tools-sft.yaml)

The content is synthetic but regular (arithmetic, capitals, word games), so a tiny
random model visibly learns it within a few dozen steps on CPU.
"""

import json
import random
import sys
from pathlib import Path

CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid",
    "Japan": "Tokyo", "Canada": "Ottawa", "Egypt": "Cairo", "Kenya": "Nairobi",
    "Peru": "Lima", "Norway": "Oslo", "Chile": "Santiago", "Ghana": "Accra",
    "Greece": "Athens", "Poland": "Warsaw", "Cuba": "Havana", "Nepal": "Kathmandu",
}
WORDS = ["apple", "river", "stone", "cloud", "green", "light", "tiger", "music",
         "ocean", "paper", "smile", "train", "candle", "forest", "garden", "winter"]
SYSTEMS = ["You are a helpful assistant.", "Answer briefly.", "You are a careful tutor."]


def qa_pair(rng: random.Random) -> tuple[str, str]:
    kind = rng.randrange(4)
    if kind == 0:
        a, b = rng.randrange(10), rng.randrange(10)
        return f"What is {a} + {b}?", f"{a} + {b} = {a + b}."
    if kind == 1:
        country = rng.choice(sorted(CAPITALS))
        return f"What is the capital of {country}?", f"The capital of {country} is {CAPITALS[country]}."
    if kind == 2:
        word = rng.choice(WORDS)
        return f"Spell {word} backwards.", f"{word} backwards is {word[::-1]}."
    word = rng.choice(WORDS)
    return f"How many letters are in {word}?", f"{word} has {len(word)} letters."


def chat_example(rng: random.Random) -> dict:
    messages = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": rng.choice(SYSTEMS)})
    for _ in range(1 if rng.random() < 0.6 else rng.randrange(2, 4)):
        question, answer = qa_pair(rng)
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return {"messages": messages}


def text_example(rng: random.Random) -> dict:
    sentences = [" ".join(qa_pair(rng)) for _ in range(rng.randrange(1, 5))]
    return {"text": " ".join(sentences)}


UNICODE = [("Wie heißt die Hauptstadt von Österreich?", "Die Hauptstadt von Österreich ist Wien."),
           ("¿Cuál es la capital de España?", "La capital de España es Madrid."),
           ("日本の首都はどこですか?", "日本の首都は東京です。"),
           ("Πρωτεύουσα της Ελλάδας;", "Η πρωτεύουσα της Ελλάδας είναι η Αθήνα."),
           ("Say hello with an emoji.", "Hello! 👋🙂")]


def special_chat_example(rng: random.Random, i: int) -> dict:
    """Long (12-turn) or non-ASCII conversations, to exercise truncation and byte-level tokenization."""
    if i % 2 == 0:
        messages = [{"role": "system", "content": rng.choice(SYSTEMS)}]
        for _ in range(6):
            question, answer = qa_pair(rng)
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        return {"messages": messages}
    question, answer = rng.choice(UNICODE)
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}


def prompt_completion_example(rng: random.Random) -> dict:
    question, answer = qa_pair(rng)
    return {"prompt": f"Question: {question}\nAnswer:", "completion": f" {answer}"}


def alpaca_example(rng: random.Random) -> dict:
    question, answer = qa_pair(rng)
    if rng.random() < 0.5:
        return {"instruction": question, "input": "", "output": answer}
    return {"instruction": "Answer the question in one sentence.", "input": question, "output": answer}


def sharegpt_example(rng: random.Random) -> dict:
    chat = chat_example(rng)["messages"]
    names = {"system": "system", "user": "human", "assistant": "gpt"}
    return {"conversations": [{"from": names[m["role"]], "value": m["content"]} for m in chat]}


def wrong_answer(rng: random.Random, question: str) -> str:
    """A wrong answer of the same shape as the right one."""
    if question.startswith("What is the capital"):
        country = question.removeprefix("What is the capital of ").rstrip("?")
        city = rng.choice(sorted(set(CAPITALS.values()) - {CAPITALS[country]}))
        return f"The capital of {country} is {city}."
    if question.startswith("What is"):
        a, b = (int(x) for x in question.removeprefix("What is ").rstrip("?").split(" + "))
        return f"{a} + {b} = {a + b + rng.choice([-2, -1, 1, 2])}."
    if question.startswith("Spell"):
        word = question.split()[1]
        letters = list(word[::-1])
        i = rng.randrange(len(letters) - 1)
        letters[i], letters[i + 1] = letters[i + 1], letters[i]
        wrong = "".join(letters) if "".join(letters) != word[::-1] else word
        return f"{word} backwards is {wrong}."
    word = question.split()[-1].rstrip("?")
    return f"{word} has {len(word) + rng.choice([-1, 1, 2])} letters."


def preference_example(rng: random.Random) -> dict:
    question, answer = qa_pair(rng)
    prompt = ([{"role": "system", "content": rng.choice(SYSTEMS)}] if rng.random() < 0.3 else []) + \
        [{"role": "user", "content": question}]
    return {"prompt": prompt, "chosen": [{"role": "assistant", "content": answer}],
            "rejected": [{"role": "assistant", "content": wrong_answer(rng, question)}]}


def unpaired_example(rng: random.Random) -> dict:
    pair = preference_example(rng)
    label = rng.random() < 0.5
    return {"prompt": pair["prompt"], "completion": pair["chosen" if label else "rejected"], "label": label}


def arithmetic_question(rng: random.Random) -> tuple[str, int, str, int, int]:
    a, b, op = rng.randint(2, 99), rng.randint(2, 99), rng.choice("+-*")
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    return f"What is {a} {op} {b}?", a, op, b, value


def tool_prompt_example(rng: random.Random) -> dict:
    """recipes/tiny-tools.yaml's GRPO prompts: an arithmetic question and its answer (the reward's column)."""
    question, _, _, _, value = arithmetic_question(rng)
    return {"prompt": [{"role": "user", "content": question}], "answer": value}


# models/tiny-tools' chat template with tools=[hftrain.rl.example_tools.calculator], written out (a test renders the
# template and compares): the SFT stage of recipes/tiny-tools.yaml teaches the turns GRPO's prompts lead into
TOOLS_SYSTEM = ("<|im_start|>system\nTools:\ncalculator(a: integer, op: string, b: integer): Compute a op b."
                "<|im_end|>\n")


def tool_sft_example(rng: random.Random) -> dict:
    """One assistant turn of a calculator conversation as prompt / completion text, in three kinds: the call, the
    answer after the tool's result, or a direct answer without the tool (a guess, as often as the call): stage 1
    leaves the choice to call open, for GRPO to settle."""
    question, a, op, b, value = arithmetic_question(rng)
    prompt = f"{TOOLS_SYSTEM}<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    call = f'<tool_call>\n{{"name": "calculator", "arguments": {{"a": {a}, "op": "{op}", "b": {b}}}}}\n</tool_call>'
    kind = rng.random()
    if kind < 1 / 3:
        return {"prompt": prompt, "completion": call}
    if kind < 2 / 3:
        return {"prompt": prompt, "completion": f"The answer is {rng.randint(2, 200)}."}
    return {"prompt": f"{prompt}{call}<|im_end|>\n<|im_start|>tool\n{value}<|im_end|>\n<|im_start|>assistant\n",
            "completion": f"The answer is {value}."}


def write(path: Path, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"wrote {len(rows)} examples to {path}")


def main(out_dir: str = "data") -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(1234)  # chat.jsonl and text.jsonl first: the tiny model's tokenizer is trained on them
    chat = [chat_example(rng) for _ in range(600)]
    text = [text_example(rng) for _ in range(600)]
    special = random.Random(99)
    write(out / "chat.jsonl", chat + [special_chat_example(special, i) for i in range(24)])
    write(out / "text.jsonl", text)
    write(out / "prompt_completion.jsonl", [prompt_completion_example(special) for _ in range(300)])
    write(out / "alpaca.jsonl", [alpaca_example(special) for _ in range(300)])
    write(out / "sharegpt.jsonl", [sharegpt_example(special) for _ in range(300)])
    pairs = random.Random(7)  # its own stream: adding it changed none of the files above
    write(out / "preference.jsonl", [preference_example(pairs) for _ in range(400)])
    feedback = random.Random(11)  # its own stream too
    write(out / "unpaired.jsonl", [unpaired_example(feedback) for _ in range(400)])
    tools = random.Random(41)  # its own stream: adding it changed none of the files above
    write(out / "tool_prompts.jsonl", [tool_prompt_example(tools) for _ in range(256)])
    write(out / "tool_sft.jsonl", [tool_sft_example(tools) for _ in range(2000)])


if __name__ == "__main__":
    main(*sys.argv[1:])
