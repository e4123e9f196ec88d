"""Bytes of the all-reduce as counted on the wire by real hivemind averagers on 127.0.0.1: about 4:2:1 for fp32,
fp16 and int8, of the order of hivemind's butterfly formula, the same for weights and updates."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from swarm_utils import loopback_dhts, run_captured

from spes_node.swarm.averaging import GroupAverager, estimated_bytes

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(600)]

NUMEL = 1_500_000
MEMBERS = 3


class Lost(Exception):
    """A member was lost during a measurement: its averager could not reach its DHT's p2pd, gave no outcome, or
    dropped out of a group (some parts not averaged, then groups without it)."""


def counted_bytes(compression: str, average: str) -> list[tuple[int, int]]:
    """(sent, received) of each member in one whole all-reduce of `NUMEL` values, on DHTs of its own.

    In 4 of 14 loaded suite runs and one CI run, one member of a group of these DHTs was lost: its p2pd closed its
    control socket (the next averager's start failed with FileNotFoundError), its averager never gave an outcome,
    or it dropped out of the group and then out of every group after. The cause is not found; the DHT processes
    stayed alive. Each measurement therefore starts fresh DHTs, and a measurement that loses a member is taken once
    more on new ones, saying so; a second loss fails the test."""
    for attempt in range(2):
        dhts = loopback_dhts(MEMBERS)
        try:
            return _count(dhts, compression, average)
        except (FileNotFoundError, Lost) as e:
            if attempt:
                raise
            print(
                f"\n{compression}/{average}: a member was lost ({type(e).__name__}: {e}): fresh DHTs, once more"
            )
        finally:
            for dht in dhts:
                dht.shutdown()
    raise AssertionError("unreachable")


def _count(dhts: list, compression: str, average: str) -> list[tuple[int, int]]:
    zeros = {"w": torch.zeros(NUMEL)}
    group = []
    try:
        for dht in dhts:
            averager = GroupAverager(
                dht,
                f"bytes_{compression}_{average}",
                zeros,
                compression=compression,
                matchmaking_time=2.0,
                allreduce_timeout=30.0,
                client_mode=False,
                average=average,
                step_grace=10.0,
            )
            group.append(averager)
        generator = torch.Generator().manual_seed(0)
        common = torch.randn(NUMEL, generator=generator)
        for _ in range(3):
            inputs = [{"w": common + 0.1 * torch.randn(NUMEL, generator=generator)} for _ in group]
            anchors = [{"w": torch.zeros(NUMEL)} if average == "updates" else None for _ in group]
            handles = [
                a.step(x, 1.0, (0, 0, 1), anchor=anchor) for a, x, anchor in zip(group, inputs, anchors)
            ]
            results = [a.finish(handle)[0] for a, handle in zip(group, handles)]
            if all(r.group_size == MEMBERS and r.error is None and not r.failed_reducers for r in results):
                # the step's time splits into matchmaking and the all-reduce, which the averager process timed
                assert all(0 < r.allreduce_seconds <= r.seconds for r in results), results
                return [(r.bytes_sent, r.bytes_received) for r in results]
            if all(r.group_size == 1 and r.bytes_sent == 0 for r in results) and not any(
                "unresponsive" in (r.error or "") for r in results
            ):
                print(f"\n{compression}/{average}: no group formed, once more")
                continue  # nobody met (a slow start): nothing was sent
            raise Lost([(r.group_size, r.failed_reducers, r.error) for r in results])
        pytest.fail("no group of every member formed in 3 tries")
    finally:
        for averager in group:
            averager.shutdown()


def measured(compression: str, average: str) -> list[tuple[int, int]]:
    """`counted_bytes` in a fresh interpreter, whose DHTs and averagers fork from a process with no history.

    Measured inside the test worker, this test lost a member in both of its tries in one CI run: a DHT process forked
    from the worker late in the suite found its control pipe's descriptor closed under it (EBADF on every read),
    and libuv in one of the processes reported its io_uring descriptor closed the same way. Something closed a
    descriptor the child owned. That it came from state inherited from the worker is an inference (both tries
    failed alike); what it was is not found (a whole suite under strace showed one failed close, no more). A fresh
    interpreter inherits nothing from the worker."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = run_captured([sys.executable, __file__, compression, average], timeout=280, env=env)
    if done.stdout.strip():
        print(done.stdout)
    assert done.returncode == 0, done.stderr[-4000:]
    return [tuple(member) for member in json.loads(done.stdout.strip().splitlines()[-1])]


def test_bytes_on_the_wire_scale_with_the_wire_precision():
    counts = {compression: measured(compression, "weights") for compression in ("none", "fp16", "int8")}
    counts["int8 updates"] = measured("int8", "updates")
    totals = {kind: sum(sent for sent, _ in members) for kind, members in counts.items()}
    print(
        {kind: [f"{s / NUMEL:.3f}/{r / NUMEL:.3f}" for s, r in members] for kind, members in counts.items()}
    )
    for kind, members in counts.items():
        # everything one member sends, another receives
        assert sum(s for s, _ in members) == sum(r for _, r in members), kind
    assert 1.95 < totals["none"] / totals["fp16"] < 2.05
    assert 1.9 < totals["fp16"] / totals["int8"] < 2.0  # int8 carries one fp32 scale per 1024 values
    assert totals["int8 updates"] == totals["int8"]
    for kind, compression in (("none", "none"), ("fp16", "fp16"), ("int8", "int8")):
        for sent, received in counts[kind]:
            estimate = estimated_bytes(NUMEL, MEMBERS, compression)  # per direction
            # each member reduces about a third of the vector (parts are whole chunks): within 15% of the formula
            assert 0.85 * estimate < sent < 1.15 * estimate, (kind, sent, estimate)
            assert 0.85 * estimate < received < 1.15 * estimate, (kind, received, estimate)


if __name__ == "__main__":
    print(json.dumps(counted_bytes(sys.argv[1], sys.argv[2])))
