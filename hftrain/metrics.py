"""What a training window measured: throughput, step-time split, memory, MFU, device-hours, rank health.

The loop marks phases with `RunMeter.timer.lap(name)` and counts each optimizer step with
`RunMeter.count`; both are host-only (no device sync). At logging steps `RunMeter.window` gathers
one small vector per rank (a single all_gather), turns the window into metrics.jsonl fields and
checks the ranks against each other:

- straggler: each rank's *own* throughput is its processed tokens over the time it spends without
  waiting for other ranks (data wait + forward; backward and the token-count reduce contain the
  collectives in which fast ranks wait for the slowest). A rank below the median of the others by
  more than `straggler_threshold` in two consecutive logging windows is reported (the first window,
  which holds one-time warm-up, does not count). Wall-clock tokens/sec cannot show a straggler: in
  synchronous training every rank runs at the slowest rank's pace.
- desync: step, logged loss, gradient norm and a checksum of the replicated parameters must be
  identical on every rank (sharded parameters, FSDP2 DTensors, are left out of the checksum).

Timers are `time.perf_counter` on CPU and CUDA events on GPU (read back only at logging steps,
so a lap measures the device timeline without synchronising every step).
"""

from __future__ import annotations

import math
import os
import resource
import statistics
import threading
import time
from collections import defaultdict
from collections.abc import Callable

import psutil
import torch
from torch.distributed.tensor import DTensor
from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

from hftrain.compat.deepspeed import whole_numel

# Peak dense (no sparsity) bf16 tensor-core TFLOP/s per device, from the vendors' datasheets. Matched
# in order against torch.cuda.get_device_name(), so more specific names come first.
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("GB200", 2500.0), ("B200", 2250.0), ("B100", 1750.0),
    ("H200", 989.0), ("GH200", 989.0), ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H800", 989.0),
    ("A100", 312.0), ("A800", 312.0), ("A6000", 154.8), ("A40", 149.7), ("A30", 165.0), ("A10G", 70.0),
    ("A10", 125.0), ("L40S", 362.0), ("L40", 181.0), ("L4", 121.0),
    ("RTX 6000 Ada", 364.0), ("RTX 4090", 165.2), ("RTX 3090", 71.0),
    ("MI300X", 1307.0), ("MI250X", 383.0), ("MI250", 362.0),
)
TIMER_PHASES = ("data_wait", "generation", "token_sync", "forward", "backward", "optimizer")
PHASE_WORDS = {"generation": "generation (sampling the completions: use_vllm, a larger generation batch)",
               "data_wait": "data wait (the loader is slower than the device: dataloader_num_workers, pre-tokenized "
               "data)", "token_sync": "the token-count collective (a slow link or a straggling rank)",
               "optimizer": "the optimizer step and its gradient collectives (fused optimizer, bucket sizes, offload)",
               "compute": "the device's own forward and backward (kernels too small to fill it: a larger "
               "per_device_train_batch_size, packing, torch_compile)"}
LOW_UTILIZATION = 80.0  # percent: below this for two windows in a row, a GPU is waiting on something


class UtilizationSampler:
    """Samples a device's utilisation (percent) on a background thread every `interval` seconds; `window_mean()` is
    the mean since the last call (NaN when nothing could be read). `read` is the seam: NVML on CUDA
    (`torch.cuda.utilization`, nvidia-ml-py), this process's share of its allowed CPU cores on CPU."""

    def __init__(self, name: str, read: Callable[[], float] | None, interval: float = 0.5):
        self.name, self.read, self.interval = name, read, interval
        self.samples: list[float] = []
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        if read is not None:
            threading.Thread(target=self._run, daemon=True, name="hftrain-utilization").start()

    def _run(self) -> None:
        while not self.stopped.wait(self.interval):
            try:
                value = float(self.read())
            except Exception:  # noqa: BLE001 - a failed read (driver hiccup) is a missing sample, not a failed run
                continue
            with self.lock:
                self.samples.append(value)

    def window_mean(self) -> float:
        with self.lock:
            samples, self.samples = self.samples, []
        return statistics.fmean(samples) if samples else float("nan")

    def stop(self) -> None:
        self.stopped.set()


def utilization_sampler(device: torch.device, interval: float = 0.5) -> UtilizationSampler:
    """gpu_utilization from NVML on CUDA (None when nvidia-ml-py is missing: the metric is then left out), else
    cpu_utilization: this process's CPU time over the cores it may use, in percent."""
    if device.type == "cuda":
        def read_gpu() -> float:
            return torch.cuda.utilization(device)
        try:
            read_gpu()
        except Exception:  # noqa: BLE001 - pynvml missing or NVML unavailable: no utilisation metric
            return UtilizationSampler("gpu_utilization", None)
        return UtilizationSampler("gpu_utilization", read_gpu, interval)
    process, cores = psutil.Process(), len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        (os.cpu_count() or 1)
    process.cpu_percent(None)  # the first call starts the measurement
    return UtilizationSampler("cpu_utilization", lambda: process.cpu_percent(None) / cores, interval)


def peak_tflops(device: torch.device, override: float | None) -> float | None:
    """Peak bf16 TFLOP/s of one device: the recipe's value, else the table entry for this GPU, else None."""
    if override is not None:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((tflops for key, tflops in PEAK_BF16_TFLOPS if key in name), None)


def current_memory_mb(device: torch.device) -> float:
    """Memory in use now: CUDA allocated on GPU, resident set size of the process on CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 2**20
    return psutil.Process().memory_info().rss / 2**20


def peak_memory_mb(device: torch.device) -> tuple[float, float]:
    """(peak allocated, peak reserved) CUDA memory, or the process's peak RSS twice on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, torch.cuda.max_memory_reserved(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
    return rss, rss


class StepTimer:
    """Cheap phase timers: `lap(name)` adds the time since the previous mark to `name` (and tells `on_lap`, e.g. the
    hang watchdog, that the step moved on)."""

    def __init__(self, device: torch.device, on_lap: Callable[[str], None] | None = None):
        self.cuda = device.type == "cuda"
        self.on_lap = on_lap
        self.totals: dict[str, float] = defaultdict(float)
        self.pending: list[tuple[str, object, object]] = []
        self.last = self._mark()

    def _mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def restart(self) -> None:
        """Start a new step: time since the last lap (logging, evaluation, saving) is not counted."""
        self.last = self._mark()

    def lap(self, name: str) -> None:
        if self.on_lap is not None:
            self.on_lap(name)
        now = self._mark()
        if self.cuda:
            self.pending.append((name, self.last, now))
        else:
            self.totals[name] += now - self.last
        self.last = now

    def move(self, source: str, target: str, seconds: float) -> None:
        """Count `seconds` of what was lapped as `source` as `target` instead: a part of the phase that its owner timed
        itself (grpo's feed samples a generation window inside the loop's wait for micro-batches)."""
        if seconds:
            self.totals[source] -= seconds
            self.totals[target] += seconds

    def collect(self) -> dict[str, float]:
        """Seconds per phase since the last collect (synchronises with the device on GPU)."""
        if self.cuda:
            self.last.synchronize()
            for name, start, end in self.pending:
                self.totals[name] += start.elapsed_time(end) / 1000
            self.pending.clear()
        totals = {name: self.totals.get(name, 0.0) for name in TIMER_PHASES}
        self.totals.clear()
        return totals


EXPERT_COUNT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts")  # the families' config names


def num_experts(model_config) -> int | None:
    """The experts of each MoE layer, from the config (None: not a mixture-of-experts config hftrain knows)."""
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    return next((value for name in EXPERT_COUNT_FIELDS if isinstance(value := getattr(text, name, None), int)), None)


def active_expert_fraction(config) -> float | None:
    """k / experts of a mixture-of-experts config (each token is routed to k experts), None for a dense model."""
    top_k = getattr(config, "num_experts_per_tok", None)
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    return top_k / experts if top_k and experts else None


def parameter_count(param: torch.Tensor) -> int:
    """Elements of the original weight: a bitsandbytes 4-bit parameter packs two or more per stored element, and a
    parameter ZeRO-3 holds partitioned has an empty `.data` (its whole size kept by DeepSpeed)."""
    quant_state = getattr(param, "quant_state", None)
    return quant_state.shape.numel() if quant_state is not None else whole_numel(param)


def stored_bytes(param: torch.Tensor) -> int:
    """Bytes a parameter is stored in (a sharded one at its whole size, a ZeRO-3 partitioned one included): a
    bitsandbytes 4-bit weight's packed elements and its quantization state's scales (an absmax per block; with double
    quantization those in 8 bits and their own fp32 absmax per 256 blocks)."""
    size = whole_numel(param) * param.element_size()
    state = getattr(param, "quant_state", None)
    while state is not None:
        size += state.absmax.numel() * state.absmax.element_size()
        state = state.state2 if state.nested else None
    return size


class FlopCounter:
    """Model FLOPs of training tokens: 6 x params per token plus the attention term (PaLM, appendix B).

    Per processed token: forward 2N, backward 2N for activation gradients plus 2 x trainable N for
    weight gradients, over the matmul parameters N (embeddings excluded, a tied output head
    included). Attention adds 12 x layers x attention width x sequence length (forward QK^T and AV,
    backward twice that). Recomputation under gradient checkpointing is not counted (MFU, not HFU).
    A mixture-of-experts model computes with its active parameters: each token goes through top-k of
    its experts, so expert weights count k / experts of their size (shared experts and the router in full).
    """

    def __init__(self, lm):
        config = lm.config.get_text_config() if hasattr(lm.config, "get_text_config") else lm.config
        out, inp = lm.get_output_embeddings(), lm.get_input_embeddings()
        tied = out is not None and inp is not None and out.weight is inp.weight
        # each parameter at its original size: 4-bit weights unpacked, ZeRO-3's partitioned ones whole
        head = parameter_count(out.weight) if tied else 0
        inactive = 1 - (active_expert_fraction(config) or 1)
        embeddings = {id(m.weight) for m in lm.modules() if isinstance(m, torch.nn.Embedding)}
        matmul = [(name, p) for name, p in lm.named_parameters() if id(p) not in embeddings]
        experts = [p for name, p in matmul if ".experts." in f".{name}"]
        self.matmul_params = sum(parameter_count(p) for _, p in matmul) + head - round(
            inactive * sum(parameter_count(p) for p in experts))
        self.trainable_matmul_params = sum(parameter_count(p) for _, p in matmul if p.requires_grad) + (
            head if tied and out.weight.requires_grad else 0) - round(
            inactive * sum(parameter_count(p) for p in experts if p.requires_grad))
        heads = getattr(config, "num_attention_heads", 0) or 0
        head_dim = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else 0)
        self.layers = getattr(config, "num_hidden_layers", 0) or 0
        self.attention_width = heads * head_dim
        self.per_token = 4 * self.matmul_params + 2 * self.trainable_matmul_params

    def batch(self, batch_size: int, seq_len: int) -> float:
        tokens = batch_size * seq_len
        return tokens * (self.per_token + 12 * self.layers * self.attention_width * seq_len)


def param_checksum(model: torch.nn.Module) -> float:
    """Sum of every replicated parameter (identical on all ranks when gradients are synchronised)."""
    sums = [torch.sum(p.detach(), dtype=torch.float64) for p in model.parameters() if not isinstance(p, DTensor)]
    return float(torch.stack(sums).sum()) if sums else 0.0


class RunMeter:
    """Per-window accounting for the loop; `window()` turns it into metrics at logging steps."""

    # fields of the per-rank vector gathered at logging steps
    FIELDS = ("loss_sum", "loss_units", "trained_tokens", "examples", "processed_tokens", "flops", *TIMER_PHASES,
              "peak_memory_mb", "peak_reserved_mb", "step", "loss", "grad_norm", "param_checksum", "utilization")

    def __init__(self, accelerator, flops: FlopCounter, *, straggler_threshold: float,
                 peak_tflops_override: float | None, cost_per_gpu_hour: float | None, effective_batch_size: int,
                 device_hours_before: float, warn: Callable[[str], None], machines: int = 1,
                 utilization: UtilizationSampler | None = None, sequence_shards: int = 1, model_shards: int = 1,
                 peers: list[list[int]] | None = None, on_lap: Callable[[str], None] | None = None):
        self.accelerator = accelerator
        # ranks that do the same work each step, among which a straggler is sought: all of them, or under pp the
        # ranks of one stage (a stage's copies and tp shards; stages hold unequal layers, embedding and head)
        self.peers = peers if peers is not None else [list(range(accelerator.num_processes))]
        self.shards = sequence_shards  # sequence parallel: each rank processes 1/shards of every micro-batch
        # tensor / pipeline parallel: `model_shards` ranks see every token of a batch and do 1/model_shards of its
        # FLOPs, so the run's totals count each rank's tokens and FLOPs that many times over
        self.model_shards = model_shards
        self.world, self.rank = accelerator.num_processes, accelerator.process_index
        self.flops = flops
        self.timer = StepTimer(accelerator.device, on_lap)
        self.peak = peak_tflops(accelerator.device, peak_tflops_override)
        self.threshold = straggler_threshold
        self.cost_per_hour = cost_per_gpu_hour
        self.effective_batch_size = effective_batch_size
        self.machines = machines  # nodes; ranks are numbered node by node (torchrun, accelerate launch)
        self.hours_before = device_hours_before
        self.started = time.perf_counter()
        self.warn = warn
        self.first_window = True
        self.suspect: int | None = None  # rank below the straggler threshold in the previous window
        self.utilization = utilization if utilization is not None else utilization_sampler(accelerator.device)
        self.low_before = False  # the previous window's minimum GPU utilisation was below LOW_UTILIZATION
        self._reset()

    def _reset(self) -> None:
        self.local_tokens = torch.zeros((), dtype=torch.float64, device=self.accelerator.device)
        self.local_examples = torch.zeros((), dtype=torch.float64, device=self.accelerator.device)
        self.local_units = torch.zeros((), dtype=torch.float64, device=self.accelerator.device)
        self.processed, self.window_flops, self.steps = 0, 0.0, 0

    def count(self, shapes: list[tuple[int, int]], local_tokens: torch.Tensor,
              local_examples: torch.Tensor | int = 0, local_units: torch.Tensor | None = None) -> None:
        """Account one optimizer step (no device sync: shapes are host values, tokens stay on the device).
        `shapes`: (rows, positions) of each forward of the step (the loss's `forward_shapes` of each micro-batch).
        `local_units`: what this rank's loss sum is over (the objective's `loss_units`: tokens, or pairs); tokens
        when not given."""
        self.local_tokens += local_tokens
        self.local_examples += local_examples
        self.local_units += local_tokens if local_units is None else local_units
        for rows, width in shapes:
            self.processed += rows * width / self.shards
            self.window_flops += self.flops.batch(rows, width) / self.shards
        self.steps += 1

    def device_hours(self) -> float:
        """Wall-clock hours of this run (resumed parts included) times the number of devices."""
        return self.hours_before + (time.perf_counter() - self.started) / 3600 * self.world

    def window(self, *, checksum: float, step: int, loss: float | None, grad_norm: float | None,
               local_loss_sum: torch.Tensor,
               global_tokens: int, global_examples: int) -> dict:
        """Metrics of the window since the last call (every rank must call it: it gathers). `checksum`: the backend's
        checksum of the model's replicated parameters (`Backend.param_checksum`), equal on ranks in sync."""
        phases = self.timer.collect()
        peak, reserved = peak_memory_mb(self.accelerator.device)
        values = {"loss_sum": local_loss_sum, "loss_units": self.local_units, "trained_tokens": self.local_tokens,
                  "examples": self.local_examples,
                  "processed_tokens": self.processed,
                  "flops": self.window_flops, **phases, "peak_memory_mb": peak, "peak_reserved_mb": reserved,
                  "step": step, "loss": loss if loss is not None else float("nan"),
                  "grad_norm": grad_norm if grad_norm is not None else float("nan"),
                  "param_checksum": checksum, "utilization": self.utilization.window_mean()}
        mine = torch.stack([torch.as_tensor(values[k], dtype=torch.float64).to(self.accelerator.device).reshape(())
                            for k in self.FIELDS])
        table = self.accelerator.gather(mine.unsqueeze(0)).reshape(self.world, len(self.FIELDS)).cpu().tolist()
        ranks = [dict(zip(self.FIELDS, row, strict=True)) for row in table]
        steps, first = self.steps, self.first_window
        self._reset()
        self.first_window = False
        return self._metrics(ranks, steps, global_tokens, global_examples, first)

    def _metrics(self, ranks: list[dict], steps: int, global_tokens: int, global_examples: int,
                 first: bool = False) -> dict:
        """`first`: the first window after (re)start, whose timings hold one-time warm-up (no straggler warning)."""
        busy = [sum(r[p] for p in TIMER_PHASES) for r in ranks]
        train_time = max(max(busy), 1e-9)  # the window's training time (eval, saving and logging excluded)
        processed = sum(r["processed_tokens"] for r in ranks) / self.model_shards
        row = {
            "tokens_per_second": global_tokens / train_time,
            "total_tokens_per_second": processed / train_time,
            "tokens_per_second_per_device": global_tokens / train_time / self.world,
            "samples_per_second": global_examples / train_time,
            "effective_batch_size": self.effective_batch_size,
            "step_time": train_time / steps,
            "data_wait_time": statistics.fmean(r["data_wait"] for r in ranks) / steps,
            **({"generation_time": statistics.fmean(r["generation"] for r in ranks) / steps}
               if any(r["generation"] for r in ranks) else {}),
            "forward_backward_time": statistics.fmean(r["token_sync"] + r["forward"] + r["backward"]
                                                      for r in ranks) / steps,
            "optimizer_time": statistics.fmean(r["optimizer"] for r in ranks) / steps,
            "peak_memory_mb": round(max(r["peak_memory_mb"] for r in ranks), 1),
        }
        if self.accelerator.device.type == "cuda":
            row["peak_memory_reserved_mb"] = round(max(r["peak_reserved_mb"] for r in ranks), 1)
        achieved = sum(r["flops"] for r in ranks) / self.model_shards / train_time / self.world / 1e12
        row["tflops_per_device"] = achieved
        if self.peak is not None:
            row["mfu"] = achieved / self.peak
        row["device_hours"] = self.device_hours()
        if self.cost_per_hour is not None:
            row["cost"] = row["device_hours"] * self.cost_per_hour
        own = [r["processed_tokens"] / max(r["data_wait"] + r["generation"] + r["forward"], 1e-9) for r in ranks]
        for i, r in enumerate(ranks):
            row[f"rank{i}/tokens_per_second"] = r["trained_tokens"] / train_time
            row[f"rank{i}/own_tokens_per_second"] = own[i]
            row[f"rank{i}/loss"] = r["loss_sum"] / max(r["loss_units"], 1.0)  # per token, or per pair (dpo)
            row[f"rank{i}/peak_memory_mb"] = round(r["peak_memory_mb"], 1)
        row.update(self._utilization(ranks, warn=not first))
        if self.machines > 1:
            row.update(self._per_node(ranks, train_time, global_tokens, global_examples))
        if self.world > 1:
            row.update(self._straggler(own, warn=not first))
            row["ranks_in_sync"] = self._in_sync(ranks)
        return row

    def _utilization(self, ranks: list[dict], warn: bool) -> dict:
        """`<name>` (mean over ranks), `min_<name>` and `rank<i>/<name>`; on GPUs a warning when the minimum stays
        below LOW_UTILIZATION for two windows in a row, naming the phase that dominates that rank's step. CPU
        processes are only reported: under gloo they wait on each other's collectives by design."""
        name, values = self.utilization.name, [r["utilization"] for r in ranks]
        measured = {i: v for i, v in enumerate(values) if not math.isnan(v)}  # a rank may have no sample yet
        if not measured:
            return {}
        i = min(measured, key=measured.get)
        row = {name: statistics.fmean(measured.values()), f"min_{name}": measured[i]}
        row.update({f"rank{r}/{name}": v for r, v in measured.items()})
        low = name == "gpu_utilization" and measured[i] < LOW_UTILIZATION
        if low and self.low_before and warn:
            phases = {p: ranks[i][p] for p in ("data_wait", "generation", "token_sync", "optimizer")}
            phases["compute"] = ranks[i]["forward"] + ranks[i]["backward"]
            worst = max(phases, key=phases.get)
            share = phases[worst] / max(sum(phases.values()), 1e-9)
            self.warn(f"low {name}: rank {i} at {values[i]:.0f}% (below {LOW_UTILIZATION:.0f}% for two logging "
                      f"windows); the largest part of its step is {PHASE_WORDS[worst]}, {share:.0%} of it")
        self.low_before = low
        return row

    def _per_node(self, ranks: list[dict], train_time: float, global_tokens: int, global_examples: int) -> dict:
        """Trained tokens/s and samples/s of each node: its ranks' share of the step's data. Ranks that share their
        data (a tensor-parallel group) count it once: the shares are of the ranks' sum, scaled to the global count."""
        per_node = self.world // self.machines
        row = {}
        for key, total, name in (("trained_tokens", global_tokens, "tokens_per_second"),
                                 ("examples", global_examples, "samples_per_second")):
            ranks_sum = max(sum(r[key] for r in ranks), 1e-9)
            for node in range(self.machines):
                share = sum(r[key] for r in ranks[node * per_node:(node + 1) * per_node]) / ranks_sum
                row[f"node{node}/{name}"] = share * total / train_time
        return row

    def _straggler(self, own: list[float], warn: bool) -> dict:
        """The slowest rank, each rank against the median of its peers (`peers`: ranks doing the same work); a
        warning when the same rank is below the threshold in two windows in a row (one slow window is scheduling
        noise more often than a slow device). Nothing when no rank has a peer (a pipeline of one copy)."""
        ratios = {i: own[i] / max(statistics.median([own[j] for j in group if j != i]), 1e-9)
                  for group in self.peers if len(group) > 1 for i in group}
        if not ratios:
            return {}
        slowest = min(ratios, key=ratios.__getitem__)
        below = warn and ratios[slowest] < 1 - self.threshold
        repeated, self.suspect = below and self.suspect == slowest, slowest if below else None
        if repeated:
            self.warn(f"straggler: rank {slowest} processes {own[slowest]:,.0f} tokens/s of its own time, "
                      f"{1 - ratios[slowest]:.0%} below its peers' median ({own[slowest] / ratios[slowest]:,.0f}"
                      f"); every rank waits for it (straggler_threshold={self.threshold})")
        return {"slowest_rank": slowest, "slowest_rank_ratio": ratios[slowest]}

    def _in_sync(self, ranks: list[dict]) -> bool:
        ok = True
        for key in ("step", "loss", "grad_norm", "param_checksum"):
            values = [r[key] for r in ranks]
            if not all(_same(v, values[0]) for v in values):
                ok = False
                shown = ", ".join(f"rank {i}: {v:.12g}" for i, v in enumerate(values))
                self.warn(f"desync: ranks disagree on {key} ({shown}); the replicas are no longer training the "
                          "same model")
        return ok


def _same(a: float, b: float) -> bool:
    if a != a and b != b:  # both NaN (grad_norm not available)
        return True
    return abs(a - b) <= 1e-9 * max(abs(a), abs(b), 1.0)


class StepProfiler:
    """A torch.profiler trace of optimizer steps [start, start + count) in `folder`, one file per rank.

    The traces (`rank<N>.*.pt.trace.json`) open in TensorBoard's profiler plugin, chrome://tracing
    or Perfetto. `step()` is called once per optimizer step; with `count` 0 everything is a no-op.
    """

    def __init__(self, folder, count: int, start: int, steps_done: int, rank: int, device: torch.device):
        self.profiler = None
        lead_in = start - 1 - steps_done  # steps to run before the first traced one
        if count <= 0 or lead_in + count <= 0:
            return
        active = count + min(lead_in, 0)  # resumed inside the window: trace what is left of it
        warmup = 1 if lead_in >= 1 else 0
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self.profiler = profile(
            activities=activities,
            schedule=schedule(wait=max(lead_in - warmup, 0), warmup=warmup, active=active, repeat=1),
            on_trace_ready=tensorboard_trace_handler(str(folder), worker_name=f"rank{rank}"),
            record_shapes=True, profile_memory=True,
        )
        self.profiler.start()

    def step(self) -> None:
        if self.profiler is not None:
            self.profiler.step()

    def stop(self) -> None:
        if self.profiler is not None:
            self.profiler.stop()
            self.profiler = None
