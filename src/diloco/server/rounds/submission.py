"""One pseudo-gradient submission as the coordinator hands it to a round engine."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from diloco.server.members.membership import WorkerRecord
from diloco.wire.format.spool import PieceBody


@dataclass(frozen=True)
class Submission:
    """Keyed by (worker, round, fragment); `units` are the work units it reports finished,
    `progress` those trained in part (unit -> samples of it trained so far)."""

    record: WorkerRecord
    round: int
    fragment: int
    tensors: Mapping[str, torch.Tensor] | PieceBody  # a compressed body: decoded pieces
    tokens: int
    units: list[int]
    progress: dict[int, int] = field(default_factory=dict)

    @property
    def worker_id(self) -> str:
        return self.record.worker_id

    @property
    def nbytes(self) -> int:
        if isinstance(self.tensors, PieceBody):
            return self.tensors.nbytes
        return sum(t.numel() * t.element_size() for t in self.tensors.values())
