"""Every command's `--help` names each option's default.

Written here rather than taken from argparse's ArgumentDefaultsHelpFormatter: that one prints
"(default: None)" and "(default: False)" for unset options and flags, which say nothing, skips
options that have no help text, and cannot be combined with a parser's own formatter class."""
from __future__ import annotations

import argparse


def shown(default) -> str:
    """A default as the command line would give it: a list's items spaced, a path as written."""
    text = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)
    return f"(default: {text})".replace("%", "%%")  # argparse %-formats help strings


def show_defaults(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Append the default to each option's help where it is a value (not None, not a flag's
    False), in `parser` and its subcommands; the parser, for chaining."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):  # aliases map to the same parser
                show_defaults(sub)
            continue
        says_nothing = action.default is None or action.default is False or action.default == [] \
            or action.default == argparse.SUPPRESS
        if (not action.option_strings or says_nothing or action.help == argparse.SUPPRESS
                or "default" in (action.help or "").lower()):  # the help already says it, in its own words
            continue
        action.help = f"{action.help.rstrip()} {shown(action.default)}" if action.help else shown(action.default)
    return parser


class OneLineParser(argparse.ArgumentParser):
    """A parser whose complaint is the command's own error (`error_type`, which its main prints
    as one line), not argparse's usage block and message over many lines. Subclass it per command,
    or call `one_line_parser`."""
    error_type: type[Exception] = ValueError
    see_help = False  # end the message with "(see PROG --help)"

    def error(self, message: str):
        raise self.error_type(f"{message} (see {self.prog} --help)" if self.see_help else message)


def one_line_parser(error_type: type[Exception], see_help: bool = False) -> type[OneLineParser]:
    return type(f"OneLine{error_type.__name__}Parser", (OneLineParser,),
                {"error_type": error_type, "see_help": see_help})
