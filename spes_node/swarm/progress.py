"""What a node believes about the swarm's progress: its round, and which peers to ask for state.

Records and group data come from peers that may lie. Two rules keep a single peer from steering a node:

- **The round.** A node's round moves by one per round it completes. It jumps ahead only to a round that most of
  the other live nodes it sees report (`consensus_round`): one peer's claim, however large, moves nobody while
  two honest nodes see each other, and a node that fell behind (a restart, a long pause) catches up.
- **Holders.** State is asked first from peers that proved themselves (served us or averaged with us), never
  from peers whose claimed round is ahead of the consensus, and peers that failed us go last (`rank_holders`).
- **Waits.** A round waits for a peer its record says is about to finish (`wait_for_peers`), which is what brings
  a node that fell out of step back among the others. The node trains while it waits, for as many whole steps as
  the wait holds (`another_step_fits`), and its record announces when it will sync, so that others can wait
  for it in turn. A peer that was waited for and did not come is not waited for again until it has been seen in a
  group (`no_shows`), so a record that claims a peer about to finish, round after round, holds the swarm for a few
  rounds' waits, not for good.

Pure functions of plain data, so every rule is unit-tested without a network.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Iterable, Mapping
from typing import Protocol

ROUND_SLACK = 1
"""A holder may be this many rounds ahead of the consensus (it finished its round a moment before us)."""
NO_SHOW_LIMIT = 2
"""Rounds a peer may be waited for in vain before it is no longer waited for."""


class Holder(Protocol):
    round: int
    shards: Collection[int]
    state: str


def consensus_round(other_rounds: Iterable[int]) -> int | None:
    """The highest round that more than half of the other live nodes report (at least), or None without any.

    With one other node this is its round; with two, the lower one; a single peer's claim is outvoted as soon as
    two others are seen.
    """
    rounds = sorted(other_rounds, reverse=True)
    if not rounds:
        return None
    return rounds[len(rounds) // 2]


def should_catch_up(own_round: int, other_rounds: Iterable[int], slack: int = ROUND_SLACK) -> int | None:
    """The round to catch up to when most other live nodes are ahead of `own_round` by more than `slack`, else None.

    One round apart is the normal skew of nodes finishing a round a moment apart; more means this node missed
    rounds (it was paused, restarted or cut off) and must take the swarm's weights instead of averaging its old
    ones into theirs. A node that starts from a checkpoint uses no slack.
    """
    target = consensus_round(other_rounds)
    if target is None or target <= own_round + slack:
        return None
    return target


def rank_holders(
    nodes: Mapping[str, Holder],
    *,
    shard: int | None,
    me: str,
    active_states: Collection[str],
    excluded: Collection[str] = (),
    verified: Collection[str] = (),
    failed: Mapping[str, int] | None = None,
    rng: random.Random | None = None,
) -> list[str]:
    """Peers to ask for a shard (`shard` None: anyone, for the shared parameters), best first.

    Order: peers that proved themselves before unknown ones, then fewer recent failures, then at random (so that
    load spreads). Peers whose claimed round is more than `ROUND_SLACK` ahead of the consensus of the others are
    left out: an honest holder is never that far ahead, a fake record claiming a huge round is.
    """
    failed = failed or {}
    rng = rng or random.Random()
    live = {
        peer: node
        for peer, node in nodes.items()
        if peer != me and peer not in excluded and node.state in active_states
    }
    consensus = consensus_round(node.round for node in live.values())
    ranked = []
    for peer, node in live.items():
        if shard is not None and shard not in node.shards:
            continue
        if consensus is not None and node.round > consensus + ROUND_SLACK:
            continue
        ranked.append((peer not in verified, failed.get(peer, 0), rng.random(), peer))
    return [peer for *_, peer in sorted(ranked)]


class Progress(Protocol):
    round: int
    step: int
    sync_at: float
    state: str
    tokens_per_s: float
    updated_at: float


def wait_for_peers(
    others: Mapping[str, Progress],
    *,
    round_: int,
    sync_steps: int,
    tokens_per_step: int,
    now: float,
    cap: float,
    default_tokens_per_s: float = 0.0,
) -> float:
    """Seconds to keep looking for a group beyond the matchmaking window, at most `cap`: the longest of
    `peer_etas` (the round leaves out the peers `no_shows` excuses).

    A peer of the same round that is still training is expected at the sync when its remaining steps are done
    (its step and tokens/s as its last record says, minus the record's age). Waiting for it keeps nodes in step:
    one that fell behind by a few seconds (a pause, a slow step) is met at this round, and both start the next
    one together, instead of the two missing each other round after round. A peer that reports no throughput yet
    (it has just joined) is assumed to train at `default_tokens_per_s` (ours).

    A peer still averaging the round we have just finished (it missed our group) is expected after a whole round of
    steps, counted from now: how long its averaging takes is not in its record. Waiting for it is what brings two
    nodes a round apart back into step; without it, each would average alone while the other trains, round after
    round.
    """
    etas = peer_etas(
        others,
        round_=round_,
        sync_steps=sync_steps,
        tokens_per_step=tokens_per_step,
        now=now,
        default_tokens_per_s=default_tokens_per_s,
    )
    return longest_wait(etas, cap)


def longest_wait(etas: Mapping[str, float], cap: float) -> float:
    """The longest of `etas`, between 0 and `cap`."""
    return min(max(max(etas.values(), default=0.0), 0.0), max(cap, 0.0))


def peer_etas(
    others: Mapping[str, Progress],
    *,
    round_: int,
    sync_steps: int,
    tokens_per_step: int,
    now: float,
    default_tokens_per_s: float = 0.0,
) -> dict[str, float]:
    """Seconds until each peer that is worth waiting for reaches this round's sync, as `wait_for_peers` reads
    the records; peers that are not (another round, no throughput known) are left out."""
    etas = {}
    for peer, node in others.items():
        if node.round == round_ and node.state == "training" and node.sync_at > 0:
            # when it said it would sync: it may train past step H while waiting for others
            etas[peer] = node.sync_at - now
            continue
        speed = node.tokens_per_s if node.tokens_per_s > 0 else default_tokens_per_s
        if not speed > 0:
            continue
        if node.round == round_ and node.state == "training":
            steps_left = min(max((round_ + 1) * sync_steps - node.step, 0), sync_steps)
            etas[peer] = steps_left * tokens_per_step / speed - max(0.0, now - node.updated_at)
        elif node.round == round_ - 1 and node.state == "averaging":
            etas[peer] = sync_steps * tokens_per_step / speed
    return etas


def another_step_fits(seconds_left: float, step_seconds: float) -> bool:
    """Whether one more training step of `step_seconds` ends within `seconds_left` (the time until the node's
    slowest expected peer reaches the sync): a node that reached the sync first trains while it does, instead of
    idling, and still arrives before that peer (so that the peer, which reads its record, need not wait for it
    in turn). Asked before each step, so that steps slower than expected cost one step's error, not many."""
    return seconds_left > 0 and step_seconds > 0 and step_seconds <= seconds_left


def no_shows(
    counts: Mapping[str, int], waited_for: Collection[str], joined: Collection[str]
) -> dict[str, int]:
    """After a round: how many rounds in a row each peer was waited for and did not join the group. A peer seen
    in the group starts again from zero; peers not waited for keep their count. A peer at `NO_SHOW_LIMIT` is
    excused from the next waits (`excused_peers`)."""
    counts = {peer: n for peer, n in counts.items() if peer not in joined}
    for peer in waited_for:
        if peer not in joined:
            counts[peer] = counts.get(peer, 0) + 1
    return counts


class RoundMembers:
    """The other members of a node's last round, as a node that leaves after it waits for them to end it
    (`Node.await_round_members`): the last messages of an all-reduce can still be on their way to a member when the
    node's own results are complete, and a node that stopped its networking then cut them off ("sent 10 parts, but
    we expected 11").

    A member has ended the round when its record's round is at least ours, or its record says it is leaving. A
    member with no live record has not heartbeated for a while: a node on a loaded machine stalls that long (taking
    its expired record for a departure is the likely cause of a CI run's lost last parts), a crashed node never
    comes back; it is waited for until it has been missing `absent_grace` seconds in a row."""

    def __init__(self, members: Iterable[str], round_: int, absent_grace: float):
        self.members, self.round, self.absent_grace = set(members), round_, absent_grace
        self._missing_since: dict[str, float] = {}

    def pending(self, nodes: Mapping[str, Holder], leaving: Collection[str], now: float) -> set[str]:
        """The members still awaited, from a read of the records at `now` (a monotonic clock)."""
        behind = {peer for peer in self.members if peer in nodes and nodes[peer].round < self.round}
        missing = {peer for peer in self.members if peer not in nodes and peer not in leaving}
        self._missing_since = {peer: self._missing_since.get(peer, now) for peer in missing}
        return behind | {peer for peer in missing if now - self._missing_since[peer] < self.absent_grace}


class RecentPeers:
    """Peers that a read of the node records missed although they were live a moment ago.

    A record expires three heartbeats after its last store, and a live node misses that on a loaded machine or
    behind an upload link that its own all-reduce fills (a tiny round's parts take 6 s on a 5 Mbit/s link, the test
    swarms' records 6 s to expire). A round that took the missing record for a departure left that peer out of its
    groups' expected members, and a leader whose expected members had all joined began without it: the peer, at the
    sync a second later, averaged alone. Such a peer stays expected for `grace` seconds after the last read that saw
    it (the same grace as `RoundMembers`'), unless a read says it is leaving; a peer that did crash costs its
    groups' leaders that long in full windows, instead of an early start."""

    def __init__(self, grace: float):
        self.grace = grace
        self._seen: dict[str, tuple[Holder, float]] = {}

    def update(self, nodes: Mapping[str, Holder], leaving: Collection[str], now: float) -> dict[str, Holder]:
        """Remember a read at `now` (a monotonic clock): its live records `nodes` and the peers whose record says
        they are leaving. Returns the peers this read missed that a read less than `grace` seconds ago saw, with the
        last record seen."""
        for peer in leaving:
            self._seen.pop(peer, None)
        for peer, node in nodes.items():
            self._seen[peer] = (node, now)
        self._seen = {peer: seen for peer, seen in self._seen.items() if now - seen[1] < self.grace}
        return {peer: node for peer, (node, _) in self._seen.items() if peer not in nodes}


def excused_peers(counts: Mapping[str, int]) -> set[str]:
    """Peers not to wait for: waited for in vain `NO_SHOW_LIMIT` rounds in a row."""
    return {peer for peer, n in counts.items() if n >= NO_SHOW_LIMIT}
