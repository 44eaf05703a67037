"""The `diloco` command: server, cluster, worker, status, admin, demo, simulate."""

from __future__ import annotations

from diloco.commands.admin import admin_app
from diloco.commands.cluster import cluster_command
from diloco.commands.demo import demo_command
from diloco.commands.helptext import App
from diloco.commands.serve import server_command
from diloco.commands.simulate import simulate_command
from diloco.commands.status import status_command
from diloco.commands.work import worker_command
from diloco.console import exit_now

app = App(
    help="DiLoCo: train one PyTorch model across machines that talk rarely.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.command("server")(server_command)
app.command("cluster", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(
    cluster_command
)
app.command("worker")(worker_command)
app.command("status")(status_command)
app.add_typer(admin_app, name="admin")
app.command("demo")(demo_command)
app.command("simulate")(simulate_command)


def main() -> None:
    """Run the command, then exit without the interpreter's teardown (see `exit_now`)."""
    try:
        app()
        code: object = 0
    except SystemExit as exc:
        code = exc.code
    exit_now(code)


if __name__ == "__main__":
    main()
