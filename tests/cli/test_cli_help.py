"""Every command's --help at 80 columns: each option's full name, nothing wider than the
terminal, no `<bool>` after a flag, arguments named in the usage line, and `diloco server`'s
options in panels. The commands and their options come from the click command objects, so a
new option is checked without being listed here."""

from __future__ import annotations

import re

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from diloco.cli import app

ANSI = re.compile(r"\x1b\[[0-9;]*m")


def commands(command=None, path=()):
    """(path, click command) for every command and group under `diloco`."""
    command = command or get_command(app)
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from commands(sub, (*path, name))


COMMANDS = dict(commands())


def help_text(path: tuple[str, ...]) -> str:
    result = CliRunner().invoke(
        app, [*path, "--help"], prog_name="diloco", env={"COLUMNS": "80"}, terminal_width=80
    )
    assert result.exit_code == 0, result.output
    return ANSI.sub("", result.stdout)


def shown(name: str, text: str) -> bool:
    """Whether `name` appears whole (not `--error-feedback-b…`, not part of a longer name)."""
    return re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text) is not None


def panels(text: str) -> dict[str, str]:
    """Each rich panel's title and the text inside it."""
    found = {}
    for match in re.finditer(r"╭─ (.+?) ─+╮\n(.*?)╰", text, re.S):
        found[match.group(1)] = match.group(2)
    return found


@pytest.mark.parametrize("path", list(COMMANDS), ids=lambda p: " ".join(p) or "diloco")
def test_help_at_80_columns_shows_every_option_whole(path):
    command = COMMANDS[path]
    text = help_text(path)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80, max(lines, key=len)
    options = [p for p in command.params if p.param_type_name == "option" and not p.hidden]
    assert options or getattr(command, "commands", None)
    for option in options:
        for name in (*option.opts, *option.secondary_opts):
            assert shown(name, text), f"{' '.join(path)} --help cuts or omits {name}"
    for name in getattr(command, "commands", {}):
        assert shown(name, text)
    assert shown("--help", text)
    assert "<bool>" not in text
    usage = next(line for line in lines if "Usage:" in line)
    arguments = [p for p in command.params if p.param_type_name == "argument"]
    assert usage.split() == ["Usage:", "diloco", *path, "[OPTIONS]"] + [
        a.name.upper() for a in arguments
    ] + (["COMMAND", "[ARGS]..."] if getattr(command, "commands", None) else [])


def test_help_paragraphs_wrap_at_the_terminal_not_where_the_docstring_broke():
    # The docstring breaks after "every other option"; at 80 columns the sentence runs on.
    text = help_text(("cluster",))
    assert "every other\n" not in text
    assert re.search(r"processes on 127\.0\.0\.1; every other\s+option", text)
    # Help text is shown as written, not read as rich markup.
    assert "(needs diloco[tensorboard])" in " ".join(help_text(("server",)).split())


def test_server_options_are_grouped_into_panels():
    text = help_text(("server",))
    found = panels(text)
    assert list(found) == [
        "Options",
        "Durability",
        "Rounds and outer optimizer",
        "Robust aggregation",
        "Codecs",
        "Membership",
        "Upload limits",
        "Streaming mode",
        "Async mode",
        "Auth and TLS",
        "Outputs",
        "Sharding",
    ]
    for option in COMMANDS[("server",)].params:
        if option.hidden:
            continue
        panel = getattr(option, "rich_help_panel", None) or "Options"
        assert shown(option.opts[0], found[panel]), (option.opts[0], panel)
    assert len(text.splitlines()) < 200
