"""Prompts with images for objective grpo on an image-text model, in TRL's vision format (what GRPOTrainer takes): a
`prompt` of chat messages and an `images` column (one image per image part of the prompt, in order) or an `image`
column (one image); images are paths (relative ones read from the data file's folder) or PIL images
(hftrain.data.image_chats' references). A prompt whose messages all hold strings gets its images before the text of
its first user message, as TRL's `prepare_multimodal_messages` puts them; a text prompt with images is refused, as
TRL refuses it.

Each prompt is rendered by the processor's chat template with the generation prompt and encoded by the processor:
its token ids hold each image's expansion (the ids generate continues and rollouts.jsonl's prompt_ids). Pixels are
never cached: each generation window runs the processor again on its prompts' images (`row_inputs`, checked to give
the same ids), and those outputs travel with the window's rows: into `generate` (rollouts.generate_rows) and into each
micro-batch (rollouts.collate), so the policy's, the stored old and the reference log-probs of the completion tokens
are all computed on the same pixels. Image tokens sit in the prompt, so they are never trained, and their ids are
never sampled (suppressed in generate, as TRL suppresses the image token).

Reward functions get TRL's arguments: `prompts` as TRL builds them (every content a list of parts, each image part
holding its opened PIL image) and the dataset's other columns as the data gives them (`images`: the paths).
"""

from __future__ import annotations

import torch

from hftrain.data.image_chats import IMAGES_COLUMN, base_folder, image_token_ids, open_image
from hftrain.data.image_pairs import parts, with_image_parts
from hftrain.errors import HftrainError
from hftrain.rl.rollouts import PASSED_OVER, Prompt, is_conversational

IMAGE_COLUMN = "image"  # TRL's column for one image per prompt


def row_images(row: dict) -> list:
    """A row's image references: its `images` column (a list, or one image), else its `image` column, else none."""
    if row.get(IMAGES_COLUMN) is not None:
        refs = row[IMAGES_COLUMN]
        return list(refs) if isinstance(refs, list) else [refs]
    return [row[IMAGE_COLUMN]] if row.get(IMAGE_COLUMN) is not None else []


def image_name(ref, row: int, k: int):
    """How rollouts.jsonl names an image: its path as the data gives it, else its place in the dataset."""
    if isinstance(ref, str):
        return ref
    if isinstance(ref, dict) and ref.get("path"):
        return ref["path"]
    return {"row": row, "image": k}


def trl_messages(prompt: list[dict], count: int) -> list[dict]:
    """The prompt as TRL's `prepare_multimodal_messages` shapes it for an image-text model, before the images are put
    in: `count` image parts before the text of the first user message when every content is a string
    (image_pairs.with_image_parts), every string content a text part."""
    return [{**m, "content": parts(m["content"])} if isinstance(m.get("content"), str) else m
            for m in with_image_parts(prompt, count)]


def image_parts(messages: list[dict]) -> int:
    return sum(isinstance(p, dict) and p.get("type") == "image"
               for m in messages for p in parts(m.get("content") or ""))


class ProcessorTemplate:
    """The tokenizer of an image-text model's processor, rendering with the processor's chat template (what the
    prompts are rendered with; the tokenizer may have none of its own): what tool calling's template checks, tool
    suffixes and turn parsing use (hftrain.rl.tools), as TRL renders them with the processor."""

    def __init__(self, processor):
        self.tokenizer, self.chat_template = processor.tokenizer, processor.chat_template

    def apply_chat_template(self, messages, **kwargs):
        return self.tokenizer.apply_chat_template(messages, chat_template=self.chat_template, **kwargs)

    def __getattr__(self, name: str):
        if name in ("tokenizer", "chat_template"):  # not set yet (a copy being built)
            raise AttributeError(name)
        return getattr(self.tokenizer, name)


class PromptImages:
    """The processor's side of grpo's prompts with images (module docstring)."""

    def __init__(self, processor):
        self.processor = processor
        self.suppressed = tuple(sorted(image_token_ids(processor)))

    def encode(self, text: str, images: list) -> dict:
        return self.processor(text=[text], images=images or None, return_tensors="pt", add_special_tokens=False)

    def render(self, dataset, name: str, max_prompt_length: int | None, tools=None) -> list[Prompt]:
        """Every row's prompt rendered (with tool calling, with the tools' schemas: `apply_chat_template(tools=...)`,
        as TRL renders them), encoded with its images and checked (module docstring); a prompt with images longer
        than max_prompt_length is refused (cutting it would cut its image tokens)."""
        base, prompts = base_folder(name), []
        for i, row in enumerate(dataset):
            where = f"dataset {name!r} row {i}"
            value, refs = row["prompt"], row_images(row)
            sources = [open_image(r, base, where) for r in refs]
            if refs and not is_conversational(value):
                raise HftrainError(f"{where} has images but a text prompt; a prompt with images is a list of chat "
                                   "messages (TRL's conversational vision format: TRL refuses a rendered prompt too), "
                                   "whose chat template places the image tokens")
            if is_conversational(value):
                value = trl_messages(value, len(refs))
                if image_parts(value) != len(refs):
                    raise HftrainError(f"{where}: {image_parts(value)} image part(s) in the prompt but {len(refs)} "
                                       f"image(s) in the {IMAGES_COLUMN!r} / {IMAGE_COLUMN!r} column; give one image "
                                       "per {type: image} part, in order")
                text = self.processor.apply_chat_template(value, tools=tools or None, add_generation_prompt=True,
                                                          tokenize=False)
                ids = self.encode(text, sources)["input_ids"][0].tolist()
            else:
                text, ids = value, self.processor.tokenizer(value)["input_ids"]
            if max_prompt_length is not None and len(ids) > max_prompt_length:
                if refs:
                    raise HftrainError(f"{where}: its prompt is {len(ids)} tokens with its images' tokens, over "
                                       f"max_prompt_length={max_prompt_length}; a prompt with images is not cut (the "
                                       "cut would lose image tokens): raise max_prompt_length, or unset it")
                ids = ids[-max_prompt_length:]
                text = self.processor.tokenizer.decode(ids)
            # a path is read again at every window: made absolute here; a PIL image is kept as it is
            kept = [str(base / r) if isinstance(r, str) and base is not None and (base / r).exists() else r
                    for r in refs]
            prompts.append(Prompt(value, text, list(ids), {k: v for k, v in row.items() if k not in PASSED_OVER},
                                  images=[image_name(r, i, k) for k, r in enumerate(refs)], image_sources=kept))
        return prompts

    def again(self, prompt: Prompt, value: list[dict], tools, max_prompt_length: int | None) -> Prompt:
        """`prompt` with its messages replaced by `value` (an environment's observation added), rendered and encoded
        with its images as `render` does."""
        text = self.processor.apply_chat_template(value, tools=tools or None, add_generation_prompt=True,
                                                  tokenize=False)
        ids = self.encode(text, [open_image(r, None, "a prompt's image") for r in prompt.image_sources]
                          )["input_ids"][0].tolist()
        if max_prompt_length is not None and len(ids) > max_prompt_length:
            raise HftrainError(f"a prompt with images is {len(ids)} tokens once its environment's observation is "
                               f"added, over max_prompt_length={max_prompt_length}; a prompt with images is not cut: "
                               "raise max_prompt_length, or unset it")
        return Prompt(value, text, ids, prompt.columns, images=prompt.images, image_sources=prompt.image_sources)

    def row_inputs(self, prompts: list[Prompt]) -> list[dict[str, torch.Tensor]]:
        """Each prompt's processor outputs other than its token ids and attention mask (pixel_values, image_sizes,
        token_type_ids, ...; a batch of 1; {} for a prompt without images), each distinct prompt encoded once."""
        done: dict[int, dict] = {}
        for p in prompts:
            if id(p) in done:
                continue
            if not p.image_sources:
                done[id(p)] = {}
                continue
            out = self.encode(p.text, [open_image(r, None, "a prompt's image") for r in p.image_sources])
            if out["input_ids"][0].tolist() != p.ids:
                raise HftrainError(f"the processor encodes the prompt {p.text[:60]!r} with its images differently "
                                   "from the first time (at load); its image settings must be deterministic")
            done[id(p)] = {k: v for k, v in out.items() if k not in ("input_ids", "attention_mask")}
        return [done[id(p)] for p in prompts]

    @staticmethod
    def reward_prompt(prompt: Prompt):
        """The prompt as TRL hands it to reward functions: every content a list of parts, each image part holding
        its opened image (`prepare_multimodal_messages(prompt, images)`); a prompt without images as it is."""
        if not prompt.image_sources:
            return prompt.value
        images = iter([open_image(r, None, "a prompt's image") for r in prompt.image_sources])
        return [{**m, "content": [{**p, "image": next(images)} if p.get("type") == "image" else p
                                  for p in parts(m["content"])]} if m.get("content") is not None else m
                for m in prompt.value]

    @staticmethod
    def check_every_prompt_has_images(prompts: list[Prompt], name: str) -> None:
        """Several processes training the projector or the vision tower: DDP reduces their gradients on every
        process at every micro-batch, and a micro-batch without an image leaves them without one there (an error
        under DDP); under ZeRO-3 and FSDP2 every forward of the vision tower gathers its weights from every process,
        frozen or not (a process whose batch holds no image would not join: a hang). So every prompt must hold an
        image."""
        bare = sum(not p.image_sources for p in prompts)
        if bare:
            raise HftrainError(f"dataset {name!r}: {bare} of {len(prompts)} prompts hold no image; on several "
                               "processes with the projector or the vision tower trained (freeze_projector / "
                               "freeze_vision_tower false), or under ZeRO-3 or FSDP2 (which gather the vision "
                               "tower's weights in each of its forwards, frozen or not), every micro-batch and "
                               "generation must run them, so every prompt needs an image: add images, keep both "
                               "parts frozen under DDP, or train on one process")
