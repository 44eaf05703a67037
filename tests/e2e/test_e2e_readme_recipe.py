"""README.md's "Train across machines" recipe, run as written: its code block is read from the
README, so a README that changes into commands that do not run fails here.

The substitutions are only those a test needs: COORDINATOR is localhost, the server listens
on 127.0.0.1 at a free port instead of 0.0.0.0:8470, HOME is a temporary folder (the recipe
writes its secrets into ~), `.venv/bin/diloco` and `python3` are this interpreter, and the
workers train the tiny model for a few steps on a small corpus with H = 2 (appended: the
server's --port-file; the workers' --corpus, model options, --device cpu, --no-progress).
The one worker command runs twice, as w0 and w1 ("on each worker machine")."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import urllib3

from diloco.server.ops.launch import diloco_command, free_ports, stop_process
from diloco.worker import DiLoCoClient, RetryPolicy
from processes import STARTED, wait_all
from tiny import TINY_CLI

README = Path(__file__).resolve().parents[2] / "README.md"
SECTION = "## Train across machines"
STEPS, SYNC_EVERY = 4, 2
# Connection: close, or an idle TLS keep-alive connection holds the server's graceful stop 10 s
CLOSE = {"Connection": "close"}
FORM = {"Content-Type": "application/x-www-form-urlencoded", **CLOSE}


@dataclass
class Recipe:
    setup: list[str]  # run in order before the server (tokens, certificate, chmod)
    server: str
    worker: str
    status: str


def recipe_commands(text: str) -> list[str]:
    """The shell commands of the section's first bash block: continuation lines joined,
    comment lines dropped."""
    assert SECTION in text, f"README.md has no {SECTION!r} section"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block is not None, f"README.md's {SECTION!r} has no ```bash block"
    joined = re.sub(r"\\\n\s*", " ", block.group(1))
    return [line.strip() for line in joined.splitlines() if line.strip() and line[0] != "#"]


def one_of(commands: list[str], what: str) -> str:
    found = [c for c in commands if what in c]
    assert len(found) == 1, f"README.md's recipe should run {what!r} once: {commands}"
    return found[0]


def substituted(command: str, port: int) -> str:
    """The recipe's command as this test runs it (see the module's docstring)."""
    diloco = shlex.join(diloco_command())
    command = re.sub(r"(^|\s)\.venv/bin/diloco(?=\s)", rf"\g<1>{diloco}", command)
    command = re.sub(r"^python3(?=\s)", shlex.quote(sys.executable), command)
    command = command.replace("COORDINATOR", "localhost")
    command = re.sub(r":8470\b", f":{port}", command)
    command = re.sub(r"--port \d+", f"--port {port}", command)
    command = re.sub(r"--host \S+", "--host 127.0.0.1", command)
    command = re.sub(r"--steps \d+", f"--steps {STEPS}", command)
    return re.sub(r"--sync-every \d+", f"--sync-every {SYNC_EVERY}", command)


def read_recipe(port: int) -> Recipe:
    commands = [substituted(c, port) for c in recipe_commands(README.read_text())]
    server, worker, status = (one_of(commands, f"diloco.cli {c} ") for c in
                              ("server", "worker", "status"))  # fmt: skip
    assert commands.index(server) < commands.index(worker) < commands.index(status), commands
    setup = commands[: commands.index(server)]
    assert any("openssl" in c for c in setup), "the recipe makes its TLS certificate"
    return Recipe(setup, server, worker, status)


def tokens_file_admin(server: str, env: dict[str, str], cwd: Path) -> str:
    """The admin token of the server command's --tokens-file (a line "TOKEN admin")."""
    found = re.search(r"--tokens-file (\S+)", server)
    assert found is not None, f"the recipe's server gets no --tokens-file: {server}"
    path = shell(f"echo {found.group(1)}", cwd, env).stdout.strip()
    admins = [
        line.split()[0]
        for line in Path(cwd, path).read_text().splitlines()
        if line.split()[1:] == ["admin"]
    ]
    assert len(admins) == 1, f"{path} should hold one admin line"
    return admins[0]


def shell(command: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """`command` run by bash to its end, as a user types it."""
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120, check=False)  # fmt: skip


def bash(command: str, cwd: Path, env: dict[str, str], **kwargs) -> subprocess.Popen:
    return subprocess.Popen(["bash", "-c", f"exec {command}"], cwd=cwd, env=env, **kwargs)


def test_the_readme_recipe_runs_top_to_bottom(corpus_file: Path, tmp_path: Path) -> None:
    """Tokens, certificate, server, two workers, status, a dashboard login: ~13 s here."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed: the README's recipe makes its certificate with it")
    home, here = tmp_path / "home", tmp_path / "machine"
    home.mkdir(), here.mkdir()
    env = {**os.environ, "HOME": str(home)}
    env.pop("DILOCO_TOKEN", None)
    (port,) = free_ports(1)
    recipe = read_recipe(port)
    for command in recipe.setup:
        done = shell(command, here, env)
        assert done.returncode == 0, (command, done.stderr)
    url = f"https://localhost:{port}"
    cert = here / "cert.pem"

    log = tmp_path / "server.log"
    port_file = tmp_path / "port"
    server = bash(f"{recipe.server} --port-file {port_file}", here, env,
                  stdout=log.open("wb"), stderr=subprocess.STDOUT)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists():
            assert server.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        started = log.read_text()
        assert "Traceback" not in started
        signs_in = "(sign in with an admin token from --tokens-file)"
        assert f"dashboard: https://127.0.0.1:{port}/ {signs_in}" in started, started

        extra = f" --corpus {shlex.quote(str(corpus_file))} --no-progress --device cpu " + (
            shlex.join(TINY_CLI)
        )
        workers = []
        for worker_id in ("w0", "w1"):
            command = recipe.worker.replace("w0", worker_id) + extra
            output = (tmp_path / f"{worker_id}.log").open("wb")
            workers.append(bash(command, here, env, stdout=output, stderr=subprocess.STDOUT))
            STARTED.append(workers[-1])  # killed by the autouse fixture if left running
        wait_all(workers, timeout=240)
        for worker_id, worker in zip(("w0", "w1"), workers, strict=True):
            text = (tmp_path / f"{worker_id}.log").read_text()
            assert worker.returncode == 0 and "Traceback" not in text, text[-3000:]
            assert json.loads((here / f"{worker_id}.json").read_text())  # its --json

        status = shell(recipe.status, here, env)
        assert status.returncode == 0, status.stderr
        token = (home / ".diloco-token").read_text().strip()
        with DiLoCoClient(url, token, ca_file=cert, retry=RetryPolicy(attempts=3)) as client:
            shown = client.status()
        rounds = {w["worker_id"]: w["rounds_contributed"] for w in shown["workers"]}
        assert rounds == {"w0": STEPS // SYNC_EVERY, "w1": STEPS // SYNC_EVERY}
        assert re.search(r"\bw0\b", status.stdout) and re.search(r"\bw1\b", status.stdout)

        # The dashboard: a login with the admin token of the recipe's --tokens-file.
        admin = tokens_file_admin(recipe.server, env, here)
        http = urllib3.PoolManager(ca_certs=str(cert), timeout=30.0)
        login = http.request("POST", f"{url}/login", body=f"token={admin}".encode(),
                             headers=FORM, redirect=False)  # fmt: skip
        assert login.status == 303, login.data[:2000]
        session = {"Cookie": login.headers["set-cookie"].split(";")[0]}
        page = http.request("GET", f"{url}/", headers={**session, **CLOSE})
        assert page.status == 200 and b'id="workers"' in page.data
    finally:
        stop_process(server)
    assert server.returncode == 0, log.read_text()[-3000:]
