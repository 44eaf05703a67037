"""`diloco status URL`: the server's view of the run, as tables."""

from __future__ import annotations

from pathlib import Path

import typer

from diloco.commands.options import CaFileOption, TokenFileOption, TokenOption, server_client
from diloco.console import check_output_path, megabytes, out, summary_table, write_json
from diloco.worker import DiLoCoClient
from diloco.worker.session import waiting_text as whom_it_waits_for


def waiting_text(status: dict) -> str:
    """Who the open round waits for, and any workers it needs beyond them (--min-workers),
    in the words of a waiting worker's log."""
    return whom_it_waits_for(status) or "-"


def status_command(
    url: str = typer.Argument(..., help="Server URL, e.g. http://127.0.0.1:8470"),
    token: str = TokenOption,
    token_file: Path = TokenFileOption,
    ca_file: Path = CaFileOption,
    json_path: Path = typer.Option(None, "--json", help="Also write the status JSON here."),
) -> None:
    """Print the round, the workers and the traffic of a running server."""
    check_output_path(json_path, "--json")
    failure = "cannot read the status of {url}"
    with server_client(
        DiLoCoClient, url, token, token_file, ca_file, attempts=2, read_timeout=10, failure=failure
    ) as client:
        status = client.status()
    out.print(
        summary_table(
            f"diloco server {url}",
            [
                "round",
                "mode",
                "live workers",
                "waiting for",
                "MB in",
                "MB out",
                "rounds/hour",
                "uptime s",
            ],
            [
                [
                    status["round"],
                    status["mode"],
                    sum(1 for w in status["workers"] if w["live"]),
                    waiting_text(status),
                    megabytes(status["bytes_in"]),
                    megabytes(status["bytes_out"]),
                    f"{status['rounds_per_hour']:.1f}",
                    f"{status['uptime_seconds']:.0f}",
                ]
            ],
        )
    )
    if status["workers"]:
        out.print(
            summary_table(
                "workers",
                ["worker", "live", "step", "steps/s", "loss", "tokens", "seen s ago", "rounds"],
                [
                    [
                        w["worker_id"],
                        "yes" if w["live"] else "no",
                        w["step"],
                        f"{w['steps_per_second']:.2f}",
                        "-" if w["loss"] is None else f"{w['loss']:.4f}",
                        w["tokens"],
                        f"{w['last_seen_seconds_ago']:.1f}",
                        w["rounds_contributed"],
                    ]
                    for w in status["workers"]
                ],
            )
        )
    if json_path is not None:
        write_json(json_path, status)
