"""`spes-node join` with benchmark instrumentation: `python -m benchmarks.node_runner join ARGS...`.

The daemon runs unchanged; a few methods are wrapped to record what the benchmarks need, written as JSON to
`$SPES_BENCH_TIMELINE` when the node shuts down:
- wall-clock times of every training step (with its tokens), of every round (begin: the sync starts; end: its
  result is applied) and of startup;
- at each round start and at shutdown, the node's byte counters by kind and the bytes its state server sent
  (frozen-expert refreshes it served to others), so that bytes can be attributed to rounds;
- the resident-set size after imports and its high-water mark at shutdown (training process only).

Switches, all from the environment:
- `SPES_BENCH_NO_SYNC=1`: a round does nothing but count itself (no averaging, refresh or merge, no training on
  while waiting for peers); the loop, its per-round checkpoints and `--max-rounds` stay, so the run is "the same
  loop with syncing turned off".
- `SPES_BENCH_DATA_PART=i/n`: read data part i of n. Nodes that start together compute their part before they
  see each other's records, so two replicas of a shard can pick the same part; the benchmarks pin parts to
  compare methods on disjoint data. The part the node would have chosen is recorded too.
- `SPES_BENCH_EXIT_AFTER_STARTUP=1`: leave (cleanly) as soon as startup is done, for join-time measurements.
- `SPES_BENCH_STEP_DELAY=S`: every training step takes S seconds longer (counted as step time), a slower card.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from benchmarks.common import rss_kib
from spes_node.cli import main as cli_main
from spes_node.daemon import node as node_module
from spes_node.daemon.node import Node
from spes_node.daemon.round import RoundInputs, RoundReport, SpesRound
from spes_node.daemon.trainer import Trainer

TIMELINE: dict = {
    "process_start": time.time(),
    "steps": [],
    "rounds": [],
    "counters": [],
    "startup": {},
    "data_part": {},
    "no_sync": os.environ.get("SPES_BENCH_NO_SYNC") == "1",
}


def _counters(node: Node) -> dict:
    sync = getattr(node, "sync", None)
    server = getattr(sync, "server", None)
    return {
        "time": time.time(),
        "round": node.status.round,
        "sent": dict(node.status.bytes_sent),
        "received": dict(node.status.bytes_received),
        "served": int(getattr(server, "bytes_sent", 0)),
    }


def _wrap_train_step(original):
    delay = float(os.environ.get("SPES_BENCH_STEP_DELAY", "0"))

    def train_step(self: Trainer, *args, **kwargs):
        stats = original(self, *args, **kwargs)
        if delay > 0:
            time.sleep(delay)  # the slower card's extra time per step
            stats.seconds += delay
        TIMELINE["steps"].append([time.time(), stats.tokens, stats.seconds])
        return stats

    return train_step


def _wrap_node_begin_round(original):
    def _begin_round(self: Node, *args, **kwargs) -> None:
        # what the round does first: the previous round's refresh belongs to that round
        self.sync.finish_pending()
        self.status.add_bytes("refresh", 0, self.sync.take_refresh_bytes())
        TIMELINE["counters"].append(_counters(self))
        original(self, *args, **kwargs)

    return _begin_round


def _wrap_begin_round(original):
    def begin_round(self: SpesRound, inputs: RoundInputs, overlap: bool, **kwargs) -> None:
        called = time.time()
        self.finish_pending()
        TIMELINE["rounds"].append(
            {
                "called": called,
                "start": time.time(),
                "overlap": overlap or kwargs.get("overlap_shards", False),
            }
        )
        if not TIMELINE["no_sync"]:
            original(self, inputs, overlap, **kwargs)
            return
        self._inflight = SimpleNamespace(inputs=inputs, handles=list)  # ready at once, nothing to average

    return begin_round


def _wrap_complete_round(original):
    def complete_round(self: SpesRound) -> RoundReport:
        report = _skip_round(self) if TIMELINE["no_sync"] else original(self)
        TIMELINE["rounds"][-1].update(end=time.time(), report=dict(self.last_report))
        return report

    return complete_round


def _no_wait(self: SpesRound, *args, **kwargs) -> float:
    """Without syncs nobody waits for peers, so nobody trains on past H while waiting for them either."""
    return 0.0


def _skip_round(sync: SpesRound) -> RoundReport:
    flight, sync._inflight = sync._inflight, None
    report = RoundReport(
        round=flight.inputs.round + 1,
        loss=flight.inputs.loss,
        shards=sync.shards,
        data_part=flight.inputs.data_part,
        shared_group=1,
        shard_groups={shard: 1 for shard in sync.shards},
        steps=flight.inputs.steps,
    )
    sync.last_report = report.as_dict()
    return report


def _wrap_startup(original):
    def startup(self: Node) -> None:
        TIMELINE["startup"]["start"] = time.time()
        TIMELINE["startup"]["rss_kib_before"] = rss_kib()
        original(self)
        TIMELINE["startup"]["end"] = time.time()
        TIMELINE["startup"]["shard"] = self.shard
        if os.environ.get("SPES_BENCH_EXIT_AFTER_STARTUP") == "1":
            self.stop_event.set()

    return startup


def _wrap_shutdown(original):
    def shutdown(self: Node) -> None:
        TIMELINE["rss_kib_peak"] = rss_kib("VmHWM")
        if getattr(self, "sync", None) is not None:
            TIMELINE["counters"].append(_counters(self))
        TIMELINE["exit"] = time.time()
        try:
            original(self)
        finally:
            path = os.environ.get("SPES_BENCH_TIMELINE")
            if path:
                Path(path).write_text(json.dumps(TIMELINE))

    return shutdown


def _wrap_data_part(original):
    def data_part(*args, **kwargs):
        chosen = original(*args, **kwargs)
        TIMELINE["data_part"]["chosen"] = list(chosen)
        pinned = os.environ.get("SPES_BENCH_DATA_PART")
        if not pinned:
            return chosen
        part, num_parts = (int(x) for x in pinned.split("/"))
        TIMELINE["data_part"]["pinned"] = [part, num_parts]
        return part, num_parts

    return data_part


def install() -> None:
    Trainer.train_step = _wrap_train_step(Trainer.train_step)
    Node._begin_round = _wrap_node_begin_round(Node._begin_round)
    SpesRound.begin_round = _wrap_begin_round(SpesRound.begin_round)
    SpesRound.complete_round = _wrap_complete_round(SpesRound.complete_round)
    if TIMELINE["no_sync"]:
        SpesRound.wait_ahead = _no_wait
    Node.startup = _wrap_startup(Node.startup)
    Node.shutdown = _wrap_shutdown(Node.shutdown)
    node_module.data_part = _wrap_data_part(node_module.data_part)


if __name__ == "__main__":
    install()
    sys.exit(cli_main())
