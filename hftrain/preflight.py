"""Every check that needs the machine, the launch or the model's config, reported together before heavy work.

`config.validate` judges the recipe alone (run when the recipe is loaded, also by `python -m hftrain.data`). The
preflight runs at the start of training, once the launch is known (`parallel.Launch`), and adds what depends on it:

- machine:  CUDA-only options on a CPU machine, missing optional packages, a C++ compiler for torch_compile;
- launch:   the preset's precision, its DeepSpeed JSON against the recipe, quantization or tensor parallelism
            under strategies that cannot run them;
- model:    the model's config (read without weights): it exists, max_length fits, the architecture suits
            loss_chunk_tokens;
- Liger:    every use_liger_kernel rule in one place;
- varlen:   what attn_implementation=varlen (torch's variable-length FlashAttention for packed rows) needs, asked for
            an explicit request and for the automatic choice (`varlen_obstacles`, `attention_choice`);
- vLLM:     use_vllm's CUDA, vllm package and strategy rules (`vllm_problems`);
- hub:      push_to_hub's token and online mode (`hftrain.hub.preflight_problems`).

All problems come out as one ConfigError, in one paragraph, before the accelerator, the data or the weights load.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from dataclasses import dataclass

import psutil
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
)

from hftrain import attention, compat, fp8, hub, qat, vision
from hftrain.attention import MAX_HEAD_DIM, VARLEN, VARLEN_MODEL_TYPES
from hftrain.compat import accelerate as compat_accelerate
from hftrain.compat import cpython as compat_cpython
from hftrain.compat import datasets as compat_datasets
from hftrain.compat import liger as compat_liger
from hftrain.compat import torch as compat_torch
from hftrain.compat import torchao as compat_torchao
from hftrain.compat import transformers as compat_transformers
from hftrain.config import Recipe
from hftrain.errors import ConfigError
from hftrain.estimate import ulysses_splits
from hftrain.fields.grpo import VLLM_REQUIREMENT
from hftrain.fields.parallel import V_SCHEDULES
from hftrain.model import DTYPES, HEAD_ONLY_MODEL_TYPES, LIGER_MODEL_TYPES, load_error, router_coefficient
from hftrain.optim import BNB_ADAMW, muon_launch_problems
from hftrain.parallel.deepspeed import deepspeed_problems
from hftrain.parallel.expert import expert_problems
from hftrain.parallel.launch import Launch, strategy_problems
from hftrain.parallel.pipeline import PIPELINE_MODEL_TYPES, pipeline_problems
from hftrain.parallel.tensor import fsdp_tp_blocks_disagree
from hftrain.stages import STAGES_PER_PROCESS, stage_layout
from hftrain.versions import feature_problem

TP_WITH_DEEPSPEED_REFUSED = (
    "tensor parallelism combined with DeepSpeed is not available in hftrain: accelerate 1.15 composes TP with "
    "DeepSpeed only through ParallelismConfig, whose TP preparation (Accelerator._prepare_tp) imports transformers' "
    "ReplicateParallel, which transformers 5.23 no longer has, and transformers' own DistributedConfig, which "
    "hftrain loads tensor-parallel models with, composes TP with FSDP2, not with ZeRO. Use an FSDP2 preset (fsdp2, "
    "with --num_processes a multiple of tp_size: FSDP2 x TP) or a DDP-type one (tp, cpu_ddp, multi_gpu: "
    "data-parallel copies)"
)


RECIPE_FOR_LAUNCH = "recipe for this machine and launch"  # what the preflight's problems are problems of


def preflight(recipe: Recipe, launch: Launch, cuda: bool) -> PretrainedConfig | None:
    """Raise one ConfigError with every problem found; return the model's config. A model that cannot be loaded
    (a wrong id, a hub out of reach, a folder without a config) is the model's or the hub's problem, not the
    recipe's: it is reported first, as itself, before the recipe's problems for this machine and launch."""
    model_config, problems = model_problems(recipe)
    unloadable, problems = (problems, []) if model_config is None else ([], problems)
    problems = machine_problems(recipe, cuda) + launch_problems(recipe, launch) + problems
    problems += gpu_count_problems(launch, torch.cuda.device_count() if cuda else 0)
    problems += liger_problems(recipe, cuda, launch, model_config)
    if recipe.attn_implementation == VARLEN:
        problems += [obstacle.problem for obstacle in varlen_obstacles(recipe, launch, cuda, model_config)]
    problems += sequence_parallel_problems(recipe, launch, model_config)
    problems += context_parallel_problems(recipe, launch, model_config)
    problems += fsdp2_tp_shard_problems(recipe, launch, model_config)
    problems += pipeline_problems(recipe, launch, model_config)
    problems += expert_problems(recipe, launch, model_config)
    problems += host_memory_problems(recipe, launch, model_config)
    problems += vllm_problems(recipe, launch, cuda)
    problems += evaluation_problems(recipe, launch, model_config)
    problems += qat.preflight_problems(recipe, launch.kind, model_config)
    problems += fp8.preflight_problems(recipe, cuda, fp8.device_capability(recipe, cuda), launch.kind)
    problems += hub.preflight_problems(recipe)
    # the installed libraries' problems are not the recipe's either: each names the install that fixes it
    unusable = unloadable + library_problems(recipe, launch)
    if problems or unusable:
        raise ConfigError(groups=[(None, unusable), (RECIPE_FOR_LAUNCH, problems)])
    return model_config


def before_launch(recipe: Recipe, preset: dict, deepspeed_config_path: str | None = None,
                  num_processes: int | None = None, num_machines: int | None = None) -> None:
    """`hftrain launch`, before it starts any process (the recipe as every process will read it, already loaded):
    what accelerate would select instead of the preset's strategy on this machine, and the whole preflight against the
    launch the preset describes. A refusal is then printed once, in seconds, instead of once per process after the
    launcher has started them all."""
    launch = Launch.from_preset(preset, deepspeed_config_path, num_processes, num_machines)
    cuda = torch.cuda.is_available()
    problems = strategy_problems(launch, cuda, gpus=torch.cuda.device_count() if cuda else 0)
    groups = []
    try:
        preflight(recipe, launch, cuda)
    except ConfigError as error:
        groups = error.groups
    if problems or groups:
        raise ConfigError(problems, RECIPE_FOR_LAUNCH, groups=groups)


def library_uses(recipe: Recipe, launch: Launch) -> list[compat.Use]:
    """The uses of libraries' internals (hftrain.compat) this run will make, so that a library outside the versions
    they were checked on is refused here, with every other problem, rather than when the feature first runs."""
    uses = [compat_transformers.WEIGHT_CONVERSIONS, compat_transformers.ATTN_IMPLEMENTATION]
    uses.append(compat_datasets.EXAMPLES_ITERABLE if recipe.streaming else compat_datasets.FINGERPRINT)
    if launch.world > 1:
        uses.append(compat_cpython.EXIT)
    if launch.kind == "fsdp2":
        uses += [compat_accelerate.FSDP2_STATE_DICT, compat_transformers.NO_SPLIT_MODULES]
    if (recipe.tp_size > 1 and launch.kind == "fsdp2") or recipe.ep_size > 1:  # transformers' FSDP2 mesh
        uses += [compat_transformers.DEVICE_MESH, compat_torch.LOCAL_BLOCKS]
    if recipe.cp_size > 1:
        # accelerate's attention-mask hooks, attached by hftrain: tp x cp's model, grpo's frozen reference
        hooks = recipe.tp_size > 1 or (recipe.objective == "grpo" and recipe.beta > 0)
        uses += [compat_torch.RING_ATTENTION] + ([compat_accelerate.CP_HOOKS] if hooks else [])
    if recipe.pp_size > 1:
        uses.append(compat_torch.PERSISTENT_BUFFERS)
        uses += [] if recipe.use_peft else [compat_transformers.STAGE_LOAD]
        uses += [compat_torch.V_SCHEDULE_EVAL] if recipe.pp_schedule in V_SCHEDULES else []
    if recipe.fp8 and compat.installed_version("torchao") is not None:  # else missing_extra_problems
        uses.append(compat_torchao.FLOAT8_FILTER)
    if recipe.use_liger_kernel and compat.installed_version("liger-kernel") is not None:  # else liger_problems
        uses.append(compat_liger.INSTANCE_KERNELS)
    return uses


def library_problems(recipe: Recipe, launch: Launch) -> list[str]:
    """A library outside the versions one of this run's uses of its internals was checked on, one problem each."""
    return [problem for use in dict.fromkeys(library_uses(recipe, launch)) if (problem := use.problem())]


def vllm_problems(recipe: Recipe, launch: Launch, cuda: bool) -> list[str]:
    """use_vllm (grpo's colocated vLLM generation, hftrain.rl.vllm_generation): what the machine and the launch must
    give it. Its recipe-only rules are hftrain.fields.grpo's."""
    if not recipe.use_vllm:
        return []
    problems = []
    if not cuda:
        problems.append("use_vllm: true needs a CUDA GPU (vLLM's engine runs on the GPU of each training process) and "
                        "this machine has none; set use_vllm: false to sample with transformers' generate")
    if importlib.util.find_spec("vllm") is None:
        problems.append(f"use_vllm: true needs the vllm package, which is not installed: pip install 'hftrain[vllm]' "
                        f"on a CUDA machine ({VLLM_REQUIREMENT}, TRL 1.16's newest supported vLLM; it requires "
                        "transformers < 5.18, so pip installs transformers 5.17.x beside it, the lower end hftrain is "
                        "tested on), or set use_vllm: false")
    if launch.kind == "fsdp2" or (launch.kind == "deepspeed" and launch.zero_stage == 3):
        strategy = "FSDP2" if launch.kind == "fsdp2" else "DeepSpeed ZeRO-3"
        problems.append(f"use_vllm with {strategy} is refused: each push of the trained weights into vLLM would "
                        "have to gather them from the shards (TRL gathers them parameter by parameter, and a LoRA's "
                        "whole model at once), which hftrain has not written; use a DDP or ZeRO-1/2 preset, or "
                        "use_vllm: false (transformers' generate works under every strategy)")
    return problems


def evaluation_problems(recipe: Recipe, launch: Launch, model_config: PretrainedConfig | None) -> list[str]:
    """eval_tasks and log_completions against the launch: lm-eval installed; eval_tasks evaluates the main process's
    whole model (`eval_tasks.TaskEvaluation` checks the resolved layout again), log_completions generates with
    transformers' generate, which pipeline stages and sequence shards cannot run."""
    r, problems = recipe, []
    if r.eval_tasks and importlib.util.find_spec("lm_eval") is None:
        problems.append("eval_tasks needs lm-evaluation-harness, which is not installed: pip install 'hftrain[eval]'")
    split = ("FSDP2 shards the weights" if launch.kind == "fsdp2" else
             "DeepSpeed ZeRO-3 shards the weights" if launch.kind == "deepspeed" and launch.zero_stage == 3 else
             next((f"{name}={getattr(r, name)} splits the {what}" for name, what in (
                 ("tp_size", "model"), ("pp_size", "model"), ("ep_size", "experts"), ("sp_size", "sequences"),
                 ("cp_size", "sequences"))
                 if getattr(r, name) > 1), None))
    if r.eval_tasks and split:
        problems.append(f"eval_tasks runs lm-eval on the main process's whole model while the other processes wait, "
                        f"but {split}, so no process holds it whole. Remove eval_tasks and run `hftrain eval "
                        "output_dir/final --tasks ...` after training, or train with one process, DDP or DeepSpeed "
                        "ZeRO-1/2")
    if r.eval_tasks and vision.is_image_text(model_config):
        problems.append("eval_tasks runs lm-eval's text model on the causal LM, but this is an image-text model; "
                        "remove eval_tasks")
    # grpo's log_completions is its rollouts' table (no generation of its own): it runs wherever grpo runs
    if r.log_completions and r.objective != "grpo" and max(r.pp_size, r.sp_size, r.cp_size) > 1:
        problems.append("log_completions generates with transformers' generate, which cannot run the model split "
                        "into pipeline stages or sequence shards (pp_size, sp_size, cp_size); remove log_completions "
                        "and try the final folder with `hftrain chat`")
    return problems


def gpu_count_problems(launch: Launch, gpus: int) -> list[str]:
    """On a GPU machine every process of a node needs a GPU of its own (`gpus`: those this process sees)."""
    if gpus == 0 or launch.per_node <= gpus:
        return []
    return [f"the launch starts {launch.per_node} processes per machine but this machine shows {gpus} GPU(s) "
            "(CUDA_VISIBLE_DEVICES / the preset's gpu_ids): processes would share a GPU; pass --num_processes "
            f"{gpus} (per machine) or make more GPUs visible"]


def machine_problems(recipe: Recipe, cuda: bool) -> list[str]:
    """Problems that depend on the machine rather than on the recipe alone (Liger's: `liger_problems`)."""
    problems = []
    if recipe.fp16 and not cuda:
        problems.append("fp16 needs a CUDA GPU (on CPU accelerate would silently train in fp32); "
                        "use bf16: true or neither")
    compiler = os.environ.get("CXX", "g++")  # what torch inductor runs to build its CPU kernels on Linux
    if recipe.torch_compile and not cuda and shutil.which(compiler) is None:
        problems.append(f"torch_compile on CPU needs a C++ compiler (inductor builds its kernels with {compiler}, "
                        "the CXX environment variable or g++) and none is on PATH; install g++, point CXX at a "
                        "compiler, or set torch_compile: false")
    if recipe.attn_implementation == "flash_attention_2":
        if not cuda:
            problems.append("attn_implementation=flash_attention_2 needs a CUDA GPU; use sdpa")
        if importlib.util.find_spec("flash_attn") is None:
            problems.append("attn_implementation=flash_attention_2 needs the flash-attn package, which is not "
                            "installed; pip install flash-attn --no-build-isolation (it compiles against the installed "
                            "torch and CUDA), or use sdpa")
    if "mlflow" in recipe.report_to and importlib.util.find_spec("mlflow") is None:
        problems.append("report_to includes mlflow but the mlflow package is not installed; pip install mlflow "
                        "(or mlflow-skinny), or drop mlflow from report_to")
    if recipe.use_peft and recipe.use_dora and recipe.load_in_8bit and not cuda:
        problems.append("use_dora with load_in_8bit fails on CPU (bitsandbytes 0.50.2 loses the 8-bit scale state "
                        "at the second forward); use load_in_4bit for a quantized DoRA, or plain LoRA in 8 bits")
    return problems


def launch_problems(recipe: Recipe, launch: Launch) -> list[str]:
    """Settings the launch preset and the recipe both make differently, and what the strategy cannot run."""
    problems = []
    recipe_precision = "bf16" if recipe.bf16 else "fp16" if recipe.fp16 else "no"
    if launch.mixed_precision not in ("no", recipe_precision):
        problems.append(f"the accelerate preset sets mixed_precision={launch.mixed_precision} but the recipe has "
                        f"bf16={recipe.bf16}, fp16={recipe.fp16}; precision comes from the recipe: set it there "
                        "and use mixed_precision: 'no' in the preset")
    problems += quantization_problems(recipe, launch)
    problems += missing_extra_problems(recipe, launch)
    problems += muon_launch_problems(recipe, launch.kind, launch.zero_stage)
    if launch.kind == "deepspeed":
        if launch.deepspeed_config is None:
            problems.append("the DeepSpeed preset names no deepspeed_config_file; hftrain's presets point at "
                            "ds_configs/*.json so that every DeepSpeed setting is visible in one file")
        else:
            problems += deepspeed_problems(recipe, launch.deepspeed_config, launch.world)
    return problems + tensor_parallel_problems(recipe, launch)


# the optional packages a run may need: (package, hftrain's extra that installs it)
EXTRAS = {"deepspeed": "deepspeed", "bitsandbytes": "quantization", "wandb": "wandb", "torchao": "qat"}


def missing_extra_problems(recipe: Recipe, launch: Launch) -> list[str]:
    """What this run needs from the packages that are extras of hftrain's (pyproject.toml), when they are missing."""
    needs = [("deepspeed", "the DeepSpeed preset") if launch.kind == "deepspeed" else None,
             ("deepspeed", f"sp_size={recipe.sp_size} (DeepSpeed's Ulysses attention)") if recipe.sp_size > 1 else None,
             ("bitsandbytes", "load_in_4bit" if recipe.load_in_4bit else "load_in_8bit")
             if recipe.load_in_4bit or recipe.load_in_8bit else None,
             ("bitsandbytes", f"optim={recipe.optim}") if recipe.optim in BNB_ADAMW else None,
             ("torchao", f"qat_scheme={recipe.qat_scheme}") if recipe.qat_scheme is not None else None,
             ("torchao", "fp8") if recipe.fp8 else None,
             ("wandb", "report_to: wandb") if "wandb" in recipe.report_to else None]
    return [f"{what} needs the {package} package, which is not installed: pip install 'hftrain[{EXTRAS[package]}]'"
            f" (or pip install {package})" for package, what in filter(None, needs)
            if importlib.util.find_spec(package) is None]


def quantization_problems(recipe: Recipe, launch: Launch) -> list[str]:
    """Quantized (QLoRA) recipes that the launch strategy cannot run."""
    r = recipe
    if not (r.load_in_4bit or r.load_in_8bit):
        return []
    bits = "load_in_4bit" if r.load_in_4bit else "load_in_8bit"
    problems = []
    if launch.kind == "deepspeed" and launch.zero_stage == 3:
        problems.append(f"{bits} with DeepSpeed ZeRO-3 is refused: partitioning bitsandbytes weights is not verified "
                        "with this stack (a trial with 4-bit weights stored in dtype trained correctly, but a rank "
                        "aborted at exit in one of six runs; docs/peft.md); use DeepSpeed ZeRO-2, FSDP2 with "
                        "load_in_4bit and bnb_4bit_quant_storage equal to dtype, or DDP")
    if launch.kind == "fsdp2" and r.load_in_8bit:
        problems.append("load_in_8bit with FSDP is refused: accelerate's FSDP2 preparation fails on bitsandbytes 8-bit "
                        "weights (Int8Params cannot be moved to the meta device for sharding); use load_in_4bit with "
                        "bnb_4bit_quant_storage equal to dtype")
    if launch.kind == "fsdp2" and r.load_in_4bit and r.bnb_4bit_quant_storage != r.dtype:
        problems.append(f"load_in_4bit with FSDP needs bnb_4bit_quant_storage equal to dtype so that packed 4-bit "
                        f"weights shard like the other parameters (accelerate leaves uint8 ones unsharded: every rank "
                        f"would hold the whole base); got bnb_4bit_quant_storage="
                        f"{r.bnb_4bit_quant_storage} and dtype={r.dtype}: set bnb_4bit_quant_storage: {r.dtype}")
    return problems


def tensor_parallel_problems(recipe: Recipe, launch: Launch) -> list[str]:
    """Tensor-parallel layouts hftrain does not run."""
    tp, world = recipe.tp_size, launch.world
    if tp <= 1:
        return []
    if (too_old := feature_problem("tensor_parallel")) is not None:
        return [f"tp_size={tp}: {too_old}"]
    if launch.kind == "deepspeed":
        return [f"tp_size={tp} with a DEEPSPEED preset: {TP_WITH_DEEPSPEED_REFUSED}"]
    if launch.kind == "fsdp2":
        return fsdp2_tensor_parallel_problems(recipe, launch)
    if launch.kind == "single":
        return [f"tp_size={tp} needs tp_size (or a multiple of it) processes on a DDP-type preset (e.g. tp, or "
                f"cpu_ddp with --num_processes {tp}); this launch is 1 process"]
    if world % tp:
        return [f"tp_size={tp} does not divide the {world} processes of this launch; use a multiple of tp_size "
                "processes (each group of tp_size consecutive ranks shards one copy of the model)"]
    return []


def fsdp2_tensor_parallel_problems(recipe: Recipe, launch: Launch) -> list[str]:
    """FSDP2 x tensor parallel (parallel/tensor.py's TensorParallel over FSDP2Backend): transformers' 2D mesh of
    fsdp_size = processes / tp_size data-parallel shards of tp_size-way split weights."""
    tp, world, problems = recipe.tp_size, launch.world, []
    if world % tp or world < 2 * tp:
        problems.append(f"tp_size={tp} with an FSDP2 preset shards each tensor-parallel shard over processes / "
                        f"tp_size data-parallel ranks (FSDP2 x TP), so it needs a multiple of tp_size processes, at "
                        f"least {2 * tp}; this launch is {world}. Pass --num_processes {2 * tp} (or another "
                        f"multiple), or use the tp preset for tensor parallelism alone")
    elif recipe.cp_size > 1 and world % (tp * recipe.cp_size):
        problems.append(f"tp_size={tp} with cp_size={recipe.cp_size} under FSDP2 needs a multiple of tp_size x cp_size "
                        f"= {tp * recipe.cp_size} processes (each data-parallel rank's batches are shared by cp x tp "
                        f"consecutive ranks); this launch is {world}")
    if recipe.fp16:
        problems.append(f"fp16 with tp_size={tp} under FSDP2: transformers' FSDP2 x TP mixed precision is bf16 only "
                        "(DistributedConfig.fsdp_mixed_precision); use bf16: true")
    if recipe.objective != "sft":
        problems.append(f"objective {recipe.objective} with tp_size={tp} under FSDP2 is refused: FSDP2 x TP is "
                        "verified for the token loss (objective sft) only; a reference model or a second forward "
                        "through transformers' FSDP2 units is not. Use the tp or cpu_ddp preset (data-parallel "
                        "copies) for dpo, simpo or grpo with tensor parallelism")
    return problems


def fsdp2_tp_shard_problems(recipe: Recipe, launch: Launch, model_config: PretrainedConfig | None) -> list[str]:
    """FSDP2 x TP: the model dimensions that tp_size and fsdp_size both split (the vocabulary, the column-wise
    projections' rows) must be cut alike by transformers' loader and by FSDP2 (`fsdp_tp_blocks_disagree`), or
    transformers raises from inside from_pretrained on some ranks."""
    tp = recipe.tp_size
    if tp <= 1 or launch.kind != "fsdp2" or recipe.pp_size > 1 or model_config is None or launch.world % tp:
        return []
    fsdp, text = launch.world // tp, model_config.get_text_config()
    heads = getattr(text, "num_attention_heads", None)
    head_dim = getattr(text, "head_dim", None) or (text.hidden_size // heads if heads else None)
    sizes = {"vocab_size": getattr(text, "vocab_size", None),
             "num_attention_heads x head_dim": heads * head_dim if heads and head_dim else None,
             "num_key_value_heads x head_dim": (getattr(text, "num_key_value_heads", None) or heads or 0) *
             (head_dim or 0) or None,
             "intermediate_size": getattr(text, "intermediate_size", None)}
    uneven = [f"{name} {size}" for name, size in sizes.items()
              if isinstance(size, int) and fsdp_tp_blocks_disagree(size, fsdp, tp)]
    if not uneven:
        return []
    return [f"tp_size={tp} x fsdp_size={fsdp} (FSDP2 x TP over {launch.world} processes) cannot load this model: "
            f"{', '.join(uneven)} split over {tp} x {fsdp} ranks would be cut into blocks of one length by "
            "transformers' loader and of another by FSDP2, and transformers refuses the load on some ranks. Use a "
            f"process count whose fsdp_size cuts it alike (a tp_size x fsdp_size that divides it always does), or pad "
            "the vocabulary to a multiple of it"]


def host_memory_problems(recipe: Recipe, launch: Launch, model_config: PretrainedConfig | None,
                         available: int | None = None) -> list[str]:
    """pp_size: what the processes of one machine hold in host memory at once while they load. Full fine-tuning
    reads each rank's stages' decoder layers, the embeddings, the final norm and the head (`model.load_decoder_layers`;
    the largest rank's share is counted); with adapters every rank reads the whole model (peft's initialisation draws
    over it); 1/tp of either under pp x tp (transformers reads only its shards). Refused when per_node x that exceeds
    the machine's available memory (`available`, bytes: psutil's), which would otherwise end in the kernel's OOM
    killer during the load. Quantized loads are not estimated."""
    pp = recipe.pp_size
    if pp <= 1 or model_config is None or recipe.load_in_4bit or recipe.load_in_8bit or \
            model_config.model_type not in PIPELINE_MODEL_TYPES:  # other models: pipeline_problems refuses them
        return []
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(model_config)
    params = sum(p.numel() for p in lm.parameters())
    layers = [sum(p.numel() for p in layer.parameters()) for layer in lm.get_decoder().layers]
    if recipe.use_peft:
        read, what = params, "the whole model (adapters are added over it)"
    else:
        if len(layers) < pp * STAGES_PER_PROCESS[recipe.pp_schedule]:  # fewer layers than stages: pipeline_problems
            return []
        stages = [stage_layout(len(layers), pp, recipe.pp_schedule, rank) for rank in range(pp)]
        read = params - sum(layers) + max(sum(layers[i] for s in mine for i in ranges[s]) for ranges, mine in stages)
        what = "its stages' layers, the embeddings and the head"
    tp, gib = recipe.tp_size, 2**30
    per_process_bytes = read * DTYPES[recipe.dtype].itemsize // tp
    need = per_process_bytes * launch.per_node
    available = psutil.virtual_memory().available if available is None else available
    if need <= available:
        return []
    share = f", 1/{tp} of them under tp_size={tp}" if tp > 1 else ""
    return [f"pp_size={pp}: each process reads {what} into host memory while it loads ({read / 1e9:.2f}B of the "
            f"model's {params / 1e9:.2f}B parameters in {recipe.dtype}{share}: {per_process_bytes / gib:.1f} GiB), so "
            f"the {launch.per_node} processes of this machine need {need / gib:.1f} GiB at once and "
            f"{available / gib:.1f} GiB is available. Use tp_size inside the machine (each process then reads 1/tp "
            "of the weights), a larger pp_size, dtype: bfloat16, or fewer processes per machine"]


def model_problems(recipe: Recipe) -> tuple[PretrainedConfig | None, list[str]]:
    """Load only the model's config (no weights): a missing model or a too-long max_length fails in seconds, a hub
    that cannot be reached in one (`hub.unreachable_problem`, instead of huggingface_hub's retries)."""
    if (unreachable := hub.unreachable_problem("model", recipe.model_name_or_path, recipe.model_revision)):
        return None, [unreachable]
    try:
        config = AutoConfig.from_pretrained(recipe.model_name_or_path, revision=recipe.model_revision,
                                            trust_remote_code=recipe.trust_remote_code)
    except (OSError, ValueError) as exc:
        return None, [load_error("model", recipe.model_name_or_path, exc)]
    problems = []
    limit = getattr(config.get_text_config(), "max_position_embeddings", None)
    if limit is not None and recipe.max_length > limit:
        problems.append(f"max_length={recipe.max_length} is above the model's max_position_embeddings={limit}; "
                        "lower max_length")
    if recipe.loss_chunk_tokens and config.model_type not in HEAD_ONLY_MODEL_TYPES:
        problems.append(f"loss_chunk_tokens={recipe.loss_chunk_tokens} needs logits that are exactly lm_head(hidden "
                        f"states); hftrain knows that of {', '.join(sorted(HEAD_ONLY_MODEL_TYPES))}, and this model "
                        f"is {config.model_type!r} (it may scale or cap its logits): set loss_chunk_tokens: 0")
    if recipe.router_aux_loss_scope == "step" and not router_coefficient(config, recipe.router_aux_loss_coef):
        problems.append(f"router_aux_loss_scope=step makes a mixture-of-experts router loss exact over a step, but "
                        f"{config.model_type!r} has none (a dense model, or coefficient 0); remove "
                        "router_aux_loss_scope")
    problems += saved_quantization_problems(recipe, config)
    problems += vision.problems(recipe, config)
    problems += reward_model_problems(recipe, config)
    problems += yes_no_reranker_problems(recipe, config)
    return config, problems


def yes_no_reranker_problems(recipe: Recipe, config: PretrainedConfig) -> list[str]:
    """reranker_head yes_no reads the base's own next-token logits: it must load as AutoModelForCausalLM."""
    if recipe.objective != "reranker" or recipe.reranker_head != "yes_no":
        return []
    remote = "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {})
    if config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or (remote and recipe.trust_remote_code):
        return []
    return [f"reranker_head yes_no reads the 'yes' and 'no' next-token logits of {recipe.model_name_or_path!r} "
            f"loaded as AutoModelForCausalLM, but transformers has no causal-LM class for model type "
            f"{config.model_type!r}{' (its remote code has one: set trust_remote_code: true)' if remote else ''}; "
            "start from a causal LM (Qwen3, Qwen2.5, Llama 3...) or use reranker_head: classifier"]


def reward_model_problems(recipe: Recipe, config: PretrainedConfig) -> list[str]:
    """objective reward loads the base as AutoModelForSequenceClassification: its architecture must have one."""
    if recipe.objective != "reward":
        return []
    remote = "AutoModelForSequenceClassification" in (getattr(config, "auto_map", None) or {})
    if config.model_type in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES or (remote and recipe.trust_remote_code):
        return []
    return [f"objective reward loads {recipe.model_name_or_path!r} as AutoModelForSequenceClassification (its body "
            f"plus a one-output score head), but transformers has no sequence-classification class for model type "
            f"{config.model_type!r}{' (its remote code has one: set trust_remote_code: true)' if remote else ''}; "
            "start from a causal LM whose architecture has one (llama, qwen2, mistral, gemma, ... "
            "ForSequenceClassification)"]


def saved_quantization_problems(recipe: Recipe, config: PretrainedConfig) -> list[str]:
    """A `quantization_config` in the model's own config.json: the weights were saved quantized (or claim to be).
    transformers then treats the loaded model as quantized and refuses to save full weights, which a run would only
    find out at its final save, after training."""
    saved = getattr(config, "quantization_config", None)
    if saved is None:
        return []
    method = saved.get("quant_method") if isinstance(saved, dict) else getattr(saved, "quant_method", None)
    method = str(getattr(method, "value", method))
    if method == "gguf":
        return [f"{recipe.model_name_or_path}'s config.json declares quantization_config quant_method 'gguf', but "
                "GGUF is a file format, not a state of these weights: transformers would mark the model as quantized "
                "and refuse to save it after training. Delete the quantization_config entry from config.json (older "
                "versions of scripts/convert_gguf.py wrote it; the current one does not)"]
    if not recipe.use_peft:
        return [f"{recipe.model_name_or_path} was saved quantized ({method}): full fine-tuning cannot update or save "
                "quantized weights (transformers refuses to save them after training); set use_peft: true to train "
                "LoRA adapters on the quantized base, or start from the unquantized model"]
    return []


def liger_problems(recipe: Recipe, cuda: bool, launch: Launch, model_config: PretrainedConfig | None) -> list[str]:
    """use_liger_kernel: what it needs from the machine, the recipe, the launch and the architecture. (Whether the
    built head is a plain Linear -- no adapter on lm_head -- is checked by `objectives.sft.CausalLMTokenLoss`.)"""
    if not recipe.use_liger_kernel:
        return []
    problems = []
    if not cuda:
        problems.append("use_liger_kernel needs a CUDA GPU: Liger's kernels are Triton GPU kernels; set "
                        "use_liger_kernel: false on this machine")
    if importlib.util.find_spec("liger_kernel") is None:
        problems.append("use_liger_kernel is set but the liger_kernel package is not installed; pip install "
                        "liger-kernel==0.8.5 (or pip install -e '.[cuda]'), or set use_liger_kernel: false")
    if recipe.loss_chunk_tokens > 0:
        problems.append(f"use_liger_kernel with loss_chunk_tokens={recipe.loss_chunk_tokens}: Liger's fused linear "
                        "cross-entropy already splits the tokens into chunks and computes their gradients in forward, "
                        "so hftrain's recomputing chunks would only run it twice; set loss_chunk_tokens: 0")
    if launch.zero_stage == 3:
        problems.append("use_liger_kernel under ZeRO-3 is refused: Liger's fused loss reads lm_head.weight without "
                        "calling lm_head, so ZeRO-3's gather hook never runs and the kernel gets an empty shard (TRL "
                        "issue #3368); use ZeRO-2, FSDP2 or DDP with Liger, or ZeRO-3 without it")
    if model_config is not None and model_config.model_type not in LIGER_MODEL_TYPES:
        problems.append(f"use_liger_kernel needs an architecture with Liger kernels whose logits are exactly "
                        f"lm_head(hidden states) (for the fused linear cross-entropy): "
                        f"{', '.join(sorted(LIGER_MODEL_TYPES))}; this model is {model_config.model_type!r}: set "
                        "use_liger_kernel: false")
    return problems


@dataclass(frozen=True)
class Obstacle:
    """Why attn_implementation=varlen cannot run with this recipe, launch, machine and model: `problem`, the refusal of
    an explicit request; `short`, the start-up line's words where the automatic choice keeps the model's attention."""

    short: str
    problem: str


def varlen_obstacles(recipe: Recipe, launch: Launch, cuda: bool, model_config: PretrainedConfig | None,
                     automatic: bool = False) -> list[Obstacle]:
    """Everything that stands between this run and attn_implementation=varlen (hftrain.attention): fp32 compute for a
    FlashAttention kernel, rows that are not packed, a layout whose attention is another module's (sequence
    parallelism, the pipeline; context parallelism's own rule refuses any attention but sdpa), generation through
    the trained model, and a model whose attention the kernel cannot compute. `automatic`: for the automatic choice,
    which takes varlen only where a FlashAttention kernel runs it (on CPU, hftrain's per-document sdpa runs it when
    named)."""
    r, kernel, found = recipe, attention.kernel_for(cuda), []

    def add(short: str, problem: str) -> None:
        found.append(Obstacle(short, f"attn_implementation={VARLEN} {problem}"))

    if automatic and kernel is attention.CPU_KERNEL:
        add("runs on CPU when named", "on a machine without CUDA runs as per-document sdpa: set "
            "attn_implementation: varlen to use it")
    if kernel.flash and not (r.bf16 or r.fp16 or r.dtype in ("bfloat16", "float16")):
        add("needs bf16/fp16", "computes in bf16 or fp16 only (FlashAttention has no fp32 kernel), and this run "
            "computes in fp32; set bf16: true (or fp16: true), or use sdpa")
    if not r.packing:
        add("needs packing", "keeps the documents of packed rows apart by the packer's boundaries; without packing "
            "every row is one example, which sdpa's causal kernel already runs without a mask: set packing: true, "
            "or use sdpa")
    if r.sp_size > 1:
        add("does not combine with sp_size", f"with sp_size={r.sp_size}: DeepSpeed's Ulysses attention wraps the "
            "kernels it knows (sdpa, flash_attention_2) and finds the documents from the gathered position_ids, not "
            "from the packer's boundaries; use sdpa (or flash_attention_2 on GPUs) with sp_size")
    if r.pp_size > 1:
        add("does not combine with pp_size", f"with pp_size={r.pp_size}: pipeline stages pass each micro-batch's "
            "hidden states and position_ids in buffers of one fixed shape, and the packer's boundaries (one entry per "
            "document, a different count in every micro-batch) do not travel with them; use sdpa with pp_size")
    if r.log_completions or r.eval_tasks:
        add("does not generate", "cannot generate: the kernel runs whole rows without a key/value cache or a padding "
            "mask, and log_completions / eval_tasks generate with the trained model; remove them (and try the final "
            "folder with `hftrain chat` / `hftrain eval`), or use sdpa")
    if model_config is None:
        return found
    text = model_config.get_text_config()
    heads = getattr(text, "num_attention_heads", None)
    head_dim = getattr(text, "head_dim", None) or (text.hidden_size // heads if heads else 0)
    window = getattr(text, "sliding_window", None)
    if model_config.model_type not in VARLEN_MODEL_TYPES:
        add("does not run this model", f"runs the architectures whose attention hftrain checked against it "
            f"({', '.join(sorted(VARLEN_MODEL_TYPES))}); this model is {model_config.model_type!r}: use sdpa")
    elif kernel.flash and head_dim > MAX_HEAD_DIM:
        add("does not run this model", f"needs a head dimension of at most {MAX_HEAD_DIM} (FlashAttention-2's), and "
            f"this model's is {head_dim}: use sdpa")
    if window is not None and window < r.max_length:
        add("does not run this model", f"computes no sliding window, and this model attends within {window} tokens, "
            f"fewer than max_length={r.max_length} (a longer document would attend further back than the model "
            f"does): set max_length <= {window}, or use sdpa")
    if getattr(text, "attention_dropout", 0.0):
        add("does not run this model", f"has no attention dropout, and this model trains with attention_dropout="
            f"{text.attention_dropout}: use sdpa, or set the model's attention_dropout to 0")
    return found


def attention_choice(recipe: Recipe, launch: Launch, cuda: bool,
                     model_config: PretrainedConfig | None) -> tuple[str | None, str | None]:
    """The attention the model loads with, and why varlen was not chosen where packed rows could use it (the start-up
    line's words, else None). The recipe's attn_implementation where it names one; else varlen where it can run
    (`varlen_obstacles`: CUDA, bf16/fp16, packed rows, a model and a layout it runs); else None, the model's default
    (sdpa for every architecture hftrain names)."""
    if recipe.attn_implementation is not None:
        return recipe.attn_implementation, None
    obstacles = varlen_obstacles(recipe, launch, cuda, model_config, automatic=True)
    if not obstacles:
        return VARLEN, None
    return None, f"{VARLEN} {obstacles[0].short}" if recipe.packing else None


def sequence_parallel_problems(recipe: Recipe, launch: Launch, model_config: PretrainedConfig | None) -> list[str]:
    """sp_size: DeepSpeed's Ulysses attention needs a DeepSpeed launch, whole sequence groups, heads it can split and
    an attention kernel that keeps documents apart without a 4D mask. (Sequence lengths need no check: hftrain pads
    each micro-batch to a multiple of sp_size with a target-less document.)"""
    sp, world = recipe.sp_size, launch.world
    if sp <= 1:
        return []
    problems = []
    if launch.kind != "deepspeed":
        problems.append(f"sp_size={sp} needs a DeepSpeed preset (cpu_sp on CPU; zero3_sp on GPUs): the sequence-"
                        "parallel backend is DeepSpeed's Ulysses attention (accelerate's ParallelismConfig has "
                        f"sp_backend deepspeed only); this launch is {launch.kind}. For ring attention under FSDP2 "
                        "use cp_size")
    elif world % sp:
        problems.append(f"sp_size={sp} does not divide the {world} processes of this launch; use a multiple of "
                        "sp_size processes (each group of sp_size consecutive ranks shares one sequence, the "
                        "remaining factor is data-parallel)")
    if recipe.attn_implementation == "eager":
        problems.append(f"sp_size={sp} with attn_implementation={recipe.attn_implementation}: DeepSpeed's Ulysses "
                        "refuses eager attention (it needs a 4D mask of the whole sequence, O(length^2) memory); "
                        "use sdpa, or flash_attention_2 on GPUs")
    if model_config is not None:
        text = model_config.get_text_config()
        heads, kv = text.num_attention_heads, getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        if not ulysses_splits(heads, kv, sp):
            problems.append(f"sp_size={sp} cannot split this model's {heads} attention heads ({kv} key/value heads): "
                            "Ulysses gives each rank of a sequence group heads/sp_size heads, so sp_size must divide "
                            "the attention heads and divide or be a multiple of the key/value heads")
        if router_coefficient(model_config, recipe.router_aux_loss_coef):
            problems.append(f"sp_size={sp} with a mixture-of-experts router loss: each slice would balance its own "
                            "tokens; set router_aux_loss_coef: 0, or sp_size: 1")
    return problems


def context_parallel_problems(recipe: Recipe, launch: Launch, model_config: PretrainedConfig | None) -> list[str]:
    """cp_size: torch's ring attention through accelerate's ParallelismConfig (built by hftrain from the recipe)
    needs FSDP2, whole context groups, sdpa, unpacked rows and plain causal attention in every layer. (Sequence
    lengths need no check: hftrain pads each micro-batch to a multiple of 2 x cp_size with target-less positions.
    CUDA is checked where the accelerator is made, parallel/launch.py: accelerate refuses the mesh on a CPU one.)"""
    cp, problems = recipe.cp_size, []
    mesh = launch.preset_mesh
    if mesh is not None and (mesh["cp"] != cp or mesh["tp"] > 1 or mesh["dp_replicate"] > 1):
        sizes = ", ".join(f"{name}_size {size}" for name, size in mesh.items())
        problems.append(f"the launch preset's parallelism_config ({sizes}) disagrees with the recipe "
                        f"(cp_size={cp}): hftrain builds accelerate's ParallelismConfig "
                        "from the recipe's cp_size (dp_shard_size = processes / cp_size); set cp_size in the recipe "
                        "and drop the preset's parallelism_config section")
    if cp <= 1:
        return problems
    if launch.kind != "fsdp2":
        problems.append(f"cp_size={cp} needs an FSDP2 preset (fsdp2_cp): accelerate runs torch's ring attention "
                        f"only with FSDP2 (ParallelismConfig cp_size); this launch is {launch.kind}. For sequence "
                        "parallelism under DeepSpeed use sp_size")
    elif launch.world % cp:
        problems.append(f"cp_size={cp} does not divide the {launch.world} processes of this launch; use a multiple "
                        "of cp_size processes (each group of cp_size consecutive ranks shares one sequence, the "
                        "remaining factor is data-parallel)")
    if recipe.attn_implementation not in (None, "sdpa"):
        problems.append(f"cp_size={cp} with attn_implementation={recipe.attn_implementation}: torch's ring "
                        "attention replaces scaled_dot_product_attention only; use sdpa")
    if recipe.packing:
        problems.append(f"cp_size={cp} with packing: torch's ring attention is plain causal over the whole row and "
                        "would attend across packed examples (axolotl #3608); use sp_size, or packing: false")
    if model_config is not None:
        text = model_config.get_text_config()
        layers = set(getattr(text, "layer_types", None) or
                     (["sliding_attention"] if getattr(text, "sliding_window", None) else [])) - {"full_attention"}
        if layers:
            problems.append(f"cp_size={cp} with a model whose attention layers are {sorted(layers)}: ring attention "
                            "drops the layer's mask for plain causal attention, so those layers would train with "
                            "full causal attention; use sp_size, or a full-attention model")
        if router_coefficient(model_config, recipe.router_aux_loss_coef):
            problems.append(f"cp_size={cp} with a mixture-of-experts router loss: each rank would balance its own "
                            "shard of the tokens; set router_aux_loss_coef: 0, or cp_size: 1")
    return problems
