"""`hftrain env`: the versions in use, whether each is inside the range hftrain is tested on, and which features
that need a newer library (or an optional one) are available here; paste its output into a bug report.

    hftrain env            # = python -m hftrain.versions
    hftrain env --json

The tested range of a package runs from its floor in pyproject.toml (the lower end CI tests, constraints/lower.txt)
to the newer of the version the whole suite runs on (constraints/lock.txt) and the newest end `make test-newest` tests
(constraints/newest.txt); tests/unit/test_versions.py keeps TESTED equal to those files. A feature that needs a newer
library is refused by its own check (the preflight's) in one paragraph naming the version that brings it:
`feature_problem(name)`.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import json
import platform
import sys
from collections.abc import Callable
from dataclasses import dataclass

from packaging.version import Version

import hftrain
from hftrain.options import Parser, add_switch

# package -> (the lower end CI tests, the newest version tested: the lock's, or `make test-newest`'s where newer);
# torch's floor is 2.11 (the lent GPU image's), CI's lower end runs 2.13.0, the only CPU build on its machine
TESTED: dict[str, tuple[str, str]] = {
    "torch": ("2.11", "2.14.1"),
    "transformers": ("5.17.0", "5.25.0"),
    "tokenizers": ("0.23.2", "0.23.3"),
    "accelerate": ("1.15.0", "1.16.0"),
    "huggingface-hub": ("1.33.0", "2.4.0"),
    "datasets": ("5.0.0", "5.2.0"),
    "peft": ("0.20.0", "0.21.2"),
    "safetensors": ("0.8.0", "0.8.0"),
    "deepspeed": ("0.19.8", "0.19.8"),
    "bitsandbytes": ("0.50.2", "0.50.2"),
    "wandb": ("0.31.0", "0.31.0"),
}
OPTIONAL = ("trl", "torchvision", "vllm", "liger-kernel", "flash-attn", "mlflow-skinny")  # shown when installed


def installed(package: str) -> str | None:
    try:
        return md.version(package)
    except md.PackageNotFoundError:
        return None


def _release(version: str) -> Version:
    """The public part of a version (2.13.0+cpu -> 2.13.0)."""
    return Version(Version(version).public)


def placement(package: str, version: str | None) -> str:
    """Where `version` lies against TESTED: 'in range', 'OLDER than tested', 'newer than tested', 'not installed'."""
    if version is None:
        return "not installed"
    low, high = TESTED[package]
    v = _release(version)
    if v < Version(low):
        return "OLDER than tested: unsupported"
    if v > Version(high):
        return "newer than tested"
    return "in range"


@dataclass(frozen=True)
class Feature:
    name: str  # what the user asks for, as a recipe or the docs name it
    package: str
    minimum: str | None  # the version of `package` that brings it; None: the package's presence is enough
    brings: str  # what that version (or package) adds that the feature uses
    present: Callable[[], bool] = lambda: True  # for minimum=None: whether it can be used here


def _has(module: str) -> Callable[[], bool]:
    return lambda: importlib.util.find_spec(module) is not None


FEATURES = {
    "tensor_parallel": Feature(
        "tensor parallelism (tp_size > 1)", "transformers", "5.23.0",
        "DistributedConfig's dp_replicate_size, with which hftrain keeps tensor-parallel copies on transformers' "
        "device mesh, and shards of uneven size (the vocabulary of a head that tp_size does not divide, 5.21)"),
    "expert_parallel": Feature(
        "expert parallelism (ep_size > 1)", "transformers", "5.23.0",
        "DistributedConfig's ep_implementation 'all_to_all', whose token exchanges have a backward (5.19 brought "
        "ep_size, but its dispatch exchanged tokens without gradients, so it could not train; hftrain checked 5.23)"),
    "qwen_vl": Feature(
        "Qwen2-VL, Qwen2.5-VL, Qwen3-VL (image-text families whose processor has a video processor)", "torchvision",
        None,
        "the video-processor base class that transformers defines only with torchvision", _has("torchvision")),
    "vllm": Feature("use_vllm (colocated vLLM generation, CUDA)", "vllm", None, "vLLM; pip install 'hftrain[vllm]'",
                    _has("vllm")),
    "liger": Feature("use_liger_kernel (CUDA)", "liger-kernel", None, "Liger's Triton kernels; pip install "
                     "'hftrain[cuda]'", _has("liger_kernel")),
    "flash_attention": Feature("attn_implementation: flash_attention_2 (CUDA)", "flash-attn", None,
                               "the flash-attn kernels; pip install flash-attn --no-build-isolation",
                               _has("flash_attn")),
}


def available(key: str) -> bool:
    feature = FEATURES[key]
    if feature.minimum is None:
        return feature.present()
    version = installed(feature.package)
    return version is not None and _release(version) >= Version(feature.minimum)


def feature_problem(key: str) -> str | None:
    """One paragraph saying why feature `key` cannot run with the installed libraries, naming the version that brings
    it; None where it can."""
    if available(key):
        return None
    feature = FEATURES[key]
    if feature.minimum is None:
        return f"{feature.name} needs {feature.package}, which is not installed ({feature.brings})"
    return (f"{feature.name} needs {feature.package} >= {feature.minimum}, which brings {feature.brings}; this "
            f"environment has {feature.package} {installed(feature.package)}: pip install "
            f"'{feature.package}>={feature.minimum}'")


def needs(key: str) -> str:
    feature = FEATURES[key]
    return feature.package + (f" >= {feature.minimum}" if feature.minimum else "")


def report() -> dict:
    packages = {name: {"version": installed(name), "tested": "{} .. {}".format(*TESTED[name]),
                       "status": placement(name, installed(name))} for name in TESTED}
    optional = {name: installed(name) for name in OPTIONAL if installed(name) is not None}
    features = {key: {"name": FEATURES[key].name, "available": available(key), "needs": needs(key),
                      "why_not": feature_problem(key)} for key in FEATURES}
    return {"hftrain": hftrain.__version__, "python": platform.python_version(),
            "platform": f"{platform.system()} {platform.machine()}", "packages": packages, "optional": optional,
            "features": features}


def render(info: dict) -> str:
    lines = [f"hftrain {info['hftrain']}, Python {info['python']}, {info['platform']}", "",
             "package            installed       tested (lower end .. newest end)"]
    for name, entry in info["packages"].items():
        lines.append(f"{name:18} {entry['version'] or '-':15} {entry['tested']:18} {entry['status']}")
    if info["optional"]:
        lines += ["", "optional: " + ", ".join(f"{name} {version}" for name, version in info["optional"].items())]
    lines += ["", "features (yes: available here; no: what it needs)"]
    for entry in info["features"].values():
        lines.append(f"  {'yes' if entry['available'] else 'no ':4} {entry['name']}"
                     + ("" if entry["available"] else f": needs {entry['needs']}"))
    return "\n".join(lines)


def build_arg_parser(prog: str = "hftrain env") -> Parser:
    parser = Parser(prog=prog, description="The versions in use, whether each is inside the range hftrain is tested "
                    "on, and which version-gated features are available (for a bug report).")
    add_switch(parser, "--json", help="print the same as JSON")
    return parser


def main(argv: list[str] | None = None, prog: str = "hftrain env") -> None:
    args = build_arg_parser(prog).parse_args(argv)
    info = report()
    print(json.dumps(info, indent=2) if args.json else render(info))


if __name__ == "__main__":
    main(sys.argv[1:])
