"""grpo's completions sampled with vLLM in TRL 1.16's colocated mode (`use_vllm: true`), written from
trl/generation/vllm_generation.py (`VLLMGeneration._init_vllm`, `sync_weights`, `generate`, `extract_logprobs`) and
vLLM's `LLM` API as TRL calls it. Not run on a GPU yet (docs/grpo.md says what was tested).

Why not TRL's `VLLMGeneration` itself: it builds one `SamplingParams` for all prompts, so a repeated prompt's
completions differ only through the engine's one RNG stream; hftrain samples each completion from its own seed
(`rollouts.row_seed`: the same completions on any number of processes and after a resume), which vLLM takes as one
`SamplingParams(seed=...)` per request. The rest follows TRL:

- each process runs its own engine (`LLM(..., distributed_executor_backend="external_launcher")`, vLLM joining the
  training's torch.distributed world; tensor-parallel size 1) on its GPU, with vllm_gpu_memory_utilization of its
  memory, logprobs_mode="processed_logprobs" (the log-probs after temperature / top-k / top-p, which the correction
  needs), and sleeps (level 2) between generation windows with vllm_enable_sleep_mode;
- before each window's sampling, the trained weights are pushed into the engine (`load_weights` of vLLM's model,
  under the Hugging Face names: `vllm_weight_name`), a LoRA merged into a copy of its base weight (peft's safe
  merge; TRL merges in place and unmerges), then the prefix cache is reset. Only whole weights on every process
  are pushed (one process, DDP, ZeRO-1/2): ZeRO-3 and FSDP2 are refused by the preflight;
- each completion comes back with vLLM's log-prob of each sampled token (`logprobs=0`), for the importance-sampling
  correction (`rl.loss.vllm_importance_sampling_ratio`).
"""

from __future__ import annotations

import math
import os
import socket

import torch

from hftrain.errors import HftrainError
from hftrain.rl.rollouts import Sampled, Sampling, cut_at_eos


def sampling_params(SamplingParams, seeds: list[int], sampling: Sampling, eos_ids: set[int]) -> list:
    """One `SamplingParams` per request (TRL's colocate settings: n=1, temperature, top_p, top_k (0: all tokens),
    min_p 0, repetition_penalty, max_tokens, logprobs=0: the sampled token's log-prob), each with its completion's
    seed, stopping at the tokenizer's EOS ids as transformers' generate does in hftrain."""
    return [SamplingParams(n=1, seed=seed, temperature=sampling.temperature, top_p=sampling.top_p,
                           top_k=sampling.top_k, min_p=0.0, repetition_penalty=sampling.repetition_penalty,
                           max_tokens=sampling.max_completion_length, logprobs=0, stop_token_ids=sorted(eos_ids))
            for seed in seeds]


def vllm_weight_name(name: str, peft_prefix: str | None = None) -> str | None:
    """The Hugging Face checkpoint name vLLM's `load_weights` reads for a trained parameter `name`, or None for a
    parameter vLLM has no counterpart of (a LoRA factor: merged into its base before the push; peft's copy of a
    modules_to_save module's original). TRL's rules (`_fix_param_name_to_vllm`, `_iter_named_params`), plus torch
    compile's `_orig_mod.` (hftrain's regional torch_compile)."""
    if peft_prefix is not None:
        name = name.removeprefix("base_model.model.").replace(".base_layer", "")
        if peft_prefix in name or "original_module" in name:
            return None
        name = name.replace("modules_to_save.default.", "")
    for wrapper in ("_checkpoint_wrapped_module.", "_orig_mod."):
        name = name.replace(wrapper, "")
    return name


def dense(weight) -> torch.Tensor:
    """A weight's values as a dense tensor: a bitsandbytes 4-bit weight (QLoRA's frozen base) dequantized by
    bitsandbytes' `dequantize_4bit` (what peft's merge and transformers' `dequantize` call), any other as it is."""
    state = getattr(weight, "quant_state", None)
    if state is None:
        return weight.data
    if getattr(state, "packing_format_for_cpu", False):
        raise HftrainError("a 4-bit weight was repacked by bitsandbytes for its CPU inference kernel (it does so in "
                           "place at an eval-mode forward on a CPU with AVX512-BF16, e.g. an evaluation in the "
                           "trainer), and its values can no longer be dequantized for the weight push; run QLoRA with "
                           "async_generation without evaluation on such a CPU, or on a GPU")
    from bitsandbytes.functional import dequantize_4bit  # optional: only with load_in_4bit

    return dequantize_4bit(weight.data, state)


def merged_weight(layer) -> torch.Tensor:
    """A peft LoRA layer's base weight with its active adapters merged in, as a new tensor: peft's own safe merge
    (`LoraLayer.merge(safe_merge=True)`: base + `get_delta_weight`, or the variant's `merge_safe` for DoRA) on a copy,
    so that the trained model's base weights are not touched (TRL merges in place and unmerges after, which leaves
    the rounding of W + BA - BA in the frozen base after every push)."""
    merged = dense(layer.get_base_layer().weight).clone()
    for adapter in layer.active_adapters:
        if adapter not in layer.lora_A:
            continue
        if adapter in layer.lora_variant:
            merged = layer.lora_variant[adapter].merge_safe(layer, adapter, merged)
        else:
            merged += layer.get_delta_weight(adapter).to(merged.dtype)
    return merged


def named_weights(lm):
    """(vLLM name, tensor) of every weight of `lm` (a causal LM or a peft model, whole on this process), a LoRA-adapted
    base weight with its adapter merged in (`merged_weight`), a 4-bit one dequantized (`dense`)."""
    peft_prefix = getattr(lm, "prefix", None) if hasattr(lm, "peft_config") else None
    adapted = {}
    if peft_prefix is not None:
        from peft.tuners.lora import LoraLayer

        adapted = {f"{name}.base_layer.weight": module for name, module in lm.named_modules()
                   if isinstance(module, LoraLayer)}
    for name, param in lm.named_parameters():  # tied weights come once, as vLLM wants
        target = vllm_weight_name(name, peft_prefix)
        if target is not None:
            yield target, merged_weight(adapted[name]) if name in adapted else dense(param)


def completion_logps(logprobs, length: int) -> list[float]:
    """The sampled token's log-prob at each of the first `length` positions of vLLM's `CompletionOutput.logprobs`
    (one {token: Logprob} per position; with logprobs=0 the sampled token's, rank-sorted first as in TRL's
    `extract_logprobs`); NaN where vLLM gave none."""
    if logprobs is None:
        return [math.nan] * length
    values = []
    for position in logprobs[:length]:
        first = min(position.values(), key=lambda item: item.rank) if position else None
        values.append(math.nan if first is None or first.logprob is None else float(first.logprob))
    return values


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class VLLMGenerator:
    """A colocated vLLM engine on this process's GPU (module docstring)."""

    def __init__(self, recipe, lm, accelerator, sampling: Sampling, eos_ids: set[int]):
        from vllm import LLM, SamplingParams

        self.SamplingParams, self.lm, self.sampling, self.eos_ids = SamplingParams, lm, sampling, eos_ids
        self.sleep = recipe.vllm_enable_sleep_mode
        # vLLM's external launcher reads the training's ranks from the environment (accelerate launch sets them; a
        # single process has none); TRL's ensure_master_addr_port
        os.environ["RANK"] = str(accelerator.process_index)
        os.environ["LOCAL_RANK"] = str(accelerator.local_process_index)
        os.environ["WORLD_SIZE"] = str(accelerator.num_processes)
        os.environ["MASTER_ADDR"] = os.environ.get("MASTER_ADDR") or "localhost"
        if os.environ.get("MASTER_PORT", "").strip().lower() in ("", "0", "auto"):
            os.environ["MASTER_PORT"] = str(free_port())
        steps_per_generation = recipe.steps_per_generation or recipe.gradient_accumulation_steps
        self.llm = LLM(
            model=recipe.model_name_or_path,
            revision=recipe.model_revision,
            tensor_parallel_size=1,
            gpu_memory_utilization=recipe.vllm_gpu_memory_utilization,
            max_model_len=recipe.vllm_max_model_length,
            max_num_seqs=recipe.per_device_train_batch_size * steps_per_generation,  # a window's completions
            enable_sleep_mode=self.sleep,
            model_impl=recipe.vllm_model_impl,
            distributed_executor_backend="external_launcher",
            seed=accelerator.process_index,  # the engine's own stream; every request here carries its own seed
            max_num_batched_tokens=4096,  # TRL's: vLLM's memory profiler is misled by its default
            logprobs_mode="processed_logprobs",  # log-probs after temperature / top-k / top-p, as the correction needs
            trust_remote_code=recipe.trust_remote_code,
        )
        if self.sleep:
            self.llm.sleep(level=2)  # level 2 frees the weights: they are pushed again before the first window
        accelerator.wait_for_everyone()  # TRL: engines start at different speeds; keep the processes together

    def sync_weights(self) -> None:
        """Push the trained weights into the engine (every window: a window follows an optimizer step, except the
        first, where the weights may be a resumed checkpoint's or a LoRA's rather than the files vLLM read)."""
        if self.sleep:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            self.llm.wake_up(tags=["weights"])
        model = self.llm.llm_engine.model_executor.driver_worker.model_runner.model
        with torch.no_grad():
            for name, tensor in named_weights(self.lm):
                model.load_weights([(name, tensor)])
        self.llm.reset_prefix_cache()

    def sample(self, prompts: list[list[int]], seeds: list[int]) -> list[Sampled]:
        self.sync_weights()
        if self.sleep:
            self.llm.wake_up(tags=["kv_cache"])
        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts],
                                    sampling_params=sampling_params(self.SamplingParams, seeds, self.sampling,
                                                                    self.eos_ids),
                                    use_tqdm=False)
        if self.sleep:
            self.llm.sleep(level=2)
        sampled = []
        for output in outputs:
            completion = output.outputs[0]
            ids, truncated, length = cut_at_eos(list(completion.token_ids), self.eos_ids)
            sampled.append(Sampled(ids, truncated, completion_logps(completion.logprobs, length)))
        return sampled

    def describe(self) -> str:
        return "vLLM (colocated)"
