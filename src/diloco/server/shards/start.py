"""Starting one shard of sharded servers: its part of --init, the check against shard 0,
and (on the other shards) the thread that follows shard 0's decisions."""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch

from diloco.server.coordinator import Coordinator
from diloco.server.model.global_model import fragment_plan, specs_of
from diloco.server.settings import ServerSettings
from diloco.server.shards.peers import (
    DecisionFollower,
    MembershipFollower,
    PeerUnavailable,
    ShardPeers,
    wait_for_leader,
)
from diloco.wire import fingerprint
from diloco.wire.format.shard_layout import shard_fragment_plan, shard_layout

log = logging.getLogger("diloco.server")

LEADER_WAIT_SECONDS = 120.0  # how long another shard waits for shard 0 to answer at start


class ShardStart:
    """What `serve` does differently for shard `settings.shard` of several."""

    def __init__(
        self,
        settings: ServerSettings,
        secret: str | None,
        initial: Mapping[str, torch.Tensor] | None,
        durability: str,
        state_dir: object | None,
        ca_file: str | None = None,
    ) -> None:
        """`secret`: the tokens file's `shard` secret (None: the shards run open); `ca_file`:
        what signs the other shards' certificates (https:// shard URLs)."""
        if state_dir is None:
            raise ValueError(
                "sharded servers need --state-dir: a shard that restarted without its state "
                "would start over at round 0 while the others hold later rounds"
            )
        if durability != "round":
            raise ValueError(
                "sharded servers need --durability round: a shard that lost steps it had "
                "served could not be brought back to the version the other shards hold"
            )
        self.settings = settings
        self.peers = ShardPeers(settings.shard_urls, settings.shard, secret, ca_file)
        # The whole --init model's fingerprint: shards started on other files refuse.
        self.whole_model = None
        self.fragment_plan: list[list[str]] | None = None  # streaming: this shard's part
        self.whole_plan: list[list[str]] | None = None  # and the --init file's whole plan
        if initial is not None:
            self.whole_model = fingerprint(list(specs_of(initial, None).values()))

    def own_part(
        self, initial: Mapping[str, torch.Tensor] | None
    ) -> dict[str, torch.Tensor] | None:
        """This shard's tensors of the --init weights (the layout every worker computes)."""
        if initial is None:
            return None
        specs = list(specs_of(initial, None).values())
        settings = self.settings
        if settings.mode == "streaming":  # whole fragments of the file's plan
            plan = fragment_plan(specs, settings.fragments)
            self.whole_plan = plan
            self.fragment_plan = shard_fragment_plan(plan, specs, settings.shards, settings.shard)
            names = [name for names in self.fragment_plan for name in names]
        else:
            names = shard_layout(specs, settings.shards)[settings.shard]
        return {name: initial[name] for name in names}

    def check_against_shard_0(self) -> None:
        """Another shard waits for shard 0 and refuses to start with other settings
        (ValueError naming the first difference). Shard 0 checks nothing."""
        if self.settings.leads:
            return
        info = wait_for_leader(self.peers, self.settings.to_wire(), LEADER_WAIT_SECONDS)
        if self.whole_model is not None:  # a first start: refused before anything is written
            self._check_model(self.whole_model, info)

    def _check_model(self, mine: str | None, info: dict) -> None:
        """The same --init file on every shard, or none: the fingerprint each shard keeps in
        its state from its first start (so a restart, which drops --init, still compares)."""
        theirs = (info.get("shards") or {}).get("whole_model")
        if (mine is None) != (theirs is None):
            here, there = ("with", "without") if theirs is None else ("without", "with")
            raise ValueError(
                f"this shard was started {here} --init and shard 0 {there}: give every shard "
                "the same --init file, or none (the first worker's weights)"
            )
        if theirs != mine:
            raise ValueError(
                f"this shard's --init model (fingerprint {mine}) differs from shard 0's "
                f"({theirs}): every shard starts from the same file"
            )

    def _leader_info(self) -> dict:
        """Shard 0's /v1/info, waiting for it as at start (it may be restarting too)."""
        return wait_for_leader(self.peers, self.settings.to_wire(), LEADER_WAIT_SECONDS)

    def _check_streaming_state(self, coordinator: Coordinator, info: dict) -> None:
        """A streaming follower: weights where shard 0 has them (a shard that lost its state
        would start its fragments over), and shard 0's whole fragment plan."""
        state = coordinator.journal.state
        mine = state.get_meta("whole_fragment_plan")
        if info.get("model_fingerprint") is not None and coordinator.masters is None:
            # This run's state (shard 0's plan), never a round, and no record that its
            # initial weights were stored (written once they are durable, before the upload
            # is answered): it was stopped writing them and told nobody it held them. Else
            # it held weights once and lost them.
            stored = state.get_meta("settings") is not None
            if mine is None or stored or state.committed_rounds():
                raise ValueError(
                    "shard 0 holds the run's weights and this shard none: its --state-dir was "
                    "lost or is another run's (a shard cannot start its fragments over)"
                )
            log.warning(
                "this shard was stopped before its initial weights were stored: it takes its "
                "part again from the worker whose weights shard 0 holds (its initial_from), "
                "and its fragments wait until that worker sends it"
            )
        try:
            theirs = self.peers.whole_plan()
        except PeerUnavailable as exc:
            raise ValueError(f"shard 0's fragment plan could not be read: {exc}") from None
        if mine is not None and theirs is not None and mine != theirs:
            raise ValueError(
                "this shard's fragment plan differs from shard 0's (an --init file with the "
                "tensors in another order?): every shard must cut the model alike"
            )

    def _check_version(self, mine: int, info: dict) -> None:
        """Sync: a follower holds shard 0's version or the one before (shard 0 decides a
        round only once every shard holds its slices, so no follower can be further behind).
        Async: any version up to shard 0's (a follower applies decided steps one by one and
        may lag several). Anything else is state from another run, or lost: refused, naming
        both versions."""
        leader = int(info.get("round", 0))
        allowed = range(0, leader + 1) if self.settings.mode == "async" else (leader - 1, leader)
        if mine not in allowed:
            behind = (
                "at most shard 0's"
                if self.settings.mode == "async"
                else ("at shard 0's round or the one before")
            )
            raise ValueError(
                f"this shard's state is at round {mine} and shard 0's at round {leader}: a "
                f"shard can only be {behind} (another run's --state-dir, or one that lost "
                "rounds?)"
            )

    def follow(self, coordinator: Coordinator) -> DecisionFollower | MembershipFollower | None:
        """Shard 0 states its --init fingerprint; the others follow its decisions (streaming:
        its membership, each shard deciding the rounds of its own fragments)."""
        assert coordinator.shard is not None
        state = coordinator.journal.state
        if self.whole_model is not None:  # a first start (--init is refused on a resume)
            state.set_meta("whole_model", self.whole_model)
        whole_model = state.get_meta("whole_model")
        coordinator.shard.whole_model = whole_model
        if self.settings.leads:
            return None
        info = self._leader_info()  # once, for both checks
        self._check_model(whole_model, info)
        if self.settings.mode == "streaming":  # each shard commits its own fragments
            self._check_streaming_state(coordinator, info)
            members = MembershipFollower(
                self.peers,
                coordinator.shard.follow_members,
                self.settings.heartbeat_interval,
                coordinator.clock,
            )
            members.start()
            return members
        self._check_version(coordinator.version, info)
        follower = DecisionFollower(self.peers, coordinator.shard)
        follower.start()
        return follower
