"""Soak run (not a test): a local swarm trains for a long time while the memory of every node is sampled.

A bootstrap DHT and N `spes-node join` daemons on 127.0.0.1 (tiny preset by default). Every `--interval` seconds
the script records, for each node, the resident memory of its whole process tree (the daemon, its DHT and
averager processes, p2pd): RSS summed over the processes, and PSS, which splits shared pages (torch shared
memory, libraries) between the processes that map them, so that the sum is not inflated. At the end it stops the
nodes, prints a table (start, end and peak per node, and the growth per minute fitted after a warm-up) and writes
every sample to a JSON file. A leak shows as a steady positive growth per minute.

    python scripts/soak.py --minutes 30 --out runs/soak/soak.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from spes_node.config import load_preset
from spes_node.procs import descendants
from spes_node.swarm import records
from spes_node.swarm.bootstrap import start_bootstrap

RUN_ID = "soak"


def process_tree(root: int) -> list[int]:
    return [root, *descendants(root)]


def memory_kb(pid: int) -> dict | None:
    """RSS and PSS of one process in kB (PSS from smaps_rollup; None if the process is gone)."""
    try:
        name = Path(f"/proc/{pid}/comm").read_text().strip()
        status = Path(f"/proc/{pid}/status").read_text()
        rss = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return None
    pss = None
    try:
        rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
        pss = next(int(line.split()[1]) for line in rollup.splitlines() if line.startswith("Pss:"))
    except (OSError, StopIteration):
        pass
    return {"name": name, "rss_kb": rss, "pss_kb": pss}


def sample(procs: dict[str, subprocess.Popen]) -> dict:
    nodes = {}
    for name, proc in procs.items():
        per_process = {pid: m for pid in process_tree(proc.pid) if (m := memory_kb(pid)) is not None}
        nodes[name] = {
            "processes": {str(pid): m for pid, m in per_process.items()},
            "rss_kb": sum(m["rss_kb"] for m in per_process.values()),
            "pss_kb": sum(m["pss_kb"] or 0 for m in per_process.values()),
            "main_rss_kb": per_process.get(proc.pid, {}).get("rss_kb", 0),
        }
    return nodes


def slope_per_minute(times: list[float], values: list[float]) -> float:
    """Least-squares slope, in units per minute."""
    n = len(times)
    if n < 2:
        return 0.0
    mean_t, mean_v = sum(times) / n, sum(values) / n
    var = sum((t - mean_t) ** 2 for t in times)
    if var == 0:
        return 0.0
    return 60 * sum((t - mean_t) * (v - mean_v) for t, v in zip(times, values)) / var


def summarize(samples: list[dict], names: list[str], warmup_s: float) -> dict:
    after = [s for s in samples if s["t"] >= warmup_s] or samples
    out = {}
    for name in names:
        rows = [
            (s["t"], s["nodes"][name]) for s in samples if name in s["nodes"] and s["nodes"][name]["rss_kb"]
        ]
        late = [(t, m) for t, m in rows if t >= after[0]["t"]] or rows
        if not rows:
            continue
        out[name] = {
            "processes": len(rows[-1][1]["processes"]),
            "rss_start_mb": late[0][1]["rss_kb"] / 1024,
            "rss_end_mb": late[-1][1]["rss_kb"] / 1024,
            "rss_peak_mb": max(m["rss_kb"] for _, m in rows) / 1024,
            "rss_growth_mb_per_min": slope_per_minute(
                [t for t, _ in late], [m["rss_kb"] / 1024 for _, m in late]
            ),
            "pss_start_mb": late[0][1]["pss_kb"] / 1024,
            "pss_end_mb": late[-1][1]["pss_kb"] / 1024,
            "pss_peak_mb": max(m["pss_kb"] for _, m in rows) / 1024,
            "pss_growth_mb_per_min": slope_per_minute(
                [t for t, _ in late], [m["pss_kb"] / 1024 for _, m in late]
            ),
            "main_rss_growth_mb_per_min": slope_per_minute(
                [t for t, _ in late], [m["main_rss_kb"] / 1024 for _, m in late]
            ),
        }
    return out


def print_table(summary: dict, rounds: dict[str, int]) -> None:
    header = (
        "node",
        "procs",
        "rounds",
        "RSS start",
        "RSS end",
        "RSS peak",
        "RSS MB/min",
        "PSS end",
        "PSS MB/min",
    )
    print(" ".join(f"{h:>10}" for h in header))
    for name, s in summary.items():
        cells = (
            name,
            s["processes"],
            rounds.get(name, "?"),
            f"{s['rss_start_mb']:.0f} MB",
            f"{s['rss_end_mb']:.0f} MB",
            f"{s['rss_peak_mb']:.0f} MB",
            f"{s['rss_growth_mb_per_min']:+.2f}",
            f"{s['pss_end_mb']:.0f} MB",
            f"{s['pss_growth_mb_per_min']:+.2f}",
        )
        print(" ".join(f"{c:>10}" for c in cells))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="How long the swarm trains.")
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--interval", type=float, default=10.0, help="Seconds between memory samples.")
    parser.add_argument("--warmup", type=float, default=120.0, help="Seconds left out of the growth fit.")
    parser.add_argument("--workdir", default="runs/soak")
    parser.add_argument("--out", default=None, help="JSON with every sample (default: WORKDIR/soak.json).")
    args = parser.parse_args()
    if args.minutes <= 0 or args.nodes < 1 or args.interval <= 0:
        parser.error("--minutes and --interval must be positive, --nodes at least 1")

    workdir = Path(args.workdir)
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    out = Path(args.out) if args.out else workdir / "soak.json"
    cfg = load_preset(args.preset)
    config_path = workdir / "config.json"
    config_path.write_text(cfg.to_json())
    bootstrap = start_bootstrap(["/ip4/127.0.0.1/tcp/0"])
    maddr = str(bootstrap.get_visible_maddrs()[0])
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    names = [f"node{i}" for i in range(args.nodes)]
    procs: dict[str, subprocess.Popen] = {}
    for name in names:
        cmd = [
            sys.executable, "-m", "spes_node.cli", "join", "--run-id", RUN_ID, "--peers", maddr,
            "--config", str(config_path), "--checkpoint-dir", str(workdir / name), "--device", "cpu",
            "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--public-name", name, "--wait-peers", str(args.nodes),
        ]  # fmt: skip
        with open(workdir / f"{name}.log", "w") as log:
            procs[name] = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
    print(
        f"{args.nodes} nodes ({cfg.name}) for {args.minutes:g} min, sampling every {args.interval:g}s; logs in {workdir}/"
    )

    samples: list[dict] = []
    started = time.monotonic()
    end = started + 60 * args.minutes
    try:
        while time.monotonic() < end:
            dead = [name for name, proc in procs.items() if proc.poll() is not None]
            if dead:
                print(f"stopped early: {', '.join(dead)} exited (see their logs)")
                break
            samples.append({"t": round(time.monotonic() - started, 1), "nodes": sample(procs)})
            if len(samples) % max(1, int(60 / args.interval)) == 0:
                totals = " ".join(f"{n}={s['rss_kb'] / 1024:.0f}MB" for n, s in samples[-1]["nodes"].items())
                print(f"{samples[-1]['t'] / 60:5.1f} min  RSS {totals}", flush=True)
            time.sleep(args.interval)
    finally:
        live = records.fetch_nodes(bootstrap, RUN_ID)
        rounds = {n.public_name: n.round for n in live.values()}
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        bootstrap.shutdown()

    summary = summarize(samples, names, args.warmup)
    out.write_text(
        json.dumps(
            {
                "nodes": args.nodes,
                "preset": cfg.name,
                "minutes": args.minutes,
                "interval_s": args.interval,
                "warmup_s": args.warmup,
                "rounds": rounds,
                "summary": summary,
                "samples": samples,
            },
            indent=1,
        )  # fmt: skip
    )
    print_table(summary, rounds)
    print(f"samples and summary written to {out}")
    return 0 if samples and len(summary) == len(names) else 1


if __name__ == "__main__":
    sys.exit(main())
