"""The result is served from the masters' own buffer: a slow reader must never see a later round.

The commit updates the masters in place unless a response still holds a view of them. This runs
the real server and a real socket: an observer reads the first megabyte of a 32 MB /v1/weights
answer and stalls (the rest cannot fit in the loopback buffers, so the server still sends from
its buffer), two workers commit the next round meanwhile, and the observer then reads the rest.
"""

from __future__ import annotations

import http.client
from urllib.parse import urlsplit

import torch

from diloco.server.settings import ServerSettings
from diloco.wire import decode_tensors, encode_tensors, specs_of
from diloco.worker import DiLoCoClient

SIZE = 8 * 1024 * 1024  # fp32 values: a 32 MB body


def test_a_stalled_download_keeps_its_bytes_while_the_next_round_commits(live_server) -> None:
    settings = ServerSettings(sync_every=1, outer_optimizer="sgd", outer_lr=1.0)
    with live_server(settings, {"w": torch.zeros(SIZE)}) as server:
        specs = [s.to_json() for s in specs_of({"w": torch.zeros(SIZE)}, {"w": "trainable"})]
        client = DiLoCoClient(server.url, read_timeout=120)
        client.register("a", specs)
        client.register("b", specs)
        frames = server.coordinator.model.frames
        assert frames is not None
        served = frames.current
        parts = urlsplit(server.url)
        observer = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
        observer.request("GET", "/v1/weights")
        answer = observer.getresponse()
        assert answer.status == 200 and answer.getheader("X-Diloco-Round") == "0"
        head = answer.read(1 << 20)
        pseudo_gradient = bytes(encode_tensors({"w": torch.full((SIZE,), -1.0)}))
        client.submit(0, "a", pseudo_gradient)
        client.submit(0, "b", pseudo_gradient)
        masters = server.coordinator.masters
        assert server.coordinator.round_number == 1 and masters is not None
        assert torch.equal(masters["w"], torch.ones(SIZE))
        assert frames.current is not served  # the reader's buffer was left to it
        received = decode_tensors(head + answer.read())
        assert torch.equal(received["w"], torch.zeros(SIZE))  # round 0's weights, whole
        observer.close()
        # Once nobody reads it, the next round's weights are written in place again.
        current = frames.current
        client.submit(1, "a", pseudo_gradient)
        client.submit(1, "b", pseudo_gradient)
        assert frames.current is current
        weights, round_number = client.get_weights()
        assert round_number == 2
        assert torch.equal(decode_tensors(weights)["w"], torch.full((SIZE,), 2.0))
        client.close()
