"""The network plan of one node: the bytes it sends and receives in a round, by kind, from the config alone.

Pure arithmetic on the config, no torch, like the memory plan (`plan.py`). Every term follows what the code sends:
- the shared parameters: hivemind's butterfly all-reduce over the n nodes that reach the round, in which a node
  sends and receives 2 (n-1)/n of the vector each, at the wire precision (`swarm.wire_compression`);
- each held shard: the same over its r holders (nothing when it has one);
- the frozen experts: every `refresh_every` rounds a node receives every shard it does not hold, as the holder's
  int8 update since the last refresh (`swarm.refresh_by_updates`; the steady state, since a node's first refresh
  takes whole shards) or else as whole shards at snapshot precision (fp16; fp32 on an uncompressed wire). What a
  node serves to others' refreshes is, averaged over the swarm, as much as it receives.

Beside it, for comparison: DiLoCo (the whole model all-reduced over the n nodes at the same wire precision) and the
reference implementation's central-server scheme (each node uploads the shared parameters and its experts and
downloads the whole model, every round). `benchmarks/bytes_per_round.py` measures the same kinds on real links.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from spes_node.config import WIRE_BYTES, SpesConfig
from spes_node.daemon.plan import WIRE_SNAPSHOT_BYTES, param_counts

UPDATE_BYTES = WIRE_BYTES["int8"]
"""Bytes per value of a served update (int8 blockwise; its fp32 scale per 1024 values is left out)."""


@dataclass(frozen=True)
class RoundTraffic:
    """Bytes one node sends plus receives per round, by kind (the steady state: refreshes by update)."""

    name: str
    nodes: int
    shards_held: int
    replicas: float
    """Holders of a shard, on average: nodes x shards held / shards."""
    refresh_every: int
    refresh_by_updates: bool
    sync_steps: int
    wire_compression: str
    overlap: str
    """Which all-reduces run beside the next round's steps: 'none', 'shards' (`swarm.overlap_shards`) or 'all'
    (`swarm.overlap`)."""
    shared: float
    """The shared parameters' all-reduce."""
    shard: float
    """The held shards' all-reduces."""
    refresh_received: float
    """Frozen-expert refreshes, per round (a refresh's bytes over `refresh_every` rounds)."""
    refresh_served: float
    """What the node serves to the others' refreshes, per round."""
    diloco: float
    """DiLoCo: the whole model all-reduced over the same nodes, at the same wire precision."""
    server: float
    """The reference's central-server scheme, at the same wire precision."""

    @property
    def total(self) -> float:
        return self.shared + self.shard + self.refresh_received + self.refresh_served

    @property
    def allreduce(self) -> float:
        """The all-reduces' share; the refresh runs beside training."""
        return self.shared + self.shard

    @property
    def stalling(self) -> float:
        """The all-reduces' bytes that training waits for: the shared parameters' alone when the shards' run beside
        the next steps, none when every group does."""
        return {"none": self.allreduce, "shards": self.shared, "all": 0.0}[self.overlap]

    @staticmethod
    def seconds(nbytes: float, rate_mbit: float) -> float:
        """Time on a link of `rate_mbit` each way for `nbytes` sent plus received: the two directions carry about as
        much and move at once."""
        return nbytes / 2 * 8 / (rate_mbit * 1e6)

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "total": self.total, "vs_diloco": self.total / self.diloco}


def allreduce_bytes(numel: float, group: float, wire_bytes: float) -> float:
    """Sent plus received by one member of a butterfly all-reduce of `numel` values in a group of `group`."""
    return 4 * (group - 1) / group * numel * wire_bytes if group > 1 else 0.0


def round_traffic(cfg: SpesConfig, nodes: int | None = None, shards_held: int = 1) -> RoundTraffic:
    """The bytes per round of a node holding `shards_held` shards in a swarm of `nodes` alike (default: enough nodes
    for `swarm.replication_target` holders of every shard)."""
    s = cfg.swarm
    S = s.num_shards
    if not 1 <= shards_held <= S:
        raise ValueError(f"--shards: expected 1 to {S} (swarm.num_shards), got {shards_held}")
    if nodes is None:
        nodes = max(2, math.ceil(S * s.replication_target / shards_held))
    if nodes < 1:
        raise ValueError(f"--nodes: expected at least 1, got {nodes}")
    counts = param_counts(cfg.model, S)
    wire = WIRE_BYTES[s.wire_compression]
    replicas = nodes * shards_held / S
    state = UPDATE_BYTES if s.refresh_by_updates else WIRE_SNAPSHOT_BYTES[s.wire_compression]
    refresh = (S - shards_held) * counts["shard"] * state / s.refresh_every
    own = counts["shared"] + shards_held * counts["shard"]
    return RoundTraffic(
        name=cfg.name,
        nodes=nodes,
        shards_held=shards_held,
        replicas=replicas,
        refresh_every=s.refresh_every,
        refresh_by_updates=s.refresh_by_updates,
        sync_steps=s.sync_steps,
        wire_compression=s.wire_compression,
        overlap="all" if s.overlap else "shards" if s.overlap_shards else "none",
        shared=allreduce_bytes(counts["shared"], nodes, wire),
        shard=shards_held * allreduce_bytes(counts["shard"], replicas, wire),
        refresh_received=refresh,
        refresh_served=refresh,
        diloco=allreduce_bytes(counts["total"], nodes, wire),
        server=own * wire + counts["total"] * wire,
    )


def traffic_table(t: RoundTraffic, rate_mbit: float) -> str:
    """The network plan as the CLI prints it."""
    gb = 1e9
    every = f"every {t.refresh_every} rounds" if t.refresh_every > 1 else "every round"
    by = "by int8 updates" if t.refresh_by_updates else "as whole shards"
    lines = [
        f"network per round ({t.sync_steps} steps): {t.nodes} nodes, {t.replicas:g} holders a shard, "
        f"{t.wire_compression} on the wire,",
        f"frozen experts refreshed {every} {by}",
        "",
    ]
    rows = [
        ("shared parameters (all-reduce)", t.shared),
        ("own shards (all-reduce)", t.shard),
        ("frozen-expert refresh received", t.refresh_received),
        ("frozen-expert refresh served", t.refresh_served),
        ("total, sent + received", t.total),
    ]
    width = max(len(r[0]) for r in rows) + 2
    lines.append(f"{'kind':<{width}}{'GB':>10}")
    lines += [f"{name:<{width}}{value / gb:>10.3f}" for name, value in rows]
    lines.append("")
    lines.append(
        f"DiLoCo at the same wire precision: {t.diloco / gb:.3f} GB (SPES moves {t.total / t.diloco:.2f} of it)"
    )
    lines.append(
        f"a central server: {t.server / gb:.3f} GB per node (SPES moves {t.total / t.server:.2f} of it), "
        "all of it through the server"
    )
    beside = {
        "none": "",
        "shards": "; the shards' begin once it is done and run beside the next steps (swarm.overlap_shards)",
        "all": "; they run beside the next steps (swarm.overlap)",
    }[t.overlap]
    lines.append(
        f"on a {rate_mbit:g} Mbit/s link each way: the all-reduces take {t.seconds(t.allreduce, rate_mbit):.0f} s "
        f"of each round, training waits {t.seconds(t.stalling, rate_mbit):.0f} s of it{beside};"
    )
    lines.append(
        f"the refresh {t.seconds(t.refresh_received + t.refresh_served, rate_mbit):.0f} s (beside the next steps)"
    )
    return "\n".join(lines)
