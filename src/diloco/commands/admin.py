"""`diloco admin ...`: steer a running server (needs a token with the admin scope).

Each command is one call of a /v1/admin route (docs/protocol.md), answered with a short table;
the server audits every action. Bad input exits 2, a refused or failed call exits 1, each
with one line and no traceback.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape

from diloco.commands.helptext import App
from diloco.commands.options import CaFileOption, server_client
from diloco.console import check_output_path, fail, megabytes, out, summary_table, write_json
from diloco.wire import WireError, decode_tensors
from diloco.worker.net.admin_client import AdminClient

admin_app = App(
    help="Steer a running server: pause, resume, outer lr, evict, ban, stop, weights, audit.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)

UrlArgument = typer.Argument(..., help="Server URL, e.g. http://127.0.0.1:8470")
AdminTokenOption = typer.Option(
    None,
    help="A token with the admin scope (an 'admin' line of the server's --tokens-file). Shows "
    "in `ps`: prefer --token-file or $DILOCO_TOKEN.",
)
AdminTokenFileOption = typer.Option(
    None, help="File whose first line is the admin token (else $DILOCO_TOKEN, if set)."
)


def _client(
    url: str, token: str | None, token_file: Path | None, ca_file: Path | None
) -> AbstractContextManager[AdminClient]:
    return server_client(
        AdminClient, url, token, token_file, ca_file, attempts=3, read_timeout=60,
        failure="{url}", token_name="admin token",
    )  # fmt: skip


def _call(
    url: str,
    token: str | None,
    token_file: Path | None,
    ca_file: Path | None,
    action: Callable[[AdminClient], dict[str, Any]],
) -> dict[str, Any]:
    with _client(url, token, token_file, ca_file) as client:
        return action(client)


def _show(title: str, answer: dict[str, Any]) -> None:
    keys = list(answer)
    out.print(summary_table(title, keys, [[_cell(answer[k]) for k in keys]]))


def _cell(value: object) -> str:
    """A table cell, its text shown as is (rich markup in a reason or an id is escaped)."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:g}"
    return escape(str(value))


@admin_app.command("pause")
def pause_command(
    url: str = UrlArgument,
    token: str = AdminTokenOption,
    token_file: Path = AdminTokenFileOption,
    ca_file: Path = CaFileOption,
) -> None:
    """Hold every outer step: workers keep training and submitting, and wait for results."""
    _show("paused", _call(url, token, token_file, ca_file, lambda c: c.pause()))


@admin_app.command("resume")
def resume_command(
    url: str = UrlArgument,
    token: str = AdminTokenOption,
    token_file: Path = AdminTokenFileOption,
    ca_file: Path = CaFileOption,
) -> None:
    """Let outer steps commit again (rounds that filled up while paused commit now)."""
    _show("resumed", _call(url, token, token_file, ca_file, lambda c: c.resume()))


@admin_app.command("set-outer-lr")
def set_outer_lr_command(
    url: str = UrlArgument,
    lr: float = typer.Argument(..., help="The outer learning rate of every later outer step."),
    token: str = AdminTokenOption,
    token_file: Path = AdminTokenFileOption,
    ca_file: Path = CaFileOption,
) -> None:
    """Change the outer learning rate from the next outer step on (durable, audited)."""
    if not (math.isfinite(lr) and lr > 0):
        raise fail(f"LR must be a positive finite number, got {lr}")
    _show("outer lr", _call(url, token, token_file, ca_file, lambda c: c.set_outer_lr(lr)))


@admin_app.command("evict")
def evict_command(
    url: str = UrlArgument,
    worker_id: str = typer.Argument(..., help="The worker to take out of the run."),
    ban: bool = typer.Option(
        False, "--ban", help="Also refuse its registrations and revoke its credential."
    ),
    reason: str = typer.Option("", help="Why (kept in the audit log)."),
    token: str = AdminTokenOption,
    token_file: Path = AdminTokenFileOption,
    ca_file: Path = CaFileOption,
) -> None:
    """Evict a live worker now: the open round goes on without it, its units return to the
    pool. Without --ban it may register again."""
    answer = _call(
        url, token, token_file, ca_file, lambda c: c.evict(worker_id, ban=ban, reason=reason)
    )
    _show("evicted", answer)


@admin_app.command("unban")
def unban_command(
    url: str = UrlArgument,
    worker_id: str = typer.Argument(..., help="A banned worker id."),
    token: str = AdminTokenOption,
    token_file: Path = AdminTokenFileOption,
    ca_file: Path = CaFileOption,
) -> None:
    """Let a banned worker id register again."""
    _show("unbanned", _call(url, token, token_file, ca_file, lambda c: c.unban(worker_id)))


@admin_app.command("stop")
def stop_command(
    url: str = UrlArgument,
    token: str = AdminTokenOption,
    token_file: Path = AdminTokenFileOption,
    ca_file: Path = CaFileOption,
) -> None:
    """Stop the server gracefully, as SIGTERM does: drain requests, flush the state, exit 0.
    Workers wait and retry; a restart on the same --state-dir goes on from there."""
    _show("stopping", _call(url, token, token_file, ca_file, lambda c: c.stop()))


@admin_app.command("weights")
def weights_command(
    url: str = UrlArgument,
    output: Path = typer.Argument(..., help="Where to write the weights (.safetensors)."),
    token: str = AdminTokenOption,
    token_file: Path = AdminTokenFileOption,
    ca_file: Path = CaFileOption,
    json_path: Path = typer.Option(None, "--json", help="Also write the summary as JSON here."),
) -> None:
    """Download the current fp32 master weights as a safetensors file."""
    check_output_path(output, "OUTPUT")
    check_output_path(json_path, "--json")
    with _client(url, token, token_file, ca_file) as client:
        weights = client.master_weights()
    try:
        tensors = decode_tensors(weights.body)  # the file is checked before it is written
    except WireError as exc:
        raise fail(f"{url} sent weights that are not valid safetensors: {exc}", code=1) from None
    temporary = output.with_name(output.name + ".tmp")
    temporary.write_bytes(weights.body)
    temporary.replace(output)
    summary = {
        "round": weights.round,
        "tensors": len(tensors),
        "parameters": sum(t.numel() for t in tensors.values()),
        "bytes": len(weights.body),
        "path": str(output),
    }
    out.print(
        summary_table(
            "global weights",
            ["round", "tensors", "parameters", "MB", "file"],
            [
                [
                    weights.round,
                    summary["tensors"],
                    f"{summary['parameters']:,}",
                    megabytes(len(weights.body)),
                    str(output),
                ]
            ],
        )
    )
    if json_path is not None:
        write_json(json_path, summary)


@admin_app.command("audit")
def audit_command(
    url: str = UrlArgument,
    after: int = typer.Option(0, help="Only events with an id above this one."),
    limit: int = typer.Option(100, help="At most this many events (1-1000)."),
    token: str = AdminTokenOption,
    token_file: Path = AdminTokenFileOption,
    ca_file: Path = CaFileOption,
    json_path: Path = typer.Option(None, "--json", help="Also write the events as JSON here."),
) -> None:
    """Print the server's audit log: registrations, evictions, steps, admin actions."""
    if after < 0:
        raise fail(f"--after must be >= 0, got {after}")
    if not 1 <= limit <= 1000:
        raise fail(f"--limit must be between 1 and 1000, got {limit}")
    check_output_path(json_path, "--json")
    events = _call(url, token, token_file, ca_file, lambda c: c.audit(after, limit))["events"]
    rows = [
        [
            event["id"],
            datetime.datetime.fromtimestamp(event["at"]).isoformat(timespec="seconds"),
            _cell(event["event"]),
            _cell(event["worker_id"]),
            _cell(event["round"]),
            _cell(", ".join(f"{k}={v}" for k, v in event["detail"].items()) or None),
        ]
        for event in events
    ]
    out.print(summary_table("audit log", ["id", "at", "event", "worker", "round", "detail"], rows))
    if json_path is not None:
        write_json(json_path, events)
