"""Concurrent uploads beyond --memory-bodies go to disk and fold exactly like the others."""

from __future__ import annotations

import http.client
import json
import time
from urllib.parse import urlsplit

import torch

from diloco.server.http import app as app_module
from diloco.server.settings import ServerSettings
from diloco.wire import PROTOCOL_HEADER, decode_tensors, encode_tensors, specs_of
from diloco.worker import DiLoCoClient, ServerError

SPECS = [s.to_json() for s in specs_of({"w": torch.zeros(64, 64)}, {"w": "trainable"})]


def body(value: float) -> bytes:
    return bytes(encode_tensors({"w": torch.full((64, 64), value)}))


def test_a_second_upload_in_flight_is_spooled_and_the_round_is_exact(
    live_server, monkeypatch
) -> None:
    spooled = []
    real_spool_body = app_module.spool_body

    async def counting_spool_body(*args, **kwargs):
        spooled.append(await real_spool_body(*args, **kwargs))
        return spooled[-1]

    monkeypatch.setattr(app_module, "spool_body", counting_spool_body)
    settings = ServerSettings(
        sync_every=1, outer_optimizer="sgd", outer_lr=1.0, min_workers=3, memory_bodies=1
    )
    with live_server(settings, {"w": torch.full((64, 64), 10.0)}) as server:
        client = DiLoCoClient(server.url)
        for worker in ("slow", "fast", "nan"):
            client.register(worker, SPECS)
        # "slow" holds the only RAM slot: headers and half its body, then it pauses.
        slow_body = body(-2.0)
        parts = urlsplit(server.url)
        connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
        connection.putrequest("POST", "/v1/rounds/0/submissions?worker_id=slow")
        connection.putheader("Content-Length", str(len(slow_body)))
        connection.putheader(PROTOCOL_HEADER, "1")
        connection.endheaders()
        connection.send(slow_body[: len(slow_body) // 2])
        time.sleep(0.3)  # the server is now reading it into memory
        # A NaN body while the slot is taken is spooled, checked from disk and refused.
        poisoned = torch.full((64, 64), 1.0)
        poisoned[3, 7] = float("nan")
        try:
            client.submit(0, "nan", bytes(encode_tensors({"w": poisoned})))
            raise AssertionError("a NaN body was accepted")
        except ServerError as error:
            assert error.status == 422 and error.kind == "non_finite"
            assert "'w'" in error.error
        # A good one is spooled too, and counted.
        assert client.submit(0, "fast", body(-8.0))["status"] == "accepted"
        assert client.submit(0, "nan", body(-5.0))["status"] == "accepted"
        assert len(spooled) == 3  # nan, fast and the nan worker's retry all went to disk
        assert all(body.closed for body in spooled)  # and are done with
        # One after the other, they were written into the same kept file.
        assert len({id(body.file) for body in spooled}) == 1
        connection.send(slow_body[len(slow_body) // 2 :])
        reply = connection.getresponse()
        assert reply.status == 200, reply.read()
        assert json.loads(reply.read())["status"] == "accepted"
        connection.close()
        result, round_number = client.get_weights()
        assert round_number == 1
        # FedAvg of 10 - (-2), 10 - (-8), 10 - (-5): 15 everywhere.
        assert torch.equal(decode_tensors(result)["w"], torch.full((64, 64), 15.0))
        client.close()


def test_an_unwritable_spool_dir_is_503_and_changes_nothing(live_server, tmp_path) -> None:
    spool_dir = tmp_path / "spool"
    spool_dir.mkdir()
    settings = ServerSettings(
        sync_every=1, outer_optimizer="sgd", outer_lr=1.0, spool_dir=str(spool_dir)
    )
    with live_server(settings, {"w": torch.full((64, 64), 10.0)}) as server:
        client = DiLoCoClient(server.url)
        client.register("a", SPECS)
        spool_dir.rmdir()  # the disk went away
        raw = urlsplit(server.url)
        connection = http.client.HTTPConnection(raw.hostname, raw.port, timeout=30)
        payload = body(-2.0)
        connection.request(
            "POST",
            "/v1/rounds/0/submissions?worker_id=a",
            body=payload,
            headers={"Content-Length": str(len(payload)), PROTOCOL_HEADER: "1"},
        )
        reply = connection.getresponse()
        answer = json.loads(reply.read())
        assert reply.status == 503 and answer["kind"] == "spool_unavailable"
        assert server.coordinator.round_number == 0 and server.coordinator.round.submitted == {}
        spool_dir.mkdir()  # back: the same submission now goes through
        assert client.submit(0, "a", payload)["status"] == "accepted"
        assert server.coordinator.round_number == 1
        connection.close()
        client.close()
