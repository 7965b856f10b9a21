"""Pipeline parallelism: the model's layers split into stages, run by `torch.distributed.pipelining`.

The rooms: `checks` (what a pipeline needs of the recipe, the launch and the model), `stage` (one stage: the model's
forward over the layers it owns, the schedule over the stages), `backend` (how a strategy holds the stages, copies or
FSDP2 shards, and `PipelineBackend`: mesh, wrap, step, clipping, records).

`--pp_size N` splits the transformers model by hand along its own pp plan (`base_model_pp_plan`: embed_tokens, the
layer list, norm; the causal LM's `_pp_plan`: lm_head), not with torch's tracer (it fails on HF models with rotary
embeddings, pytorch #184361):

- every process keeps the model's module tree; the modules another stage owns are replaced by parameterless
  placeholders (`Elsewhere`), so parameter names stay the HF names (checkpoints, the final save) and each layer keeps
  its index (`config.layer_types`, sliding windows);
- a stage runs the model's own base forward with the other stages' layers skipped and, except on the last stage, the
  final norm skipped (`StageForward`): positions, the causal masks and the rotary embeddings are recomputed on every
  stage from the hidden states' shape, and only the hidden states cross between stages;
- layers are balanced over the stages with the embedding and the head counted as one layer each (`split_layers`),
  and every layer lives on exactly one stage (asserted);
- the last stage computes the summed token loss on trained positions only (the head applied there), times the
  loop's step scale: `scale_grads=False`, so the step's loss is sum(token losses) / the step's trained tokens over
  every microbatch, accumulation step and data-parallel copy, exactly as without pp;
- rows are padded to `max_length` and the rows of a per-device batch to a multiple of the microbatches (torch sizes
  its receive buffers once), with target-less padding (causal attention: no real token sees it); packed rows'
  position_ids travel with the hidden states, so every stage keeps the documents apart;
- LoRA / QLoRA: the adapters are added before the split, so each stage trains its layers' own (a stage may train
  nothing); checkpoints hold trained weights only, and the final adapter is written from every stage's
  (`checkpoint_io.PipelineCheckpoints.save_pretrained`);
- gradients: averaged over the data-parallel copies, the tied embedding's gradient summed between the first and the
  last stage, the norm summed over the stages (each tied weight counted once) before clipping.

Process layout (one DeviceMesh ("pp", "dp", "tp"), pp outermost, tp innermost): rank = (stage_rank * copies + copy)
* tp_size + tp_rank. With 4 processes and pp_size=2: ranks {0, 2} and {1, 3} are two pipelines; {0, 1} hold the
first stage, {2, 3} the last. With tp_size=2 as well (pp x tp, 4 processes): {0, 1} hold the first stage's layers
split in two by transformers' tensor-parallel plan, {2, 3} the last stage's; ranks 0 -> 2 and 1 -> 3 exchange the
(replicated) hidden states. 8 processes with pp_size=2, tp_size=2: two such pipelines, one per data-parallel copy
("3D": data x tensor x pipeline).

pp x FSDP2 (an FSDP2 preset, `ShardedStages`): the same mesh with tp_size 1, each stage sharded by torch's
`fully_shard` over its "dp" ranks instead of held whole by each copy (torchtitan's pp x fsdp; see the class).

Loading: with full fine-tuning each rank reads only its stages' decoder layers from the checkpoint, plus the
embeddings, the final norm and the head (`layers_to_load` -> `model.load_decoder_layers`: the other layers stay on the
meta device, with their names and shapes, until `prepare` drops them), so a machine's processes hold the model about
once in host memory, not once each. With adapters every rank reads the whole model: peft draws each adapter's
initialisation from the global generator in module order, and one process's draws are kept only over the whole model.

pp x tp: the tensor-parallel transform (`tensor.TensorParallel`) over this backend: every rank loads the model with
transformers' tp plan over its tp group (`PipelineBackend.distributed_config`: each rank reads 1/tp of every layer it
reads), then keeps only its stage's layers, so the plan applies per stage to the
layers the stage owns; the stage's forward runs transformers' sharded layers (their collectives inside the tp group).
"""


from hftrain.parallel.pipeline.backend import PipelineBackend, ShardedStages, StageCopies
from hftrain.parallel.pipeline.checks import (
    PIPELINE_MODEL_TYPES,
    fsdp2_stage_problems,
    microbatches,
    pipeline_problems,
    resume_problems,
)
from hftrain.parallel.pipeline.stage import (
    Elsewhere,
    PipelineStages,
    StageForward,
    causal_lm,
    forward_only_order,
    keep_only,
    local,
    sharded,
    sum_whole,
)

__all__ = ["PIPELINE_MODEL_TYPES", "Elsewhere", "PipelineBackend", "PipelineStages", "ShardedStages", "StageCopies",
           "StageForward", "causal_lm", "forward_only_order", "fsdp2_stage_problems", "keep_only", "local",
           "microbatches", "pipeline_problems", "resume_problems", "sharded", "sum_whole"]
