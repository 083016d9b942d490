"""Every flag's `--help` says what the flag does and what happens when it is not given.

A flag whose default is a value shows "(default: VALUE)"; one without an argument shows
"(default: off)"; one whose default is None states its default in words. `muse serve`'s
flags are defined with the server (muse/server/launch.py) and checked there.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator

from muse.cli import build_parser

SKIPPED_COMMANDS = {("serve",)}


def subcommands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
                ) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                if path + (name,) not in SKIPPED_COMMANDS:
                    yield path + (name,), child
                    yield from subcommands(child, path + (name,))


def rendered_help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The help text as `--help` prints it, before wrapping."""
    formatter = parser._get_formatter()
    return formatter._expand_help(action) if action.help else ""


def test_every_flag_states_its_default() -> None:
    problems, checked = [], 0
    for path, parser in subcommands(build_parser()):
        for action in parser._actions:
            if not action.option_strings or action.required or \
                    isinstance(action, argparse._HelpAction):
                continue
            checked += 1
            text = rendered_help(parser, action)
            flag = f"muse {' '.join(path)} {action.option_strings[0]}"
            if not text.strip():
                problems.append(f"{flag}: no help")
            elif isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
                if "(default: off" not in text:
                    problems.append(f"{flag}: no '(default: off)' in {text!r}")
            elif "(default: " not in text:
                problems.append(f"{flag}: no '(default: ...)' in {text!r}")
    assert checked > 80
    assert not problems, "\n".join(problems)


def test_defaults_are_shown_with_their_values() -> None:
    parsers = dict(subcommands(build_parser()))
    tokenizer_help = " ".join(parsers[("train-tokenizer",)].format_help().split())
    assert "(default: 8192)" in tokenizer_help
    pretrain_help = " ".join(parsers[("train", "pretrain")].format_help().split())
    assert "peak learning rate (default: 0.002)" in pretrain_help
