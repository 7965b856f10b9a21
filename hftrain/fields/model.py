"""The model group: what is loaded and how it computes (dtype, attention kernel, compile, Liger, loss chunking,
gradient checkpointing, what of an image-text model trains), and the rules judged from the recipe alone
(`problems`); the rules that need the model's config or the machine are the preflight's (hftrain/preflight.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hftrain.fields import looks_local
from hftrain.fields import recipe_field as _f
from hftrain.paths import DEFAULT_MODEL


@dataclass
class ModelFields:
    model_name_or_path: str = _f(
        str(DEFAULT_MODEL),
        "Hub model id (org/name) or local folder, loaded with AutoModelForCausalLM.from_pretrained. Default: the tiny "
        "offline model shipped inside hftrain.",
        group="model",
    )
    tokenizer_name_or_path: str | None = _f(
        None, "Tokenizer id or folder; defaults to model_name_or_path.", group="model"
    )
    model_revision: str = _f("main", "Hub revision (branch, tag or commit) of the model.", group="model")
    trust_remote_code: bool = _f(
        False, "Allow model code from the hub repository to run. Off unless you trust the repository.", group="model"
    )
    dtype: str = _f(
        "float32",
        "dtype the weights are loaded in. Keep float32 for mixed-precision training (bf16 autocast keeps "
        "fp32 master weights); bfloat16 halves memory but trains in pure bf16.",
        group="model",
        choices=("float32", "bfloat16", "float16"),
    )
    attn_implementation: str | None = _f(
        None, "Attention kernel: eager, sdpa, flash_attention_2 (CUDA only; needs the flash-attn package: pip install "
        "flash-attn --no-build-isolation) or varlen (torch's own variable-length FlashAttention, "
        "torch.nn.attention.varlen: CUDA, bf16/fp16, packing; each packed document attends as its own sequence, by "
        "the packer's boundaries, with no mask, so a row costs the sum of its documents' causal squares instead of "
        "the row's; on a machine without CUDA, when named, hftrain runs it as sdpa over each document, in any "
        "precision: the same saving). Default: varlen where it can run (CUDA, bf16 or fp16, packing: true, llama, "
        "mistral, mixtral, qwen2, qwen3, phi3, olmo2 or gemma, without sp_size, pp_size, log_completions or "
        "eval_tasks), else the model's choice (sdpa: packed rows get a block-diagonal mask). Every kernel keeps "
        "packed examples apart: transformers' flash attention finds examples from position_ids only in a batch of "
        "one row, so hftrain hands it (and varlen) each packed micro-batch flattened into one row. The start-up line "
        "names the one in use.",
        group="model", choices=(None, "eager", "sdpa", "flash_attention_2", "varlen"),
    )
    use_liger_kernel: bool = _f(
        False, "Liger's Triton kernels (CUDA only; pip install liger-kernel==0.8.5, or the [cuda] extra): RMSNorm, "
        "SwiGLU/GeGLU and RoPE patched into the loaded model, and the output projection fused with the "
        "cross-entropy (chunked internally, gradients computed in forward), so the logits of a micro-batch are never "
        "materialised in fp32. For the architectures whose logits are lm_head(hidden); excludes loss_chunk_tokens.",
        group="model",
    )
    gradient_checkpointing: bool = _f(
        False, "Recompute activations in backward (non-reentrant) to save memory at ~30% more compute.",
        group="model",
    )
    loss_chunk_tokens: int = _f(
        0, "Compute the output projection and cross-entropy over this many trained tokens at a time, recomputing "
        "each chunk's logits in backward, so that the fp32 logits of a whole micro-batch never exist at once "
        "(they take tokens x vocabulary x 4 bytes, several GB for 100k+ vocabularies). 0: one chunk. Costs one "
        "more output projection per chunk in backward; for the architectures whose logits are lm_head(hidden).",
        group="model",
    )
    torch_compile: bool = _f(
        False, "Compile the model's repeated blocks (each decoder layer) with torch.compile, in place: parameter "
        "names and checkpoints are unchanged. Shapes are dynamic from the first compile, so varying lengths (and "
        "packed documents) do not recompile. The first step takes longer (it compiles; the start-up reports its "
        "time), later steps run faster; worth it for runs of many steps. CPU needs a C++ compiler (inductor).",
        group="model",
    )
    torch_compile_mode: str | None = _f(
        None, "torch.compile mode with torch_compile: default, reduce-overhead (CUDA graphs), max-autotune, "
        "max-autotune-no-cudagraphs. Default: torch's default.", group="model",
        choices=(None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"),
    )
    freeze_vision_tower: bool = _f(
        True, "Image-text models: the vision tower gets no gradient (full fine-tuning) and no LoRA adapters "
        "(all-linear). No effect on text models. See docs/vision.md.", group="model",
    )
    freeze_projector: bool = _f(
        True, "Image-text models: the projector between the vision tower and the language model (LLaVA's "
        "multi_modal_projector, Qwen's merger, Idefics3's connector) gets no gradient and no LoRA adapters "
        "(all-linear). No effect on text models.", group="model",
    )


def problems(r) -> list[str]:
    """The model's fields that cannot work as given or together."""
    problems = []
    if r.loss_chunk_tokens < 0:
        problems.append(f"loss_chunk_tokens must be >= 0 (0 = no chunking), got {r.loss_chunk_tokens}")
    if r.torch_compile_mode is not None and not r.torch_compile:
        problems.append(f"torch_compile_mode={r.torch_compile_mode} is set but torch_compile is false; set "
                        "torch_compile: true or remove torch_compile_mode")
    if r.torch_compile and r.tp_size > 1:
        problems.append("torch_compile with tp_size > 1 is refused: compiling transformers' tensor-parallel layers "
                        "(DTensor weights) fails in backward with torch 2.13 (a RecursionError in a view's backward); "
                        "use tensor parallelism or torch_compile, not both")
    if r.use_liger_kernel and r.tp_size > 1:
        problems.append(f"use_liger_kernel with tp_size={r.tp_size} is refused: Liger's fused loss reads "
                        "lm_head.weight directly, and under tensor parallelism that is a DTensor holding 1/tp_size of "
                        "the vocabulary (transformers' tp plan splits the head), which its Triton kernel cannot "
                        "take as the whole head; use tensor parallelism or Liger, not both")
    if r.fp16 and r.dtype == "bfloat16":
        problems.append("fp16 mixed precision with dtype=bfloat16 weights; use bf16")
    if looks_local(r.model_name_or_path) and not Path(r.model_name_or_path).expanduser().is_dir():
        problems.append(f"model_name_or_path {r.model_name_or_path!r} is not a folder; give a local model "
                        "folder or a hub id (org/name). scripts/make_tiny_model.py builds an offline one")
    return problems
