"""`hftrain`: pick a launch preset by name and run the training entry point through `accelerate launch`.

    hftrain launch --preset zero3 --config recipes/my.yaml [--num_processes 8] [--learning_rate 1e-4 ...]
    hftrain launch --config recipes/my.yaml          # the recipe's launch_preset, else `cpu`
    hftrain launch --preset cpu [--max_steps 20]     # no recipe: the embedded default (tiny model, demo data)
    hftrain presets                                  # the shipped presets, one line each
    hftrain finetune|merge|estimate|report|data ...  # = python -m hftrain.<command> ...

`--preset` takes a shipped name (accelerate_configs/<name>.yaml, inside the installed package as
hftrain/shipped/accelerate_configs; as TRL's `--accelerate_config zero3`) or a path to any accelerate
config. A DeepSpeed preset's `deepspeed_config_file` is passed on as an absolute path, so the command
works from any folder, as does the embedded default (its model and data ship in the package too).
Launcher options (process and node counts, rendezvous) go to `accelerate launch`; every other argument
goes to hftrain/finetune.py. `--dry_run` prints the command instead of running it.
"""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
from pathlib import Path

import yaml

from hftrain.config import PRESET_DIR, SHIPPED, read_yaml
from hftrain.errors import ConfigError, HftrainError, run_tool

ENTRY = Path(__file__).resolve().parent / "finetune.py"
TOOLS = {"finetune": "hftrain.finetune", "merge": "hftrain.merge", "estimate": "hftrain.estimate",
         "report": "hftrain.report", "data": "hftrain.data.__main__"}
LAUNCHER_OPTIONS = ("num_processes", "num_machines", "machine_rank", "main_process_ip", "main_process_port",
                    "rdzv_backend", "max_restarts", "monitor_interval")


def resolve_preset(name: str) -> Path:
    """A shipped preset name or a path to an accelerate config file."""
    path = Path(name).expanduser()
    if path.suffix in (".yaml", ".yml", ".json") and path.is_file():
        return path.resolve()
    shipped = PRESET_DIR / f"{name}.yaml"
    if shipped.is_file():
        return shipped.resolve()
    names = ", ".join(sorted(p.stem for p in PRESET_DIR.glob("*.yaml")))
    raise ConfigError([f"--preset {name!r} is neither a shipped preset ({names}) nor an accelerate config file"],
                      "command line")


def deepspeed_config_file(preset: Path) -> Path | None:
    """The preset's DeepSpeed JSON. A relative name is looked for in the current folder, then beside the preset's
    folder (ds_configs/ sits beside accelerate_configs/), then among the JSON files shipped with hftrain."""
    config = yaml.safe_load(preset.read_text(encoding="utf-8")) or {}
    name = (config.get("deepspeed_config") or {}).get("deepspeed_config_file")
    if name is None:
        return None
    path = Path(name).expanduser()
    folders = dict.fromkeys([Path.cwd(), preset.parent.parent, SHIPPED])  # the preset's and the shipped may be one
    candidates = [path] if path.is_absolute() else [folder / path for folder in folders]
    for candidate in candidates:
        if candidate.is_file():
            return candidate.resolve()
    raise ConfigError([f"{preset} names deepspeed_config_file {name!r}, which is not a file; looked for "
                       f"{', '.join(str(candidate) for candidate in candidates)}"], "launch preset")


def recipe_preset(args: list[str]) -> str | None:
    """`--launch_preset` on the command line, else the recipe file's launch_preset."""
    for flag in ("--launch_preset", "--config"):
        if flag in args and args.index(flag) + 1 < len(args):
            value = args[args.index(flag) + 1]
            if flag == "--launch_preset":
                return value
            return read_yaml(value).get("launch_preset")
    return None


def launch_command(argv: list[str]) -> list[str]:
    parser = argparse.ArgumentParser(prog="hftrain launch", add_help=False)
    parser.add_argument("--preset")
    parser.add_argument("--dry_run", action="store_true")
    for option in LAUNCHER_OPTIONS:
        parser.add_argument(f"--{option}")
    known, rest = parser.parse_known_args(argv)
    preset = resolve_preset(known.preset or recipe_preset(rest) or "cpu")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(preset)]
    ds_file = deepspeed_config_file(preset)
    if ds_file is not None:
        cmd += ["--deepspeed_config_file", str(ds_file)]
    for option in LAUNCHER_OPTIONS:
        if getattr(known, option) is not None:
            cmd += [f"--{option}", getattr(known, option)]
    return cmd + [str(ENTRY), *rest]


def list_presets() -> str:
    lines = []
    for path in sorted(PRESET_DIR.glob("*.yaml")):
        first = path.read_text(encoding="utf-8").splitlines()[0].lstrip("# ").strip()
        lines.append(f"{path.stem:24} {first}")
    return "\n".join(lines)


def _command(command: str, rest: list[str]) -> list[str] | None:
    """Run `presets` or a one-process tool (None), or return the `accelerate launch` command line."""
    if command == "presets":
        print(list_presets())
        return None
    if command in TOOLS:  # one process, no launcher: python -m hftrain.<module>
        tool = importlib.import_module(TOOLS[command]).main
        extra = {"prog": "hftrain merge"} if command == "merge" else {}
        tool(rest, **extra)
        return None
    if command != "launch":
        raise HftrainError(f"unknown command {command!r}; use `hftrain launch`, `hftrain presets` or one of "
                           f"{', '.join(TOOLS)}")
    return launch_command(rest)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return
    cmd = run_tool(_command, argv[0], argv[1:])
    if cmd is None:
        return
    if "--dry_run" in argv[1:]:
        print(" ".join(cmd))
        return
    sys.exit(subprocess.call(cmd))


if __name__ == "__main__":
    main()
