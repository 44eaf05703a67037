"""The only code that knows bytes: safetensors frames, dtypes, size limits, JSON schemas.

Server and worker exchange tensors and JSON only through these functions, so the protocol of
docs/protocol.md is written down in one place.
"""

from diloco.wire.body import check_length, parse_content_length, read_body
from diloco.wire.checks import check_finite, check_tensors
from diloco.wire.dtypes import (
    DTYPE_NAMES,
    SAFETENSORS_CODES,
    WIRE_FLOAT_DTYPE_NAMES,
    WIRE_FLOAT_DTYPES,
    dtype_from_safetensors_code,
    dtype_name,
    parse_wire_dtype,
    safetensors_code,
    torch_dtype,
)
from diloco.wire.errors import WireError
from diloco.wire.frames import MAX_HEADER_BYTES, decode_tensors, encode_tensors
from diloco.wire.schemas import (
    MAX_COUNT,
    WORKER_ID_PATTERN,
    DatasetRequest,
    DeregisterResponse,
    ErrorBody,
    HealthResponse,
    HeartbeatRequest,
    HeartbeatResponse,
    InfoResponse,
    LeaseRequest,
    OuterOptimizerSummary,
    RegisterRequest,
    RegisterResponse,
    Settings,
    StatusResponse,
    SubmitResponse,
    TensorSpecModel,
    WaitingResponse,
    WorkerStatus,
    is_worker_id,
)
from diloco.wire.specs import (
    TENSOR_KINDS,
    TensorSpec,
    fingerprint,
    first_difference,
    same_dtype_class,
    specs_of,
)
from diloco.wire.spool import SpooledTensors, SpoolFiles, spool_body
from diloco.wire.validation import (
    PROTOCOL_VERSION,
    check_protocol_version,
    parse_request,
    parse_unit_ids,
    validation_error_to_wire,
)

__all__ = [
    "DTYPE_NAMES",
    "MAX_COUNT",
    "MAX_HEADER_BYTES",
    "PROTOCOL_VERSION",
    "SAFETENSORS_CODES",
    "TENSOR_KINDS",
    "WIRE_FLOAT_DTYPES",
    "WIRE_FLOAT_DTYPE_NAMES",
    "WORKER_ID_PATTERN",
    "DatasetRequest",
    "DeregisterResponse",
    "ErrorBody",
    "HealthResponse",
    "HeartbeatRequest",
    "HeartbeatResponse",
    "InfoResponse",
    "LeaseRequest",
    "OuterOptimizerSummary",
    "RegisterRequest",
    "RegisterResponse",
    "Settings",
    "SpoolFiles",
    "SpooledTensors",
    "StatusResponse",
    "SubmitResponse",
    "TensorSpec",
    "TensorSpecModel",
    "WaitingResponse",
    "WireError",
    "WorkerStatus",
    "check_finite",
    "check_length",
    "check_protocol_version",
    "check_tensors",
    "decode_tensors",
    "dtype_from_safetensors_code",
    "dtype_name",
    "encode_tensors",
    "fingerprint",
    "first_difference",
    "is_worker_id",
    "parse_content_length",
    "parse_request",
    "parse_unit_ids",
    "parse_wire_dtype",
    "read_body",
    "safetensors_code",
    "same_dtype_class",
    "specs_of",
    "spool_body",
    "torch_dtype",
    "validation_error_to_wire",
]
