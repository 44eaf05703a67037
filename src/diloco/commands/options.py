"""Options shared by several commands, so each is spelled and documented once."""

from __future__ import annotations

from pathlib import Path

import typer

from diloco.console import fail

CORPUS_HELP = "'shakespeare' (default, fetched once into a cache), 'generated[:SEED]', or a path"

TokenOption = typer.Option(None, help="Bearer token of the server.")
TokenFileOption = typer.Option(None, help="File whose first line is the bearer token.")


def read_token(token: str | None, token_file: Path | None) -> str | None:
    """--token or --token-file (whose first line is the token); never both."""
    if token and token_file:
        raise fail("give --token or --token-file, not both")
    if token_file is None:
        return token or None
    try:
        text = token_file.read_text().strip()
    except OSError as exc:
        raise fail(f"--token-file {token_file} cannot be read ({exc.strerror})") from None
    if not text:
        raise fail(f"--token-file {token_file} is empty")
    return text.splitlines()[0].strip()


def require_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise fail(f"{name} must be a positive integer, got {value}")
