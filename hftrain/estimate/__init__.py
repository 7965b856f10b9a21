"""Memory per GPU before launching: every strategy side by side, and the cheapest launch preset that fits.

The rooms: `shape` (what is read of a model), `activations`, `budget` (what of a GPU a run may fill), `strategies`
(the per-strategy rows and the recommendation), `pipeline` (per-stage memory of pp x tp), `layouts` (the 3D search of a
cluster), `cli` (`hftrain estimate`). The model state of every row comes from hftrain.memory, as the run's start-up
line's does.

    python -m hftrain.estimate --model Qwen/Qwen2.5-7B --gpus 8 --gpu_memory 80 [--lora | --qlora] \
        [--seq 4096 --batch 4] [--sp 4] [--pp 4 --tp 8 --pp_schedule 1F1B]
    python -m hftrain.estimate --model models/llama-3-70b-shape --nodes 4 --gpus_per_node 8 --gpu_memory_gib 80

Only the model's config is read (the model is built on the meta device: no weights are downloaded).
The numbers are a model of what training keeps in memory, per GPU, in bytes:

- weights, gradients, optimizer states (AdamW: two fp32 moments), per strategy: hftrain.memory's model, the one
  each run's start-up line uses too (`Placement`: what a strategy shards, splits and offloads). bf16 mixed
  precision: DDP and FSDP keep fp32 weights and gradients (+ the bf16 weight copies autocast
  caches for the forward); DeepSpeed ZeRO keeps bf16 weights and gradients with fp32 master
  weights in the optimizer state (2 + 2 + 12 bytes per parameter, the ZeRO paper's model). ZeRO-1
  shards the optimizer state, ZeRO-2 also the gradients, ZeRO-3 / FSDP full shard everything; a
  sharded run also holds the gathered weights of the layers in flight (two, with prefetch). DDP
  with 2+ GPUs keeps a second copy of the gradients in its all-reduce buckets.
- activations saved for backward, counted tensor by tensor for a Llama-style decoder layer with
  SDPA/flash attention (no s x s score matrix): per token, two norms (input and normalised
  output in the residual dtype, plus the input of the next matmul), q/k/v, attention output and
  its contiguous copy, and four MLP tensors. With gradient checkpointing only each layer's input
  is kept, plus one layer recomputed during backward. The loss keeps fp32 log-probabilities and
  their gradient for every predicted token (vocab x tokens x 8 bytes) and the logits themselves.
- the peak is weights + optimizer + max(activations, gradients): gradients fill up during backward
  while activations are freed (and gradients are freed by `zero_grad(set_to_none=True)` before the
  next forward). Offload variants move what they offload to CPU memory (shown separately).
- sequence parallelism (--sp N, DeepSpeed Ulysses, preset zero3_sp): each GPU of a group of N holds the
  activations and loss buffers of 1/N of every sequence (its slice; attention runs on 1/N of the heads over the
  whole sequence) plus, per layer, the all-to-all outputs (whole-sequence q, k, v and attention output for those
  heads), on top of ZeRO-3's model state. The same --sp N adds a context-parallel row (torch ring attention under
  FSDP2, preset fsdp2_cp, recipe cp_size): 1/N of the activations plus the ring's key/value blocks of one layer
  (the block attended to and the next one arriving), for any head count. Without --sp, a full fine-tuning that
  needs gradient checkpointing or does not fit gets the smallest degree that fits as a hint (Ulysses where the
  heads divide, else the ring).
- pipeline parallelism (--pp N, with --tp T inside each stage): per process, its stages' weights, gradients and
  optimizer state (the shards transformers' tp plan gives the largest tp rank) and the activations its schedule keeps
  in flight, and the bubble (`pipeline_memory`). --nodes / --gpus_per_node search the 3D layouts (data x tensor x
  pipeline) of a cluster and recommend one with its preset and recipe fields (`search_layouts`, `format_layouts`;
  what they leave out: `NOT_MODELLED`). `models/llama-3-70b-shape` is a config-only Llama-3-70B (no weights).
- LoRA keeps the frozen base in bf16 and trains all-linear adapters of rank r; QLoRA stores the
  base's decoder linears in 4-bit NF4 with double quantization (0.5 + ~0.016 bytes per parameter) and, as
  peft's `prepare_model_for_kbit_training` leaves them, every other weight (embeddings, norms, head) in fp32.

Checked against measured peaks of real CPU runs (docs/memory-estimates.md): within +-25%.
A GPU also needs ~1 GiB for the CUDA context and communication buffers, and fragmentation takes a
part of the rest: a strategy "fits" when its peak stays under 90% of (gpu_memory - 1 GiB).
"""

from hftrain.estimate.activations import activation_bytes, backward_floor_bytes, layer_activation_bytes
from hftrain.estimate.budget import CUDA_OVERHEAD_GIB, USABLE_FRACTION, usable_bytes
from hftrain.estimate.cli import build_parser, format_plan, main, print_plan
from hftrain.estimate.layouts import (
    DEFAULT_GLOBAL_BATCH,
    NOT_MODELLED,
    Layout,
    format_layouts,
    layout_launch,
    layout_problems,
    search_layouts,
)
from hftrain.estimate.pipeline import (
    StageMemory,
    chunks_in_flight,
    format_pipeline,
    pipeline_bubble,
    pipeline_memory,
)
from hftrain.estimate.shape import ModelShape, model_shape, tp_elements, ulysses_splits
from hftrain.estimate.strategies import (
    NF4_BYTES,
    TOKENS_PER_PARAMETER,
    Plan,
    Row,
    estimate,
    recommend,
    sequence_parallel_hint,
    token_budget_line,
)
from hftrain.memory import GIB

__all__ = [
    "CUDA_OVERHEAD_GIB", "DEFAULT_GLOBAL_BATCH", "GIB", "NF4_BYTES", "NOT_MODELLED", "TOKENS_PER_PARAMETER",
    "USABLE_FRACTION", "Layout", "ModelShape", "Plan", "Row", "StageMemory", "activation_bytes",
    "backward_floor_bytes", "build_parser", "chunks_in_flight", "estimate", "format_layouts", "format_pipeline",
    "format_plan", "layer_activation_bytes", "layout_launch", "layout_problems", "main", "model_shape",
    "pipeline_bubble", "pipeline_memory", "print_plan", "recommend", "search_layouts", "sequence_parallel_hint",
    "token_budget_line", "tp_elements", "ulysses_splits", "usable_bytes",
]
