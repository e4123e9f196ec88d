"""All-reduces of a large vector between averaging peers in network namespaces, each behind a tbf-shaped link.

Each peer (`link_peer.py`) runs in its own namespace, with a `GroupAverager` (weights mode, fp16 on the wire) over
a vector large enough that one all-reduce keeps the link busy for several seconds; the bootstrap DHT runs here, on
the bridge. The peers start each all-reduce together (a `go` line on their stdin) and report what their averager
counted, when the all-reduce began and ended, and the CPU seconds their processes used.

Time on the wire T: from the first to the last 20 ms interval in which the peer's link moved more than 5% of the
rate in either direction, from the moment the peer's all-reduce began (its averager's stage) until it ended. Per direction, utilisation = bytes / (T x rate), with the bytes counted
on the interface (everything: TCP/IP headers, encryption, multiplexing) and with the averager's own count (the
serialized all-reduce messages, the useful part). A peer's utilisation is that of its busier direction.
"""

from __future__ import annotations

import bisect
import json
import logging
import os
import queue
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.common import NODE_ENV, REPO_ROOT, _cpu_times, median, python_cmd
from benchmarks.netns import CounterSampler, ShapedNetwork

logger = logging.getLogger(__name__)

ACTIVE_FRACTION = 0.05
SAMPLE_HZ = 50.0


@dataclass
class StepMeasure:
    peer: int
    step: int
    report: dict
    """What the peer printed for this step (`link_peer.py`)."""
    wire_seconds: float | None
    wire_sent: int
    wire_received: int
    machine_busy: float
    """Busy fraction of the whole machine's cores during the all-reduce (every process on it)."""
    extra: dict = field(default_factory=dict)


class _Peer:
    def __init__(self, cmd: list[str], log: Path):
        self.log = log.open("w")
        self.process = subprocess.Popen(
            cmd,
            cwd=REPO_ROOT,
            env={**os.environ, **NODE_ENV},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            if line.startswith("{"):
                self.lines.put(json.loads(line))
        self.lines.put(None)

    def next(self, timeout: float) -> dict:
        record = self.lines.get(timeout=timeout)
        if record is None:
            raise RuntimeError(f"peer exited (code {self.process.wait()}); see {self.log.name}")
        return record

    def send(self, line: str) -> None:
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()

    def close(self) -> None:
        try:
            self.process.stdin.close()
            self.process.wait(timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            self.process.kill()
            self.process.wait()
        self.log.close()


def measure(
    rate_mbit: float,
    params: int,
    peers: int,
    steps: int,
    workdir: Path,
    *,
    burst: str,
    latency: str,
    compression: str = "fp16",
    part_size: int | None = None,
    part_window: int | None = None,
    sysctls: dict[str, str] | None = None,
    fresh: str | None = None,
    timeout: float = 300.0,
) -> list[StepMeasure]:
    """`steps` all-reduces of `params` values among `peers` peers behind `rate_mbit` links. `fresh`, for an
    experiment: "averager", each peer makes a new averager for every all-reduce; "connections", the peers'
    connections to each other are reset before every all-reduce (the p2p daemons dial again); "disconnect", each peer
    closes its connections to the last group's peers before every all-reduce, through its p2p daemon, as a node does
    with `swarm.fresh_connections`; "peer", every
    all-reduce has new peer processes (new DHTs, p2p daemons and connections)."""
    assert fresh in (None, "averager", "connections", "disconnect", "peer"), fresh
    from hivemind import DHT

    workdir.mkdir(parents=True, exist_ok=True)
    with ShapedNetwork(peers, rate_mbit, burst=burst, latency=latency, sysctls=sysctls) as network:
        bootstrap = DHT(host_maddrs=[f"/ip4/{network.host_ip}/tcp/0"], start=True)
        try:
            maddr = str(bootstrap.get_visible_maddrs()[0])

            def start_peers(generation: int) -> list[_Peer]:
                started = [
                    _Peer(
                        network.exec_prefix(i)
                        + python_cmd(
                            "benchmarks.link_peer",
                            "--initial-peer",
                            maddr,
                            "--host-ip",
                            network.node_ip(i),
                            "--params",
                            str(params),
                            "--compression",
                            compression,
                            "--allreduce-timeout",
                            str(timeout),
                            *(["--part-size", str(part_size)] if part_size else []),
                            *(["--part-window", str(part_window)] if part_window else []),
                            *(["--fresh-averager"] if fresh == "averager" else []),
                            *(["--fresh-connections"] if fresh == "disconnect" else []),
                        ),
                        workdir / f"peer{i}{f'.{generation}' if generation else ''}.log",
                    )
                    for i in range(peers)
                ]
                for p in started:
                    p.next(timeout=180)
                return started

            procs: list[_Peer] = []
            try:
                procs = start_peers(0)
                with CounterSampler(network, hz=SAMPLE_HZ) as sampler, _MachineSampler() as machine:
                    raw, tcp = [], []
                    for step in range(steps):
                        if fresh == "peer" and step > 0:
                            for p in procs:
                                p.close()
                            procs = start_peers(step)
                        if fresh == "connections" and step > 0:
                            for i in range(peers):
                                for j in range(i + 1, peers):
                                    network.drop_connections(i, j)
                        time.sleep(1.0)
                        before = [network.tcp_segments(i) for i in range(peers)]
                        for p in procs:
                            p.send("go")
                        # a fresh peer counts its all-reduces from 0: the step is the benchmark's
                        raw.append([{**p.next(timeout=timeout + 60), "step": step} for p in procs])
                        after = [network.tcp_segments(i) for i in range(peers)]
                        tcp.append([(a[0] - b[0], a[1] - b[1]) for a, b in zip(after, before)])
            finally:
                for p in procs:
                    p.close()
        finally:
            bootstrap.shutdown()
    # the raw link counters, for a look at the shape of a transfer
    (workdir / "counters.json").write_text(json.dumps({"samples": sampler.samples, "steps": raw}))
    out = []
    for reports, segments in zip(raw, tcp):
        for i, report in enumerate(reports):
            seconds, sent, received = wire_window(sampler.samples[i], report, rate_mbit)
            busy = machine.busy(report.get("allreduce_began") or report["began"], report["done"])
            extra = {"tcp_segments_sent": segments[i][0], "tcp_segments_retransmitted": segments[i][1]}
            out.append(StepMeasure(i, report["step"], report, seconds, sent, received, busy, extra))
    return out


class _MachineSampler:
    """The machine's CPU counters (/proc/stat) 10 times a second, for its busy fraction between two times."""

    def __init__(self, hz: float = 10.0):
        self.period, self.samples = 1.0 / hz, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="machine-cpu", daemon=True)

    def __enter__(self) -> _MachineSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time(), *_cpu_times()))
            self._stop.wait(self.period)

    def busy(self, start: float, end: float) -> float:
        times = [s[0] for s in self.samples]
        lo = max(0, bisect.bisect_right(times, start) - 1)
        hi = min(len(self.samples) - 1, bisect.bisect_left(times, end))
        (_, total0, idle0), (_, total1, idle1) = self.samples[lo], self.samples[hi]
        return 1.0 - (idle1 - idle0) / max(total1 - total0, 1e-9)


def wire_window(
    samples: list[tuple[float, int, int]], report: dict, rate_mbit: float
) -> tuple[float | None, int, int]:
    """(time on the wire, bytes sent, bytes received in it) of one step from a peer's link counter samples."""
    times = [s[0] for s in samples]
    # from the moment the all-reduce began: matchmaking before it moves a little data (DHT, group requests)
    lo = max(0, bisect.bisect_right(times, report.get("allreduce_began") or report["began"]) - 1)
    hi = min(len(samples) - 1, bisect.bisect_left(times, report["done"] + 0.2))
    threshold = ACTIVE_FRACTION * rate_mbit * 1e6 / 8
    active = [
        j
        for j in range(lo + 1, hi + 1)
        if max(samples[j][1] - samples[j - 1][1], samples[j][2] - samples[j - 1][2])
        > threshold * (samples[j][0] - samples[j - 1][0])
    ]
    if not active:
        return None, 0, 0
    first, last = active[0] - 1, active[-1]
    return (
        samples[last][0] - samples[first][0],
        samples[last][1] - samples[first][1],
        samples[last][2] - samples[first][2],
    )


def summarize(measures: list[StepMeasure], rate_mbit: float, skip_first: bool = True) -> dict:
    """Per-step, per-peer figures and their medians (the first all-reduce, which opens the connections, is left
    out of the medians when there are others)."""
    bytes_per_s = rate_mbit * 1e6 / 8
    rows = []
    for m in measures:
        r = m.report
        if m.wire_seconds is None or not r["averaged"]:
            rows.append({"peer": m.peer, "step": m.step, "failed": r.get("error") or "no transfer seen"})
            continue
        t = m.wire_seconds
        allreduce_s = r["done"] - r["allreduce_began"] if r.get("allreduce_began") else None
        cpu = r["cpu_seconds"]
        rows.append(
            {
                "peer": m.peer,
                "step": m.step,
                "group_size": r["group_size"],
                "wire_seconds": t,
                "allreduce_seconds": allreduce_s,
                "step_seconds": r["done"] - r["began"],
                "payload_sent": r["bytes_sent"],
                "payload_received": r["bytes_received"],
                "wire_sent": m.wire_sent,
                "wire_received": m.wire_received,
                "ideal_seconds": max(r["bytes_sent"], r["bytes_received"]) / bytes_per_s,
                "utilisation_up": r["bytes_sent"] / (t * bytes_per_s),
                "utilisation_down": r["bytes_received"] / (t * bytes_per_s),
                "utilisation": max(r["bytes_sent"], r["bytes_received"]) / (t * bytes_per_s),
                "utilisation_wire_up": m.wire_sent / (t * bytes_per_s),
                "utilisation_wire_down": m.wire_received / (t * bytes_per_s),
                "cpu_seconds": cpu,
                "cpu_cores_busy": sum(cpu.values()) / t,
                "cpu_cores_busy_p2pd": sum(v for k, v in cpu.items() if k.startswith("p2pd")) / t,
                "machine_busy": m.machine_busy,
                **m.extra,
            }
        )
    ok = [row for row in rows if "failed" not in row]
    steps = sorted({row["step"] for row in ok})
    used = [row for row in ok if row["step"] != steps[0]] if skip_first and len(steps) > 1 else ok
    if not used:
        raise RuntimeError(f"{rate_mbit} Mbit/s: no all-reduce completed")
    med = {key: median([row[key] for row in used]) for key in _MEDIAN_KEYS}
    per_step_cpu = {}
    for row in used:
        per_step_cpu[row["step"]] = per_step_cpu.get(row["step"], 0.0) + row["cpu_cores_busy"]
    by_step = {step: [row for row in ok if row["step"] == step] for step in steps}
    return {
        "rate_mbit": rate_mbit,
        **{f"{key}_median": value for key, value in med.items()},
        "peers_cpu_cores_busy_median": median(list(per_step_cpu.values())),
        "utilisation_by_step": [median([row["utilisation"] for row in rows]) for rows in by_step.values()],
        "tcp_retransmitted_by_step": [
            sum(row.get("tcp_segments_retransmitted", 0) for row in rows)
            / max(1, sum(row.get("tcp_segments_sent", 0) for row in rows))
            for rows in by_step.values()
        ],
        "failed_steps": len(rows) - len(ok),
        "steps": rows,
    }


_MEDIAN_KEYS = (
    "wire_seconds",
    "allreduce_seconds",
    "ideal_seconds",
    "payload_sent",
    "wire_sent",
    "utilisation",
    "utilisation_up",
    "utilisation_down",
    "utilisation_wire_up",
    "utilisation_wire_down",
    "cpu_cores_busy",
    "cpu_cores_busy_p2pd",
    "machine_busy",
)
