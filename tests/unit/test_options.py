"""hftrain.options: one form for a yes/no option in every command (issue 49, item 13): `--name true|false` as the
recipe's fields take it, `--name` alone, and `--no-name` where a command had it; a bare switch never takes the
positional argument after it."""

from __future__ import annotations

import argparse
import importlib

import pytest

from hftrain import cli, config, estimate
from hftrain.options import Parser, Switch, add_switch

# every command of `hftrain` and what builds its parser (hftrain presets takes no options)
PARSERS = {
    "launch": cli.launch_parser,
    "recipes": cli.recipes_parser,
    "finetune": lambda: config.build_arg_parser("hftrain finetune"),
    "data": lambda: importlib.import_module("hftrain.data.__main__").build_arg_parser(),
    "estimate": estimate.build_parser,
    "report": lambda: importlib.import_module("hftrain.report").build_arg_parser(),
    "merge": lambda: importlib.import_module("hftrain.merge").build_arg_parser(),
    "env": lambda: importlib.import_module("hftrain.versions").build_arg_parser(),
    "chat": lambda: importlib.import_module("hftrain.chat").build_arg_parser(),
    "eval": lambda: importlib.import_module("hftrain.eval_tasks").build_arg_parser(),
}


def test_the_walk_covers_every_command():
    assert set(PARSERS) | {"presets"} == set(cli.TOOLS) | {"launch", "presets", "recipes"}


def required_arguments(parser: argparse.ArgumentParser) -> list[str]:
    """Words that satisfy the parser's required positionals and options."""
    words = []
    for action in parser._actions:
        if not action.option_strings and action.nargs != argparse.PARSER:
            words.append("x")
        elif action.required:
            words += [action.option_strings[0], "x"]
    return words


def takes_no_value(action: argparse.Action) -> bool:
    """An option that is present or absent (store_true, BooleanOptionalAction...): a yes/no option that would refuse
    `--name false`; the help option and a switch's `--no-name` alias (default SUPPRESS) aside."""
    return bool(action.option_strings) and action.nargs == 0 and "--help" not in action.option_strings \
        and action.default is not argparse.SUPPRESS


@pytest.mark.parametrize("command", sorted(PARSERS))
def test_every_yes_no_option_of_every_command_takes_true_and_false(command):
    """`hftrain chat --do_sample false` answered "unrecognized arguments: false": every boolean option of every
    command takes the recipe's form, before or after the positional arguments, and alone means true."""
    parser = PARSERS[command]()
    assert not [action.option_strings for action in parser._actions if takes_no_value(action)]
    if command == "finetune":  # the recipe's own parser: its boolean fields take a value that load_recipe reads
        fields = [name for name, tp in config.TYPES.items() if tp is bool]
        assert len(fields) > 20
        for name in fields:
            for word, value in (("true", True), ("false", False), ("no", False)):
                given, unknown = parser.parse_known_args([f"--{name}", word])
                assert unknown == [], name
                assert getattr(config.recipe_subset(vars(given), (name,), "test"), name) is value, (name, word)
        return
    assert isinstance(parser, Parser)
    base = required_arguments(parser)
    for switch in parser.switches():
        flag = switch.option_strings[0]
        for word, value in (("true", True), ("false", False), ("no", False), ("1", True)):
            assert getattr(parser.parse_args([*base, flag, word]), switch.dest) is value, (flag, word)
            assert getattr(parser.parse_args([flag, word, *base]), switch.dest) is value, (flag, word)
            assert getattr(parser.parse_args([*base, f"{flag}={word}"]), switch.dest) is value, (flag, word)
        assert getattr(parser.parse_args([flag, *base]), switch.dest) is True  # alone, before a positional
        assert getattr(parser.parse_args(base), switch.dest) is switch.default


EXPECTED_SWITCHES = {
    "launch": ["--dry_run"], "chat": ["--do_sample"], "eval": ["--apply_chat_template", "--log_samples"],
    "merge": ["--private", "--dry_run"], "env": ["--json"],
    "estimate": ["--lora", "--qlora", "--precompute_ref_log_probs", "--trust_remote_code"],
}


def test_the_yes_no_options_found_are_the_commands_booleans():
    """The walk sees each command's boolean options (they were store_true or BooleanOptionalAction)."""
    found = {command: [s.option_strings[0] for s in build().switches()] for command, build in PARSERS.items()
             if command != "finetune"}
    assert {command: flags for command, flags in found.items() if flags} == EXPECTED_SWITCHES


def test_chat_keeps_no_do_sample_and_refuses_a_word_that_is_no_boolean(capsys):
    parser = PARSERS["chat"]()
    assert parser.parse_args(["--no-do_sample", "final"]).do_sample is False
    assert parser.parse_args(["final"]).do_sample is None  # the folder's generation config decides
    with pytest.raises(SystemExit):
        parser.parse_args(["final", "--do_sample=maybe"])
    assert "argument --do_sample: expected true or false, got 'maybe'" in capsys.readouterr().err


def test_a_switch_in_a_mutually_exclusive_group_set_false_is_not_present():
    parser = PARSERS["estimate"]()
    args = parser.parse_args(["--model", "m", "--lora", "false", "--qlora", "true"])
    assert (args.lora, args.qlora) == (False, True)
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--lora", "--qlora"])


def test_hftrain_launch_takes_dry_run_false_and_passes_no_word_to_the_recipe(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    cmd = cli.launch_command(["--dry_run", "false", "--max_steps", "2", "--bf16", "false"])
    assert cmd[-4:] == ["--max_steps", "2", "--bf16", "false"] and "--dry_run" not in cmd
    cli.main(["launch", "--dry_run", "true", "--max_steps", "2"])
    printed = capsys.readouterr().out
    assert "accelerate.commands.launch" in printed and printed.rstrip().endswith("--max_steps 2")


def test_a_switch_is_written_in_its_explicit_form_before_argparse_reads_it():
    parser = Parser(prog="t")
    parser.add_argument("folder")
    add_switch(parser, "--keep", help="keep")
    assert parser.explicit_switches(["--keep", "folder"]) == ["--keep=true", "folder"]
    assert parser.explicit_switches(["--kee", "off", "folder"]) == ["--keep=off", "folder"]  # argparse's prefixes
    assert parser.explicit_switches(["--", "--keep"]) == ["--", "--keep"]
    assert isinstance(parser.switches()[0], Switch)
