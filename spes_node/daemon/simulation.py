"""A local swarm for `spes-node simulate`: a bootstrap DHT and N daemons as processes on 127.0.0.1, a live view,
then a summary."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from spes_node.config import SpesConfig, load_preset
from spes_node.daemon.checkpoint import os_reason
from spes_node.swarm import records
from spes_node.swarm.bootstrap import start_bootstrap

RUN_DIR = re.compile(r"run-(\d+)")
RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


def new_run_dir(workdir: Path) -> Path:
    """A new, empty `workdir/run-NNN` for one simulation. Nothing already in `workdir` (earlier runs, the user's
    files, the current directory) is deleted or written to."""
    if workdir.exists() and not workdir.is_dir():
        raise ValueError(f"--workdir: {workdir} is not a directory")
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        taken = [int(m[1]) for entry in workdir.iterdir() if (m := RUN_DIR.fullmatch(entry.name))]
        number = max(taken, default=0) + 1
        while True:
            run_dir = workdir / f"run-{number:03d}"
            try:
                run_dir.mkdir()  # atomic: two simulations started at once get different directories
                return run_dir
            except FileExistsError:
                number += 1
    except OSError as e:
        raise ValueError(f"--workdir: cannot make a run directory in {workdir}: {os_reason(e)}") from None


def status_command(maddrs: list[str], run_id: str) -> str:
    return "spes-node status " + " ".join(f"--peers {m}" for m in maddrs) + f" --run-id {run_id}"


def start_daemon(cmd: list[str], log_path: Path, env: dict[str, str]) -> subprocess.Popen:
    with open(log_path, "w") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def run_simulation(
    cfg: SpesConfig | None,
    num_nodes: int | None,
    max_rounds: int,
    workdir: Path,
    data: str | None,
    run_id: str = "simulate",
) -> int:
    if not RUN_ID.fullmatch(run_id):
        raise ValueError(f"--run-id: use 1-64 letters, digits, '_' or '-', got '{run_id}'")
    cfg = cfg or load_preset("tiny")
    num_shards = cfg.swarm.num_shards
    num_nodes = num_nodes or min(num_shards, 16)
    run_dir = new_run_dir(workdir)
    # as many shards per node as it takes for every expert to train (--shards auto would hold every shard of a
    # small preset on each node: nothing sparse left to show)
    shards_per_node = -(-num_shards // num_nodes)
    config_path = run_dir / "config.json"
    config_path.write_text(cfg.to_json())
    bootstrap = start_bootstrap(["/ip4/127.0.0.1/tcp/0"])
    procs: list[subprocess.Popen] = []
    start = time.monotonic()
    try:
        maddrs = [str(m) for m in bootstrap.get_visible_maddrs()]
        watch = status_command(maddrs[:1], run_id)
        print(f"bootstrap DHT at {maddrs[0]}")
        print(
            f"{num_nodes} nodes, preset {cfg.name}, swarm '{run_id}', {max_rounds} rounds of "
            f"{cfg.swarm.sync_steps} steps; logs in {run_dir}/"
        )
        print(f"to watch it from another terminal: {watch}")
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        for i in range(num_nodes):
            node_dir = run_dir / f"node{i}"
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
                "--shards",
                str(shards_per_node),
            ]
            for m in maddrs:
                cmd += ["--peers", m]
            if data:
                cmd += ["--data", data]
            procs.append(start_daemon(cmd, run_dir / f"node{i}.log", env))
        seen: set[str] = set()
        while any(p.poll() is None for p in procs):
            nodes = records.fetch_nodes(bootstrap, run_id)
            _show(table(procs, nodes, time.monotonic() - start, seen), watch)
            time.sleep(2.0)
    except KeyboardInterrupt:
        for p in procs:
            p.terminate()  # each daemon checkpoints and leaves within seconds (see `Node.shutdown`)
        deadline = time.monotonic() + 60
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        bootstrap.shutdown()
    return _summary(run_dir, procs, time.monotonic() - start)


def table(
    procs: list[subprocess.Popen],
    nodes: dict[str, records.NodeInfo],
    elapsed: float,
    seen: set[str] | None = None,
) -> list[str]:
    """One row per started daemon (`nodeI`): its record's progress, or `starting` until its first record appears,
    `leaving` once it has withdrawn it, and `exited N` once it is gone. `seen`: names whose record a table showed
    (updated here)."""
    by_name = {node.public_name: node for node in nodes.values()}
    seen = set() if seen is None else seen
    lines = [
        f"[{elapsed:5.0f}s] {'node':<8} {'shard':>5} {'round':>5} {'step':>6} {'loss':>7} {'tok/s':>7}  state"
    ]
    for i, proc in enumerate(procs):
        name = f"node{i}"
        node = by_name.get(name)
        if node is None:
            code = proc.poll()
            state = f"exited {code}" if code is not None else "leaving" if name in seen else "starting"
            lines.append(f"{'':8} {name:<8} {'-':>5} {'-':>5} {'-':>6} {'-':>7} {'-':>7}  {state}")
            continue
        seen.add(name)
        lines.append(
            f"{'':8} {name:<8} {','.join(map(str, node.shards)) or '-':>5} {node.round:>5} "
            f"{node.step:>6} {node.loss:>7.3f} {node.tokens_per_s:>7.0f}  {node.state}"
        )
    return lines


def _show(lines: list[str], watch: str) -> None:
    if sys.stdout.isatty():
        # the screen is cleared for each refresh: keep the status command (printed once at the start) in view
        lines = [*lines, f"watch: {watch}"]
        sys.stdout.write("\x1b[2J\x1b[H" + "\n".join(lines) + "\n")
    else:
        sys.stdout.write("\n".join(lines) + "\n")
    sys.stdout.flush()


def _summary(workdir: Path, procs: list[subprocess.Popen], elapsed: float) -> int:
    print(f"\nsummary after {elapsed:.0f}s")
    print(
        f"{'node':<6} {'exit':>4} {'shard':>5} {'rounds':>6} {'first loss':>10} {'last loss':>9} {'tok/s':>7} {'MB/round':>8}"
    )
    failed = 0
    for i, proc in enumerate(procs):
        path = workdir / f"node{i}" / "summary.json"
        if proc.returncode != 0 or not path.exists():
            failed += 1
            print(f"node{i:<2} {proc.returncode:>4}  (no summary: see {workdir}/node{i}.log)")
            continue
        s = json.loads(path.read_text())
        total = sum(s["bytes_sent"].values()) + sum(s["bytes_received"].values())
        per_round = total / max(1, s["rounds_done"]) / 1e6
        first = s["first_loss"] if s["first_loss"] is not None else math.nan
        shards = ",".join(map(str, s["shards"]))
        print(
            f"node{i:<2} {proc.returncode:>4} {shards:>5} {s['rounds_done']:>6} {first:>10.3f} "
            f"{s['last_loss']:>9.3f} {s['tokens_per_s']:>7.0f} {per_round:>8.2f}"
        )
    return 1 if failed else 0
