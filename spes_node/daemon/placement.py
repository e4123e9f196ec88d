"""Shard math and shard decisions: which experts a shard holds, which shards to take, when to move.

Every function here is a pure function of the swarm's node records (as returned by
``spes_node.swarm.records.fetch_nodes``), so every node that sees the same records decides the same way.

Placement ranks the shards by need, in this order (``rank_shards``):

1. coverage: a shard nobody holds;
2. reachability: a shard whose holders all take no inbound connections (client mode): nobody can download its
   state (circuit relays carry small requests, not bulk state), so joiners, refreshes and exports cannot get it;
3. replication: a shard with fewer holders than the swarm's replication target, fewest first;
4. throughput: the shard with the least total tokens/s of its holders (a holder that has not measured its speed
   yet counts as a typical node of the swarm, so a new node is never taken for a slow one).

A node that takes no inbound connections does not become the only kind of holder a shard has: whenever some
shard has a reachable holder, it takes only shards that have one (fewer than its capacity if those run out).
The rebalance decision (``plan_rebalance_move``) moves a holder only when that strictly lowers the swarm's
deficits in the same order without uncovering a shard or leaving one without a reachable holder, and sends it
where ``rank_shards`` would place it.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from spes_node.swarm.records import ACTIVE_STATES

DEFAULT_TARGET = 2
"""Replication target when the caller gives none (the config's ``swarm.replication_target`` default)."""


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


def reachable(node) -> bool:
    """Whether other peers can open connections to this node (and so download its state): not in client mode.
    A client-mode node with circuit relay addresses still counts as unreachable: relays carry small requests."""
    return not getattr(node, "client_mode", False)


def _held(node, num_shards: int) -> set[int]:
    return {shard for shard in node.shards if 0 <= shard < num_shards}


def replica_counts(nodes: Mapping[str, ShardHolder], num_shards: int) -> list[int]:
    """Number of nodes holding each shard; shard ids outside [0, num_shards) are ignored."""
    counts = [0] * num_shards
    for node in nodes.values():
        for shard in _held(node, num_shards):
            counts[shard] += 1
    return counts


def reachable_counts(nodes: Mapping[str, ShardHolder], num_shards: int) -> list[int]:
    """Number of reachable nodes (see ``reachable``) holding each shard."""
    counts = [0] * num_shards
    for node in nodes.values():
        if reachable(node):
            for shard in _held(node, num_shards):
                counts[shard] += 1
    return counts


def under_replicated(nodes: Mapping[str, ShardHolder], num_shards: int, target: int) -> list[int]:
    """Shards held by fewer than ``target`` nodes, in increasing order."""
    counts = replica_counts(nodes, num_shards)
    return [shard for shard in range(num_shards) if counts[shard] < target]


def unreachable_only(nodes: Mapping[str, ShardHolder], num_shards: int) -> list[int]:
    """Shards that have holders, none of them reachable, in increasing order."""
    counts, reach = replica_counts(nodes, num_shards), reachable_counts(nodes, num_shards)
    return [shard for shard in range(num_shards) if counts[shard] and not reach[shard]]


def typical_throughput(nodes: Mapping[str, ShardHolder]) -> float:
    """The tokens/s assumed for a node that has not measured its own yet: the median of those that have (1.0 when
    none has), so that throughput falls back to counting nodes rather than treating new nodes as idle."""
    measured = [n.tokens_per_s for n in nodes.values() if n.tokens_per_s > 0]
    return statistics.median(measured) if measured else 1.0


@dataclass
class ShardStats:
    """Per shard: holders, reachable holders, total tokens/s of the holders."""

    counts: list[int]
    reachable: list[int]
    throughput: list[float]
    typical: float

    @classmethod
    def of(cls, nodes: Mapping[str, ShardHolder], num_shards: int) -> ShardStats:
        live = _live(nodes)
        typical = typical_throughput(live)
        stats = cls([0] * num_shards, [0] * num_shards, [0.0] * num_shards, typical)
        for node in live.values():
            stats.add(_held(node, num_shards), reachable(node), node.tokens_per_s)
        return stats

    def add(self, shards: Iterable[int], is_reachable: bool, tokens_per_s: float, sign: int = 1) -> None:
        speed = tokens_per_s if tokens_per_s > 0 else self.typical
        for shard in shards:
            self.counts[shard] += sign
            self.reachable[shard] += sign * int(is_reachable)
            self.throughput[shard] += sign * speed

    def need(self, shard: int, target: int) -> tuple:
        """Sort key of a shard's need, neediest first: coverage, reachability, replication, throughput."""
        count = self.counts[shard]
        tier = 0 if count == 0 else 1 if self.reachable[shard] == 0 else 2 if count < target else 3
        return (tier, count if tier == 2 else 0, self.throughput[shard], count, shard)

    def deficits(self, target: int) -> tuple[int, int, int]:
        """(shards nobody holds, held shards without a reachable holder, replicas missing below target)."""
        return (
            sum(1 for c in self.counts if c == 0),
            sum(1 for c, r in zip(self.counts, self.reachable) if c and not r),
            sum(max(0, target - c) for c in self.counts),
        )

    def rank(self, target: int, client_mode: bool = False, exclude: Iterable[int] = ()) -> list[int]:
        """Shards a node may take, neediest first. A client-mode node, whenever some shard has a reachable holder,
        may take only shards that have one."""
        excluded = set(exclude)
        candidates = [s for s in range(len(self.counts)) if s not in excluded]
        if client_mode and any(self.reachable):
            candidates = [s for s in candidates if self.reachable[s] > 0]
        return sorted(candidates, key=lambda shard: self.need(shard, target))


def _live(nodes: Mapping[str, ShardHolder]) -> dict[str, ShardHolder]:
    """Nodes that count as holders: every node but those leaving."""
    return {peer: n for peer, n in nodes.items() if getattr(n, "state", "training") != "leaving"}


def _check_target(num_shards: int, target: int) -> None:
    if num_shards < 1:
        raise ValueError(f"num_shards must be at least 1, got {num_shards}")
    if target < 1:
        raise ValueError(f"target must be at least 1, got {target}")


def rank_shards(
    nodes: Mapping[str, ShardHolder],
    num_shards: int,
    *,
    target: int = DEFAULT_TARGET,
    client_mode: bool = False,
    exclude: Iterable[int] = (),
) -> list[int]:
    """The shards a node may take given the swarm's records, neediest first (see the module's docstring)."""
    _check_target(num_shards, target)
    return ShardStats.of(nodes, num_shards).rank(target, client_mode, exclude)


def choose_shards(
    nodes: Mapping[str, ShardHolder],
    num_shards: int,
    capacity: int,
    *,
    target: int = DEFAULT_TARGET,
    client_mode: bool = False,
    exclude_peer: str | None = None,
    held: Sequence[int] = (),
) -> list[int]:
    """The shards a node with room for ``capacity`` shards should hold: ``held`` (kept, first), then one at a time
    the neediest shard by ``rank_shards``, counting the node's own earlier picks. Fewer than ``capacity`` when a
    client-mode node runs out of shards with a reachable holder.

    ``exclude_peer`` leaves one node (usually the caller's own, stale record) out of the swarm.
    """
    _check_target(num_shards, target)
    if capacity < 1:
        raise ValueError(f"capacity must be at least 1, got {capacity}")
    others = {peer: node for peer, node in nodes.items() if peer != exclude_peer}
    stats = ShardStats.of(others, num_shards)
    chosen = list(dict.fromkeys(s for s in held if 0 <= s < num_shards))
    stats.add(chosen, not client_mode, 0.0)
    while len(chosen) < min(capacity, num_shards):
        ranked = stats.rank(target, client_mode, exclude=chosen)
        if not ranked:
            break
        chosen.append(ranked[0])
        stats.add(ranked[:1], not client_mode, 0.0)
    return chosen


def choose_shard(
    nodes: Mapping[str, ShardHolder],
    num_shards: int,
    *,
    exclude_peer: str | None = None,
    target: int = DEFAULT_TARGET,
    client_mode: bool = False,
) -> int:
    """The one shard a joining node should take (``choose_shards`` with capacity 1)."""
    return choose_shards(
        nodes, num_shards, 1, target=target, client_mode=client_mode, exclude_peer=exclude_peer
    )[0]


@dataclass(frozen=True)
class Move:
    """One holder leaves one shard for another."""

    peer: str
    source: int
    destination: int


def plan_rebalance_move(
    nodes: Mapping[str, StatefulShardHolder], num_shards: int, target: int
) -> Move | None:
    """The one move the swarm should make now, or None.

    Candidates: a training or averaging node gives up one of its shards and takes, in its place, the first shard
    ``rank_shards`` offers it (its other shards excluded) in the swarm without that holding. A candidate counts
    only if it strictly lowers ``ShardStats.deficits`` (coverage, then reachability, then missing replicas) and
    raises neither of the first two: a move never uncovers a shard, never leaves a shard with only unreachable
    holders, and never just swaps which shard is short. Among those: the lowest deficits after the move, then the source with the
    most holders, then the lowest peer id, then the lowest source shard. Every live node (joining ones too) counts
    as a holder; leaving nodes do not. Throughput alone never moves a node: it only steers joiners.
    """
    _check_target(num_shards, target)
    stats = ShardStats.of(nodes, num_shards)
    now = stats.deficits(target)
    best: tuple | None = None
    for peer, node in _live(nodes).items():
        if node.state not in ACTIVE_STATES:
            continue
        mine, is_reachable = _held(node, num_shards), reachable(node)
        for source in sorted(mine):
            count_before = stats.counts[source]
            stats.add([source], is_reachable, node.tokens_per_s, sign=-1)
            ranked = stats.rank(target, not is_reachable, exclude=mine - {source})
            destination = ranked[0] if ranked else source
            if destination != source:
                stats.add([destination], is_reachable, node.tokens_per_s)
                after = stats.deficits(target)
                stats.add([destination], is_reachable, node.tokens_per_s, sign=-1)
                key = (after, -count_before, peer, source)
                allowed = after < now and after[0] <= now[0] and after[1] <= now[1]
                if allowed and (best is None or key < best[0]):
                    best = (key, Move(peer, source, destination))
            stats.add([source], is_reachable, node.tokens_per_s)
    return best[1] if best is not None else None


def plan_rebalance(
    nodes: Mapping[str, StatefulShardHolder], my_peer_id: str, num_shards: int, target: int
) -> int | None:
    """The shard this node should move to now, or None to stay (``plan_rebalance_move``, when it is our move).
    Which of our shards to leave is ``plan_rebalance_move(...).source``."""
    move = plan_rebalance_move(nodes, num_shards, target)
    return move.destination if move is not None and move.peer == my_peer_id else None


def assign_joiners(
    nodes: Mapping[str, ShardHolder],
    joiners: Sequence[str],
    num_shards: int,
    *,
    target: int = DEFAULT_TARGET,
    capacities: Mapping[str, int] | None = None,
) -> dict[str, list[int]]:
    """Shards for nodes joining at the same time: in peer-id order, each takes ``choose_shards`` of the swarm plus
    the joiners before it, so simultaneous joiners spread out instead of all taking the same shards.

    A joiner's client mode is read from its record in ``nodes`` (reachable when it has none); its capacity from
    ``capacities`` (1 when absent: a node does not know the others' memory). A joiner's first shard does not
    depend on its own capacity, so every joiner computes the same first shards for all of them.
    """
    capacities = capacities or {}

    class _Claim:
        def __init__(self, shards: list[int], client_mode: bool):
            self.shards, self.tokens_per_s, self.client_mode = shards, 0.0, client_mode

    counted = {peer: node for peer, node in nodes.items() if node.shards and peer not in joiners}
    assigned: dict[str, list[int]] = {}
    for peer in sorted(set(joiners)):
        client_mode = not reachable(nodes[peer]) if peer in nodes else False
        shards = choose_shards(
            counted, num_shards, capacities.get(peer, 1), target=target, client_mode=client_mode
        )
        assigned[peer] = shards
        counted[peer] = _Claim(shards, client_mode)
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
