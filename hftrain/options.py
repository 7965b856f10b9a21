"""The command line's one form for a yes/no option, in every hftrain command as in the recipe: `--name true|false`
(also yes/no, on/off, 1/0, and `--name=false`), `--name` alone for true, and `--no-name` where a command offered it
before. Imports nothing of hftrain (the recipe's parser in `config` reads the same words).

    parser = Parser(prog="hftrain chat")
    add_switch(parser, "--do_sample", default=None, negatable=True, help="...")

argparse's own `store_true` takes no value (`--log_samples false` was "unrecognized arguments: false") and its
`BooleanOptionalAction` only `--no-name`. A switch here is an optional value (`nargs="?"`); so that a bare switch
never swallows the positional argument after it (`hftrain eval --apply_chat_template FOLDER`), `Parser` writes every
switch on the command line in its explicit form (`--name=true`) before argparse reads it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

TRUE_WORDS = frozenset({"true", "yes", "1", "on"})
FALSE_WORDS = frozenset({"false", "no", "0", "off"})


def is_bool_word(word: str) -> bool:
    return word.lower() in TRUE_WORDS | FALSE_WORDS


def parse_bool(word: str) -> bool:
    """argparse's `type` of a switch: True or False for the recipe's words, an error naming them otherwise."""
    if not is_bool_word(word):
        raise argparse.ArgumentTypeError(f"expected true or false, got {word!r}")
    return word.lower() in TRUE_WORDS


class Switch(argparse.Action):
    """A yes/no option: `--name [true|false]`."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        kwargs.setdefault("metavar", "true|false")
        super().__init__(option_strings, dest, nargs="?", const=True, type=parse_bool, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, values)


def add_switch(container, flag: str, *, default: bool | None = False, negatable: bool = False, help: str,
               **kwargs: Any) -> argparse.Action:
    """Add the yes/no option `flag` (e.g. "--do_sample") to a parser or an argument group of a `Parser`;
    `negatable` also takes `--no-<name>` for false (argparse's BooleanOptionalAction form, kept where a command had
    it)."""
    switch = container.add_argument(flag, action=Switch, default=default, help=help, **kwargs)
    if negatable:
        container.add_argument(f"--no-{flag[2:]}", dest=switch.dest, action="store_const", const=False,
                               default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        switch.help = f"{help} (--no-{flag[2:]}: false)"
    return switch


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose switches (`add_switch`) take `--name`, `--name true|false` and `--name=false`: each
    switch on the command line is rewritten to its explicit form (`--name=true`, `--name=false`) before parsing, so
    that argparse never reads the word after a bare switch as its value when it is not one."""

    def parse_known_args(self, args: Sequence[str] | None = None, namespace=None):
        return super().parse_known_args(self.explicit_switches(args), namespace)

    def switches(self) -> list[Switch]:
        """The parser's yes/no options."""
        return [action for action in self._actions if isinstance(action, Switch)]

    def switch_for(self, flag: str) -> Switch | None:
        """The switch `flag` names (exactly, or as argparse's unique prefix when abbreviations are allowed)."""
        actions = self._option_string_actions
        if flag in actions:
            action = actions[flag]
        elif self.allow_abbrev and flag.startswith("--"):
            matches = {actions[name] for name in actions if name.startswith(flag)}
            action = matches.pop() if len(matches) == 1 else None
        else:
            action = None
        return action if isinstance(action, Switch) else None

    def explicit_switches(self, args: Sequence[str] | None) -> list[str]:
        args = list(sys.argv[1:] if args is None else args)
        out, i = [], 0
        while i < len(args):
            arg = args[i]
            i += 1
            if arg == "--":  # everything after it is positional
                out += args[i - 1:]
                break
            switch = self.switch_for(arg) if arg.startswith("--") and "=" not in arg else None
            if switch is None:
                out.append(arg)
                continue
            value = "true"
            if i < len(args) and is_bool_word(args[i]):
                value = args[i]
                i += 1
            out.append(f"{switch.option_strings[0]}={value}")
        return out
