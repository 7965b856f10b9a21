"""`hftrain`: the command line. `hftrain launch` picks a launch preset by name and runs the training entry point
through `accelerate launch`; the other commands list what ships or run one of hftrain's tools in this process.

`--preset` takes a shipped name (accelerate_configs/<name>.yaml, inside the installed package as
hftrain/shipped/accelerate_configs; as TRL's `--accelerate_config zero3`) or a path to any accelerate
config. A DeepSpeed preset's `deepspeed_config_file` is passed on as an absolute path, so the command
works from any folder, as does the embedded default (its model and data ship in the package too).
Launcher options (process and node counts, rendezvous) go to `accelerate launch`; every other argument
goes to hftrain/finetune.py. Before it starts several processes, `hftrain launch` checks the recipe and the preset
against this machine as each process would (`hftrain.preflight.before_launch`), so that a refusal is printed once,
in seconds. `--dry_run` prints the command instead of checking and running it. When the run fails, the
processes' own errors are shown as they print them, and the launcher's closing traceback (accelerate's
`CalledProcessError`, torchrun's `ChildFailedError` and its summary), which only says that a process exited
non-zero, is replaced by one line naming the process and its exit status.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import difflib
import importlib
import importlib.metadata
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TextIO

import psutil
import yaml

import hftrain
from hftrain.config import (
    FIELDS,
    PRESET_DIR,
    SHIPPED,
    build_arg_parser,
    load_recipe,
    read_yaml,
    recipe_file,
    shipped_recipes,
    wants_help,
)
from hftrain.errors import ConfigError, HftrainError, run_tool
from hftrain.options import Parser, add_switch
from hftrain.paths import DEMO_RECIPE
from hftrain.preemption import EXIT_PREEMPTED
from hftrain.presets import device_problems, layout_problems, needs

ENTRY = Path(__file__).resolve().parent / "finetune.py"
TOOLS = {"finetune": "hftrain.finetune", "merge": "hftrain.merge", "estimate": "hftrain.estimate",
         "report": "hftrain.report", "data": "hftrain.data.__main__", "env": "hftrain.versions",
         "chat": "hftrain.chat", "eval": "hftrain.eval_tasks"}
# the exceptions with which accelerate's launcher reports a process that exited non-zero (single process / DeepSpeed
# multi-node: CalledProcessError; torchrun: ChildFailedError, followed by its failure summary)
LAUNCHER_FAILURES = ("subprocess.CalledProcessError: Command",
                     "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:")
LAUNCHER_OPTIONS = {  # accelerate launch's options that `hftrain launch` takes, with what they do
    "num_processes": "processes in all, over every machine (default: the preset's)",
    "num_machines": "machines (nodes) the processes are spread over (default: the preset's)",
    "machine_rank": "this machine's rank, 0 to num_machines - 1 (each node runs the command with its own)",
    "main_process_ip": "address of machine 0, reachable from every machine",
    "main_process_port": "port on machine 0 for the rendezvous (0: a free one, one machine only)",
    "rdzv_backend": "torchrun rendezvous backend: static (the presets' default) or c10d",
    "max_restarts": "times torchrun restarts the processes after a failure (default 0)",
    "monitor_interval": "seconds between torchrun's checks of its processes",
    "num_cpu_threads_per_process": "compute threads of each process on a CPU preset (default: the machine's "
                                   "physical cores over the processes per machine, or OMP_NUM_THREADS)",
}
VERSIONS_OF = ("torch", "accelerate", "transformers", "peft", "datasets", "deepspeed")  # shown by --version

USAGE = """\
usage: hftrain <command> [options]

Fine-tune causal LMs with one Accelerator loop, one typed recipe and a launch preset per machine.

commands:
  launch     train a recipe under a launch preset through accelerate launch (hftrain launch --help)
  presets    the shipped launch presets, what each is for
  recipes    the shipped recipes (--config NAME trains one); `hftrain recipes copy NAME` copies one here to edit
  finetune   train in this process, without a launcher (= python -m hftrain.finetune; --help: the recipe's
             fields by group, --help all: every field)
  data       preview what a recipe trains on: tokens, masks, lengths (= python -m hftrain.data)
  estimate   memory per GPU of a model under every strategy, and the preset that fits (= python -m hftrain.estimate)
  report     plots and a summary of a run's metrics.jsonl (= python -m hftrain.report)
  merge      merge a LoRA / DoRA run's adapter into its base model (= python -m hftrain.merge)
  env        the versions in use, whether each is inside the tested range, and which version-gated features
             are available here (for a bug report; = python -m hftrain.versions)
  chat       talk to a trained folder: final, merged, adapter or checkpoint-N (= python -m hftrain.chat)
  eval       lm-evaluation-harness tasks on a trained folder (= python -m hftrain.eval_tasks; needs hftrain[eval])

options:
  -h, --help     show this text; `hftrain <command> --help` shows a command's own
  -V, --version  hftrain's version and those of the libraries it runs on

examples:
  hftrain launch --preset cpu                                  the demo (recipe tiny-chat: the tiny model on
                                                               the shipped chat data; as `make demo`)
  hftrain launch --config tiny-dpo                             a shipped recipe, by name
  hftrain launch --preset zero3 --config my.yaml --num_processes 8 --learning_rate 1e-4
  hftrain launch --config my.yaml                              the recipe's launch_preset, else cpu
"""


def resolve_preset(name: str) -> Path:
    """A shipped preset name or a path to an accelerate config file."""
    path = Path(name).expanduser()
    if path.suffix in (".yaml", ".yml", ".json") and path.is_file():
        return path.resolve()
    shipped = PRESET_DIR / f"{name}.yaml"
    if shipped.is_file():
        return shipped.resolve()
    shipped = sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))
    raise ConfigError([f"--preset {name!r} is neither a shipped preset nor an accelerate config file"
                       f"{preset_did_you_mean(name, shipped)} (shipped presets: {', '.join(shipped)}; `hftrain "
                       "presets` says what each is for)"], "command line")


def preset_did_you_mean(name: str, shipped: list[str]) -> str:
    """The presets a mistyped `--preset` may mean: those it begins (fsdp: the fsdp2 presets), else the one closest
    to it (zero4: zero3; of equally close ones, difflib's order puts the highest stage first)."""
    like = [preset for preset in shipped if preset.startswith(name)] if name else []
    like = like or difflib.get_close_matches(name, shipped, n=1, cutoff=0.6)
    return f"; did you mean {' or '.join([', '.join(like[:-1]), like[-1]] if len(like) > 1 else like)}?" if like \
        else ""


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
            return read_yaml(recipe_file(value)).get("launch_preset")
    return None


def launch_parser() -> Parser:
    """`hftrain launch`'s own options; every other argument is the recipe's (`--config`, `--<field> value`)."""
    parser = Parser(
        prog="hftrain launch", add_help=False, formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # as the recipe's parser: a prefix is a typo to report, not an option to guess
        usage="hftrain launch [--preset NAME|FILE] [--dry_run] [launcher options] [--config RECIPE] "
              "[--<field> VALUE ...]",
        description="Train a recipe: start the processes of a launch preset with accelerate launch, each running\n"
                    "hftrain's training entry point (hftrain/finetune.py) on the recipe.",
        epilog=textwrap.dedent("""\
            recipe arguments (passed on to every process):
              --config RECIPE       a recipe YAML file, or a shipped recipe's name (hftrain recipes lists
                                    them); without it, the demo recipe tiny-chat
              --<field> VALUE       any recipe field, overriding the file (e.g. --max_steps 20 --learning_rate 1e-4)
            The recipe's fields by group: hftrain finetune --help (every field with its default and meaning:
            hftrain finetune --help all). The shipped presets: hftrain presets.

            examples:
              hftrain launch --preset cpu --max_steps 20
              hftrain launch --preset cpu_ddp --config my.yaml --num_processes 2
              hftrain launch --preset zero3 --config my.yaml --bf16 --dry_run"""))
    options = parser.add_argument_group("options")
    options.add_argument("-h", "--help", action="help", help="show this text and exit")
    options.add_argument("--preset", metavar="NAME|FILE",
                         help="a shipped launch preset (hftrain presets lists them) or an accelerate config file; "
                              "default: the recipe's launch_preset, else cpu")
    add_switch(options, "--dry_run", help="print the accelerate launch command instead of running it")
    launcher = parser.add_argument_group("launcher options (passed to accelerate launch; default: the preset's)")
    for option, text in LAUNCHER_OPTIONS.items():
        launcher.add_argument(f"--{option}", metavar="N" if option in ("num_processes", "num_machines",
                              "machine_rank", "max_restarts") else "VALUE", help=text)
    return parser


def with_demo_recipe(args: list[str]) -> list[str]:
    """A recipe's arguments, with `--config` naming the demo recipe when they name none: `hftrain launch` without a
    recipe trains what `make demo` trains."""
    named = any(arg == "--config" or arg.startswith("--config=") for arg in args)
    return args if named else ["--config", str(DEMO_RECIPE), *args]


def launch_option_typos(args: list[str]) -> list[str]:
    """The flags among the recipe's arguments that are no recipe field but look like one of `hftrain launch`'s own
    options (a prefix of it, or one or two letters off): named with the option, instead of the recipe's "unknown
    argument"."""
    own = ["--help", "--preset", "--dry_run", *(f"--{option}" for option in LAUNCHER_OPTIONS)]
    problems = []
    for arg in args:
        flag = arg.split("=", 1)[0]
        if not flag.startswith("--") or flag[2:].replace("-", "_") in FIELDS or flag in own:
            continue
        like = [option for option in own if option.startswith(flag)] or difflib.get_close_matches(flag, own, 1, 0.8)
        if like:
            problems.append(f"{flag} is neither an option of hftrain launch nor a recipe field: did you mean "
                            f"{like[0]}?")
    return problems


def check_launch(argv: list[str]) -> None:
    """Refuse, before any process starts, what every process would refuse, and a recipe without the layout the
    preset is for (`hftrain.presets`). The preflight against the launch (`hftrain.preflight.before_launch`) runs only
    for a launch of several processes: one process prints its refusal once anyway, without this process's seconds of
    imports (torch, transformers), which `hftrain presets` or `--help` need not pay, hence the import here."""
    known, rest = launch_parser().parse_known_args(argv)
    if typos := launch_option_typos(rest):
        raise ConfigError(typos, "hftrain launch arguments")
    rest = with_demo_recipe(rest)
    preset = resolve_preset(known.preset or recipe_preset(rest) or "cpu")
    recipe = load_recipe(rest)  # first: the recipe alone needs none of the preflight's imports
    problems = layout_problems(preset, recipe)
    problems += device_problems(preset, lambda: importlib.import_module("torch").cuda.is_available(),
                                lambda: importlib.import_module("torch").__version__)
    config = yaml.safe_load(preset.read_text(encoding="utf-8")) or {}
    groups = []
    if int(known.num_processes or config.get("num_processes") or 1) > 1:
        ds_file = deepspeed_config_file(preset)
        try:
            importlib.import_module("hftrain.preflight").before_launch(
                recipe, config, str(ds_file) if ds_file else None, known.num_processes, known.num_machines)
        except ConfigError as error:
            groups = error.groups
    if problems or groups:
        raise ConfigError(problems, "recipe for this machine and launch", groups=groups)


def launch_command(argv: list[str]) -> list[str]:
    known, rest = launch_parser().parse_known_args(argv)
    rest = with_demo_recipe(rest)
    preset = resolve_preset(known.preset or recipe_preset(rest) or "cpu")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(preset)]
    ds_file = deepspeed_config_file(preset)
    if ds_file is not None:
        cmd += ["--deepspeed_config_file", str(ds_file)]
    for option in LAUNCHER_OPTIONS:
        if getattr(known, option) is not None:
            cmd += [f"--{option}", getattr(known, option)]
    threads = cpu_threads(preset, known)
    if threads is not None:
        cmd += ["--num_cpu_threads_per_process", str(threads)]
    return cmd + [str(ENTRY), *rest]


def cpu_threads(preset: Path, known: argparse.Namespace) -> int | None:
    """For a CPU preset launched without num_cpu_threads_per_process or OMP_NUM_THREADS, the threads accelerate's
    launcher would choose (physical cores over the processes per machine, at least 1), given explicitly: left to
    choose, it prints a four-line warning block on every launch to say it chose them. None: accelerate's own rule
    stays silent (OMP_NUM_THREADS set, the option given, or a GPU preset)."""
    config = yaml.safe_load(preset.read_text(encoding="utf-8")) or {}
    if known.num_cpu_threads_per_process is not None or os.environ.get("OMP_NUM_THREADS") \
            or not config.get("use_cpu"):
        return None
    processes = int(known.num_processes or config.get("num_processes") or 1)
    machines = int(known.num_machines or config.get("num_machines") or 1)
    return max((psutil.cpu_count(logical=False) or 1) // max(processes // machines, 1), 1)


def launcher_environment(argv: list[str], environ: Mapping[str, str] = os.environ,
                         cuda: Callable[[], bool] = lambda: importlib.import_module("torch").cuda.is_available()
                         ) -> dict[str, str]:
    """What `hftrain launch` adds to the launcher's environment for a DeepSpeed preset: only what the launch does
    anyway, without the notices that say so on every launch. accelerate's DeepSpeed launcher passes no
    num_cpu_threads_per_process on (it does for every other strategy), so on one machine torchrun gives each process
    OMP_NUM_THREADS=1 with a four-line banner: given here, as it is. The launcher imports DeepSpeed, which, on a machine
    without CUDA, detects the CPU accelerator with a warning ("Setting accelerator to CPU"): named here, as every
    training process names it (hftrain.model.name_deepspeeds_cpu_accelerator). What the caller set is kept."""
    known, rest = launch_parser().parse_known_args(argv)
    preset = resolve_preset(known.preset or recipe_preset(with_demo_recipe(rest)) or "cpu")
    config = yaml.safe_load(preset.read_text(encoding="utf-8")) or {}
    if config.get("distributed_type") != "DEEPSPEED":
        return {}
    added = {}
    machines = int(known.num_machines or config.get("num_machines") or 1)
    if machines == 1 and "OMP_NUM_THREADS" not in environ and known.num_cpu_threads_per_process is None:
        added["OMP_NUM_THREADS"] = "1"
    if "DS_ACCELERATOR" not in environ and not cuda():
        added["DS_ACCELERATOR"] = "cpu"
    return added


def list_presets(width: int | None = None) -> str:
    """Each shipped preset's name and the first sentence of its leading comment, wrapped to `width` (the
    terminal's)."""
    width = width or shutil.get_terminal_size().columns
    paths = sorted(PRESET_DIR.glob("*.yaml"))
    column = max(len(path.stem) for path in paths) + 2
    lines = []
    for path in paths:
        need = needs(path)
        text = preset_summary(path) + (f" [needs {need[0]} > 1]" if need else "")
        lines.append(textwrap.fill(text, width=max(width, column + 40), break_on_hyphens=False,
                                   initial_indent=path.stem.ljust(column), subsequent_indent=" " * column))
    return "\n".join(lines)


def preset_summary(path: Path) -> str:
    """The first sentence of a preset's leading comment (the prose before its first command example)."""
    prose = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#") or line.startswith("#   "):
            break
        prose.append(line.lstrip("#").strip())
    text = " ".join(prose)
    end = re.search(r"(?<!e\.g)(?<!i\.e)\.(\s|$)", text)  # the first full stop that is not an abbreviation's
    return text[:end.start() + 1] if end else text


def list_recipes(width: int | None = None) -> str:
    """Each shipped recipe's name and the first sentence of its leading comment, wrapped to `width`."""
    width = width or shutil.get_terminal_size().columns
    paths = shipped_recipes()
    column = max(len(path.stem) for path in paths) + 2
    lines = [textwrap.fill(preset_summary(path), width=max(width, column + 40), break_on_hyphens=False,
                           initial_indent=path.stem.ljust(column), subsequent_indent=" " * column) for path in paths]
    return "\n".join([*lines, "", "Train one with `hftrain launch --config NAME`; `hftrain recipes copy NAME` writes "
                       "NAME.yaml here to edit."])


def recipes_parser() -> Parser:
    parser = Parser(prog="hftrain recipes", description="List the recipes shipped with hftrain, or copy one into the "
                    "current folder to edit.")
    sub = parser.add_subparsers(dest="action")
    copy = sub.add_parser("copy", help="copy a shipped recipe to a file (default: ./NAME.yaml)")
    copy.add_argument("name", help="a shipped recipe's name, e.g. tiny-dpo")
    copy.add_argument("file", nargs="?", help="where to write it (default: NAME.yaml in the current folder)")
    return parser


def recipes_command(argv: list[str]) -> None:
    """`hftrain recipes`: list the shipped recipes; `hftrain recipes copy NAME [FILE]`: copy one to edit."""
    args = recipes_parser().parse_args(argv)
    if args.action is None:
        print(list_recipes())
        return
    source = next((path for path in shipped_recipes() if path.stem == args.name), None)
    if source is None:
        raise HftrainError(f"{args.name!r} is not a shipped recipe; hftrain ships "
                           f"{', '.join(path.stem for path in shipped_recipes())}")
    target = Path(args.file or f"{args.name}.yaml")
    if target.exists():
        raise HftrainError(f"{target} already exists; name another file: hftrain recipes copy {args.name} FILE")
    target.write_text(copied_recipe(source.read_text(encoding="utf-8"), args.name, target), encoding="utf-8")
    print(f"wrote {target}; edit it, then train it: hftrain launch --config {target}")


def copied_recipe(text: str, name: str, target: Path) -> str:
    """A shipped recipe as `hftrain recipes copy` writes it to `target`: the commands of its header that name the
    recipe by its repository path (`--config recipes/tiny-chat.yaml`, which trains the shipped file from any folder)
    name the copy instead (`--config ./tiny-chat.yaml`), the file the user edits and trains; the rest is unchanged."""
    shown = str(target) if target.is_absolute() or target.parent != Path(".") else f"./{target}"
    own = re.compile(rf"--config recipes/{re.escape(name)}\.yaml(?=\s|$)")
    return "".join(own.sub(f"--config {shlex.quote(shown)}", line) if line.startswith("#") else line
                   for line in text.splitlines(keepends=True))


def version() -> str:
    """hftrain's version, Python's, and those of the libraries a run depends on (for a bug report)."""
    found = []
    for name in VERSIONS_OF:
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{name} not installed")
    return f"hftrain {hftrain.__version__} (Python {platform.python_version()}; {', '.join(found)})"


def _command(command: str, rest: list[str]) -> list[str] | None:
    """Run `presets` or a one-process tool (None), or return the `accelerate launch` command line."""
    if command == "presets":
        print(list_presets())
        return None
    if command == "recipes":
        recipes_command(rest)
        return None
    if command in TOOLS:  # one process, no launcher: python -m hftrain.<module>
        if command == "finetune" and wants_help(rest):  # printed by the recipe's parser, before the training
            build_arg_parser(f"hftrain {command}").parse_known_args(rest)  # module's imports (torch, transformers)
        tool = importlib.import_module(TOOLS[command]).main
        extra = {"prog": f"hftrain {command}"} if command in ("merge", "chat", "eval", "finetune") else {}
        tool(with_demo_recipe(rest) if command in ("finetune", "data") else rest, **extra)
        return None
    if command != "launch":
        raise HftrainError(f"unknown command {command!r}; use `hftrain launch`, `presets`, `recipes` or one of "
                           f"{', '.join(TOOLS)} (hftrain --help describes them)")
    return launch_command(rest)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        return
    if argv[0] in ("-V", "--version"):
        print(version())
        return
    cmd = run_tool(_command, argv[0], argv[1:])
    if cmd is None:
        return
    if launch_parser().parse_known_args(argv[1:])[0].dry_run:
        print(" ".join(cmd))
        return
    run_tool(check_launch, argv[1:])
    sys.exit(run_launcher(cmd, run_tool(launcher_environment, argv[1:])))


def run_launcher(cmd: list[str], environment: Mapping[str, str] | None = None) -> int:
    """Run accelerate's launcher (with `environment` added to this process's: `launcher_environment`) with its
    standard error relayed through `relay_errors`, and return the training processes' exit status (75,
    EXIT_PREEMPTED, after a stop with a checkpoint).

    The launcher runs in a session of its own, so a Ctrl-C at the terminal reaches this process only. It passes
    SIGINT and SIGTERM (SIGHUP as SIGTERM) on to the training processes, the launcher's children (the launcher itself
    while it has none yet), which stop at the next step boundary with a checkpoint and say so in one line. The
    launcher never sees the signal: accelerate's prints a KeyboardInterrupt traceback, and torchrun's agent
    kills its workers 30 s later, whatever they are saving. This process relays until the launch's output ends, so
    no process writes into a closed pipe."""
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, start_new_session=True,
                            env={**os.environ, **environment} if environment else None)

    def forward(signum: int, frame) -> None:
        sent = signal.SIGTERM if signum == signal.SIGHUP else signum
        try:
            targets = psutil.Process(proc.pid).children() or [psutil.Process(proc.pid)]
        except psutil.NoSuchProcess:
            return
        for target in targets:
            with contextlib.suppress(psutil.NoSuchProcess):
                target.send_signal(sent)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, forward)
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    status = relay_errors((decoder.decode(block) for block in iter(lambda: os.read(proc.stderr.fileno(), 65536),
                                                                     b"")), sys.stderr)
    code = proc.wait()
    return status if code and status is not None else code


TRACEBACK = "Traceback (most recent call last):"
PREEMPTED_LOG = re.compile(rf"elastic/multiprocessing/api\.py:\d+\] failed \(exitcode: {EXIT_PREEMPTED}\)")
# accelerate >= 1.16's single-process launcher raises its CalledProcessError `from RuntimeError(<the last 512 KiB of
# the process's standard error>)`, so the process's error comes back a second time, after "RuntimeError: ", before
# the launcher's own traceback (accelerate/commands/launch.py, `_run_subprocess`); a bare "RuntimeError" when the
# process wrote past the launcher's copy (hftrain.compat.accelerate.write_stderr_past_launchers_copy)
ECHO = "RuntimeError: "
ECHO_END = "The above exception was the direct cause of the following exception:"
ECHO_SPAN = 1 << 20  # what is kept of the relayed text to recognise the echo: more than the launcher's tail


def relay_errors(chunks: Iterable[str], out: TextIO) -> int | None:
    """Pass the launch's standard error on as it comes (progress bars' partial lines at once), except the launcher's
    own closing traceback: a traceback is held until its exception line; the launcher's (`LAUNCHER_FAILURES`), with
    what follows it (torchrun's summary), becomes one line (none after a stop with a checkpoint, which the training
    process has announced); any other (a process's own error) is passed on whole. accelerate 1.16's repetition of
    the process's standard error (`ECHO`) is held while it repeats what was passed on, and dropped when the
    launcher's traceback follows it. Returns the failed process's exit status that the launcher reported, if it
    did."""
    held: list[str] = []  # a traceback so far; held[0] == "" once it is the launcher's
    echo: list[str] = []  # lines that so far repeat what went out, after ECHO
    echoed = False  # the echo was just dropped: the blank lines before the launcher's traceback go with it
    partial, sent = "", 0  # the unfinished last line, and how much of it was passed on already
    # the end of what went out, in pieces (joined only to look for an echo, which is rare: every progress bar's
    # update goes through `emit`), and that text joined while nothing more has gone out
    relayed: deque[str] = deque()
    relayed_size, joined = 0, None

    def emit(text: str) -> None:
        nonlocal relayed_size, joined
        out.write(text)
        if text:
            relayed.append(text)
            relayed_size, joined = relayed_size + len(text), None
            while relayed_size - len(relayed[0]) >= ECHO_SPAN:
                relayed_size -= len(relayed.popleft())

    def repeats(lines: list[str]) -> bool:
        nonlocal joined
        if joined is None:
            joined = "".join(relayed)
        body = "".join(lines)[len(ECHO):].rstrip("\n").lstrip("\ufffd")  # the tail may begin mid-character
        return body in joined

    def complete(line: str) -> None:
        nonlocal held, echo, echoed
        if echoed and not line.strip():
            return
        echoed = False
        if echo:
            if line.startswith(ECHO_END):  # the launcher's traceback follows: its closing line replaces it
                echo, echoed = [], True
                return
            if repeats([*echo, line]) or not line.strip():
                echo.append(line)
                return
            lines, echo = echo, []
            for earlier in lines:
                complete_line(earlier)
        if line.rstrip("\n") == ECHO.rstrip(": ") and not held:
            line = ECHO + "\n"  # an empty copy
        if line.startswith(ECHO) and not held and repeats([line]):
            echo = [line]
            return
        complete_line(line)

    def complete_line(line: str) -> None:
        nonlocal held
        if PREEMPTED_LOG.search(line):  # torchrun's log of a worker's exit 75: the worker's own line says it all
            return
        if held and held[0] == "":
            held.append(line)
        elif line.startswith(TRACEBACK):
            emit("".join(held))
            held = [line]
        elif held and line.startswith((" ", "\t")):
            held.append(line)
        elif held and line.startswith(LAUNCHER_FAILURES):
            held = ["", line]
        else:
            emit("".join(held))
            held = []
            emit(line)

    for chunk in chunks:
        partial += chunk
        while "\n" in partial:
            line, partial = partial.split("\n", 1)
            if sent:  # its start went out as a partial line: not a traceback's
                emit(line[sent:] + "\n")
                sent = 0
            else:
                complete(line + "\n")
        may_be_held = any(start.startswith(partial) or partial.startswith(start) for start in (TRACEBACK, ECHO))
        if partial and not held and not echo and (sent or not may_be_held):
            emit(partial[sent:])
            sent = len(partial)
        out.flush()
    if partial and not sent:
        complete(partial)
    elif partial[sent:]:
        emit(partial[sent:])
    for line in echo:  # the stream ended inside what looked like an echo: it was the process's own text
        complete_line(line)
    status = None
    if held and held[0] == "":
        line, status = launcher_failure_line("".join(held))
        out.write(line)
    else:
        out.writelines(held)
    out.flush()
    return status


def launcher_failure_line(text: str) -> tuple[str, int | None]:
    """One line for the launcher's report that a process failed (torchrun's root-cause rank) and the exit status;
    no line for EXIT_PREEMPTED, which the training process has explained."""
    cause = text.split("Root Cause", 1)[-1]
    rank, code = re.search(r"rank\s*:\s*(\d+)", cause), re.search(r"exitcode\s*:\s*(-?\d+)", cause)
    if not (rank and code):
        rank, code = None, re.search(r"non-zero exit status (-?\d+)", text)
    status = int(code.group(1)) if code else None
    if status == EXIT_PREEMPTED:
        return "", status
    if rank:
        return (f"hftrain launch: process {rank.group(1)} exited with status {status} (its error is above); "
                "the launcher stopped the others\n"), status
    return (f"hftrain launch: the run exited with status {status if code else 'non-zero'} (its error is above)\n",
            status)


if __name__ == "__main__":
    main()
