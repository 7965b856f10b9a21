"""Image-text-to-text models: recognised from the folder's config, loaded with transformers' Auto classes, their
processor, what trains (`freeze_vision_tower`, `freeze_projector`, LoRA's default targets) and what they refuse.

A model is an image-text model when its config's type is in transformers' `AutoModelForImageTextToText` mapping
(LLaVA, Qwen2-VL / Qwen2.5-VL, Gemma 3, Idefics3 / SmolVLM, ...): no recipe key says so. Its parts are found by the
module names transformers 5.23 gives them: the vision tower (`vision_tower`, `visual`, `vision_model`) and the
projector between it and the language model (`multi_modal_projector`, `connector`, or `merger` inside Qwen's
`visual`); everything else (the language model and its head) is the language side.
"""

from __future__ import annotations

import transformers
from torch import nn
from transformers import AutoConfig, AutoProcessor, PretrainedConfig
from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING_NAMES
from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES, MODEL_MAPPING
from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES
from transformers.utils import is_torchvision_available

from hftrain import hub
from hftrain.compat.deepspeed import whole_numel
from hftrain.compat.transformers import needs_missing_backend
from hftrain.errors import HftrainError, first_line

# The objectives that train an image-text model (image chats for sft, image preference pairs for dpo, simpo and
# orpo: hftrain.data.image_pairs, unpaired rows for kto: hftrain.data.image_unpaired, prompts with images for grpo:
# hftrain.rl.images), and what each other objective would need, in words for its refusal.
IMAGE_OBJECTIVES = ("sft", "dpo", "simpo", "orpo", "kto", "grpo")
IMAGE_OBJECTIVES_NOT_YET = {
    "reward": "a reward model (a sequence classifier) on an image-text model is",
    "distill": "distillation with images is",
}
VISION_TOWER_NAMES = ("vision_tower", "visual", "vision_model")
PROJECTOR_NAMES = ("multi_modal_projector", "connector", "merger", "mm_projector")


def is_image_text(config: PretrainedConfig | None) -> bool:
    """An image-text-to-text model (loaded with AutoModelForImageTextToText)."""
    return config is not None and config.model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES


def model_config(recipe) -> PretrainedConfig | None:
    """The model folder's config (None when it cannot be read: the model loader then says why; at once when the hub
    cannot be reached, instead of after huggingface_hub's retries)."""
    if hub.unreachable_problem("model", recipe.model_name_or_path, recipe.model_revision) is not None:
        return None
    try:
        return AutoConfig.from_pretrained(recipe.model_name_or_path, revision=recipe.model_revision,
                                          trust_remote_code=recipe.trust_remote_code)
    except (OSError, ValueError):
        return None


def torchvision_problem(config: PretrainedConfig | None) -> str | None:
    """Why this model's processor cannot be built here, when torchvision is not installed and its family needs it;
    else None. Two ways a family needs it:

    - its processor has a video processor (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, SmolVLM, LLaVA-OneVision, ...):
      transformers (5.17 to 5.24) cannot build such a processor without torchvision, even for images only:
      ProcessorMixin's constructor checks every attribute's class, `video_processor=None` included, against
      BaseVideoProcessor, which transformers defines only with torchvision (the lookup then fails on the placeholder
      VIDEO_PROCESSOR_MAPPING: "has no attribute '_extra_content'"), and AutoProcessor first loads the video
      processor, which requires it;
    - the installed transformers marks the family's Pillow image processor as needing torchvision (Idefics3's in
      5.17; not in 5.23): transformers then exports a placeholder that names it (hftrain.compat.transformers)."""
    if config is None or is_torchvision_available():
        return None
    name = PROCESSOR_MAPPING_NAMES.get(config.model_type)
    cls = getattr(transformers, name, None) if name else None
    images = IMAGE_PROCESSOR_MAPPING_NAMES.get(config.model_type)
    pil = images.get("pil") if isinstance(images, dict) else None
    if cls is not None and "video_processor" in cls.get_attributes():
        why = (f"its processor ({name}) has a video processor, and transformers {transformers.__version__} cannot "
               "build such a processor without torchvision, even for images only (its constructor checks the video "
               "processor's class against one that exists only with torchvision)")
    elif pil and needs_missing_backend(getattr(transformers, pil, None), "torchvision"):
        why = (f"transformers {transformers.__version__} marks its Pillow image processor ({pil}) as needing "
               "torchvision (transformers 5.23 does not)")
    else:
        return None
    return (f"the image-text model {config.model_type!r} needs torchvision, which is not installed: {why}. Install "
            "the torchvision build that matches your torch (torchvision 0.28.x for torch 2.13, 0.29.x needs "
            "torch>=2.14; the CPU build on a CPU-only machine). Families that train without torchvision: LLaVA, "
            "Gemma 3, Idefics3 (SmolVLM v1) where its image processor needs none; see docs/vision.md")


def problems(recipe, config: PretrainedConfig | None) -> list[str]:
    """What an image-text model cannot do in hftrain today, all at once (called by the preflight)."""
    if not is_image_text(config):
        return []
    kind, found = config.model_type, []
    if (needs := torchvision_problem(config)) is not None:
        found.append(needs)
    if recipe.packing:
        found.append(f"packing: true with the image-text model {kind!r}: rows with images are not packed (each "
                     "example's image features must meet its own placeholder tokens); set packing: false")
    if recipe.objective not in IMAGE_OBJECTIVES:
        found.append(f"objective={recipe.objective} with the image-text model {kind!r}: "
                     f"{IMAGE_OBJECTIVES_NOT_YET[recipe.objective]} not supported yet; objectives that train an "
                     f"image-text model today: {', '.join(IMAGE_OBJECTIVES)}")
    pairs = f"objective={recipe.objective} on image preference {'rows' if recipe.objective == 'kto' else 'pairs'} " \
        f"with the image-text model {kind!r}"
    if recipe.objective == "grpo":
        found += grpo_problems(recipe, kind)
    if recipe.objective in IMAGE_OBJECTIVES and recipe.objective not in ("sft", "grpo"):
        if recipe.precompute_ref_log_probs:
            found.append(f"precompute_ref_log_probs with {pairs} is not supported yet (the reference runs beside "
                         "the policy on the same pixels); set precompute_ref_log_probs: false")
        for name in ("max_prompt_length", "max_completion_length"):
            if getattr(recipe, name) is not None:
                found.append(f"{name} with {pairs} is not supported yet (a cut prompt would lose its image tokens); "
                             "pairs longer than max_length are truncated after their images, or dropped")
    if recipe.dataset_mixture:
        found.append(f"dataset_mixture with the image-text model {kind!r}: image chats load from one dataset_name "
                     "(plus eval_dataset_name) today; merge the files into one")
    if recipe.use_liger_kernel:
        found.append(f"use_liger_kernel with the image-text model {kind!r}: Liger's kernels patch text models only; "
                     "set use_liger_kernel: false")
    return found


def grpo_problems(recipe, kind: str) -> list[str]:
    """What grpo on an image-text model does not do yet (hftrain.rl.images: one process, DDP, ZeRO-3 or FSDP2,
    transformers' generate; tool calling, each turn generated with the prompt's pixels)."""
    what, found = f"objective=grpo with the image-text model {kind!r}", []
    if recipe.async_generation:
        found.append(f"async_generation with {what} is not supported yet: the rollout worker process samples from "
                     "token ids alone (it receives neither the prompts' images nor the processor); set "
                     "async_generation: false")
    if recipe.use_vllm:
        found.append(f"use_vllm with {what} is not supported yet: hftrain hands vLLM token ids only, without the "
                     "prompts' images; set use_vllm: false (transformers' generate takes the pixels)")
    split = [f"{name} {getattr(recipe, name)}" for name in ("tp_size", "pp_size", "sp_size", "cp_size", "ep_size")
             if getattr(recipe, name) > 1]
    if split:
        found.append(f"{', '.join(split)} with {what} is not supported yet: the image inputs are not split with the "
                     "model or the sequences; use one process or DDP")
    return found


def build_processor(recipe):
    """The model's processor (`AutoProcessor`): its tokenizer, image processor and chat template."""
    name = recipe.tokenizer_name_or_path or recipe.model_name_or_path
    if (needs := torchvision_problem(model_config(recipe))) is not None:
        raise HftrainError(needs)
    try:
        return AutoProcessor.from_pretrained(name, revision=recipe.model_revision,
                                             trust_remote_code=recipe.trust_remote_code)
    except (OSError, ValueError, ImportError) as exc:
        raise HftrainError(f"cannot load the processor of the image-text model {name!r}: {first_line(exc)}. The "
                           "folder needs its processor files (processor_config.json or preprocessor_config.json, "
                           "tokenizer files, chat template); some families' image processors need torchvision") \
            from None


def define_model_classes(config: PretrainedConfig) -> None:
    """Import the modules of an image-text model's sub-models (its language model's, its vision tower's) before the
    model loads. DeepSpeed's ZeRO-3 loading (`zero.Init`, DeepSpeed 0.19) wraps the `__init__` of every module class,
    also of a class first defined while it is active, and puts back on exit the `__init__` it found. transformers'
    attention classes are decorated after their body by the `kernels` library (`use_kernelized_func`, whose `__init__`
    gives each instance its `_kernel_funcs`), so an attention class defined inside `zero.Init` gets its undecorated
    `__init__` back on exit, and every later instance fails in its first forward ("'LlamaAttention' object has no
    attribute '_kernel_funcs'"). LLaVA's `__init__` imports its language model's module (`AutoModel.from_config`)
    inside the load, so the frozen reference copy of a ZeRO-3 dpo run, built after it, failed."""
    for key in getattr(config, "sub_configs", None) or {}:
        sub = getattr(config, key, None)
        if isinstance(sub, PretrainedConfig) and type(sub) in MODEL_MAPPING:
            MODEL_MAPPING[type(sub)]  # the mapping imports the class's module


def part_of(name: str) -> str:
    """'vision', 'projector' or 'language' for a parameter or module name."""
    parts = name.split(".")
    if any(p in PROJECTOR_NAMES for p in parts):
        return "projector"
    if any(p in VISION_TOWER_NAMES for p in parts):
        return "vision"
    return "language"


def trains_vision_tower(model: nn.Module) -> bool:
    """Some parameter of the vision tower gets a gradient (freeze_vision_tower false, fully or through its LoRA
    adapters)."""
    return any(p.requires_grad and part_of(name) == "vision" for name, p in model.named_parameters())


def frozen_parts(recipe) -> set[str]:
    return {part for part, frozen in (("vision", recipe.freeze_vision_tower),
                                      ("projector", recipe.freeze_projector)) if frozen}


def freeze(model: nn.Module, recipe) -> dict[str, int]:
    """Full fine-tuning: no gradient for the frozen parts. Returns the frozen parameter count per part."""
    frozen: dict[str, int] = {}
    parts = frozen_parts(recipe)
    for name, param in model.named_parameters():
        part = part_of(name)
        if part in parts:
            param.requires_grad_(False)
            frozen[part] = frozen.get(part, 0) + whole_numel(param)  # ZeRO-3 loads it partitioned
    return frozen


def lora_targets(model: nn.Module, recipe) -> list[str]:
    """LoRA's default (`all-linear`) targets on an image-text model: every Linear layer of the language model (not
    its output head), and of the vision tower / projector only where they are not frozen."""
    parts = {"language", "vision", "projector"} - frozen_parts(recipe)
    head = model.get_output_embeddings()
    return [name for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and module is not head and part_of(name) in parts]


def describe_frozen(frozen: dict[str, int]) -> str:
    names = {"vision": "vision tower", "projector": "projector"}
    said = ", ".join(f"the {names[p]} ({n:,} parameters)" for p, n in sorted(frozen.items()))
    return (f"frozen: {said} (freeze_vision_tower / freeze_projector)" if said else
            "image-text model: every part trains (freeze_vision_tower / freeze_projector are false)")


def lora_note(recipe, layers: int) -> str:
    trained = ["the language model"] + [f"the {name}" for part, name in (("vision", "vision tower"),
                                                                       ("projector", "projector"))
                                        if part not in frozen_parts(recipe)]
    return (f"all-linear LoRA on an image-text model: adapters on {layers} linear layers of {', '.join(trained)} "
            "(freeze_vision_tower / freeze_projector decide the rest)")

