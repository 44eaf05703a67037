"""Sharded servers as a user runs them: S `diloco server --shard I` processes, real workers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from diloco.server.ops.launch import start_shards, stop_process
from e2e.test_e2e_sync import simulated_run
from processes import start_worker, wait_all


@pytest.fixture
def shards(tmp_path: Path):
    started: list = []

    def start(count: int, *args: str, state: bool = False):
        logs = [tmp_path / f"shard-{i}.log" for i in range(count)]
        per_shard = (lambda i: ("--state-dir", str(tmp_path / f"state-{i}"))) if state else None
        launched = start_shards(
            tmp_path,
            count,
            *args,
            per_shard=per_shard or (lambda _i: ()),
            output=lambda i: logs[i].open("ab"),
        )
        started.extend(process for process, _ in launched)
        return [url for _, url in launched]

    yield start
    for process in started:
        stop_process(process)


def train_two(urls: list[str], corpus: Path, out: Path) -> dict[str, torch.Tensor]:
    """Two tiny workers for 10 steps through the shards' second URL; the joined weights,
    every shard at round 3."""
    workers = [start_worker(urls[1], f"w{i}", i, 2, 10, corpus, out) for i in range(2)]
    wait_all(workers)
    for i, worker in enumerate(workers):
        assert worker.returncode == 0, (out / f"w{i}.log").read_text()
    real, rounds = joined_weights(urls)
    assert rounds == [3, 3]
    return real


def joined_weights(urls: list[str]) -> tuple[dict[str, torch.Tensor], list[int]]:
    from processes import global_weights

    tensors: dict[str, torch.Tensor] = {}
    rounds = []
    for url in urls:
        part, round_number = global_weights(url)
        assert not set(part) & set(tensors), "two shards own the same tensor"
        tensors.update(part)
        rounds.append(round_number)
    return tensors, rounds


@pytest.mark.slow  # its default sibling: test_e2e_shard_crash's simulator check, under a kill
def test_two_shards_and_two_workers_match_the_simulator(
    shards, corpus_file: Path, small_corpus: bytes, tmp_path: Path
) -> None:
    """The sharded run computes the same outer steps as the simulator's one model."""
    urls = shards(2, "--sync-every", "4", "--min-workers", "2", state=True)
    real = train_two(urls, corpus_file, tmp_path)
    simulated = simulated_run(small_corpus, workers=2, steps=10)
    assert real.keys() == simulated.final_state.keys()
    for name, tensor in simulated.final_state.items():
        torch.testing.assert_close(real[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    reports = [json.loads((tmp_path / f"w{i}.json").read_text()) for i in range(2)]
    assert [r["rounds"] for r in reports] == [3, 3]


@pytest.mark.slow  # ~14 s; the default suite keeps the shard secret's routes (in process) and
# every refusal at start against a real HTTPS shard 0 (tests/cli/test_cli_shards.py)
def test_an_https_cluster_with_a_shard_secret_completes_a_run(
    shards, corpus_file: Path, tmp_path: Path
) -> None:
    """Issue 28, item 2, as a deployment runs it: two shards serve HTTPS and call each other
    over TLS (--ca-file) with the tokens file's shard secret; two workers enroll with the
    enrollment token, trust the certificate, and finish their rounds on both shards."""
    from diloco.worker import DiLoCoClient
    from processes import self_signed_certificate

    cert, key = self_signed_certificate(tmp_path)
    enroll = "enroll-secret-0123456789"
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{enroll} enroll\nshard-secret-0123456789 shard\n")
    token_file = tmp_path / "token"
    token_file.write_text(enroll + "\n")
    urls = shards(
        2, "--sync-every", "2", "--min-workers", "2", "--tls-cert", str(cert), "--tls-key",
        str(key), "--ca-file", str(cert), "--tokens-file", str(tokens), state=True,
    )  # fmt: skip
    assert all(url.startswith("https://") for url in urls)
    trusted = ("--ca-file", str(cert), "--token-file", str(token_file))
    workers = [
        start_worker(urls[i], f"w{i}", i, 2, 4, corpus_file, tmp_path, extra=trusted)
        for i in range(2)
    ]
    wait_all(workers)
    for i, worker in enumerate(workers):
        assert worker.returncode == 0, (tmp_path / f"w{i}.log").read_text()
    for url in urls:
        with DiLoCoClient(url, enroll, ca_file=cert) as client:
            status = client.status()
        assert status["round"] == 2  # 4 steps at H = 2, committed on both shards
        assert sorted(w["worker_id"] for w in status["workers"]) == ["w0", "w1"]


@pytest.mark.slow  # ~27 s; in the default suite: the in-process int8 round worked by hand
# (tests/server/test_server_http_shards.py) and split_body's bytes (tests/wire)
@pytest.mark.parametrize("codec", ["int8", "topk:0.1+int2"])
def test_two_shards_with_coded_uploads_match_the_simulator(
    shards, corpus_file: Path, small_corpus: bytes, tmp_path: Path, codec: str
) -> None:
    """Issue 28, item 1: each worker codes its pseudo-gradient (error feedback on) and sends
    each shard its tensors' parts; the shards fold them as one server would, and the run
    ends where the simulator's one model ends with the same codec (top-k: the codec's
    sparse_mean, each shard averaging its elements over their senders, and outer sgd)."""
    urls = shards(2, "--sync-every", "4", "--min-workers", "2", "--upload-codec", codec, state=True)
    real = train_two(urls, corpus_file, tmp_path)
    simulated = simulated_run(
        small_corpus, workers=2, steps=10, upload_codec=codec,
        aggregation="sparse_mean" if codec.startswith("topk") else "mean",
    )  # fmt: skip
    assert real.keys() == simulated.final_state.keys()
    for name, tensor in simulated.final_state.items():
        torch.testing.assert_close(real[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    plain = simulated_run(small_corpus, workers=2, steps=10)  # the codec made a difference
    assert any(not torch.equal(plain.final_state[n], t) for n, t in simulated.final_state.items())


@pytest.mark.slow  # ~28 s; in the default suite: the in-process delta round
# (tests/server/test_server_http_shards.py)
def test_two_shards_with_int8_both_ways_match_the_simulator(
    shards, corpus_file: Path, small_corpus: bytes, tmp_path: Path
) -> None:
    """Each shard codes its tensors' change of the weights as an int8 delta; a worker joins
    the shards' deltas into one and applies it to its anchor: the run ends where the
    simulator ends with int8 both ways."""
    urls = shards(
        2, "--sync-every", "4", "--min-workers", "2", "--upload-codec", "int8",
        "--download-codec", "int8", "--error-feedback-beta", "0.95", state=True,
    )  # fmt: skip
    real = train_two(urls, corpus_file, tmp_path)
    simulated = simulated_run(
        small_corpus, workers=2, steps=10, upload_codec="int8", download_codec="int8",
        error_feedback_beta=0.95,
    )  # fmt: skip
    for name, tensor in simulated.final_state.items():
        torch.testing.assert_close(real[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    reports = [json.loads((tmp_path / f"w{i}.json").read_text()) for i in range(2)]
    assert all(r["rounds"] == 3 for r in reports)
    # every round came as the shards' int8 deltas joined (about a quarter of the model), none
    # as whole weights (the start's initial weights, which two workers may race to send and
    # fetch, are not a round's)
    fp32_mb = sum(t.numel() * 4 for t in real.values()) / 1e6
    down = [figures["mb_down"] for r in reports for figures in r["round_figures"]]
    assert len(down) == 6 and all(mb < 0.4 * fp32_mb for mb in down), (down, fp32_mb)
