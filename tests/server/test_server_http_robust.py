"""`diloco server --aggregation clipped_mean` as a process, over raw HTTP: the submissions are
spooled to disk and held until the barrier, the outlier is refused and the large one clipped
exactly as worked by hand, the audit log says so, and a restart screens the next round with
the same history.

Every tensor of the tests' model is filled with one value v, so a pseudo-gradient's norm is
|v| x sqrt(15): the medians and scales are those of the values themselves (see
test_server_robust.py for the rule).
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch
from test_server_http import Api, gradient, registration
from test_server_identity import init_file

from diloco.wire import decode_tensors

SGD = ("--outer-optimizer", "sgd", "--outer-lr", "1", "--sync-every", "2")


def weights_value(api: Api) -> float:
    tensors = decode_tensors(api.call("GET", "/v1/weights").data)
    values = torch.cat([t.flatten() for t in tensors.values()])
    assert torch.allclose(values, values[0].expand_as(values), atol=0), values
    return float(values[0])


def test_a_clipped_mean_server_refuses_clips_and_remembers_across_a_kill(
    server_process, tmp_path: Path
) -> None:
    args = ("--init", str(init_file(tmp_path)), "--aggregation", "clipped_mean", *SGD,
            "--state-dir", str(tmp_path / "state"))  # fmt: skip
    first = server_process(*args)
    api = Api(first.url)
    for worker in ("a", "b", "c"):
        api.ok("POST", "/v1/workers", json_body=registration(worker))
    assert api.ok("GET", "/v1/info")["settings"]["aggregation"] == "clipped_mean"
    for worker, value in (("a", 1.0), ("b", 1.2), ("c", 50.0)):
        answer = api.submit(worker, gradient(value))
        assert answer.status == 200, answer.data
    # Median 1.2: c's 50 (over 12) refused; the mean of 1 and 1.2 is 1.1.
    assert weights_value(api) == pytest.approx(10 - 1.1, abs=1e-6)

    first.process.send_signal(signal.SIGKILL)
    first.process.wait(timeout=10)
    again = server_process(*args[2:])  # the same state dir, without --init
    api = Api(again.url)
    for worker, value in (("a", 1.0), ("b", 3.0), ("c", 2.0)):
        assert api.submit(worker, gradient(value), round_number=1).status == 200
    # History (1, 1.2) kept: median 1.2, bound 2.4; b's 3 clipped to 2.4; mean 1.8.
    assert weights_value(api) == pytest.approx(8.9 - 1.8, abs=1e-5)
    events = api.ok("GET", "/v1/admin/audit")["events"]
    screened = [(e["event"], e["worker_id"], e["round"]) for e in events
                if e["event"].startswith("contribution_")]  # fmt: skip
    assert screened == [("contribution_refused", "c", 0), ("contribution_clipped", "b", 1)]


@pytest.mark.slow  # in `make test-slow`: the test above reads held spool files tensor by tensor
def test_a_median_server_reads_each_held_body_tensor_by_tensor(
    server_process, tmp_path: Path
) -> None:
    # --memory-bodies 8 would keep these bodies in RAM; held for the barrier, they go to disk.
    server = server_process("--init", str(init_file(tmp_path)), "--aggregation", "median",
                            "--memory-bodies", "8", *SGD)  # fmt: skip
    api = Api(server.url)
    for worker in ("a", "b", "c"):
        api.ok("POST", "/v1/workers", json_body=registration(worker))
    for worker, value in (("a", 1.0), ("b", 2.0), ("c", 9.0)):
        assert api.submit(worker, gradient(value)).status == 200
    assert weights_value(api) == pytest.approx(10 - 2.0, abs=1e-6)  # the median, 2


@pytest.mark.parametrize("codec", ["int8", "int2"])
def test_a_clipped_mean_round_of_three_coded_uploads_commits(live_server, codec: str) -> None:
    """Three workers' coded uploads held by a clipped-mean round: its opposed-sign check reads
    each held body a tensor at a time, and a compressed body was not readable there (an
    assertion: 500 to the last worker, then the round held everything and never committed).
    Every tensor is filled with one value v (coded as the top level times v / that level:
    v within an ulp), so by hand: norms 1, 1.2, 0.9 (x sqrt(15)), median
    1, none over 2x: kept as they are, and the weights move from 10 by their mean."""
    from test_server_http import SHAPES, state

    from diloco.algorithm.compression.codecs import parse_codec
    from diloco.server.settings import ServerSettings
    from diloco.wire.compressed.body import encode_compressed

    settings = ServerSettings(
        outer_optimizer="sgd", outer_lr=1.0, aggregation="clipped_mean", upload_codec=codec
    )
    coded = parse_codec(codec, block=settings.codec_block)
    with live_server(settings, state(10.0)) as server:
        api = Api(server.url)
        for worker in ("a", "b", "c"):
            api.register(worker)
        for worker, value in (("a", 1.0), ("b", 1.2), ("c", 0.9)):
            tensors = {name: torch.full(shape, value) for name, shape in SHAPES.items()}
            answer = api.submit(worker, bytes(encode_compressed(tensors, coded)))
            assert answer.status == 200, answer.data
        assert server.coordinator.round_number == 1
        assert weights_value(api) == pytest.approx(10 - (1.0 + 1.2 + 0.9) / 3, abs=1e-6)
