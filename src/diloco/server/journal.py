"""Durable rounds: the global state reaches the disk before any worker sees a round's result.

Each save is one checkpoint generation (weights, outer optimizer state, and as metadata the
round, the model's tensor specs and the settings), so a restarted server resumes exactly where
the last result it published left off: no acknowledged outer step is ever lost or applied
twice. A restart with different settings is refused unless told to override them, because
workers adopted the old ones.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from diloco.checkpoints import CheckpointStore
from diloco.server.settings import ServerSettings
from diloco.wire import TensorSpec

log = logging.getLogger("diloco.server")


@dataclass(frozen=True)
class RestoredState:
    round: int
    masters: dict[str, torch.Tensor]
    optimizer_state: dict[str, torch.Tensor]
    specs: dict[str, TensorSpec]


class RoundJournal:
    """Saves and restores the coordinator's global state through a CheckpointStore."""

    def __init__(
        self, store: CheckpointStore, settings: ServerSettings, override_settings: bool = False
    ) -> None:
        self.store = store
        self.settings = settings
        self.override_settings = override_settings

    def save(
        self,
        round_number: int,
        masters: Mapping[str, torch.Tensor],
        optimizer_state: Mapping[str, torch.Tensor],
        specs: Mapping[str, TensorSpec],
    ) -> None:
        existing = self.store.generations()
        generation = existing[-1] + 1 if existing else 0
        self.store.write(
            generation,
            {"weights": masters, "outer_state": optimizer_state},
            {
                "round": round_number,
                "specs": [spec.to_json() for spec in specs.values()],
                "settings": self.settings.to_wire(),
            },
        )

    def restore(self) -> RestoredState | None:
        """The newest verified state, or None for a new run; refuses conflicting settings."""
        loaded = self.store.load_latest()
        if loaded is None:
            return None
        stored = loaded.metadata["settings"]
        current = self.settings.to_wire()
        conflicts = [
            f"{key}: {stored[key]!r} in the state dir, {current.get(key)!r} now"
            for key in sorted(stored)
            if stored[key] != current.get(key)
        ]
        if conflicts and not self.override_settings:
            raise ValueError(
                "the state dir was written with other settings ("
                + "; ".join(conflicts)
                + "); start with the same settings, or pass --override-settings"
            )
        for conflict in conflicts:
            log.warning("overriding a stored setting: %s", conflict)
        specs = [TensorSpec.from_json(s) for s in loaded.metadata["specs"]]
        log.info(
            "resuming round %d from %s",
            loaded.metadata["round"],
            loaded.path,
        )
        return RestoredState(
            round=int(loaded.metadata["round"]),
            masters=dict(loaded.tensors["weights"]),
            optimizer_state=dict(loaded.tensors.get("outer_state", {})),
            specs={spec.name: spec for spec in specs},
        )
