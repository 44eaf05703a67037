"""Uploads and downloads as the real system codes them (issue 12): the server's upload codec,
error feedback kept by each simulated worker, delta downloads of the published weights, and
the exact bytes of every transfer.

For each *trainable* floating tensor of its pseudo-gradient g a worker keeps a residual e and
sends C(e) after e <- beta e + g, then keeps e <- e - D(C(e)), what the server did not get; beta
= 0 keeps nothing and sends C(g). The server folds D(C(e)). Buffers, frozen tensors and integer
tensors are not coded. The coding is algorithm/compression/codecs.py's `error_feedback_step` /
`encode` and the server's `decode`, the functions the real worker and server call, so the
simulator stays comparable bit for bit. As on the wire:

  - fp32: the identity; the pseudo-gradient goes as it is and nothing is kept.
  - bf16: a plain bf16 body (the server's upload_dtype bf16): every floating tensor is cast to
    bf16 (round to nearest even), the trainable ones after error feedback.
  - int8, int4, int2, topk:F[+VALUES]: a compressed body; tensors sent exact are plain entries
    of the pseudo-gradient's own dtype (fp32 for floats, int64 for integers and bools).

Bytes are those of the tensor data of one body: `encoded_nbytes` for a coded tensor, elements
times element size for a plain entry. The safetensors header is left out, as everywhere else
in the simulator.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from diloco.algorithm import TensorKind
from diloco.algorithm.compression.codecs import (
    Codec,
    decode,
    encode,
    encoded_nbytes,
    error_feedback_step,
)

# The dtype of an integer or bool tensor's pseudo-gradient (algorithm.pseudo_gradient).
INTEGER_GRADIENT = torch.int64


class UploadCodec:
    """A run's upload codec and error-feedback decay, and which tensors it codes."""

    def __init__(self, codec: Codec, beta: float, kinds: Mapping[str, TensorKind]) -> None:
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0 <= beta < 1:
            raise ValueError(f"error_feedback_beta must be in [0, 1), got {beta!r}")
        self.codec = codec
        self.beta = float(beta)
        self.kinds = {name: TensorKind(kind) for name, kind in kinds.items()}

    @property
    def plain_bf16(self) -> bool:
        """Dense bf16: the body is plain, every floating entry in bf16."""
        return self.codec.values == "bf16" and not self.codec.is_sparse

    @property
    def keeps_residual(self) -> bool:
        """Whether workers carry anything between uploads (a lossy codec and beta > 0)."""
        return self.beta > 0 and not self.codec.is_identity

    def is_coded(self, name: str, floating: bool) -> bool:
        """Whether tensor `name` goes through the codec (and error feedback)."""
        trainable = self.kinds.get(name) is TensorKind.TRAINABLE
        return floating and trainable and not self.codec.is_identity

    def entry_nbytes(self, name: str, tensor: torch.Tensor) -> int:
        """Bytes of the pseudo-gradient of `name` (shaped like `tensor`) in one upload body."""
        numel, floating = tensor.numel(), tensor.is_floating_point()
        if self.is_coded(name, floating) and not self.plain_bf16:
            return encoded_nbytes(numel, self.codec)
        if not floating:
            return numel * INTEGER_GRADIENT.itemsize
        return numel * (torch.bfloat16 if self.plain_bf16 else torch.float32).itemsize

    def nbytes(self, tensors: Mapping[str, torch.Tensor]) -> int:
        """Bytes of one upload of the pseudo-gradients of `tensors` (shapes and kinds only)."""
        return sum(self.entry_nbytes(name, tensor) for name, tensor in tensors.items())

    def uplink(self) -> WorkerUplink:
        """A new worker's side of the link, with no residual yet."""
        return WorkerUplink(self)


class WorkerUplink:
    """One simulated worker's uploads: its residual per tensor, and what the server decodes."""

    def __init__(self, upload: UploadCodec) -> None:
        self.upload = upload
        self.residual: dict[str, torch.Tensor] = {}

    def send(self, gradient: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What the server folds for the pseudo-gradient `gradient` (anchor - local), as fp32
        (integers as they are); updates this worker's residuals."""
        upload = self.upload
        if upload.codec.is_identity:
            return dict(gradient)
        received: dict[str, torch.Tensor] = {}
        for name, g in gradient.items():
            if upload.is_coded(name, g.is_floating_point()):
                received[name] = self._code(name, g)
            elif g.is_floating_point() and upload.plain_bf16:
                received[name] = g.to(torch.bfloat16).float()
            else:
                received[name] = g
        return received

    def _code(self, name: str, g: torch.Tensor) -> torch.Tensor:
        codec, beta = self.upload.codec, self.upload.beta
        if beta == 0:
            encoded = encode(g, codec)
        else:
            residual = self.residual.get(name)
            if residual is None or residual.shape != g.shape:
                residual = self.residual[name] = torch.zeros(g.shape, dtype=torch.float32)
            encoded, _ = error_feedback_step(residual, g, beta, codec)
        return decode(encoded, codec).view(g.shape)


class Downlink:
    """The published weights P that workers hold, as the server's --download-codec keeps them.

    fp32: P is the masters themselves and every download is the full fp32 weights. Any other
    codec: each step codes masters - P for its tensors and P moves by exactly what was coded
    (P += D(C(masters - P)), the server's published copy), so workers train from P, not from
    the masters; a worker whose anchor is not the P before the step downloads P whole.
    Trainable float tensors are coded; the others go as their value
    (server/model/published_copy.py).
    """

    def __init__(
        self, codec: Codec, kinds: Mapping[str, TensorKind], masters: Mapping[str, torch.Tensor]
    ) -> None:
        self.codec = codec
        self.coded = {
            name
            for name, t in masters.items()
            if t.is_floating_point()
            and TensorKind(kinds.get(name, "frozen")) is TensorKind.TRAINABLE
        }
        self.masters = masters
        self.published = (
            masters if codec.is_identity else {n: t.clone() for n, t in masters.items()}
        )

    def publish(self, names: list[str]) -> None:
        """After an outer step on `names`: move P by the step's coded delta."""
        if self.codec.is_identity:
            return
        for name in names:
            target, master = self.published[name], self.masters[name]
            if name in self.coded:
                encode(torch.sub(master, target), self.codec, fold_into=target)
            else:
                target.copy_(master)

    def delta_nbytes(self, names: list[str]) -> int:
        """Bytes of one step's download of `names` for a worker that holds the P before it."""
        total = 0
        for name in names:
            tensor = self.published[name]
            if not tensor.is_floating_point():
                continue  # the simulator counts floating tensors only (SimSetup.tensor_bytes)
            if self.codec.is_identity or name not in self.coded:
                total += tensor.numel() * 4
            else:
                total += encoded_nbytes(tensor.numel(), self.codec)
        return total
