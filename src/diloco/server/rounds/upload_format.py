"""What a submission's body must hold under the server's upload codec, and the body a round
folds from it.

- Plain codecs (fp32, bf16): the fragment's tensors by name; floating ones in the upload dtype,
  int and bool ones in their own dtype, int64 or fp32 (wire/format/checks.py). A body whose header
  names a codec (`diloco.*` metadata) is 422 codec_mismatch: the worker and the server
  disagree on the codec, and reading its parts as tensors would only say "unknown tensor".
- Compressed codecs (int8, int4, int2, top-k): the header's metadata must name the server's
  codec, block, chunk and k exactly (else 422 codec_mismatch); every trainable tensor comes as
  the codec's parts (`NAME#codes`, `#scales`, `#indices`, of the exact dtypes and lengths), and
  every other tensor of the fragment (frozen, float, int and bool buffers) as a plain entry
  under the same dtype rule as in a plain body, so a worker sends its buffers exactly as it
  does without compression.

`check` reads only the header (names, shapes, dtypes, metadata), so the server runs it as soon
as a body's header has arrived. `open` turns an admitted body into what the round folds: a
plain body as it is, a compressed one as `CompressedPieces`, whose values are checked and
decoded span by span when the round scans or folds it, never decoded whole.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from diloco.algorithm import TensorKind
from diloco.server.settings import ServerSettings
from diloco.wire import SpooledTensors, TensorSpec, WireError, check_tensors
from diloco.wire.compressed.header import (
    CompressedHeader,
    check_compressed_header,
    echo_metadata,
)
from diloco.wire.compressed.pieces import CompressedPieces
from diloco.wire.format.spool import PieceBody

Tensors = Mapping[str, torch.Tensor] | PieceBody
_CODEC_PREFIX = "diloco."


class UploadFormat:
    """The server's upload codec, applied to submissions' headers and bodies."""

    def __init__(self, settings: ServerSettings) -> None:
        self.codec = settings.upload if settings.compressed_uploads else None
        self.codec_name = settings.upload_codec
        self.float_dtype = settings.upload_dtype

    def check(
        self,
        entries: Mapping[str, Any],
        metadata: Mapping[str, str] | None,
        expected: Mapping[str, TensorSpec],
    ) -> CompressedHeader | None:
        """A body's header (entries with a shape and a dtype: header entries, meta tensors or
        tensors) against the fragment's `expected` specs; WireError(422) naming the tensor.
        Returns the sorted-out header of a compressed body, None for a plain one."""
        if self.codec is None:
            self._refuse_codec(metadata or {})
            check_tensors(entries, expected, float_dtype=self.float_dtype, scan_values=False)
            return None
        exact = {name for name, spec in expected.items() if spec.kind != TensorKind.TRAINABLE.value}
        # An exact tensor is given its entry's own dtype here, so that the dtype rule of plain
        # bodies (checked below, with its wording) decides it rather than an exact match.
        shapes = {
            name: (
                tuple(spec.shape),
                entries[name].dtype if name in exact and name in entries else spec.dtype,
            )
            for name, spec in expected.items()
        }
        header = check_compressed_header(entries, metadata, shapes, self.codec, exact=exact)
        plain_specs = {name: expected[name] for name in header.plain}
        check_tensors(
            header.plain,
            plain_specs,
            float_dtype=self.float_dtype,
            require_all=False,
            scan_values=False,
        )
        return header

    def open(
        self,
        tensors: Mapping[str, torch.Tensor] | SpooledTensors,
        metadata: Mapping[str, str] | None,
        expected: Mapping[str, TensorSpec],
    ) -> Tensors:
        """`check` the body, then the body a round folds: a plain one as it is; a compressed
        one as decoded pieces read from its file or its buffer (no value is read yet)."""
        if isinstance(tensors, SpooledTensors):
            header = self.check(tensors.entries, metadata, expected)
            return tensors if header is None else CompressedPieces.spooled(header, tensors)
        header = self.check(tensors, metadata, expected)
        return tensors if header is None else CompressedPieces.in_memory(header)

    def _refuse_codec(self, metadata: Mapping[str, str]) -> None:
        """422 codec_mismatch for a coded body sent to a server that takes plain tensors."""
        got = {key: value for key, value in metadata.items() if key.startswith(_CODEC_PREFIX)}
        if not got:
            return
        got = echo_metadata(got)
        coded = got.get("diloco.codec", "an unnamed codec")
        raise WireError(
            422,
            "codec_mismatch",
            f"the body is coded as {coded!r}; this server takes plain tensors (upload codec "
            f"{self.codec_name}), with no diloco.* metadata",
            expected={},
            got=got,
            codec=self.codec_name,
        )
