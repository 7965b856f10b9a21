"""GPU proof: hftrain's CUDA path measured on one GPU, against plain PyTorch, transformers Trainer and TRL.

    python scripts/gpu_proof.py assemble        # wheels of scripts/gpu_bundle.json -> .gpu-bundle/ (needs PyPI)
    python scripts/gpu_proof.py check           # .gpu-bundle/ = the manifest; repository + bundle fit in 64 MiB
    bash scripts/gpu_proof.sh --parts env,correctness   # on the GPU machine: installs the bundle, then `run`
    python scripts/gpu_proof.py run --dry-run --out /tmp/gpu-proof   # the same orchestration on CPU, tiny model

The GPU machine has no package index and its own torch (2.11.0+cu130): the bundle carries the pinned packages
it lacks or has at other versions, as wheels that scripts/gpu_proof.sh installs into a --target folder on
PYTHONPATH. `run` goes through parts, each a list of checks with a status (pass, FAIL, skip, error), the
numbers measured, the bound they are held to, and the exit status of the process that ran them:

- env: versions, the GPU, and that every carried package imports;
- correctness: one SGD step (lr 1, no clipping) of hftrain's real entry point against the same step in plain
  PyTorch, fp32 and bf16, with and without accumulation; the same with Liger's kernels and with torch.compile;
  packed rows against separate examples with sdpa (and flash attention where flash-attn is installed);
- throughput: scripts/bench.py --size gpu (a 1.24B Llama at max_length 4096, packed chat data) with hftrain's
  recommended GPU setting, transformers Trainer and TRL SFTTrainer (padding and packing): tokens/s, peak CUDA
  memory, MFU, and the issue's targets;
- varlen: attn_implementation varlen (torch's variable-length FlashAttention, hftrain's default for packed rows on
  CUDA in bf16/fp16): packed rows = separate examples (bf16, fp16, grouped key/value heads), fp32 refused, one step
  = plain PyTorch (bf16 with varlen, fp32 with sdpa), then bench.py --size gpu_long: the default against TRL's
  packing and each lever alone (varlen/sdpa, compile, loss chunking, Liger), within --budget: one call of <= 8 min
  with --budget 330;
- memory: `hftrain.estimate` against the peak CUDA memory of 2-step runs, full, LoRA and QLoRA;
- grpo_pp: GRPO on CUDA (1 x 8 completions = 4 x 2 accumulation; a resume inside a generation window = the
  uninterrupted run) and pipeline parallelism's refusal on one process;
- fp8: `fp8: true` refused on a machine without float8 tensor cores (the dry run's CPU); on the GPU, tokens/s and
  peak memory of bf16 against torchao float8 (tensorwise, rowwise) training steps of a 2-layer Llama-3-8B-shaped
  model in the same call, compiled, with the layers hftrain.fp8 chooses, then FSDP2's float8 all-gather on one
  process (the weights hftrain converts for it, the scales its optimizer hook recomputes, against float8 max / max
  |w|) (needs torchao: not in the image, add torchao 0.18.0 to scripts/gpu_bundle.json first).

Each part fits one device call of at most 10 minutes (throughput with its contenders split over two calls,
--contenders); results are rewritten after every check into OUT/gpu_proof.json and OUT/gpu_proof.md, so a call
cut short still returns what it measured. --dry-run runs the same parts on CPU with the tiny model in 1-3
minutes on 2 cores (what needs CUDA is reported as skipped; varlen's CUDA kernel is replaced by
tests/varlen_reference.py's CPU reference, in this process and through tests/launchers/varlen_on_cpu.py).
docs/gpu-proof.md explains how to read the results.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
MANIFEST = REPO / "scripts" / "gpu_bundle.json"
BUNDLE = REPO / ".gpu-bundle"
MIB = 2**20
TINY = REPO / "models" / "tiny-llama"
PARTS = ("env", "correctness", "throughput", "varlen", "memory", "grpo_pp", "fp8")


# ------------------------------------------------------------------------------------------- the bundle
def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def wheel_prefix(name: str, version: str) -> str:
    """The start of a wheel's file name: the distribution name normalised (PEP 427), then the version."""
    return f"{name.replace('-', '_').lower()}-{version}-"


def download(entry: dict, manifest: dict, folder: Path) -> Path:
    """pip download of one wheel for the GPU machine's Python and platform, no dependencies."""
    platforms = [arg for p in manifest["platforms"] for arg in ("--platform", p)]
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", "--python-version",
           manifest["python_version"], "--implementation", "cp", *platforms, "--dest", str(folder),
           f"{entry['name']}=={entry['version']}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    prefix = wheel_prefix(entry["name"], entry["version"])
    found = [p for p in folder.glob("*.whl") if p.name.lower().startswith(prefix)]
    if proc.returncode != 0 or len(found) != 1:
        raise SystemExit(f"gpu_proof: pip could not download {entry['name']}=={entry['version']} for Python "
                         f"{manifest['python_version']} on {manifest['platforms'][0]} (exit {proc.returncode}, "
                         f"{len(found)} matching wheel(s)). Assembling needs the package index; pip said: "
                         f"{proc.stderr.strip()[-800:]}")
    return found[0]


def slim(wheel: Path, keep: list[str], out: Path) -> None:
    """The wheel without the compiled libraries not named in `keep` (and their RECORD lines).

    Written uncompressed with the members' own timestamps, so the result is the same bytes on every machine."""
    def dropped(member: str) -> bool:
        return member.endswith(".so") and Path(member).name not in keep

    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as target:
        for info in source.infolist():
            if dropped(info.filename):
                continue
            data = source.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines(keepends=True)
                data = "".join(line for line in lines if not dropped(line.split(",", 1)[0])).encode()
            copy = zipfile.ZipInfo(info.filename, date_time=info.date_time)
            copy.external_attr, copy.compress_type = info.external_attr, zipfile.ZIP_STORED
            target.writestr(copy, data)


def assemble(bundle: Path, update_manifest: bool = False) -> dict:
    """Download (and slim) every wheel of the manifest into `bundle`, checked against the recorded sha256."""
    manifest = json.loads(MANIFEST.read_text())
    bundle.mkdir(parents=True, exist_ok=True)
    wanted = set()
    with tempfile.TemporaryDirectory() as tmp:
        for entry in manifest["wheels"]:
            original = download(entry, manifest, Path(tmp))
            if not update_manifest and entry.get("pypi_sha256") not in (None, sha256(original)):
                raise SystemExit(f"gpu_proof: {original.name} from the index has sha256 {sha256(original)}, the "
                                 f"manifest records {entry['pypi_sha256']}: the index serves other bytes for this "
                                 "version. Check the release; `assemble --update-manifest` records the new one.")
            target = bundle / original.name
            if entry.get("keep_libraries"):
                slim(original, entry["keep_libraries"], target)
            else:
                target.write_bytes(original.read_bytes())
            if update_manifest:
                entry.update(pypi_sha256=sha256(original), pypi_bytes=original.stat().st_size)
                entry.update(file=target.name, bytes=target.stat().st_size, sha256=sha256(target))
            wanted.add(target.name)
    for stale in bundle.glob("*.whl"):  # two versions of one package would stop the install on the device
        if stale.name not in wanted:
            stale.unlink()
    if update_manifest:
        MANIFEST.write_text(json.dumps(manifest, indent=1) + "\n")
    return check(bundle)


def travelling_bytes() -> int:
    """What the device tool sends besides carried folders: tracked and untracked-not-ignored files."""
    proc = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"gpu_proof: `git ls-files` failed in {REPO} ({proc.stderr.strip()}); the size check counts "
                         "the files of a git checkout, which is what the device tool sends.")
    paths = [REPO / p for p in dict.fromkeys(proc.stdout.split("\0")) if p]
    return sum(p.lstat().st_size for p in paths if p.is_symlink() or p.exists())


def check(bundle: Path) -> dict:
    """The bundle against the manifest, and the size that would travel against the budget."""
    manifest = json.loads(MANIFEST.read_text())
    problems = []
    expected = {e["file"]: e for e in manifest["wheels"] if "file" in e}
    if len(expected) != len(manifest["wheels"]):
        problems.append("the manifest lacks file names and digests: run `assemble --update-manifest`")
    present = {p.name: p for p in bundle.glob("*.whl")} if bundle.is_dir() else {}
    for name, entry in expected.items():
        if name not in present:
            problems.append(f"{name} is missing from {bundle}")
        elif present[name].stat().st_size != entry["bytes"] or sha256(present[name]) != entry["sha256"]:
            problems.append(f"{name} differs from the manifest (size or sha256)")
    problems += [f"{name} is in {bundle} but not in the manifest" for name in present if name not in expected]
    bundle_bytes = sum(p.stat().st_size for p in present.values())
    manifest_bytes = sum(e.get("bytes", 0) for e in manifest["wheels"])
    repo_bytes = travelling_bytes()
    carried = max(bundle_bytes, manifest_bytes)  # an unassembled bundle is counted at the manifest's size
    total = repo_bytes + carried
    if total > manifest["budget_bytes"]:
        problems.append(f"repository ({repo_bytes / MIB:.1f} MiB) + bundle ({carried / MIB:.1f} MiB) = "
                        f"{total / MIB:.1f} MiB, over the device's {manifest['budget_bytes'] / MIB:.0f} MiB")
    return {"bundle": str(bundle), "wheels": len(present), "bundle_bytes": bundle_bytes,
            "manifest_bytes": manifest_bytes, "repo_bytes": repo_bytes, "total_bytes": total,
            "budget_bytes": manifest["budget_bytes"], "problems": problems}


# ------------------------------------------------------------------------------------------ the report
@dataclass
class Check:
    part: str
    name: str
    status: str  # pass | FAIL | skip | error | info
    measured: str = ""
    bound: str = ""
    exit: int | None = None  # of the process that ran it, where one did
    seconds: float = 0.0
    detail: str = ""
    numbers: dict = field(default_factory=dict)


class Report:
    """Every check so far, rewritten to OUT after each one (a call cut short still returns what it measured)."""

    def __init__(self, out: Path, meta: dict):
        self.out, self.meta, self.checks = out, meta, []
        out.mkdir(parents=True, exist_ok=True)

    def add(self, check: Check) -> Check:
        self.checks.append(check)
        print(f"gpu_proof: [{check.part}] {check.name}: {check.status} {check.measured} {check.bound}".rstrip(),
              flush=True)
        self.write()
        return check

    def write(self) -> None:
        data = {**self.meta, "finished": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                "checks": [asdict(c) for c in self.checks]}
        (self.out / "gpu_proof.json").write_text(json.dumps(data, indent=1) + "\n")
        (self.out / "gpu_proof.md").write_text(self.markdown())

    def markdown(self) -> str:
        m = self.meta
        lines = [f"# GPU proof{' (dry run on CPU)' if m['dry_run'] else ''}", "",
                 f"Command: `{m['command']}`  ", f"Started: {m['started']}; device: {m['device']}  ",
                 "Versions: " + ", ".join(f"{k} {v}" for k, v in m["versions"].items()), "",
                 "| part | check | status | measured | bound | exit | s | detail |",
                 "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for c in self.checks:
            detail = c.detail.replace("|", "/").replace("\n", " ")[:300]
            lines.append(f"| {c.part} | {c.name} | {c.status} | {c.measured} | {c.bound} | "
                         f"{'' if c.exit is None else c.exit} | {c.seconds:.0f} | {detail} |")
        counts = {s: sum(c.status == s for c in self.checks) for s in ("pass", "FAIL", "error", "skip")}
        lines += ["", "Totals: " + ", ".join(f"{n} {s}" for s, n in counts.items())]
        return "\n".join(lines) + "\n"


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    found = {"python": platform.python_version()}
    for name in ("torch", "transformers", "accelerate", "datasets", "peft", "trl", "tokenizers", "liger-kernel",
                 "bitsandbytes", "flash-attn", "huggingface-hub", "safetensors", "fsspec", "pyarrow", "triton"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


# ------------------------------------------------------------------------------------------ running
@dataclass(frozen=True)
class Mode:
    dry_run: bool
    work: Path
    timeout: int  # seconds for one hftrain run
    bench_timeout: int  # seconds for scripts/bench.py (every contender)
    contenders: list[str] | None = None  # throughput: None = the default list for the mode

    @property
    def cuda(self) -> bool:
        return not self.dry_run


def child_env(extra: dict | None = None) -> dict:
    path = os.pathsep.join([str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    return {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled",
            "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1", **(extra or {})}


def hftrain_run(mode: Mode, name: str, *args: str, env: dict | None = None, overwrite: bool = True,
                script: Path | None = None) -> tuple[int, Path, str]:
    """`python -m hftrain.finetune` (the real entry point, one process): (exit status, output_dir, stderr tail).
    `overwrite` False keeps what output_dir holds (a resume); `script`: a test launcher in its place (the dry run's
    stand-in for a CUDA-only kernel)."""
    out = mode.work / "runs" / name
    entry = ["-m", "hftrain.finetune"] if script is None else [str(script)]
    cmd = [sys.executable, *entry, "--output_dir", str(out), "--disable_tqdm", "true",
           "--report_to", "none", *(["--overwrite_output_dir", "true"] if overwrite else []), *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=child_env(env),
                              timeout=mode.timeout)
    except subprocess.TimeoutExpired:
        return 124, out, f"timed out after {mode.timeout} s"
    return proc.returncode, out, proc.stderr[-1500:]


def timed(report: Report, part: str, name: str, fn) -> None:
    """Run one check; an exception becomes an `error` row (the next checks still run)."""
    start = time.time()
    try:
        check = fn()
    except Exception as exc:  # noqa: BLE001 - one broken check must not hide the others' numbers
        check = Check(part, name, "error", detail=f"{type(exc).__name__}: {exc}"[:1500])
    check.part, check.name, check.seconds = part, name, time.time() - start
    report.add(check)


# ------------------------------------------------------------------------------------------ part: env
def part_env(report: Report, mode: Mode) -> None:
    def device() -> Check:
        import torch

        if not torch.cuda.is_available():
            return Check("", "", "skip" if mode.dry_run else "FAIL", measured="no CUDA device",
                         detail=f"torch {torch.__version__}")
        props = torch.cuda.get_device_properties(0)
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True)
        return Check("", "", "pass", measured=f"{props.name}, {props.total_memory / 2**30:.0f} GiB",
                     detail=f"torch {torch.__version__} CUDA {torch.version.cuda}; nvidia-smi: {smi.stdout.strip()}",
                     numbers={"name": props.name, "memory_gib": props.total_memory / 2**30,
                              "sm_count": props.multi_processor_count, "bf16": torch.cuda.is_bf16_supported()})

    def imports() -> Check:
        """Each module imported in a child with the runs' environment (what the hftrain runs will see)."""
        modules = ["hftrain.finetune", "transformers", "datasets", "peft", "trl", "liger_kernel", "bitsandbytes"]
        if mode.dry_run:  # the CUDA-only packages are optional on a CPU machine
            modules = [m for m in modules if m not in ("liger_kernel", "bitsandbytes") or importlib.util.find_spec(m)]
        probe = ("import importlib, json, sys\nfailed = {}\nfor m in sys.argv[1:]:\n    try:\n"
                 "        importlib.import_module(m)\n    except Exception as e:\n"
                 "        failed[m] = f'{type(e).__name__}: {e}'[:300]\nprint(json.dumps(failed))")
        proc = subprocess.run([sys.executable, "-c", probe, *modules], capture_output=True, text=True,
                              env=child_env(), cwd=REPO)
        failed = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else {"probe": proc.stderr}
        return Check("", "", "FAIL" if failed else "pass", measured=f"{len(modules) - len(failed)}/{len(modules)}",
                     exit=proc.returncode, detail="; ".join(f"{m}: {e}" for m, e in failed.items()))

    timed(report, "env", "CUDA device", device)
    timed(report, "env", "carried packages import", imports)


# ----------------------------------------------------------------------------------- part: correctness
N_EXAMPLES = 8
# worst |hftrain step - plain step| / max |gradient| over tensors. On CPU (dry run, tiny model) the exact runs gave
# 8e-5 (fp32) and 5e-3 (bf16); the naive accumulation 8e-2 in both: each bound sits between the two
TOLERANCE = {"fp32": 1e-3, "bf16": 2e-2, "fp16": 2e-2}
AUTOCAST = {"bf16": "bfloat16", "fp16": "float16"}


def texts() -> list[str]:
    lines = (REPO / "data" / "text.jsonl").read_text().splitlines()[:N_EXAMPLES]
    return [json.loads(line)["text"] for line in lines]


def plain_step(model_dir: Path, device: str, precision: str, micro: int = N_EXAMPLES) -> tuple[dict, dict]:
    """(weights before, gradient) of the mean token loss of all examples, in plain PyTorch with the HF model.

    micro < N_EXAMPLES: the naive accumulation (each micro-batch's mean, averaged), a different gradient that the
    tolerance must be able to tell apart."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    before = {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}
    rows = [tokenizer(t)["input_ids"] + [tokenizer.eos_token_id] for t in texts()]
    for start in range(0, N_EXAMPLES, micro):
        part = rows[start:start + micro]
        width = max(map(len, part))
        input_ids = torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r in part], device=device)
        attention_mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in part], device=device)
        labels = input_ids.masked_fill(attention_mask == 0, -100)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        (loss * micro / N_EXAMPLES).backward()
    return before, {n: p.grad.detach().float().cpu() for n, p in model.named_parameters()}


def step_error(before: dict, after: dict, grads: dict) -> tuple[float, str]:
    """Worst over tensors of max |(before - after) - gradient| / max |gradient|: with SGD at lr 1 and no clipping,
    before - after is the gradient the run applied."""
    worst, where = 0.0, ""
    for name, grad in grads.items():
        applied = before[name] - after[name].float()
        err = float((applied - grad).abs().max() / grad.abs().max().clamp_min(1e-12))
        if err > worst:
            worst, where = err, name
    return worst, where


def sgd_args(data: Path, batch: int, accum: int, precision: str) -> list[str]:
    return ["--model_name_or_path", str(TINY), "--dataset_name", str(data), "--validation_split_percentage", "0",
            "--max_steps", "1", "--optim", "sgd", "--learning_rate", "1.0",
            "--lr_scheduler_type", "constant", "--max_grad_norm", "0", "--weight_decay", "0",
            "--train_sampling_strategy", "sequential", "--per_device_train_batch_size", str(batch),
            "--gradient_accumulation_steps", str(accum), "--bf16", str(precision == "bf16").lower(),
            "--logging_steps", "1"]


def step_check(mode: Mode, name: str, data: Path, precision: str, batch: int, accum: int,
               reference: tuple[dict, dict], *extra: str, script: Path | None = None) -> Check:
    """One SGD step of `hftrain_run` over the 8 examples of `data` against plain PyTorch's (`reference`: weights
    before, gradient), within TOLERANCE; the run's attention (hftrain_state.json) in the detail and numbers."""
    from safetensors.torch import load_file

    before, grads = reference
    code, out, stderr = hftrain_run(mode, name, *sgd_args(data, batch, accum, precision), *extra, script=script)
    if code != 0:
        return Check("", "", "FAIL", exit=code, detail=stderr)
    err, where = step_error(before, load_file(out / "final" / "model.safetensors"), grads)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    loss = next(r["loss"] for r in rows if "loss" in r)
    attention = json.loads((out / "final" / "hftrain_state.json").read_text())["model"].get("attention")
    tol = TOLERANCE[precision]
    return Check("", "", "pass" if err <= tol else "FAIL", measured=f"{err:.2e}", bound=f"<= {tol:.0e}",
                 exit=code, detail=f"worst tensor {where}; step-1 loss {loss:.6f}; attention {attention}",
                 numbers={"error": err, "loss": loss, "attention": attention})


def text8(mode: Mode) -> Path:
    """The 8 examples of the plain step, in its order, as a data file."""
    data = mode.work / "text8.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts()))
    return data


def part_correctness(report: Report, mode: Mode) -> None:
    device = "cuda" if mode.cuda else "cpu"
    data = text8(mode)
    references = {}

    def reference(precision: str) -> tuple[dict, dict]:
        if precision not in references:
            references[precision] = plain_step(TINY, device, precision)
        return references[precision]

    losses = {}

    def exactness(name: str, precision: str, batch: int, accum: int, *extra: str) -> Check:
        check = step_check(mode, name, data, precision, batch, accum, reference(precision), *extra)
        if "loss" in check.numbers:
            losses[name] = check.numbers["loss"]
        return check

    def sharpness(precision: str) -> Check:
        """The tolerance tells the exact step from the naive accumulation (mean per micro-batch of 2)."""
        before, grads = reference(precision)
        _, naive = plain_step(TINY, device, precision, micro=2)
        err, _ = step_error(before, {n: before[n] - g for n, g in naive.items()}, grads)
        tol = TOLERANCE[precision]
        return Check("", "", "pass" if err > tol else "FAIL", measured=f"{err:.2e}", bound=f"> {tol:.0e}",
                     detail="naive accumulation vs the exact step: must exceed the tolerance",
                     numbers={"error": err})

    def liger_loss(name: str, plain: str, precision: str) -> Check:
        if name not in losses or plain not in losses:
            return Check("", "", "skip", detail="a run it compares failed or was skipped")
        rel = abs(losses[name] - losses[plain]) / abs(losses[plain])
        tol = {"fp32": 1e-5, "bf16": 1e-2}[precision]
        return Check("", "", "pass" if rel <= tol else "FAIL", measured=f"{rel:.2e}", bound=f"<= {tol:.0e}",
                     detail=f"step-1 loss {losses[name]:.6f} with Liger, {losses[plain]:.6f} without",
                     numbers={"relative_difference": rel})

    def needs_cuda(fn):
        return fn if mode.cuda else lambda: Check("", "", "skip", detail="needs CUDA (dry run on CPU)")

    for precision in ("fp32", "bf16"):
        timed(report, "correctness", f"tolerance {precision} is sharp", lambda p=precision: sharpness(p))
        for batch, accum in ((2, 4),) if mode.dry_run else ((8, 1), (2, 4)):
            name = f"exact-{precision}-{batch}x{accum}"
            timed(report, "correctness", f"one step = plain PyTorch, {precision}, {batch}x{accum}",
                  lambda n=name, p=precision, b=batch, a=accum: exactness(n, p, b, a))
    for precision in ("fp32", "bf16"):
        name = f"liger-{precision}-2x4"
        timed(report, "correctness", f"Liger: one step = plain PyTorch, {precision}, 2x4",
              needs_cuda(lambda n=name, p=precision: exactness(n, p, 2, 4, "--use_liger_kernel", "true")))
        timed(report, "correctness", f"Liger on/off: step-1 loss, {precision}",
              needs_cuda(lambda n=name, p=precision: liger_loss(n, f"exact-{p}-2x4", p)))
    timed(report, "correctness", "torch.compile: one step = plain PyTorch, fp32, 2x4",
          needs_cuda(lambda: exactness("compile-fp32-2x4", "fp32", 2, 4, "--torch_compile", "true")))
    timed(report, "correctness", "torch.compile: one step = plain PyTorch, bf16, 2x4",
          needs_cuda(lambda: exactness("compile-bf16-2x4", "bf16", 2, 4, "--torch_compile", "true")))
    for attn in ("sdpa", "flash_attention_2"):
        for precision in ("fp32", "bf16"):
            timed(report, "correctness", f"packed rows = separate examples, {attn}, {precision}",
                  lambda a=attn, p=precision: packed_check(device, a, p, small=mode.dry_run))


def packed_check(device: str, attn: str, precision: str, small: bool = False) -> Check:
    """Loss and gradient of two packed rows (3 + 2 examples, position_ids restarting) through hftrain's
    CausalLMTokenLoss, against each example on its own, on a random Llama with 4 layers (`small`: rows of 60
    tokens and a 1,000-token vocabulary, for the dry run on CPU). varlen gets the documents' boundaries as hftrain's
    collator gives them (data.batching.document_boundaries)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from hftrain.data.batching import document_boundaries
    from hftrain.objectives.sft import CausalLMTokenLoss

    if attn == "flash_attention_2":
        if device != "cuda" or importlib.util.find_spec("flash_attn") is None:
            return Check("", "", "skip", detail="flash-attn is not installed: PyPI has only its source, which "
                                                "compiles against the installed torch and CUDA (no wheel to carry)")
        if precision == "fp32":
            return Check("", "", "skip", detail="flash attention computes in 16 bits only")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1000 if small else 32000, hidden_size=256, intermediate_size=688,
                         num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=1024, pad_token_id=0, tie_word_embeddings=False,
                         attn_implementation=attn)
    model = LlamaForCausalLM(config).to(device).train()
    g = torch.Generator().manual_seed(3)
    rows = [(30, 12, 9), (40, 10)] if small else [(300, 120, 90), (400, 100)]
    width = 64 if small else 512
    input_ids = torch.zeros((2, width), dtype=torch.long)
    labels = torch.full((2, width), -100)
    position_ids = torch.zeros((2, width), dtype=torch.long)
    examples = []
    for r, lengths in enumerate(rows):
        offset = 0
        for n in lengths:
            ids = torch.randint(3, config.vocab_size, (n,), generator=g)
            input_ids[r, offset:offset + n], labels[r, offset + 1:offset + n] = ids, ids[1:]
            position_ids[r, offset:offset + n] = torch.arange(n)
            examples.append(ids)
            offset += n
        position_ids[r, offset:] = torch.arange(width - offset)
    documents = {}
    if attn == "varlen":
        documents = document_boundaries([[(range(n), None) for n in lengths] for lengths in rows], width)
        documents = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in documents.items()}

    def loss_and_grads(fn) -> tuple[float, dict]:
        model.zero_grad(set_to_none=True)
        dtype = getattr(torch, AUTOCAST.get(precision, "bfloat16"))
        with torch.autocast(device, dtype=dtype, enabled=precision in AUTOCAST):
            loss = fn()
        loss.backward()
        return loss.item(), {n: p.grad.float().cpu() for n, p in model.named_parameters()}

    wrapped = CausalLMTokenLoss(model)
    packed, packed_grads = loss_and_grads(lambda: wrapped(input_ids.to(device), labels.to(device),
                                                          position_ids=position_ids.to(device), **documents))
    separate, separate_grads = loss_and_grads(lambda: sum(
        wrapped(ids[None].to(device), torch.cat([torch.tensor([-100]), ids[1:]])[None].to(device))
        for ids in examples))
    rel = abs(packed - separate) / abs(separate)
    grad_err, where = step_error({n: torch.zeros_like(t) for n, t in separate_grads.items()},
                                 {n: -t for n, t in packed_grads.items()}, separate_grads)
    tol = TOLERANCE[precision]
    ok = rel <= tol and grad_err <= tol * 10  # gradients of attention weights pass through more rounding
    return Check("", "", "pass" if ok else "FAIL", measured=f"loss {rel:.1e}, grad {grad_err:.1e}",
                 bound=f"loss <= {tol:.0e}, grad <= {tol * 10:.0e}", detail=f"worst gradient {where}",
                 numbers={"loss_relative": rel, "grad_error": grad_err})


# ------------------------------------------------------------------------------------ part: throughput
GPU_CONTENDERS = ["hftrain_gpu", "hftrain_gpu_compile", "trainer", "trl_padding", "trl_packing"]
DRY_CONTENDERS = ["hftrain_packed", "trl_packing"]  # the dry run: CPU-runnable stand-ins, tiny model
TARGETS = {"mfu": 0.40, "vs_trl": 1.3}


def keep_failed_logs(row: dict, dest: Path, lines: int = 200) -> str:
    """Copy the end of a failed contender's logs next to the report (the bench's working folder stays on the device
    machine and is lost with it); return their last lines for the check's detail."""
    text = "".join(f"== {log}\n" + "\n".join(Path(log).read_text(errors="replace").splitlines()[-lines:]) + "\n"
                   for log in row.get("failed_logs", []) if Path(log).exists())
    dest.write_text(text or "no log was kept\n")
    return " / ".join(text.splitlines()[-6:])[-1200:]


def run_bench(report: Report, mode: Mode, part: str, size: str, names: list[str], folder: str, *extra: str) -> dict:
    """scripts/bench.py with `names` at `size` into report.out/`folder` (one check: every contender ran, a failed one's
    log kept beside the report), then one info row per contender that ran, naming the attention, compile and loss path
    hftrain's runs said at start-up. Returns bench.py's report ({} when it wrote none)."""
    out = report.out / folder
    cmd = [sys.executable, str(REPO / "scripts" / "bench.py"), "--size", size, "--contenders", ",".join(names),
           "--reps", "1", "--no-warmup", "--out", str(out), "--work", str(mode.work / folder), *extra]
    state = {}

    def bench() -> Check:
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=child_env(),
                                  timeout=mode.bench_timeout)
        except subprocess.TimeoutExpired as exc:
            state["code"] = 124
            return Check("", "", "FAIL", exit=124, detail=f"bench.py ran past {mode.bench_timeout} s: name fewer "
                         f"contenders per call (--contenders); its last output: {str(exc.stdout)[-800:]}")
        state["code"] = proc.returncode
        if not (out / "benchmarks.json").exists():
            return Check("", "", "FAIL", exit=proc.returncode, detail=(proc.stdout + proc.stderr)[-1500:])
        state["report"] = json.loads((out / "benchmarks.json").read_text())
        results, skipped = state["report"]["results"], state["report"].get("skipped", [])
        failed = [n for n, r in results.items() if "tokens_per_second" not in r]
        tails = {n: keep_failed_logs(results[n], out / f"failed-{n}.log") for n in failed}
        return Check("", "", "FAIL" if proc.returncode or failed else "pass", exit=proc.returncode,
                     measured=f"{len(results) - len(failed)}/{len(names)} contenders ran",
                     detail=f"{state['report']['model_parameters']:,} parameters, max_length "
                            f"{state['report']['data']['max_length']}; failed: {', '.join(failed) or 'none'}"
                            + (f"; not run (past the budget): {', '.join(skipped)}" if skipped else "")
                            + f"; tables in {folder}/benchmarks.md"
                            + "".join(f"; {n}'s log ends: {t}" for n, t in tails.items()))

    timed(report, part, f"scripts/bench.py --size {size} --contenders {','.join(names)}", bench)
    bench_report = state.get("report", {})
    logs = {r["contender"]: r["log"] for r in bench_report.get("runs", []) if r.get("ok")}
    memory_key = "peak_rss_mb" if mode.dry_run else "peak_cuda_mb"
    for name, row in bench_report.get("results", {}).items():
        if "tokens_per_second" in row:
            said = attention_line(logs[name]) if name in logs and name.startswith("hftrain") else row["label"]
            mfu = f", MFU {row['mfu']:.1%}" if "mfu" in row else ""
            report.add(Check(part, name, "info", measured=f"{row['tokens_per_second']:,.0f} tokens/s, "
                             f"{row.get(memory_key, 0):,.0f} MB{mfu}, first step {row['time_to_first_step_s']:.1f} s",
                             exit=state["code"], detail=said,
                             numbers={k: row.get(k) for k in ("tokens_per_second", "peak_cuda_mb", "peak_rss_mb",
                                                              "mfu", "time_to_first_step_s", "steps",
                                                              "trained_tokens")}))
    return bench_report


def attention_line(log: str) -> str:
    """The start-up line naming a run's attention, compile and loss path, from its log."""
    text = Path(log).read_text(errors="replace").splitlines() if Path(log).exists() else []
    said = [line for line in text if line.startswith("hftrain: attention")]
    return said[0].removeprefix("hftrain: ") if said else "no start-up line"


def part_throughput(report: Report, mode: Mode) -> None:
    names = mode.contenders or (DRY_CONTENDERS if mode.dry_run else GPU_CONTENDERS)
    results = run_bench(report, mode, "throughput", "quick" if mode.dry_run else "gpu", names, "bench").get(
        "results", {})
    memory_key = "peak_rss_mb" if mode.dry_run else "peak_cuda_mb"
    ours = names[0]
    trl = [n for n in names if n.startswith("trl") and "tokens_per_second" in results.get(n, {})]

    def mfu() -> Check:
        if mode.dry_run or ours not in results:
            return Check("", "", "skip", detail="MFU is measured on CUDA only" if mode.dry_run else
                         f"{ours} is not among this call's contenders")
        value = results.get(ours, {}).get("mfu")
        if value is None:
            return Check("", "", "FAIL", detail=f"{ours} logged no MFU (failed, or an unknown GPU peak)")
        return Check("", "", "pass" if value >= TARGETS["mfu"] else "FAIL", measured=f"{value:.1%}",
                     bound=f">= {TARGETS['mfu']:.0%}")

    def versus_trl() -> Check:
        if ours not in names or not any(n.startswith("trl") for n in names):
            return Check("", "", "skip", detail=f"needs {ours} and a TRL contender in the same call")
        if "tokens_per_second" not in results.get(ours, {}) or not trl:
            return Check("", "", "FAIL", detail="hftrain or every TRL contender failed")
        best = max(trl, key=lambda n: results[n]["tokens_per_second"])
        ratio = results[ours]["tokens_per_second"] / results[best]["tokens_per_second"]
        memory = results[ours].get(memory_key, 0) / max(results[best].get(memory_key, 0), 1e-9)
        ok = ratio >= TARGETS["vs_trl"] and memory <= 1.0
        return Check("", "", "info" if mode.dry_run else "pass" if ok else "FAIL",
                     measured=f"{ratio:.2f}x tokens/s, {memory:.2f}x memory",
                     bound=f">= {TARGETS['vs_trl']}x, <= 1.00x", detail=f"against {best}, TRL's faster setting" +
                     (" (dry run: peak RSS, tiny model; not judged)" if mode.dry_run else ""),
                     numbers={"tokens_ratio": ratio, "memory_ratio": memory, "trl": best})

    timed(report, "throughput", f"MFU of {ours}, 1B full bf16", mfu)
    timed(report, "throughput", f"{ours} against TRL's best", versus_trl)


# ---------------------------------------------------------------------------------------- part: varlen
LAUNCHER = REPO / "tests" / "launchers" / "varlen_on_cpu.py"  # the dry run's stand-in for torch's CUDA-only kernel
# hftrain's GPU default (varlen for packed bf16 rows), then TRL's packing, then one lever each, in the order they are
# dropped when the call's time runs out (bench.py --budget): the last first
VARLEN_CONTENDERS = ["hftrain_gpu_noliger", "trl_packing", "hftrain_gpu_sdpa", "hftrain_gpu_compile",
                     "hftrain_gpu_chunked", "hftrain_gpu"]
DRY_VARLEN_CONTENDERS = ["hftrain_packed", "hftrain_gpu_sdpa"]  # the dry run: the orchestration, tiny model, fp32
LEVERS = {  # lever contender: what it changes against hftrain's default
    "hftrain_gpu_sdpa": "varlen -> sdpa's block-diagonal mask",
    "hftrain_gpu_compile": "torch_compile off -> on",
    "hftrain_gpu_chunked": "full fp32 logits of the trained tokens -> loss_chunk_tokens 8192",
    "hftrain_gpu": "-> Liger's kernels and fused linear cross-entropy",
}


def reference_kernel_in_place():
    """The dry run: tests/varlen_reference.py's per-document sdpa stands in for torch's CUDA-only kernel in this
    process (as tests/launchers/varlen_on_cpu.py does in the hftrain runs)."""
    import hftrain.attention
    from tests.varlen_reference import reference_kernel

    kernel = reference_kernel(gqa=True)
    hftrain.attention.varlen_kernel = lambda: kernel


def part_varlen(report: Report, mode: Mode) -> None:
    """attn_implementation varlen (torch's variable-length FlashAttention for packed rows, hftrain's default on CUDA in
    bf16): packed rows = separate examples (bf16, fp16; grouped key/value heads), fp32 refused, one step = plain
    PyTorch through hftrain's entry point (bf16 with varlen, fp32 with sdpa), then bench.py: the default against TRL's
    packing at gpu_long and each lever alone, within the call's time (--budget)."""
    device = "cuda" if mode.cuda else "cpu"
    script = None if mode.cuda else LAUNCHER
    stand_in = "" if mode.cuda else " (dry run: tests/varlen_reference.py stands in for torch's CUDA-only kernel)"
    if mode.dry_run:
        reference_kernel_in_place()
    for precision in ("bf16", "fp16"):
        if mode.dry_run and precision == "fp16":
            timed(report, "varlen", "packed rows = separate examples, varlen, fp16",
                  lambda: Check("", "", "skip", detail="fp16 autocast needs CUDA (dry run on CPU)"))
            continue
        timed(report, "varlen", f"packed rows = separate examples, varlen, {precision}",
              lambda p=precision: packed_check(device, "varlen", p, small=mode.dry_run))
    data = text8(mode)
    packed = ["--packing", "true", "--max_length", "96"]  # the 8 examples pack into 4 rows: 2 x 2 is one step

    def fp32_refused() -> Check:
        code, out, err = hftrain_run(mode, "varlen-fp32", *sgd_args(data, 2, 2, "fp32"), *packed,
                                     "--attn_implementation", "varlen", script=script)
        said = " ".join(err.split())
        ok = code == 2 and "computes in bf16 or fp16 only" in said and "Traceback" not in err
        return Check("", "", "pass" if ok else "FAIL", measured=f"exit {code}", bound="exit 2, one paragraph",
                     exit=code, detail=said[-500:])

    def one_step(precision: str, expected: str) -> Check:
        check = step_check(mode, f"varlen-step-{precision}", data, precision, 2, 2,
                           plain_step(TINY, device, precision), *packed, script=script)
        if check.status == "pass" and check.numbers.get("attention") != expected:
            check.status = "FAIL"
        check.bound += f"; attention {expected}"
        check.detail += stand_in
        return check

    timed(report, "varlen", "fp32 with varlen: refused by the preflight", fp32_refused)
    timed(report, "varlen", "one step = plain PyTorch, packed 2x2, bf16 (varlen chosen)",
          lambda: one_step("bf16", "varlen"))
    timed(report, "varlen", "one step = plain PyTorch, packed 2x2, fp32 (sdpa kept)", (lambda: one_step("fp32", "sdpa"))
          if mode.cuda else lambda: Check("", "", "skip", detail="on CPU the automatic choice keeps sdpa for want of "
                                                                  "CUDA, whatever the precision (dry run)"))
    levers_bench(report, mode)


def levers_bench(report: Report, mode: Mode) -> None:
    """bench.py --size gpu_long: hftrain's default against TRL's packing, then each lever alone, stopping before a run
    that would not end within the call (bench.py --budget); the default against TRL is the issue's target."""
    names = mode.contenders or (DRY_VARLEN_CONTENDERS if mode.dry_run else VARLEN_CONTENDERS)
    results = run_bench(report, mode, "varlen", "quick" if mode.dry_run else "gpu_long", names, "bench-varlen",
                        "--budget", str(max(mode.bench_timeout - 30, 60))).get("results", {})
    memory_key = "peak_rss_mb" if mode.dry_run else "peak_cuda_mb"
    ours = names[0]

    def versus(first: str, other: str, what: str, judged: bool = False) -> Check:
        """`first` against `other`: tokens/s, memory and first-step ratios; `judged`: the issue's target."""
        if "tokens_per_second" not in results.get(first, {}) or "tokens_per_second" not in results.get(other, {}):
            return Check("", "", "skip", detail=f"{first} or {other} did not run (failed, or past the budget)")
        a, b = results[first], results[other]
        speed, memory = a["tokens_per_second"] / b["tokens_per_second"], a.get(memory_key, 0) / max(b.get(memory_key,
                                                                                                          0), 1e-9)
        later = a["time_to_first_step_s"] - b["time_to_first_step_s"]
        ok = speed >= TARGETS["vs_trl"] and memory <= 1.0
        return Check("", "", ("pass" if ok else "FAIL") if judged and mode.cuda else "info",
                     measured=f"{first} / {other}: {speed:.2f}x tokens/s, {memory:.2f}x memory, first step "
                              f"{later:+.1f} s", bound=f">= {TARGETS['vs_trl']}x, <= 1.00x" if judged else "",
                     detail=what + (" (dry run: tiny model on CPU, not judged)" if mode.dry_run else ""),
                     numbers={"tokens_ratio": speed, "memory_ratio": memory, "first_step_difference_s": later})

    if mode.cuda or "trl_packing" in names:
        timed(report, "varlen", f"{ours} (hftrain's default) against TRL's packing",
              lambda: versus(ours, "trl_packing", "the issue's target", judged=True))
    for lever, what in LEVERS.items():
        if lever in names:
            timed(report, "varlen", f"lever: {what}",
                  lambda lever=lever: versus(ours, lever, f"{ours} against {lever}"))
    if "hftrain_gpu_chunked" in names and "hftrain_gpu" in names:
        timed(report, "varlen", "lever: loss chunking against Liger",
              lambda: versus("hftrain_gpu_chunked", "hftrain_gpu", "loss_chunk_tokens 8192 against Liger's fused "
                             "linear cross-entropy"))


# ---------------------------------------------------------------------------------------- part: memory
def part_memory(report: Report, mode: Mode) -> None:
    from hftrain.estimate import estimate, model_shape

    model, data = mode.work / "memory-model", mode.work / "memory-rows.jsonl"
    batch, seq = (1, 256) if mode.dry_run else (1, 4096)
    state = {}

    def setup() -> Check:
        if mode.dry_run:
            state["model"] = TINY
        else:
            spec = importlib.util.spec_from_file_location("bench", REPO / "scripts" / "bench.py")
            bench = importlib.util.module_from_spec(spec)
            sys.modules["bench"] = bench  # its dataclasses look their module up while the class is made
            spec.loader.exec_module(bench)
            if not (model / "config.json").exists():
                bench.build_model(bench.GPU, model)
            state["model"] = model
        words = [json.loads(line)["text"] for line in (REPO / "data" / "text.jsonl").read_text().splitlines()]
        per_row = seq // 3 + 50  # every row is longer than seq tokens: each micro-batch is exactly batch x seq
        with data.open("w") as f:
            for i in range(16):
                f.write(json.dumps({"text": " ".join(words[(i + j) % len(words)] for j in range(per_row))}) + "\n")
        shape = model_shape(str(state["model"]))
        state["shape"] = shape
        return Check("", "", "info", measured=f"{shape.params:,} parameters", detail=f"batch {batch} x {seq} tokens")

    timed(report, "memory", "model and rows", setup)
    if "shape" not in state:
        return
    plan = estimate(state["shape"], 1, batch, seq, precision="bf16")
    # the estimate's model of LoRA: a bf16 frozen base (fp32 adapters); QLoRA: NF4 base, bf16 compute
    method_args = {"full": [], "lora": ["--use_peft", "true", "--dtype", "bfloat16"],
                   "qlora": ["--use_peft", "true", "--dtype", "bfloat16", "--load_in_4bit", "true"]}
    if mode.dry_run:  # one method: the loop is the same, and the tiny model's numbers judge nothing
        method_args = {"full": []}
    for method, extra in method_args.items():
        def measure(method=method, extra=extra) -> Check:
            (row,) = [r for r in plan.rows if r.method == method and r.strategy.endswith(("single GPU", "GPU)"))]
            code, out, stderr = hftrain_run(
                mode, f"memory-{method}", "--model_name_or_path", str(state["model"]), "--dataset_name", str(data),
                "--max_steps", "2", "--logging_steps", "1", "--per_device_train_batch_size", str(batch),
                "--max_length", str(seq), "--validation_split_percentage", "0", "--bf16", "true",
                "--dataloader_num_workers", "0", *extra, env={"MALLOC_MMAP_THRESHOLD_": "65536"})
            if code != 0:
                return Check("", "", "FAIL", exit=code, detail=stderr)
            rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            peak = max(r["peak_memory_mb"] for r in rows if "loss" in r)
            baseline = 0.0 if mode.cuda else json.loads((out / "final" / "hftrain_state.json").read_text()
                                                        )["memory_baseline_mb"]  # CPU: RSS before the model
            measured, estimated = peak - baseline, row.peak(False) / MIB
            ratio = estimated / measured
            judged = "pass" if 0.75 <= ratio <= 1.25 else "FAIL"
            return Check("", "", "info" if mode.dry_run else judged,
                         measured=f"estimate {estimated:,.0f} MiB / measured {measured:,.0f} MiB = {ratio:.2f}",
                         bound="0.75-1.25", exit=code, detail=row.strategy + ("" if mode.cuda else
                         " (dry run: peak RSS - baseline of a 0.2M-parameter model, not judged)"),
                         numbers={"estimated_mib": estimated, "measured_mib": measured, "ratio": ratio})
        timed(report, "memory", f"estimate vs measured peak, {method}", measure)


# ---------------------------------------------------------------------------------------- part: grpo_pp
GRPO = ["--model_name_or_path", str(TINY), "--dataset_name", str(REPO / "data" / "prompt_completion.jsonl"),
        "--objective", "grpo", "--reward_funcs", "hftrain.rl.example_rewards.vowel_share", "--num_generations", "4",
        "--max_completion_length", "6", "--max_steps", "3", "--optim", "sgd", "--learning_rate", "1.0",
        "--weight_decay", "0", "--lr_scheduler_type", "constant", "--max_grad_norm", "1.0", "--eval_strategy", "no",
        "--logging_steps", "1", "--seed", "3", "--num_iterations", "2", "--beta", "0.5"]
# tests/e2e/test_grpo.py's settings: step 1 trains the first generation window on-policy, step 2 the same rollouts
# against the stored old log-probs and the frozen reference, step 3 samples a new window


def part_grpo_pp(report: Report, mode: Mode) -> None:
    """GRPO on CUDA (generation with per-completion seeded sampling, the reference, num_iterations 2): accumulation
    gives the same training as one micro-batch, and a resume inside a generation window gives the uninterrupted
    run's rollouts and weights; and the pipeline-parallel refusal on one process (pp needs a process per stage)."""
    from safetensors.torch import load_file

    runs = {}

    def grpo(name: str, *extra: str) -> tuple[int, Path, str]:
        if name not in runs:
            runs[name] = hftrain_run(mode, f"grpo-{name}", *GRPO, *extra)
        return runs[name]

    def rows(out: Path) -> list[dict]:
        return [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]

    def train_rows(out: Path) -> list[dict]:
        return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]

    def worst(a: Path, b: Path) -> float:
        wa, wb = load_file(a / "final" / "model.safetensors"), load_file(b / "final" / "model.safetensors")
        return max((wa[n].float() - wb[n].float()).abs().max().item() for n in wa)

    def one_batch() -> tuple[int, Path, str]:  # 1 x 8 completions, a checkpoint inside the first window
        return grpo("1x8", "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "1",
                    "--save_strategy", "steps", "--save_steps", "1", "--checkpoint_preflight", "false")

    def accumulation() -> Check:
        code, a, err = one_batch()
        if code != 0:
            return Check("", "", "FAIL", exit=code, detail=err)
        code, b, err = grpo("4x2", "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "4",
                            "--save_strategy", "no")
        if code != 0:
            return Check("", "", "FAIL", exit=code, detail=err)
        same_rollouts = rows(a) == rows(b)
        losses = [(x["loss"], y["loss"]) for x, y in zip(train_rows(a), train_rows(b))]
        loss_err = max(abs(x - y) for x, y in losses)
        weight_err = worst(a, b)
        ok = same_rollouts and len(losses) == 3 and loss_err <= 1e-5 and weight_err <= 1e-4
        return Check("", "", "pass" if ok else "FAIL", measured=f"rollouts equal: {same_rollouts}; loss "
                     f"{loss_err:.1e}, weights {weight_err:.1e}", bound="equal; <= 1e-5; <= 1e-4", exit=code,
                     detail=f"{len(rows(a))} completions; losses {[round(x, 6) for x, _ in losses]}",
                     numbers={"loss_error": loss_err, "weight_error": weight_err, "rollouts_equal": same_rollouts})

    def resume() -> Check:
        code, a, err = one_batch()
        if code != 0:
            return Check("", "", "FAIL", exit=code, detail=err)
        b = mode.work / "runs" / "grpo-resumed"
        shutil.rmtree(b, ignore_errors=True)
        b.mkdir(parents=True)
        shutil.copytree(a / "checkpoint-1", b / "checkpoint-1")  # what a SIGTERM after step 1 leaves
        first = [r for r in rows(a) if r["step"] == 1]
        (b / "rollouts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in first))
        code, _, err = hftrain_run(mode, b.name, *GRPO, "--per_device_train_batch_size", "8",
                                   "--gradient_accumulation_steps", "1", "--resume_from_checkpoint", "latest",
                                   overwrite=False)
        if code != 0:
            return Check("", "", "FAIL", exit=code, detail=err)
        same_rollouts = rows(a) == rows(b)
        weight_err = worst(a, b)
        ok = same_rollouts and weight_err <= 1e-5
        return Check("", "", "pass" if ok else "FAIL", measured=f"rollouts equal: {same_rollouts}; weights "
                     f"{weight_err:.1e}", bound="equal; <= 1e-5", exit=code,
                     detail=f"resumed from checkpoint-1 (inside the first window of num_iterations 2); "
                            f"{len(first)} of {len(rows(a))} rows before the stop",
                     numbers={"weight_error": weight_err, "rollouts_equal": same_rollouts})

    def pp_refusal() -> Check:
        start = time.time()
        code, out, err = hftrain_run(mode, "pp-one-process", "--pp_size", "2", "--max_steps", "1")
        said = " ".join(err.split())
        ok = (code == 2 and "pp_size=2 does not divide" in said and "Traceback" not in err
              and not (out / "final").exists())
        return Check("", "", "pass" if ok else "FAIL", measured=f"exit {code} after {time.time() - start:.0f} s",
                     bound="exit 2, one paragraph, nothing written", exit=code, detail=said[-400:])

    covered = "covered on CPU by tests/e2e/test_grpo.py; the dry run checks the orchestration of the other parts"
    skip_on_cpu = (lambda fn: fn) if mode.cuda else (lambda fn: lambda: Check("", "", "skip", detail=covered))
    timed(report, "grpo_pp", "GRPO: 1x8 = 4x2 accumulation (rollouts, loss, weights)", skip_on_cpu(accumulation))
    timed(report, "grpo_pp", "GRPO: resume inside a generation window = uninterrupted", skip_on_cpu(resume))
    timed(report, "grpo_pp", "pp_size 2 on one process: refused before loading", pp_refusal)


# ------------------------------------------------------------------------------------------------- main


# ------------------------------------------------------------------------------------------ part: fp8
FP8_SHAPE = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 2,
             "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 4096}


def fp8_steps(precision: str, batch: int = 4, length: int = 2048, warmup: int = 3, steps: int = 10) -> dict:
    """Training steps (bf16 autocast, AdamW, torch.compile) of a random FP8_SHAPE Llama, in bf16 or with hftrain's
    float8 layers (`precision`: bf16, tensorwise, rowwise): tokens/s over `steps` after `warmup`, peak CUDA memory."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from hftrain import fp8
    from hftrain.config import Recipe

    torch.manual_seed(0)
    torch.cuda.reset_peak_memory_stats()
    model = LlamaForCausalLM(LlamaConfig(**FP8_SHAPE)).cuda()
    note = "bf16 autocast"
    if precision != "bf16":
        note = fp8.convert(model, Recipe(fp8=True, fp8_recipe=precision, bf16=True))
    model = torch.compile(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    ids = torch.randint(0, FP8_SHAPE["vocab_size"], (batch, length), device="cuda")
    for i in range(warmup + steps):
        if i == warmup:
            torch.cuda.synchronize()
            start = time.time()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    seconds = time.time() - start
    result = {"tokens_per_second": batch * length * steps / seconds, "peak_cuda_mb": torch.cuda.max_memory_allocated()
              / MIB, "loss": loss.item(), "layers": note}
    del model, optimizer
    torch.cuda.empty_cache()
    return result


def fsdp2_float8_all_gather(steps: int = 3, batch: int = 2, length: int = 1024) -> dict:
    """One-process FSDP2 (nccl) over a FP8_SHAPE Llama converted as hftrain converts it under FSDP2 (tensorwise, the
    float8 all-gather on: `fp8.convert(..., all_gather=True)`), each decoder layer and the root sharded, the scales
    recomputed by hftrain's optimizer hook (`fp8.precompute_scales_after_step`): a few AdamW steps; after them every
    float8-gathered weight's scale against float8 max / max |w| of its updated weight."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor
    from transformers import LlamaConfig, LlamaForCausalLM

    from hftrain import fp8
    from hftrain.config import Recipe

    store = tempfile.mkdtemp(prefix="fp8-fsdp2-")
    dist.init_process_group("nccl", init_method=f"file://{store}/store", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**FP8_SHAPE)).cuda()
        note = fp8.convert(model, Recipe(fp8=True, fp8_recipe="tensorwise", bf16=True), all_gather=True)
        mesh = init_device_mesh("cuda", (1,))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
        fp8.precompute_scales_after_step(optimizer, model)
        ids = torch.randint(0, FP8_SHAPE["vocab_size"], (batch, length), device="cuda")
        torch.cuda.synchronize()
        start = time.time()
        for _ in range(steps):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        seconds = time.time() - start
        worst, gathered = 0.0, 0
        for module in model.modules():
            local = getattr(getattr(module, "weight", None), "_local_tensor", None)
            if isinstance(local, WeightWithDynamicFloat8CastTensor):
                gathered += 1
                expected = torch.finfo(torch.float8_e4m3fn).max / module.weight.full_tensor().abs().max().double()
                worst = max(worst, abs(float(local._precomputed_scale) / float(expected) - 1))
        return {"loss": loss.item(), "gathered_in_float8": gathered, "worst_scale_rel_error": worst,
                "tokens_per_second": batch * length * steps / seconds, "layers": note}
    finally:
        dist.destroy_process_group()


def part_fp8(report: Report, mode: Mode) -> None:
    """fp8: the refusal where float8 cannot run, then (CUDA, compute capability >= 8.9) bf16 against float8."""
    data = text8(mode)

    def refused() -> Check:
        code, out, err = hftrain_run(mode, "fp8-refused", *sgd_args(data, 2, 2, "bf16"), "--fp8", "true")
        said = " ".join(err.split())
        ok = code == 2 and "fp8 needs a" in said and "Traceback" not in err
        return Check("", "", "pass" if ok else "FAIL", measured=f"exit {code}", bound="exit 2, one paragraph",
                     exit=code, detail=said[-500:])

    if not mode.cuda:
        timed(report, "fp8", "fp8 refused without float8 tensor cores (CPU)", refused)
        timed(report, "fp8", "bf16 against float8: tokens/s and memory",
              lambda: Check("", "", "skip", detail="float8 matmuls need CUDA with compute capability >= 8.9 (dry run "
                                                   "on CPU)"))
        return
    import torch

    if torch.cuda.get_device_capability() < (8, 9):
        timed(report, "fp8", "fp8 refused below compute capability 8.9", refused)
        return
    if importlib.util.find_spec("torchao") is None:
        timed(report, "fp8", "bf16 against float8: tokens/s and memory",
              lambda: Check("", "", "skip", detail="torchao is not installed: add torchao 0.18.0 to "
                                                   "scripts/gpu_bundle.json (python scripts/gpu_proof.py assemble)"))
        return
    measured = {}
    for precision in ("bf16", "tensorwise", "rowwise"):
        def one(p=precision) -> Check:
            measured[p] = fp8_steps(p)
            row = measured[p]
            return Check("", "", "info", measured=f"{row['tokens_per_second']:,.0f} tokens/s, "
                         f"{row['peak_cuda_mb']:,.0f} MB", detail=f"{row['layers']}; loss {row['loss']:.3f}",
                         numbers=row)
        timed(report, "fp8", f"{precision}: 2-layer Llama-3-8B shape, 4 x 2048 tokens, compiled", one)
    for precision in ("tensorwise", "rowwise"):
        def versus(p=precision) -> Check:
            if p not in measured or "bf16" not in measured:
                return Check("", "", "skip", detail=f"{p} or bf16 did not run")
            speed = measured[p]["tokens_per_second"] / measured["bf16"]["tokens_per_second"]
            memory = measured[p]["peak_cuda_mb"] / measured["bf16"]["peak_cuda_mb"]
            return Check("", "", "info", measured=f"{speed:.2f}x tokens/s, {memory:.2f}x memory",
                         detail="torchtitan reports float8 ~1.2-1.3x over compiled bf16 on H100 at larger shapes",
                         numbers={"tokens_ratio": speed, "memory_ratio": memory})
        timed(report, "fp8", f"{precision} against bf16", versus)

    def all_gather() -> Check:
        row = fsdp2_float8_all_gather()
        ok = row["gathered_in_float8"] == 10 and row["worst_scale_rel_error"] < 1e-6 and math.isfinite(row["loss"])
        return Check("", "", "pass" if ok else "FAIL", measured=f"{row['gathered_in_float8']} weights gathered in "
                     f"float8, scales within {row['worst_scale_rel_error']:.1e}, loss {row['loss']:.3f}",
                     bound="the 10 float8 layers (q o gate up down x 2), scales = float8 max / max |w|",
                     detail=row["layers"], numbers=row)
    timed(report, "fp8", "FSDP2 float8 all-gather (one process): scales recomputed after each step", all_gather)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    a = sub.add_parser("assemble", help="download the manifest's wheels into the bundle folder (needs PyPI)")
    a.add_argument("--bundle", type=Path, default=BUNDLE)
    a.add_argument("--update-manifest", action="store_true", help="record the downloaded files' sizes and sha256")
    c = sub.add_parser("check", help="the bundle matches the manifest and fits the device's size limit")
    c.add_argument("--bundle", type=Path, default=BUNDLE)
    r = sub.add_parser("run", help="run parts on the GPU (or on CPU with --dry-run)")
    r.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    r.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or REPO / "outputs" / "gpu-proof"))
    r.add_argument("--work", type=Path, help="scratch folder (default: a new temporary one)")
    r.add_argument("--dry-run", action="store_true", help="on CPU with the tiny model: checks the orchestration")
    r.add_argument("--contenders", help="throughput: scripts/bench.py contenders (default: "
                   f"{','.join(GPU_CONTENDERS)}; dry run {','.join(DRY_CONTENDERS)})")
    r.add_argument("--budget", type=int, default=540, help="seconds scripts/bench.py may take (default 540: one "
                   "device call is limited to 600)")
    args = parser.parse_args(argv)

    if args.command in ("assemble", "check"):
        result = assemble(args.bundle, args.update_manifest) if args.command == "assemble" else check(args.bundle)
        print(f"gpu_proof: {result['wheels']} wheels, {result['bundle_bytes'] / MIB:.1f} MiB in {result['bundle']}; "
              f"with the repository {result['total_bytes'] / MIB:.1f} MiB of {result['budget_bytes'] / MIB:.0f} MiB")
        if result["problems"]:
            print("gpu_proof: " + "; ".join(result["problems"]), file=sys.stderr)
            sys.exit(1)
        return

    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if unknown := [p for p in parts if p not in PARTS]:
        parser.error(f"unknown part(s) {unknown}; choose from {', '.join(PARTS)}")
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_proof: no CUDA device is visible to torch, and `run` measures the CUDA path; on a machine without "
              "a GPU use `run --dry-run`, which runs the same parts on CPU with the tiny model.", file=sys.stderr)
        sys.exit(2)
    work = args.work or Path(tempfile.mkdtemp(prefix="gpu-proof-"))
    work.mkdir(parents=True, exist_ok=True)
    mode = Mode(dry_run=args.dry_run, work=work, timeout=180 if args.dry_run else 420, bench_timeout=args.budget,
                contenders=[n.strip() for n in args.contenders.split(",")] if args.contenders else None)
    meta = {"command": "scripts/gpu_proof.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "dry_run": args.dry_run, "parts": parts,
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() and not args.dry_run else "CPU",
            "versions": versions(), "work": str(work)}
    report = Report(args.out, meta)
    runners = {"env": part_env, "correctness": part_correctness, "throughput": part_throughput, "varlen": part_varlen,
               "memory": part_memory, "grpo_pp": part_grpo_pp, "fp8": part_fp8}
    for part in parts:
        runners[part](report, mode)
        if torch.cuda.is_available():  # the next part's child processes get the GPU memory this one cached
            torch.cuda.empty_cache()
    failed = [c for c in report.checks if c.status in ("FAIL", "error")]
    print(report.markdown())
    print(f"gpu_proof: wrote {args.out / 'gpu_proof.md'} and gpu_proof.json; {len(failed)} check(s) failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
