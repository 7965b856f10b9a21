"""What a pipeline needs of the recipe, the launch and the model (the preflight's pipeline rules), and how many
microbatches a pipeline step runs."""

from __future__ import annotations

import json
from pathlib import Path

from hftrain.checkpoint import newest_intact
from hftrain.config import Recipe
from hftrain.fields.parallel import V_SCHEDULES
from hftrain.model import HEAD_ONLY_MODEL_TYPES, router_coefficient
from hftrain.parallel.launch import Launch
from hftrain.paths import STATE_FILE
from hftrain.stages import (
    STAGES_PER_PROCESS,
    resume_layout_problem,
)

# Causal LMs whose base forward does nothing outside the planned modules besides positions, masks and rotary
# embeddings (read in transformers 5.23), and whose logits are lm_head(hidden states). Granite, for one, multiplies
# the embeddings by `embedding_multiplier` inside forward(): every stage would repeat it.
PIPELINE_MODEL_TYPES = HEAD_ONLY_MODEL_TYPES


def microbatches(recipe: Recipe) -> int:
    """Microbatches per pipeline step: the recipe's, or 2 x the pipeline's stages."""
    stages = recipe.pp_size * STAGES_PER_PROCESS.get(recipe.pp_schedule, 1)
    return recipe.pp_microbatches if recipe.pp_microbatches is not None else 2 * stages


def resume_problems(recipe: Recipe, launch: Launch) -> list[str]:
    """A resume_from_checkpoint folder whose layout this run cannot read (`resume_layout_problem`: pp checkpoints
    under FSDP2 / DeepSpeed, FSDP2 / ZeRO / tensor-parallel ones under pp), before the weights load. `latest` is
    the checkpoint resolve_resume will take (the newest intact one in output_dir)."""
    path = recipe.resume_from_checkpoint
    label = f"resume_from_checkpoint {path!r}"
    if path == "latest" and (newest := newest_intact(Path(recipe.output_dir))) is not None:
        label, state = f"resume_from_checkpoint latest ({newest})", newest / STATE_FILE
    else:
        state = Path(path) / STATE_FILE if path not in (None, "latest") else None
    if state is None or not state.is_file():
        return []  # no checkpoint, or one that resolve_resume reports as incomplete
    try:
        saved = json.loads(state.read_text(encoding="utf-8"))["launch"]
    except (ValueError, KeyError):
        return []  # a damaged record: resolve_resume's check names it
    sharded_by = {"fsdp2": "FSDP2", "deepspeed": "DeepSpeed"}.get(launch.kind)
    problem = resume_layout_problem(saved, recipe.pp_size, sharded_by)
    return [f"{label}: {problem}"] if problem else []


def pipeline_problems(recipe: Recipe, launch: Launch, model_config) -> list[str]:
    """pp_size: what the launch and the model's config must allow, before the weights load (and a checkpoint to
    resume whose layout a pipeline cannot read, or a pipeline checkpoint that this launch cannot)."""
    problems = resume_problems(recipe, launch)
    pp = recipe.pp_size
    if pp <= 1:
        return problems
    if launch.kind == "deepspeed":
        problems.append(f"pp_size={pp} with a deepspeed preset: hftrain's pipeline runs with data-parallel copies of "
                        "the pipeline on a DDP-type preset (cpu_pp on CPU, pp on GPUs) or with each stage sharded by "
                        "FSDP2 (an fsdp2 preset); ZeRO per stage is not built (docs/pipeline.md)")
    elif launch.kind == "fsdp2":
        problems += fsdp2_stage_problems(recipe, launch)
    elif launch.world % (pp * recipe.tp_size):
        size = f"pp_size={pp}" + (f" x tp_size={recipe.tp_size}" if recipe.tp_size > 1 else "")
        problems.append(f"{size} does not divide the {launch.world} processes of this launch; use {size} processes "
                        "(cpu_pp / pp preset) or a multiple of it for data-parallel copies of the pipeline")
    if model_config is None:
        return problems
    kind = model_config.model_type
    plan = getattr(model_config, "base_model_pp_plan", None)
    if not plan:
        problems.append(f"pp_size={pp}: the model ({kind!r}) has no pipeline plan (base_model_pp_plan in its "
                        "transformers config), so hftrain does not know how its forward splits into stages")
    elif kind not in PIPELINE_MODEL_TYPES or list(plan) != ["embed_tokens", "layers", "norm"]:
        problems.append(f"pp_size={pp}: the model ({kind!r}) is not one whose forward hftrain has checked for work "
                        "outside its pipeline plan (each stage would repeat it, e.g. Granite's embedding_multiplier) "
                        f"and whose logits are lm_head(hidden states): {', '.join(sorted(PIPELINE_MODEL_TYPES))}")
    else:
        stages = pp * STAGES_PER_PROCESS[recipe.pp_schedule]
        layers = model_config.get_text_config().num_hidden_layers
        if layers < stages:
            problems.append(f"pp_size={pp} with pp_schedule={recipe.pp_schedule} needs {stages} stages of at least "
                            f"one layer each, and the model has {layers} layers; use a smaller pp_size or 1F1B")
    if router_coefficient(model_config, recipe.router_aux_loss_coef):
        problems.append(f"pp_size={pp} with a mixture-of-experts router loss: each stage holds only its layers' "
                        "routers and the loss would need them all on the last stage; set router_aux_loss_coef: 0")
    return problems


def fsdp2_stage_problems(recipe: Recipe, launch: Launch) -> list[str]:
    """pp_size under an FSDP2 preset (`ShardedStages`): each stage sharded by FSDP2 over its data-parallel
    ranks. What that layout does not run."""
    pp, world, problems = recipe.pp_size, launch.world, []
    layout = f"pp_size={pp} with an fsdp2 preset (each stage sharded by FSDP2 over its data-parallel ranks)"
    if recipe.tp_size > 1:
        problems.append(f"{layout} and tp_size={recipe.tp_size}: tensor parallelism inside FSDP2-sharded stages is "
                        "not built; use the cpu_pp / pp preset for pp x tp (data-parallel copies of the pipeline)")
    elif world % pp or world < 2 * pp:
        problems.append(f"{layout} needs a multiple of pp_size processes, at least {2 * pp} (2 data-parallel ranks "
                        f"per stage); this launch is {world}. For a pipeline without copies use the cpu_pp / pp preset")
    if launch.fsdp_offload:
        problems.append(f"{layout} and fsdp_offload_params: true: CPU offload of sharded stages is not built (the "
                        "pipeline's receive buffers, loss and clipping stay on the device); set it to false in the "
                        "preset, or use FSDP2 without pp_size")
    if recipe.pp_schedule in V_SCHEDULES:
        problems.append(f"{layout} and pp_schedule={recipe.pp_schedule}: its V puts the first and the last stage on "
                        "one process, so a tied embedding and head would be one parameter in two FSDP2 roots, and "
                        "torch's split weight backward is not tested under FSDP2 here; use 1F1B, GPipe or "
                        "Interleaved1F1B")
    if recipe.load_in_4bit or recipe.load_in_8bit:
        problems.append(f"{layout} and QLoRA (load_in_4bit / load_in_8bit): bitsandbytes' quantized weights under "
                        "torch's fully_shard in hftrain's stages are not built (accelerate's FSDP2 preparation, which "
                        "handles their storage, wraps one whole model); use the cpu_pp / pp preset")
    return problems
