from dataclasses import dataclass, field

import pytest

from spes_node.daemon.placement import (
    assign_joiners,
    choose_shard,
    data_part,
    expert_to_shard,
    plan_rebalance,
    replica_counts,
    shard_experts,
    under_replicated,
)
from spes_node.swarm.records import NodeInfo


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
    assert all(len(shards) == 1 for shards in assigned.values())
    after |= {peer: Node(shards) for peer, shards in assigned.items()}
    counts = replica_counts(after, 4)
    assert min(counts) >= 1 and max(counts) - min(counts) <= 1


def _holder(peer: str, shard: int, part: int | None = None, state: str = "training") -> NodeInfo:
    return NodeInfo(peer_id=peer, shards=[shard], state=state, data_part=part)


def _settle(parts: dict[str, int | None], shards: dict[str, int] | None = None) -> dict[str, tuple[int, int]]:
    """Every node's data_part given the others' announced parts (each node ignores its own record)."""
    shards = shards or {}
    records = {peer: _holder(peer, shards.get(peer, 0), part) for peer, part in parts.items()}
    return {peer: data_part(records, peer, current=parts[peer]) for peer in parts}


def _assert_disjoint(assigned: dict[str, tuple[int, int]], documents: int = 4096) -> set[int]:
    """Training documents 0..documents-1 that some node reads; fails if two nodes read the same one."""
    reader: dict[int, str] = {}
    for peer, (part, num_parts) in assigned.items():
        assert 0 <= part < num_parts and num_parts & (num_parts - 1) == 0, (peer, part, num_parts)
        for t in range(part, documents, num_parts):
            assert t not in reader, f"document {t} read by {reader[t]} and {peer}: {assigned}"
            reader[t] = peer
    return set(reader)


def test_data_part_takes_the_lowest_index_nobody_announces_whatever_the_shard():
    assert data_part({}, "B") == (0, 1), "alone: every document"
    assert data_part({"A": _holder("A", 1, 0)}, "B") == (1, 2)
    assert data_part({"A": _holder("A", 0, 0)}, "B") == (1, 2), "a node of another shard counts too"
    assert data_part({"A": _holder("A", 1, 1)}, "B") == (0, 2)
    # leaving nodes and nodes without a part yet do not count
    nodes = {"A": _holder("A", 0, 0), "C": _holder("C", 1, 1, state="leaving"), "D": _holder("D", 1)}
    assert data_part(nodes, "B") == (1, 2)
    # our own record, if the caller left it in, is ignored
    assert data_part({"B": _holder("B", 1, 0)}, "B") == (0, 1)


def test_four_replicas_of_one_shard_settle_on_four_disjoint_parts_in_one_step():
    # target 2, four holders of shard 0 that started together: all took part 0 before seeing each other
    started = {peer: data_part({}, peer) for peer in "DBCA"}
    assert set(started.values()) == {(0, 1)}
    settled = _settle({peer: 0 for peer in "ABCD"})
    assert settled == {"A": (0, 4), "B": (1, 4), "C": (2, 4), "D": (3, 4)}
    assert _assert_disjoint(settled) == set(range(4096)), "four parts of four: every document is read"
    # once apart, nobody moves again
    assert _settle({peer: part for peer, (part, _) in settled.items()}) == settled


def test_sixteen_nodes_on_four_shards_read_disjoint_parts_as_nodes_come_and_go():
    peers = [f"p{i:02d}" for i in range(16)]
    shards = {peer: i % 4 for i, peer in enumerate(peers)}
    parts: dict[str, int | None] = {}
    for peer in peers:  # one at a time, each sees the earlier ones
        parts[peer] = _settle({**parts, peer: None}, shards)[peer][0]
    assert sorted(parts.values()) == list(range(16))
    assigned = _settle(parts, shards)
    assert set(assigned.values()) == {(i, 16) for i in range(16)}
    assert _assert_disjoint(assigned) == set(range(4096))
    # five leave: the rest keep their indices, some read more, nothing is read twice
    for peer in ("p03", "p07", "p08", "p12", "p15"):
        del parts[peer]
    after = _settle(parts, shards)
    assert {peer: part for peer, (part, _) in after.items()} == parts
    assert len(_assert_disjoint(after)) > len(after) * 4096 // 16
    # three join: they take the lowest free indices; still disjoint
    for peer in ("n1", "n2", "n3"):
        parts[peer] = _settle({**parts, peer: None}, shards)[peer][0]
    assert [parts[peer] for peer in ("n1", "n2", "n3")] == [3, 7, 8]
    _assert_disjoint(_settle(parts, shards))


@pytest.mark.parametrize("count", [1, 2, 3, 5, 6, 7, 9, 12, 17, 33])
def test_contiguous_parts_are_disjoint_and_read_everything(count):
    assigned = _settle({f"p{i:02d}": i for i in range(count)})
    assert [part for part, _ in assigned.values()] == list(range(count))
    assert _assert_disjoint(assigned) == set(range(4096))
    sizes = {num_parts for _, num_parts in assigned.values()}
    assert max(sizes) <= 2 * min(sizes) and max(sizes) < 2 * count + 1


def test_num_parts_follows_the_nodes_for_the_same_index():
    five = {peer: i for i, peer in enumerate("ABCDE")}
    assert _settle(five)["A"] == (0, 8), "E reads 4 of 8, A keeps 0 of 8"
    four = {peer: i for i, peer in enumerate("ABCD")}
    assert _settle(four)["A"] == (0, 4), "E gone: A reads 0 of 4 again"


def test_restarted_node_keeps_its_part():
    # C restarts with part 2 from its checkpoint while 0 and 1 are taken, and 3 was read by a node now gone
    others = {"A": _holder("A", 0, 0), "B": _holder("B", 1, 1)}
    assert data_part(others, "C", current=2) == (2, 4), "not the lowest free index: its own"
    # a node that took the index while C was down: the smaller peer id keeps it, the other moves
    assert data_part({**others, "Z": _holder("Z", 1, 2)}, "C", current=2) == (2, 4)
    assert data_part({**others, "C": _holder("C", 1, 2)}, "Z", current=2) == (3, 4)
    assert data_part({**others, "B0": _holder("B0", 1, 2)}, "C", current=2) == (3, 4)
    # a restarted node whose index is far above the others keeps it too; nobody's documents overlap
    assigned = _settle({"A": 0, "B": 1, "C": 6})
    assert assigned["C"] == (6, 8)
    _assert_disjoint(assigned)


def test_simultaneous_movers_and_newcomers_do_not_collide_again():
    # A keeps 0; B and C both claimed 0 and move to the lowest free indices in peer id order, skipping 1 (D's)
    parts = {"A": 0, "B": 0, "C": 0, "D": 1}
    assert _settle(parts) == {"A": (0, 4), "B": (2, 4), "C": (3, 4), "D": (1, 4)}
    records = {peer: _holder(peer, 0, part) for peer, part in parts.items()}
    assert data_part(records, "E") == (4, 8), "a node without a part comes after the movers"
