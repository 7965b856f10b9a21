"""Build the shipped mini image-chat set: coloured shapes on plain backgrounds, with captions, in TRL's vision format.

    python scripts/make_image_chat.py [OUT_DIR]     # default: data/ (image-chat.jsonl, image-pairs.jsonl,
                                                    # image-unpaired.jsonl, images/*.png)

Each row has `messages` whose content is a list of parts for every role ({"type": "image"} / {"type": "text"}) and an
`images` column of PNG paths relative to the JSONL file, one per image part in order of appearance. Most rows ask for
one shape's colour and kind; some hold two images in one turn, some an image in a later user turn, some a system
message. Deterministic: the same files every time (no randomness beyond a fixed-seed generator).

`image-pairs.jsonl`: preference pairs on the same images in TRL's vision formats (dpo, simpo): `prompt` messages,
one-message `chosen` (the right colour and shape) and `rejected` (a wrong one), and `images`; half the prompts give
their image parts in list-of-parts content, half give string content, into whose first user message the images go
before the text (as TRL's `prepare_multimodal_messages` puts them); some prompts hold two images.
`image-unpaired.jsonl`: the same pairs unpaired for kto (TRL's unpairing): `prompt`, `completion` (one message),
`label` (true for the chosen answer, false for the rejected one) and `images`.
"""

import argparse
import json
import random
from pathlib import Path

from PIL import Image, ImageDraw

COLOURS = {"red": (220, 30, 30), "green": (30, 170, 60), "blue": (40, 70, 220), "yellow": (235, 200, 20)}
SHAPES = ("circle", "square", "triangle")
SIDE = 32


def draw(colour: str, shape: str, background: tuple[int, int, int]) -> Image.Image:
    image = Image.new("RGB", (SIDE, SIDE), background)
    pen, box = ImageDraw.Draw(image), (6, 6, SIDE - 7, SIDE - 7)
    if shape == "circle":
        pen.ellipse(box, fill=COLOURS[colour])
    elif shape == "square":
        pen.rectangle(box, fill=COLOURS[colour])
    else:
        pen.polygon([(SIDE // 2, 5), (SIDE - 6, SIDE - 7), (5, SIDE - 7)], fill=COLOURS[colour])
    return image


def text(value: str) -> dict:
    return {"type": "text", "text": value}


IMAGE = {"type": "image"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path, nargs="?", default=Path(__file__).resolve().parent.parent / "data")
    args = parser.parse_args()
    rng = random.Random(0)
    (args.out_dir / "images").mkdir(parents=True, exist_ok=True)
    names = {}
    for colour in COLOURS:
        for shape in SHAPES:
            background = (255, 255, 255) if shape != "square" else (235, 235, 235)
            path = f"images/{colour}-{shape}.png"
            draw(colour, shape, background).save(args.out_dir / path, optimize=True)
            names[colour, shape] = path
    pairs = list(names)
    rows = []
    for colour, shape in pairs * 2:  # 24 one-image captions, half with a system message
        messages = [{"role": "user", "content": [IMAGE, text(rng.choice(["What is this?", "Describe the image.",
                                                                          "What shape do you see?"]))]},
                    {"role": "assistant", "content": [text(f"A {colour} {shape}.")]}]
        if len(rows) % 2:
            messages.insert(0, {"role": "system", "content": [text("You name shapes and colours.")]})
        rows.append({"messages": messages, "images": [names[colour, shape]]})
    for _ in range(8):  # two images in one turn
        (c1, s1), (c2, s2) = rng.sample(pairs, 2)
        rows.append({"messages": [
            {"role": "user", "content": [IMAGE, IMAGE, text("Name both shapes.")]},
            {"role": "assistant", "content": [text(f"First a {c1} {s1}, then a {c2} {s2}.")]},
        ], "images": [names[c1, s1], names[c2, s2]]})
    for _ in range(8):  # an image in a later turn
        (c1, s1), (c2, s2) = rng.sample(pairs, 2)
        rows.append({"messages": [
            {"role": "user", "content": [IMAGE, text("What colour is it?")]},
            {"role": "assistant", "content": [text(f"It is {c1}.")]},
            {"role": "user", "content": [text("And this one?"), IMAGE]},
            {"role": "assistant", "content": [text(f"A {c2} {s2}.")]},
        ], "images": [names[c1, s1], names[c2, s2]]})
    rng.shuffle(rows)
    with open(args.out_dir / "image-chat.jsonl", "w", encoding="utf-8") as out:
        for row in rows:
            out.write(json.dumps(row) + "\n")
    pairs_rng, preference = random.Random(1), []
    for i in range(32):
        count = 2 if i % 4 == 3 else 1
        shown = pairs_rng.sample(pairs, count)
        wrong = [(pairs_rng.choice([c for c in COLOURS if c != colour]), shape) for colour, shape in shown]
        right_text, wrong_text = (", then ".join(f"a {c} {s}" for c, s in answer) for answer in (shown, wrong))
        question = "Name both shapes." if count == 2 else pairs_rng.choice(["What is this?", "Describe the image."])
        prompt = ([{"role": "user", "content": [*[IMAGE] * count, text(question)]}] if i % 2 else
                  [{"role": "user", "content": question}])
        preference.append({"prompt": prompt,
                           "chosen": [{"role": "assistant", "content": right_text[0].upper() + right_text[1:] + "."}],
                           "rejected": [{"role": "assistant", "content": wrong_text[0].upper() + wrong_text[1:] + "."}],
                           "images": [names[pair] for pair in shown]})
    with open(args.out_dir / "image-pairs.jsonl", "w", encoding="utf-8") as out:
        for row in preference:
            out.write(json.dumps(row) + "\n")
    with open(args.out_dir / "image-unpaired.jsonl", "w", encoding="utf-8") as out:  # kto: each pair as two rows
        for row in preference:
            for side in ("chosen", "rejected"):
                out.write(json.dumps({"prompt": row["prompt"], "completion": row[side], "label": side == "chosen",
                                      "images": row["images"]}) + "\n")
    print(f"{len(rows)} image chats, {len(preference)} image preference pairs and {len(names)} images in "
          f"{args.out_dir}")


if __name__ == "__main__":
    main()
