"""Nodes that fall out of step: a paused node, a node restarted behind the swarm. Real daemons on 127.0.0.1."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
from swarm_utils import Swarm

from spes_node.daemon.checkpoint import CheckpointManager
from spes_node.procs import descendants

pytestmark = pytest.mark.swarm

WIRE = {"rtol": 2e-3, "atol": 2e-4}
"""fp16 on the wire: a downloaded copy equals its source within this."""


@pytest.fixture
def make_swarm(tmp_path):
    made: list[Swarm] = []

    def make(**overrides) -> Swarm:
        made.append(Swarm(tmp_path, **overrides))
        return made[-1]

    yield make
    for swarm in made:
        swarm.close()


def test_a_paused_node_neither_stalls_the_other_nor_drops_out_of_its_groups(make_swarm):
    matchmaking, pause = 3.0, 6.0
    swarm = make_swarm(matchmaking_time=matchmaking, averaging_timeout=30.0, heartbeat_s=2.0)
    for name in ("steady", "paused"):
        swarm.start(name, "--max-rounds", "5", "--wait-peers", "2")
    # freeze one node, all its processes, the moment it reaches the end of round 2's steps (as a machine that
    # stalls would), for `pause` seconds
    swarm.wait_for(
        lambda: "round 2: looking for groups" in swarm.log("paused"), 240, "paused to reach round 2"
    )
    node = swarm.procs["paused"].pid
    frozen = [node, *descendants(node)]
    for pid in frozen:
        os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(pause)  # the fault itself: a pause of a known length
    finally:
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
    for name in ("steady", "paused"):
        assert swarm.wait_exit(name, 240) == 0, swarm.log(name)[-3000:]

    rounds = swarm.summary("steady")["rounds"]
    print(
        "\nsteady node, rounds (seconds, shared group):", [(r["seconds"], r["shared_group"]) for r in rounds]
    )
    # round 2 of the steady node: it stops looking after its matchmaking window (twice the matchmaking time)
    # plus the pause at most (before: 2 x 3 s + the 30 s averaging timeout = 36 s, in a group of one)
    # 10 s of slack for a loaded machine: measured 6.0 s alone, 18.2 s in the full suite beside two busy loops
    limit = 2 * matchmaking + pause + 10.0
    assert rounds[1]["seconds"] < limit, rounds
    # and the two average together again afterwards
    assert any(r["shared_group"] == 2 for r in rounds[2:]), rounds


SLOW_NODE = Path(__file__).parent / "slow_node.py"


def test_a_faster_node_trains_while_it_waits_for_a_slower_one_and_both_still_meet(make_swarm):
    # one node's steps take 0.6 s longer (a slower card): at each sync the other reads its record (steps left,
    # tokens/s) and trains through the wait instead of idling, then both average in the same groups
    swarm = make_swarm(matchmaking_time=6.0, averaging_timeout=30.0)
    rounds, H = 5, swarm.cfg.swarm.sync_steps
    swarm.start("fast", "--max-rounds", str(rounds), "--wait-peers", "2")
    swarm.start("slow", "--max-rounds", str(rounds), "--wait-peers", "2", program=(str(SLOW_NODE), "0.6"))
    for name in ("fast", "slow"):
        assert swarm.wait_exit(name, 300) == 0, swarm.log(name)[-3000:]
    fast, slow = swarm.summary("fast")["rounds"], swarm.summary("slow")["rounds"]
    print("\nsteps and shared group per round, fast:", [(r["steps"], r["shared_group"]) for r in fast])
    print("slow:", [(r["steps"], r["shared_group"]) for r in slow])
    assert len(fast) == len(slow) == rounds
    # they met every round: the extra steps end before the slower node comes
    assert all(r["shared_group"] == 2 for r in fast + slow), (fast, slow)
    # the faster node trained past H while waiting (once both report a throughput: from the second round on)
    # How many steps it adds depends on how long its own steps take against the slower node's: on a loaded machine
    # (the full suite, 2 cores) it added 5 in all, rounds of 5 9 5 6 5 steps against 5 each
    assert max(r["steps"] for r in fast) > H, fast
    assert sum(r["steps"] for r in fast) > sum(r["steps"] for r in slow), (fast, slow)
    assert "meanwhile" in swarm.log("fast"), swarm.log("fast")[-3000:]
    assert all(r["steps"] >= H for r in slow), slow


def test_a_node_restarted_behind_the_swarm_takes_its_shard_from_a_live_replica(make_swarm):
    # one shard, so that the live node stays a replica of it: with two, placement moves the node left alone to the
    # uncovered shard, and the restarted node's shard came from the live node's frozen copy
    swarm = make_swarm(num_shards=1, heartbeat_s=2.0)
    swarm.cfg = swarm.cfg.replace(train={"keep_checkpoints": 100})
    swarm.config_path.write_text(swarm.cfg.to_json())
    for name in ("live", "restarted"):
        swarm.start(name, "--shard", "0", "--wait-peers", "2")

    def round_of(name: str) -> int:
        return max((n.round for n in swarm.nodes().values() if n.public_name == name), default=-1)

    swarm.wait_for(lambda: min(round_of("live"), round_of("restarted")) >= 2, 240, "two rounds together")
    swarm.procs["restarted"].send_signal(signal.SIGTERM)
    assert swarm.wait_exit("restarted", 60) == 0, swarm.log("restarted")[-3000:]
    stopped_at = swarm.checkpoint("restarted").meta["round"]
    swarm.wait_for(
        lambda: round_of("live") >= stopped_at + 5, 240, "the live replica to train 5 rounds alone"
    )

    swarm.expected_deaths.discard("restarted")
    swarm.start("restarted", "--shard", "0")
    found = swarm.wait_for(
        lambda: re.search(r"caught up from round (\d+) to the swarm's round (\d+) \(checkpoint at step (\d+)\)",
                          swarm.log("restarted")),
        240,
        "the restarted node to catch up",
    )  # fmt: skip
    assert int(found[1]) == stopped_at and int(found[2]) >= stopped_at + 5, found[0]
    step, round_ = int(found[3]), int(found[2])
    caught_up = _checkpoint_at(swarm, "restarted", step)
    # the live node's checkpoint at the end of that round (its step may be past round x H: it trains while it
    # waits for the restarted node to come to a sync)
    live_rounds = _checkpoint_rounds(swarm, "live")
    live_step = min(s for s, r in live_rounds.items() if r == round_)
    live = _checkpoint_at(swarm, "live", live_step)
    assert caught_up.meta["round"] == live.meta["round"] == round_
    # the shared parameters are of the round caught up to; the shard is of that round or a later one (the live
    # node trains on between the two downloads: a loaded run saw the shard one round newer)
    later = [
        live,
        *(
            _checkpoint_at(swarm, "live", s)
            for s, r in sorted(live_rounds.items())
            if s > live_step and r <= round_ + 10
        ),
    ]
    for name, tensor in live.tensors.items():
        if ".mlp.shards." not in name:
            torch.testing.assert_close(caught_up.tensors[name].float(), tensor.float(), **WIRE, msg=name)
    shard = {name for name in live.tensors if ".mlp.shards." in name}
    assert shard
    matches = [c.step for c in later if all(_close(caught_up.tensors[n], c.tensors[n]) for n in shard)]
    assert matches, f"the shard matches no checkpoint of the live node from step {step} on"
    print(f"\ncaught up at step {step}: its shard is the live node's of step {matches[0]}")


def _checkpoint_paths(swarm: Swarm, name: str) -> dict[int, Path]:
    """The node's complete checkpoints by step."""
    return {int(p.name.rsplit("-", 1)[-1]): p for p in CheckpointManager(swarm.tmp / name).list()}


def _checkpoint_rounds(swarm: Swarm, name: str) -> dict[int, int]:
    """The round of each of the node's complete checkpoints, by step (from their meta.json)."""
    return {
        step: json.loads((path / "meta.json").read_text())["meta"]["round"]
        for step, path in _checkpoint_paths(swarm, name).items()
    }


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a.float(), b.float(), **WIRE)


def _checkpoint_at(swarm: Swarm, name: str, step: int):
    """The node's checkpoint of `step` (loaded through the manager, from a copy of that checkpoint alone)."""
    path = _checkpoint_paths(swarm, name).get(step)
    assert path is not None, f"{name} has no checkpoint at step {step}"
    alone = swarm.tmp / f"{name}-step-{step}"
    shutil.copytree(path, alone / path.name)
    checkpoint = CheckpointManager(alone).latest()
    assert checkpoint is not None and checkpoint.step == step
    return checkpoint
