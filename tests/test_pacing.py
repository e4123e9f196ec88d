"""When a round has another local step (pure; the clock is a fake one)."""

import pytest

from spes_node.daemon import pacing
from spes_node.daemon.pacing import RoundPacer


@pytest.fixture
def clock(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(pacing.time, "perf_counter", lambda: now[0])
    return now


def test_the_first_h_steps_then_steps_while_another_ends_before_the_peer_is_due(clock):
    pacer = RoundPacer(sync_steps=3)
    assert pacer.another_step(0) and pacer.another_step(2)
    assert not pacer.wants_wait(), "no step time yet: nothing to plan with"
    pacer.note_step(1.0)
    assert not pacer.another_step(3), "at H without a wait: sync"
    assert pacer.seconds_to_sync(1) == 2.0
    assert pacer.wants_wait()
    assert pacer.wait(2.5)
    assert not pacer.wants_wait(), "once a round"
    assert pacer.another_step(3) and pacer.seconds_to_sync(3) == 2.5
    clock[0] += 1.0
    assert pacer.another_step(4), "1.5 s left, steps of 1 s"
    clock[0] += 1.0
    assert not pacer.another_step(5), "0.5 s left: the rest is spent in matchmaking"
    pacer.new_round()
    assert not pacer.another_step(5) and pacer.wants_wait()


def test_a_step_slower_than_the_average_costs_one_steps_error(clock):
    pacer = RoundPacer(sync_steps=1)
    pacer.note_step(0.1)
    assert pacer.wait(1.0)
    # the steps become ten times slower: the average follows, and training stops once a step no longer fits
    steps = 0
    while pacer.another_step(1 + steps):
        clock[0] += 1.0
        pacer.note_step(1.0)
        steps += 1
    assert steps == 1 and clock[0] - 100.0 == 1.0


def test_a_wait_shorter_than_a_step_or_turned_off_trains_nothing(clock):
    pacer = RoundPacer(sync_steps=2)
    pacer.note_step(1.0)
    assert not pacer.wait(0.5) and not pacer.another_step(2)
    off = RoundPacer(sync_steps=2, enabled=False)
    off.note_step(1.0)
    assert not off.wants_wait()


def test_a_node_announces_its_sync_while_it_trains_but_not_while_an_overlapped_round_is_in_flight(tmp_path):
    from types import SimpleNamespace

    from spes_node.daemon.node import Node, NodeOptions

    node = Node(None, NodeOptions(checkpoint_dir=tmp_path))
    node.peer_id = "QmNode"
    node.trainer = SimpleNamespace(step=13)
    node.pacer = RoundPacer(sync_steps=5)
    node.pacer.note_step(1.0)
    node.steps_into_round = 3
    node.status.state = "training"
    node.sync = SimpleNamespace(round_in_flight=lambda: False)
    info = node.node_info()
    assert info.sync_at > 0 and info.round_steps == 3
    # overlap: the round averaged is in flight while the next one's steps run; the record's round is the former, so
    # a time (or steps) of the latter would have peers of that round wait for the sync after next
    node.sync = SimpleNamespace(round_in_flight=lambda: True)
    info = node.node_info()
    assert info.sync_at == 0 and info.round_steps is None
    node.sync, node.status.state = SimpleNamespace(round_in_flight=lambda: False), "averaging"
    assert node.node_info().sync_at == 0


@pytest.mark.parametrize("refreshing", [False, True])
def test_the_round_begins_on_the_records_read_at_step_h_unless_a_refresh_was_in_flight(
    tmp_path, monkeypatch, refreshing
):
    """Step H reads the records to decide whether to train on; when it does not, the round begins on that read
    (one DHT lookup a round, not two), except when a refresh was downloading: the round waits for it first, and
    reads the records after that wait."""
    from types import SimpleNamespace

    from spes_node.daemon import node as node_module
    from spes_node.daemon.node import Node, NodeOptions

    reads = []

    def fetch_nodes(*args, **kwargs):
        reads.append(len(reads))
        return {f"QmPeer{len(reads)}": SimpleNamespace()}

    monkeypatch.setattr(node_module.records, "fetch_nodes", fetch_nodes)
    node = Node(None, NodeOptions(checkpoint_dir=tmp_path))
    node.peer_id = "QmNode"
    node.trainer = SimpleNamespace(step=10)
    node.cfg = SimpleNamespace(
        swarm=SimpleNamespace(num_shards=4, shared_lag_steps=0, fresh_connections=False)
    )
    node.pacer = RoundPacer(sync_steps=5)
    node.pacer.note_step(1.0)
    node.steps_into_round = 5
    node.publish_record = lambda: None
    node.node_info = lambda: None
    node.recent_peers = SimpleNamespace(update=lambda nodes, leaving, now: {})
    began = []
    node.sync = SimpleNamespace(
        refresh_in_flight=lambda: refreshing,
        wait_ahead=lambda nodes, round_, me: 0.2,  # shorter than a step: no training on
        finish_pending=lambda: 0,
        begin_round=lambda inputs, overlap, overlap_shards, shared_lag: began.append(inputs.nodes),
    )
    assert node._at_sync(overlap=False, overlap_shards=False)
    assert len(began) == 1
    if refreshing:
        assert len(reads) == 2 and list(began[0]) == ["QmPeer2"], "read again after the refresh"
    else:
        assert len(reads) == 1 and list(began[0]) == ["QmPeer1"], "the round began on step H's read"
    # training on through a peer's wait: the round is not begun, and begins on a read of its own later
    reads.clear(), began.clear()
    node.pacer.new_round()
    node.sync.wait_ahead = lambda nodes, round_, me: 3.0
    assert not node._at_sync(overlap=False, overlap_shards=False) and not began
    assert node._at_sync(overlap=False, overlap_shards=False)
    assert len(reads) == 2 and list(began[0]) == ["QmPeer2"]
