from dataclasses import dataclass, field

import pytest

from spes_node.records import NodeInfo
from spes_node.sharding import data_part
from spes_node.shards import (
    assign_joiners,
    choose_shard,
    expert_to_shard,
    plan_rebalance,
    replica_counts,
    shard_experts,
    under_replicated,
)


@dataclass
class Node:
    shards: list[int]
    tokens_per_s: float = 100.0
    state: str = "training"
    extra: dict = field(default_factory=dict)


def _swarm(*shards_per_node, **states):
    return {
        f"peer{i}": Node(shards=[shard], state=states.get(f"peer{i}", "training"))
        for i, shard in enumerate(shards_per_node)
    }


def test_shard_experts_partition_and_inverse():
    assert shard_experts(0, 16, 4) == range(0, 4)
    assert shard_experts(3, 16, 4) == range(12, 16)
    covered = [expert for shard in range(4) for expert in shard_experts(shard, 8, 4)]
    assert covered == list(range(8))
    for expert in range(32):
        assert expert in shard_experts(expert_to_shard(expert, 32, 8), 32, 8)


@pytest.mark.parametrize(
    ("call", "field_name"),
    [
        (lambda: shard_experts(0, 10, 4), "num_experts"),
        (lambda: shard_experts(4, 8, 4), "shard"),
        (lambda: shard_experts(0, 8, 0), "num_shards"),
        (lambda: expert_to_shard(8, 8, 4), "expert"),
        (lambda: expert_to_shard(0, 6, 4), "num_experts"),
    ],
)
def test_bad_split_names_the_field(call, field_name):
    with pytest.raises(ValueError, match=field_name):
        call()


def test_choose_shard_prefers_fewest_replicas():
    nodes = _swarm(0, 0, 1, 2, 2, 3)
    assert choose_shard(nodes, 4) == 1
    assert choose_shard({}, 4) == 0


def test_choose_shard_ties_by_throughput_then_index():
    nodes = {"a": Node([0], 50.0), "b": Node([1], 10.0), "c": Node([2], 10.0), "d": Node([3], 30.0)}
    assert choose_shard(nodes, 4) == 1
    nodes["b"].tokens_per_s = 60.0
    assert choose_shard(nodes, 4) == 2


def test_choose_shard_excludes_own_record():
    nodes = {"me": Node([1]), "a": Node([0]), "b": Node([0]), "c": Node([1])}
    assert choose_shard(nodes, 2) == 0
    assert choose_shard(nodes, 2, exclude_peer="me") == 1


def test_replica_counts_and_under_replicated_ignore_foreign_shards():
    nodes = {"a": Node([0, 0]), "b": Node([0, 5]), "c": Node([2])}
    assert replica_counts(nodes, 4) == [2, 0, 1, 0]
    assert under_replicated(nodes, 4, 2) == [1, 2, 3]
    assert under_replicated(nodes, 4, 1) == [1, 3]


def test_rebalance_moves_exactly_one_node():
    nodes = _swarm(0, 0, 0, 1, 1, 2, 2, 3)
    moves = {peer: plan_rebalance(nodes, peer, 4, 2) for peer in nodes}
    assert moves == {peer: (3 if peer == "peer0" else None) for peer in nodes}


def test_rebalance_without_over_replicated_shard_moves_only_when_gap_is_two():
    nodes = _swarm(0, 0, 1, 2, 3)
    assert all(plan_rebalance(nodes, peer, 4, 2) is None for peer in nodes)
    nodes = _swarm(0, 0, 1, 1, 2)
    moves = {peer: plan_rebalance(nodes, peer, 4, 2) for peer in nodes}
    assert moves == {peer: (3 if peer == "peer0" else None) for peer in nodes}


def test_rebalance_balanced_swarm_stays():
    nodes = _swarm(0, 0, 1, 1, 2, 2, 3, 3, 0)
    assert all(plan_rebalance(nodes, peer, 4, 2) is None for peer in nodes)


def test_rebalance_only_training_nodes_move_but_joining_ones_count():
    nodes = _swarm(0, 0, 0, 1, 1, 2, 2, 3, peer0="joining")
    moves = {peer: plan_rebalance(nodes, peer, 4, 2) for peer in nodes}
    assert moves == {peer: (3 if peer == "peer1" else None) for peer in nodes}
    nodes["peer8"] = Node([3], state="joining")
    assert all(plan_rebalance(nodes, peer, 4, 2) is None for peer in nodes)


def test_rebalance_converges():
    nodes = _swarm(0, 0, 0, 0, 0, 0, 1, 1)
    for _ in range(10):
        moves = {peer: plan_rebalance(nodes, peer, 4, 2) for peer in nodes}
        moving = {peer: shard for peer, shard in moves.items() if shard is not None}
        if not moving:
            break
        assert len(moving) == 1
        ((peer, shard),) = moving.items()
        nodes[peer].shards = [shard]
    assert replica_counts(nodes, 4) == [2, 2, 2, 2]


def test_simultaneous_joiners_spread_out():
    nodes = {"a": Node([0]), "b": Node([0]), "c": Node([1]), "z": Node([], state="joining"), "y": Node([2])}
    assigned = assign_joiners(nodes, ["z", "x", "w"], 4)
    assert assigned == assign_joiners(nodes, ["w", "x", "z"], 4)
    assert set(assigned) == {"w", "x", "z"}
    after = {peer: node for peer, node in nodes.items() if node.shards}
    after |= {peer: Node([shard]) for peer, shard in assigned.items()}
    counts = replica_counts(after, 4)
    assert min(counts) >= 1 and max(counts) - min(counts) <= 1


def _holder(peer: str, shard: int, part: int | None = None, state: str = "training") -> NodeInfo:
    return NodeInfo(peer_id=peer, shards=[shard], state=state, data_part=part)


def test_data_part_takes_the_lowest_part_nobody_reads():
    # shard 1 of 4 with 2 replicas per shard: parts 2 and 3 of 8
    assert data_part({}, "B", 1, 4, 2) == (2, 8)
    assert data_part({"A": _holder("A", 1, 2)}, "B", 1, 4, 2) == (3, 8)
    assert data_part({"A": _holder("A", 1, 3)}, "B", 1, 4, 2) == (2, 8)
    # other shards' holders and leaving nodes do not count; holders without a part yet neither
    nodes = {"A": _holder("A", 0, 0), "C": _holder("C", 1, 2, state="leaving"), "D": _holder("D", 1)}
    assert data_part(nodes, "B", 1, 4, 2) == (2, 8)
    # more replicas than the target share the least read part
    nodes = {"A": _holder("A", 1, 2), "C": _holder("C", 1, 3), "D": _holder("D", 1, 2)}
    assert data_part(nodes, "B", 1, 4, 2) == (3, 8)


def test_simultaneous_replicas_settle_on_different_parts():
    # A and B started together and both took part 2; after a round they see each other's records
    a, b = _holder("A", 1, 2), _holder("B", 1, 2)
    assert data_part({"B": b}, "A", 1, 4, 2, current=2) == (2, 8), "the smaller peer id stays"
    assert data_part({"A": a}, "B", 1, 4, 2, current=2) == (3, 8), "the larger one moves"
    # once apart, nobody moves again
    assert data_part({"B": _holder("B", 1, 3)}, "A", 1, 4, 2, current=2) == (2, 8)
    assert data_part({"A": a}, "B", 1, 4, 2, current=3) == (3, 8)
    # a kept part may be outside the shard's own range (a restarted node, a pinned benchmark): kept while unique
    assert data_part({"A": a}, "B", 1, 4, 2, current=6) == (6, 8)
