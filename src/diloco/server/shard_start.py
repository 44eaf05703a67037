"""Starting one shard of sharded servers: its part of --init, the check against shard 0,
and (on the other shards) the thread that follows shard 0's decisions."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from diloco.server.coordinator import Coordinator
from diloco.server.global_model import specs_of
from diloco.server.settings import ServerSettings
from diloco.server.shard_peers import DecisionFollower, ShardPeers, wait_for_leader
from diloco.wire import fingerprint
from diloco.wire.shard_layout import shard_layout

LEADER_WAIT_SECONDS = 120.0  # how long another shard waits for shard 0 to answer at start


class ShardStart:
    """What `serve` does differently for shard `settings.shard` of several."""

    def __init__(
        self,
        settings: ServerSettings,
        token: str | None,
        initial: Mapping[str, torch.Tensor] | None,
        durability: str,
    ) -> None:
        if durability != "round":
            raise ValueError(
                "sharded servers need --durability round: a shard that lost steps it had "
                "served could not be brought back to the version the other shards hold"
            )
        self.settings = settings
        self.peers = ShardPeers(settings.shard_urls, settings.shard, token)
        # The whole --init model's fingerprint: shards started on other files refuse.
        self.whole_model = None
        if initial is not None:
            self.whole_model = fingerprint(list(specs_of(initial, None).values()))

    def own_part(
        self, initial: Mapping[str, torch.Tensor] | None
    ) -> dict[str, torch.Tensor] | None:
        """This shard's tensors of the --init weights (the layout every worker computes)."""
        if initial is None:
            return None
        specs = list(specs_of(initial, None).values())
        names = shard_layout(specs, self.settings.shards)[self.settings.shard]
        return {name: initial[name] for name in names}

    def check_against_shard_0(self) -> None:
        """Another shard waits for shard 0 and refuses to start with other settings or
        another --init model (ValueError naming the difference). Shard 0 checks nothing."""
        if self.settings.leads:
            return
        info = wait_for_leader(self.peers, self.settings.to_wire(), LEADER_WAIT_SECONDS)
        theirs = (info.get("shards") or {}).get("whole_model")
        if self.whole_model is not None and theirs is not None and theirs != self.whole_model:
            raise ValueError(
                f"this shard's --init model (fingerprint {self.whole_model}) differs from "
                f"shard 0's ({theirs}): every shard starts from the same file"
            )

    def follow(self, coordinator: Coordinator) -> DecisionFollower | None:
        """Shard 0 states its --init fingerprint; the others follow its decisions."""
        assert coordinator.shard is not None
        coordinator.shard.whole_model = self.whole_model
        if self.settings.leads:
            return None
        follower = DecisionFollower(
            self.peers, coordinator.shard.open_round, coordinator.shard.apply_decision
        )
        follower.start()
        return follower
