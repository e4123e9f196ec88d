"""A node's averager process killed under it (as the OOM killer does, which picks the largest helper): the node
starts a new one at its next round and averages that group with its peers again. Real daemons on 127.0.0.1."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest
from swarm_utils import Swarm

from spes_node.procs import descendants

pytestmark = pytest.mark.swarm

RESTARTED = re.compile(
    r"shard0: the averager (process exited \(code -9\)|did not take or end its step in time): starting a new one"
)


def _helpers(pid: int, name: str) -> list[int]:
    """The node's descendant processes called `name` (helpers name themselves: `procs.bind_to_parent`)."""
    found = []
    for child in descendants(pid):
        try:
            if Path(f"/proc/{child}/comm").read_text().strip() == name:
                found.append(child)
        except OSError:  # gone meanwhile
            continue
    return found


def test_a_node_whose_averager_was_killed_starts_a_new_one_and_averages_that_group_again(tmp_path):
    swarm = Swarm(tmp_path, num_shards=1)
    try:
        for name in ("a", "b"):
            swarm.start(name, "--wait-peers", "2")
        swarm.wait_for(lambda: "round 2 done" in swarm.log("a"), 240, "a's round 2")
        (killed,) = _helpers(swarm.procs["a"].pid, "spes-shard0")
        os.kill(killed, signal.SIGKILL)

        def averaged_again():
            log = swarm.log("a")
            restart = RESTARTED.search(log)
            # a round that a's new averager of shard 0 took part in, with b
            return (
                restart
                if restart and re.search(r"round \d+ done: .*shard 0 group 2", log[restart.end() :])
                else None
            )

        restart = swarm.wait_for(averaged_again, 300, "a new averager of shard 0 to average with b")
        print(f"\n{restart[0]}")
        (new,) = _helpers(swarm.procs["a"].pid, "spes-shard0")
        assert new != killed
        for name in ("a", "b"):
            swarm.procs[name].send_signal(signal.SIGTERM)
        for name in ("a", "b"):
            assert swarm.wait_exit(name, 120) == 0, swarm.log(name)[-3000:]
        # the round that replaced it says so in its report (status shows a round's errors)
        said = [
            e
            for r in swarm.summary("a")["rounds"]
            for e in r["errors"]
            if e.startswith("shard0: the averager")
        ]
        assert len(said) == 1 and said[0].endswith("a new one started"), said
        # the new averager is one of the node's helpers: it ends with the node
        swarm.wait_for(lambda: not Path(f"/proc/{new}").exists(), 60, "the new averager to end with its node")
    finally:
        swarm.close()
