"""Shard math and shard decisions: which experts a shard holds, which shard to take, when to move.

Every function here is a pure function of the swarm's node records (as returned by
``spes_node.swarm.records.fetch_nodes``), so every node that sees the same records decides the same way.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Protocol

from spes_node.swarm.records import ACTIVE_STATES


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


def data_part(nodes, peer_id: str, current: int | None = None) -> tuple[int, int]:
    """This node's part of the data, (part, num_parts), disjoint from what every other live node reads.

    `nodes`: the swarm's records by peer id (our own, if present, is ignored); `current`: the part this node
    reads now (or read before a restart), None when it has none. Shards play no part: any two nodes read
    different documents, whatever the number of replicas of their shards.

    Part index: global, one per node, announced in the record (`NodeInfo.data_part`). A node keeps `current`
    unless a node with a smaller peer id announces the same index (two nodes that started at the same moment,
    or a part taken while its node was down); the others with a taken index, in peer id order, and then a
    node without one, take the lowest indices nobody announces, in order. Nodes that see the same records so
    reach distinct indices in one step, and a node keeps its index, hence its place in the data, for as long
    as it lives and across restarts.

    Documents: `TokenBatcher` reads training document t when t % num_parts == part. Here num_parts is the
    smallest power of two above the part index at which no other node's index (after the moves above) is
    congruent to ours; it changes as nodes come and go, and a change of num_parts for the same index only
    narrows or widens the documents read (`TokenBatcher.set_part` then keeps the position).
    Disjointness: let p != q with num_parts L_p <= L_q (both powers of two, so L_p divides L_q). A document
    t read by both has t = q (mod L_q), hence t = q (mod L_p), and t = p (mod L_p), so q = p (mod L_p),
    which the choice of L_p excludes. This holds once the nodes have read each other's records (at startup,
    after --wait-peers, and every round); until then a new node may read documents that a node whose
    num_parts it halves still reads. Coverage: when the indices in use are 0..n-1 with 2^(k-1) < n <= 2^k,
    every document is read: index r < 2^(k-1) reads the documents r mod 2^(k-1) alone, or splits them with
    index r + 2^(k-1) at num_parts 2^k. An index whose node is gone stays unread until a new node takes it.
    """
    claims = {
        peer: n.data_part
        for peer, n in nodes.items()
        if peer != peer_id and n.state != "leaving" and n.data_part is not None and n.data_part >= 0
    }
    if current is not None and current >= 0:
        claims[peer_id] = current
    owners: dict[int, str] = {}
    for peer in sorted(claims):
        owners.setdefault(claims[peer], peer)
    movers = sorted(peer for peer, part in claims.items() if owners[part] != peer)
    if peer_id not in claims:
        movers.append(peer_id)
    free = (index for index in itertools.count() if index not in owners)
    settled = {peer: part for part, peer in owners.items()} | dict(zip(movers, free))
    part = settled.pop(peer_id)
    others = set(settled.values())
    num_parts = 1
    while num_parts <= part or any(q % num_parts == part for q in others):
        num_parts *= 2
    return part, num_parts
