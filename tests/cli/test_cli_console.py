"""The shared console: a comma-separated option, or one `error:` line and exit code 2; piped
output never wraps a line; a finished command exits with its code, its atexit handlers and
its streams, and waits for a thread that is still working."""

from __future__ import annotations

import subprocess
import sys
import textwrap

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


def _exit_in_a_process(tmp_path, body: str) -> subprocess.CompletedProcess:
    script = textwrap.dedent(
        f"""
        import atexit, pathlib, threading, time
        from diloco.console import exit_now
        out = pathlib.Path({str(tmp_path)!r})
        atexit.register(lambda: (out / "atexit").write_text("ran"))
        """
    ) + textwrap.dedent(body)
    return subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )


@pytest.mark.parametrize(("code", "expected"), [(None, 0), (3, 3), ("it broke", 1)])
def test_exit_now_keeps_the_code_runs_atexit_and_flushes(tmp_path, code, expected) -> None:
    done = _exit_in_a_process(tmp_path, f"print('last line', end=''); exit_now({code!r})")
    assert done.returncode == expected
    assert done.stdout == "last line"  # buffered, yet not lost
    assert (tmp_path / "atexit").read_text() == "ran"
    assert done.stderr == ("it broke\n" if code == "it broke" else "")


def test_exit_now_lets_a_running_non_daemon_thread_finish(tmp_path) -> None:
    done = _exit_in_a_process(
        tmp_path,
        """
        def work():
            time.sleep(0.3)
            (out / "finished").write_text("yes")
        threading.Thread(target=work).start()
        exit_now(4)
        """,
    )
    assert done.returncode == 4
    assert (tmp_path / "finished").read_text() == "yes"
