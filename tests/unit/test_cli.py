"""`hftrain launch`: presets by name or path, the recipe's own preset, DeepSpeed configs made absolute, and the
files shipped inside the package (presets, DeepSpeed JSON, the embedded default's model and data)."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
import torch

from hftrain import cli
from hftrain.cli import (
    deepspeed_config_file,
    launch_command,
    launch_option_typos,
    launcher_environment,
    list_presets,
    main,
    relay_errors,
    resolve_preset,
)
from hftrain.config import DEFAULT_DATASET, DEFAULT_MODEL, PRESET_DIR, SHIPPED, Recipe, load_recipe, recipe_from_dict
from hftrain.errors import ConfigError
from tests.conftest import REPO


def option(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_preset_by_name_from_another_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cmd = launch_command(["--preset", "zero3", "--num_processes", "4", "--config", "r.yaml", "--max_steps", "3"])
    assert cmd[1:4] == ["-m", "accelerate.commands.launch", "--config_file"]
    assert option(cmd, "--config_file") == str((PRESET_DIR / "zero3.yaml").resolve())
    assert option(cmd, "--deepspeed_config_file") == str((SHIPPED / "ds_configs" / "zero3.json").resolve())
    assert option(cmd, "--num_processes") == "4"  # launcher option before the script...
    script = cmd.index(str(REPO / "hftrain" / "finetune.py"))
    assert cmd.index("--num_processes") < script
    assert cmd[script + 1:] == ["--config", "r.yaml", "--max_steps", "3"]  # ...recipe arguments after it


def test_preset_by_path_and_without_deepspeed(tmp_path):
    custom = tmp_path / "mine.yaml"
    custom.write_text((REPO / "accelerate_configs" / "cpu_ddp.yaml").read_text())
    cmd = launch_command(["--preset", str(custom)])
    assert option(cmd, "--config_file") == str(custom) and "--deepspeed_config_file" not in cmd


def test_the_recipes_launch_preset_is_the_default(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("launch_preset: zero2\n")
    assert option(launch_command(["--config", str(recipe)]), "--config_file").endswith("zero2.yaml")
    assert option(launch_command(["--config", str(recipe), "--launch_preset", "zero3"]),
                  "--config_file").endswith("zero3.yaml")
    assert option(launch_command(["--preset", "cpu_ddp", "--config", str(recipe)]),
                  "--config_file").endswith("cpu_ddp.yaml")  # --preset wins
    assert option(launch_command([]), "--config_file").endswith("cpu.yaml")


def test_unknown_preset_is_one_clear_error(capsys):
    with pytest.raises(ConfigError, match="'zero9' is neither a shipped preset"):
        resolve_preset("zero9")
    with pytest.raises(SystemExit) as exit_info:
        main(["launch", "--preset", "zero9"])
    assert exit_info.value.code == 2 and "zero2_offload" in capsys.readouterr().err


def test_a_recipe_field_typo_under_hftrain_launch_is_reported_as_the_command_lines(capsys):
    """Issue 49 (8): `hftrain launch --learning_rat` blamed the recipe file (the demo recipe here)."""
    with pytest.raises(SystemExit) as exit_info:
        main(["launch", "--preset", "cpu", "--learning_rat", "1e-4"])
    said = " ".join(capsys.readouterr().err.split())
    assert exit_info.value.code == 2
    assert said.startswith("hftrain: error: invalid command line, 1 problem: (1) unknown argument '--learning_rat'")
    assert "invalid recipe" not in said, said


def test_a_mistyped_preset_gets_a_did_you_mean(capsys):
    """Issue 49 (8): `--preset zero4` and `--preset fsdp` listed the 21 presets without saying which was meant."""
    for typed, meant in (("zero4", "did you mean zero3?"), ("cpu-ddp", "did you mean cpu_ddp?"),
                         ("fsdp", "did you mean fsdp2, fsdp2_cp, fsdp2_hybrid_multinode or fsdp2_shard_grad_op?")):
        with pytest.raises(SystemExit) as exit_info:
            main(["launch", "--preset", typed])
        said = " ".join(capsys.readouterr().err.split())
        assert exit_info.value.code == 2 and f"--preset {typed!r} is neither a shipped preset" in said, said
        assert meant in said and "zero2_offload" in said, said  # and still the whole list
    with pytest.raises(ConfigError) as error:
        resolve_preset("xyz")
    assert "did you mean" not in str(error.value)


def test_a_prefix_or_typo_of_a_launch_option_is_named_not_guessed(capsys):
    """hftrain launch takes no prefixes of its options, as the recipe's parser takes none of the fields (argparse
    would read --pres as --preset); a flag that is no recipe field but looks like one of its options is named with
    that option, before any process starts."""
    for typed, meant in (("--pres", "--preset"), ("--num_proc", "--num_processes"), ("--dry-run", "--dry_run"),
                         ("--prest", "--preset")):
        with pytest.raises(SystemExit) as exit_info:
            main(["launch", typed, "cpu", "--max_steps", "1"])
        said = " ".join(capsys.readouterr().err.split())
        assert exit_info.value.code == 2, typed
        assert f"{typed} is neither an option of hftrain launch nor a recipe field: did you mean {meant}?" in said
    assert launch_option_typos(["--max_steps", "1", "--lora-r", "8", "--config=my.yaml", "--preset", "cpu"]) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where torch sees no CUDA device")
def test_a_gpu_preset_is_refused_where_torch_sees_no_gpu(capsys):
    """accelerate would start multi_gpu's 8 processes on the CPU over gloo, and single_gpu's one on the CPU, without
    a word: refused before any process starts, naming the CPU preset (and the CPU build of torch it may be)."""
    for preset, twin in (("multi_gpu", "cpu_ddp"), ("single_gpu", "cpu")):
        with pytest.raises(SystemExit) as exit_info:
            main(["launch", "--preset", preset, "--max_steps", "1"])
        said = " ".join(capsys.readouterr().err.split())
        assert exit_info.value.code == 2
        assert f"the launch preset {preset} is for CUDA GPUs, but torch {torch.__version__} sees none here" in said
        assert f"launch with --preset {twin} to train on this CPU" in said


def test_dry_run_prints_the_command(capsys):
    main(["launch", "--preset", "zero2", "--dry_run", "--max_steps", "2"])
    out = capsys.readouterr().out
    assert "--config_file" in out and "zero2.json" in out and out.strip().endswith("--max_steps 2")
    assert "--dry_run" not in out


def test_a_deepspeed_launch_gives_the_launcher_what_it_would_announce(monkeypatch):
    """Issue 49: accelerate's DeepSpeed launcher passes no CPU threads on, so torchrun gave each process
    OMP_NUM_THREADS=1 under a four-line banner, and it imports DeepSpeed, which warned "Setting accelerator to CPU"
    on a machine without CUDA. `hftrain launch` gives the launcher both, as they would be, so neither is printed;
    what the caller set stays, other strategies get nothing (accelerate passes their threads on), and a launch over
    several machines keeps the threads each machine's launcher chooses."""
    cpu = {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    assert launcher_environment(["--preset", "zero3"], {}, cuda=lambda: False) == cpu
    assert launcher_environment(["--preset", "zero2", "--max_steps", "2"], {}, cuda=lambda: True) == \
        {"OMP_NUM_THREADS": "1"}
    assert launcher_environment(["--preset", "zero3"], {"OMP_NUM_THREADS": "4", "DS_ACCELERATOR": "cuda"},
                                cuda=lambda: False) == {}
    assert launcher_environment(["--preset", "zero3", "--num_cpu_threads_per_process", "3"], {},
                                cuda=lambda: True) == {}
    assert launcher_environment(["--preset", "multi_node_zero3"], {}, cuda=lambda: True) == {}
    assert launcher_environment(["--preset", "cpu_ddp"], {}, cuda=lambda: False) == {}
    assert launcher_environment([], {}, cuda=lambda: False) == {}  # the demo: the cpu preset
    # what `hftrain launch` starts the launcher with
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    started = []
    monkeypatch.setattr(cli, "run_launcher", lambda cmd, environment=None: started.append(environment) or 0)
    with pytest.raises(SystemExit) as info:
        main(["launch", "--preset", "zero3", "--max_steps", "2"])
    assert info.value.code == 0
    assert started == [cpu if not torch.cuda.is_available() else {"OMP_NUM_THREADS": "1"}]


def test_presets_listing_shows_every_shipped_preset_in_whole_sentences_wrapped_to_the_terminal():
    listing = list_presets(width=90).splitlines()
    names = [line.split()[0] for line in listing if not line.startswith(" ")]
    assert names == sorted(p.stem for p in (REPO / "accelerate_configs").glob("*.yaml"))
    assert all(len(line) <= 90 for line in listing)
    entries = " ".join(listing).split()
    starts = [entries.index(name) for name in names] + [len(entries)]
    for name, start, end in zip(names, starts, starts[1:]):
        text = re.sub(r" \[needs \w+_size > 1\]$", "", " ".join(entries[start + 1:end]))  # hftrain.presets
        comment = " ".join(line.lstrip("#").strip() for line in
                           (REPO / "accelerate_configs" / f"{name}.yaml").read_text().splitlines()
                           if line.startswith("#"))
        assert text.endswith(".") and comment.startswith(text), (name, text)  # the comment's opening, whole


def test_version_names_hftrains_and_its_libraries(capsys):
    import importlib.metadata

    main(["--version"])
    out = capsys.readouterr().out
    project = re.search(r'^version = "(.+)"$', (REPO / "pyproject.toml").read_text(), re.M).group(1)
    assert out.startswith(f"hftrain {project} (Python ")
    assert f"torch {importlib.metadata.version('torch')}" in out
    main(["-V"])
    assert capsys.readouterr().out == out


def test_launch_help_shows_its_own_options_and_points_to_the_recipe_fields(capsys):
    with pytest.raises(SystemExit) as info:
        main(["launch", "--help"])
    out = capsys.readouterr().out
    assert info.value.code == 0 and out.startswith("usage: hftrain launch")
    for option in ("--preset", "--dry_run", "--num_processes", "--num_machines", "--machine_rank",
                   "--main_process_ip", "--main_process_port", "--config"):
        assert f"  {option} " in out, option
    assert "hftrain finetune --help" in out and "hftrain presets" in out
    assert "--learning_rate FLOAT" not in out and len(out.splitlines()) < 60  # not every recipe field


def test_hftrain_help_lists_every_command(capsys):
    from hftrain.cli import TOOLS

    main(["--help"])
    out = capsys.readouterr().out
    commands = {line.split()[0] for line in out.split("commands:")[1].split("options:")[0].splitlines()
                if line.startswith("  ") and not line.startswith("   ")}
    assert commands == {"launch", "presets", "recipes", *TOOLS}
    assert "--version" in out


def test_the_shipped_files_are_the_repositorys_own():
    """One copy of each file in git: hftrain/shipped/ links to the top-level folders that the README's
    `accelerate launch --config_file accelerate_configs/cpu.yaml ...` uses (a built wheel holds copies:
    tests/e2e/test_wheel.py)."""
    assert PRESET_DIR.resolve() == REPO / "accelerate_configs"
    assert (SHIPPED / "ds_configs").resolve() == REPO / "ds_configs"
    assert DEFAULT_MODEL.resolve() == REPO / "models" / "tiny-llama"
    assert DEFAULT_DATASET.resolve() == REPO / "data" / "chat.jsonl"
    assert (SHIPPED / "recipes").resolve() == REPO / "recipes"


def test_a_presets_deepspeed_json_is_found_beside_it_else_among_the_shipped(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    preset = tmp_path / "mine" / "accelerate_configs" / "z.yaml"
    preset.parent.mkdir(parents=True)
    preset.write_text("deepspeed_config:\n  deepspeed_config_file: ds_configs/zero3.json\n")
    assert deepspeed_config_file(preset) == (SHIPPED / "ds_configs" / "zero3.json").resolve()
    beside = tmp_path / "mine" / "ds_configs" / "zero3.json"
    beside.parent.mkdir()
    beside.write_text("{}")
    assert deepspeed_config_file(preset) == beside  # a copied preset folder keeps its own JSON
    preset.write_text("deepspeed_config:\n  deepspeed_config_file: ds_configs/zero9.json\n")
    with pytest.raises(ConfigError, match="names deepspeed_config_file 'ds_configs/zero9.json', which is not a file") \
            as error:
        deepspeed_config_file(preset)
    assert str(SHIPPED / "ds_configs" / "zero9.json") in str(error.value)


def test_the_embedded_default_is_valid_from_any_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no models/ or data/ here
    recipe = recipe_from_dict({})  # validation checks that the model folder and the data file exist
    assert Path(recipe.model_name_or_path) == DEFAULT_MODEL and (DEFAULT_MODEL / "config.json").is_file()
    assert Path(recipe.dataset_name) == DEFAULT_DATASET
    assert recipe.output_dir == "outputs/tiny-chat"  # relative: written under the current folder


def test_launch_without_a_recipe_trains_the_demo_recipe(tmp_path, monkeypatch):
    """`hftrain launch --preset cpu` trains what `make demo` trains: the repository's recipes/tiny-chat.yaml."""
    monkeypatch.chdir(tmp_path)
    cmd = launch_command(["--max_steps", "2"])
    assert option(cmd, "--config_file") == str((PRESET_DIR / "cpu.yaml").resolve())
    assert Path(option(cmd, "--config")).resolve() == REPO / "recipes" / "tiny-chat.yaml"
    assert cmd[-2:] == ["--max_steps", "2"]
    (tmp_path / "mine.yaml").write_text("max_steps: 3\n")
    mine = launch_command(["--config", "mine.yaml"])
    assert mine.count("--config") == 1 and option(mine, "--config") == "mine.yaml"
    recipe = load_recipe(cmd[cmd.index("--config"):])  # valid from a folder without models/ or data/
    assert recipe.model_name_or_path == str(SHIPPED / "models" / "tiny-llama")
    assert recipe.dataset_name == str(SHIPPED / "data" / "chat.jsonl")
    assert (recipe.max_steps, recipe.learning_rate, recipe.assistant_only_loss) == (2, 3e-3, True)


@pytest.mark.parametrize("config", ["tiny-dpo", "tiny-dpo.yaml", "recipes/tiny-dpo.yaml"])
def test_a_shipped_recipe_runs_by_name_from_any_folder(config, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    recipe = load_recipe(["--config", config, "--max_steps", "1"])
    assert recipe.objective == "dpo"
    assert recipe.model_name_or_path == str(SHIPPED / "models" / "tiny-llama")  # its relative paths: shipped files
    assert recipe.dataset_name == str(SHIPPED / "data" / "preference.jsonl")
    assert recipe.output_dir == "outputs/tiny-dpo"  # still written under the current folder


def test_a_file_in_the_current_folder_comes_before_a_shipped_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "chat.jsonl").write_text((REPO / "data" / "chat.jsonl").read_text())
    (tmp_path / "tiny-chat.yaml").write_text("dataset_name: data/chat.jsonl\nmax_steps: 7\n")
    recipe = load_recipe(["--config", "tiny-chat.yaml"])
    assert recipe.max_steps == 7 and recipe.dataset_name == "data/chat.jsonl"
    mixture = load_recipe(["--config", "tiny-mixture"]).dataset_mixture
    assert [source.name for source in mixture] == ["data/chat.jsonl", str(SHIPPED / "data" / "alpaca.jsonl"),
                                                   str(SHIPPED / "data" / "sharegpt.jsonl")]


def test_a_missing_recipe_names_the_shipped_ones(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as error:
        load_recipe(["--config", "tiny-dop"])
    message = " ".join(str(error.value).split())
    assert "cannot read recipe file 'tiny-dop'" in message and "tiny-dpo, tiny-embedding, tiny-grpo" in message
    assert "hftrain recipes" in message


def test_hftrain_recipes_lists_the_shipped_ones_and_copies_one_to_edit(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    main(["recipes"])
    listing = capsys.readouterr().out.splitlines()
    names = [line.split()[0] for line in listing if line and not line.startswith(" ")][:-1]
    assert names == sorted(p.stem for p in (REPO / "recipes").glob("*.yaml"))
    main(["recipes", "copy", "tiny-grpo"])
    assert "hftrain launch --config tiny-grpo.yaml" in capsys.readouterr().out
    copied, shipped = (tmp_path / "tiny-grpo.yaml").read_text(), (REPO / "recipes" / "tiny-grpo.yaml").read_text()
    assert copied == shipped.replace("--config recipes/tiny-grpo.yaml", "--config ./tiny-grpo.yaml")  # issue 49
    assert load_recipe(["--config", "tiny-grpo.yaml"]).reward_funcs  # the copy runs from here
    with pytest.raises(SystemExit) as exit_info:
        main(["recipes", "copy", "tiny-grpo"])  # never over an existing file
    assert exit_info.value.code == 2 and "tiny-grpo.yaml already exists" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["recipes", "copy", "tiny-grop"])
    assert "'tiny-grop' is not a shipped recipe" in capsys.readouterr().err


def listed_descriptions(listing: str) -> dict[str, str]:
    """`hftrain recipes`' listing as {name: description}: a name starts a line, its wrapped description follows."""
    described: dict[str, list[str]] = {}
    for line in listing.split("\n\n")[0].splitlines():
        if line.startswith(" "):
            described[list(described)[-1]].append(line.strip())
        else:
            name, text = line.split(maxsplit=1)
            described[name] = [text]
    return {name: " ".join(words) for name, words in described.items()}


def test_every_listed_recipe_is_described_by_whole_sentences(capsys):
    """Issue 49: six descriptions were cut where the header's command began ("..., CPU, < 1 minute:"): the listing
    shows the header's prose up to its first full stop, so the prose before the command must be a sentence."""
    main(["recipes"])
    described = listed_descriptions(capsys.readouterr().out)
    assert sorted(described) == sorted(p.stem for p in (REPO / "recipes").glob("*.yaml"))
    for name, text in described.items():
        assert text.endswith(".") and text[0].isupper(), f"{name}: {text!r}"


HEADER_COMMAND = re.compile(r"^#.*?\bhftrain (launch|data) (.*?)(?:\s+#.*|\s+\(.*)?$")


def header_commands(text: str) -> list[tuple[str, list[str]]]:
    """The hftrain commands a recipe's leading comment block gives: (command, its arguments)."""
    header = [line for line in text.splitlines() if line.startswith("#")][:12]
    return [(m.group(1), m.group(2).split()) for line in header if (m := HEADER_COMMAND.match(line))]


@pytest.mark.parametrize("name", sorted(p.stem for p in (REPO / "recipes").glob("*.yaml")))
def test_a_copied_recipes_header_trains_the_copy_from_where_the_user_is(name, tmp_path, monkeypatch, capsys):
    """Issue 49: the header of `hftrain recipes copy tiny-chat` suggested `accelerate launch --config_file
    accelerate_configs/cpu.yaml hftrain/finetune.py`, paths that exist only in the checkout. Every shipped recipe's
    header gives hftrain commands, whose `--config recipes/NAME.yaml` trains the shipped file from any folder; in the
    copy, the same commands name the copy, with a preset that ships."""
    shipped = (REPO / "recipes" / f"{name}.yaml").read_text()
    assert "accelerate_configs/" not in shipped and "hftrain/finetune.py" not in shipped
    monkeypatch.chdir(tmp_path)
    main(["recipes", "copy", name])
    capsys.readouterr()
    commands = header_commands((tmp_path / f"{name}.yaml").read_text())
    own = [args for command, args in commands if command == "launch" and f"./{name}.yaml" in args]
    assert own, commands  # the copy's header trains the copy...
    for args in own:
        cmd = launch_command(args)
        assert option(cmd, "--config") == f"./{name}.yaml"
        assert Path(option(cmd, "--config_file")).parent == PRESET_DIR.resolve()  # ...under a shipped preset
    assert [args for _, args in header_commands(shipped) if f"recipes/{name}.yaml" in args] == [
        [arg.replace(f"./{name}.yaml", f"recipes/{name}.yaml") for arg in args]
        for _, args in commands if f"./{name}.yaml" in args]  # the shipped header's commands, renamed


def test_make_demo_trains_the_demo_recipe_with_one_compute_thread(tmp_path, monkeypatch):
    """Issue 49: `make demo` took 34 s where the README said ~15: the CPU preset's thread per core made torch's two
    threads wait on each other on a busy 2-core machine (39-130 s there, 11-21 s with one thread; README.md)."""
    recipe = re.search(r"^demo:.*\n\t(.*?hftrain launch (.*?))\n(?!\t)", (REPO / "Makefile").read_text().replace(
        "\\\n\t\t", ""), re.M | re.S)
    args = recipe.group(2).split()
    monkeypatch.chdir(REPO)
    cmd = launch_command(args)
    assert option(cmd, "--num_cpu_threads_per_process") == "1" and option(cmd, "--config_file").endswith("cpu.yaml")
    assert option(cmd, "--config") == "recipes/tiny-chat.yaml"


def test_recipe_launch_preset_must_ship(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    with pytest.raises(ConfigError) as error:
        recipe_from_dict({"launch_preset": "zero9", "overwrite_output_dir": True})
    assert "launch_preset='zero9' is not a shipped preset" in str(error.value)
    with pytest.raises(ConfigError, match="launch_preset_reason is set but launch_preset is not"):
        recipe_from_dict({"launch_preset_reason": "because", "overwrite_output_dir": True})
    assert recipe_from_dict({"launch_preset": "zero3", "overwrite_output_dir": True}).launch_preset == "zero3"
    assert Recipe().launch_preset is None


# Standard error of real failed launches (accelerate 1.15, and 1.16 where the name says; torch 2.13; paths shortened to
# /repo): a recipe error in
# every process, then the launcher's own traceback saying a process exited non-zero
LAUNCHER_OUTPUT = Path(__file__).parent / "launcher_output"


def relayed(chunks: list[str]) -> str:
    out = io.StringIO()
    relay_errors(chunks, out)
    return out.getvalue()


def test_torchruns_closing_traceback_becomes_one_line():
    text = (LAUNCHER_OUTPUT / "torchrun_child_failed.txt").read_text()
    shown = relayed([text[i:i + 100] for i in range(0, len(text), 100)])  # arriving in pieces
    assert "Traceback" not in shown and "ChildFailedError" not in shown and "Root Cause" not in shown
    assert shown.count("hftrain: error: invalid recipe") == 2  # each process's own error, as printed
    assert "failed (exitcode: 2) local_rank: 0" in shown  # torch's log line stays
    assert shown.endswith("hftrain launch: process 0 exited with status 2 (its error is above); the launcher "
                          "stopped the others\n")
    assert shown == text[:text.index("Traceback")] + shown.splitlines(keepends=True)[-1]


def test_a_single_process_launchers_traceback_becomes_one_line():
    text = (LAUNCHER_OUTPUT / "simple_called_process_error.txt").read_text()
    shown = relayed([text])
    closing = "hftrain launch: the run exited with status 2 (its error is above)\n"
    assert shown == text[:text.index("Traceback")] + closing


def test_accelerate_1_16s_repetition_of_the_error_is_dropped():
    """accelerate 1.16's single-process launcher raises its CalledProcessError from a RuntimeError holding the
    process's standard error: the error came back after "RuntimeError: ", then the launcher's traceback. Once."""
    text = (LAUNCHER_OUTPUT / "simple_called_process_error_accelerate_1_16.txt").read_text()
    error = text[:text.index("RuntimeError: ")]
    assert error.startswith("hftrain: error: invalid recipe") and text.count(error.strip()) == 2
    closing = "hftrain launch: the run exited with status 2 (its error is above)\n"
    for pieces in ([text], [text[i:i + 7] for i in range(0, len(text), 7)]):  # whole, and in small pieces
        assert relayed(pieces) == error + closing


def test_a_processs_own_runtime_error_line_is_passed_on():
    """A line of the process's own that starts like the echo, but repeats nothing, goes out as it is."""
    own = "progress\nRuntimeError: something the process printed itself\nnext\n"
    assert relayed([own[:15], own[15:]]) == own
    repeated = "warn: x\nRuntimeError: warn: x\nmore of the process's own output\n"  # not followed by the launcher
    assert relayed([repeated]) == repeated


def test_a_processs_own_traceback_is_passed_on_whole():
    own = ("Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n    boom()\n"
           "RuntimeError: boom\n")
    launcher = (LAUNCHER_OUTPUT / "simple_called_process_error.txt").read_text()
    launcher = launcher[launcher.index("Traceback"):]
    shown = relayed([own[:20], own[20:], "next line\n", launcher])
    assert shown.startswith(own + "next line\n") and shown.endswith("exited with status 2 (its error is above)\n")
    assert relayed([own[:-1]]) == own[:-1]  # an unfinished traceback at the end is not lost


def test_progress_bars_partial_lines_go_out_at_once():
    out, seen = io.StringIO(), []

    def chunks():  # what had gone out when each chunk was taken in
        for chunk in ("\rtraining: 1/3", "\rtraining: 2/3", "\rtraining: 3/3\n", "Trace",
                      "back (most recent call last):\n"):
            yield chunk
            seen.append(out.getvalue())

    relay_errors(chunks(), out)
    assert seen[:2] == ["\rtraining: 1/3", "\rtraining: 1/3\rtraining: 2/3"]  # each piece as it comes
    assert out.getvalue() == "\rtraining: 1/3\rtraining: 2/3\rtraining: 3/3\nTraceback (most recent call last):\n"
    assert seen[3] == seen[4] == "\rtraining: 1/3\rtraining: 2/3\rtraining: 3/3\n"  # a traceback's start is held


def test_a_listing_piped_into_a_reader_that_closes_early_ends_quietly():
    """`hftrain presets | head -1`: the reader closes the pipe before the listing is written. The tool exits as
    one killed by SIGPIPE (141), with nothing on stderr instead of a BrokenPipeError traceback."""
    import subprocess
    import sys

    process = subprocess.Popen([sys.executable, "-m", "hftrain", "presets"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, cwd=REPO)
    process.stdout.close()  # before the interpreter has even imported hftrain
    stderr = process.stderr.read().decode()
    assert process.wait(timeout=120) == 141
    assert stderr == ""
