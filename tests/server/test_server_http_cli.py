"""`diloco server` as a user runs it: --init weights over HTTP, bad options, SIGTERM."""

from __future__ import annotations

import signal
import sqlite3
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import torch
import urllib3
from safetensors.torch import save_file

from diloco.server.coordinator import Coordinator
from diloco.server.settings import ServerSettings
from diloco.server.state.journal import RoundJournal
from diloco.server.state.store import StateStore
from diloco.wire import TensorSpec, decode_tensors, fingerprint
from processes import run_all, run_each_in_process

TIMEOUT = urllib3.Timeout(connect=5.0, read=20.0)


def pool_for(url: str) -> urllib3.HTTPConnectionPool:
    parts = urlsplit(url)
    assert parts.hostname == "127.0.0.1"
    return urllib3.HTTPConnectionPool("127.0.0.1", parts.port, timeout=TIMEOUT, retries=False)


def initial_tensors() -> dict[str, torch.Tensor]:
    return {
        "embed.weight": torch.linspace(-1, 1, 10).reshape(5, 2).to(torch.bfloat16),
        "layer.bias": torch.tensor([0.5, -1.25, 3.0]),
        "step": torch.tensor(7, dtype=torch.int64),
    }


def test_init_file_is_served_as_round_0_weights(server_process, tmp_path: Path):
    tensors = initial_tensors()
    init = tmp_path / "init.safetensors"
    save_file(tensors, str(init))
    server = server_process("--init", str(init))
    pool = pool_for(server.url)

    weights = pool.request("GET", "/v1/weights")
    assert weights.status == 200, weights.data[:300]
    assert weights.headers["X-Diloco-Round"] == "0"
    served = decode_tensors(weights.data)
    assert set(served) == set(tensors)
    for name, tensor in tensors.items():
        expected = tensor.float() if tensor.is_floating_point() else tensor
        assert served[name].dtype == expected.dtype, name  # floats served in fp32 (default)
        assert torch.equal(served[name], expected), name

    specs = [TensorSpec(name, tuple(t.shape), t.dtype, "trainable") for name, t in tensors.items()]
    info = pool.request("GET", "/v1/info").json()
    assert info["protocol_version"] == 1 and info["round"] == 0
    assert info["model_fingerprint"] == fingerprint(specs)
    assert server.process.poll() is None


def test_sigterm_stops_the_server_with_exit_code_0(server_process):
    server = server_process()
    assert pool_for(server.url).request("GET", "/healthz").json() == {"ok": True}
    started = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    code = server.process.wait(timeout=15)
    assert code == 0, server.log.read_text()
    assert time.monotonic() - started < 5.0
    log = server.log.read_text()
    assert "server stopped" in log
    assert "Traceback" not in log


@pytest.mark.parametrize(
    "part",
    [
        pytest.param("in-process", id="in-process"),  # every case, through typer's runner
        pytest.param("one-process", id="one-process"),  # a real `diloco server` process
        pytest.param("processes", id="processes", marks=pytest.mark.slow),  # every case
    ],
)
def test_bad_options_exit_2_with_one_error_line(tmp_path: Path, part: str):
    """Each fails before listening: exit code 2, one `error:` line on stderr, no traceback."""
    not_safetensors = tmp_path / "weights.safetensors"
    not_safetensors.write_bytes(b"this is a text file, not a safetensors file\n")
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    # Runs that were started with the default sync H = 50. One per case: the cases run at
    # once, and a state dir is locked by whichever process opens it first.
    written_states = {}
    for name in ("settings", "mode"):
        written_states[name] = tmp_path / f"state-{name}"
        journal = RoundJournal(StateStore(written_states[name]), ServerSettings())
        Coordinator(ServerSettings(), {"w": torch.zeros(2)}, journal=journal).shutdown()
    foreign = tmp_path / "photos"  # somebody's directory, not a state dir
    foreign.mkdir()
    (foreign / "holiday.jpg").write_bytes(b"\xff\xd8")
    newer = tmp_path / "newer"  # written by a later diloco
    StateStore(newer).close()
    with sqlite3.connect(newer / "state.sqlite") as db:
        db.execute("UPDATE meta SET value = '99' WHERE key = 'format'")
    cases = {
        "missing --init": (["--init", str(tmp_path / "missing.safetensors")], "--init"),
        "--init a directory": (["--init", str(tmp_path)], "--init is a directory"),
        "non-safetensors --init": (["--init", str(not_safetensors)], "safetensors"),
        "interval >= timeout": (
            ["--heartbeat-interval", "30", "--heartbeat-timeout", "30"],
            "heartbeat_interval",
        ),
        "outer lr 0": (["--outer-lr", "0"], "lr"),
        "fp16 upload": (["--upload-dtype", "fp16"], "fp16"),
        "unknown codec": (["--upload-codec", "int3"], "unknown codec 'int3'; allowed: fp32"),
        "top-k fraction above 1": (
            ["--upload-codec", "topk:1.5+int2"],
            "top-k fraction must be in (0, 1], got 1.5",
        ),
        "top-k fraction keeping no value of a chunk": (
            ["--upload-codec", "topk:0.0001", "--topk-chunk", "128"],
            "top-k topk:0.0001 keeps k = round(0.0001 x 128) = 0 values of each chunk of 128",
        ),
        "outer momentum against the codec's sgd": (
            ["--upload-codec", "topk:0.03+int2", "--outer-momentum", "0.9"],
            "outer_momentum 0.9 needs outer_optimizer momentum or nesterov",
        ),
        "block not a power of two": (
            ["--codec-block", "100"],
            "block size must be a positive power of two in [8, 65536], got 100",
        ),
        "chunk 0": (["--topk-chunk", "0"], "chunk size must be a positive power of two"),
        "error feedback beta 1": (
            ["--error-feedback-beta", "1"],
            "error_feedback_beta must be in [0, 1) (0: no error feedback), got 1.0",
        ),
        "unknown download codec": (["--download-codec", "fp8"], "unknown codec 'fp8'"),
        "bf16 download dtype with a delta codec": (
            ["--download-dtype", "bf16", "--download-codec", "int8"],
            "with download_codec int8 the full weights are the fp32 published copy",
        ),
        "bf16 dtype with an int8 codec": (
            ["--upload-dtype", "bf16", "--upload-codec", "int8"],
            "with upload_codec int8 give one or the other",
        ),
        "token and token file": (["--token", "abc", "--token-file", str(token_file)], "--token"),
        "keep 0 checkpoints": (["--keep-checkpoints", "0"], "--keep-checkpoints"),
        "negative memory bodies": (["--memory-bodies", "-1"], "memory_bodies"),
        "missing spool dir": (["--spool-dir", str(tmp_path / "nowhere")], "--spool-dir"),
        "state dir with other settings": (
            ["--state-dir", str(written_states["settings"]), "--sync-every", "9"],
            "sync_every: 50 in the state dir, 9 now",
        ),
        "foreign state dir": (["--state-dir", str(foreign)], "not a diloco state directory"),
        "state dir is a file": (["--state-dir", str(token_file)], "is not a directory"),
        "unwritable state dir": (["--state-dir", "/proc/diloco-state"], "cannot be"),
        "newer state dir": (["--state-dir", str(newer)], "newer diloco"),
        "unknown durability": (["--durability", "sometimes"], "--durability"),
        "unknown mode": (["--mode", "bogus"], "mode must be one of sync, streaming, async"),
        "fragments in sync mode": (["--fragments", "2"], "--fragments applies to --mode streaming"),
        "async with a barrier timeout": (
            ["--mode", "async", "--barrier-timeout", "5"],
            "--barrier-timeout does not apply to --mode async",
        ),
        "state dir of another mode": (
            ["--state-dir", str(written_states["mode"]), "--mode", "async"],
            "written with mode 'sync'",
        ),
        "fragments that do not divide H": (
            ["--mode", "streaming", "--sync-every", "50", "--fragments", "3"],
            "sync_every H must be divisible by fragments P, got H = 50, P = 3",
        ),
        "delay at the window": (
            ["--mode", "streaming", "--sync-every", "20", "--fragments", "4", "--delay", "5"],
            "delay tau must be in [0, S) with S = H / P = 5, got 5",
        ),
        "alpha above 1": (
            ["--mode", "streaming", "--fragments", "2", "--alpha", "1.5"],
            "alpha must be in [0, 1], got 1.5",
        ),
        "dn-period 0": (["--mode", "async", "--dn-period", "0"], "dn_period must be"),
        "negative grace": (["--mode", "async", "--grace-seconds", "-1"], "grace_seconds must be"),
        "dylu in sync mode": (["--dylu"], "dylu applies to"),
        "interval without a state dir": (["--durability", "interval"], "needs --state-dir"),
        "checkpoint-every on a shard": (
            [
                *("--shard", "1", "--shard-url", "http://127.0.0.1:9"),
                *("--shard-url", "http://127.0.0.1:10", "--checkpoint-every", "5"),
            ],
            "sharded servers checkpoint every round",
        ),
        "checkpoint-every 0": (
            [
                "--state-dir",
                str(tmp_path / "new"),
                "--durability",
                "interval",
                "--checkpoint-every",
                "0",
            ],
            "--checkpoint-every must be >= 1",
        ),
        "unknown aggregation": (["--aggregation", "mode"], "aggregation must be one of mean"),
        "median in async mode": (
            ["--mode", "async", "--aggregation", "median"],
            "mode async applies each arrival alone",
        ),
        "tensorboard on a file": (
            ["--tensorboard", str(Path(__file__))],
            "is a file, not a directory",
        ),
        "zero threads": (["--threads", "0"], "--threads must be a positive integer, got 0"),
        # from an outside review: each was a traceback, or an error after the state dir
        "port file a directory": (["--port-file", str(tmp_path)], "--port-file is a directory"),
        "port file inside a file": (
            ["--port-file", str(token_file / "port")],
            "--port-file is inside a file",
        ),
        "infinite body limit": (["--max-body-mib", "inf"], "--max-body-mib must be a finite"),
        "body limit under a byte": (["--max-body-mib", "1e-9"], "--max-body-mib must be a finite"),
        "tensorboard on a file before the state dir": (
            ["--tensorboard", str(token_file), "--state-dir", str(tmp_path / "not-made")],
            "is a file, not a directory",
        ),
        "unknown log level": (["--log-level", "bogus"], "--log-level must be one of"),
        "host nobody has": (["--host", "999.1.1.1"], "--host '999.1.1.1' is not an address"),
    }
    if part == "one-process":
        cases = dict(list(cases.items())[:1])
    commands = {
        label: ["server", "--host", "127.0.0.1", "--port", "0", *args]  # binds nothing fixed
        if "--host" not in args
        else ["server", "--port", "0", *args]
        for label, (args, _) in cases.items()
    }
    in_process = part == "in-process"  # run_all: at once, as each pays the interpreter's start
    outcomes = (run_each_in_process if in_process else run_all)(commands)
    assert not (tmp_path / "not-made").exists()  # nothing written before the refusal
    for label, (code, stdout, stderr) in outcomes.items():
        lines = [line for line in stderr.splitlines() if line.strip()]
        assert code == 2, (label, code, stderr)
        assert "Traceback" not in stderr and "Traceback" not in stdout, (label, stderr)
        assert len(lines) == 1, (label, stderr)
        assert lines[0].startswith("error: "), (label, stderr)
        assert cases[label][1] in lines[0], (label, lines[0])
