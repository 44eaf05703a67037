"""JSON request bodies: read with a size limit, then parsed into their pydantic model."""

from __future__ import annotations

from typing import TypeVar

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
