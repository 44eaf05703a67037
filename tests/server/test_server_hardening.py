"""Defects an outside test found, each checked where a user meets it: a real `diloco server`
process, raw HTTP (urllib3, never our client), expected values computed by hand here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from test_server_http import SHAPES, Api, gradient

from diloco.wire import decode_tensors


def init_file(tmp_path: Path, value: float = 0.0) -> Path:
    path = tmp_path / "init.safetensors"
    save_file({name: torch.full(shape, value) for name, shape in SHAPES.items()}, str(path))
    return path


def weights_of(api: Api) -> tuple[int, dict[str, torch.Tensor]]:
    response = api.call("GET", "/v1/weights")
    assert response.status == 200, response.data[:300]
    return int(response.headers["X-Diloco-Round"]), decode_tensors(response.data)


def test_delayed_nesterov_n4_cycle_applies_one_momentum_step_over_http(server_process, tmp_path):
    """--dn-period 4 --dn-c 0.1, lr 1, beta 0.9, g = 1 per arrival from theta 0: by hand
    (tests/algorithm/test_algo_delayed_nesterov.py) -1.63 after 4 arrivals, -4.097 after 8;
    the (1 - c) reading of the c term gave -1.81 after 4."""
    server = server_process(
        "--mode", "async", "--dn-period", "4", "--dn-c", "0.1", "--outer-lr", "1",
        "--init", str(init_file(tmp_path)),
    )  # fmt: skip
    api = Api(server.url)
    api.register("a")
    seen = {}
    for version in range(8):
        response = api.submit("a", gradient(1.0), round_number=version)
        assert response.status == 200, response.data[:300]
        round_number, weights = weights_of(api)
        assert round_number == version + 1
        assert torch.all(weights["layer.weight"] == weights["layer.weight"].flatten()[0])
        seen[version + 1] = weights["layer.bias"][0].item()
    assert seen[4] == pytest.approx(-1.63, abs=1e-5)
    assert seen[8] == pytest.approx(-4.097, abs=1e-5)


def test_dn_c_over_its_bound_is_one_error_line(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "diloco.cli", "server", "--mode", "async", "--dn-period", "8",
         "--dn-c", "0.2", "--port", "0"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    assert "c must be in [0, 1/(N - 1)]" in lines[0]
    assert "Traceback" not in result.stderr


def test_token_weighting_refuses_a_submission_without_tokens(server_process, tmp_path):
    """It would weigh 0: with every worker like it the model never moved, silently."""
    server = server_process(
        "--weighting", "tokens", "--outer-optimizer", "sgd", "--outer-lr", "1",
        "--init", str(init_file(tmp_path, 10.0)),
    )  # fmt: skip
    api = Api(server.url)
    api.register("a")
    before = api.snapshot()
    for query in ("", "&tokens=0"):
        error = api.rejects(api.submit("a", gradient(-2.0), query=query), 422, "tokens_required")
        assert error["detail"] == {"field": "tokens", "got": 0}
        assert "--weighting tokens" in error["error"]
    assert api.snapshot() == before
    assert api.submit("a", gradient(-2.0), query="&tokens=5").status == 200
    round_number, weights = weights_of(api)
    assert round_number == 1 and torch.all(weights["layer.weight"] == 12.0)


def test_integers_past_int64_are_refused_and_a_restart_still_works(server_process, tmp_path):
    """`tokens=2**63` once passed the query check, overflowed SQLite after the checkpoint was
    written, and left a state dir that could not be restarted. Every count is now bounded
    (2**48) at the door, and the largest allowed values commit and restart."""
    state = tmp_path / "state"
    args = ("--weighting", "tokens", "--outer-optimizer", "sgd", "--outer-lr", "1",
            "--state-dir", str(state))  # fmt: skip
    server = server_process(*args, "--init", str(init_file(tmp_path, 10.0)))
    api = Api(server.url)
    api.register("a")
    before = api.snapshot()
    huge = 2**63
    for query in (f"&tokens={huge}", f"&tokens={2**48 + 1}", f"&fragment={huge}"):
        api.rejects(api.submit("a", gradient(-2.0), query=query), 422, "invalid_request")
    api.rejects(api.submit("a", gradient(-2.0), round_number=huge), 422, "invalid_request")
    api.rejects(api.result("a", round_number=huge), 422, "invalid_request")
    beat = {"step": huge, "steps_per_second": 1.0, "loss": None, "tokens": 0}
    response = api.call("POST", "/v1/workers/a/heartbeat", json_body=beat)
    api.rejects(response, 422, "invalid_request", "step")
    response = api.call("POST", "/v1/workers/a/heartbeat", json_body={**beat, "step": 1,
                        "tokens": huge})  # fmt: skip
    api.rejects(response, 422, "invalid_request", "tokens")
    assert api.snapshot() == before
    assert api.submit("a", gradient(-2.0), query=f"&tokens={2**48}").status == 200
    assert weights_of(api)[0] == 1
    server.process.terminate()
    assert server.process.wait(timeout=30) == 0
    again = Api(server_process(*args).url)
    round_number, weights = weights_of(again)
    assert round_number == 1 and torch.all(weights["layer.weight"] == 12.0)
