"""The rules that keep one peer from steering a node's round or its choice of holders (pure, no network)."""

import random
from dataclasses import dataclass, field

from spes_node.swarm.progress import (
    NO_SHOW_LIMIT,
    RecentPeers,
    RoundMembers,
    another_step_fits,
    consensus_round,
    excused_peers,
    no_shows,
    peer_etas,
    rank_holders,
    should_catch_up,
    wait_for_peers,
)

ACTIVE = ("training", "averaging")


@dataclass
class Rec:
    round: int = 0
    shards: list = field(default_factory=lambda: [0])
    state: str = "training"
    step: int = 0
    tokens_per_s: float = 0.0
    updated_at: float = 0.0
    sync_at: float = 0.0


def test_a_single_inflated_claim_moves_nobody_once_two_others_are_seen():
    honest, liar = 10, 10_000
    assert consensus_round([honest, liar]) == honest
    assert should_catch_up(10, [honest, liar]) is None
    # three rounds of +999 claims: the honest node's round still moves by one per round
    own = 10
    for claim in (1009, 2008, 3007):
        assert should_catch_up(own, [own, claim]) is None
        own += 1
    assert own == 13


def test_a_node_behind_most_of_the_swarm_catches_up():
    assert should_catch_up(3, [9, 9, 9]) == 9
    assert should_catch_up(3, [9, 9, 2]) == 9, "most others are at 9"
    assert should_catch_up(3, [9, 2, 2]) is None, "most others are not ahead"
    assert should_catch_up(8, [9, 9]) is None, "one round apart is normal skew"
    assert should_catch_up(8, [9, 9], slack=0) == 9, "a resumed node takes any lead"
    assert should_catch_up(3, []) is None


def test_a_fake_holder_claiming_a_huge_round_is_never_asked():
    nodes = {"honest": Rec(round=5), "other": Rec(round=5, shards=[1]), "fake": Rec(round=10**6)}
    ranked = rank_holders(nodes, shard=0, me="me", active_states=ACTIVE)
    assert ranked == ["honest"]


def test_verified_holders_come_first_and_failed_ones_last():
    nodes = {name: Rec(round=5) for name in ("a", "b", "c", "d")}
    for seed in range(5):
        ranked = rank_holders(
            nodes,
            shard=0,
            me="a",
            active_states=ACTIVE,
            verified={"d"},
            failed={"b": 2},
            rng=random.Random(seed),
        )
        assert ranked == ["d", "c", "b"]


def test_holders_exclude_banned_leaving_and_other_shards():
    nodes = {
        "banned": Rec(round=1),
        "leaving": Rec(round=1, state="leaving"),
        "elsewhere": Rec(round=1, shards=[2]),
        "good": Rec(round=1),
    }
    assert rank_holders(nodes, shard=0, me="me", active_states=ACTIVE, excluded={"banned"}) == ["good"]
    shared = rank_holders(nodes, shard=None, me="me", active_states=ACTIVE, excluded={"banned"})
    assert sorted(shared) == ["elsewhere", "good"]


def test_wait_for_a_peer_that_is_about_to_finish_its_round():
    # H = 10 steps of 100 tokens; the peer is 4 steps from the sync at 200 tokens/s: 2 s, its record 0.5 s old
    peer = Rec(round=3, step=36, tokens_per_s=200.0, updated_at=99.5)
    wait = wait_for_peers({"p": peer}, round_=3, sync_steps=10, tokens_per_step=100, now=100.0, cap=30.0)
    assert abs(wait - 1.5) < 1e-9
    assert (
        wait_for_peers({"p": peer}, round_=3, sync_steps=10, tokens_per_step=100, now=100.0, cap=1.0) == 1.0
    )
    # peers already at the sync, of another round, or without a throughput figure are not waited for
    for other in (
        Rec(round=3, step=36, state="averaging", tokens_per_s=200.0),
        Rec(round=4, step=46, tokens_per_s=200.0),
        Rec(round=3, step=36, tokens_per_s=0.0),
    ):
        assert (
            wait_for_peers({"p": other}, round_=3, sync_steps=10, tokens_per_step=100, now=0.0, cap=30.0) == 0
        )


def test_wait_for_a_peer_still_averaging_the_round_we_finished():
    # the peer missed our group of round 3 and is still averaging it: it is due after a whole round of steps
    # (10 steps of 100 tokens at 200 tokens/s), however old its record is
    behind = Rec(round=2, step=30, state="averaging", tokens_per_s=200.0, updated_at=90.0)
    wait = wait_for_peers({"b": behind}, round_=3, sync_steps=10, tokens_per_step=100, now=100.0, cap=30.0)
    assert abs(wait - 5.0) < 1e-9
    assert (
        wait_for_peers({"b": behind}, round_=3, sync_steps=10, tokens_per_step=100, now=100.0, cap=2.0) == 2.0
    )
    # two rounds behind, or training a round behind: not expected within the round (it will catch up instead)
    for other in (
        Rec(round=1, step=20, state="averaging", tokens_per_s=200.0, updated_at=100.0),
        Rec(round=2, step=25, tokens_per_s=200.0, updated_at=100.0),
    ):
        assert (
            wait_for_peers({"p": other}, round_=3, sync_steps=10, tokens_per_step=100, now=100.0, cap=30.0)
            == 0
        )


def test_a_peer_without_a_throughput_figure_is_assumed_as_fast_as_we_are():
    # a node that just joined reports 0 tokens/s; it is 4 steps from the sync, and we train 200 tokens/s
    joiner = Rec(round=3, step=36, tokens_per_s=0.0, updated_at=100.0)
    wait = wait_for_peers(
        {"j": joiner},
        round_=3,
        sync_steps=10,
        tokens_per_step=100,
        now=100.0,
        cap=30.0,
        default_tokens_per_s=200.0,
    )
    assert abs(wait - 2.0) < 1e-9


def test_each_peer_worth_waiting_for_has_its_own_eta():
    peers = {
        "near": Rec(round=3, step=38, tokens_per_s=200.0, updated_at=100.0),  # 2 steps: 1 s
        "far": Rec(round=3, step=32, tokens_per_s=200.0, updated_at=100.0),  # 8 steps: 4 s
        "done": Rec(round=3, step=40, state="averaging", tokens_per_s=200.0),
    }
    etas = peer_etas(peers, round_=3, sync_steps=10, tokens_per_step=100, now=100.0)
    assert etas == {"near": 1.0, "far": 4.0}
    assert wait_for_peers(peers, round_=3, sync_steps=10, tokens_per_step=100, now=100.0, cap=30.0) == 4.0


def test_a_peer_training_past_its_round_is_expected_when_its_record_says():
    # H = 10: the peer's step (47) is past the round's H steps because it trains while waiting for others; its
    # record says it syncs at 101.5: 1.5 s from now, however fast its steps and however old the record
    ahead = Rec(round=3, step=47, tokens_per_s=200.0, updated_at=97.0, sync_at=101.5)
    assert peer_etas({"a": ahead}, round_=3, sync_steps=10, tokens_per_step=100, now=100.0) == {"a": 1.5}
    # read by its step alone, it would look done (the sync at step 40 is behind it)
    by_step = Rec(round=3, step=47, tokens_per_s=200.0, updated_at=99.5)
    assert peer_etas({"a": by_step}, round_=3, sync_steps=10, tokens_per_step=100, now=100.0)["a"] < 0
    # a record may claim any time: the wait is capped (and a peer that does not come is a no-show)
    liar = Rec(round=3, step=40, tokens_per_s=200.0, updated_at=100.0, sync_at=1e12)
    assert (
        wait_for_peers({"l": liar}, round_=3, sync_steps=10, tokens_per_step=100, now=100.0, cap=30.0) == 30.0
    )
    # only a peer still training its round is expected at its sync time
    done = Rec(round=3, step=40, state="averaging", tokens_per_s=200.0, updated_at=100.0, sync_at=101.5)
    assert peer_etas({"d": done}, round_=3, sync_steps=10, tokens_per_step=100, now=100.0) == {}


def test_a_node_trains_on_while_another_step_ends_before_the_peer_it_waits_for():
    assert another_step_fits(5.0, 1.7), "then 3.3 s are left: another step fits"
    assert not another_step_fits(1.6, 1.7), "less than a step: wait in matchmaking"
    assert another_step_fits(1.7, 1.7)
    for left, step in ((0.0, 1.0), (-1.0, 1.0), (5.0, 0.0), (float("nan"), 1.0), (1.0, float("nan"))):
        assert not another_step_fits(left, step)


def test_a_peer_waited_for_in_vain_is_not_waited_for_again_until_it_is_seen():
    counts: dict[str, int] = {}
    # a record says "liar" is about to finish, round after round, and it never comes; "slow" comes late once
    counts = no_shows(counts, waited_for=["liar", "slow"], joined={"me", "slow"})
    assert counts == {"liar": 1} and not excused_peers(counts)
    counts = no_shows(counts, waited_for=["liar"], joined={"me", "slow"})
    assert counts == {"liar": 2} and excused_peers(counts) == {"liar"} and NO_SHOW_LIMIT == 2
    # excused, it is not waited for, and its count stays until it is seen in a group
    counts = no_shows(counts, waited_for=[], joined={"me", "slow"})
    assert excused_peers(counts) == {"liar"}
    counts = no_shows(counts, waited_for=[], joined={"me", "liar"})
    assert counts == {} and not excused_peers(counts)


def test_a_node_leaving_after_its_round_waits_only_for_members_that_have_not_ended_it():
    nodes = {
        "behind": Rec(round=2),
        "ended": Rec(round=3),
        "ahead": Rec(round=4),
        "stranger": Rec(round=0),
    }
    leaving = {"leaving"}
    members = ["behind", "ended", "ahead", "leaving"]
    # a member that left (its record says so) has ended the round; a node that was not in the round's groups
    # ("stranger") is never waited for, however far behind
    assert RoundMembers(members, 3, absent_grace=10).pending(nodes, leaving, now=0.0) == {"behind"}
    assert RoundMembers(members, 2, absent_grace=10).pending(nodes, leaving, now=0.0) == set()
    assert RoundMembers([], 3, absent_grace=10).pending(nodes, leaving, now=0.0) == set()


def test_a_member_whose_record_expired_is_waited_for_until_it_has_been_missing_the_grace():
    """No live record is no proof of a departure: a loaded machine's node stops heartbeating for a while (a CI run
    lost the last parts of an all-reduce to a node that took the expired record for one). Such a member is waited
    for until it has been missing `absent_grace` seconds in a row; one that comes back is behind or done again."""
    members = RoundMembers(["stalled", "crashed"], 3, absent_grace=10)
    assert members.pending({}, set(), now=100.0) == {"stalled", "crashed"}
    assert members.pending({}, set(), now=109.0) == {"stalled", "crashed"}
    # the stalled node heartbeats again, still in the round: behind; then its record expires once more
    assert members.pending({"stalled": Rec(round=2)}, set(), now=109.5) == {"stalled", "crashed"}
    assert members.pending({}, set(), now=110.0) == {"stalled"}  # crashed: missing 10 s
    assert members.pending({}, set(), now=119.0) == {"stalled"}  # missing again since 110
    assert members.pending({"stalled": Rec(round=3)}, set(), now=119.5) == set()


def test_a_peer_a_read_missed_stays_expected_for_the_grace_after_the_last_read_that_saw_it():
    """A read of the records misses a live node whose heartbeat came late (a loaded machine, an upload link full of
    its all-reduce): the round still expects it in its groups, for `grace` seconds after the last read that saw it,
    with its last record; a read saying it is leaving ends that at once."""
    recent = RecentPeers(grace=10)
    a, b, c = Rec(round=1), Rec(round=1, shards=[1]), Rec(round=1)
    assert recent.update({"a": a, "b": b, "c": c}, set(), now=100.0) == {}
    assert recent.update({"a": a}, set(), now=105.0) == {"b": b, "c": c}
    # c says it is leaving; b is seen again, newer, then missed once more: its last record is the one expected
    b2 = Rec(round=2, shards=[1])
    assert recent.update({"a": a, "b": b2}, {"c"}, now=106.0) == {}
    assert recent.update({"a": a}, set(), now=115.9) == {"b": b2}
    # missing the whole grace since the last read that saw it: a departure (a crash), no longer expected
    assert recent.update({"a": a}, set(), now=116.0) == {}
    assert recent.update({}, set(), now=117.0) == {"a": a}
    # a record that comes back is a live peer again, not a missed one
    assert recent.update({"b": b2, "a": a}, set(), now=118.0) == {}
