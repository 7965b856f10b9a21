"""Generate the small datasets shipped under data/ (deterministic; re-run to regenerate).

    python scripts/make_data.py [OUT_DIR]

chat.jsonl  -- {"messages": [...]} chats: single and multi-turn, some with a system prompt
text.jsonl  -- {"text": ...} short documents for plain causal-LM training

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


def main(out_dir: str = "data") -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(1234)
    for name, make, count in (("chat.jsonl", chat_example, 600), ("text.jsonl", text_example, 600)):
        with open(out / name, "w", encoding="utf-8") as f:
            for _ in range(count):
                f.write(json.dumps(make(rng), ensure_ascii=False) + "\n")
        print(f"wrote {count} examples to {out / name}")


if __name__ == "__main__":
    main(*sys.argv[1:])
