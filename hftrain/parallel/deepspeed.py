"""DeepSpeed ZeRO (stages 1-3, optimizer / parameter offload): the engine owns the update.

The preset's JSON (`ds_configs/*.json`) uses "auto" for what the recipe owns; hftrain fills those values from the
recipe so that it stays the single source of truth (`fill_deepspeed_config`), and refuses a JSON that contradicts
it (`deepspeed_problems`, run by the preflight). The client optimizer is used (no DeepSpeed optimizer or scheduler
block): the loop steps the schedule once per optimizer step. The engine clips inside its step (`gradient_clipping`)
and applies the update inside `backward` of the last micro-batch. Checkpoints hold one optimizer partition per rank;
on another number of processes they are converted to a DeepSpeed universal checkpoint first
(`checkpoint_io.DeepSpeedCheckpoints`).
"""

from __future__ import annotations

import copy
from contextlib import contextmanager

import torch

from hftrain.compat.deepspeed import is_partitioned, local_part
from hftrain.config import TORCH_ADAMW, Recipe
from hftrain.errors import HftrainError
from hftrain.memory import ModelState, ParameterCounts, deepspeed_bytes, zero_offload_state
from hftrain.memory import zero as zero_placement
from hftrain.parallel.base import Backend, Parallelism
from hftrain.parallel.checkpoint_io import DeepSpeedCheckpoints
from hftrain.parallel.generation import ZeRO3Generation

# "auto" entries hftrain fills: from the recipe (and world size) at start-up, or from the model's hidden size
RECIPE_AUTO_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size",
                    "gradient_clipping", "bf16.enabled", "fp16.enabled")
HIDDEN_SIZE_AUTO_KEYS = {  # the sizes HF Trainer and accelerate use
    "zero_optimization.reduce_bucket_size": lambda h: h * h,
    "zero_optimization.stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "zero_optimization.stage3_param_persistence_threshold": lambda h: 10 * h,
}


def get_key(config: dict, dotted: str):
    node = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def set_key(config: dict, dotted: str, value) -> None:
    *parents, last = dotted.split(".")
    node = config
    for part in parents:
        node = node[part]
    node[last] = value


def _auto_keys(node: dict, prefix: str = "") -> list[str]:
    found = []
    for key, value in node.items():
        if isinstance(value, dict):
            found += _auto_keys(value, f"{prefix}{key}.")
        elif value == "auto":
            found.append(f"{prefix}{key}")
    return found


def offloaded_parts(block: dict) -> tuple[str, ...]:
    """What a `zero_optimization` block offloads to CPU RAM: "optimizer" (offload_optimizer), "weights"
    (offload_param); `memory.zero` adds the gradients that go with the optimizer."""
    return tuple(part for part, key in (("optimizer", "offload_optimizer"), ("weights", "offload_param"))
                 if block.get(key, {}).get("device", "none") not in ("none", None))


def recipe_values(recipe: Recipe, world: int) -> dict:
    """What the recipe says for each DeepSpeed key hftrain fills."""
    micro, accum = recipe.per_device_train_batch_size, recipe.gradient_accumulation_steps
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accum,
            "train_batch_size": micro * accum * world, "gradient_clipping": float(recipe.max_grad_norm),
            "bf16.enabled": recipe.bf16, "fp16.enabled": recipe.fp16}


def deepspeed_problems(recipe: Recipe, config: dict, world: int) -> list[str]:
    """Every way a DeepSpeed config contradicts the recipe or cannot work with hftrain's loop."""
    problems = []
    for block in ("optimizer", "scheduler"):
        if block in config:
            problems.append(f"the DeepSpeed config has an {block!r} block; remove it: the recipe's optim / "
                            "learning-rate fields build the optimizer and schedule (the same ones under every preset)")
    for key, wanted in recipe_values(recipe, world).items():
        value = get_key(config, key)
        if value is None or value == "auto":
            continue
        if key.endswith(".enabled"):
            value = str(value).lower() == "true"
        if value != wanted:
            problems.append(f"the DeepSpeed config sets {key}={value} but the recipe gives {wanted}; set it to "
                            "\"auto\" so hftrain fills it from the recipe")
    unknown = [k for k in _auto_keys(config) if k not in RECIPE_AUTO_KEYS and k not in HIDDEN_SIZE_AUTO_KEYS]
    if unknown:
        problems.append(f"the DeepSpeed config has \"auto\" values hftrain does not fill: {', '.join(unknown)}; "
                        "give them numbers")
    if "zero_optimization" not in config:
        problems.append("the DeepSpeed config has no zero_optimization block; give one with a stage (0-3)")
    zero = config.get("zero_optimization", {})
    if zero.get("stage") == 3 and not zero.get("stage3_gather_16bit_weights_on_model_save"):
        problems.append("ZeRO stage 3 without zero_optimization.stage3_gather_16bit_weights_on_model_save: true "
                        "cannot write a consolidated final model (every rank holds a shard); set it to true")
    if "optimizer" in offloaded_parts(zero) and recipe.optim not in TORCH_ADAMW:
        problems.append(f"optimizer offload runs DeepSpeedCPUAdam, but optim={recipe.optim}: accelerate would "
                        "silently replace it with Adam; use optim=adamw_torch or a DeepSpeed config without "
                        "offload_optimizer")
    return problems


def fill_deepspeed_config(config: dict, recipe: Recipe, world: int) -> None:
    """Fill the recipe-determined values that are "auto" or absent, in place.

    Absent counts as "auto": DeepSpeed's own defaults differ from the recipe's (gradient_clipping defaults to 1.0
    there; max_grad_norm=0 must reach DeepSpeed as 0, which disables clipping). Precision (bf16/fp16.enabled) is
    filled by accelerate from the recipe's mixed precision.
    """
    for key, value in recipe_values(recipe, world).items():
        if not key.endswith(".enabled") and get_key(config, key) in (None, "auto"):
            set_key(config, key, value)


class DeepSpeedBackend(Backend):
    step_applied_in_backward = True  # the engine steps its optimizer inside backward: a bad step cannot be skipped
    checkpoint_io = DeepSpeedCheckpoints
    generation_io = ZeRO3Generation

    @property
    def config(self) -> dict:
        """The DeepSpeed config the engine runs with (filled in place)."""
        return self.accelerator.state.deepspeed_plugin.deepspeed_config

    def __post_init__(self) -> None:
        fill_deepspeed_config(self.config, self.recipe, self.accelerator.num_processes)
        super().__post_init__()

    def make_record(self, **layout) -> Parallelism:
        block = self.config["zero_optimization"]
        stage = int(block.get("stage", 0))
        placed = zero_placement(stage, self.accelerator.num_processes, offloaded_parts(block))
        name = f"DeepSpeed ZeRO-{stage}" + (" + offload" if placed.offloaded else "")
        return super().make_record(kind="deepspeed", name=name, zero_stage=stage, sharded=placed.sharded,
                                   offloaded=placed.offloaded)

    def wrap(self, model, optimizer):
        hidden = getattr(model.config.get_text_config(), "hidden_size", None)  # an image-text model's language model
        for key, size in HIDDEN_SIZE_AUTO_KEYS.items():
            if get_key(self.config, key) == "auto":
                if hidden is None:
                    raise HftrainError(f"the DeepSpeed config has {key}: \"auto\" but the model config has no "
                                       "hidden_size to derive it from; give a number")
                set_key(self.config, key, size(hidden))
        return super().wrap(model, optimizer)

    def local_trained_tensors(self, model) -> list[torch.Tensor]:
        """ZeRO-3: this process's partition of each trained parameter (the parameter itself is an empty placeholder
        outside forward); ZeRO-1/2: the engine's copy of the weights (the master copy is restored from the same
        checkpoint)."""
        return [local_part(p) for p in model.parameters() if p.requires_grad]

    def copy_frozen(self, model, rebuild):
        """Under ZeRO-3 transformers loads the model already partitioned (zero.Init): its parameters are empty
        placeholders that a deep copy would copy as such. The copy is built again, partitioned the same way, and
        each process copies its own partitions into it (exactly the starting weights, resized embeddings included)."""
        if not any(is_partitioned(p) for p in model.parameters()):
            return super().copy_frozen(model, rebuild)
        copy_ = rebuild()
        with torch.no_grad():
            for (name, mine), (_, theirs) in zip(copy_.named_parameters(), model.named_parameters(), strict=True):
                if local_part(mine).shape != local_part(theirs).shape:
                    raise HftrainError(f"dpo's reference copy: {name} is partitioned differently from the model")
                local_part(mine).copy_(local_part(theirs))
        return copy_

    def place_frozen(self, module):
        """An inference engine with the training config less its optimizer parts (TRL's prepare_deepspeed): under
        ZeRO-3 its weights are partitioned like the trained model's; under ZeRO-0/1/2 (stage 0: nothing to shard
        without an optimizer) replicated in the engine's dtype. Called after `prepare`, so the config is filled."""
        import deepspeed

        config = copy.deepcopy(self.config)
        for key in ("optimizer", "scheduler"):
            config.pop(key, None)
        zero = config.setdefault("zero_optimization", {})
        zero.pop("offload_optimizer", None)
        stage = int(zero.get("stage", 0))
        if stage != 3:
            zero["stage"] = 0
        engine, *_ = deepspeed.initialize(model=module, config=config)
        engine.eval()
        return engine, ("partitioned over the processes (ZeRO-3)" if stage == 3 else
                               "replicated on every process in the engine's dtype")

    @contextmanager
    def gathered(self, params: list):
        """ZeRO-3: the partitions gathered whole for the context (DeepSpeed's GatheredParameters, read-only: one
        all-gather on every rank); other stages hold them whole."""
        if self.record.zero_stage != 3:
            yield
            return
        import deepspeed

        with deepspeed.zero.GatheredParameters(params):
            yield

    def unwrap(self, model):
        return self.accelerator.unwrap_model(model)  # the DeepSpeedEngine's module

    def shard_count(self) -> int:
        return self.accelerator.num_processes

    def model_state(self, counts: ParameterCounts) -> ModelState:
        """In 16-bit mixed precision DeepSpeed holds 16-bit weights and gradients and an fp32 master copy (4 bytes)
        in the optimizer state (`memory.deepspeed_bytes`); with the optimizer offloaded at stage 1 or 2 the
        gradients are fp32 (`memory.zero_offload_state`)."""
        if self.recipe.bf16 or self.recipe.fp16:
            weight_bytes, state_bytes = deepspeed_bytes(0, self.optimizer_state_bytes(), True)
            state = ModelState.of(counts.total, counts.trained, weight_bytes, state_bytes)
        else:
            state = super().model_state(counts)
        if "optimizer" in self.record.offloaded:
            state = zero_offload_state(state, counts.trained, self.record.zero_stage)
        return state

    def config_used(self) -> dict | None:
        return self.config

