"""Scale: `spes-node status` and joining against a DHT where 32 to 64 peers publish node records.

Each peer is a plain hivemind DHT (its own process and p2p daemon, on 127.0.0.1) that publishes a signed NodeRecord
(`records.publish_node`, state training, round 0, shards spread evenly) and, for the first, the swarm config. No
peer trains: the benchmark measures the DHT side only. At each size:
- status: opening a client-mode DHT and one `fetch_summary` in this process (median of a few), and the whole
  `spes-node status --json` command as a user runs it (a fresh interpreter included); the number of nodes it saw;
- join: a real `spes-node join` (instrumented) that leaves as soon as its startup is done: startup time (DHT,
  config agreement, shard choice, model, data) and the process's wall time from launch to exit.
Peers take memory (a process and a p2p daemon each, about 150 MiB): a size that does not fit in the memory
available is reduced, and the result says so.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path

from benchmarks.common import NODE_ENV, REPO_ROOT, LoadMonitor, emit, median, python_cmd, table, write_result

logger = logging.getLogger(__name__)

SETTINGS = {
    "preset": "tiny",
    "sizes": [32, 64],
    "status_repeats": 3,
    "record_expiration_s": 1800,
    "mib_per_peer": 170,
    "reserve_mib": 4096,
    "run_id": "scale",
}


def _available_mib() -> int:
    match = re.search(r"MemAvailable:\s+(\d+)", Path("/proc/meminfo").read_text())
    return int(match.group(1)) // 1024 if match else 0


class RecordPeers:
    """Plain DHT peers that each publish one node record (and the first, the swarm config)."""

    def __init__(self, bootstrap_maddrs: list[str], cfg, run_id: str, expiration_s: float):
        self.maddrs, self.cfg, self.run_id, self.expiration_s = bootstrap_maddrs, cfg, run_id, expiration_s
        self.peers = []
        self.keys = tempfile.TemporaryDirectory(prefix="spes-scale-")

    def grow(self, count: int) -> None:
        import hivemind
        from hivemind.dht.crypto import RSASignatureValidator

        from spes_node.swarm import records
        from spes_node.swarm.identity import load_or_create_identity

        while len(self.peers) < count:
            # a node's peer id derives from its record-signing key, and readers check that (records.py)
            identity = Path(self.keys.name) / f"peer{len(self.peers)}.key"
            validator = RSASignatureValidator(load_or_create_identity(identity))
            # a serving peer with its own signing key, as a node is (`swarm.client.open_client_dht` opens a
            # read-only client without one); it validates records as every DHT of the project does
            dht = hivemind.DHT(
                initial_peers=self.maddrs,
                host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                identity_path=str(identity),
                record_validators=records.record_validators(validator),
                start=True,
            )
            index = len(self.peers)
            if index == 0:
                records.publish_config(
                    dht, self.run_id, self.cfg.to_json(), self.cfg.hash(), validator, self.expiration_s
                )
            info = records.NodeInfo(
                peer_id=dht.peer_id.to_base58(),
                shards=[index % self.cfg.swarm.num_shards],
                state="training",
                public_name=f"peer{index}",
                tokens=1000 * index,
            )
            if not records.publish_node(dht, self.run_id, info, validator, expiration_s=self.expiration_s):
                logger.warning(f"peer {index}: the DHT did not accept its record")
            self.peers.append(dht)

    def shutdown(self) -> None:
        for dht in self.peers:
            dht.shutdown()
        self.keys.cleanup()


def measure_status(maddrs: list[str], run_id: str, repeats: int) -> dict:
    from spes_node.daemon.status import fetch_summary, open_dht

    started = time.perf_counter()
    client = open_dht(maddrs, timeout=60)
    open_s = time.perf_counter() - started
    fetch_s, seen = [], 0
    try:
        for _ in range(repeats):
            t = time.perf_counter()
            summary = fetch_summary(client, run_id)
            fetch_s.append(time.perf_counter() - t)
            seen = len(summary["nodes"])
    finally:
        client.shutdown()
    t = time.perf_counter()
    out = subprocess.run(
        python_cmd(
            "spes_node.cli", "status", "--peers", maddrs[0], "--run-id", run_id, "--json", "--timeout", "60"
        ),
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env={**os.environ, **NODE_ENV},
        timeout=300,
    )
    cli_s = time.perf_counter() - t
    cli_seen = len(json.loads(out.stdout)["nodes"]) if out.returncode == 0 else None
    return {
        "open_client_dht_s": open_s,
        "fetch_summary_s_median": median(fetch_s),
        "fetch_summary_s": fetch_s,
        "nodes_seen": seen,
        "cli_wall_s": cli_s,
        "cli_nodes_seen": cli_seen,
        "cli_error": out.stderr.strip().splitlines()[-1]
        if out.returncode != 0 and out.stderr.strip()
        else None,
    }


def measure_join(maddr: str, config_path: Path, run_id: str, workdir: Path) -> dict:
    directory = workdir / f"join_{time.time_ns()}"
    directory.mkdir(parents=True)
    timeline = directory / "timeline.json"
    cmd = python_cmd(
        "benchmarks.node_runner", "join", "--run-id", run_id, "--peers", maddr, "--config", str(config_path),
        "--checkpoint-dir", str(directory), "--device", "cpu", "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
        "--shards", "1",  # a joiner of one shard, as measured before shards by capacity
    )  # fmt: skip
    env = {
        **os.environ,
        **NODE_ENV,
        "SPES_BENCH_TIMELINE": str(timeline),
        "SPES_BENCH_EXIT_AFTER_STARTUP": "1",
    }
    launched = time.time()
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT, env=env, timeout=600)
    wall = time.time() - launched
    if out.returncode != 0 or not timeline.exists():
        raise RuntimeError(f"join failed (exit {out.returncode}):\n{out.stdout[-1500:]}{out.stderr[-1500:]}")
    data = json.loads(timeline.read_text())
    startup = data["startup"]
    return {
        "startup_s": startup["end"] - startup["start"],
        "launch_to_startup_s": startup["start"] - launched,
        "process_wall_s": wall,
        "shard_chosen": startup.get("shard"),
    }


def run(workdir: Path, settings: dict | None = None) -> dict:
    from spes_node.config import load_preset
    from spes_node.swarm.bootstrap import start_bootstrap

    settings = {**SETTINGS, **(settings or {})}
    workdir.mkdir(parents=True, exist_ok=True)
    cfg = load_preset(settings["preset"])
    config_path = workdir / "config.json"
    config_path.write_text(cfg.to_json())
    by_size, notes = {}, []
    with LoadMonitor() as load:
        bootstrap = start_bootstrap(["/ip4/127.0.0.1/tcp/0"])
        maddrs = [str(m) for m in bootstrap.get_visible_maddrs()]
        peers = RecordPeers(maddrs, cfg, settings["run_id"], settings["record_expiration_s"])
        try:
            for size in settings["sizes"]:
                room = (_available_mib() - settings["reserve_mib"]) // settings["mib_per_peer"]
                target = min(size, len(peers.peers) + max(0, room))
                if target < size:
                    notes.append(f"size {size} reduced to {target}: {_available_mib()} MiB available")
                if target <= len(peers.peers) and by_size:
                    continue
                t = time.perf_counter()
                peers.grow(target)
                grow_s = time.perf_counter() - t
                by_size[str(target)] = {
                    "peers": target,
                    "start_peers_s": grow_s,
                    "status": measure_status(maddrs, settings["run_id"], settings["status_repeats"]),
                    "join": measure_join(maddrs[0], config_path, settings["run_id"], workdir),
                }
                emit(f"scale: {target} peers measured")
        finally:
            peers.shutdown()
            bootstrap.shutdown()
    results = {"by_size": by_size, "notes": notes}
    emit(
        table(
            ["peers", "status fetch s", "status CLI s", "nodes seen", "join startup s", "join process s"],
            [
                [
                    size,
                    r["status"]["fetch_summary_s_median"],
                    r["status"]["cli_wall_s"],
                    r["status"]["nodes_seen"],
                    r["join"]["startup_s"],
                    r["join"]["process_wall_s"],
                ]
                for size, r in by_size.items()
            ],
            title="scale (DHT peers publishing node records, 127.0.0.1)",
        )
    )
    write_result("scale", settings, results, load.summary())
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="runs/benchmarks/scale")
    args = parser.parse_args()
    started = time.time()
    run(Path(args.workdir))
    emit(f"scale benchmark took {time.time() - started:.0f}s")


if __name__ == "__main__":
    main()
