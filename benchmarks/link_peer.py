"""One averaging peer of the link benchmark: a DHT, a `GroupAverager` over `--params` random values, and one
all-reduce each time the benchmark says `go` on stdin.

Not a node: nothing is trained, so the all-reduce has the machine's cores to itself. It prints one JSON line per
event on stdout: `{"ready": ...}` once the averager runs, then per step the averager's own result (group size,
counted bytes), wall-clock times (step begun, all-reduce begun, done) and the CPU seconds its processes (the peer,
its DHT and averager processes and the p2p daemon) used during the all-reduce and during the whole step, by
process name.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import torch
from hivemind import DHT
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.control import AveragingStage

from spes_node.procs import descendants
from spes_node.swarm import robust
from spes_node.swarm.averaging import GroupAverager
from spes_node.swarm.connections import close_connections

TENSOR_VALUES = 1 << 22
"""The vector is split into tensors of 4M values, like the parameter tensors of a model."""

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(root: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of each process in the tree, summed by process name."""
    by_name: dict[str, float] = {}
    for pid in [root, *descendants(root)]:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat.rsplit(")", 1)[1].split()
        by_name[name] = by_name.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
    return by_name


def say(**record) -> None:
    print(json.dumps(record), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--initial-peer", required=True, help="multiaddr of the bootstrap DHT peer")
    parser.add_argument("--host-ip", required=True)
    parser.add_argument("--params", type=int, required=True, help="values to average")
    parser.add_argument("--compression", default="fp16")
    parser.add_argument("--prefix", default="link_bench")
    parser.add_argument("--matchmaking-time", type=float, default=3.0)
    parser.add_argument("--allreduce-timeout", type=float, default=300.0)
    parser.add_argument(
        "--part-size",
        type=int,
        help="hivemind's all-reduce part size in bytes, for an experiment (GroupAverager keeps hivemind's default)",
    )
    parser.add_argument(
        "--part-window",
        type=int,
        help="parts a reducer takes from each sender ahead of its results (default: robust.PART_WINDOW; 1: hivemind's lockstep)",
    )
    parser.add_argument(
        "--fresh-averager",
        action="store_true",
        help="a new averager (and averager process) for every all-reduce, on the same DHT and p2p daemon",
    )
    parser.add_argument(
        "--fresh-connections",
        action="store_true",
        help="before every all-reduce, close the connections to the last group's peers as a node does "
        "(swarm.fresh_connections, `connections.close_connections`)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.part_size:
        DecentralizedAverager.__init__.__kwdefaults__["part_size_bytes"] = args.part_size
    if args.part_window:
        robust.PART_WINDOW = args.part_window  # read when each all-reduce begins, in the forked averager too

    dht = DHT(initial_peers=[args.initial_peer], host_maddrs=[f"/ip4/{args.host_ip}/tcp/0"], start=True)
    # like replicas of one model: the same values on every peer, plus a little noise of its own
    shared, own = torch.Generator().manual_seed(0), torch.Generator().manual_seed(os.getpid())
    sizes = [TENSOR_VALUES] * (args.params // TENSOR_VALUES)
    if args.params % TENSOR_VALUES:
        sizes.append(args.params % TENSOR_VALUES)
    tensors = {
        f"t{i}": torch.randn(n, generator=shared).add_(torch.randn(n, generator=own), alpha=0.01)
        for i, n in enumerate(sizes)
    }

    def make_averager() -> GroupAverager:
        return GroupAverager(
            dht,
            args.prefix,
            tensors,
            compression=args.compression,
            matchmaking_time=args.matchmaking_time,
            allreduce_timeout=args.allreduce_timeout,
            client_mode=False,
        )

    averager = make_averager()
    say(ready=True, peer_id=dht.peer_id.to_base58(), params=args.params)
    step, last_peers = 0, []
    for line in sys.stdin:
        if line.strip() != "go":
            break
        if args.fresh_averager and step > 0:
            averager.shutdown()
            averager = make_averager()
        closed = close_connections(dht, last_peers) if args.fresh_connections else 0
        cpu_before = cpu_seconds(os.getpid())
        began = time.time()
        handle = averager.step(tensors, weight=1.0, gather=(step, 0, 0))
        allreduce_began = watch_allreduce_start(handle[0])
        result, averaged = averager.finish(handle)
        last_peers = [peer for peer in result.peers if peer != dht.peer_id.to_base58()]
        done = time.time()
        cpu_after = cpu_seconds(os.getpid())
        cpu_at_allreduce = allreduce_began.get("cpu", cpu_before)
        say(
            step=step,
            began=began,
            allreduce_began=allreduce_began.get("t"),
            done=done,
            group_size=result.group_size,
            bytes_sent=result.bytes_sent,
            bytes_received=result.bytes_received,
            error=result.error,
            averaged=averaged is not None,
            connections_closed=closed,
            cpu_seconds={k: round(v - cpu_at_allreduce.get(k, 0.0), 3) for k, v in cpu_after.items()},
            cpu_seconds_step={k: round(v - cpu_before.get(k, 0.0), 3) for k, v in cpu_after.items()},
        )
        step += 1
    averager.shutdown()
    dht.shutdown()


def watch_allreduce_start(control) -> dict:
    """Notes (in the returned dict) when the step's all-reduce begins (`t`) and the CPU seconds used by then
    (`cpu`), from a thread polling its stage."""
    seen: dict = {}

    def poll() -> None:
        while not control.done():
            if control.stage in (AveragingStage.RUNNING_ALLREDUCE, AveragingStage.FINISHED):
                seen["t"] = time.time()
                seen["cpu"] = cpu_seconds(os.getpid())
                return
            time.sleep(0.005)

    threading.Thread(target=poll, daemon=True).start()
    return seen


if __name__ == "__main__":
    main()
