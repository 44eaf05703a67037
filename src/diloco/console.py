"""Shared terminal helpers: progress bars, summary tables and one-line errors for the CLI."""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from rich.text import Text

# Piped output (CI logs, log files, tests) gets a wide console so that summary tables are not
# squeezed, and lines of text are never wrapped: a log line stays one line for grep, whatever
# the length of the paths it names.
out = Console(width=None if sys.stdout.isatty() else 140, soft_wrap=not sys.stdout.isatty())
err = Console(
    stderr=True, width=None if sys.stderr.isatty() else 140, soft_wrap=not sys.stderr.isatty()
)


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print one clear line on stderr; the caller raises the result (no traceback).

    Exit code 2 is bad input (a usage error, a server URL where no server ever answered); 1 is
    a failure at run time (a refused request, a server that stopped answering).
    """
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    return typer.Exit(code=code)


def warn(message: str) -> None:
    """One WARNING line on stderr (the run goes on)."""
    err.print(f"WARNING: {escape(message)}", highlight=False, soft_wrap=True)


class _LinesOnStderr(logging.Handler):
    """Log records as lines printed through `err`, so that a live progress bar stays below
    them: INFO as the message alone, WARNING and above as "LEVEL logger: message"."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
            if record.levelno >= logging.WARNING:
                text = f"{record.levelname} {record.name}: {text}"
            if record.exc_info:
                text += "\n" + logging.Formatter().formatException(record.exc_info)
            err.print(Text(text), highlight=False, soft_wrap=True)
        except Exception:
            self.handleError(record)


def log_to_stderr(info_from: Sequence[str] = ()) -> None:
    """A command's log on stderr: WARNING and above of every logger, and the INFO lines of
    the loggers `info_from` names. Nothing changes when the root logger has handlers already
    (the caller's own logging, a test's capture)."""
    root = logging.getLogger()
    if root.handlers:
        return
    root.addHandler(_LinesOnStderr())
    root.setLevel(logging.WARNING)
    for name in info_from:
        logging.getLogger(name).setLevel(logging.INFO)


def check_output_path(path: Path | None, option: str) -> None:
    """A results file must be writable before hours of work go into it."""
    if path is None:
        return
    if not path.parent.exists():
        raise fail(f"{option} directory does not exist: {path.parent}")
    if not path.parent.is_dir():
        raise fail(f"{option} is inside a file, not a directory: {path.parent}")
    if path.is_dir():
        raise fail(f"{option} is a directory, expected a file path: {path}")
    writable = os.access(path, os.W_OK) if path.exists() else os.access(path.parent, os.W_OK)
    if not writable:
        raise fail(f"{option} cannot be written: {path}")


def number_list(text: str, option: str, kind: type = int) -> list:
    """A comma-separated option such as `--workers 1,2,4`, or one error line naming it."""
    try:
        values = [kind(part) for part in text.split(",") if part.strip()]
    except ValueError:
        what = "integers" if kind is int else "numbers"
        raise fail(f"{option} must be comma-separated {what}, got {text!r}") from None
    if not values:
        raise fail(f"{option} must not be empty")
    return values


def write_json(path: Path, document: dict | list) -> None:
    path.write_text(json.dumps(document, indent=2) + "\n")


def read_results_json(path: Path, keys: Sequence[str]) -> dict:
    """A benchmark's earlier results (`--from-json`), or one error line naming what is wrong."""
    try:
        document = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise fail(f"--from-json {path} is not a readable results file ({exc})") from None
    missing = [key for key in keys if not isinstance(document, dict) or key not in document]
    if missing:
        raise fail(f"--from-json {path} is not a results file of this benchmark: no {missing}")
    return document


@contextmanager
def progress_bar(description: str, total: int, enabled: bool = True) -> Iterator:
    """A rich progress bar on stderr; yields `advance(n)`."""
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=err,
        transient=False,
        disable=not enabled,
    )
    with progress:
        task = progress.add_task(description, total=total)
        yield lambda n=1: progress.advance(task, n)


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    """The lines of a Markdown table (a benchmark's .md beside its summary table)."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return lines + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]


def summary_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[object]]) -> Table:
    table = Table(title=title, title_justify="left")
    for i, column in enumerate(columns):
        table.add_column(column, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*(str(cell) for cell in row))
    return table


def megabytes(value: float) -> str:
    return f"{value / 1e6:,.2f}"


def exit_now(code: object) -> NoReturn:
    """End the process with `code` (SystemExit's: None is 0, a message is printed and is 1)
    once the command is done: atexit handlers run and every stream is flushed, but the
    interpreter's teardown of torch's ~1,600 modules and libraries is skipped. It took about
    1 s of every `diloco server` stop on this machine (and of every CLI test's process). With
    a non-daemon thread still running, Python's own exit joins it instead."""
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    others = [t for t in threading.enumerate() if t is not threading.main_thread()]
    if any(not t.daemon for t in others):
        sys.exit(code)
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
