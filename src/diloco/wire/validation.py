"""Turning a bad JSON request into one sentence that names the field, and parsing requests.

Pydantic reports every problem with its own wording; the protocol wants a single 422
`invalid_request` whose sentence names the first bad field path and what it must be, so a
person reading a worker's log can fix the call without reading the server's code.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, TypeVar

import pydantic

from diloco.wire.errors import WireError

PROTOCOL_VERSION = 1
# Every request of a worker names the protocol it speaks; the server refuses another version.
PROTOCOL_HEADER = "X-Diloco-Protocol"

Model = TypeVar("Model", bound=pydantic.BaseModel)

# Error type -> what the field must be (formatted with the error's ctx).
_EXPECTATIONS = {
    "missing": "is required",
    "extra_forbidden": "is not a field of this request",
    "int_type": "must be an integer",
    "int_parsing": "must be an integer",
    "int_from_float": "must be an integer",
    "float_type": "must be a number",
    "float_parsing": "must be a number",
    "finite_number": "must be a finite number",
    "string_type": "must be a string",
    "bool_type": "must be true or false",
    "bool_parsing": "must be true or false",
    "list_type": "must be a list",
    "dict_type": "must be an object",
    "model_type": "must be an object",
    "model_attributes_type": "must be an object",
    "none_required": "must be null",
    "string_pattern_mismatch": "must match {pattern}",
    "string_too_short": "must have at least {min_length} characters",
    "string_too_long": "must have at most {max_length} characters",
    "too_short": "must have at least {min_length} item(s)",
    "too_long": "must have at most {max_length} item(s)",
    "greater_than_equal": "must be >= {ge}",
    "greater_than": "must be > {gt}",
    "less_than_equal": "must be <= {le}",
    "less_than": "must be < {lt}",
    "literal_error": "must be {expected}",
}

# Error types about an item's type, worded as "a list of <noun>" for list items.
_ITEM_NOUNS = {
    "int_type": "integers",
    "int_parsing": "integers",
    "int_from_float": "integers",
    "float_type": "numbers",
    "float_parsing": "numbers",
    "string_type": "strings",
    "bool_type": "booleans",
    "dict_type": "objects",
    "model_type": "objects",
}

_NO_INPUT = frozenset({"missing", "extra_forbidden", "value_error", "assertion_error"})


def validation_error_to_wire(exc: pydantic.ValidationError) -> WireError:
    """WireError(422, "invalid_request") naming the first bad field and what it must be."""
    errors = exc.errors(include_url=False)
    if not errors:
        return WireError(422, "invalid_request", "the request is invalid")
    first = errors[0]
    kind = first["type"]
    loc = tuple(first.get("loc", ()))
    got = None if kind in _NO_INPUT else _short(first.get("input"))
    expectation = _expectation(first)
    path = ".".join(str(part) for part in loc)
    if not loc:
        if kind in ("model_type", "dict_type", "model_attributes_type"):
            sentence = "the request body must be a JSON object"
        elif kind == "json_invalid":
            sentence = "the request body is not valid JSON"
        else:
            sentence = f"the request is invalid: {_message(first)}"
    elif isinstance(loc[-1], int) and kind in _ITEM_NOUNS and len(loc) > 1:
        parent = ".".join(str(part) for part in loc[:-1])
        sentence = (
            f"field {parent!r} must be a list of {_ITEM_NOUNS[kind]}; item {loc[-1]} is {got}"
        )
    elif expectation is None:
        sentence = f"field {path!r} is invalid: {_message(first)}"
    elif got is None:
        sentence = f"field {path!r} {expectation}"
    else:
        sentence = f"field {path!r} {expectation}, got {got}"
    detail: dict[str, Any] = {"field": path, "problem": expectation or _message(first)}
    if got is not None:
        detail["got"] = got
    if len(errors) > 1:
        detail["more_errors"] = len(errors) - 1
    return WireError(422, "invalid_request", sentence, **detail)


def _expectation(error: Mapping[str, Any]) -> str | None:
    template = _EXPECTATIONS.get(error["type"])
    if template is None:
        return None
    try:
        return template.format(**(error.get("ctx") or {}))
    except (KeyError, IndexError):
        return template


def _message(error: Mapping[str, Any]) -> str:
    message = str(error.get("msg", "invalid value"))
    return message.removeprefix("Value error, ")


def _short(value: object, limit: int = 60) -> str:
    try:
        text = json.dumps(value, allow_nan=True)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_protocol_version(body: object) -> None:
    """400 protocol_version when a JSON object body's `protocol_version` is not 1.

    The protocol checks the version before the fields, so a client of another protocol version
    hears about the version rather than about fields it may name differently. A body that is
    not an object is left for field validation (422).
    """
    if not isinstance(body, Mapping):
        return
    version = body.get("protocol_version")
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise WireError(
            400,
            "protocol_version",
            f"protocol_version must be {PROTOCOL_VERSION}, got {_short(version)}",
            expected=PROTOCOL_VERSION,
            got=version if isinstance(version, (int, float, str)) or version is None else None,
        )


def check_protocol_header(value: str | None, required: bool) -> None:
    """WireError(400, protocol_version) unless the X-Diloco-Protocol header names our version.

    A missing header passes only where `required` is False (reads: GET by an operator's curl or
    a Prometheus scraper, which interpret nothing of the client's).
    """
    if value is None and not required:
        return
    if value is not None and value.strip() == str(PROTOCOL_VERSION):
        return
    shown = None if value is None else value[:40]
    raise WireError(
        400,
        "protocol_version",
        f"the {PROTOCOL_HEADER} header must be {PROTOCOL_VERSION}, got "
        + (
            "none (a client older than the header, or not a diloco worker)"
            if value is None
            else repr(shown)
        ),
        expected=PROTOCOL_VERSION,
        got=shown,
        header=PROTOCOL_HEADER,
    )


def parse_request(model: type[Model], body: bytes | bytearray | str | object) -> Model:
    """Parse a JSON request body (raw text or already-decoded) into `model`.

    Bad JSON and bad fields are WireError(422, "invalid_request"); for a model with a
    `protocol_version` field the version is checked first (400), as docs/protocol.md orders.
    """
    data = body
    if isinstance(body, (bytes, bytearray, str)):
        try:
            data = json.loads(body)
        except (ValueError, RecursionError) as exc:
            raise WireError(
                422, "invalid_request", f"the request body is not valid JSON: {exc}"
            ) from None
    if "protocol_version" in model.model_fields:
        check_protocol_version(data)
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as exc:
        raise validation_error_to_wire(exc) from None


MAX_UNITS_PER_SUBMISSION = 4096


def _positive_int(part: str) -> int | None:
    # ASCII digits only: str.isdigit() also passes '²', which int() refuses. Ids and counts
    # start at 1, so 0 is refused here too, naming this field.
    if not (part.isascii() and part.isdigit()) or len(part) > 18 or not part.strip("0"):
        return None
    return int(part)


def parse_unit_reports(text: str) -> tuple[list[int], dict[int, int]]:
    """The `units` query field: comma-separated work units finished (`ID`) or trained in part
    (`ID:COUNT`, the samples of the unit trained so far, from its first); empty is none."""
    if not text:
        return [], {}
    parts = text.split(",")
    if len(parts) > MAX_UNITS_PER_SUBMISSION:
        raise WireError(
            422,
            "invalid_request",
            f"field 'units' lists {len(parts)} units; at most {MAX_UNITS_PER_SUBMISSION} "
            "may be reported with one submission",
            field="units",
        )
    finished: list[int] = []
    partial: dict[int, int] = {}
    for part in parts:
        unit_text, colon, count_text = part.partition(":")
        unit_id = _positive_int(unit_text)
        count = _positive_int(count_text) if colon else None
        if unit_id is None or (colon and count is None):
            raise WireError(
                422,
                "invalid_request",
                "field 'units' must be comma-separated unit ids (integers >= 1), each "
                f"optionally ':COUNT' (samples trained, >= 1); got {_short(part)!r}",
                field="units",
                got=_short(part),
            )
        if unit_id in partial or unit_id in finished:
            raise WireError(
                422,
                "invalid_request",
                f"field 'units' names unit {unit_id} more than once",
                field="units",
                got=unit_id,
            )
        if count is None:
            finished.append(unit_id)
        else:
            partial[unit_id] = count
    return finished, partial


def parse_unit_ids(text: str) -> list[int]:
    """The finished units of a `units` field that may not report partly trained ones."""
    finished, partial = parse_unit_reports(text)
    if partial:
        unit_id = next(iter(partial))
        raise WireError(
            422,
            "invalid_request",
            f"field 'units' must be unit ids here, got '{unit_id}:{partial[unit_id]}'",
            field="units",
            got=f"{unit_id}:{partial[unit_id]}",
        )
    return finished
