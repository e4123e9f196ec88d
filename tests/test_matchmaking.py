"""Groups begin once every expected peer has joined (`SpesMatchmaking`): real hivemind averagers on 127.0.0.1, and
the rule itself, which never refuses a joiner for a full group."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from types import SimpleNamespace

import pytest
import torch
from hivemind.averaging.control import AveragingStage
from hivemind.p2p import P2P, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import as_aiter
from swarm_utils import wait_for

from spes_node.swarm.averaging import GroupAverager, StepHandle
from spes_node.swarm.robust import RobustAverager, SpesMatchmaking

TENSORS = {"w": torch.zeros(1000)}


def run_group(
    dhts,
    prefix: str,
    members: int,
    window: float,
    expected: list[list[str]],
    extra: float = 0.0,
    late: float | None = None,
    clients: tuple[int, ...] = (),
):
    """`members` averagers step, each telling its averager whom to expect and waiting `extra` seconds past the
    window for them; with `late`, the last one steps only once the others have been looking for that long; the
    members numbered in `clients` run in client mode. Returns their results."""
    group = [
        GroupAverager(
            dht,
            prefix,
            TENSORS,
            compression="fp16",
            matchmaking_time=window,
            allreduce_timeout=60.0,
            client_mode=i in clients,
        )
        for i, dht in enumerate(dhts[:members])
    ]

    def step(i: int):
        tensors = {"w": torch.full((1000,), float(i + 1))}
        return group[i].step(tensors, 1.0, (0, 0, 1), extra, expected=expected[i])

    try:
        handles = [step(i) for i in range(members - (late is not None))]
        if late is not None:
            while time.perf_counter() - handles[0].started < late:
                assert not any(h.control.done() for h in handles), "a step ended before the late peer came"
                time.sleep(0.1)
            handles.append(step(members - 1))
        return [averager.finish(handle) for averager, handle in zip(group, handles)]
    finally:
        for averager in group:
            averager.shutdown()


@pytest.mark.swarm
@pytest.mark.timeout(600)
def test_a_group_begins_once_every_expected_peer_has_joined(dhts):
    # a window far longer than the group needs: before, the leader always waited it out
    window = 120.0
    ids = [dht.peer_id.to_base58() for dht in dhts]
    outcomes = run_group(dhts, "test_mm_all", 3, window, [[p for p in ids if p != me] for me in ids])
    for result, averaged in outcomes:
        assert result.group_size == 3 and averaged is not None and not result.error, result
        assert result.seconds < window, result
        assert torch.allclose(averaged["w"], outcomes[0][1]["w"], atol=1e-2) and 1 < averaged["w"].mean() < 3


@pytest.mark.swarm
@pytest.mark.timeout(600)
def test_a_client_joins_a_leader_whose_group_begins_past_two_windows_of_its_search(dhts):
    # a client is found by no one: it joins a leader that has declared itself, and a leader refuses a follower whose
    # search ends before the leader's group begins (a window after the leader came). This client reaches the sync
    # alone; the leader (expecting it) comes one and a half windows later, so its group begins past two windows of
    # the client's search: the client still joins it
    window = 5.0
    ids = [dht.peer_id.to_base58() for dht in dhts]
    outcomes = run_group(
        dhts, "test_mm_client", 2, window, [[ids[1]], [ids[0]]], late=1.5 * window, clients=(0,)
    )
    for result, averaged in outcomes:
        assert result.group_size == 2 and averaged is not None and not result.error, result
        assert torch.allclose(averaged["w"], torch.full((1000,), 1.5), atol=1e-2)


@pytest.mark.swarm
@pytest.mark.timeout(600)
def test_a_group_missing_an_expected_peer_waits_out_its_stretched_window(dhts):
    # the third DHT runs no averager under this key: the two that do expect it, and are told it is due in 8 s,
    # wait for it through the window stretched by those 8 s, then begin without it (the round bounds the wait and
    # stops waiting for a peer that did not come: progress.no_shows)
    window, extra = 4.0, 8.0
    ids = [dht.peer_id.to_base58() for dht in dhts]
    outcomes = run_group(
        dhts, "test_mm_missing", 2, window, [[ids[1], ids[2]], [ids[0], ids[2]]], extra=extra
    )
    for result, averaged in outcomes:
        assert result.group_size == 2 and averaged is not None, result
    # the leader is the first to step; its group cannot begin before its stretched window ends
    assert window + extra <= max(result.seconds for result, _ in outcomes) < 2 * window + extra + 60


@pytest.mark.swarm
@pytest.mark.timeout(600)
def test_the_window_stretches_for_a_peer_expected_soon_and_ends_when_it_joins(dhts):
    # two peers wait past their 4 s window for a third that the records say is about to finish (the round's
    # `wait_extra`, which stretches the window to 124 s); it steps once they have been looking for 12 s, three
    # windows, and the group of three begins when it joins. (With the stretch capped at one more window, the two
    # began at 8 s and the third, like a joiner whose download outlasted a round, found no group.)
    window, extra, late = 4.0, 120.0, 12.0
    ids = [dht.peer_id.to_base58() for dht in dhts]
    expected = [[p for p in ids if p != me] for me in ids]
    outcomes = run_group(dhts, "test_mm_late", 3, window, expected, extra=extra, late=late)
    for result, averaged in outcomes:
        assert result.group_size == 3 and averaged is not None and not result.error, result
    assert late <= outcomes[0][0].seconds < late + 60


def matchmaking(me: PeerID, expected: set[PeerID], followers: list[PeerID]) -> SpesMatchmaking:
    class Bare(SpesMatchmaking):
        def __init__(self):  # no p2p: only the group-size rule is exercised
            self.peer_id = me
            self.current_followers = dict.fromkeys(followers)

    bare = Bare()
    bare.expected = frozenset(expected)
    return bare


def test_the_group_size_exists_only_once_every_expected_peer_is_in():
    me, a, b, stranger = (PeerID(f"peer-{name}-id-bytes".encode()) for name in ("me", "a", "b", "stranger"))
    assert matchmaking(me, set(), [a, b]).target_group_size is None  # nobody expected: the window decides
    assert matchmaking(me, {a, b}, [a]).target_group_size is None
    # a stranger that joins first fills no expected place: the group still waits for b, and refuses nobody
    assert matchmaking(me, {a, b}, [stranger, a]).target_group_size is None
    assert matchmaking(me, {a, b}, [stranger, a, b]).target_group_size == 4
    assert matchmaking(me, {a, b}, [b, a]).target_group_size == 2 + 1


def test_hivemind_begins_a_group_at_its_target_size_and_refuses_past_it():
    # the rule works through hivemind's own uses of target_group_size: the early begin in rpc_join_group and the
    # refusal of a full group, which our size makes unreachable (the group has begun by then)
    import inspect

    from hivemind.averaging.matchmaking import Matchmaking

    join = inspect.getsource(Matchmaking.rpc_join_group)
    assert "len(self.current_followers) + 1 >= self.target_group_size" in join
    assert "await self.leader_assemble_group()" in join
    reject = inspect.getsource(Matchmaking._check_reasons_to_reject)
    assert reject.index("self.assembled_group.done()") < reject.index("GROUP_IS_FULL")

    bare = matchmaking(PeerID(b"peer-me-id-bytes"), set(), [])
    bare.target_group_size = None  # what hivemind's constructor sets
    with pytest.raises(ValueError):
        bare.target_group_size = 4


@pytest.mark.swarm
@pytest.mark.timeout(600)
def test_an_averager_whose_process_was_killed_is_restarted_and_averages_again(dhts):
    # the OOM killer picks the largest helper, often an averager: its group would never average again, and each
    # step on it would wait out its whole deadline. `healthy` sees it at once; a restart starts a new process on the
    # group's live weights, which then averages with the others
    ids = [dht.peer_id.to_base58() for dht in dhts[:2]]
    expected = [[ids[1]], [ids[0]]]
    group = [
        GroupAverager(dht, "test_mm_restart", TENSORS, compression="none", matchmaking_time=30.0,
                      allreduce_timeout=60.0, client_mode=False)
        for dht in dhts[:2]
    ]  # fmt: skip
    try:
        killed = group[0].averager
        os.kill(killed.pid, signal.SIGKILL)
        killed.join(30)
        assert not group[0].healthy and group[1].healthy
        live = {"w": torch.full((1000,), 3.0)}
        group[0].restart(live)
        assert group[0].healthy and group[0].averager.pid != killed.pid and group[0].restarts == 1
        with group[0].averager.get_tensors() as buffers:
            assert torch.equal(buffers[0], live["w"]), "the new averager starts from the live weights"
        handles = [
            averager.step({"w": torch.full((1000,), float(2 * i + 1))}, 1.0, (0, 0, 1), expected=expected[i])
            for i, averager in enumerate(group)
        ]
        for result, averaged in (a.finish(h) for a, h in zip(group, handles)):
            assert result.group_size == 2 and not result.error, result
            assert torch.allclose(averaged["w"], torch.full((1000,), 2.0)), averaged["w"][:4]
    finally:
        for averager in group:
            averager.shutdown()


def test_an_averager_that_gave_no_outcome_in_time_is_unhealthy_until_restarted(dhts):
    averager = GroupAverager(dhts[0], "test_mm_wedged", TENSORS, compression="none", matchmaking_time=2.0,
                             allreduce_timeout=5.0, client_mode=False, step_grace=0.0)  # fmt: skip
    try:
        assert averager.healthy
        # a step whose outcome never comes (a hung averager loop), past its deadline
        never = SimpleNamespace(result=_never_within, cancel=lambda: None)
        result, averaged = averager.finish(StepHandle(never, time.perf_counter(), time.perf_counter() + 0.2))
        assert averaged is None and "unresponsive" in result.error
        assert not averager.healthy and averager.averager.is_alive()
        old = averager.averager
        averager.restart(TENSORS)
        assert averager.healthy and not old.is_alive(), (
            "the old process is ended, not left beside the new one"
        )
        with pytest.raises(ValueError, match="same tensors"):
            averager.restart({"v": torch.zeros(1000)})
    finally:
        averager.shutdown()


def _never_within(timeout: float):
    """A step control's `result` when the outcome never comes: it times out (as `concurrent.futures` does)."""
    time.sleep(timeout)
    raise TimeoutError


@pytest.mark.swarm
@pytest.mark.timeout(300)
def test_a_part_for_a_group_we_are_not_in_is_refused_while_we_look_for_one(dhts):
    """A member that gave up on its leader's group (its wait for the leader's answer ran out as the leader began)
    goes on looking for a group. hivemind's averager held the parts that group's members sent it, with no timeout,
    until it registered a group of its own, and the members' all-reduce waited on it. Here a stranger, built from
    hivemind's API, sends a part for a group that never formed to an averager that is looking for a group: it is
    refused while the averager is still looking."""
    prefix = "test_unknown_group"
    averager = GroupAverager(
        dhts[0],
        prefix,
        TENSORS,
        compression="fp16",
        matchmaking_time=30.0,
        allreduce_timeout=60.0,
        client_mode=False,
    )

    async def send_a_part() -> int:
        p2p = await P2P.create(initial_peers=[str(m) for m in dhts[0].get_visible_maddrs()])
        try:
            stub = RobustAverager.get_stub(p2p, dhts[0].peer_id, namespace=prefix)
            part = averaging_pb2.AveragingData(
                code=averaging_pb2.PART_FOR_AVERAGING, group_id=b"a group never formed"
            )
            stream = await stub.rpc_aggregate_part(as_aiter(part))
            return (await asyncio.wait_for(anext(stream), 20)).code
        finally:
            await p2p.shutdown()

    try:
        handle = averager.step({"w": torch.ones(1000)}, 1.0, (0, 0, 1))
        wait_for(lambda: handle.control.stage == AveragingStage.LOOKING_FOR_GROUP, 60, "the averager to look")
        code = asyncio.run(send_a_part())
        assert code == averaging_pb2.BAD_GROUP_ID, averaging_pb2.MessageCode.Name(code)
        assert handle.control.stage == AveragingStage.LOOKING_FOR_GROUP and not handle.control.done()
    finally:
        averager.shutdown()
