"""The grpo group of the recipe (TRL GRPOConfig's names and defaults): its fields (`GRPOFields`) and the rules judged
from the recipe alone (`problems`); the reward functions are imported and checked by the objective before the
model loads (`hftrain/objectives/grpo.py`, pieces in `hftrain/rl/`). beta, loss_type, max_prompt_length and
max_completion_length are the objective group's fields, shared with dpo; their grpo defaults are
`OBJECTIVE_DEFAULTS`."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, fields
from pathlib import Path

from hftrain.fields import GRPO_LOSS_TYPES as LOSS_TYPES
from hftrain.fields import recipe_field as _f

# GRPOConfig's defaults where they differ from DPOConfig's for the fields the two share; load_recipe applies them
# to the fields a grpo recipe and its command line leave unset, so the resolved recipe shows them
# (and TRL holds no prompts out for evaluation: a grpo run evaluates on eval_dataset_name, or on a carve-out it asks
# for with validation_split_percentage)
OBJECTIVE_DEFAULTS = {"grpo": {"beta": 0.0, "loss_type": "dapo", "max_completion_length": 512,
                               "validation_split_percentage": 0.0},
                      "kto": {"loss_type": "kto"}}  # KTOConfig's default loss


@dataclass
class GRPOFields:
    reward_funcs: list[str] = _f(
        [], "grpo: the reward functions, each a dotted import path pkg.module.func or path/to/file.py:func, called "
        "as TRL does: f(prompts, completions, completion_ids, **dataset_columns) -> list[float | None]; or a reward "
        "model folder (objective reward's final folder: prompt + completion scored as TRL scores with a model).",
        group="grpo",
    )
    reward_weights: list[float] | None = _f(
        None, "grpo: one weight per reward function (default: all 1); the reward is the weighted sum.", group="grpo",
    )
    num_generations: int = _f(8, "grpo: completions sampled per prompt (a group).", group="grpo")
    temperature: float = _f(
        1.0, "grpo: sampling temperature; the trained log-probs use the logits divided by it, as TRL.", group="grpo",
    )
    top_p: float = _f(1.0, "grpo: nucleus sampling probability mass (1 = off).", group="grpo")
    top_k: int = _f(0, "grpo: sample from the k most likely tokens only (0 = off).", group="grpo")
    repetition_penalty: float = _f(1.0, "grpo: generate's repetition penalty (1 = off).", group="grpo")
    epsilon: float = _f(0.2, "grpo: lower clipping range of the importance ratio, 1 - epsilon.", group="grpo")
    epsilon_high: float | None = _f(
        None, "grpo: upper clipping range, 1 + epsilon_high (default: epsilon; DAPO uses 0.28). loss_type cispo: the "
        "ratio's upper clip itself (not 1 + epsilon_high: the MiniMax-M1 paper's epsilon_max, TRL recommends 5.0).",
        group="grpo",
    )
    sapo_temperature_pos: float = _f(
        1.0, "grpo, loss_type sapo: the gate's temperature for tokens of completions with a positive advantage "
        "(TRL's name and default).", group="grpo",
    )
    sapo_temperature_neg: float = _f(
        1.05, "grpo, loss_type sapo: the gate's temperature for tokens of completions with a zero or negative "
        "advantage (TRL's name and default).", group="grpo",
    )
    advantage_estimator: str = _f(
        "grpo", "grpo: how each completion's advantage is computed from the rewards of its group. grpo: R - group "
        "mean, scaled by scale_rewards (GRPOTrainer). rloo: TRL RLOOTrainer's leave-one-out baseline, A = R - the "
        "mean of the other completions of its group that some reward function scored; with beta > 0 the reward is "
        "first penalised by beta x the completion's summed first-order KL, sum_t (logp - ref logp) with the "
        "log-probs at generation, and no KL term is added to the loss (RLOOTrainer's KL handling); "
        "normalize_advantages then standardises the whole generation batch's advantages. The policy loss stays "
        "loss_type's (docs/grpo.md).", group="grpo", choices=("grpo", "rloo"),
    )
    normalize_advantages: bool = _f(
        False, "grpo, advantage_estimator rloo (RLOOConfig's name and default): standardise the advantages over the "
        "whole generation batch, (A - mean) / (std + 1e-4), std with Bessel's correction, completions no function "
        "scored left out.", group="grpo",
    )
    scale_rewards: str = _f(
        "group", "grpo: advantages (R - group mean) divided by the group's reward std (group), the whole "
        "generation batch's (batch) or not at all (none).", group="grpo", choices=("group", "batch", "none"),
    )
    num_iterations: int = _f(
        1, "grpo: optimisation passes over each generation batch; every pass uses the log-probs stored at "
        "generation as the ratio's denominator (PPO-style).", group="grpo",
    )
    steps_per_generation: int | None = _f(
        None, "grpo: micro-batches per process that one generation batch feeds (default: "
        "gradient_accumulation_steps, one generation per optimizer step); a multiple of "
        "gradient_accumulation_steps.", group="grpo",
    )
    mask_truncated_completions: bool = _f(
        False, "grpo: completions cut at max_completion_length (no EOS) train no token.", group="grpo",
    )
    importance_sampling_level: str = _f(
        "token", "grpo: one importance ratio per token, or per completion (sequence: GSPO).", group="grpo",
        choices=("token", "sequence"),
    )
    log_completions: bool = _f(
        False, "grpo: also log TRL's table of completions (step, prompt, completion, each reward, advantage) of the "
        "latest generation batch to W&B with each metrics row; needs wandb in report_to (rollouts.jsonl always has "
        "every completion). sft, dpo, simpo: at each evaluation, complete the first num_completion_prompts eval "
        "prompts (greedy, up to completion_max_new_tokens) with the live model, append them to "
        "output_dir/completions.jsonl (step, prompt, completion), log them as a W&B table (report_to wandb) and print "
        "num_completions_to_print of them.", group="grpo",
    )
    use_vllm: bool = _f(
        False, "grpo: sample with vLLM instead of transformers' generate, in TRL's colocated mode: every process runs "
        "its own vLLM engine (vllm.LLM with the external_launcher executor) on its GPU beside the trained model, the "
        "trained weights are pushed into it before each generation batch, each completion is one request with its "
        "own seed, and the loss is corrected for vLLM's sampling log-probs (vllm_importance_sampling_*). Needs a "
        "CUDA GPU and the vllm package (pip install 'hftrain[vllm]'); one process, DDP or ZeRO-1/2, full fine-tuning "
        "or LoRA. Written from TRL 1.16's and vLLM's code, not yet run on a GPU (docs/grpo.md).", group="grpo",
    )
    vllm_mode: str = _f(
        "colocate", "grpo, use_vllm: colocate (vLLM inside each training process, sharing its GPU). TRL's server "
        "mode (a separate `trl vllm-serve` process that receives the weights over NCCL) is refused.", group="grpo",
        choices=("colocate", "server"),
    )
    vllm_gpu_memory_utilization: float = _f(
        0.3, "grpo, use_vllm: the share of the GPU's memory vLLM's engine takes (weights and KV cache), the rest "
        "being left to training.", group="grpo",
    )
    vllm_max_model_length: int | None = _f(
        None, "grpo, use_vllm: vLLM's context length (max_model_len); at least the longest prompt plus "
        "max_completion_length (default: from the model's config).", group="grpo",
    )
    vllm_tensor_parallel_size: int = _f(
        1, "grpo, use_vllm: vLLM's tensor-parallel size; only 1 (one engine per process) is implemented.",
        group="grpo",
    )
    vllm_enable_sleep_mode: bool = _f(
        False, "grpo, use_vllm: put vLLM's weights and KV cache to sleep (level 2: freed) between generation batches, "
        "waking the weights before they are pushed and the cache before sampling: less memory during the training "
        "steps, more transfer time.", group="grpo",
    )
    vllm_model_impl: str = _f(
        "vllm", "grpo, use_vllm: the model implementation vLLM runs: its own (vllm) or transformers' "
        "(transformers).", group="grpo", choices=("vllm", "transformers"),
    )
    vllm_importance_sampling_correction: bool = _f(
        True, "grpo, use_vllm: multiply each token's loss by the importance ratio between the trained model's "
        "log-probs at generation and vLLM's sampling log-probs (truncated or masked, vllm_importance_sampling_mode), "
        "as TRL; the generation-time log-probs are then stored and used as the ratio's denominator.", group="grpo",
    )
    vllm_importance_sampling_mode: str = _f(
        "sequence_mask", "grpo, use_vllm: token_truncate / token_mask: one ratio per token, clipped to [clip_min, "
        "clip_max] / set to 0 outside it; sequence_truncate / sequence_mask: one ratio per completion, exp of the "
        "summed log-prob differences.", group="grpo",
        choices=("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"),
    )
    vllm_importance_sampling_clip_max: float | None = _f(
        3.0, "grpo, use_vllm: upper bound of the importance ratio (none: no upper bound).", group="grpo",
    )
    vllm_importance_sampling_clip_min: float | None = _f(
        None, "grpo, use_vllm: lower bound of the importance ratio (none: no lower bound).", group="grpo",
    )
    tools: list[str] = _f(
        [], "grpo: tool functions the model may call (TRL's tools), each a dotted import path pkg.module.func or "
        "path/to/file.py:func of a function with type hints and a docstring describing every argument; their schemas "
        "are rendered into the chat prompts by the chat template (apply_chat_template(tools=...)), a turn's calls are "
        "parsed with the tokenizer's response_template (tokenizer_config.json), run, and their results appended as "
        "tool messages, never trained; generation goes on until a turn without a call (docs/grpo.md).", group="grpo",
    )
    environment_factory: str | None = _f(
        None, "grpo: a class (or callable) making one environment per rollout, as TRL's environment_factory: "
        "reset(**row) before each rollout (a string it returns is appended to the prompt), its public methods are the "
        "rollout's tools, a get_reward() method a reward function; pkg.module.Class or path/to/file.py:Class.",
        group="grpo",
    )
    max_tool_calling_iterations: int | None = _f(
        None, "grpo, tools: rounds of tool execution per rollout (TRL's); a turn whose calls go past it ends the "
        "completion unexecuted (default: no limit but max_completion_length).", group="grpo",
    )
    tool_call_timeout: float = _f(
        30.0, "grpo, tools: seconds each tool call may take; a call that raises or times out returns "
        "{'error': message} as its result and counts in tools/failure_frequency.", group="grpo",
    )
    async_generation: bool = _f(
        False, "grpo: sample in a rollout worker beside the trainer (TRL's AsyncGRPOTrainer idea): a separate process "
        "on this machine's CPU cores generating with transformers from the newest weights the trainer sent it, into a "
        "bounded queue, while the trainer trains on earlier windows. Window w is sampled by the policy exactly "
        "min(max_staleness, its version) weight syncs behind the trainer's at the step that trains it (the worker "
        "waits for those weights; a window that would be older is never generated, so nothing is dropped), each "
        "completion carries its behaviour log-probs and policy version (rollouts.jsonl), and the loss is corrected by "
        "vllm_importance_sampling_* (TRL's names) against them. One process or DDP, full fine-tuning or LoRA (the "
        "worker receives the adapter merged into the base), one optimizer step per generation window "
        "(docs/grpo.md).", group="grpo",
    )
    max_staleness: int = _f(
        4, "grpo, async_generation (TRL's name and default): how many weight syncs behind the trainer the policy "
        "that samples a window is; 0 with weight_sync_steps 1 is the synchronous run.", group="grpo",
    )
    weight_sync_steps: int = _f(
        1, "grpo, async_generation (TRL's name and default): optimizer steps between two weight pushes to the "
        "rollout worker (one policy version each).", group="grpo",
    )
    max_inflight_tasks: int = _f(
        -1, "grpo, async_generation (TRL's name): completions the worker may hold sampled ahead of the trainer (the "
        "queue's bound, whole generation windows, at least one); -1: max(max_staleness, 1) x the completions of one "
        "optimizer step, as TRL.", group="grpo",
    )
    async_worker: str = _f(
        "transformers", "grpo, async_generation: the rollout worker's kind: transformers (a process on this machine "
        "generating with transformers) or vllm_server (a running `vllm serve` at vllm_server_base_url, sampled over "
        "its OpenAI-compatible /v1/completions with each completion's seed and log-probs, weights pushed through "
        "vLLM's weight-update routes as TRL's AsyncGRPOTrainer does; its NCCL weight transfer is not written yet, so "
        "it is refused).", group="grpo", choices=("transformers", "vllm_server"),
    )
    vllm_server_base_url: str = _f(
        "http://localhost:8000", "grpo, async_worker vllm_server (TRL's name and default): the vLLM server's base "
        "URL.", group="grpo",
    )
    vllm_server_timeout: float = _f(
        240.0, "grpo, async_worker vllm_server (TRL's name and default): seconds to wait for the server to answer "
        "GET /health at start.", group="grpo",
    )
    request_timeout: float = _f(
        600.0, "grpo, async_worker vllm_server (TRL's name and default): seconds one HTTP request to the server may "
        "take before it counts as failed and is retried.", group="grpo",
    )
    vllm_server_retries: int = _f(
        3, "grpo, async_worker vllm_server: retries of a request the server refuses, drops or leaves unanswered "
        "(pauses of 1, 2, 4... s; TRL retries 3 times); then the run stops naming the server.", group="grpo",
    )
    ds3_gather_for_generation: bool = _f(
        True, "grpo, DeepSpeed ZeRO-3 (TRL's name and default): true gathers the whole model on every process for "
        "each generation batch (fast sampling; one full copy of the weights per process meanwhile); false samples "
        "through the ZeRO-3 partitions, each layer gathered by DeepSpeed's hooks for every generated token (memory as "
        "a training forward, for a model whose weights do not fit one device whole; slower). Other strategies never "
        "gather the whole model for generation (one process, DDP and ZeRO-1/2 hold it whole already, FSDP2 and "
        "tensor parallelism generate through their shards), so there false changes nothing, as in TRL.",
        group="grpo",
    )


# TRL 1.16's newest supported vLLM (its vllm extra: vllm>=0.22.0,<=0.31.0); pyproject.toml's vllm extra
VLLM_REQUIREMENT = "vllm==0.31.0"
VLLM_FIELDS = ("vllm_mode", "vllm_gpu_memory_utilization", "vllm_max_model_length", "vllm_tensor_parallel_size",
               "vllm_enable_sleep_mode", "vllm_model_impl", "vllm_importance_sampling_correction",
               "vllm_importance_sampling_mode", "vllm_importance_sampling_clip_max",
               "vllm_importance_sampling_clip_min")


IMPORTANCE_SAMPLING_FIELDS = ("vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
                              "vllm_importance_sampling_clip_max", "vllm_importance_sampling_clip_min")
ASYNC_FIELDS = ("max_staleness", "weight_sync_steps", "max_inflight_tasks", "async_worker")
SERVER_FIELDS = ("vllm_server_base_url", "vllm_server_timeout", "request_timeout", "vllm_server_retries")
GRPO_DEFAULTS = {f.name: f.default for f in fields(GRPOFields)}


def async_problems(r) -> list[str]:
    """async_generation's settings and what its worker does not do yet (judged from the recipe; the strategy, which
    must hold the whole model on each process, is checked when the worker starts)."""
    if not r.async_generation:
        return []
    checks = [
        (r.max_staleness >= 0, f"max_staleness must be >= 0, got {r.max_staleness}"),
        (r.weight_sync_steps >= 1, f"weight_sync_steps must be >= 1, got {r.weight_sync_steps}"),
        (r.max_inflight_tasks == -1 or r.max_inflight_tasks >= 1,
         f"max_inflight_tasks must be >= 1, or -1 (automatic), got {r.max_inflight_tasks}"),
        (not r.use_vllm, "async_generation with use_vllm: the rollout worker generates with transformers in its own "
         "process; the vLLM-server worker is not written yet: use one of them"),
        (r.request_timeout > 0, f"request_timeout must be > 0, got {r.request_timeout}"),
        (r.vllm_server_retries >= 0, f"vllm_server_retries must be >= 0, got {r.vllm_server_retries}"),
        (r.async_worker != "vllm_server", "async_worker: vllm_server is refused: its HTTP client "
         "(hftrain/rl/vllm_server.py: /v1/completions with per-completion seeds and log-probs, the weight-update "
         "handshake, bounded retries) is written and tested against a stand-in server, but pushing the trainer's "
         "weights to a real `vllm serve` needs vLLM's NCCL weight-transfer backend (a CUDA GPU and the vllm package "
         "on the trainer's side), which is not written, and the trainer's rollout-worker wiring for it is not "
         "finished; use async_worker: transformers (the default)"),
        (r.num_iterations == 1 and (r.steps_per_generation is None
                                    or r.steps_per_generation == r.gradient_accumulation_steps),
         "async_generation needs one optimizer step per generation window (num_iterations 1, steps_per_generation "
         "unset): each window is then trained by one policy version"),
        (not (r.load_in_4bit or r.load_in_8bit), "async_generation with load_in_4bit / load_in_8bit (QLoRA) is "
         "refused: the rollout worker builds the model in the recipe's dtype and receives each LoRA merged into its "
         "base weight, and merging into a quantized base is not written; use LoRA without quantization"),
        (not (r.tools or r.environment_factory), "async_generation with tools / environment_factory is refused: the "
         "rollout worker samples single-turn completions only"),
        (r.tp_size == 1 and r.sp_size == 1 and r.cp_size == 1 and r.pp_size == 1,
         "async_generation needs the whole model on every process (one process or DDP); tp_size, sp_size, cp_size "
         "and pp_size must be 1"),
    ]
    return [message for ok, message in checks if not ok]


def vllm_problems(r) -> list[str]:
    """use_vllm's settings judged from the recipe alone (TRL's GRPOConfig rules, and what hftrain's colocated
    generation does not run); the machine (CUDA, the vllm package) and the launch (ZeRO-3, FSDP2) are preflight's."""
    if not r.use_vllm:
        return []
    checks = [
        (r.vllm_mode == "colocate", "vllm_mode: server is refused: hftrain implements TRL's colocated mode only (a "
         "vLLM engine inside each training process); server mode needs a separate `trl vllm-serve` process and "
         "an NCCL weight-update group with it, which hftrain has not written; use vllm_mode: colocate"),
        (r.vllm_tensor_parallel_size == 1, f"vllm_tensor_parallel_size={r.vllm_tensor_parallel_size} is refused: "
         "hftrain runs one vLLM engine per process (TRL's tp groups gather the prompts of several processes into "
         "one engine, which hftrain has not written); use 1"),
        (0 < r.vllm_gpu_memory_utilization <= 1, "vllm_gpu_memory_utilization must be in (0, 1], got "
         f"{r.vllm_gpu_memory_utilization}"),
        (r.vllm_max_model_length is None or r.vllm_max_model_length >= 1,
         f"vllm_max_model_length must be >= 1 or unset, got {r.vllm_max_model_length}"),
        (r.vllm_importance_sampling_clip_min is None or r.vllm_importance_sampling_clip_max is None
         or r.vllm_importance_sampling_clip_min < r.vllm_importance_sampling_clip_max,
         f"vllm_importance_sampling_clip_min ({r.vllm_importance_sampling_clip_min}) must be less than "
         f"vllm_importance_sampling_clip_max ({r.vllm_importance_sampling_clip_max})"),
        (not (r.vllm_importance_sampling_correction and r.vllm_importance_sampling_mode.endswith("_truncate")
              and r.vllm_importance_sampling_clip_min is None and r.vllm_importance_sampling_clip_max is None),
         f"vllm_importance_sampling_mode={r.vllm_importance_sampling_mode} clips the ratio: set "
         "vllm_importance_sampling_clip_min or vllm_importance_sampling_clip_max (or both)"),
        (r.tp_size <= 1, f"use_vllm with tp_size={r.tp_size} is refused: the trained weights would have to be "
         "gathered from transformers' tensor-parallel shards for each push into vLLM, which hftrain has not written; "
         "use DDP (or transformers' generate under tp)"),
        (r.pp_size <= 1, f"use_vllm with pp_size={r.pp_size} is refused: each pipeline stage holds some layers only, "
         "and the push into vLLM needs every weight on each process"),
        (not (r.load_in_4bit or r.load_in_8bit), "use_vllm with load_in_4bit / load_in_8bit (QLoRA) is refused: "
         "pushing a LoRA merged into a bitsandbytes base into vLLM (TRL loads vLLM with quantization=bitsandbytes) "
         "has not been written; use LoRA on a bf16 base, or use_vllm: false"),
    ]
    return [message for ok, message in checks if not ok]


def vllm_defaults_changed(r) -> list[str]:
    """The vllm_* fields set away from their defaults (a recipe without use_vllm: true must not set them)."""
    defaults = {f.name: f.default for f in fields(GRPOFields)}
    return [name for name in VLLM_FIELDS if getattr(r, name) != defaults[name]]


def locate_problem(spec: str) -> str | None:
    """Why what `spec` names (pkg.module.name or path/to/file.py:name) cannot be found, or None: a file that is not
    there, a dotted path without a module, a module Python does not find (its parent packages are imported to look,
    as an import would). What fails inside the module shows when the objective loads it (hftrain/rl/)."""
    if ":" in spec:
        path, _, name = spec.rpartition(":")
        if not Path(path).expanduser().is_file():
            return f"names the file {path}, which does not exist"
        return None if name else "names no function after the ':'"
    module, _, name = spec.rpartition(".")
    if not module or not name:
        return "is not a dotted path with a module and a name"
    try:
        found = importlib.util.find_spec(module)
    except Exception as exc:  # noqa: BLE001 - a parent package that fails to import is the user's code
        return f"does not load ({type(exc).__name__}: {exc})"
    return None if found else f"does not load (ModuleNotFoundError: No module named {module!r})"


def tool_problems(r) -> list[str]:
    """The tools and environment_factory entries that name nothing Python can find (`locate_problem`), whatever the
    objective: reported with the objective's own problems."""
    specs = [(f"tools entry {spec!r}", spec, "pkg.module.func or path/to/file.py:func") for spec in r.tools]
    if r.environment_factory is not None:
        specs.append((f"environment_factory {r.environment_factory!r}", r.environment_factory,
                      "pkg.module.Class or path/to/file.py:Class"))
    return [f"{what} {problem}; give a dotted import path {form}" for what, spec, form in specs
            if (problem := locate_problem(spec))]


def problems(r) -> list[str]:
    """objective grpo's settings (GRPOConfig's rules) and what it cannot be combined with yet. Other objectives:
    reward_funcs and the tool settings unset. Either way, tools and environment_factory must name something Python
    finds."""
    stray = [] if r.use_vllm else [name for name in vllm_defaults_changed(r)
                                   if not (r.async_generation and name in IMPORTANCE_SAMPLING_FIELDS)]
    stray = [f"{', '.join(stray)} set without use_vllm: true; they configure vLLM generation: add use_vllm: true "
             "(objective grpo) or remove them"] if stray else []
    server_set = [name for name in SERVER_FIELDS if getattr(r, name) != GRPO_DEFAULTS[name]]
    if server_set and r.async_worker != "vllm_server":
        stray.append(f"{', '.join(server_set)} set without async_worker: vllm_server; they configure the vLLM-server "
                     "rollout worker: add async_worker: vllm_server (with async_generation: true) or remove them")
    async_set = [name for name in ASYNC_FIELDS if getattr(r, name) != GRPO_DEFAULTS[name]]
    if async_set and not r.async_generation:
        stray.append(f"{', '.join(async_set)} set without async_generation: true; they configure the rollout worker: "
                     "add async_generation: true or remove them")
    unfound = tool_problems(r)
    if r.objective != "grpo":
        misplaced = [(r.reward_funcs, f"reward_funcs is set but objective={r.objective}; set objective: grpo"),
                     (r.reward_weights is not None, f"reward_weights is set but objective={r.objective}; set "
                      "objective: grpo"),
                     (r.use_vllm, f"use_vllm is grpo's generation setting, but objective={r.objective}; remove it"),
                     (r.async_generation, f"async_generation is grpo's generation setting, but "
                      f"objective={r.objective}; remove it"),
                     (not r.ds3_gather_for_generation, "ds3_gather_for_generation: false is grpo's generation "
                      f"setting, but objective={r.objective}; remove it"),
                     (r.tools, f"tools is set but objective={r.objective}; tool calling is grpo's (set objective: "
                      "grpo, or remove tools)"),
                     (r.environment_factory is not None, f"environment_factory is set but objective={r.objective}; "
                      "set objective: grpo, or remove it"),
                     (r.max_tool_calling_iterations is not None, "max_tool_calling_iterations is grpo's tool-calling "
                      f"setting, but objective={r.objective}; remove it")]
        return [message for is_set, message in misplaced if is_set] + stray + unfound
    problems = stray + unfound + vllm_problems(r) + async_problems(r)
    if r.loss_type not in LOSS_TYPES:
        problems.append(f"loss_type={r.loss_type} is a dpo loss; grpo takes {', '.join(LOSS_TYPES)}")
    defaults = {f.name: f.default for f in fields(GRPOFields)}
    sapo_set = [n for n in ("sapo_temperature_pos", "sapo_temperature_neg") if getattr(r, n) != defaults[n]]
    if sapo_set and r.loss_type != "sapo":
        problems.append(f"{', '.join(sapo_set)} set but loss_type={r.loss_type}; they shape loss_type sapo's gate: "
                        "set loss_type: sapo, or remove them")
    if r.advantage_estimator == "rloo" and r.scale_rewards != defaults["scale_rewards"]:
        problems.append(f"scale_rewards={r.scale_rewards} is GRPO's advantage scaling; advantage_estimator rloo "
                        "scales with normalize_advantages (RLOOConfig's): remove scale_rewards")
    if r.normalize_advantages and r.advantage_estimator != "rloo":
        problems.append("normalize_advantages is RLOOConfig's (advantage_estimator: rloo); GRPO scales its advantages "
                        "with scale_rewards: set advantage_estimator: rloo, or remove normalize_advantages")
    if not r.reward_funcs:
        problems.append("objective grpo needs reward_funcs: a list of pkg.module.func or path/to/file.py:func")
    if r.reward_weights is not None and len(r.reward_weights) != len(r.reward_funcs):
        problems.append(f"reward_weights has {len(r.reward_weights)} weights for {len(r.reward_funcs)} reward_funcs; "
                        "give one per function, or none (all 1)")
    checks = [
        (r.beta >= 0, f"beta must be >= 0 (0 = no reference model), got {r.beta}"),
        (r.num_generations >= 2, f"num_generations must be >= 2 (a group's advantages need two completions), got "
         f"{r.num_generations}"),
        (r.temperature > 0, f"temperature must be > 0, got {r.temperature}"),
        (0 < r.top_p <= 1, f"top_p must be in (0, 1], got {r.top_p}"),
        (r.top_k >= 0, f"top_k must be >= 0 (0 = off), got {r.top_k}"),
        (r.repetition_penalty > 0, f"repetition_penalty must be > 0, got {r.repetition_penalty}"),
        (r.epsilon > 0, f"epsilon must be > 0, got {r.epsilon}"),
        (r.epsilon_high is None or r.epsilon_high > 0, f"epsilon_high must be > 0, got {r.epsilon_high}"),
        (r.sapo_temperature_pos > 0 and r.sapo_temperature_neg > 0, "sapo_temperature_pos and sapo_temperature_neg "
         f"must be > 0 (the gate divides by them), got {r.sapo_temperature_pos} and {r.sapo_temperature_neg}"),
        (r.num_iterations >= 1, f"num_iterations must be >= 1, got {r.num_iterations}"),
        (r.max_completion_length is not None and r.max_completion_length >= 1,
         f"max_completion_length must be >= 1, got {r.max_completion_length}"),
        (r.max_prompt_length is None or r.max_prompt_length >= 1,
         f"max_prompt_length must be >= 1 or unset, got {r.max_prompt_length}"),
        (r.steps_per_generation is None or (r.steps_per_generation >= 1
                                            and r.steps_per_generation % r.gradient_accumulation_steps == 0),
         f"steps_per_generation={r.steps_per_generation} must be a multiple of gradient_accumulation_steps="
         f"{r.gradient_accumulation_steps}: a generation batch then feeds whole optimizer steps"),
        (not r.packing, "packing with objective grpo is refused: each completion is one row; set packing: false"),
        (not r.streaming, "streaming: true with objective grpo is not supported yet: grpo reads its whole prompt set "
         "map-style (each generation window's prompts come from a permutation of all of them, seeded by (seed, "
         "epoch)) and has no streamed reader; set streaming: false"),
        (not (r.use_liger_kernel or r.loss_chunk_tokens), "objective grpo needs per-token log-probs; use_liger_kernel "
         "and loss_chunk_tokens compute one summed cross-entropy: turn them off"),
        (not r.precompute_ref_log_probs, "precompute_ref_log_probs is dpo's and kto's; grpo's reference log-probs "
         "are computed with each generation"),
        (r.label_smoothing == 0, "label_smoothing is a dpo/simpo setting; remove it with objective grpo"),
        (not r.dataset_mixture, "objective grpo reads one dataset_name (with a prompt column); dataset_mixture is not "
         "supported with it yet"),
        (not r.log_completions or "wandb" in r.report_to, "log_completions logs a W&B table: add wandb to report_to, "
         "or remove log_completions (output_dir/rollouts.jsonl has every completion)"),
        (not r.router_aux_loss_coef, "objective grpo does not add a router load-balancing loss yet; remove "
         "router_aux_loss_coef"),
        (r.max_tool_calling_iterations is None or r.max_tool_calling_iterations >= 1,
         f"max_tool_calling_iterations must be >= 1 or unset (no limit), got {r.max_tool_calling_iterations}"),
        (r.max_tool_calling_iterations is None or r.tools or r.environment_factory,
         "max_tool_calling_iterations is set without tools or environment_factory; it limits rounds of tool calls: "
         "add tools, or remove it"),
        (r.tool_call_timeout > 0, f"tool_call_timeout must be > 0 seconds, got {r.tool_call_timeout}"),
    ]
    return problems + [message for ok, message in checks if not ok]
