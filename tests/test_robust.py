"""What one peer can do to an all-reduce it is part of: its weight is bounded, failed parts are counted, and a
banned peer is refused as a leader too (pure, no network)."""

import asyncio
import inspect

import torch
from hivemind.averaging.partition import TensorPartContainer
from hivemind.p2p import PeerID

from spes_node.swarm.robust import BanAwareMatchmaking, CheckedPartContainer, RobustPolicy, robust_mean


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

    class Recording(BanAwareMatchmaking):
        def __init__(self):  # no p2p: only the join decision is exercised
            self.banned = frozenset({banned})

    async def parent(self, leader):
        asked.append(leader)
        return "group"

    matchmaking = Recording()
    original = BanAwareMatchmaking.__mro__[1]._request_join_group
    BanAwareMatchmaking.__mro__[1]._request_join_group = parent
    try:
        assert asyncio.run(matchmaking._request_join_group(banned)) is None
        assert asyncio.run(matchmaking._request_join_group(other)) == "group"
    finally:
        BanAwareMatchmaking.__mro__[1]._request_join_group = original
    assert asked == [other]


def test_robust_averagers_use_the_ban_aware_matchmaking():
    # hivemind builds the matchmaking from a module-level name, which RobustAverager.run replaces in its process:
    # this fails if an upgrade of hivemind stops looking the name up there
    import hivemind.averaging.averager as averager_module

    assert issubclass(BanAwareMatchmaking, averager_module.Matchmaking)
    assert "self._matchmaking = Matchmaking(" in inspect.getsource(averager_module.DecentralizedAverager)
