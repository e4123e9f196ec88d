"""A benchmark swarm: a bootstrap DHT and instrumented `spes-node join` processes (on 127.0.0.1 or in namespaces).

Every node runs `benchmarks.node_runner` (the real daemon plus a timeline) with one torch thread, pinned to a
shard and a data part, and leaves after `--max-rounds`; the swarm then reads each node's summary.json, timeline
and checkpoint directory.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.common import NODE_ENV, REPO_ROOT, python_cmd
from benchmarks.netns import ShapedNetwork
from spes_node.config import SpesConfig

logger = logging.getLogger(__name__)


class SwarmFailed(RuntimeError):
    """A node of a benchmark swarm exited with an error or did not finish in time."""


@dataclass
class NodeRun:
    name: str
    directory: Path
    log: Path
    returncode: int | None = None
    summary: dict = field(default_factory=dict)
    timeline: dict = field(default_factory=dict)


class BenchSwarm:
    """Start with `run(...)`; `nodes` holds one NodeRun per node afterwards."""

    def __init__(
        self,
        workdir: Path,
        cfg: SpesConfig,
        num_nodes: int,
        run_id: str = "bench",
        network: ShapedNetwork | None = None,
    ):
        self.workdir, self.cfg, self.num_nodes, self.run_id = Path(workdir), cfg, num_nodes, run_id
        self.network = network
        if self.workdir.exists():
            shutil.rmtree(self.workdir)
        self.workdir.mkdir(parents=True)
        self.config_path = self.workdir / "config.json"
        self.config_path.write_text(cfg.to_json())
        self.nodes: list[NodeRun] = []
        self.procs: list[subprocess.Popen] = []

    def _host(self, i: int | None) -> str:
        if self.network is None:
            return "127.0.0.1"
        return self.network.host_ip if i is None else self.network.node_ip(i)

    def run(
        self,
        max_rounds: int,
        timeout: float,
        no_sync: bool = False,
        pin_data: bool = True,
        shards: list[int] | None = None,
        step_delays: dict[int, float] | None = None,
    ) -> list[NodeRun]:
        """Start every node at once (`--wait-peers` all), wait for all to exit, collect their outputs.
        `step_delays`: seconds added to every step of some nodes (by index), as slower cards."""
        from spes_node.swarm.bootstrap import start_bootstrap

        bootstrap = start_bootstrap([f"/ip4/{self._host(None)}/tcp/0"])
        try:
            maddr = str(bootstrap.get_visible_maddrs()[0])
            num_shards = self.cfg.swarm.num_shards
            shards = shards or [i % num_shards for i in range(self.num_nodes)]
            for i in range(self.num_nodes):
                env = {"SPES_BENCH_TIMELINE": str(self.workdir / f"node{i}" / "timeline.json")}
                if no_sync:
                    env["SPES_BENCH_NO_SYNC"] = "1"
                if pin_data:
                    env["SPES_BENCH_DATA_PART"] = f"{i}/{self.num_nodes}"
                if step_delays and step_delays.get(i):
                    env["SPES_BENCH_STEP_DELAY"] = str(step_delays[i])
                self._start(i, maddr, max_rounds, shards[i], env)
            self._wait(timeout)
        finally:
            for proc in self.procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(30)
            bootstrap.shutdown()
        for node, proc in zip(self.nodes, self.procs):
            node.returncode = proc.returncode
            summary, timeline = node.directory / "summary.json", node.directory / "timeline.json"
            node.summary = json.loads(summary.read_text()) if summary.exists() else {}
            node.timeline = json.loads(timeline.read_text()) if timeline.exists() else {}
        failed = [n for n in self.nodes if n.returncode != 0 or not n.summary]
        if failed:
            tails = "\n".join(
                f"--- {n.name} (exit {n.returncode}):\n{n.log.read_text()[-2000:]}" for n in failed
            )
            raise SwarmFailed(f"{len(failed)} of {self.num_nodes} nodes failed:\n{tails}")
        return self.nodes

    def _start(self, i: int, maddr: str, max_rounds: int, shard: int, extra_env: dict) -> None:
        name = f"node{i}"
        directory = self.workdir / name
        directory.mkdir()
        cmd = python_cmd(
            "benchmarks.node_runner",
            "join",
            "--run-id", self.run_id,
            "--peers", maddr,
            "--config", str(self.config_path),
            "--checkpoint-dir", str(directory),
            "--device", "cpu",
            "--host-maddrs", f"/ip4/{self._host(i)}/tcp/0",
            "--public-name", name,
            "--max-rounds", str(max_rounds),
            "--shard", str(shard),
            "--wait-peers", str(self.num_nodes),
        )  # fmt: skip
        if self.network is not None:
            cmd = self.network.exec_prefix(i) + cmd
        log = self.workdir / f"{name}.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=REPO_ROOT,
                env={**os.environ, **NODE_ENV, **extra_env},
            )
        self.nodes.append(NodeRun(name, directory, log))
        self.procs.append(proc)

    def _wait(self, timeout: float) -> None:
        """Until every node has exited, one has failed (the rest are then killed), or the timeout."""
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in self.procs):
            if any(p.poll() not in (None, 0) for p in self.procs):
                return
            if time.monotonic() > deadline:
                logger.warning(f"swarm {self.run_id}: timed out after {timeout:.0f}s")
                return
            time.sleep(0.5)
