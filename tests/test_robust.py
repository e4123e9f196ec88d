"""What one peer can do to an all-reduce it is part of: its weight is bounded, failed parts are counted, and a
banned peer is refused as a leader too (pure, no network)."""

import asyncio
import inspect

import pytest
import torch
from hivemind.averaging.matchmaking import Matchmaking
from hivemind.averaging.partition import TensorPartContainer
from hivemind.p2p import PeerID

from spes_node.swarm.averaging import MAX_WORK_RATIO
from spes_node.swarm.robust import (
    CheckedPartContainer,
    RobustPolicy,
    SpesMatchmaking,
    check_result,
    part_floor,
    robust_mean,
    update_rms,
)


def test_a_claimed_weight_counts_no_more_than_one_round_of_training():
    honest, attacker = torch.ones(16), torch.full((16,), 1.5)  # within the distance bound: not rejected
    round_tokens = 1000.0

    def attacker_share(policy: RobustPolicy) -> float:
        result = robust_mean(
            [honest, attacker], [round_tokens, 1e9], honest.shape, own=0, policy=policy
        ).result
        return float((result.mean() - 1.0) / 0.5)

    # the attacker claims a billion tokens; the relative weight cap alone (2x the lower median) gave it 2/3
    assert abs(attacker_share(RobustPolicy()) - 2 / 3) < 1e-5
    assert abs(attacker_share(RobustPolicy(max_weight=round_tokens)) - 1 / 2) < 1e-5


def test_an_honest_update_trained_longer_than_ours_is_not_rejected_but_a_liars_still_is():
    """Update averaging: members train unequal amounts in a round (one trains on while it waits for a slower peer,
    a joiner only the rest of the round), and an update grows with the steps behind it. A node that trained 6 steps
    compares a peer's 20-step update with its own; the plain bound of 4 times its own norm rejected (and banned)
    that honest peer; the bound raised by the claimed work does not, and a liar's claim raises it at most
    `MAX_WORK_RATIO` times."""
    g = torch.Generator().manual_seed(0)
    direction = torch.randn(4096, generator=g)

    def update(steps: int) -> torch.Tensor:
        # Adam-like steps of about the learning rate, in a direction shared with the swarm plus one of the node's
        # own data, under a 10-step warmup (the test swarms' rounds are in it): the norm grows faster than the steps
        own = direction + torch.randn(4096, generator=g)
        return sum(0.01 * min(1.0, (t + 1) / 10) * own for t in range(steps))

    tokens_per_step, h = 1000.0, 5
    ours, longer = update(6), update(20)
    weights = [6 * tokens_per_step, 20 * tokens_per_step]
    plain = RobustPolicy(max_weight=h * tokens_per_step)
    scaled = RobustPolicy(max_weight=h * tokens_per_step, max_work_ratio=MAX_WORK_RATIO)
    assert robust_mean([ours, longer], weights, ours.shape, own=0, policy=plain).rejected.keys() == {1}
    kept = robust_mean([ours, longer], weights, ours.shape, own=0, policy=scaled)
    assert kept.rejected == {}
    # and the member that trained 6 steps accepts the average its reducer returns
    assert check_result(kept.result - ours, ours, scaled) is None
    # a liar claiming a billion tokens gains at most MAX_WORK_RATIO on the bound: 100 times our update is refused
    liar = robust_mean([ours, 100 * ours], [weights[0], 1e9], ours.shape, own=0, policy=scaled)
    assert liar.rejected.keys() == {1}
    assert check_result(200 * ours, ours, scaled) is not None
    # a joiner trains only the rest of its first round: 1 step against a peer's whole round of 100 (past warmup,
    # steps of equal size): its update counts as if scaled up to a full round, by its own tokens, not the peer's
    h = 100
    full_round = RobustPolicy(max_weight=h * tokens_per_step, max_work_ratio=MAX_WORK_RATIO)
    step = 0.01 * (direction + torch.randn(4096, generator=g))
    joiner, whole = step, sum(0.01 * (direction + torch.randn(4096, generator=g)) for _ in range(h))
    weights = [tokens_per_step, h * tokens_per_step]
    claims_only = RobustPolicy(
        max_work_ratio=MAX_WORK_RATIO
    )  # no full round known: the claim's factor, capped
    assert robust_mean([joiner, whole], weights, step.shape, own=0, policy=claims_only).rejected.keys() == {1}
    joined = robust_mean([joiner, whole], weights, step.shape, own=0, policy=full_round)
    assert joined.rejected == {}
    assert check_result(joined.result - joiner, joiner, full_round, own_weight=weights[0]) is None
    # weights mode keeps the plain bound whatever the claim
    assert robust_mean([ours, longer], [1.0, 1e9], ours.shape, own=0, policy=plain).rejected.keys() == {1}


def test_a_replica_whose_experts_saw_our_tokens_no_more_is_not_rejected_but_a_liar_still_is():
    """Update averaging: the experts in one part of a shard can see none of our tokens in a round, and AdamW then
    moves them by weight decay alone, while a replica's update there is normal. Against our part's norm alone the
    replica was 200 times too far (a swarm banned an honest replica so, in round 1); against a reference that is
    at least our whole update's size at the part's length it is not, and a liar far beyond that still is."""
    g = torch.Generator().manual_seed(3)
    size = 65_536
    common = torch.randn(2 * size, generator=g)
    ours = 1e-3 * (common + torch.randn(2 * size, generator=g))
    ours[size:] = 4e-6 * torch.randn(size, generator=g)  # the second half saw no tokens: weight decay only
    theirs = 1e-3 * (common + torch.randn(2 * size, generator=g))
    part = slice(size, 2 * size)
    policy = RobustPolicy()
    floor = part_floor(update_rms([ours]), size)
    assert 0.5 * float(ours.norm()) < floor / (0.5**0.5) < 1.5 * float(ours.norm())

    alone = robust_mean([ours[part], theirs[part]], [1.0, 1.0], torch.Size([size]), own=0, policy=policy)
    assert alone.rejected.keys() == {1}, "our part's norm alone must be what rejected the replica"
    kept = robust_mean(
        [ours[part], theirs[part]],
        [1.0, 1.0],
        torch.Size([size]),
        own=0,
        policy=policy,
        reference_floor=floor,
    )
    assert kept.rejected == {}
    torch.testing.assert_close(kept.result, (ours[part] + theirs[part]) / 2)
    # the replica, as a sender, accepts that average as our part's result; so does our side, with its floor
    assert check_result(kept.result - ours[part], ours[part], policy) is not None
    assert check_result(kept.result - ours[part], ours[part], policy, reference_floor=floor) is None
    # a liar 100 times our whole update's size is still refused, as a part and as a result
    liar = 100 * theirs[part]
    refused = robust_mean(
        [ours[part], liar], [1.0, 1.0], torch.Size([size]), own=0, policy=policy, reference_floor=floor
    )
    assert refused.rejected.keys() == {1}
    assert check_result(liar, ours[part], policy, reference_floor=floor) is not None
    # the root mean square is over all of our tensors' values, however they are split
    assert update_rms([ours[:size], ours[size:]]) == pytest.approx(update_rms([ours]), rel=1e-5)
    assert update_rms([]) == 0.0


def test_failed_reducers_are_counted():
    tensors = [torch.randn(100), torch.randn(50)]
    container = CheckedPartContainer(
        tensors,
        (0.5, 0.5),
        return_deltas=True,
        local_index=0,
        policy=RobustPolicy(),
        on_bad_result=lambda *_: None,
        part_size_bytes=64,
    )
    assert isinstance(container, TensorPartContainer)
    container.register_failed_reducer(1)
    assert container.failed_reducers == {1}
    assert container.failed_size > 0


def test_a_banned_peer_is_not_asked_to_lead_our_group():
    banned, other = PeerID(b"banned-peer-id-bytes"), PeerID(b"another-peer-id-bytes")
    asked = []

    class Recording(SpesMatchmaking):
        def __init__(self):  # no p2p: only the join decision is exercised
            self.banned = frozenset({banned})

    async def parent(self, leader):
        asked.append(leader)
        return "group"

    matchmaking = Recording()
    original = SpesMatchmaking.__mro__[1]._request_join_group
    SpesMatchmaking.__mro__[1]._request_join_group = parent
    try:
        assert asyncio.run(matchmaking._request_join_group(banned)) is None
        assert asyncio.run(matchmaking._request_join_group(other)) == "group"
    finally:
        SpesMatchmaking.__mro__[1]._request_join_group = original
    assert asked == [other]


@pytest.mark.parametrize("ended", ["assembled", "timed out", "cancelled"])
def test_a_leader_that_begins_after_our_search_ended_is_declined_without_an_error(ended):
    # hivemind asserts that our group is not assembled yet when a leader's "begin all-reduce" arrives; when the
    # search ended in the same turn of the event loop, that assertion failed in a background task (a traceback
    # in the node's log). We decline that leader instead.
    leader = PeerID(b"late-leader-peer-id-bytes")

    class Ended(SpesMatchmaking):
        def __init__(self):  # no p2p: only the follower's decision is exercised
            self.assembled_group = asyncio.get_running_loop().create_future()
            if ended == "assembled":
                self.assembled_group.set_result("our group")
            elif ended == "timed out":
                self.assembled_group.set_exception(asyncio.TimeoutError())
                self.assembled_group.exception()  # retrieved, as hivemind's search does
            else:
                self.assembled_group.cancel()

    async def decide():
        matchmaking = Ended()
        outcome = await matchmaking.follower_assemble_group(leader, msg=None)
        return outcome, matchmaking.assembled_group

    outcome, future = asyncio.run(decide())
    assert outcome is None
    assert future.cancelled() or future.exception() is not None or future.result() == "our group"

    async def hivemind_alone():
        matchmaking = Ended()
        matchmaking.lock_looking_for_group, matchmaking.lock_request_join_group = (
            asyncio.Lock(),
            asyncio.Lock(),
        )
        matchmaking.current_leader = leader
        async with matchmaking.lock_looking_for_group, matchmaking.lock_request_join_group:
            return await Matchmaking.follower_assemble_group(matchmaking, leader, None)

    with pytest.raises(AssertionError, match="^$"):  # hivemind's own `assert not self.assembled_group.done()`
        asyncio.run(hivemind_alone())


def test_robust_averagers_use_our_matchmaking():
    # hivemind builds the matchmaking from a module-level name, which RobustAverager.run replaces in its process:
    # this fails if an upgrade of hivemind stops looking the name up there
    import hivemind.averaging.averager as averager_module

    assert issubclass(SpesMatchmaking, averager_module.Matchmaking)
    assert "self._matchmaking = Matchmaking(" in inspect.getsource(averager_module.DecentralizedAverager)


def test_stopping_cancels_running_groups_where_hivemind_raised():
    """hivemind's averager shutdown calls finalize() on the futures of its running groups (AttributeError, a
    traceback in the log of a node stopped mid all-reduce); ours finalizes the runners and cancels the rest."""
    import asyncio

    from hivemind.averaging.averager import DecentralizedAverager

    from spes_node.swarm.robust import cancel_running_groups

    class Runner:
        cancelled = False

        def finalize(self, *, cancel=False):
            self.cancelled = cancel

    async def scenario():
        runner, started = Runner(), asyncio.get_running_loop().create_future()
        started.set_result(runner)
        pending = asyncio.get_running_loop().create_future()  # a group registered, its all-reduce not begun
        groups = {b"a": started, b"b": pending}
        with pytest.raises(AttributeError):  # hivemind's own shutdown, on the same groups
            bare = DecentralizedAverager.__new__(DecentralizedAverager)
            bare.client_mode, bare._running_groups = True, {b"b": pending}
            await DecentralizedAverager._shutdown(bare, timeout=1.0)
        assert cancel_running_groups(groups.values()) == 1
        return runner.cancelled, pending.cancelled()

    assert asyncio.run(scenario()) == (True, True)


def test_a_cancelled_future_nobody_read_is_not_logged_as_an_error(caplog):
    import gc
    import logging

    from spes_node.swarm.robust import quiet_cancelled

    def leave_unread(exception: BaseException, handler) -> list[logging.LogRecord]:
        async def run():
            loop = asyncio.get_running_loop()
            loop.set_exception_handler(handler)
            future = loop.create_future()
            future.set_exception(exception)
            del future  # never read: asyncio reports it when the future is collected
            gc.collect()

        caplog.clear()
        with caplog.at_level(logging.DEBUG):
            asyncio.run(run())
        return [r for r in caplog.records if r.levelno >= logging.ERROR]

    # what hivemind's averager loop logged, with a traceback, after an all-reduce cancelled part-way
    assert leave_unread(asyncio.CancelledError(), None)
    assert not leave_unread(asyncio.CancelledError(), quiet_cancelled)
    # any other exception nobody read is still an error
    assert leave_unread(RuntimeError("lost"), quiet_cancelled)
