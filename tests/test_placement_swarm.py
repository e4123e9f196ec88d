"""Placement in a real swarm: a client-mode joiner takes a shard that has a reachable holder, a node with room for
several shards takes the neediest ones and trains them all."""

import pytest
from swarm_utils import Swarm, status_json


@pytest.fixture
def swarm(tmp_path):
    swarm = Swarm(tmp_path, run_id="placed")
    yield swarm
    swarm.close()


def _record(swarm: Swarm, name: str):
    return next((n for n in swarm.nodes().values() if n.public_name == name and n.shards), None)


@pytest.mark.swarm
def test_client_joins_a_reachable_holder_and_a_wide_node_takes_the_uncovered_shards(swarm):
    swarm.start("public", "--shard", "2", "--max-rounds", "200")
    swarm.wait_for(lambda: _record(swarm, "public"), 120, "the public node's record")

    # room for two shards, but only shard 2 has a reachable holder: the client takes that one alone
    swarm.start("nat", "--client-mode", "--shards", "2", "--max-rounds", "200")
    nat = swarm.wait_for(lambda: _record(swarm, "nat"), 120, "the client's record")
    assert nat.client_mode and nat.shards == [2]
    assert "--shards 2: room for 2 of 4 shards" in swarm.log("nat")
    assert "placement gives this node" not in swarm.log("nat")

    # a reachable node with room for three takes the three shards nobody holds, and trains them all
    swarm.start("wide", "--shards", "3", "--max-rounds", "200")
    wide = swarm.wait_for(lambda: _record(swarm, "wide"), 120, "the wide node's record")
    assert wide.shards == [0, 1, 3]
    swarm.wait_for(lambda: "training shards [0, 1, 3]" in swarm.log("wide"), 120, "the wide node training")

    summary = status_json(swarm)
    assert summary["no_holder"] == []
    assert summary["unreachable_only"] == []
    by_shard = {s["shard"]: s for s in summary["shards"]}
    assert (by_shard[2]["replicas"], by_shard[2]["reachable_replicas"]) == (2, 1)
    assert {n["public_name"]: n["reachable"] for n in summary["nodes"]} == {
        "public": "direct",
        "nat": "none",
        "wide": "direct",
    }
