"""The round's decisions as pure functions of plain data: no event loop, no DHT, no averager."""

import threading

import pytest

from spes_node.config import load_preset
from spes_node.daemon.frozen import refresh_due
from spes_node.daemon.round import (
    RoundReport,
    catch_up_target,
    live_peers,
    merge_due_at,
    next_data_part,
    rebalance_move,
    wait_cap,
)
from spes_node.swarm.records import NodeInfo


def node(
    peer: str, shards=(0,), round_: int = 0, state: str = "training", data_part: int | None = None
) -> NodeInfo:
    return NodeInfo(peer_id=peer, shards=list(shards), round=round_, state=state, data_part=data_part)


def swarm_config(**fields):
    return load_preset("tiny").replace(swarm=fields).swarm


def swarm(*nodes: NodeInfo) -> dict[str, NodeInfo]:
    return {n.peer_id: n for n in nodes}


def test_live_peers_are_the_other_active_unbanned_nodes():
    nodes = swarm(
        node("me"),
        node("a"),
        node("b", state="averaging"),
        node("c", state="joining"),
        node("d"),
        node("e", state="leaving"),
    )
    assert sorted(live_peers(nodes, "me", banned={"d"})) == ["a", "b"]


def test_a_node_catches_up_only_to_a_round_most_others_are_ahead_by_more_than_one():
    # one round apart is the normal skew of nodes finishing a moment apart
    assert catch_up_target(5, swarm(node("a", round_=6), node("b", round_=6)), "me") is None
    assert catch_up_target(5, swarm(node("a", round_=9), node("b", round_=9)), "me") == 9
    # our own record, joining nodes and banned peers do not count
    nodes = swarm(node("me", round_=50), node("a", round_=5), node("b", round_=80, state="joining"))
    assert catch_up_target(5, nodes, "me") is None
    assert (
        catch_up_target(5, swarm(node("a", round_=5), node("liar", round_=10**6)), "me", banned={"liar"})
        is None
    )


def test_one_peers_huge_round_claim_is_outvoted():
    nodes = swarm(node("a", round_=5), node("b", round_=5), node("liar", round_=10**6))
    assert catch_up_target(5, nodes, "me") is None


def test_the_wait_for_peers_is_capped_at_one_round_and_at_first_at_the_first_round_so_far():
    assert wait_cap(None, 6.0) == 6.0
    assert wait_cap(42.5, 6.0) == 42.5
    assert wait_cap(42.5, 6.0, this_round_so_far=80.0) == 42.5, "the last round, once there is one"
    # before a first round: that round's steps so far (a node on faster cards meets a slower one from round 1)
    assert wait_cap(None, 6.0, this_round_so_far=36.0) == 36.0
    assert wait_cap(None, 6.0, this_round_so_far=2.0) == 6.0


def test_refresh_and_merge_fall_due_on_their_schedules():
    swarm_cfg = swarm_config(
        refresh_every=2, sync_steps=5, merge_interval=10, merge_alpha0=0.05, merge_horizon=1000
    )
    assert [r for r in range(1, 9) if refresh_due(r, swarm_cfg)] == [2, 4, 6, 8]
    assert [r for r in range(1, 9) if merge_due_at(r, swarm_cfg)] == [2, 4, 6, 8]  # sync steps 10, 20, ...
    assert not any(
        merge_due_at(r, swarm_config(sync_steps=5, merge_interval=10, merge_alpha0=0.0)) for r in range(1, 9)
    )
    # past the horizon alpha is 0: no merge
    assert not merge_due_at(400, swarm_cfg)


def test_of_two_nodes_reading_one_data_part_the_larger_peer_id_moves():
    others = swarm(node("a", data_part=0))
    assert next_data_part(others, "b", (0, 1)) == (1, 2)
    assert next_data_part(swarm(node("b", data_part=0)), "a", (0, 1)) == (0, 2)  # a keeps its index, narrower
    assert next_data_part(swarm(node("a", data_part=0)), "b", (1, 2)) is None  # nothing to change


def test_a_lone_node_widens_its_part_when_the_others_left():
    assert next_data_part(swarm(node("me", data_part=0)), "me", (0, 2)) == (0, 1)


def test_exactly_one_holder_of_the_crowded_shard_moves_to_the_uncovered_one():
    swarm_cfg = swarm_config(num_shards=2, replication_target=2)
    nodes = swarm(node("a"), node("b"), node("c"))
    moves = {peer: rebalance_move(nodes, nodes[peer], (0,), swarm_cfg) for peer in nodes}
    assert moves == {"a": (0, 1), "b": None, "c": None}
    # once it moved, nobody else does
    nodes["a"] = node("a", shards=(1,))
    assert all(
        rebalance_move(nodes, nodes[peer], tuple(nodes[peer].shards), swarm_cfg) is None for peer in nodes
    )


def test_a_node_decides_its_move_from_its_own_record_not_a_stale_one():
    swarm_cfg = swarm_config(num_shards=2, replication_target=2)
    nodes = swarm(node("a", shards=(1,)), node("b"), node("c"))  # the DHT still shows a on shard 1
    me = node("a")  # a has since moved to shard 0 (for instance, restarted with --shard 0)
    assert rebalance_move(nodes, me, (0,), swarm_cfg) == (0, 1)


def test_the_report_keeps_the_dict_form_that_summaries_read():
    report = RoundReport(
        round=3, loss=2.5, shards=(1, 3), data_part=(0, 2), shared_group=4, shard_groups={1: 2, 3: 3}
    )
    report.add_bytes("shared", 100, 200)
    report.add_bytes("shard", 10, 20)
    report.add_bytes("shard", 1, 2)
    report.add_bytes("refresh", 0, 5000)
    as_dict = report.as_dict()
    assert set(as_dict) == {
        "round", "loss", "shared_group", "shards", "shard_group", "shard_groups", "bytes_shared", "bytes_shard", "seconds", "overlapped",
        "failed_parts", "errors", "banned", "merged", "refreshed", "caught_up", "resynced", "anchors",
        "steps", "steps_while_waiting", "phases", "shared_landed_after", "shared_landed_at", "shards_began_at", "stalled",
        "members",
    }  # fmt: skip
    assert as_dict["bytes_shared"] == 300 and as_dict["bytes_shard"] == 33
    assert as_dict["shard_group"] == 2  # the smallest group of the node's shards
    assert as_dict["shards"] == [1, 3] and as_dict["shard_groups"] == {1: 2, 3: 3}
    assert RoundReport(1, 0.0, (0,), (0, 1), 1, {}).as_dict()["shard_group"] == 1


def test_the_round_logic_runs_without_any_thread():
    before = threading.active_count()
    test_refresh_and_merge_fall_due_on_their_schedules()
    test_exactly_one_holder_of_the_crowded_shard_moves_to_the_uncovered_one()
    assert threading.active_count() == before


@pytest.mark.parametrize("held", [(0,), (0, 1)])
def test_a_node_never_moves_to_a_shard_it_already_holds(held):
    swarm_cfg = swarm_config(num_shards=2, replication_target=2)
    nodes = swarm(node("a", shards=held), node("b"), node("c"))
    assert rebalance_move(nodes, nodes["a"], held, swarm_cfg) in (None, (0, 1))
    if 1 in held:
        assert rebalance_move(nodes, nodes["a"], held, swarm_cfg) is None
