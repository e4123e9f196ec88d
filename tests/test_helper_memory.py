"""Forked helpers (hivemind's averagers) give back the node's tensors they inherited: otherwise every page the node
writes after the fork (each optimiser step writes every trainable weight) stays behind in the helper as a private
copy, and each averager grows towards a copy of the node's training state."""

from __future__ import annotations

import multiprocessing as mp
import re
from pathlib import Path

import hivemind
import pytest
import torch

from spes_node.procs import NodeDHT, release_inherited_tensors
from spes_node.swarm.robust import RobustAverager

BIG = 384 << 20
"""Bytes of the node's tensor in these tests: far above what a forked Python process holds of its own."""


def private_bytes(pid: int) -> int:
    """Memory only this process maps (its copy-on-write copies among it), from /proc/<pid>/smaps_rollup."""
    text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    return sum(int(kib) * 1024 for kib in re.findall(r"^Private_(?:Clean|Dirty):\s+(\d+) kB", text, re.M))


def _helper(shared: torch.Tensor, release: bool, released, done) -> None:
    released.put(release_inherited_tensors(keep=[shared], min_bytes=1) if release else 0)
    shared.fill_(7.0)  # what it keeps still works, and the node sees it
    released.put("filled")
    done.wait(60)


@pytest.mark.parametrize("release", [True, False])
def test_a_forked_helper_holds_no_copy_of_the_tensors_the_node_writes_after_the_fork(release):
    context = mp.get_context("fork")
    weights = torch.ones(BIG // 4)
    shared = torch.zeros(1024).share_memory_()  # small: kept by `keep`, not by its size
    released, done = context.Queue(), context.Event()
    child = context.Process(target=_helper, args=(shared, release, released, done), daemon=True)
    child.start()
    try:
        assert released.get(timeout=60) >= (BIG if release else 0)
        assert released.get(timeout=60) == "filled"
        # counted from here: walking the objects touched their pages in the child (more in a long-lived process)
        before = private_bytes(child.pid)
        weights.add_(1.0)  # an optimiser step: every page written by the node
        grown = private_bytes(child.pid) - before
        if release:
            assert grown < BIG // 4, f"the helper came to hold {grown >> 20} MiB more of its own"
        else:  # what the release is for: without it, the helper keeps the pages as they were before the write
            assert grown > BIG * 3 // 4, f"the helper came to hold {grown >> 20} MiB more of its own"
        assert torch.equal(weights, torch.full_like(weights, 2.0)), "the node's tensors are untouched"
    finally:
        done.set()
        child.join(30)
    assert torch.equal(shared, torch.full_like(shared, 7.0))


@pytest.mark.swarm
def test_an_averager_process_gives_back_the_nodes_tensors_it_inherited():
    # as in a node: the DHT process forks first, then the model is built, then the averagers fork beside it (a DHT
    # forked after the weights would share the old pages with the averager, and hide them from its private count)
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    weights = torch.ones(BIG // 4)
    averager = RobustAverager([torch.zeros(1 << 16)], dht, prefix="memory", min_matchmaking_time=1.0)
    try:
        before = private_bytes(averager.pid)  # the averager has released what it inherited before it is ready
        weights.add_(1.0)
        grown = private_bytes(averager.pid) - before
        assert grown < BIG // 4, f"the averager came to hold {grown >> 20} MiB more of its own"
        assert torch.equal(weights, torch.full_like(weights, 2.0))
    finally:
        averager.shutdown()
        dht.shutdown()


def test_helper_processes_are_named_for_what_they_do():
    """hivemind's helpers are forks of the daemon, all "python" to `top`, `ps` and the OOM killer's log: they name
    themselves (the DHT, and each averager by its group)."""
    dht = NodeDHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    averager = RobustAverager([torch.zeros(16)], dht, prefix="run_0123abcd_shard12", min_matchmaking_time=1.0)
    try:
        names = {Path(f"/proc/{p.pid}/comm").read_text().strip() for p in (dht, averager)}
        assert names == {"spes-dht", "spes-shard12"}
    finally:
        averager.shutdown()
        dht.shutdown()
