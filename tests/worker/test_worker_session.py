"""ServerSession's exchange where the body's buffer also takes the result (fp32 both ways).

The server here is a stand-in: a real one never asks for a submission again after a result
has started to come (its commit is durable before the result is out), so the case the
session guards against, a download that wrote over the body and then a resend, cannot be
made with a real server."""

from __future__ import annotations

import torch

from diloco.wire import decode_tensors, encode_tensors
from diloco.worker.data.units import UnitReports
from diloco.worker.errors import ServerError
from diloco.worker.net.client import Weights
from diloco.worker.session import ServerSession


class LosesTheFirstUpload:
    """Takes a submission, then writes half a result into the download buffer and says the
    submission was lost (not_submitted); the second submission gets the result."""

    def __init__(self, result: bytes) -> None:
        self.result = result
        self.submitted: list[bytes] = []
        self.last_waiting: dict = {}
        self.waits = 0

    def submit(self, round_number: int, worker_id: str, body: bytearray, **_: object) -> dict:
        self.submitted.append(bytes(body))
        return {"status": "accepted"}

    def wait_result(self, round_number: int, worker_id: str, *, into=None, **_: object):
        self.waits += 1
        if self.waits == 1:
            assert into is not None
            into[: len(into) // 2] = b"\xff" * (len(into) // 2)  # a download cut short
            raise ServerError(409, "not_submitted", "the server restarted without it")
        buffer = into if into is not None and len(into) == len(self.result) else bytearray()
        buffer[:] = self.result
        return Weights(buffer, round_number + 1)


def test_a_resend_after_a_download_wrote_over_the_body_sends_the_body_built_again() -> None:
    upload = {"w": torch.tensor([0.5, -1.0, 2.0])}
    result = {"w": torch.tensor([1.0, 2.0, 3.0])}
    server = LosesTheFirstUpload(encode_tensors(result))
    session = ServerSession(server, [], UnitReports(), worker_id="a")  # type: ignore[arg-type]
    body = bytearray(encode_tensors(upload))
    builds = []

    def rebuild() -> bytearray:
        body[:] = encode_tensors(upload)  # anchor - local again, into the same buffer
        builds.append(1)
        return body

    got = session.exchange(body, [], 0, tokens=0, rebuild=rebuild)
    assert server.submitted == [encode_tensors(upload)] * 2  # the same bytes both times
    assert len(builds) == 1
    assert got.round == 1 and torch.equal(got.tensors["w"], result["w"])
    assert session.download_buffer is body  # the result came into the body's buffer


def test_without_rebuild_the_result_never_comes_into_the_body() -> None:
    upload = {"w": torch.tensor([0.5, -1.0, 2.0])}
    server = LosesTheFirstUpload(encode_tensors({"w": torch.tensor([1.0, 2.0, 3.0])}))
    session = ServerSession(server, [], UnitReports(), worker_id="a")  # type: ignore[arg-type]
    session._download = bytearray(len(encode_tensors(upload)))  # the last weights' buffer
    body = bytearray(encode_tensors(upload))
    got = session.exchange(body, [], 0, tokens=0)
    assert server.submitted == [encode_tensors(upload)] * 2
    assert decode_tensors(body)["w"].tolist() == [0.5, -1.0, 2.0]
    assert got.round == 1 and session.download_buffer is not body
