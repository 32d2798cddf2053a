"""CONDUIT_* environment variables as the defaults of a service's command-line flags.

Every long flag `--some-flag` can also be set as `CONDUIT_SOME_FLAG`; a flag given on the command line
wins. Both CLIs use this one mapping, so the rule and its error messages are the same everywhere.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping

ENV_PREFIX = "CONDUIT_"


def env_name(flag: str) -> str:
    """`--max-num-seqs` → `CONDUIT_MAX_NUM_SEQS`."""
    return ENV_PREFIX + flag.removeprefix("--").replace("-", "_").upper()


def flag_bool(value: str) -> bool:
    """The type of a boolean flag: true/false, yes/no, on/off or 1/0 (from the command line or CONDUIT_*)."""
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {value!r}")


def add_bool_flag(parser: argparse.ArgumentParser, flag: str, default: bool, help_text: str) -> None:
    """`--flag` alone means true; `--flag false` (or CONDUIT_FLAG=false) still works."""
    parser.add_argument(flag, type=flag_bool, default=default, help=help_text, nargs="?", const=True)


def long_flags(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.Action]]:
    """(`--flag`, its action) for every option of `parser` that has a long flag, except --help."""
    flags = []
    for action in parser._actions:
        flag = next((option for option in action.option_strings if option.startswith("--")), None)
        if flag is not None and flag != "--help":
            flags.append((flag, action))
    return flags


def apply_env_defaults(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> dict[str, str]:
    """Make the CONDUIT_* variables in `environ` the defaults of `parser`'s flags.

    argparse converts a string default with the flag's type when the flag is absent, so a bad value is
    reported under the flag's name. Values of repeatable (append) flags are returned by `dest` instead
    of becoming defaults: argparse would append command-line values to a default list.
    """
    repeatable: dict[str, str] = {}
    for flag, action in long_flags(parser):
        value = environ.get(env_name(flag))
        if value is None or value == "":
            continue
        if isinstance(action, argparse._AppendAction):
            repeatable[action.dest] = value
        else:
            action.default = value
    return repeatable


def describe_env(parser: argparse.ArgumentParser) -> None:
    """Append `[env CONDUIT_…]` to every long flag's help text."""
    for flag, action in long_flags(parser):
        if action.help and env_name(flag) not in action.help:
            action.help = f"{action.help} [env {env_name(flag)}]"
