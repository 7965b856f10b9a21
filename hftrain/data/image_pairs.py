"""Preference pairs with images (dpo, simpo, orpo) for image-text models, in TRL's vision formats: loading, exact masks,
truncation, collation with one image encoding per pair.

A row is `prompt` (messages), `chosen` and `rejected` (one assistant message each; without a prompt column the
conversations' shared leading messages are the prompt) and an `images` column, one image per image part of the
prompt, in order (hftrain.data.image_chats' references: paths relative to the data file's folder, or PIL images).
Content is a list of parts ({"type": "image"}, {"type": "text", "text": ...}) or a string; a prompt whose messages
all hold strings while the row has images gets the images before the text of its first user message, as TRL's
`prepare_multimodal_messages` puts them. Completions hold text only.

Each side is encoded as an image chat whose last assistant turn is the completion (`image_chats.encode`: the turn's
content and end-of-turn token trained, image tokens never). The two sides must share their prompt tokens (the image
expansions included) up to the completion; the collator runs the processor once per pair, on the chosen side with
the images, and builds the rejected row from those prompt tokens, the same per-image outputs (pixel_values computed
once, read for both rows) and the rejected completion's tokens.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from hftrain.data.formats import ROLES
from hftrain.data.image_chats import (
    FILLER_SCAN,
    IMAGES_COLUMN,
    PER_TOKEN_PAD,
    ImageRows,
    StreamImageCollator,
    base_folder,
    check_image_chat,
    check_image_paths,
    collate,
    encode,
    filler_row,
    open_image,
    truncate,
)
from hftrain.data.origin import ROW_COLUMN
from hftrain.data.sources import row_origin
from hftrain.data.tokenize import IGNORE_INDEX, DataSpec
from hftrain.errors import HftrainError


def parts(content) -> list[dict]:
    return [{"type": "text", "text": content}] if isinstance(content, str) else content


def with_image_parts(prompt: list[dict], count: int) -> list[dict]:
    """TRL's placement for a prompt without image parts (every content a string) and `count` images: the image
    parts before the text of the first user message (trl.data_utils.prepare_multimodal_messages)."""
    if not count or not all(isinstance(m.get("content"), str) for m in prompt):
        return prompt
    first = next((i for i, m in enumerate(prompt) if m.get("role") == "user"), None)
    if first is None:
        return prompt
    user = prompt[first]
    return [*prompt[:first], {"role": "user", "content": [*[{"type": "image"}] * count, *parts(user["content"])]},
            *prompt[first + 1:]]


def check_image_pair(example: dict, messages_field: str, where: str) -> tuple[list[dict], list[dict], list[dict], list]:
    """(prompt, chosen, rejected, image references) of one row, or HftrainError naming the row and what is wrong."""
    chosen, rejected, prompt = example.get("chosen"), example.get("rejected"), example.get("prompt")
    if not (isinstance(chosen, list) and isinstance(rejected, list)):
        raise HftrainError(f"{where}: chosen and rejected must be message lists for an image-text model (TRL's "
                           "conversational vision format); string pairs with images are not supported yet")
    if prompt is None:  # implicit prompt: the shared leading messages
        shared = next((i for i, (a, b) in enumerate(zip(chosen, rejected)) if a != b), min(len(chosen), len(rejected)))
        prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
    if not isinstance(prompt, list) or not prompt:
        raise HftrainError(f"{where}: a pair needs a prompt of at least one message (a prompt column of messages, or "
                           "conversations that share their first messages)")
    images = example.get(IMAGES_COLUMN) or []
    images = images if isinstance(images, list) else [images]
    prompt = with_image_parts(prompt, len(images))
    for name, completion in (("chosen", chosen), ("rejected", rejected)):
        if len(completion) != 1 or not isinstance(completion[0], dict) or completion[0].get("role") != "assistant":
            raise HftrainError(f"{where}: the {name} completion must be one assistant message (got "
                               f"{[m.get('role') if isinstance(m, dict) else m for m in completion]})")
        if any(isinstance(p, dict) and p.get("type") == "image" for p in parts(completion[0].get("content"))):
            raise HftrainError(f"{where}: the {name} completion holds an image; images in completions are not "
                               "supported yet (put them in the prompt)")
    sides = []
    for completion in (chosen, rejected):
        messages, refs = check_image_chat({messages_field: [*prompt, *completion], IMAGES_COLUMN: images},
                                          messages_field, where)
        sides.append(messages)
    if any(m["role"] not in ROLES for m in prompt):
        raise HftrainError(f"{where}: prompt roles must be one of {', '.join(ROLES)}")
    return sides[0][:-1], sides[0][-1:], sides[1][-1:], refs


def completion_start(labels: list[int]) -> int:
    """The first trained position (the completion's first token), or the length when nothing is trained."""
    return next((i for i, label in enumerate(labels) if label != IGNORE_INDEX), len(labels))


def encode_pair(processor, prompt, chosen, rejected, images, spec: DataSpec, where: str) -> dict:
    """Both sides through the processor (image_chats.encode, the completion as the last trained turn): {"chosen",
    "rejected": encode's results, "prompt_tokens": the shared tokens before the completion, "dropped": "" |
    "overlong" | "image_cut" | "no_trained_tokens" | "identical"}. A pair whose sides differ before the completion
    is refused."""
    completion_spec = replace(spec, assistant_only_loss=True, train_on_turns="last")
    sides = [encode(processor, [*prompt, *completion], images, completion_spec, where)
             for completion in (chosen, rejected)]
    ids = [side["inputs"]["input_ids"][0].tolist() for side in sides]
    starts = [completion_start(side["labels"][0].tolist()) for side in sides]
    dropped = sides[0]["dropped"] or sides[1]["dropped"] or ("identical" if ids[0] == ids[1] else "")
    if not dropped and (starts[0] != starts[1] or ids[0][:starts[0]] != ids[1][:starts[1]]):
        raise HftrainError(f"{where}: the prompt tokens differ between the chosen and the rejected rendering (the "
                           "chat template or the tokenizer changes the prompt depending on the answer), so the pair "
                           "would not compare two answers to one prompt with one image encoding; fix the template or "
                           "the data")
    return {"chosen": sides[0], "rejected": sides[1], "prompt_tokens": starts[0], "dropped": dropped}


class ImagePairs(ImageRows):
    """The kept pairs of one image preference set: the rendered sides, image references, and the token ids and labels
    of the load-time encoding (the collator runs the processor again on the chosen side with the images and checks
    that it gives the same ids)."""

    column_names = ["prompt", "chosen", "rejected", IMAGES_COLUMN, "input_ids", "labels", "rejected_input_ids",
                    "rejected_labels"]

    def collator(self, processor, pad_token_id: int) -> ImagePairCollator:
        return ImagePairCollator(self, processor, pad_token_id)

    def example(self, i: int, processor) -> tuple[list[dict], list[torch.Tensor]]:
        """([chosen inputs, rejected inputs] for a batch of 1 each, [chosen labels, rejected labels]) of kept pair i:
        one processor call (the chosen side with the images); the rejected side shares its prompt tokens, their
        per-token outputs and every per-image output, and has its own completion tokens."""
        row, where = self.rows[i], f"{self.name} pair {i}"
        images = [open_image(r, self.base, where) for r in row["images"]]
        chosen = processor(text=[row["text"]], images=images or None, return_tensors="pt", add_special_tokens=False)
        truncate(chosen, len(row["input_ids"]))
        if chosen["input_ids"][0].tolist() != row["input_ids"]:
            raise HftrainError(f"{where}: the processor encodes this pair differently from the first time (at load); "
                               "its image settings must be deterministic")
        shared, ids = row["prompt_tokens"], torch.tensor([row["rejected_input_ids"]])
        rejected = {key: value for key, value in chosen.items() if key not in PER_TOKEN_PAD and key != "input_ids"}
        rejected["input_ids"] = ids
        for key, fill in ((k, 1 if k == "attention_mask" else PER_TOKEN_PAD[k]) for k in PER_TOKEN_PAD if k in chosen):
            value = chosen[key]
            rejected[key] = torch.cat([value[:, :shared], value.new_full((1, ids.shape[1] - shared), fill)], dim=1)
        return [chosen, rejected], [torch.tensor([row["labels"]]), torch.tensor([row["rejected_labels"]])]


def pair_row(pair: dict, refs: list) -> dict:
    """What the collator reads of an encoded pair (`encode_pair`): the chosen side's rendered text, token ids and
    labels, the rejected side's, the shared prompt's length, the image tokens' places, the image references."""
    c, r = pair["chosen"], pair["rejected"]
    return {"images": refs, "text": c["text"], "input_ids": c["inputs"]["input_ids"][0].tolist(),
            "labels": c["labels"][0].tolist(), "rejected_input_ids": r["inputs"]["input_ids"][0].tolist(),
            "rejected_labels": r["labels"][0].tolist(), "prompt_tokens": pair["prompt_tokens"],
            "image_positions": [k for k, inside in enumerate(c["image_mask"]) if inside],
            "image_tokens": c["image_tokens"]}


def stream_pair(example: dict, processor, spec: DataSpec, base: Path | None, where: str) -> dict:
    """One raw image pair of a stream as a training row (`pair_row` and `dropped`), encoded as `prepare_pairs` encodes
    it; its images are opened to encode it and again by the collator, never kept (a checkpoint holds the stream's
    buffered rows as JSON, so images must be file paths: image_chats.check_image_paths)."""
    prompt, chosen, rejected, refs = check_image_pair(example, spec.messages_field, where)
    check_image_paths(example, where)
    pair = encode_pair(processor, prompt, chosen, rejected, [open_image(r, base, where) for r in refs], spec, where)
    if pair["dropped"]:
        return {"dropped": True}
    return {**pair_row(pair, refs), "dropped": False}


def filler_pair(examples, processor, spec: DataSpec, base: Path | None, name: str) -> dict | None:
    """The pair ImagePairCollator adds to a micro-batch without an image: the first kept pair with an image among
    `examples` (the stream's first image_chats.FILLER_SCAN, every rank the same), else the first kept pair."""
    return filler_row(examples, processor, spec, base, name, read=stream_pair)


def prepare_pairs(raw, processor, spec: DataSpec, name: str) -> tuple[ImagePairs, dict]:
    """Check and encode every pair once (masks, image tokens, truncation), keep the trainable ones, count the rest."""
    base, rows, counts = base_folder(name), [], {"overlong": 0, "image_cut": 0, "no_trained_tokens": 0, "identical": 0}
    stats = {"format": "image_preference", "images": 0, "image_tokens": 0, "tokens": 0, "trained_tokens": 0,
             "truncated_examples": 0, "truncated_tokens": 0}
    origin = row_origin(name, False)
    for i, example in enumerate(raw):
        number = example.pop(ROW_COLUMN, None)
        where = origin.where(number) if number is not None else f"dataset {name!r} example {i}"
        prompt, chosen, rejected, refs = check_image_pair(example, spec.messages_field, where)
        pair = encode_pair(processor, prompt, chosen, rejected, [open_image(r, base, where) for r in refs], spec,
                           where)
        if pair["dropped"]:
            counts[pair["dropped"]] += 1
            continue
        c, r = pair["chosen"], pair["rejected"]
        rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected, **pair_row(pair, refs)})
        stats["images"] += len(refs)
        stats["image_tokens"] += c["image_tokens"]
        stats["tokens"] += len(rows[-1]["input_ids"]) + len(rows[-1]["rejected_input_ids"])
        stats["trained_tokens"] += sum(int((side["labels"][:, 1:] != IGNORE_INDEX).sum()) for side in (c, r))
        stats["truncated_examples"] += (c["truncated"] + r["truncated"]) > 0
        stats["truncated_tokens"] += c["truncated"] + r["truncated"]
    stats = {**stats, "examples": len(rows), **{f"dropped_{k}": v for k, v in counts.items()}}
    if not rows:
        raise HftrainError(
            f"every pair of {name} ({len(raw)}) was dropped: {counts['overlong']} over-long (overlong_examples=drop), "
            f"{counts['image_cut']} whose max_length={spec.max_length} cut would fall inside or before an image's "
            f"tokens, {counts['no_trained_tokens']} without a trained token, {counts['identical']} with identical "
            "sides; raise max_length"
        )
    return ImagePairs(rows, base, name), stats


class ImagePairCollator:
    """A micro-batch of b image pairs as 2b rows, the b chosen rows then the b rejected rows (as data.Collator orders
    text pairs), right-padded (image_chats.collate); per-image outputs in row order, so the pixels of pair k serve
    row k and row b + k. A micro-batch without an image gets one more pair, the set's first pair with an image, every
    label -100 (image_chats.ImageChatCollator's filler: every process runs the vision tower); `num_examples` counts
    the real pairs; `image_tokens` marks each row's image tokens (orpo's NLL leaves them out)."""

    def __init__(self, dataset: ImagePairs, processor, pad_token_id: int):
        self.dataset, self.processor, self.pad_token_id = dataset, processor, pad_token_id
        self.mark_real_tokens = False  # the Collator interface
        self.reference = None  # precompute_ref_log_probs is refused for image-text models (hftrain.vision)
        self.filler = next((i for i, row in enumerate(dataset.rows) if row["images"]), 0)

    def __call__(self, row_indices: list[int]) -> dict[str, torch.Tensor]:
        encoded = [self.dataset.example(i, self.processor) for i in row_indices]
        if not encoded or not any(self.dataset.rows[i]["images"] for i in row_indices):
            inputs, labels = self.dataset.example(self.filler, self.processor)
            encoded.append((inputs, [torch.full_like(label, IGNORE_INDEX) for label in labels]))
        inputs = [x[side] for side in (0, 1) for x, _ in encoded]
        labels = [y[side] for side in (0, 1) for _, y in encoded]
        batch = collate(inputs, labels, self.pad_token_id)
        # the image tokens (expansions and their tags; the same positions on both sides, which share the prompt):
        # orpo's NLL over the chosen rows' tokens leaves them out; dpo's and simpo's labels already do
        image_tokens = torch.zeros_like(batch["input_ids"], dtype=torch.bool)
        rows = [*row_indices, *([self.filler] if len(encoded) > len(row_indices) else [])]
        for r, i in enumerate(rows * 2):
            image_tokens[r, self.dataset.rows[i]["image_positions"]] = True
        return {**batch, "image_tokens": image_tokens, "num_examples": torch.tensor(len(row_indices))}


class StreamImagePairCollator(StreamImageCollator):
    """ImagePairCollator for a stream's micro-batches, given as rows (lists of one `stream_pair`) instead of indices;
    `filler`: the pair for a micro-batch without an image (`filler_pair`). With several `processes` and a filler
    without an image, a pair with an image met later stops the run (as image_chats.StreamImageCollator: the
    processes' gathers or reductions would not match)."""

    def late_image(self) -> str:
        return (f"dataset {self.name!r}: a pair with an image came after the stream's first {FILLER_SCAN} examples, "
                "which held none; on several processes every micro-batch must be able to run the vision tower, so "
                "put a pair with an image among the first examples (or shuffle the files), or train on one process")

    def collate(self, pairs: list[dict]) -> dict[str, torch.Tensor]:
        held = ImagePairs([*pairs, *([self.filler] if self.filler else [])], self.base, self.name)
        collator = ImagePairCollator(held, self.processor, self.pad_token_id)
        if self.filler and not any(pair["images"] for pair in pairs):
            collator.filler = len(pairs)  # the stream's filler, as a map-style set's first pair with an image
        return collator(list(range(len(pairs))))
