"""`spes-node simulate`: a bootstrap DHT and N daemons as processes on 127.0.0.1, a live view, then a summary."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from spes_node import records
from spes_node.bootstrap import start_bootstrap
from spes_node.config import SpesConfig, load_preset


def run_simulation(
    cfg: SpesConfig | None, num_nodes: int | None, max_rounds: int, workdir: Path, data: str | None
) -> int:
    cfg = cfg or load_preset("tiny")
    num_shards = cfg.swarm.num_shards
    num_nodes = num_nodes or min(num_shards, 16)
    if num_nodes < num_shards:
        # a node holds one shard: the experts of the others stay at their initial values
        print(
            f"warning: {num_nodes} nodes for {num_shards} shards: shards {list(range(num_nodes, num_shards))} "
            "will have no holder and their experts will not train"
        )
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    config_path = workdir / "config.json"
    config_path.write_text(cfg.to_json())
    run_id = "simulate"
    bootstrap = start_bootstrap(["/ip4/127.0.0.1/tcp/0"])
    maddrs = [str(m) for m in bootstrap.get_visible_maddrs()]
    print(f"bootstrap DHT at {maddrs[0]}")
    print(
        f"{num_nodes} nodes, preset {cfg.name}, {max_rounds} rounds of {cfg.swarm.sync_steps} steps; logs in {workdir}/"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    procs = []
    for i in range(num_nodes):
        node_dir = workdir / f"node{i}"
        node_dir.mkdir()
        cmd = [
            sys.executable,
            "-m",
            "spes_node.cli",
            "join",
            "--run-id",
            run_id,
            "--config",
            str(config_path),
            "--checkpoint-dir",
            str(node_dir),
            "--max-rounds",
            str(max_rounds),
            "--device",
            "cpu",
            "--host-maddrs",
            "/ip4/127.0.0.1/tcp/0",
            "--public-name",
            f"node{i}",
        ]
        for m in maddrs:
            cmd += ["--peers", m]
        if data:
            cmd += ["--data", data]
        log = open(workdir / f"node{i}.log", "w")
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log))
    start = time.monotonic()
    try:
        while any(p.poll() is None for p, _ in procs):
            _show(records.fetch_nodes(bootstrap, run_id), time.monotonic() - start)
            time.sleep(2.0)
    except KeyboardInterrupt:
        for p, _ in procs:
            p.terminate()
        for p, _ in procs:
            p.wait(timeout=60)
    finally:
        for _, log in procs:
            log.close()
        bootstrap.shutdown()
    return _summary(workdir, procs, time.monotonic() - start)


def _show(nodes: dict, elapsed: float) -> None:
    tty = sys.stdout.isatty()
    lines = [
        f"[{elapsed:5.0f}s] {'node':<8} {'shard':>5} {'round':>5} {'step':>6} {'loss':>7} {'tok/s':>7}  state"
    ]
    for node in sorted(nodes.values(), key=lambda n: n.public_name or n.peer_id):
        lines.append(
            f"{'':8} {node.public_name or node.peer_id[-8:]:<8} {','.join(map(str, node.shards)):>5} {node.round:>5} "
            f"{node.step:>6} {node.loss:>7.3f} {node.tokens_per_s:>7.0f}  {node.state}"
        )
    if tty:
        sys.stdout.write("\x1b[2J\x1b[H" + "\n".join(lines) + "\n")
    else:
        sys.stdout.write("\n".join(lines) + "\n")
    sys.stdout.flush()


def _summary(workdir: Path, procs, elapsed: float) -> int:
    print(f"\nsummary after {elapsed:.0f}s")
    print(
        f"{'node':<6} {'exit':>4} {'shard':>5} {'rounds':>6} {'first loss':>10} {'last loss':>9} {'tok/s':>7} {'MB/round':>8}"
    )
    failed = 0
    for i, (proc, _) in enumerate(procs):
        path = workdir / f"node{i}" / "summary.json"
        if proc.returncode != 0 or not path.exists():
            failed += 1
            print(f"node{i:<2} {proc.returncode:>4}  (no summary: see {workdir}/node{i}.log)")
            continue
        s = json.loads(path.read_text())
        total = sum(s["bytes_sent"].values()) + sum(s["bytes_received"].values())
        per_round = total / max(1, s["rounds_done"]) / 1e6
        first = s["first_loss"] if s["first_loss"] is not None else math.nan
        print(
            f"node{i:<2} {proc.returncode:>4} {s['shard']:>5} {s['rounds_done']:>6} {first:>10.3f} "
            f"{s['last_loss']:>9.3f} {s['tokens_per_s']:>7.0f} {per_round:>8.2f}"
        )
    return 1 if failed else 0
