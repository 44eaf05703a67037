"""What an operator changed in a running run: paused rounds, the outer lr, banned worker ids.

Each change is written (the state store's meta table, with its audit row, in one transaction)
before it takes effect, so a restarted server comes back as the operator left it: still
paused, with the outer lr the admin set (it supersedes the command line's, unless the server
starts with --override-settings), and with its bans. Without a state dir the same tables are
in memory and last as long as the process.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from diloco.algorithm._checks import require_positive
from diloco.server.settings import ServerSettings
from diloco.server.state.store import StateStore

log = logging.getLogger("diloco.server")

PAUSED = "admin_paused"
PAUSE_STAMP = "admin_pause_stamp"
OUTER_LR = "admin_outer_lr"
BANNED = "admin_banned"


class RunControl:
    """The operator's switches; the coordinator calls these under its lock and applies them."""

    def __init__(
        self,
        state: StateStore,
        settings: ServerSettings,
        clock: Callable[[], float],
        *,
        command_line_wins: bool = False,
    ) -> None:
        self.state = state
        self.settings = settings
        self.clock = clock
        self.paused_since: float | None = clock() if state.get_meta(PAUSED) else None
        # Orders this run's words on the pause (streaming shard 0 sends it with each push and
        # answer, and a follower takes only newer words): nanoseconds since the epoch, and
        # past the last one stored, so a restart's word is newer even if the clock went back.
        stored = state.get_meta(PAUSE_STAMP)
        self.pause_stamp = max(time.time_ns(), int(stored) + 1 if stored is not None else 0)
        self.banned: set[str] = set(state.get_meta(BANNED) or ())
        self._adopt_stored_lr(command_line_wins)

    def _adopt_stored_lr(self, command_line_wins: bool) -> None:
        stored = self.state.get_meta(OUTER_LR)
        if stored is None or stored == self.settings.outer_lr:
            return
        if command_line_wins:
            log.warning(
                "--override-settings: the command line's outer lr %g replaces %g set by an admin",
                self.settings.outer_lr,
                stored,
            )
            with self.state.transaction():
                self.state.set_meta(OUTER_LR, None)
                self.state.audit(
                    "outer_lr_overridden", stored=stored, command_line=self.settings.outer_lr
                )
            return
        log.warning(
            "outer lr %g, set by an admin, replaces the command line's %g "
            "(--override-settings keeps the command line's)",
            stored,
            self.settings.outer_lr,
        )
        self.settings.change_outer_lr(stored)

    # ----------------------------------------------------------------- pause

    @property
    def paused(self) -> bool:
        return self.paused_since is not None

    def pause(self, by: str, round_number: int) -> bool:
        """Hold every outer step until `resume`; False if already paused (nothing written)."""
        if self.paused:
            return False
        stamp = self._next_stamp()
        with self.state.transaction():
            self.state.set_meta(PAUSED, True)
            self.state.set_meta(PAUSE_STAMP, stamp)
            self.state.audit("paused", round=round_number, by=by)
        self.paused_since = self.clock()
        self.pause_stamp = stamp
        log.warning("rounds paused by %s at round %d", by, round_number)
        return True

    def resume(self, by: str, round_number: int) -> float | None:
        """Let steps commit again; when the pause began (on this clock; at the start of this
        process if it was paused before a restart), or None if it was not paused."""
        if self.paused_since is None:
            return None
        since = self.paused_since
        paused_for = max(0.0, self.clock() - since)
        stamp = self._next_stamp()
        with self.state.transaction():
            self.state.set_meta(PAUSED, False)
            self.state.set_meta(PAUSE_STAMP, stamp)
            self.state.audit("resumed", round=round_number, by=by, paused_seconds=paused_for)
        self.paused_since = None
        self.pause_stamp = stamp
        log.warning("rounds resumed by %s after %.1f s paused", by, paused_for)
        return since

    def _next_stamp(self) -> int:
        return max(self.pause_stamp + 1, time.time_ns())

    # ----------------------------------------------------------------- outer lr

    def set_outer_lr(self, lr: float, by: str, round_number: int) -> float:
        """Make `lr` the outer lr of every later step (durable first); returns the previous."""
        previous = self.settings.outer_lr
        lr = require_positive("outer_lr", lr)  # before anything is written
        with self.state.transaction():
            self.state.set_meta(OUTER_LR, lr)
            self.state.audit(
                "outer_lr_changed", round=round_number, by=by, previous=previous, lr=lr
            )
        self.settings.change_outer_lr(lr)
        log.warning("outer lr set to %g (was %g) by %s at round %d", lr, previous, by, round_number)
        return previous

    # ----------------------------------------------------------------- bans

    def is_banned(self, worker_id: str) -> bool:
        return worker_id in self.banned

    def ban(self, worker_id: str, by: str, round_number: int, reason: str) -> None:
        banned = sorted(self.banned | {worker_id})
        with self.state.transaction():
            self.state.set_meta(BANNED, banned)
            self.state.audit(
                "banned", worker_id=worker_id, round=round_number, by=by, reason=reason
            )
        self.banned = set(banned)

    def unban(self, worker_id: str, by: str, round_number: int) -> bool:
        """Allow `worker_id` to register again; False if it was not banned."""
        if worker_id not in self.banned:
            return False
        banned = sorted(self.banned - {worker_id})
        with self.state.transaction():
            self.state.set_meta(BANNED, banned)
            self.state.audit("unbanned", worker_id=worker_id, round=round_number, by=by)
        self.banned = set(banned)
        return True
