"""objective grpo (online RL with TRL's GRPO loss): the `Objective` the loop asks by `recipe.objective`. The
pieces live in hftrain/rl/: the loss over fixed rollouts (rl.loss), the reward functions (rl.rewards), the windows
and generation (rl.rollouts), the loss module and the rollout source (rl.grpo)."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable

import torch
from torch import nn

from hftrain.config import Recipe
from hftrain.data.feeds import TrainingData, total_steps
from hftrain.data.sources import hold_out, load_raw, renamed, training_sources
from hftrain.data.streaming import read_states
from hftrain.data.tokenize import prepare_chat_template
from hftrain.errors import HftrainError
from hftrain.loss import ObjectiveLoss
from hftrain.objectives.base import Objective
from hftrain.objectives.reference import AdapterReference, FrozenReference
from hftrain.parallel.fsdp import FSDP2Backend
from hftrain.parallel.launch import main_process_first
from hftrain.parallel.pipeline.backend import PipelineBackend
from hftrain.paths import STREAM_STATE
from hftrain.rl.async_worker import (
    STALL_FLOOR_SECONDS,
    ToolSpec,
    WorkerSpec,
    WorkerStarter,
    queue_windows,
    worker_threads,
)
from hftrain.rl.generation import build_generator
from hftrain.rl.grpo import GRPOLoss, Policy, ReferenceTokenLogProbs, Rollouts, RolloutSource, reference_token_log_probs
from hftrain.rl.images import ProcessorTemplate, PromptImages
from hftrain.rl.rewards import column_problems, load_reward_functions
from hftrain.rl.rollouts import WindowPlan, is_conversational, render_prompts
from hftrain.rl.tools import (
    Tooling,
    environment_methods,
    environment_reward,
    load_environment,
    load_tools,
    template_problems,
)
from hftrain.run_parts import DataRun, ModelRun, TrainRun


def build_token_reference(recipe, lm: nn.Module, device: torch.device,
                          copy_model: Callable[[nn.Module], nn.Module] = copy.deepcopy):
    """beta > 0: dpo's references (hftrain.objectives.reference) reading per-token log-probs: the policy with its
    adapters disabled for LoRA/QLoRA, else a frozen copy of the starting model."""
    if recipe.beta == 0:
        return None
    if hasattr(lm, "disable_adapter"):
        return AdapterReference(lm, reference_token_log_probs(recipe.temperature))
    return FrozenReference(ReferenceTokenLogProbs(copy_model(lm), recipe.temperature), device)


def async_worker_starter(run: ModelRun) -> WorkerStarter:
    """async_generation: how this process starts its rollout worker (hftrain.rl.async_worker) once the weights are
    loaded, given the first window it samples. The worker receives the whole model's weights at each push: every
    process holds them (one process, DDP), or gathers them for the push (ZeRO-3's partitions, FSDP2's shards). With
    tool calling the worker runs the multi-turn loop."""
    recipe, source, backend, lm = run.recipe, run.data.feed, run.backend, run.parts.loss.lm
    sharded = backend.record.zero_stage == 3 or isinstance(backend, FSDP2Backend)
    if isinstance(backend, PipelineBackend) or backend.laid_out or (sharded and hasattr(lm, "peft_config")):
        why = ("the push of a merged LoRA adapter from sharded weights is not written; use full fine-tuning, or DDP"
               if not backend.laid_out and not isinstance(backend, PipelineBackend) else
               "the rollout worker receives the whole model's weights at each push, and this layout splits the "
               "model itself over the processes; use one process, DDP, ZeRO-3 or FSDP2")
        raise HftrainError(f"async_generation under {backend.record.name} is refused: {why}")
    plan = source.plan
    bound = queue_windows(recipe.max_inflight_tasks, recipe.max_staleness, plan.window_size, plan.global_batch)
    tools = None
    if source.tooling is not None:
        tools = ToolSpec(tuple(recipe.tools), recipe.environment_factory, source.tokenizer, source.prompts,
                         recipe.max_prompt_length, recipe.max_completion_length, recipe.max_tool_calling_iterations,
                         recipe.tool_call_timeout, getattr(lm.config, "max_position_embeddings", None))
    spec = WorkerSpec(lm.config, next(lm.parameters()).dtype, [p.ids for p in source.prompts], plan, source.dp.rank,
                      recipe.seed, source.sampling, source.eos_ids, source.pad_id, recipe.temperature,
                      recipe.mask_truncated_completions, 0, run.data.total_steps, recipe.weight_sync_steps,
                      recipe.max_staleness, worker_threads(int(os.environ.get("LOCAL_WORLD_SIZE", "1"))), tools=tools)
    stall = STALL_FLOOR_SECONDS if recipe.hang_timeout is None else recipe.hang_timeout  # 0: off
    return WorkerStarter(spec, lm, bound, stall, backend.gathered)


class GRPO(Objective):
    name = "grpo"
    eval_headline = "eval_reward"
    completes_eval_prompts = False  # its evaluation completes them (eval_rollouts.jsonl); log_completions: rollouts

    def evaluate(self, run: TrainRun) -> dict[str, float]:
        """TRL's GRPO evaluation: the eval prompts completed and scored, no update (`Rollouts.evaluate`)."""
        return run.feed.evaluate(run.data.eval_set, run.progress.step)

    def build_loss(self, recipe: Recipe, lm: nn.Module, device: torch.device,
                   copy_model: Callable[[nn.Module], nn.Module] = copy.deepcopy) -> ObjectiveLoss:
        return GRPOLoss(lm, recipe, build_token_reference(recipe, lm, device, copy_model))

    def setup_data(self, run: DataRun) -> TrainingData:
        """The prompts (a `prompt` column, text or chat messages; the other columns go to the reward functions),
        the reward functions checked against those columns, and the generation windows' plan."""
        recipe, world = run.recipe, run.dp.world
        source = training_sources(recipe)[0]
        with main_process_first(run.accelerator):
            raw = renamed(load_raw(source.name, source.config, source.split), source.columns, source.name)
        problems = []
        if "prompt" not in raw.column_names:
            problems.append(f"dataset {source.name!r} has no prompt column (columns: {', '.join(raw.column_names)}); "
                            "objective grpo samples completions of each row's prompt (text or chat messages); rename "
                            "a column with dataset_columns: {your_column: prompt}")
        funcs, reward_problems = load_reward_functions(recipe.reward_funcs)
        problems += reward_problems
        tools, tool_problems = load_tools(recipe.tools)
        factory, probe, environment_problems = load_environment(recipe.environment_factory)
        problems += tool_problems + environment_problems
        if probe is not None and callable(getattr(probe, "get_reward", None)):
            funcs.append(environment_reward(type(probe)))
        others = [c for c in raw.column_names if c not in ("prompt", "completion", "completion_ids")]
        # reward functions also receive the rollouts' environments (TRL's environments=)
        problems += column_problems(funcs, others + (["environments"] if probe is not None else []))
        eval_raw = None
        if recipe.reads_eval_dataset:  # TRL evaluates on the eval dataset it is given, and holds nothing out
            with main_process_first(run.accelerator):
                eval_raw = renamed(load_raw(recipe.eval_dataset_name, recipe.dataset_config, recipe.eval_split),
                                   recipe.dataset_columns, recipe.eval_dataset_name)
            eval_others = [c for c in eval_raw.column_names if c not in ("prompt", "completion", "completion_ids")]
            if "prompt" not in eval_raw.column_names:
                problems.append(f"eval dataset {recipe.eval_dataset_name!r} has no prompt column (columns: "
                                f"{', '.join(eval_raw.column_names)}); rename one with dataset_columns")
            if set(eval_others) != set(others):
                problems += [f"eval dataset {recipe.eval_dataset_name!r}: {problem}"
                             for problem in column_problems(funcs, eval_others)]
        elif recipe.validation_split_percentage > 0 and recipe.eval_strategy != "no" and "prompt" in raw.column_names:
            raw, eval_raw = hold_out(raw, recipe, source.name)
        steps_per_generation = recipe.steps_per_generation or recipe.gradient_accumulation_steps
        window = recipe.per_device_train_batch_size * world * steps_per_generation
        if window % recipe.num_generations:
            problems.append(f"a generation batch holds per_device_train_batch_size "
                            f"{recipe.per_device_train_batch_size} x {world} processes x steps_per_generation "
                            f"{steps_per_generation} = {window} "
                            f"completions, not whole groups of num_generations={recipe.num_generations}; make it a "
                            "multiple")
        if recipe.max_samples is not None:
            raw = raw.select(range(min(recipe.max_samples, len(raw))))
        if problems:
            raise HftrainError("; ".join(problems))
        chat = any(is_conversational(row) for row in raw["prompt"]) or (
            eval_raw is not None and any(is_conversational(row) for row in eval_raw["prompt"]))
        # an image-text model renders with its processor's chat template
        template_note = prepare_chat_template(run.tokenizer, recipe.chat_template_path, chat) \
            if run.processor is None else None
        tooling = None
        if recipe.tools or recipe.environment_factory:
            # tool calling: chat prompts only (the tools are rendered by the chat template, the calls parsed from the
            # model's turns), and a tokenizer that can render and parse a call (before the model loads)
            problems = []
            if not all(is_conversational(row) for row in raw["prompt"]):
                problems.append(f"dataset {source.name!r} has text prompts; tool calling (tools / environment_factory) "
                                "needs chat prompts (a list of messages), which the chat template renders with the "
                                "tools' schemas and continues after each tool result")
            chat = run.tokenizer if run.processor is None else ProcessorTemplate(run.processor)
            problems += template_problems(chat, tools + ([] if probe is None else environment_methods(probe)),
                                          recipe.model_name_or_path)
            if problems:
                raise HftrainError("; ".join(problems))
            dp = run.dp

            def max_active(n: int) -> int:  # every data-parallel rank calls generate as often as the others
                if run.accelerator.num_processes == 1:
                    return n
                return int(dp.gather(torch.tensor([n], device=run.accelerator.device)).max().item())

            tooling = Tooling(recipe, tools, factory, probe, chat, max_active)
        schema_tools = tooling.schema_tools if tooling is not None else None
        # the eval set: its prompts, rendered as the training ones (grpo evaluates by generating: Objective.evaluate);
        # an image-text model's prompts with images: rendered and encoded by its processor (hftrain.rl.images)
        images = PromptImages(run.processor) if run.processor is not None else None
        if images is None:
            eval_set = render_prompts(eval_raw, run.tokenizer, recipe.max_prompt_length, schema_tools) \
                if eval_raw is not None else None
            prompts = render_prompts(raw, run.tokenizer, recipe.max_prompt_length, schema_tools)
        else:
            eval_set = images.render(eval_raw, recipe.eval_dataset_name or source.name, recipe.max_prompt_length,
                                     schema_tools) if eval_raw is not None else None
            prompts = images.render(raw, source.name, recipe.max_prompt_length, schema_tools)
            # ZeRO-3 and FSDP2 gather the vision tower's weights in its forwards, frozen or not
            sharded = run.backend.record.kind == "fsdp2" or run.backend.record.zero_stage == 3
            if run.dp.world > 1 and (sharded or not (recipe.freeze_vision_tower and recipe.freeze_projector)):
                images.check_every_prompt_has_images(prompts, source.name)
                if eval_set is not None and sharded:
                    images.check_every_prompt_has_images(eval_set, recipe.eval_dataset_name or source.name)
        plan = WindowPlan(len(raw), recipe.num_generations, recipe.per_device_train_batch_size, world,
                              recipe.gradient_accumulation_steps, steps_per_generation, recipe.num_iterations,
                              recipe.order_seed, shuffle=recipe.train_sampling_strategy != "sequential")
        if plan.windows_per_epoch < 1:
            raise HftrainError(f"dataset {source.name!r} has {len(raw)} prompts, fewer than one generation batch's "
                               f"{plan.prompts_per_window} ({window} completions / num_generations); use a "
                               "smaller batch or more prompts")
        rollouts = RolloutSource.read(recipe, plan, prompts, funcs, run.tokenizer, run.accelerator, run.dp,
                                      run.output_dir, run.watchdog.window, tooling, images)
        stream_state = None
        if run.resume_from is not None:  # a checkpoint inside a generation window holds each rank's buffer
            saved = read_states(run.resume_from, STREAM_STATE.format(index="*"))
            if saved and saved[0]["world"] != world:
                raise HftrainError(f"checkpoint {run.resume_from} was saved inside a generation window by "
                                   f"{saved[0]['world']} data-parallel ranks; its buffered rollouts are per "
                                   "data-parallel rank (a process, or a tensor-parallel group): resume with "
                                   f"{saved[0]['world']} of them, or from a checkpoint at the end of a window")
            stream_state = next((state for state in saved if state["rank"] == run.dp.rank), None)
        evaluated = (f"; each evaluation completes {len(eval_set)} eval prompts x {recipe.num_generations} "
                     "(eval_rollouts.jsonl)" if eval_set is not None else "")
        line = (f"({plan.steps_per_epoch} per epoch)",
                f"{len(raw)} prompts, {plan.prompts_per_window} per generation batch{evaluated}")
        lengths = [len(p.ids) for p in prompts]
        stats = {"sources": [{"name": source.name, "prompts": len(raw)}], "chat_template": template_note,
                 "eval_prompts": len(eval_set) if eval_set is not None else 0,
                 "prompt_tokens": {"min": min(lengths), "max": max(lengths), "mean": sum(lengths) / len(lengths)}}
        return TrainingData(rollouts, plan, total_steps(recipe, plan), line, stats, train_set=raw,
                            eval_set=eval_set, rows=prompts, stream_state=stream_state)

    def prepare(self, run: ModelRun):
        reference = run.parts.loss.reference
        if reference is not None and hasattr(reference, "prepare"):
            reference.prepare(run.backend)
        return None

    def feed(self, run: ModelRun) -> Rollouts:
        """The rollouts, built whole from the data phase's `RolloutSource` and the policy they sample from: the
        prepared model, sampled by transformers' generate inside the backend's generation_context (ZeRO-3 gathers
        the weights, FSDP2 generates through the sharded model), or by vLLM, which receives the causal LM's weights
        before each generation batch."""
        source, backend, loss = run.data.feed, run.backend, run.parts.loss
        generator = build_generator(run.recipe, backend, run.model, loss.lm, run.accelerator, source.sampling,
                                    source.eos_ids, source.pad_id)
        config = getattr(loss.lm, "config", None)
        start_worker = async_worker_starter(run) if run.recipe.async_generation else None
        return Rollouts(source, Policy(run.model, loss, generator, backend.whole_sequences, backend.micro_batch,
                                       getattr(config, "max_position_embeddings", None), start_worker))

    @staticmethod
    def sampler(run: TrainRun) -> str:
        r = run.recipe
        if not r.async_generation:
            return run.feed.generator.describe()
        return (f"transformers' generate in a rollout worker process per trainer process (max_staleness "
                f"{r.max_staleness}, weight_sync_steps {r.weight_sync_steps}, importance-sampling correction "
                f"{r.vllm_importance_sampling_mode if r.vllm_importance_sampling_correction else 'off'})")

    @staticmethod
    def tools_note(run: TrainRun) -> str:
        tooling, recipe = run.feed.tooling, run.recipe
        if tooling is None:
            return ""
        rounds = recipe.max_tool_calling_iterations
        return (f", calling tools {tooling.describe()} (up to {'unlimited' if rounds is None else rounds} rounds, "
                f"{recipe.tool_call_timeout:g} s per call; tool results not trained)")

    def notes(self, run: TrainRun) -> list[str]:
        recipe, plan = run.recipe, run.data.plan
        reference = run.parts.loss.reference
        ref = reference.describe() if reference is not None else "none (beta 0)"
        return [f"objective grpo ({recipe.loss_type}, {recipe.importance_sampling_level}-level ratios, epsilon "
                f"{recipe.epsilon:g}/{recipe.epsilon_high if recipe.epsilon_high is not None else recipe.epsilon:g}, "
                f"beta {recipe.beta:g}{' in the reward' if recipe.advantage_estimator == 'rloo' else ''}; advantages: "
                f"{recipe.advantage_estimator}; reference: {ref}); sampled with {self.sampler(run)}"
                f"{self.tools_note(run)}; reward "
                f"functions {', '.join(f.name for f in run.feed.funcs)}; each generation batch: "
                f"{plan.prompts_per_window} prompts x {plan.num_generations} completions, trained for "
                f"{plan.steps_per_window} optimizer step(s); every completion in {run.output_dir / 'rollouts.jsonl'}"]
