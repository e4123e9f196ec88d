"""Shard math and shard decisions: which experts a shard holds, which shard to take, when to move.

Every function here is a pure function of the swarm's node records (as returned by
``spes_node.records.fetch_nodes``), so every node that sees the same records decides the same way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

ACTIVE_STATES = frozenset({"training", "averaging"})


class ShardHolder(Protocol):
    shards: Sequence[int]
    tokens_per_s: float


class StatefulShardHolder(ShardHolder, Protocol):
    state: str


def _check_split(num_experts: int, num_shards: int) -> None:
    if num_shards < 1:
        raise ValueError(f"num_shards must be at least 1, got {num_shards}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be at least 1, got {num_experts}")
    if num_experts % num_shards != 0:
        raise ValueError(f"num_experts ({num_experts}) must be divisible by num_shards ({num_shards})")


def shard_experts(shard: int, num_experts: int, num_shards: int) -> range:
    """Expert indices (in every MoE layer) trained by the holders of ``shard``."""
    _check_split(num_experts, num_shards)
    if not 0 <= shard < num_shards:
        raise ValueError(f"shard must be in [0, {num_shards}), got {shard}")
    per_shard = num_experts // num_shards
    return range(shard * per_shard, (shard + 1) * per_shard)


def expert_to_shard(expert: int, num_experts: int, num_shards: int) -> int:
    """The shard whose holders train ``expert``."""
    _check_split(num_experts, num_shards)
    if not 0 <= expert < num_experts:
        raise ValueError(f"expert must be in [0, {num_experts}), got {expert}")
    return expert // (num_experts // num_shards)


def replica_counts(nodes: Mapping[str, ShardHolder], num_shards: int) -> list[int]:
    """Number of nodes holding each shard; shard ids outside [0, num_shards) are ignored."""
    counts = [0] * num_shards
    for node in nodes.values():
        for shard in set(node.shards):
            if 0 <= shard < num_shards:
                counts[shard] += 1
    return counts


def _throughputs(nodes: Mapping[str, ShardHolder], num_shards: int) -> list[float]:
    totals = [0.0] * num_shards
    for node in nodes.values():
        for shard in set(node.shards):
            if 0 <= shard < num_shards:
                totals[shard] += node.tokens_per_s
    return totals


def _neediest_shard(nodes: Mapping[str, ShardHolder], num_shards: int) -> int:
    counts = replica_counts(nodes, num_shards)
    throughputs = _throughputs(nodes, num_shards)
    return min(range(num_shards), key=lambda shard: (counts[shard], throughputs[shard], shard))


def choose_shard(
    nodes: Mapping[str, ShardHolder], num_shards: int, *, exclude_peer: str | None = None
) -> int:
    """The shard a joining node should take: fewest replicas, then least total tokens/s, then lowest id.

    ``exclude_peer`` leaves one node (usually the caller's own, stale record) out of the count.
    """
    if num_shards < 1:
        raise ValueError(f"num_shards must be at least 1, got {num_shards}")
    others = {peer: node for peer, node in nodes.items() if peer != exclude_peer}
    return _neediest_shard(others, num_shards)


def under_replicated(nodes: Mapping[str, ShardHolder], num_shards: int, target: int) -> list[int]:
    """Shards held by fewer than ``target`` nodes, in increasing order."""
    counts = replica_counts(nodes, num_shards)
    return [shard for shard in range(num_shards) if counts[shard] < target]


def plan_rebalance(
    nodes: Mapping[str, StatefulShardHolder], my_peer_id: str, num_shards: int, target: int
) -> int | None:
    """The shard this node should move to now, or None to stay.

    A move happens when the least-replicated shard is below ``target`` and the most-replicated
    shard has at least two replicas more (so the move strictly evens out the replication; this
    includes every case of one shard below and another above the target). Exactly one node moves
    per decision: the training holder with the lowest peer id of the most-replicated shard (ties:
    lowest shard id). It moves to the shard ``choose_shard`` would pick. Every live node counts
    as a replica of its shards, but only training or averaging nodes are asked to move.
    """
    if target < 1:
        raise ValueError(f"target must be at least 1, got {target}")
    counts = replica_counts(nodes, num_shards)
    destination = _neediest_shard(nodes, num_shards)
    source = min(range(num_shards), key=lambda shard: (-counts[shard], shard))
    if counts[destination] >= target or counts[source] - counts[destination] < 2:
        return None
    movers = sorted(
        peer for peer, node in nodes.items() if node.state in ACTIVE_STATES and source in node.shards
    )
    if not movers or movers[0] != my_peer_id:
        return None
    return destination


def assign_joiners(
    nodes: Mapping[str, ShardHolder], joiners: Sequence[str], num_shards: int
) -> dict[str, int]:
    """Shards for nodes joining at the same time: in peer-id order, each takes ``choose_shard`` of the swarm
    plus the joiners before it, so simultaneous joiners spread out instead of all taking the same shard."""

    class _Claim:
        def __init__(self, shard: int):
            self.shards, self.tokens_per_s = [shard], 0.0

    counted = {peer: node for peer, node in nodes.items() if node.shards and peer not in joiners}
    assigned: dict[str, int] = {}
    for peer in sorted(set(joiners)):
        shard = choose_shard(counted, num_shards)
        assigned[peer] = shard
        counted[peer] = _Claim(shard)
    return assigned
