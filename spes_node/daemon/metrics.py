"""Prometheus metrics of one daemon, served on `--metrics-port` from a registry of its own.

The node hands over its status (and the report of its last round) with `update`; a scrape reads the
latest values, so totals that the node already counts are exposed as counters without double counting.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from spes_node.daemon.node import NodeStatus

logger = logging.getLogger(__name__)

BYTE_KINDS = ("shared", "shard", "refresh", "state_download")
GROUPS = ("shared", "shard")
STATES = ("joining", "training", "averaging", "leaving")
PHASES = ("matchmaking", "allreduce", "after")
"""Where a round's time goes (`RoundReport.phases`)."""


class _Snapshot:
    def __init__(self) -> None:
        self.state = "joining"
        self.round = 0
        self.step = 0
        self.tokens = 0
        self.tokens_per_s = 0.0
        self.loss = math.nan
        self.round_loss = math.nan
        self.bytes_sent: dict[str, int] = {}
        self.bytes_received: dict[str, int] = {}
        self.group_size = {group: 0 for group in GROUPS}
        self.round_seconds = math.nan
        self.rounds = 0
        self.round_seconds_total = 0.0
        self.failures = 0
        self.failed_parts = 0
        self.round_steps = 0
        self.steps_while_waiting = 0
        self.phase_seconds = {phase: 0.0 for phase in PHASES}
        self.stalled_seconds = 0.0


class _NodeCollector(Collector):
    def __init__(self, snapshot: _Snapshot, lock: threading.Lock):
        self._snapshot, self._lock = snapshot, lock

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            return iter(self._families(self._snapshot))

    @staticmethod
    def _families(s: _Snapshot) -> list[Metric]:
        state = GaugeMetricFamily("spes_state", "1 for the node's current state.", labels=["state"])
        for name in sorted(set(STATES) | {s.state}):
            state.add_metric([name], 1.0 if name == s.state else 0.0)
        traffic = []
        for direction, totals in (("sent", s.bytes_sent), ("received", s.bytes_received)):
            family = CounterMetricFamily(
                f"spes_bytes_{direction}",
                f"Bytes {direction} on the wire, by kind of transfer.",
                labels=["kind"],
            )
            for kind in sorted(set(BYTE_KINDS) | set(totals)):
                family.add_metric([kind], totals.get(kind, 0))
            traffic.append(family)
        groups = GaugeMetricFamily(
            "spes_group_size", "Peers in the last averaging group (1: averaged alone).", labels=["group"]
        )
        for group in GROUPS:
            groups.add_metric([group], s.group_size[group])
        phases = CounterMetricFamily(
            "spes_round_phase_seconds",
            "Time spent in round syncs, by phase: matchmaking (finding groups, waiting for their members), "
            "allreduce, after (applying the averages, refreshing, merging, publishing).",
            labels=["phase"],
        )
        for phase in PHASES:
            phases.add_metric([phase], s.phase_seconds[phase])
        return [
            _gauge("spes_loss", "Training loss of the latest local step.", s.loss),
            _gauge("spes_round_loss", "Mean training loss of the last finished round.", s.round_loss),
            _gauge("spes_tokens_per_second", "Local training throughput.", s.tokens_per_s),
            _gauge("spes_round", "Round the node is in (rounds finished by the swarm).", s.round),
            _gauge("spes_step", "Local optimizer steps.", s.step),
            _counter("spes_tokens", "Tokens trained on by this node.", s.tokens),
            state,
            *traffic,
            groups,
            _gauge("spes_round_duration_seconds", "Duration of the last round's sync.", s.round_seconds),
            _counter("spes_rounds", "Rounds finished by this node.", s.rounds),
            _counter("spes_round_seconds", "Total time spent in round syncs.", s.round_seconds_total),
            phases,
            _counter(
                "spes_round_stalled_seconds",
                "Time the rounds held training (less than spes_round_seconds where all-reduces run beside steps).",
                s.stalled_seconds,
            ),
            _gauge("spes_round_steps", "Local steps of the last finished round.", s.round_steps),
            _counter(
                "spes_steps_while_waiting",
                "Steps trained past H while waiting for slower peers (swarm.train_while_waiting).",
                s.steps_while_waiting,
            ),
            _counter("spes_averaging_failures", "All-reduces that failed (local weights kept).", s.failures),
            _counter(
                "spes_averaging_failed_parts",
                "Parts of all-reduces whose reducer failed or was ignored (those parts kept local weights).",
                s.failed_parts,
            ),
        ]


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, documentation, value=value)


class NodeMetrics:
    """A node's Prometheus endpoint; with `port=None` it only keeps the values (for tests and `render`)."""

    def __init__(self, port: int | None, addr: str = "0.0.0.0"):
        self._lock = threading.Lock()
        self._snapshot = _Snapshot()
        self._last_report_round: int | None = None
        self.registry = CollectorRegistry()
        self.registry.register(_NodeCollector(self._snapshot, self._lock))
        ProcessCollector(registry=self.registry)
        self.port: int | None = None
        self._server = None
        if port is not None:
            if not 0 <= port <= 65535:
                raise ValueError(f"--metrics-port: {port} is not a TCP port")
            try:
                self._server, _ = start_http_server(port, addr=addr, registry=self.registry)
            except OSError as e:
                raise ValueError(
                    f"--metrics-port: cannot listen on {addr}:{port}: {e.strerror or e}"
                ) from None
            self.port = self._server.server_port
            logger.info(f"Prometheus metrics on http://{addr}:{self.port}/metrics")

    def update(self, status: NodeStatus, report: dict | None = None, *, step: int | None = None) -> None:
        """Take the node's current figures; a round report is counted once (by its round number)."""
        with self._lock:
            s = self._snapshot
            s.state = status.state
            s.round = status.round
            s.tokens = status.tokens
            s.tokens_per_s = status.tokens_per_s
            s.loss = status.loss
            s.bytes_sent = dict(status.bytes_sent)
            s.bytes_received = dict(status.bytes_received)
            if step is not None:
                s.step = step
            if report and report.get("round") != self._last_report_round:
                self._last_report_round = report.get("round")
                s.round_loss = float(report.get("loss", math.nan))
                s.group_size["shared"] = int(report.get("shared_group", 0))
                s.group_size["shard"] = int(report.get("shard_group", 0))
                s.round_seconds = float(report.get("seconds", math.nan))
                s.rounds += 1
                s.round_seconds_total += 0.0 if math.isnan(s.round_seconds) else s.round_seconds
                s.failures += len(report.get("errors", ()))
                s.failed_parts += int(report.get("failed_parts", 0))
                s.round_steps = int(report.get("steps", 0))
                s.steps_while_waiting += int(report.get("steps_while_waiting", 0))
                stalled = float(report.get("stalled", 0.0))
                s.stalled_seconds += stalled if math.isfinite(stalled) and stalled >= 0 else 0.0
                for phase, seconds in report.get("phases", {}).items():
                    if phase in s.phase_seconds and math.isfinite(seconds) and seconds >= 0:
                        s.phase_seconds[phase] += seconds

    def render(self) -> bytes:
        """The text a scrape returns."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
