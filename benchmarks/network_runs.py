"""Swarms whose nodes sit in network namespaces behind shaped links, and what their links carried per round.

Shared by the bytes-per-round and link-utilisation benchmarks. A round's window on a node runs from the moment it
begins its sync (after the previous round's refresh has arrived) to the moment it begins the next one, so the
window holds that round's all-reduces and its frozen-expert refresh. Only complete windows are used: the last
round's refresh may be cut short when its holders leave.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.netns import CounterSampler, ShapedNetwork
from benchmarks.swarm import BenchSwarm, NodeRun
from spes_node.config import SpesConfig

logger = logging.getLogger(__name__)

ACTIVE_FRACTION = 0.05
"""A counter interval is "transferring" when either direction moves more than this fraction of the link rate."""


@dataclass
class RoundWindow:
    node: str
    round: int
    start: float
    end: float
    payload_sent: dict[str, int]
    payload_received: dict[str, int]
    wire_sent: int
    wire_received: int
    active_start: float | None
    active_end: float | None
    active_wire_sent: int
    """Wire bytes sent from the first to the last transferring interval (idle gaps inside included)."""
    active_wire_received: int

    @property
    def payload_total(self) -> int:
        return sum(self.payload_sent.values()) + sum(self.payload_received.values())

    @property
    def wire_total(self) -> int:
        return self.wire_sent + self.wire_received


@dataclass
class NetworkRun:
    label: str
    cfg: SpesConfig
    rate_mbit: float | None
    nodes: list[NodeRun]
    windows: list[RoundWindow]
    seconds: float


_CACHE: dict[tuple, NetworkRun] = {}


def run_shaped_swarm(
    label: str,
    cfg: SpesConfig,
    num_nodes: int,
    rate_mbit: float | None,
    rounds: int,
    workdir: Path,
    timeout: float,
    use_netns: bool = True,
) -> NetworkRun:
    """Run (or reuse, within this process) a swarm in namespaces and cut its link counters into round windows.

    Without `use_netns` the swarm runs on 127.0.0.1 and the windows carry the nodes' accounting only (wire 0).
    """
    key = (cfg.to_json(), num_nodes, rate_mbit, rounds, use_netns)
    if key in _CACHE:
        return _CACHE[key]
    started = time.time()
    if use_netns:
        with ShapedNetwork(num_nodes, rate_mbit) as network:
            swarm = BenchSwarm(workdir, cfg, num_nodes, run_id=label.replace(" ", "_"), network=network)
            with CounterSampler(network) as sampler:
                nodes = swarm.run(max_rounds=rounds, timeout=timeout)
        samples = sampler.samples
    else:
        nodes = BenchSwarm(workdir, cfg, num_nodes, run_id=label.replace(" ", "_")).run(
            rounds, timeout=timeout
        )
        samples = [[] for _ in nodes]
    windows = []
    for i, node in enumerate(nodes):
        windows.extend(round_windows(node, samples[i], rate_mbit))
    run = NetworkRun(label, cfg, rate_mbit, nodes, windows, time.time() - started)
    _CACHE[key] = run
    return run


def round_windows(
    node: NodeRun, samples: list[tuple[float, int, int]], rate_mbit: float | None
) -> list[RoundWindow]:
    """The node's complete round windows with payload (node's own accounting) and wire bytes (link counters)."""
    rounds, counters = node.timeline["rounds"], node.timeline["counters"]
    times = [s[0] for s in samples]
    threshold = ACTIVE_FRACTION * rate_mbit * 1e6 / 8 if rate_mbit else 1e5
    windows = []
    for k in range(len(rounds) - 1):
        start, end = rounds[k]["start"], rounds[k + 1]["start"]
        before, after = counters[k], counters[k + 1]
        sent = {
            kind: after["sent"].get(kind, 0) - before["sent"].get(kind, 0) for kind in ("shared", "shard")
        }
        sent["refresh_served"] = after["served"] - before["served"]
        received = {
            kind: after["received"].get(kind, 0) - before["received"].get(kind, 0)
            for kind in ("shared", "shard", "refresh")
        }
        if not samples:
            windows.append(RoundWindow(node.name, k + 1, start, end, sent, received, 0, 0, None, None, 0, 0))
            continue
        lo, hi = _at(times, start), _at(times, end)
        active = [
            j
            for j in range(lo + 1, hi + 1)
            if max(samples[j][1] - samples[j - 1][1], samples[j][2] - samples[j - 1][2])
            > threshold * (samples[j][0] - samples[j - 1][0])
        ]
        first, last = (active[0] - 1, active[-1]) if active else (lo, lo)
        windows.append(
            RoundWindow(
                node=node.name,
                round=k + 1,
                start=start,
                end=end,
                payload_sent=sent,
                payload_received=received,
                wire_sent=samples[hi][1] - samples[lo][1],
                wire_received=samples[hi][2] - samples[lo][2],
                active_start=samples[first][0] if active else None,
                active_end=samples[last][0] if active else None,
                active_wire_sent=samples[last][1] - samples[first][1],
                active_wire_received=samples[last][2] - samples[first][2],
            )
        )
    return windows


def _at(times: list[float], t: float) -> int:
    """Index of the last sample taken at or before t (0 if none)."""
    return max(0, bisect.bisect_right(times, t) - 1)
