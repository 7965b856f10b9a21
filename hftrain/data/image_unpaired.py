"""Unpaired feedback with images (kto) for image-text models, in TRL's vision format: loading, exact masks,
truncation, and the collation of each row with its KL row on one image encoding.

A row is `prompt` (messages), `completion` (one assistant message), `label` (true: desirable) and an `images`
column, one image per image part of the prompt (hftrain.data.image_pairs' rules: string prompts get the images before
the first user message's text, as TRL's `prepare_multimodal_messages`; completions hold text only). Each row is
encoded as an image chat whose last assistant turn is the completion (its content and end-of-turn token trained,
image tokens never).

kto's KL row of row k is k's prompt followed by its partner's completion (hftrain.objectives.kto's `KTOPlan`). The
prompt holds the images, so the KL row carries row k's pixels: the collator runs the processor once per row (with
its images) and builds the KL row from k's prompt tokens, their per-token outputs, and the partner's completion
tokens, as TRL's DataCollatorForVisionUnpairedPreference concatenates the processed prompt with the cycled
completions; both forwards read the same pixel_values.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from hftrain.data.image_chats import (
    IMAGES_COLUMN,
    PER_TOKEN_PAD,
    ImageRows,
    base_folder,
    collate,
    encode,
    open_image,
    truncate,
)
from hftrain.data.image_pairs import check_image_pair, completion_start
from hftrain.data.origin import ROW_COLUMN
from hftrain.data.sources import row_origin
from hftrain.data.tokenize import IGNORE_INDEX, DataSpec
from hftrain.errors import HftrainError


def check_unpaired_row(example: dict, messages_field: str, where: str) -> tuple[list[dict], list[dict], bool, list]:
    """(prompt, completion, desirable, image references) of one row, or HftrainError naming the row."""
    label = example.get("label")
    if not isinstance(label, bool):
        raise HftrainError(f"{where}: label must be true (a desirable completion) or false, got {label!r}")
    completion = example.get("completion")
    if not isinstance(completion, list):
        raise HftrainError(f"{where}: completion must be a message list (one assistant message) for an image-text "
                           "model (TRL's conversational vision format)")
    # the pair checks with the completion on both sides: prompt, roles, images, one assistant message
    prompt, completion, _, refs = check_image_pair(
        {"prompt": example.get("prompt"), "chosen": completion, "rejected": completion,
         IMAGES_COLUMN: example.get(IMAGES_COLUMN)}, messages_field, where)
    return prompt, completion, label, refs


class ImageUnpaired(ImageRows):
    """The kept rows of one image kto set: the rendered chat, image references, the load-time token ids and labels,
    where the completion starts (`prompt_length`) and the label (kto's checks read them by name too)."""

    column_names = ["prompt", "completion", "label", IMAGES_COLUMN, "input_ids", "labels", "prompt_length",
                    "desirable"]

    def __init__(self, rows: list[dict], base: Path | None, name: str, max_length: int):
        super().__init__(rows, base, name)
        self.max_length = max_length

    def collator(self, processor, pad_token_id: int) -> ImageKTOCollator:
        return ImageKTOCollator(self, processor, pad_token_id)

    def example(self, i: int, processor) -> dict:
        """Row i's processor outputs (batch of 1): one call, with the images, checked against the load-time ids."""
        row, where = self.rows[i], f"{self.name} example {i}"
        images = [open_image(r, self.base, where) for r in row["images"]]
        inputs = processor(text=[row["text"]], images=images or None, return_tensors="pt", add_special_tokens=False)
        truncate(inputs, len(row["input_ids"]))
        if inputs["input_ids"][0].tolist() != row["input_ids"]:
            raise HftrainError(f"{where}: the processor encodes this row differently from the first time (at load); "
                               "its image settings must be deterministic")
        return inputs

    def kl_example(self, inputs: dict, row: int, partner: int) -> tuple[dict, torch.Tensor]:
        """Row `row`'s prompt (its tokens and per-token outputs from `inputs`, every per-image output as it is) and
        `partner`'s completion tokens, cut to max_length, with the completion trained."""
        start, other = self.rows[row]["prompt_length"], self.rows[partner]
        tail = other["input_ids"][other["prompt_length"]:]
        ids = torch.tensor([(self.rows[row]["input_ids"][:start] + tail)[:self.max_length]])
        labels = torch.tensor([([IGNORE_INDEX] * start + other["labels"][other["prompt_length"]:])[:self.max_length]])
        kl = {key: value for key, value in inputs.items() if key not in PER_TOKEN_PAD and key != "input_ids"}
        kl["input_ids"] = ids
        for key in (k for k in PER_TOKEN_PAD if k in inputs):
            fill = 1 if key == "attention_mask" else PER_TOKEN_PAD[key]
            value = inputs[key][:, :start]
            kl[key] = torch.cat([value, value.new_full((1, ids.shape[1] - value.shape[1]), fill)], dim=1)
        return kl, labels


def prepare_unpaired(raw, processor, spec: DataSpec, name: str) -> tuple[ImageUnpaired, dict]:
    """Check and encode every row once (masks, image tokens, truncation), keep the trainable ones, count the rest."""
    base, rows, counts = base_folder(name), [], {"overlong": 0, "image_cut": 0, "no_trained_tokens": 0}
    stats = {"format": "image_unpaired", "images": 0, "image_tokens": 0, "tokens": 0, "trained_tokens": 0,
             "truncated_examples": 0, "truncated_tokens": 0}
    completion_spec = replace(spec, assistant_only_loss=True, train_on_turns="last")
    origin = row_origin(name, False)
    for i, example in enumerate(raw):
        number = example.pop(ROW_COLUMN, None)
        where = origin.where(number) if number is not None else f"dataset {name!r} example {i}"
        prompt, completion, desirable, refs = check_unpaired_row(example, spec.messages_field, where)
        encoded = encode(processor, [*prompt, *completion], [open_image(r, base, where) for r in refs],
                         completion_spec, where)
        if encoded["dropped"]:
            counts[encoded["dropped"]] += 1
            continue
        labels = encoded["labels"][0].tolist()
        rows.append({"prompt": prompt, "completion": completion, "label": desirable, "desirable": desirable,
                     "images": refs, "text": encoded["text"], "input_ids": encoded["inputs"]["input_ids"][0].tolist(),
                     "labels": labels, "prompt_length": completion_start(labels),
                     "image_tokens": encoded["image_tokens"]})
        stats["images"] += len(refs)
        stats["image_tokens"] += encoded["image_tokens"]
        stats["tokens"] += len(labels)
        stats["trained_tokens"] += sum(label != IGNORE_INDEX for label in labels[1:])
        stats["truncated_examples"] += encoded["truncated"] > 0
        stats["truncated_tokens"] += encoded["truncated"]
    stats = {**stats, "examples": len(rows), **{f"dropped_{k}": v for k, v in counts.items()}}
    if not rows:
        raise HftrainError(
            f"every row of {name} ({len(raw)}) was dropped: {counts['overlong']} over-long (overlong_examples=drop), "
            f"{counts['image_cut']} whose max_length={spec.max_length} cut would fall inside or before an image's "
            f"tokens, {counts['no_trained_tokens']} without a trained token; raise max_length")
    return ImageUnpaired(rows, base, name, spec.max_length), stats


class ImageKTOCollator:
    """A micro-batch of kto rows with images: items are (row, KL partner) pairs from kto's `KTOPlan`, or plain rows
    (evaluation: the partner is the previous row of the set). The rows right-padded (image_chats.collate) with their
    per-image outputs (pixel_values, ...) in row order; `kl_input_ids`, `kl_labels` and `kl_<per-token output>` the
    KL rows, which read the same per-image outputs (row k's KL row holds row k's prompt, so row k's pixels);
    `desirable` the labels. A micro-batch without an image gets one more row, the set's first row with an image,
    every label -100 (every process runs the vision tower); `num_examples` counts the real rows."""

    def __init__(self, dataset: ImageUnpaired, processor, pad_token_id: int):
        self.dataset, self.processor, self.pad_token_id = dataset, processor, pad_token_id
        self.mark_real_tokens = False  # the Collator interface
        self.filler = next((i for i, row in enumerate(dataset.rows) if row["images"]), 0)

    def __call__(self, items: list) -> dict[str, torch.Tensor]:
        n = len(self.dataset)
        pairs = [item if isinstance(item, tuple) else (item, (item - 1) % n) for item in items]
        rows, kl_rows = [], []
        for row, partner in pairs:
            inputs = self.dataset.example(row, self.processor)
            rows.append((inputs, torch.tensor([self.dataset.rows[row]["labels"]])))
            kl_rows.append(self.dataset.kl_example(inputs, row, partner))
        if not any(self.dataset.rows[row]["images"] for row, _ in pairs):
            inputs = self.dataset.example(self.filler, self.processor)
            kl, kl_labels = self.dataset.kl_example(inputs, self.filler, self.filler)
            rows.append((inputs, torch.full((1, inputs["input_ids"].shape[1]), IGNORE_INDEX)))
            kl_rows.append((kl, torch.full_like(kl_labels, IGNORE_INDEX)))
        batch = collate([x for x, _ in rows], [y for _, y in rows], self.pad_token_id)
        kl = collate([x for x, _ in kl_rows], [y for _, y in kl_rows], self.pad_token_id)
        batch.update({f"kl_{key}": kl[key] for key in ("input_ids", "labels", *PER_TOKEN_PAD) if key in kl})
        desirable = [bool(self.dataset.rows[row]["desirable"]) for row, _ in pairs]
        desirable += [False] * (len(rows) - len(pairs))
        return {**batch, "desirable": torch.tensor(desirable), "num_examples": torch.tensor(len(pairs))}
