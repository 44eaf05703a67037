"""The shared console: a comma-separated option, or one `error:` line and exit code 2; piped
output never wraps a line."""

from __future__ import annotations

import pytest
import typer

from diloco.console import err, number_list, out


def test_number_list_parses_integers_and_floats() -> None:
    assert number_list("1,2,4", "--workers") == [1, 2, 4]
    assert number_list("1, 0.5,0.25,", "--speeds", float) == [1.0, 0.5, 0.25]


@pytest.mark.parametrize(
    ("text", "kind", "message"),
    [
        ("1,a", int, "--opt must be comma-separated integers, got '1,a'"),
        ("1.5", int, "--opt must be comma-separated integers, got '1.5'"),
        ("x", float, "--opt must be comma-separated numbers, got 'x'"),
        ("", int, "--opt must not be empty"),
        (" , ", float, "--opt must not be empty"),
    ],
)
def test_number_list_refuses_with_one_line_naming_the_option(
    capsys: pytest.CaptureFixture[str], text: str, kind: type, message: str
) -> None:
    with pytest.raises(typer.Exit) as raised:
        number_list(text, "--opt", kind)
    assert raised.value.exit_code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert lines == [f"error: {message}"]


def test_a_long_line_to_a_pipe_stays_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """A log file or a pipe gets whole lines (a test that greps a path-long line found it
    wrapped at 140 columns when the temp directory's name grew)."""
    line = "stopped; state in /tmp/" + "x" * 200 + " (checkpoint written at shutdown)"
    out.print(line)
    err.print(line)
    captured = capsys.readouterr()
    assert captured.out == line + "\n"
    assert captured.err == line + "\n"
