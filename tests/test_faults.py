"""Faults and untrusted peers on 127.0.0.1: robust aggregation, bans, swarm keys, bad records, bad peers."""

from __future__ import annotations

import asyncio
import json
import signal
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import hivemind
import pytest
import torch
from hivemind.averaging.partition import BannedException
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import P2P, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.serializer import MSGPackSerializer
from netns import HostSwarm
from swarm_utils import spes_cli

from spes_node.proto import NodeRecord
from spes_node.swarm import records
from spes_node.swarm.averaging import valid_gather
from spes_node.swarm.identity import peer_id_of
from spes_node.swarm.robust import (
    BanList,
    RobustAllReduceRunner,
    RobustAverager,
    RobustPartReducer,
    RobustPolicy,
    check_part,
    check_result,
    open_gathered,
    robust_mean,
)
from spes_node.swarm.swarm_key import SwarmKey, load_swarm_key

SHAPE = torch.Size([64, 8])
FAULTY_NODE = Path(__file__).parent / "faulty_node.py"


def _honest(n: int, seed: int = 0, spread: float = 0.01) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    base = torch.randn(SHAPE, generator=generator)
    return [base + spread * torch.randn(SHAPE, generator=generator) for _ in range(n)]


def _mean(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(parts).mean(0)


# ---------------------------------------------------------------------------------------------- robust_mean


def test_honest_groups_get_the_plain_mean():
    for n in (2, 3, 4):
        parts = _honest(n)
        aggregate = robust_mean(parts, [1.0] * n, SHAPE, own=0)
        assert not aggregate.rejected
        # centered clipping only touches peers farther than the median distance; with equal spreads the mean
        # moves by a small fraction of the honest spread at most
        assert (aggregate.result - _mean(parts)).norm() < 0.25 * (parts[1] - parts[0]).norm()
    parts = _honest(2)
    torch.testing.assert_close(robust_mean(parts, [1.0, 1.0], SHAPE, own=0).result, _mean(parts))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_part_is_dropped(value):
    parts = _honest(3)
    bad = parts[2].clone()
    bad[3, 3] = value
    aggregate = robust_mean([parts[0], parts[1], bad], [1.0] * 3, SHAPE, own=0)
    assert aggregate.rejected == {2: "non-finite values"}
    torch.testing.assert_close(aggregate.result, _mean(parts[:2]))


def test_large_finite_values_are_not_taken_for_non_finite_ones():
    assert check_part(torch.full(SHAPE, 3e38), SHAPE) is None
    assert check_part(torch.full(SHAPE, -3e38, dtype=torch.float64), SHAPE) is None
    assert check_part(torch.zeros(0), torch.Size([0])) is None


@pytest.mark.parametrize("seed", range(4))
def test_robust_mean_is_centered_clipping_as_written_out(seed):
    """The reducer's part-by-part arithmetic against the rule stated plainly, in float64: around our part c, each
    kept part x_i moves the result by its capped share of the weight times min(1, tau / |x_i - c|) (x_i - c), tau
    the median distance; a part beyond the bound is rejected, a huge weight capped."""
    generator = torch.Generator().manual_seed(seed)
    n = 3 + seed
    parts = _honest(n, seed=seed, spread=0.05 * (1 + seed))
    parts[-1] = parts[-1] + 0.5 * torch.randn(
        SHAPE, generator=generator
    )  # far, but within the bound: clipped
    weights = [float(w) for w in torch.randint(1, 5, (n,), generator=generator)]
    weights[1] = 1e6  # capped at twice the lower median
    policy = RobustPolicy()
    aggregate = robust_mean(parts, weights, SHAPE, own=0, policy=policy)
    assert not aggregate.rejected

    xs = [p.double().flatten() for p in parts]
    center = xs[0]
    distances = [float((x - center).norm()) for x in xs]
    reference = max(float(center.norm()), sorted(float(x.norm()) for x in xs)[(n - 1) // 2])
    tau = max(sorted(distances)[n // 2], policy.min_clip_ratio * reference)
    cap = policy.weight_cap * sorted(weights)[(n - 1) // 2]
    capped = [min(w, cap) for w in weights]
    expected = center.clone()
    for x, distance, w in zip(xs, distances, capped):
        if distance > 0:
            expected += w / sum(capped) * min(1.0, tau / distance) * (x - center)
    torch.testing.assert_close(aggregate.result.double().flatten(), expected, rtol=1e-5, atol=1e-6)
    assert aggregate.own_share == pytest.approx(capped[0] / sum(capped))


def test_huge_part_is_dropped_even_in_a_group_of_two():
    parts = _honest(2)
    aggregate = robust_mean([parts[0], parts[1] * 1e4], [1.0, 1.0], SHAPE, own=0)
    assert list(aggregate.rejected) == [1] and "away from ours" in aggregate.rejected[1]
    torch.testing.assert_close(aggregate.result, parts[0])


def test_wrong_shape_dtype_or_weight_is_dropped():
    parts = _honest(4)
    candidates = [parts[0], parts[1][:-1], parts[2].to(torch.int64), parts[3]]
    aggregate = robust_mean(candidates, [1.0, 1.0, 1.0, float("nan")], SHAPE, own=0)
    assert set(aggregate.rejected) == {1, 2, 3}
    assert (
        "shape" in aggregate.rejected[1]
        and "dtype" in aggregate.rejected[2]
        and "weight" in aggregate.rejected[3]
    )
    torch.testing.assert_close(aggregate.result, parts[0])


@pytest.mark.parametrize("n", [3, 4, 5])
def test_one_subtle_attacker_moves_the_result_by_at_most_the_honest_spread(n):
    honest = _honest(n - 1)
    spread = max(float((p - honest[0]).norm()) for p in honest)
    # inside the validation bound, pulling as hard as it can, and claiming a huge weight
    direction = torch.randn(SHAPE, generator=torch.Generator().manual_seed(7))
    attacker = honest[0] + 3.9 * honest[0].norm() * direction / direction.norm()
    aggregate = robust_mean([*honest, attacker], [1.0] * (n - 1) + [1e9], SHAPE, own=0)
    assert not aggregate.rejected
    assert (aggregate.result - _mean(honest)).norm() < spread
    plain = torch.stack([*honest, attacker]).mean(0)
    assert (plain - _mean(honest)).norm() > 50 * spread, "the plain mean would have been dragged far"


def test_median_center_when_our_own_part_is_unusable():
    parts = _honest(3)
    own = torch.full(SHAPE, float("nan"))
    aggregate = robust_mean([own, *parts], [1.0] * 4, SHAPE, own=0)
    assert list(aggregate.rejected) == [0]
    assert torch.isfinite(aggregate.result).all()
    assert (aggregate.result - _mean(parts)).norm() < (parts[1] - parts[0]).norm()


def test_result_check_bounds_what_a_reducer_may_return():
    local = _honest(1)[0]
    assert check_result(0.01 * torch.randn(SHAPE), local) is None
    assert check_result(torch.full(SHAPE, float("nan")), local) == "non-finite values"
    assert "moves our part" in check_result(1e4 * local, local)
    assert "shape" in check_result(torch.zeros(3), local)


def test_reducer_aggregates_robustly_and_reports_the_bad_sender():
    async def scenario():
        rejected = []
        shapes = [torch.Size([16]), torch.Size([4])]
        reducer = RobustPartReducer(
            shapes, 3, local_sender=0, policy=RobustPolicy(), on_reject=lambda s, r: rejected.append((s, r))
        )
        inputs = {
            0: [torch.ones(16), torch.ones(4)],
            1: [torch.ones(16) * 1.02, torch.ones(4) * 1.02],
            2: [torch.full((16,), float("nan")), torch.ones(4) * 1e6],
        }

        async def send(sender):
            return [await reducer.accumulate_part(sender, i, part) for i, part in enumerate(inputs[sender])]

        first, second, _ = await asyncio.gather(send(0), send(1), send(2))
        return first, second, rejected

    first, second, rejected = asyncio.run(scenario())
    assert all(torch.equal(a, b) for a, b in zip(first, second)), "every sender gets the same result"
    torch.testing.assert_close(first[0], torch.full((16,), 1.01))
    torch.testing.assert_close(first[1], torch.full((4,), 1.01))
    assert rejected[0] == (2, "non-finite values")


def test_reducer_takes_parts_ahead_and_reduces_each_once_complete():
    # a sender that is ahead sends all its parts before the others send any: they are kept, not refused, and each
    # part is reduced as soon as the last copy arrives (hivemind's reducer takes part k + 1 only after part k)
    async def scenario():
        shapes = [torch.Size([8])] * 4
        reducer = RobustPartReducer(
            shapes, 2, local_sender=0, policy=RobustPolicy(), on_reject=lambda s, r: None
        )
        ahead = [
            asyncio.ensure_future(reducer.accumulate_part(1, i, torch.full((8,), 10.2 + i))) for i in range(4)
        ]
        await asyncio.sleep(0)
        kept_before = (list(reducer.num_parts_received), reducer.current_part_index)
        results = []
        for i in range(4):
            results.append(await reducer.accumulate_part(0, i, torch.full((8,), 10.0 + i)))
            await ahead[i]
            assert not any(a.done() for a in ahead[i + 1 :]), "reduced in order, each once complete"
        return kept_before, results, await asyncio.gather(*ahead), reducer.finished.is_set()

    kept_before, results, ahead_results, finished = asyncio.run(scenario())
    assert kept_before == ([0, 4], 0), "all four parts of the sender ahead were taken in"
    for i, (mine, theirs) in enumerate(zip(results, ahead_results)):
        torch.testing.assert_close(mine, torch.full((8,), 10.1 + i))
        assert torch.equal(mine, theirs)
    assert finished


def test_a_sender_that_fails_counts_for_no_part_not_yet_reduced_even_those_it_sent():
    async def scenario():
        rejected = []
        shapes = [torch.Size([8])] * 3
        reducer = RobustPartReducer(
            shapes, 3, local_sender=0, policy=RobustPolicy(), on_reject=lambda s, r: rejected.append(s)
        )
        # sender 2 is rejected at part 0 (NaN) with parts 1 and 2 already in; like the runner, the rejection bans it
        reducer.on_reject = lambda s, r: (rejected.append(s), reducer.on_sender_failed(s))
        bad = [
            asyncio.ensure_future(reducer.accumulate_part(2, 0, torch.full((8,), float("nan")))),
            asyncio.ensure_future(reducer.accumulate_part(2, 1, torch.full((8,), 1e6))),
            asyncio.ensure_future(reducer.accumulate_part(2, 2, torch.full((8,), 5.0))),
        ]
        honest = [
            asyncio.ensure_future(reducer.accumulate_part(1, i, torch.full((8,), 1.02))) for i in range(3)
        ]
        own = [await reducer.accumulate_part(0, i, torch.ones(8)) for i in range(3)]
        return (
            own,
            await asyncio.gather(*honest),
            await asyncio.gather(*bad, return_exceptions=True),
            rejected,
        )

    own, honest, bad, rejected = asyncio.run(scenario())
    for result in own + honest:
        torch.testing.assert_close(result, torch.full((8,), 1.01))
    assert rejected == [2], "rejected once, for the part that was bad; its later parts were not used"
    assert isinstance(bad[0], torch.Tensor), (
        "it gets the result of the part it was rejected for, as in hivemind"
    )
    assert all(isinstance(b, BannedException) for b in bad[1:])


def test_a_sender_lost_mid_stream_leaves_the_parts_to_the_others():
    async def scenario():
        reducer = RobustPartReducer(
            [torch.Size([4])] * 3, 3, local_sender=0, policy=RobustPolicy(), on_reject=lambda s, r: None
        )
        lost = asyncio.ensure_future(reducer.accumulate_part(2, 0, torch.full((4,), 9.0)))
        other = [
            asyncio.ensure_future(reducer.accumulate_part(1, i, torch.full((4,), 1.02))) for i in range(3)
        ]
        await asyncio.sleep(0)
        reducer.on_sender_failed(2)  # its stream broke after one part: the runner bans it
        with pytest.raises(BannedException):
            await reducer.accumulate_part(2, 1, torch.zeros(4))
        own = [await reducer.accumulate_part(0, i, torch.ones(4)) for i in range(3)]
        return own, await asyncio.gather(*other), await asyncio.gather(lost, return_exceptions=True)

    own, other, lost = asyncio.run(scenario())
    for result in own + other:
        torch.testing.assert_close(result, torch.full((4,), 1.01))
    assert isinstance(lost[0], BannedException)


def test_the_reducer_reads_a_window_of_parts_ahead_of_its_results():
    # the runner's stream handler against a sender whose groupmate (the local sender) has not sent part 0 yet:
    # it takes `window` parts from the stream and no more until results can go back, then answers every part
    window, parts = 3, 8

    async def scenario():
        runner = object.__new__(RobustAllReduceRunner)
        runner.tensor_part_reducer = RobustPartReducer(
            [torch.Size([4])] * parts, 2, local_sender=0, policy=RobustPolicy(), on_reject=lambda s, r: None
        )
        runner.tensor_part_container = SimpleNamespace(prefetch=1)
        runner.window, runner.updates = window, False
        runner.sender_peer_ids = ["local", "remote"]
        banned = []

        async def ban(peer):
            banned.append(peer)

        runner._ban_sender = ban
        read = []

        async def stream():
            for i in range(parts):
                read.append(i)
                part = serialize_torch_tensor(torch.full((4,), 1.02 * (i + 1)))
                yield averaging_pb2.AveragingData(
                    code=averaging_pb2.PART_FOR_AVERAGING, tensor_part=part, weight=1
                )

        answers = []

        async def consume():
            async for message in runner._accumulate_parts_streaming(stream(), 1):
                answers.append(deserialize_torch_tensor(message.tensor_part))

        consumer = asyncio.ensure_future(consume())
        while runner.tensor_part_reducer.num_parts_received[1] < window:
            await asyncio.sleep(0.01)
        for _ in range(20):  # nothing more arrives while part 0 waits for the local sender
            await asyncio.sleep(0.01)
        taken, pulled = runner.tensor_part_reducer.num_parts_received[1], len(read)
        for i in range(parts):
            await runner.tensor_part_reducer.accumulate_part(0, i, torch.full((4,), i + 1.0))
        await consumer
        return taken, pulled, answers, banned

    taken, pulled, answers, banned = asyncio.run(scenario())
    assert taken == window
    # beyond the window: one part waiting for a slot, and hivemind's deserializer holding its prefetch (1) and one
    # more it has pulled from the stream
    assert pulled <= window + 3
    assert len(answers) == parts and not banned
    for i, delta in enumerate(answers):  # the average, 1.01 (i + 1), minus what was sent, 1.02 (i + 1)
        torch.testing.assert_close(delta, torch.full((4,), -0.01 * (i + 1)))


# ---------------------------------------------------------------------------------------------- small parts


def test_ban_list_expires_and_stays_bounded(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr("spes_node.swarm.robust.time.monotonic", lambda: clock[0])
    bans = BanList(seconds=10, max_peers=2)
    assert bans.ban("a", "nan") and not bans.ban("a", "nan again")
    clock[0] += 1
    bans.ban("b", "huge")
    clock[0] += 1
    bans.ban("c", "huge")
    assert bans.active() == {"b": "huge", "c": "huge"}, "the ban closest to expiry makes room"
    clock[0] += 9
    assert set(bans.active()) == {"c"}
    clock[0] += 1
    assert bans.active() == {} and "c" not in bans


def test_gathered_round_info_is_validated():
    assert valid_gather((3, 150, 5120)) and valid_gather([0, 0, 0])
    for bad in [
        None,
        (1, 2),
        (1, 2, 3, 4),
        (1, -2, 3),
        (1.5, 2, 3),
        (True, 2, 3),
        ("1", 2, 3),
        (1 << 70, 2, 3),
    ]:
        assert not valid_gather(bad), bad


def test_gathered_entries_need_a_known_mode_and_the_members_own_tag():
    key, prefix = SwarmKey.from_text("k" * 32), "run_shared"

    def entry(mode=0, tag_of=b"peer-a", key_=key, user=None):
        tag = key_.join_tag(prefix, tag_of)
        user = MSGPackSerializer.dumps([(1, 2, 3), tag]) if user is None else user
        return MSGPackSerializer.dumps([None, mode, user])

    assert open_gathered(entry(), b"peer-a", prefix, key) == (0, (1, 2, 3))
    assert open_gathered(entry(tag_of=b"x"), b"peer-a", prefix, None) == (0, (1, 2, 3)), "open swarm: no tag"
    for bad, reason in [
        (entry(tag_of=b"peer-b"), "tag"),
        (entry(key_=SwarmKey.from_text("x" * 32)), "tag"),
        (entry(mode=2), "mode"),
        (entry(user=b"\xc1"), "malformed"),
        (b"\x93\x01", "malformed"),
        (MSGPackSerializer.dumps({"a": 1}), "malformed"),
    ]:
        with pytest.raises(ValueError, match=reason):
            open_gathered(bad, b"peer-a", prefix, key)


def test_swarm_key_tags_and_flags(tmp_path):
    key, other = SwarmKey.from_text("k" * 32), SwarmKey.from_text("x" * 32)
    tag = key.join_tag("run_shared", b"peer-a")
    assert key.check_join_tag("run_shared", b"peer-a", tag)
    assert not key.check_join_tag("run_shared", b"peer-b", tag), "a tag is bound to its peer id"
    assert not key.check_join_tag("run_shard0", b"peer-a", tag), "and to its group"
    assert not other.check_join_tag("run_shared", b"peer-a", tag)
    assert not key.check_join_tag("run_shared", b"peer-a", None)
    assert "k" * 16 not in repr(key) and key.fingerprint in repr(key)
    assert len(SwarmKey.generate()) == 64
    path = tmp_path / "key"
    path.write_text("k" * 32 + "\n")
    assert load_swarm_key(None, str(path)).fingerprint == key.fingerprint
    assert load_swarm_key(None, None) is None
    with pytest.raises(ValueError, match="--swarm-key: a swarm key must be at least 16"):
        load_swarm_key("short", None)
    with pytest.raises(ValueError, match="not both"):
        load_swarm_key("k" * 32, str(path))
    with pytest.raises(ValueError, match="--swarm-key-file: cannot read"):
        load_swarm_key(None, str(tmp_path / "missing"))


# ---------------------------------------------------------------------------------------------- real swarms

HEARTBEAT = {"heartbeat_s": 5.0}
"""Records live 3 heartbeats; 1 s (the swarm tests' default), and at times 2 s, lets them lapse on a loaded 2-core
machine, and these tests read the records once where they expect every live node in them."""


@pytest.fixture
def host_swarm(tmp_path):
    made: list[HostSwarm] = []

    def make(**overrides) -> HostSwarm:
        made.append(HostSwarm(tmp_path, **{**HEARTBEAT, **overrides}))
        return made[-1]

    yield make
    for swarm in made:
        swarm.close()


def _by_name(swarm: HostSwarm) -> dict[str, records.NodeInfo]:
    return {n.public_name: n for n in swarm.nodes().values()}


def _round(swarm: HostSwarm, name: str) -> int:
    node = _by_name(swarm).get(name)
    return node.round if node is not None else -1


def _flat(tensors: dict[str, torch.Tensor], part: str = "all") -> torch.Tensor:
    """All tensors, or only the shared ones (everything but experts), as one vector."""
    names = sorted(k for k in tensors if part == "all" or ".mlp.shards." not in k)
    return torch.cat([tensors[k].float().flatten() for k in names])


@pytest.mark.swarm
@pytest.mark.parametrize("fault", ["huge"])
def test_bad_peer_cannot_drag_honest_weights_and_is_ignored_afterwards(host_swarm, fault):
    swarm = host_swarm(num_shards=2)
    honest = ["h0", "h1", "h2"]
    for name in honest:
        swarm.start(name, "--max-rounds", "4", "--wait-peers", "4")
    swarm.start("bad", "--wait-peers", "4", program=(str(FAULTY_NODE), fault))
    swarm.expected_deaths.add("bad")
    for name in honest:
        assert swarm.wait_exit(name, 300) == 0, swarm.log(name)[-3000:]
    bad_id = peer_id_of(swarm.tmp / "bad" / "identity.key").to_base58()

    # every honest node bans it once they meet; under load matchmaking may split the swarm into pairs, and a node
    # may first meet the bad peer in its last round: what follows a ban is checked on the nodes that have rounds
    # after theirs, and there must be some
    rounds_after_a_ban = 0
    for name in honest:
        assert f"ignoring peer {bad_id}" in swarm.log(name), swarm.log(name)[-3000:]
        rounds = swarm.summary(name)["rounds"]
        bans = [i for i, r in enumerate(rounds) if bad_id in r["banned"]]
        assert bans, (name, rounds)
        after = rounds[bans[0] + 1 :]
        assert all(bad_id in r["banned"] and r["shared_group"] <= 3 for r in after), (name, rounds)
        rounds_after_a_ban += len(after)
    assert rounds_after_a_ban >= 2, "no rounds after the bans to check"

    states = {name: swarm.checkpoint(name).tensors for name in honest}
    assert all(torch.isfinite(t).all() for state in states.values() for t in state.values())
    # the fault is 1e4 times the weights; honest nodes end a few local steps apart: the shared parameters are
    # averaged by all of them every round, experts only by a shard's replicas (the bad peer's partner trains
    # its shard alone once the bad peer is banned) and refreshed as frozen copies a round late
    for part, bound in (("shared", 0.1), ("all", 0.25)):
        flat = {name: _flat(state, part) for name, state in states.items()}
        average = torch.stack(list(flat.values())).mean(0)
        distances = {name: float((w - average).norm() / average.norm()) for name, w in flat.items()}
        print(f"\n{part} weights, distance to the honest average relative to its norm: {distances}")
        assert max(distances.values()) < bound, (part, distances)


@pytest.mark.swarm
def test_crashed_node_restarts_with_its_identity_and_shard(host_swarm):
    # a matchmaking window of 5 s (the default; 2 s elsewhere in the tests): the restarted node reaches its first
    # averaging at any point of the survivor's round
    swarm = host_swarm(num_shards=2, matchmaking_time=5.0)
    swarm.start("a", "--wait-peers", "2")
    swarm.start("b", "--wait-peers", "2")
    before = swarm.wait_for(
        lambda: (n := _by_name(swarm).get("b")) is not None and n.round >= 2 and n, 240, "b at round 2"
    )
    swarm.crash("b")
    saved = swarm.checkpoint("b")
    # checkpoints are written after every round (and every checkpoint_every steps)
    assert saved.step >= before.step - swarm.cfg.swarm.sync_steps

    # three rounds: a round that began while b was down, or whose refresh waited on b's old address, can pass
    # without b on a loaded machine; they meet in one of the next
    swarm.start("b-again", "--max-rounds", "3", node_dir="b")
    assert swarm.wait_exit("b-again", 240) == 0, swarm.log("b-again")[-3000:]
    log = swarm.log("b-again")
    assert f"resumed from {saved.path.name}: round {saved.meta['round']}, step {saved.step}" in log, log[
        -3000:
    ]
    summary = swarm.summary("b")
    assert summary["peer_id"] == before.peer_id and summary["shard"] == before.shards[0]
    assert summary["rounds_done"] == 3 and summary["step"] >= saved.step + 3 * swarm.cfg.swarm.sync_steps
    rejoined = [r for r in summary["rounds"] if r["shared_group"] == 2]
    assert rejoined, ("it averages with a again", summary["rounds"])


async def _store_raw(
    _dht, node, *, key: str, subkey: bytes, value: bytes, expiration_time: float, padding: int = 0
) -> bool:
    # runs inside the DHT process, where the padding is added: the command pipe cannot carry a value that large
    return await node.store(key, value + b"\x00" * padding, expiration_time, subkey=subkey)


@pytest.mark.swarm
def test_malformed_unsigned_and_oversized_records_are_ignored(host_swarm):
    swarm = host_swarm(num_shards=2)
    for name in ("a", "b"):
        swarm.start(name, "--wait-peers", "2")
    swarm.wait_for(lambda: min(_round(swarm, n) for n in ("a", "b")) >= 1, 240, "round 1")

    validator = RSASignatureValidator(RSAPrivateKey())
    vandal = hivemind.DHT(
        initial_peers=[swarm.maddr],
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        record_validators=[validator],
        start=True,
    )
    try:
        victim_id = next(iter(swarm.nodes()))
        key, expiration = records.node_key(swarm.run_id), get_dht_time() + 300
        # each bad record under its own subkey (a subkey keeps one value): fake peer ids, signed by the vandal
        fake = [vandal.peer_id.to_base58() + letter for letter in "ABCDEF"]
        bad_records = {
            "garbage": (fake[0], True, b"\xff\x00 not a protobuf", 0),
            "unsigned": (fake[1], False, NodeRecord(peer_id=fake[1], shards=[0]).SerializeToString(), 0),
            "out of range": (fake[2], True, NodeRecord(peer_id=fake[2], shards=[999]).SerializeToString(), 0),
            "not finite": (fake[3], True, NodeRecord(peer_id=fake[3], shards=[0], loss=float("nan")).SerializeToString(), 0),
            "impostor": (fake[4], True, NodeRecord(peer_id=victim_id, shards=[1]).SerializeToString(), 0),
            # the victim's own peer id in the subkey, a newer heartbeat: only the signing key gives it away
            "usurper": (victim_id, True, NodeRecord(peer_id=victim_id, shards=[1], public_name="usurper",
                                                    updated_at=get_dht_time() + 3600).SerializeToString(), 0),
            "oversized": (fake[5], True, NodeRecord(peer_id=fake[5], shards=[0]).SerializeToString(), records.MAX_VALUE_BYTES),
        }  # fmt: skip
        for what, (prefix, sign, value, padding) in bad_records.items():
            subkey = prefix.encode() + (validator.local_public_key if sign else b"")
            store = partial(
                _store_raw, key=key, subkey=subkey, value=value, expiration_time=expiration, padding=padding
            )
            assert vandal.run_coroutine(store), what
        store = partial(
            _store_raw,
            key=records.config_key(swarm.run_id),
            subkey=validator.local_public_key,
            value=b"\x01\x02 not a config",
            expiration_time=expiration,
        )
        assert vandal.run_coroutine(store)
        swarm.wait_for(
            lambda: (
                (found := swarm.bootstrap.get(key, latest=True)) and len(found.value) >= 2 + len(bad_records)
            ),
            60,
            "the bad records to reach the bootstrap",
        )
        readable = records.fetch_nodes(swarm.bootstrap, swarm.run_id, swarm.cfg.swarm.num_shards)
        assert sorted(n.public_name for n in readable.values()) == ["a", "b"], (
            "the impostor did not replace a"
        )

        at_injection = max(_round(swarm, n) for n in ("a", "b"))
        swarm.wait_for(
            lambda: min(_round(swarm, n) for n in ("a", "b")) >= at_injection + 2, 240, "two more rounds"
        )
        status = spes_cli("status", "--peers", swarm.maddr, "--run-id", swarm.run_id, "--json", timeout=180)
    finally:
        vandal.shutdown()
    assert status.returncode == 0, status.stderr[-3000:]
    assert "Traceback" not in status.stderr
    listed = {n["peer_id"]: n["public_name"] for n in json.loads(status.stdout)["nodes"]}
    strangers = set(listed) - set(readable)
    assert sorted(listed[p] for p in readable) == ["a", "b"]
    assert not strangers, strangers
    for name in ("a", "b"):
        log = swarm.log(name)
        assert "Ignoring node record" in log and "Traceback" not in log, log[-3000:]


@pytest.mark.swarm
def test_peer_without_the_swarm_key_is_refused(host_swarm):
    key = SwarmKey.generate()
    swarm = host_swarm(num_shards=2, swarm_key=key)
    for name in ("a", "b"):
        swarm.start(name, "--wait-peers", "2")
    swarm.wait_for(lambda: min(_round(swarm, n) for n in ("a", "b")) >= 1, 240, "round 1")

    # a node without the key, or with another key, cannot even reach the swarm's DHT
    wrong = SwarmKey.generate()
    swarm.start("keyless", "--max-rounds", "1", key=False)
    swarm.start("wrong-key", "--max-rounds", "1", "--swarm-key", wrong, key=False)
    swarm.expected_deaths |= {"keyless", "wrong-key"}
    for name in ("keyless", "wrong-key"):
        assert swarm.wait_exit(name, 180) == 2, swarm.log(name)[-3000:]
        log = swarm.log(name)
        assert "cannot start or reach the DHT" in log and "Traceback" not in log, log[-3000:]

    # a stranger's DHT peer reads nothing, and nothing it writes reaches a keyed reader
    for authorizer in (None, SwarmKey.from_text(wrong).authorizer()):
        validator = RSASignatureValidator(RSAPrivateKey())
        stranger = hivemind.DHT(
            initial_peers=[swarm.maddr],
            host_maddrs=["/ip4/127.0.0.1/tcp/0"],
            record_validators=[validator],
            authorizer=authorizer,
            ensure_bootstrap_success=False,
            start=True,
        )
        try:
            assert records.fetch_nodes(stranger, swarm.run_id) == {}
            assert records.fetch_config(stranger, swarm.run_id) is None
            info = records.NodeInfo(peer_id=stranger.peer_id.to_base58(), shards=[0], state="training")
            records.publish_node(stranger, swarm.run_id, info, validator, expiration_s=300)
            assert info.peer_id not in swarm.nodes()
        finally:
            stranger.shutdown()

    # a stranger who learned a node's address, peer id and group names is refused by its averager
    node = swarm.wait_for(lambda: _by_name(swarm).get("a"), 60, "a's record")
    prefix = f"{swarm.run_id}_{swarm.cfg.hash()[:16]}_shared"
    codes = asyncio.run(_join_requests(node, prefix, [wrong, key]))
    assert codes[0] == averaging_pb2.PROTOCOL_VIOLATION
    assert codes[1] != averaging_pb2.PROTOCOL_VIOLATION, "with the key, the same request passes the key check"

    # ... and by its state server: weights go only to a requester that proves it holds the key
    outcomes = asyncio.run(_state_downloads(node, swarm, [None, wrong, key]))
    assert outcomes[0].startswith("refused") and outcomes[1].startswith("refused"), outcomes
    assert outcomes[2] == "ok", outcomes

    # status reads the private swarm with the key, and finds nothing without it
    args = ("status", "--peers", swarm.maddr, "--run-id", swarm.run_id, "--json", "--timeout", "20")
    done = spes_cli(*args, "--swarm-key-file", str(swarm.key_file))
    assert done.returncode == 0, done.stderr[-2000:]
    assert {"a", "b"} <= {n["public_name"] for n in json.loads(done.stdout)["nodes"]}
    keyless = spes_cli(*args)
    assert keyless.returncode != 0 and "Traceback" not in keyless.stderr, keyless.stderr[-2000:]

    at = max(_round(swarm, n) for n in ("a", "b"))
    swarm.wait_for(lambda: min(_round(swarm, n) for n in ("a", "b")) >= at + 1, 240, "another round")
    for name in ("a", "b"):
        swarm.procs[name].send_signal(signal.SIGTERM)
        assert swarm.wait_exit(name, 120) == 0, swarm.log(name)[-3000:]
        assert max(r["shared_group"] for r in swarm.summary(name)["rounds"]) == 2


async def _state_downloads(node: records.NodeInfo, swarm: HostSwarm, keys: list[str | None]) -> list[str]:
    """For each key (None: no key), the outcome of downloading `node`'s shared weights from an outside peer."""
    from spes_node.model.moe import MoEForCausalLM
    from spes_node.model.ownership import shared_parameters
    from spes_node.swarm.transfer import TransferError, download_part

    with torch.device("meta"):
        model = MoEForCausalLM(swarm.cfg.model, swarm.cfg.swarm.num_shards)
    expected = {k: v.shape for k, v in shared_parameters(model).items()}
    p2p = await P2P.create(initial_peers=node.maddrs)
    outcomes = []
    try:
        for text in keys:
            try:
                await download_part(
                    p2p, PeerID.from_base58(node.peer_id), swarm.run_id, swarm.cfg.hash(), "shared", expected,
                    timeout=30, swarm_key=SwarmKey.from_text(text) if text else None,
                )  # fmt: skip
                outcomes.append("ok")
            except TransferError as e:
                outcomes.append(f"refused: {e}")
        return outcomes
    finally:
        await p2p.shutdown()


async def _join_requests(node: records.NodeInfo, prefix: str, keys: list[str]) -> list[int]:
    """Codes of one `rpc_join_group` per key, sent straight to `node`'s averager from an outside peer."""
    p2p = await P2P.create(initial_peers=node.maddrs)
    try:
        codes = []
        for text in keys:
            tag = SwarmKey.from_text(text).join_tag(prefix, p2p.peer_id.to_bytes())
            gather = MSGPackSerializer.dumps([None, 0, MSGPackSerializer.dumps([(0, 0, 0), tag])])
            request = averaging_pb2.JoinRequest(
                schema_hash=b"any", expiration=get_dht_time() + 10, gather=gather, group_key=f"{prefix}.0b"
            )
            stub = RobustAverager.get_stub(p2p, PeerID.from_base58(node.peer_id), namespace=prefix)
            stream = await stub.rpc_join_group(request)
            codes.append((await anext(stream)).code)
        return codes
    finally:
        await p2p.shutdown()
