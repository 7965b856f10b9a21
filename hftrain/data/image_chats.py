"""Image chats (TRL's vision format) for image-text models: loading, exact masks, truncation, collation.

A row is `messages` whose `content` is a list of parts ({"type": "image"}, {"type": "text", "text": ...}; a plain
string is accepted too) for every role, and an `images` column: one image per image part, in order of appearance,
as a path (relative paths are read from the data file's folder) or a PIL image (a saved dataset's Image feature).
Images are opened with Pillow and converted to RGB.

The model's processor encodes each example in the collator (its chat template, its image settings): pixels are never
cached; only the token ids (for lengths and statistics) are kept from the one encoding pass at load time. Every
processor output reaches the model (pixel_values, attention_mask, image_grid_thw, mm_token_type_ids, ...).

Masks follow the text-chat rule (hftrain.data.tokenize): the conversation is rendered by the chat template with the
image placeholders unexpanded and the assistant turns are located by rendering prefixes (each turn's content and its
end-of-turn token, not the whitespace after it). The processor expands each placeholder into the image's tokens (with
tags, separators or newlines around them in some families: Gemma 3's <start_of_image> ... <end_of_image>, Idefics3's
tiles with <row_i_col_j> tags) and reports where; its tokenizer's character offsets place every token: one holding a
character of an expansion is an image token, never trained, with assistant_only_loss false too; any other is trained
when it holds a character of an assistant turn. Truncation never cuts inside an image's tokens: an example longer than
max_length whose cut would fall inside or before an image's tokens is dropped and counted (`dropped_image_cut`); one
whose images all fit is truncated at max_length (overlong_examples: drop drops both).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from hftrain.data.formats import ROLES
from hftrain.data.origin import ROW_COLUMN
from hftrain.data.sources import row_origin
from hftrain.data.tokenize import IGNORE_INDEX, DataSpec, assistant_char_spans
from hftrain.errors import HftrainError

IMAGES_COLUMN = "images"
# Per-token processor outputs: padded along the sequence (0 after the row); every other output is per image or per
# row and concatenated along its first dimension (pixel_values, image_sizes, image_grid_thw, pixel_attention_mask,
# ...), zero-padded in its other dimensions to the largest (Idefics3's tiles per row).
PER_TOKEN_PAD = {"attention_mask": 0, "token_type_ids": 0, "mm_token_type_ids": 0}


def check_image_chat(example: dict, messages_field: str, where: str) -> tuple[list[dict], list]:
    """(messages, image references) of one row, or HftrainError naming the row and what is wrong."""
    messages = example.get(messages_field)
    if not isinstance(messages, list) or not messages:
        raise HftrainError(f"{where}: {messages_field} must be a non-empty list of {{role, content}} objects")
    image_parts, clean = 0, []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise HftrainError(f"{where}: message {i} has role {m.get('role') if isinstance(m, dict) else m!r}; "
                               f"roles must be one of {', '.join(ROLES)}")
        content = m.get("content")
        if isinstance(content, str):
            clean.append({"role": m["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise HftrainError(f"{where}: message {i} ({m['role']}) has content of type {type(content).__name__}; "
                               "an image chat's content is a list of parts ({type: image} / {type: text, text: ...})")
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image":
                image_parts += 1
                parts.append({"type": "image"})
            elif kind == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            else:
                raise HftrainError(f"{where}: message {i} part {j} is {part!r:.80}; parts are {{type: image}} or "
                                   "{type: text, text: <string>}")
        clean.append({"role": m["role"], "content": parts})
    if not any(m["role"] == "assistant" for m in clean):
        raise HftrainError(f"{where}: the conversation has no assistant message, so nothing can be trained")
    images = example.get(IMAGES_COLUMN) or []
    if not isinstance(images, list):
        images = [images]
    if len(images) != image_parts:
        raise HftrainError(f"{where}: {image_parts} image part(s) in the messages but {len(images)} image(s) in the "
                           f"{IMAGES_COLUMN!r} column; give one image per {{type: image}} part, in order")
    return clean, images


def open_image(ref: Any, base: Path | None, where: str):
    """A Pillow RGB image from a path (relative to `base`, the data file's folder) or a PIL image."""
    if isinstance(ref, Image.Image):
        return ref.convert("RGB")
    if isinstance(ref, dict) and (ref.get("bytes") or ref.get("path")):  # datasets' undecoded Image feature
        return Image.open(io.BytesIO(ref["bytes"]) if ref.get("bytes") else ref["path"]).convert("RGB")
    if not isinstance(ref, str):
        raise HftrainError(f"{where}: an image is {type(ref).__name__}; give a file path or a PIL image")
    path = Path(ref).expanduser()
    if not path.is_absolute() and base is not None and (base / path).exists():
        path = base / path
    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except OSError as exc:
        raise HftrainError(f"{where}: cannot read image {ref!r} ({exc.__class__.__name__}: {exc}); relative paths are "
                           f"read from the data file's folder{f' ({base})' if base else ''}") from None


class Renderer:
    """The processor's chat template with its tokenizer's encoding: what hftrain.data.tokenize's span finder calls
    (a processor's own __call__ takes images first)."""

    def __init__(self, processor):
        self.processor, self.tokenizer = processor, processor.tokenizer

    def apply_chat_template(self, messages, **kwargs):
        return self.processor.apply_chat_template(messages, **kwargs)

    def __call__(self, text, **kwargs):
        return self.tokenizer(text, **kwargs)


def image_token_ids(processor) -> set[int]:
    """The ids of the tokens the model fills with image features (LLaVA's and Idefics3's <image>, Gemma 3's
    <image_soft_token>; not the tags, separators or <start_of_image> / <end_of_image> around them)."""
    ids = {t for t in getattr(processor, "image_token_ids", None) or [] if t is not None}
    return ids or {processor.tokenizer.convert_tokens_to_ids(processor.image_token)}


def image_part_text(processor) -> str:
    """What the chat template writes for one image part: the placeholder the processor expands, with the text the
    template puts around it (Qwen-VL's `<|vision_start|><|image_pad|><|vision_end|>`; LLaVA's `<image>`, Gemma 3's
    `<start_of_image>`, Idefics3's `<image>` alone)."""
    before, after = "hftrain-text-before", "hftrain-text-after"
    text = processor.apply_chat_template([{"role": "user", "content": [
        {"type": "text", "text": before}, {"type": "image"}, {"type": "text", "text": after}]}], tokenize=False)
    start = text.rindex(before) + len(before)
    return text[start:text.index(after, start)]


def expanded_spans(processor, inputs, text: str, images: list, where: str) -> list[tuple[int, int, int]]:
    """(start, end, shift) of each image in the processor's text: characters [start, end) of the expanded text are the
    image's (its placeholder's expansion and what the chat template wrote around the placeholder for the image part:
    Qwen-VL's <|vision_start|> and <|vision_end|>), and text after `end` sits `shift` characters later than in the
    template's `text` (the processor reports where it expanded each placeholder: return_text_replacement_offsets)."""
    offsets = inputs.pop("text_replacement_offsets", None)
    if offsets is None:
        if images:
            raise HftrainError(f"{where}: the processor ({type(processor).__name__}) does not report where it "
                               "expands the image placeholders (return_text_replacement_offsets), so the masks cannot "
                               "be placed exactly; hftrain trains the families in docs/vision.md")
        return []
    part = image_part_text(processor) if offsets[0] else ""
    spans, shift = [], 0
    for entry in offsets[0]:
        (old_start, old_end), (new_start, new_end) = entry["span"], entry["new_span"]
        shift += (new_end - new_start) - (old_end - old_start)
        at = part.find(text[old_start:old_end])
        lead, tail = (part[:at], part[at + old_end - old_start:]) if at >= 0 else ("", "")
        if text[old_start - len(lead):old_start] == lead and text[old_end:old_end + len(tail)] == tail:
            new_start, new_end = new_start - len(lead), new_end + len(tail)
        spans.append((new_start, new_end, shift))
    return spans


def encode(processor, messages: list[dict], images: list, spec: DataSpec, where: str) -> dict:
    """One example through the processor: {"inputs": processor outputs (batch of 1, truncated), "labels": [1, L],
    "image_tokens": feature tokens, "added_tokens": every token of the images' expansions, "image_mask": per token,
    whether it is one of those (truncated as the labels), "dropped": "" |
    "overlong" | "image_cut" | "no_trained_tokens", "truncated": tokens cut}.

    Every token is placed by its characters: the processor expands each image placeholder of the template's text
    into the image's tokens (with tags, separators or newlines around them in some families) and reports where; a
    token holding any character of an expansion is an image token (a BPE merge across its edge included), never
    trained; any other token maps back to the template's text, where it is trained when it holds a character of an
    assistant turn (hftrain.data.tokenize's rule)."""
    if spec.assistant_only_loss:
        first = max(i for i, m in enumerate(messages) if m["role"] == "assistant") \
            if spec.train_on_turns == "last" else 0
        try:
            text, turns = assistant_char_spans(Renderer(processor), messages, first)
        except HftrainError as exc:
            raise HftrainError(f"{where}: {exc}") from None
    else:
        text = processor.apply_chat_template(messages, tokenize=False)
        turns = [(0, len(text))]
    inputs = processor(text=[text], images=images or None, return_tensors="pt", add_special_tokens=False,
                       return_offsets_mapping=True, return_text_replacement_offsets=True)
    expansions = expanded_spans(processor, inputs, text, images, where)
    char_offsets = inputs.pop("offset_mapping")[0].tolist()
    ids, feature_ids = inputs["input_ids"][0].tolist(), image_token_ids(processor)
    labels, added = [], []
    for t, (start, end) in zip(ids, char_offsets):
        inside = any(start < e and end > s for s, e, _ in expansions) or t in feature_ids
        shift = next((sh for s, e, sh in reversed(expansions) if e <= start), 0)  # expansions before the token
        original = (start - shift, end - shift)
        trained = not inside and any(original[0] < e and original[1] > s for s, e in turns)
        labels.append(t if trained else IGNORE_INDEX)
        added.append(inside)
    if labels:
        labels[0] = IGNORE_INDEX  # never a target (tokenize.py's rule): trained-token counts stay exact
    result = {"inputs": inputs, "labels": torch.tensor([labels]), "dropped": "", "truncated": 0, "text": text,
              "image_tokens": sum(t in feature_ids for t in ids), "added_tokens": sum(added), "image_mask": added}
    if len(ids) > spec.max_length:
        last_image = max((k for k, inside in enumerate(added) if inside), default=-1)
        if spec.overlong_examples == "drop":
            result["dropped"] = "overlong"
        elif last_image >= spec.max_length:
            result["dropped"] = "image_cut"
        else:
            result["truncated"] = len(ids) - spec.max_length
            result["labels"] = result["labels"][:, :spec.max_length]
            result["image_mask"] = added[:spec.max_length]
            truncate(inputs, spec.max_length)
    if not result["dropped"] and not (result["labels"] != IGNORE_INDEX).any():
        result["dropped"] = "no_trained_tokens"
    return result


def truncate(inputs: dict, length: int) -> None:
    """Cut the per-token processor outputs to `length` tokens (in place)."""
    for key in ("input_ids", *PER_TOKEN_PAD):
        if key in inputs:
            inputs[key] = inputs[key][:, :length]


class ImageRows:
    """The kept rows of one image set (chats, preference pairs, rated rows), indexable like a datasets.Dataset where
    the batching code reads it: `len`, and by name each of its `column_names` after the images (the load-time token
    ids, labels and the like)."""

    column_names: list[str] = [IMAGES_COLUMN]

    def __init__(self, rows: list[dict], base: Path | None, name: str):
        self.rows, self.base, self.name = rows, base, name

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, key):
        if key in self.column_names[self.column_names.index(IMAGES_COLUMN) + 1:]:
            return [row[key] for row in self.rows]
        raise KeyError(key)


class ImageChats(ImageRows):
    """The kept rows of one image-chat set: messages, image references, the rendered conversation, and the token ids
    and labels of the load-time encoding (tokens only: the collator runs the processor again on the text and the
    images, and checks that it gives the same ids)."""

    column_names = ["messages", IMAGES_COLUMN, "input_ids", "labels"]

    def collator(self, processor, pad_token_id: int) -> ImageChatCollator:
        return ImageChatCollator(self, processor, pad_token_id)

    def example(self, i: int, processor) -> tuple[dict, torch.Tensor]:
        """(processor outputs for a batch of 1, labels [1, L]) of kept row i."""
        row, where = self.rows[i], f"{self.name} example {i}"
        images = [open_image(r, self.base, where) for r in row["images"]]
        inputs = processor(text=[row["text"]], images=images or None, return_tensors="pt", add_special_tokens=False)
        truncate(inputs, len(row["input_ids"]))
        if inputs["input_ids"][0].tolist() != row["input_ids"]:
            raise HftrainError(f"{where}: the processor encodes this example differently from the first time (at "
                               "load); its image settings must be deterministic")
        return inputs, torch.tensor([row["labels"]])


def base_folder(name: str) -> Path | None:
    path = Path(name).expanduser()
    return path.parent if path.is_file() else path if path.is_dir() else None


def prepare(raw, processor, spec: DataSpec, name: str) -> tuple[ImageChats, dict]:
    """Check and encode every row once (masks, image tokens, truncation), keep the trainable ones, count the rest."""
    base, rows = base_folder(name), []
    counts = {"overlong": 0, "image_cut": 0, "no_trained_tokens": 0}
    stats = {"format": "image_chat", "images": 0, "image_tokens": 0, "tokens": 0, "trained_tokens": 0,
             "truncated_examples": 0, "truncated_tokens": 0}
    origin = row_origin(name, False)
    for i, example in enumerate(raw):
        number = example.pop(ROW_COLUMN, None)  # load_image_chats numbers the rows before the hold-out shuffles them
        where = origin.where(number) if number is not None else f"dataset {name!r} example {i}"
        messages, refs = check_image_chat(example, spec.messages_field, where)
        encoded = encode(processor, messages, [open_image(r, base, where) for r in refs], spec, where)
        if encoded["dropped"]:
            counts[encoded["dropped"]] += 1
            continue
        ids = encoded["inputs"]["input_ids"][0].tolist()
        rows.append({"messages": messages, "images": refs, "text": encoded["text"], "input_ids": ids,
                     "labels": encoded["labels"][0].tolist(), "image_tokens": encoded["image_tokens"]})
        stats["images"] += len(refs)
        stats["image_tokens"] += encoded["image_tokens"]
        stats["tokens"] += len(ids)
        stats["trained_tokens"] += int((encoded["labels"][:, 1:] != IGNORE_INDEX).sum())
        stats["truncated_examples"] += encoded["truncated"] > 0
        stats["truncated_tokens"] += encoded["truncated"]
    stats = {**stats, "examples": len(rows), **{f"dropped_{k}": v for k, v in counts.items()}}
    if not rows:
        raise HftrainError(
            f"every example of {name} ({len(raw)}) was dropped: {counts['overlong']} over-long "
            f"(overlong_examples=drop), {counts['image_cut']} whose max_length={spec.max_length} cut would fall inside "
            f"or before an image's tokens, {counts['no_trained_tokens']} without a trained token; raise max_length"
        )
    return ImageChats(rows, base, name), stats


class ImageChatCollator:
    """Encodes a micro-batch of image chats with the processor and right-pads it: input_ids (pad id), labels (-100),
    per-token outputs (0); per-image outputs are concatenated in row order.

    Every micro-batch runs the vision tower when the set has an image anywhere: under ZeRO-3 and FSDP2 its forward
    gathers sharded parameters, a collective every process must join, and DDP reduces a trained tower's gradients
    from every process. A micro-batch without an image (text-only chats, or none: the padded end of an epoch) gets
    one more row, the set's first chat with an image, with every label -100: it trains nothing and changes no loss
    (the rows are right-padded and causal, so the others' logits are their own), and `num_examples` counts the real
    rows only. The loop pops `num_examples` before the forward."""

    def __init__(self, dataset: ImageChats, processor, pad_token_id: int):
        self.dataset, self.processor, self.pad_token_id = dataset, processor, pad_token_id
        self.mark_real_tokens = False  # the Collator interface; a mixture-of-experts image-text model is not handled
        self.reference = None
        # the filler row: the first chat with an image (or the first chat, when the set has no image at all: then no
        # micro-batch anywhere runs the vision tower, and the empty one still needs a row)
        self.filler = next((i for i, row in enumerate(dataset.rows) if row["images"]), 0)

    def __call__(self, row_indices: list[int]) -> dict[str, torch.Tensor]:
        encoded = [self.dataset.example(i, self.processor) for i in row_indices]
        if not encoded or not any(self.dataset.rows[i]["images"] for i in row_indices):
            inputs, labels = self.dataset.example(self.filler, self.processor)
            encoded.append((inputs, torch.full_like(labels, IGNORE_INDEX)))
        return {**collate([inputs for inputs, _ in encoded], [labels for _, labels in encoded], self.pad_token_id),
                "num_examples": torch.tensor(len(row_indices))}


# ----------------------------------------------------------------------------------------------- streaming
FILLER_SCAN = 1000  # streaming: the filler row is the first image chat among the stream's first examples


def stream_row(example: dict, processor, spec: DataSpec, base: Path | None, where: str) -> dict:
    """One raw image chat of a stream as a training row: {input_ids, labels, text (rendered), images (paths),
    dropped}; images are opened to encode it and again by the collator, never kept. A checkpoint holds the stream's
    buffered raw examples and rows as JSON, so images must be file paths."""
    messages, refs = check_image_chat(example, spec.messages_field, where)
    check_image_paths(example, where)
    encoded = encode(processor, messages, [open_image(ref, base, where) for ref in refs], spec, where)
    return {"input_ids": encoded["inputs"]["input_ids"][0].tolist(), "labels": encoded["labels"][0].tolist(),
            "text": encoded["text"], "images": refs, "dropped": bool(encoded["dropped"])}


def check_image_paths(example: dict, where: str) -> None:
    """A streamed image chat's images must be file paths (HftrainError otherwise): a checkpoint holds the stream's
    buffered raw examples and rows as JSON, which image bytes or PIL images are not."""
    refs = example.get(IMAGES_COLUMN) or []
    if not all(isinstance(ref, str) for ref in (refs if isinstance(refs, list) else [refs])):
        raise HftrainError(f"{where}: a streamed image chat gives its {IMAGES_COLUMN!r} as file paths (a checkpoint "
                           "holds the stream's buffered examples as JSON, which image bytes are not); give paths, or "
                           "set streaming: false")


def filler_row(examples, processor, spec: DataSpec, base: Path | None, name: str, read=None) -> dict | None:
    """The row ImageChatCollator adds to a micro-batch without an image (labels all -100: it trains nothing): the
    first kept image chat among `examples` (the stream's first FILLER_SCAN, every rank the same), else the first kept
    chat. `read`: how an example becomes a row, `stream_row`'s signature (image_pairs.stream_pair for pairs)."""
    read, first = read or stream_row, None
    for i, example in enumerate(examples):
        try:
            row = read(example, processor, spec, base, f"dataset {name!r} example {i}")
        except HftrainError:
            continue
        if not row["dropped"]:
            if row["images"]:
                return row
            first = first or row
    return first


class StreamImageCollator:
    """ImageChatCollator for a stream's micro-batches, given as rows (lists of one `stream_row`) instead of indices;
    `filler`: the row for a micro-batch without an image (`filler_row`). With several `processes` and a filler
    without an image (the stream's first FILLER_SCAN examples held none), an image chat met later stops the run: its
    micro-batch would run the vision tower on this process only, and the others would wait in ZeRO-3's / FSDP2's
    gathers or DDP's reduction (a hang, not an error)."""

    def __init__(self, processor, pad_token_id: int, base: Path | None, name: str, filler: dict | None,
                 processes: int = 1):
        self.processor, self.pad_token_id, self.filler = processor, pad_token_id, filler
        self.base, self.name = base, name
        self.mark_real_tokens = False  # the Collator interface
        self.reference = None
        self.no_image_filler = processes > 1 and not (filler and filler["images"])

    def __call__(self, rows: list[list[dict]]) -> dict[str, torch.Tensor]:
        examples = [example for row in rows for example in row]
        if self.no_image_filler and any(example["images"] for example in examples):
            raise HftrainError(self.late_image())
        return self.collate(examples)

    def late_image(self) -> str:
        """The refusal of an example with an image after a filler without one."""
        return (f"dataset {self.name!r}: an image chat came after the stream's first {FILLER_SCAN} examples, which "
                "held none; on several processes every micro-batch must be able to run the vision tower (a "
                "micro-batch without an image borrows one of those first image chats), so put an image chat among "
                "the first examples (or shuffle the files), or train on one process")

    def collate(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        chats = ImageChats([*examples, *([self.filler] if self.filler else [])], self.base, self.name)
        return ImageChatCollator(chats, self.processor, self.pad_token_id)(list(range(len(examples))))


def collate(inputs: list[dict], labels: list[torch.Tensor], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Processor outputs of single examples as one right-padded batch (see ImageChatCollator)."""
    width = max(x["input_ids"].shape[1] for x in inputs)
    batch = {"input_ids": torch.full((len(inputs), width), pad_token_id, dtype=torch.long),
             "labels": torch.full((len(inputs), width), IGNORE_INDEX, dtype=torch.long)}
    for r, (x, lbl) in enumerate(zip(inputs, labels)):
        batch["input_ids"][r, :x["input_ids"].shape[1]] = x["input_ids"][0]
        batch["labels"][r, :lbl.shape[1]] = lbl[0]
    for key in sorted({key for x in inputs for key in x} - {"input_ids"}):
        values = [x[key] for x in inputs if key in x]
        if key in PER_TOKEN_PAD:
            padded = torch.full((len(inputs), width, *values[0].shape[2:]), PER_TOKEN_PAD[key], dtype=values[0].dtype)
            for r, x in enumerate(inputs):
                padded[r, :x[key].shape[1]] = x[key][0]
            batch[key] = padded
        else:  # per image (LLaVA: [images, 3, H, W]) or per row (Idefics3: [1, tiles, 3, H, W], padded as the
            # processor pads a batch: zeros after each row's tiles, which the model skips as padding images)
            shape = [max(v.shape[d] for v in values) for d in range(1, values[0].dim())]
            batch[key] = torch.cat([torch.nn.functional.pad(v, [p for d in reversed(range(1, v.dim()))
                                                               for p in (0, shape[d - 1] - v.shape[d])])
                                    for v in values])
    return batch
