"""`diloco server --shard` and `diloco cluster` as a user runs them: refusals in one line."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from cli.test_cli_worker_status import one_error_line, run_cli
from diloco.server.ops.launch import free_ports, start_server, stop_process
from processes import run_cli_in_process, sampled

SERVER_CASES = [
        (("--shard", "0"), "--shard and --shard-url go together"),
        (("--shard-url", "http://127.0.0.1:1", "--shard-url", "http://127.0.0.1:2"),
         "--shard and --shard-url go together"),
        (("--shard", "0", "--shard-url", "http://127.0.0.1:1"), "at least 2 shards"),
        (("--shard", "2", "--shard-url", "http://127.0.0.1:1", "--shard-url",
          "http://127.0.0.1:2"), "shard must be in [0, 1]"),
        (("--shard", "0", "--shard-url", "http://127.0.0.1:1", "--shard-url",
          "http://127.0.0.1:1"), "must be distinct"),
        (("--shard", "0", "--shard-url", "http://127.0.0.1:1", "--shard-url",
          "http://127.0.0.1:2", "--mode", "streaming"), "at least one fragment per shard"),
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("args", "needle"),
    [pytest.param(*case, id=f"{i}-{case[1]}") for i, case in enumerate(SERVER_CASES)],
)
def test_bad_shard_options_are_refused_in_one_line(args: tuple[str, ...], needle: str) -> None:
    """Every case through typer's runner in this process (a real process: below)."""
    one_error_line(run_cli_in_process("server", "--port", "0", *args), 2, needle)


@pytest.mark.parametrize(
    ("args", "needle"),
    sampled(SERVER_CASES, [f"{i}-{needle}" for i, (_, needle) in enumerate(SERVER_CASES)], 100),
)
def test_bad_shard_options_are_one_line_from_a_real_process(
    args: tuple[str, ...], needle: str
) -> None:
    one_error_line(run_cli("server", "--port", "0", *args), 2, needle)


@pytest.mark.slow  # one line of the same refusal path as the sampled cases
def test_sharded_servers_need_a_state_dir() -> None:
    urls = ("--shard-url", "http://127.0.0.1:1", "--shard-url", "http://127.0.0.1:2")
    one_error_line(run_cli("server", "--shard", "0", *urls), 2, "sharded servers need --state-dir")


@pytest.mark.slow  # one line of the same refusal path as the sampled cases
def test_sharded_servers_need_durability_round(tmp_path: Path) -> None:
    urls = ("--shard-url", "http://127.0.0.1:1", "--shard-url", "http://127.0.0.1:2")
    result = run_cli(
        "server", "--shard", "0", *urls, "--durability", "interval",
        "--state-dir", str(tmp_path),
    )  # fmt: skip
    one_error_line(result, 2, "sharded servers need --durability round")


def test_a_shard_started_with_other_settings_refuses_to_start(tmp_path: Path) -> None:
    """Shard 1 compares its settings with shard 0's and names the first that differs."""
    ports = free_ports(2)
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    shared = [option for url in urls for option in ("--shard-url", url)]
    leader, _ = start_server(
        tmp_path / "port-0", "--port", str(ports[0]), "--shard", "0", *shared,
        "--sync-every", "4", "--state-dir", str(tmp_path / "s0"),
    )  # fmt: skip
    try:
        result = run_cli(
            "server", "--port", str(ports[1]), "--shard", "1", *shared, "--sync-every", "5",
            "--state-dir", str(tmp_path / "s1"),
        )  # fmt: skip
        one_error_line(result, 2, "sync_every is 5 here and 4 on shard 0")
    finally:
        stop_process(leader)


CLUSTER_CASES = [
    (("--shards", "1"), "--shards must be in [2, 64]"),
    (("--shards", "65"), "--shards must be in [2, 64]"),
    (("--shards", "2", "--port", "9000"), "--port is set by `diloco cluster`"),
    (("--shards", "2", "--shard-url", "http://x:1"), "--shard-url is set by"),
    (("--shards", "2", "--host=0.0.0.0"), "--host is set by"),  # (an = form got through)
    (("--shards", "2", "--mode", "streaming"), "a shard did not start"),
]


@pytest.mark.parametrize(
    ("args", "needle"),
    sampled(CLUSTER_CASES, [" ".join(args) for args, _ in CLUSTER_CASES], every=6),
)
def test_bad_cluster_options_are_refused_in_one_line(
    args: tuple[str, ...], needle: str, tmp_path: Path
) -> None:
    result = run_cli("cluster", "--state-dir", str(tmp_path), *args)
    one_error_line(result, 2, needle)


def test_cluster_starts_every_shard_and_stops_them_on_sigint(tmp_path: Path) -> None:
    import signal
    import sys
    import time

    import urllib3

    process = subprocess.Popen(
        [sys.executable, "-m", "diloco.cli", "cluster", "--shards", "2", "--state-dir",
         str(tmp_path), "--sync-every", "7"],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        ports = []
        while len(ports) < 2:
            assert time.monotonic() < deadline and process.poll() is None
            ports = [p.read_text().strip() for p in sorted(tmp_path.glob("shard-*.port"))]
            time.sleep(0.2)
        http = urllib3.PoolManager(retries=urllib3.Retry(10, backoff_factor=0.2))
        infos = [http.request("GET", f"http://127.0.0.1:{port}/v1/info").json() for port in ports]
        assert [info["shards"]["index"] for info in infos] == [0, 1]
        assert all(info["settings"]["sync_every"] == 7 for info in infos)
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, stderr
    assert "cluster stopped; shard exit codes [0, 0]" in stderr
    assert all((tmp_path / f"shard-{i}" / "state.sqlite").exists() for i in range(2))


@pytest.mark.slow  # its sibling in the default suite: other settings refused
def test_a_shard_started_on_another_init_model_refuses_to_start(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(4), "b": torch.zeros(2)}, str(tmp_path / "one.safetensors"))
    save_file({"a": torch.zeros(4), "b": torch.zeros(3)}, str(tmp_path / "two.safetensors"))
    ports = free_ports(2)
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    shared = [option for url in urls for option in ("--shard-url", url)]
    leader, _ = start_server(
        tmp_path / "port-0", "--port", str(ports[0]), "--shard", "0", *shared,
        "--init", str(tmp_path / "one.safetensors"), "--state-dir", str(tmp_path / "s0"),
    )  # fmt: skip
    try:
        result = run_cli(
            "server", "--port", str(ports[1]), "--shard", "1", *shared,
            "--init", str(tmp_path / "two.safetensors"), "--state-dir", str(tmp_path / "s1"),
        )  # fmt: skip
        one_error_line(result, 2, "this shard's --init model (fingerprint")
        result = run_cli(
            "server", "--port", str(ports[1]), "--shard", "1", *shared,
            "--state-dir", str(tmp_path / "s2"),
        )  # fmt: skip
        # checked once its state is open (a resume drops --init): the server's start-up
        # warning may come first, then the one error line
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        last = result.stderr.strip().splitlines()[-1]
        assert last.startswith("error: this shard was started without --init and shard 0 with")
    finally:
        stop_process(leader)


@pytest.mark.slow
def test_a_follower_of_an_init_run_restarts_on_its_state_without_init(tmp_path: Path) -> None:
    """A resume drops --init; the follower then compares the --init fingerprint its state
    kept from its first start with shard 0's, and starts."""
    import torch
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(4), "b": torch.zeros(2)}, str(tmp_path / "one.safetensors"))
    ports = free_ports(2)
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    shared = [option for url in urls for option in ("--shard-url", url)]
    started = []
    try:
        for shard in (0, 1):
            process, _ = start_server(
                tmp_path / f"port-{shard}", "--port", str(ports[shard]), "--shard", str(shard),
                *shared, "--init", str(tmp_path / "one.safetensors"),
                "--state-dir", str(tmp_path / f"s{shard}"),
            )  # fmt: skip
            started.append(process)
        stop_process(started.pop())
        again, url = start_server(
            tmp_path / "port-1b", "--port", str(ports[1]), "--shard", "1", *shared,
            "--state-dir", str(tmp_path / "s1"),
        )  # fmt: skip
        started.append(again)
        assert url == urls[1]
    finally:
        for process in started:
            stop_process(process)


@pytest.mark.slow
def test_a_streaming_follower_whose_state_was_lost_refuses_to_start(tmp_path: Path) -> None:
    """Shard 0 holds the run's weights (a worker uploaded its part); a follower started on an
    empty --state-dir would start its fragments over: refused in one line."""
    import json

    import torch
    import urllib3
    from safetensors.torch import save

    ports = free_ports(2)
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    shared = [option for url in urls for option in ("--shard-url", url)]
    streaming = ("--mode", "streaming", "--sync-every", "4", "--fragments", "2")
    leader, _ = start_server(
        tmp_path / "port-0", "--port", str(ports[0]), "--shard", "0", *shared, *streaming,
        "--state-dir", str(tmp_path / "s0"),
    )  # fmt: skip
    try:
        http = urllib3.PoolManager(retries=False, timeout=30)
        headers = {"X-Diloco-Protocol": "1", "Content-Type": "application/json"}
        specs = [
            {"name": n, "shape": [size], "dtype": "float32", "kind": "trainable"}
            for n, size in (("blocks.0.w", 2), ("blocks.1.w", 4), ("head", 1))
        ]
        message = {"protocol_version": 1, "worker_id": "w1", "tensors": specs}
        answer = http.request(
            "POST", f"{urls[0]}/v1/workers", body=json.dumps(message), headers=headers
        )
        assert answer.status == 200, answer.data
        owned = json.loads(http.request("GET", f"{urls[0]}/v1/info").data)["shards"]["owned"]
        part = save({name: torch.zeros(4 if name == "blocks.1.w" else 1) for name in owned})
        answer = http.request(
            "PUT", f"{urls[0]}/v1/weights/initial?worker_id=w1", body=part,
            headers={"X-Diloco-Protocol": "1", "Content-Type": "application/octet-stream"},
        )  # fmt: skip
        assert answer.status == 200, answer.data
        result = run_cli(
            "server", "--port", str(ports[1]), "--shard", "1", *shared, *streaming,
            "--state-dir", str(tmp_path / "s1"),
        )  # fmt: skip
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        last = result.stderr.strip().splitlines()[-1]
        assert last.startswith("error: shard 0 holds the run's weights and this shard none")
    finally:
        stop_process(leader)


def refused(result: subprocess.CompletedProcess, *needles: str) -> None:
    """Exit 2 with one error line holding every needle."""
    one_error_line(result, 2, needles[0])
    assert all(needle in result.stderr for needle in needles), result.stderr


def shard_tokens(path: Path, shard_secret: str) -> Path:
    path.write_text(f"enroll-secret-0123456789 enroll\n{shard_secret} shard\n")
    return path


def test_a_shard_whose_secret_or_certificate_differs_from_shard_0s_refuses_to_start(
    tmp_path: Path,
) -> None:
    """Issue 28, item 2: shard 0 serves HTTPS and calls the others with its shard secret.
    Shard 1 (through typer's runner in this process) refuses to start, in one line, when it
    does not trust shard 0's certificate, holds another shard secret, or none."""
    from processes import self_signed_certificate

    cert, key = self_signed_certificate(tmp_path)
    ports = free_ports(2)
    shared = [o for port in ports for o in ("--shard-url", f"https://127.0.0.1:{port}")]
    tls = ("--tls-cert", str(cert), "--tls-key", str(key))
    leader, _ = start_server(
        tmp_path / "port-0", "--port", str(ports[0]), "--shard", "0", *shared, *tls,
        "--tokens-file", str(shard_tokens(tmp_path / "t0", "shard-secret-0123456789")),
        "--state-dir", str(tmp_path / "s0"),
    )  # fmt: skip
    shard_1 = ("server", "--port", str(ports[1]), "--shard", "1", *shared, *tls,
               "--state-dir", str(tmp_path / "s1"))  # fmt: skip
    same = ("--tokens-file", str(tmp_path / "t0"))
    try:
        refused(run_cli_in_process(*shard_1, *same), "the TLS certificate of shard 0", "--ca-file")
        trusted = ("--ca-file", str(cert))
        other = shard_tokens(tmp_path / "t1", "another-secret-0123456789")
        refused(
            run_cli_in_process(*shard_1, *trusted, "--tokens-file", str(other)),
            "shard 0 refused this shard's secret", "answered 401",
        )  # fmt: skip
        one_error_line(
            run_cli_in_process(*shard_1, *trusted), 2, "shard 0 needs a secret and this shard"
        )
        no_shard_line = tmp_path / "t2"
        no_shard_line.write_text("enroll-secret-0123456789 enroll\n")
        one_error_line(
            run_cli_in_process(*shard_1, *trusted, "--tokens-file", str(no_shard_line)),
            2, "add a line 'SECRET shard' to --tokens-file",
        )  # fmt: skip
        one_error_line(
            run_cli_in_process("server", "--port", "0", "--ca-file", str(cert)),
            2, "--ca-file is for sharded servers",
        )  # fmt: skip
        for bad, says in ((tmp_path / "absent.pem", "does not exist"), (key, "not a readable PEM")):
            refused(run_cli_in_process(*shard_1, "--ca-file", str(bad), *same), "--ca-file", says)
    finally:
        stop_process(leader)


@pytest.mark.slow  # a second shard 0 process; its sibling above runs the other refusals
def test_a_shard_with_secrets_refuses_an_open_shard_0(tmp_path: Path) -> None:
    ports = free_ports(2)
    shared = [o for port in ports for o in ("--shard-url", f"http://127.0.0.1:{port}")]
    leader, _ = start_server(
        tmp_path / "port-0", "--port", str(ports[0]), "--shard", "0", *shared,
        "--state-dir", str(tmp_path / "s0"),
    )  # fmt: skip
    try:
        result = run_cli_in_process(
            "server", "--port", str(ports[1]), "--shard", "1", *shared,
            "--tokens-file", str(shard_tokens(tmp_path / "t", "shard-secret-0123456789")),
            "--state-dir", str(tmp_path / "s1"),
        )  # fmt: skip
        one_error_line(result, 2, "shard 0 runs without secrets and this shard with them")
    finally:
        stop_process(leader)


def test_a_follower_resumes_with_the_outer_settings_its_run_began_with(tmp_path: Path) -> None:
    """A run of two top-k shards began with `--aggregation mean`; shard 1 restarts without
    it, where the codec's default is now sparse_mean (as after an upgrade). It must take its
    stored mean before it compares its settings with shard 0's (it was refused, naming
    aggregation, when it compared first). Shard 0 keeps its stored settings the same way
    when it loads its journal (tests/server/test_server_journal.py)."""
    import json

    import torch
    import urllib3
    from safetensors.torch import save_file

    init = tmp_path / "init.safetensors"
    save_file({"a": torch.zeros(64), "b": torch.ones(64)}, str(init))
    ports = free_ports(2)
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    shared = [option for url in urls for option in ("--shard-url", url)]
    codec = ("--upload-codec", "topk:0.25+int2")

    def start(shard: int, *extra: str) -> subprocess.Popen:
        process, _ = start_server(
            tmp_path / f"port-{shard}", "--port", str(ports[shard]), "--shard", str(shard),
            *shared, "--state-dir", str(tmp_path / f"s{shard}"), *codec, *extra,
        )  # fmt: skip
        return process

    leader = start(0, "--init", str(init), "--aggregation", "mean")
    try:
        stop_process(start(1, "--init", str(init), "--aggregation", "mean"))
        follower = start(1)
        try:
            answer = urllib3.request("GET", f"{urls[1]}/v1/info", timeout=10)
            assert json.loads(answer.data)["settings"]["aggregation"] == "mean"
        finally:
            stop_process(follower)
    finally:
        stop_process(leader)
