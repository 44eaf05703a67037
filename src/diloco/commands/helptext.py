"""How every `diloco` command's --help reads: the Typer app and its command and group classes.

Typer's rich help, as it is, keeps the line breaks of a docstring's later paragraphs (and of
a group's one-line summaries), reads `[...]` in help text as rich markup (`diloco[tensorboard]`
lost its extra), shows `<bool>` after every flag (--help included) and writes a required
argument `{url}` in the usage line. `App` builds its commands with these fixed: each paragraph
is one line that rich wraps at the terminal, help text is shown as written, flags take no
type, and arguments are upper case in the usage line (`diloco status [OPTIONS] URL`).
"""

from __future__ import annotations

import inspect
from typing import Any

import typer
from rich.markup import escape
from typer.core import TyperArgument, TyperCommand, TyperGroup, TyperOption


def unwrap(text: str | None) -> str | None:
    """`text` with each paragraph (split on blank lines) on one line, rich markup escaped; a
    paragraph that starts with click's \\b marker keeps its lines."""
    if not text:
        return text
    paragraphs = inspect.cleandoc(text).split("\n\n")
    return "\n\n".join(escape(p if p.startswith("\b") else " ".join(p.split())) for p in paragraphs)


def _tidy_params(params: list[Any]) -> None:
    for param in params:
        if getattr(param, "_help_tidied", False):
            continue  # the help option is kept and asked for again: escape its text once
        param._help_tidied = True
        param.help = unwrap(getattr(param, "help", None))
        if isinstance(param, TyperOption) and param.is_flag and param.metavar is None:
            param.metavar = ""  # rich help then shows no `<bool>` after a flag
        if isinstance(param, TyperArgument) and param.metavar is None and param.name:
            param.metavar = param.name.upper()


def _without_braces(pieces: list[str]) -> list[str]:
    """Usage pieces with a required argument as `URL`, not Typer's `{URL}`."""
    return [p[1:-1] if p.startswith("{") and p.endswith("}") else p for p in pieces]


class _ReadableHelp:
    """What a command and a group share: their text unwrapped, their options tidied."""

    help: str | None
    params: list[Any]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.help = unwrap(self.help)
        _tidy_params(self.params)

    def get_help_option(self, ctx: Any) -> Any:
        option = super().get_help_option(ctx)  # type: ignore[misc]
        if option is not None:
            _tidy_params([option])
        return option


class HelpCommand(_ReadableHelp, TyperCommand):
    """A command whose help reads as the module docstring says."""

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        return _without_braces(super().collect_usage_pieces(ctx))


class HelpGroup(_ReadableHelp, TyperGroup):
    """A group (`diloco`, `diloco admin`) whose help reads as the module docstring says."""


class App(typer.Typer):
    """A Typer app whose groups and commands are `HelpGroup` and `HelpCommand`."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(cls=HelpGroup, **kwargs)

    def command(self, *args: Any, cls: type[TyperCommand] = HelpCommand, **kwargs: Any) -> Any:
        return super().command(*args, cls=cls, **kwargs)
