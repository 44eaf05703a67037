"""Pydantic models of the JSON messages, request parsing and the 422 sentences."""

import json
import typing

import pydantic
import pytest
import torch

from diloco.wire import (
    DTYPE_NAMES,
    PROTOCOL_VERSION,
    TENSOR_KINDS,
    ErrorBody,
    HeartbeatRequest,
    HeartbeatResponse,
    InfoResponse,
    RegisterRequest,
    RegisterResponse,
    Settings,
    StatusResponse,
    SubmitResponse,
    TensorSpec,
    TensorSpecModel,
    WaitingResponse,
    WireError,
    check_protocol_version,
    is_worker_id,
    parse_request,
    validation_error_to_wire,
)

SETTINGS = {
    "sync_every": 50,
    "upload_dtype": "float32",
    "download_dtype": "float32",
    "heartbeat_interval": 5.0,
    "heartbeat_timeout": 30.0,
    "barrier_timeout": 600.0,
    "fragments": 1,
    "delay": 0,
    "alpha": 0.0,
    "dylu": False,
    "weighting": "uniform",
    "min_workers": 1,
    "max_body_bytes": 4294967296,
    "outer_optimizer": {"kind": "nesterov", "lr": 0.7, "momentum": 0.9},
}
INFO = {
    "protocol_version": 1,
    "mode": "sync",
    "round": 0,
    "model_fingerprint": "ab12",
    "settings": SETTINGS,
}
TENSOR = {"name": "head.weight", "shape": [256, 64], "dtype": "float32", "kind": "trainable"}
REGISTER = {"protocol_version": 1, "worker_id": "w0", "tensors": [TENSOR]}
HEARTBEAT = {"step": 120, "steps_per_second": 2.5, "loss": 3.1, "tokens": 4096}


def _invalid(model: type[pydantic.BaseModel], body: object) -> WireError:
    with pytest.raises(WireError) as caught:
        parse_request(model, json.dumps(body).encode())
    assert (caught.value.status, caught.value.kind) == (422, "invalid_request")
    return caught.value


def test_literals_match_the_dtype_and_kind_tables() -> None:
    fields = TensorSpecModel.model_fields
    assert typing.get_args(fields["dtype"].annotation) == DTYPE_NAMES
    assert typing.get_args(fields["kind"].annotation) == TENSOR_KINDS


def test_info_example_of_the_protocol_parses_and_ignores_new_fields() -> None:
    info = InfoResponse.model_validate({**INFO, "new_field": 1})
    assert info.settings.outer_optimizer.lr == 0.7
    assert info.settings.max_body_bytes == 4294967296
    assert "new_field" not in info.model_dump()
    assert (
        InfoResponse.model_validate({**INFO, "model_fingerprint": None}).model_fingerprint is None
    )


def test_a_missing_setting_is_named() -> None:
    settings = {key: value for key, value in SETTINGS.items() if key != "barrier_timeout"}
    with pytest.raises(pydantic.ValidationError) as caught:
        InfoResponse.model_validate({**INFO, "settings": settings})
    error = validation_error_to_wire(caught.value)
    assert error.error == "field 'settings.barrier_timeout' is required"
    assert error.detail["field"] == "settings.barrier_timeout"


def test_settings_accept_only_wire_float_dtypes() -> None:
    assert Settings.model_validate({**SETTINGS, "upload_dtype": "bfloat16"}).upload_dtype == (
        "bfloat16"
    )
    with pytest.raises(pydantic.ValidationError):
        Settings.model_validate({**SETTINGS, "download_dtype": "int8"})


def test_other_responses_parse() -> None:
    register = RegisterResponse.model_validate(
        {
            "worker_id": "w0",
            "round": 3,
            "needs_initial_weights": False,
            "model_fingerprint": None,
            "settings": SETTINGS,
        }
    )
    assert register.round == 3
    submit = SubmitResponse.model_validate(
        {"status": "committed", "round": 2, "current_round": 3, "waiting_for": []}
    )
    assert submit.status == "committed"
    waiting = WaitingResponse.model_validate(
        {"status": "waiting", "round": 2, "waiting_for": ["a"]}
    )
    assert waiting.waiting_for == ["a"]
    beat = HeartbeatResponse.model_validate(
        {"round": 1, "recommended_sync_every": None, "command": None}
    )
    assert beat.command is None
    status = StatusResponse.model_validate(
        {
            "round": 4,
            "mode": "sync",
            "workers": [
                {
                    "worker_id": "w0",
                    "live": True,
                    "step": 10,
                    "steps_per_second": 1.5,
                    "loss": None,
                    "tokens": 0,
                    "last_seen_seconds_ago": 0.2,
                    "rounds_contributed": 4,
                }
            ],
            "waiting_for": ["w0"],
            "bytes_in": 1,
            "bytes_out": 2,
            "rounds_per_hour": 12.0,
            "uptime_seconds": 300.0,
        }
    )
    assert status.workers[0].live


def test_error_body_is_what_wire_error_sends() -> None:
    error = WireError(409, "future_round", "round 7 has not started", current_round=5)
    assert isinstance(error, ValueError)
    body = ErrorBody.model_validate(error.to_body())
    assert body.model_dump() == {
        "error": "round 7 has not started",
        "kind": "future_round",
        "detail": {"current_round": 5},
    }


def test_register_request_parses_into_specs() -> None:
    request = parse_request(RegisterRequest, json.dumps(REGISTER))
    assert request.specs() == [TensorSpec("head.weight", (256, 64), torch.float32, "trainable")]
    anonymous = parse_request(RegisterRequest, {**REGISTER, "worker_id": None})
    assert anonymous.worker_id is None
    spec = TensorSpec("n", (), torch.int64, "int_buffer")
    assert TensorSpecModel.from_spec(spec).to_spec() == spec


@pytest.mark.parametrize("version", [2, 0, "1", 1.0, True, None])
def test_protocol_version_is_checked_before_fields(version: object) -> None:
    with pytest.raises(WireError) as caught:
        parse_request(RegisterRequest, {"protocol_version": version, "tensors": "nonsense"})
    assert (caught.value.status, caught.value.kind) == (400, "protocol_version")
    assert "protocol_version must be 1" in caught.value.error


def test_missing_protocol_version_is_not_version_1() -> None:
    with pytest.raises(WireError) as caught:
        check_protocol_version({"worker_id": "w0"})
    assert caught.value.status == 400
    check_protocol_version({"protocol_version": PROTOCOL_VERSION})


@pytest.mark.parametrize(
    ("change", "sentence"),
    [
        ({"tensors": []}, "field 'tensors' must have at least 1 item(s), got []"),
        ({"worker_id": "-w"}, "field 'worker_id' must match"),
        ({"worker_id": "w" * 65}, "field 'worker_id' must match"),
        ({"worker_id": 7}, "field 'worker_id' must be a string, got 7"),
        ({"surprise": 1}, "field 'surprise' is not a field of this request"),
        ({"tensors": [{**TENSOR, "shape": [256, "64"]}]}, "field 'tensors.0.shape' must be a list"),
        (
            {"tensors": [{**TENSOR, "shape": [-1]}]},
            "field 'tensors.0.shape.0' must be >= 0, got -1",
        ),
        ({"tensors": [{**TENSOR, "dtype": "fp32"}]}, "field 'tensors.0.dtype' must be 'float32'"),
        ({"tensors": [{**TENSOR, "kind": "x"}]}, "field 'tensors.0.kind' must be 'trainable'"),
        (
            {"tensors": [TENSOR, TENSOR]},
            "field 'tensors' is invalid: tensor 'head.weight' is listed",
        ),
    ],
)
def test_register_field_errors_name_the_field(change: dict, sentence: str) -> None:
    assert _invalid(RegisterRequest, {**REGISTER, **change}).error.startswith(sentence)


def test_a_list_item_of_the_wrong_type_is_named_as_in_the_protocol_notes() -> None:
    error = _invalid(RegisterRequest, {**REGISTER, "tensors": [{**TENSOR, "shape": [1.5]}]})
    assert error.error == "field 'tensors.0.shape' must be a list of integers; item 0 is 1.5"
    assert error.detail["field"] == "tensors.0.shape.0"


def test_heartbeat_request() -> None:
    beat = parse_request(HeartbeatRequest, {**HEARTBEAT, "loss": None, "steps_per_second": 0})
    assert beat.loss is None and beat.steps_per_second == 0.0


@pytest.mark.parametrize(
    ("change", "sentence"),
    [
        ({"step": -1}, "field 'step' must be >= 0, got -1"),
        ({"step": 1.0}, "field 'step' must be an integer, got 1.0"),
        ({"step": "1"}, "field 'step' must be an integer"),
        ({"tokens": True}, "field 'tokens' must be an integer, got true"),
        ({"steps_per_second": -0.5}, "field 'steps_per_second' must be >= 0"),
        ({"steps_per_second": float("inf")}, "field 'steps_per_second' must be a finite number"),
        ({"loss": float("nan")}, "field 'loss' must be a finite number, got NaN"),
        ({"loss": "low"}, "field 'loss' must be a number"),
    ],
)
def test_heartbeat_field_errors(change: dict, sentence: str) -> None:
    assert _invalid(HeartbeatRequest, {**HEARTBEAT, **change}).error.startswith(sentence)


def test_missing_field_and_whole_body_errors() -> None:
    body = {key: value for key, value in HEARTBEAT.items() if key != "tokens"}
    assert _invalid(HeartbeatRequest, body).error == "field 'tokens' is required"
    assert _invalid(HeartbeatRequest, [1, 2]).error == "the request body must be a JSON object"
    with pytest.raises(WireError, match="not valid JSON") as caught:
        parse_request(HeartbeatRequest, b"{step: 1}")
    assert caught.value.kind == "invalid_request"


def test_worker_ids() -> None:
    assert is_worker_id("w0") and is_worker_id("node-3.gpu_1") and is_worker_id("a" * 64)
    for bad in ["", "-w", ".w", "a" * 65, "w 0", "w/0", "w0\n", "wé"]:
        assert not is_worker_id(bad), bad
