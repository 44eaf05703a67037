"""JSON request bodies: read with a size limit, then parsed into their pydantic model."""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel
from starlette.requests import Request

from diloco.wire import parse_content_length, parse_request, read_body

MAX_JSON_BYTES = 16 * 1024 * 1024  # a registration lists every tensor; 16 MiB is ~100k of them
Model = TypeVar("Model", bound=BaseModel)


async def json_body(request: Request, model: type[Model], *, optional: bool = False) -> Model:
    """The body as `model`: 413 past MAX_JSON_BYTES, 422 naming a bad or missing field.

    `optional`: an empty body means every field's default (`curl -X POST` with no data)."""
    length = parse_content_length(request.headers.get("content-length"))
    chunked = "transfer-encoding" in request.headers  # a body without a length: 411 below
    if optional and (length == 0 or (length is None and not chunked)):
        return parse_request(model, b"{}")
    return parse_request(model, await read_body(request.stream(), length, MAX_JSON_BYTES))


def json_body_schema(model: type[BaseModel]) -> dict:
    """Document a body the route parses itself (so the protocol's error order holds).

    Pydantic points nested models at "#/$defs/NAME", which inside an OpenAPI document would
    mean a `$defs` at the document's root, where there is none: they are inlined instead."""
    schema = model.model_json_schema()
    definitions = schema.pop("$defs", {})
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": _inline_refs(schema, definitions)}},
        }
    }


def _inline_refs(node: Any, definitions: dict[str, Any]) -> Any:
    """`node` with every {"$ref": "#/$defs/NAME"} replaced by that definition (no cycles)."""
    if isinstance(node, list):
        return [_inline_refs(item, definitions) for item in node]
    if not isinstance(node, dict):
        return node
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/$defs/"):
        resolved = _inline_refs(definitions[ref.removeprefix("#/$defs/")], definitions)
        return {**resolved, **{k: v for k, v in node.items() if k != "$ref"}}
    return {key: _inline_refs(value, definitions) for key, value in node.items()}
