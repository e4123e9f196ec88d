"""Placement by capacity and reachability, and the rebalance decision that follows the same rules."""

import random
from dataclasses import dataclass, field

import pytest

from spes_node.daemon.placement import (
    ShardStats,
    assign_joiners,
    choose_shard,
    choose_shards,
    plan_rebalance,
    plan_rebalance_move,
    rank_shards,
    replica_counts,
    unreachable_only,
)
from spes_node.swarm.records import NodeInfo


@dataclass
class Node:
    shards: list[int]
    tokens_per_s: float = 100.0
    state: str = "training"
    client_mode: bool = False
    extra: dict = field(default_factory=dict)


def _join(
    nodes: dict, peer: str, capacity: int, *, client: bool = False, target: int = 2, num_shards: int = 4
):
    """One node joins by placement: it takes `choose_shards` of the swarm as it sees it."""
    shards = choose_shards(nodes, num_shards, capacity, target=target, client_mode=client)
    nodes[peer] = Node(shards, client_mode=client)
    return shards


def test_two_nodes_with_room_for_two_cover_tiny_and_a_third_raises_replication():
    nodes: dict = {}
    assert _join(nodes, "a", 2) == [0, 1]
    assert _join(nodes, "b", 2) == [2, 3]
    assert replica_counts(nodes, 4) == [1, 1, 1, 1]
    third = _join(nodes, "c", 2)
    assert len(third) == 2
    assert replica_counts(nodes, 4) == [2 if s in third else 1 for s in range(4)]
    fourth = _join(nodes, "d", 2)
    assert set(fourth).isdisjoint(third), "the fourth takes the shards still below target"
    assert replica_counts(nodes, 4) == [2, 2, 2, 2]


def test_capacity_is_capped_by_the_shard_count_and_never_repeats_a_shard():
    assert choose_shards({}, 4, 9) == [0, 1, 2, 3]
    assert choose_shards({"a": Node([0, 1, 2, 3])}, 4, 4) == [0, 1, 2, 3]
    assert choose_shards({}, 4, 3, held=[2, 2]) == [2, 0, 1]
    with pytest.raises(ValueError, match="capacity"):
        choose_shards({}, 4, 0)


def test_coverage_comes_before_replication():
    # shard 3 is held by nobody: it goes first even though shard 1 has a single slow holder
    nodes = {"a": Node([0]), "b": Node([0]), "c": Node([1], tokens_per_s=1.0), "d": Node([2])}
    assert choose_shard(nodes, 4) == 3
    assert choose_shards(nodes, 4, 2) == [3, 1]


def test_replication_comes_before_throughput():
    # shard 0 has one very fast holder, shard 1 two slow ones: the target of two holders counts first
    nodes = {"a": Node([0], 10_000.0), "b": Node([1], 10.0), "c": Node([1], 10.0)}
    assert choose_shard(nodes, 2, target=2) == 0
    assert choose_shard(nodes, 2, target=1) == 1, "with every shard at target, throughput decides"


def test_above_target_the_slowest_shard_wins_not_the_one_with_fewest_nodes():
    nodes = {
        "a": Node([0], 1000.0),
        "b": Node([0], 1000.0),
        "c": Node([1], 10.0),
        "d": Node([1], 10.0),
        "e": Node([1], 10.0),
    }
    assert choose_shard(nodes, 2, target=2) == 1
    nodes["e"].tokens_per_s = 5000.0
    assert choose_shard(nodes, 2, target=2) == 0


def test_a_node_without_a_measured_speed_counts_as_a_typical_one():
    # two just-joined holders of shard 0 (no tokens/s yet) against two measured ones of shard 1
    nodes = {"a": Node([0], 0.0), "b": Node([0], 0.0), "c": Node([1], 100.0), "d": Node([1], 100.0)}
    assert ShardStats.of(nodes, 2).throughput == [200.0, 200.0]
    assert choose_shard(nodes, 2) == 0
    nodes["e"] = Node([0], 0.0)
    assert choose_shard(nodes, 2) == 1, "a third new node on shard 0 is not taken for an idle one"
    assert ShardStats.of({"x": Node([0], 0.0)}, 2).throughput == [1.0, 0.0], "nothing measured: nodes count"


def test_a_client_takes_only_shards_with_a_reachable_holder():
    nodes = {"public": Node([0])}
    assert choose_shards(nodes, 4, 1, client_mode=True) == [0]
    assert choose_shards(nodes, 4, 4, client_mode=True) == [0], "never the only holder of shards 1-3"
    assert choose_shards(nodes, 4, 4, client_mode=False) == [1, 2, 3, 0]
    # among shards with a reachable holder: replication first
    nodes = {"a": Node([0]), "b": Node([0]), "c": Node([1]), "nat": Node([2], client_mode=True)}
    assert rank_shards(nodes, 4, client_mode=True) == [1, 0]
    assert choose_shards(nodes, 4, 3, client_mode=True) == [1, 0]


def test_a_client_alone_or_among_clients_still_covers_the_shards():
    assert choose_shards({}, 4, 2, client_mode=True) == [0, 1]
    nodes = {"nat1": Node([0, 1], client_mode=True)}
    assert choose_shards(nodes, 4, 2, client_mode=True) == [2, 3]


def test_a_reachable_node_takes_shards_only_clients_hold_before_adding_replicas():
    nodes = {"a": Node([0]), "nat": Node([1], client_mode=True), "b": Node([3])}
    assert rank_shards(nodes, 4) == [2, 1, 0, 3], "unheld, then held only by a client, then replicas"
    assert choose_shards(nodes, 4, 2) == [2, 1]


def test_leaving_nodes_hold_nothing():
    nodes = {"a": Node([0], state="leaving"), "b": Node([1])}
    assert choose_shard(nodes, 2) == 0


@pytest.mark.parametrize("seed", range(20))
def test_random_joins_never_leave_a_shard_with_only_unreachable_holders(seed):
    """Nodes of random capacity and reachability join one at a time after a reachable founder."""
    rng = random.Random(seed)
    num_shards = rng.choice([2, 4, 8])
    nodes: dict = {}
    _join(nodes, "founder", rng.randint(1, num_shards), num_shards=num_shards)
    for i in range(rng.randint(1, 12)):
        client = rng.random() < 0.5
        shards = _join(nodes, f"n{i:02d}", rng.randint(1, num_shards), client=client, num_shards=num_shards)
        assert shards, "every node gets at least one shard"
        assert unreachable_only(nodes, num_shards) == [], nodes
    reachable_capacity = sum(len(n.shards) for n in nodes.values() if not n.client_mode)
    counts = replica_counts(nodes, num_shards)
    if reachable_capacity >= num_shards:
        assert min(counts) >= 1, "enough reachable room: every shard is covered"


def test_simultaneous_joiners_read_each_others_reachability_and_take_their_capacity():
    swarm = {"a": Node([0]), "b": Node([1])}
    joining = {
        "c": NodeInfo(peer_id="c", shards=[], state="joining", client_mode=True),
        "d": NodeInfo(peer_id="d", shards=[], state="joining"),
    }
    assigned = assign_joiners({**swarm, **joining}, ["c", "d"], 4, capacities={"d": 2})
    assert assigned["c"] == [0], "the client joins a shard that has a reachable holder"
    assert assigned["d"] == [2, 3]
    # each joiner's first shard is the same whatever capacity the others assume for it
    again = assign_joiners({**swarm, **joining}, ["d", "c"], 4, capacities={"c": 3})
    assert again["d"][0] == assigned["d"][0] and again["c"][0] == assigned["c"][0]


# ---------------------------------------------------------------------------------------------- rebalance


def test_rebalance_never_uncovers_a_shard_or_leaves_one_to_clients():
    # the public node alone holds shard 0 beside a client; shard 1 has nobody: moving would leave shard 0 to
    # the client only, so nobody moves (a reachable joiner will take shard 1)
    nodes = {"public": Node([0]), "nat": Node([0], client_mode=True)}
    assert plan_rebalance_move(nodes, 2, 2) is None
    assert choose_shard(nodes, 2) == 1
    # with a second public holder of shard 0, one of them moves to shard 1
    nodes["public2"] = Node([0])
    assert plan_rebalance_move(nodes, 2, 2).destination == 1
    assert plan_rebalance_move(nodes, 2, 2).peer in {"public", "public2"}


def test_rebalance_gives_a_shard_held_only_by_clients_a_reachable_holder():
    nodes = {"a": Node([0]), "b": Node([0]), "c": Node([0]), "nat": Node([1], client_mode=True)}
    move = plan_rebalance_move(nodes, 2, 2)
    assert move is not None and move.destination == 1 and move.peer in {"a", "b", "c"}
    assert plan_rebalance(nodes, move.peer, 2, 2) == 1
    assert plan_rebalance(nodes, "nat", 2, 2) is None


def test_a_multi_shard_node_leaves_its_most_replicated_shard():
    nodes = {"big": Node([0, 1]), "a": Node([1]), "b": Node([1]), "c": Node([2])}
    move = plan_rebalance_move(nodes, 4, 2)
    assert move is not None and move.destination == 3
    assert move.source == 1, "a holder of the shard with three replicas moves, not the only holder of shard 0"


def _apply(nodes: dict, move) -> None:
    node = nodes[move.peer]
    node.shards = [move.destination if s == move.source else s for s in node.shards]


def _random_swarm(rng: random.Random, num_shards: int) -> dict:
    nodes = {}
    for i in range(rng.randint(1, 10)):
        held = rng.sample(range(num_shards), rng.randint(1, min(3, num_shards)))
        state = rng.choice(["training", "training", "averaging", "joining"])
        nodes[f"p{i:02d}"] = Node(
            held, rng.choice([0.0, 50.0, 100.0, 400.0]), state=state, client_mode=rng.random() < 0.3
        )
    return nodes


@pytest.mark.parametrize("seed", range(40))
def test_rebalance_moves_where_placement_would_place_and_converges(seed):
    rng = random.Random(seed)
    num_shards, target = rng.choice([(2, 2), (4, 2), (4, 3), (8, 2)])
    nodes = _random_swarm(rng, num_shards)
    for _ in range(50):
        move = plan_rebalance_move(nodes, num_shards, target)
        moves = {peer: plan_rebalance(nodes, peer, num_shards, target) for peer in nodes}
        if move is None:
            assert all(shard is None for shard in moves.values())
            break
        assert {peer for peer, shard in moves.items() if shard is not None} == {move.peer}, (
            "exactly one mover"
        )
        mover = nodes[move.peer]
        assert mover.state in ("training", "averaging") and move.source in mover.shards
        assert move.destination not in mover.shards
        # the same rules: placing the mover's freed slot afresh gives the same destination
        others = {peer: node for peer, node in nodes.items() if peer != move.peer}
        kept = [s for s in mover.shards if s != move.source]
        placed = choose_shards(
            others, num_shards, len(mover.shards), target=target, client_mode=mover.client_mode, held=kept
        )
        assert placed[len(kept)] == move.destination
        before = ShardStats.of(nodes, num_shards).deficits(target)
        _apply(nodes, move)
        after = ShardStats.of(nodes, num_shards).deficits(target)
        assert after < before and after[0] <= before[0] and after[1] <= before[1]
    else:
        pytest.fail("rebalancing did not settle in 50 moves")


@pytest.mark.parametrize("seed", range(20))
def test_a_swarm_built_by_placement_needs_no_rebalance(seed):
    rng = random.Random(seed)
    num_shards = rng.choice([2, 4, 8])
    nodes: dict = {}
    for i in range(rng.randint(1, 12)):
        _join(
            nodes, f"n{i:02d}", rng.randint(1, 2), client=i > 0 and rng.random() < 0.3, num_shards=num_shards
        )
    assert plan_rebalance_move(nodes, num_shards, 2) is None, nodes
