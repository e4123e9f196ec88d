"""Frozen experts refreshed by the round's update: the holder's update chain, the receiver's choice between update
and whole shard, applying an update to a frozen copy, and two nodes that refresh each other's shard by updates."""

from __future__ import annotations

import asyncio
import json
import re
import threading

import pytest
import torch
from hivemind.compression import NoCompression
from safetensors.torch import load_file
from swarm_utils import Swarm

from spes_node.aio import LoopThread
from spes_node.config import load_preset
from spes_node.daemon.checkpoint import META_FILE, MODEL_FILE, CheckpointManager
from spes_node.daemon.frozen import LOSSY_UPDATE_CHAIN, FrozenCopies, HeldCopy, refresh_by_update
from spes_node.model.moe import MoEForCausalLM
from spes_node.model.ownership import apply_ownership, shard_tensors
from spes_node.swarm.codecs import WIRE_CODECS
from spes_node.swarm.snapshots import SnapshotPublisher, add_update, encode_update
from spes_node.swarm.transfer import Download, StateServer

# ---------------------------------------------------------------------------------------------- the chain


def _trajectory(rounds: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Weights of a holder over rounds: weights of the tiny preset's scale, each round moved by an update about
    1% of their size (as a round of local steps moves them)."""
    generator = torch.Generator().manual_seed(seed)
    weights = {"w": 0.02 * torch.randn(64, 1024, generator=generator)}
    out = [weights]
    for _ in range(rounds):
        weights = {k: v + 2e-4 * torch.randn(v.shape, generator=generator) for k, v in weights.items()}
        out.append(weights)
    return out


def _received(serialized) -> dict[str, torch.Tensor]:
    """What a receiver decodes from a served update (the codec hivemind's deserializer calls for its type)."""
    return {name: WIRE_CODECS["int8"].extract(tensor) for name, tensor in serialized.items()}


def _max_error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def _rms_error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k].float() - b[k].float()).pow(2).mean().sqrt()) for k in a)


def test_a_follower_of_the_chain_stays_within_one_rounds_rounding_however_many_rounds():
    fp16 = torch.float16
    weights = _trajectory(100)
    served = {k: v.to(fp16) for k, v in weights[0].items()}
    chain, follower = served, {k: v.float() for k, v in served.items()}  # the follower took the whole shard
    naive = dict(follower)  # updates against the exact previous weights instead of the chain
    worst, errors, naive_errors = 0.0, [], []
    for before, now in zip(weights, weights[1:]):
        served = {k: v.to(fp16) for k, v in now.items()}
        update, chain = encode_update(chain, served, fp16)
        follower = {k: add_update(follower[k], d, fp16).float() for k, d in _received(update).items()}
        assert all(torch.equal(follower[k], chain[k].float()) for k in chain), "follower and chain differ"
        worst = max(worst, _max_error(follower, now))
        errors.append(_rms_error(follower, now))
        exact_update, _ = encode_update({k: v.to(fp16) for k, v in before.items()}, served, fp16)
        naive = {k: add_update(naive[k], d, fp16).float() for k, d in _received(exact_update).items()}
        naive_errors.append(_rms_error(naive, now))
    # one round's rounding: the update's int8 step (a block's largest change / 254) plus fp16's half step at the
    # weights' largest size (0.1 here); and the error of the last rounds is that of the first, not sqrt(rounds) x
    one_round = float((weights[1]["w"] - weights[0]["w"]).abs().max()) / 254 + 2.0**-11 * 0.1
    assert worst <= 2 * one_round, (worst, one_round)
    assert max(errors[-10:]) <= 1.1 * max(errors[:10]), errors
    # what the chain is for: without it, rounding piles up over the rounds (about 2.6 x after 100 rounds here)
    assert min(naive_errors[-10:]) > 2 * max(errors[-10:]), (naive_errors[-10:], errors[-10:])


def test_an_update_travels_in_about_half_the_bytes_of_the_shard_at_fp16():
    weights = _trajectory(1)
    base = {k: v.to(torch.float16) for k, v in weights[0].items()}
    update, _ = encode_update(base, {k: v.to(torch.float16) for k, v in weights[1].items()}, torch.float16)
    nbytes = sum(len(t.buffer) for t in update.values())
    numel = sum(v.numel() for v in base.values())
    assert nbytes == numel * (1 + 4 / 1024), nbytes  # int8 per value and one fp32 scale per 1024 values


def _publisher(every: int) -> tuple[SnapshotPublisher, StateServer, LoopThread]:
    """A publisher with updates on a state server that is not on any network (publish and withdraw only)."""
    loop = LoopThread()
    server = StateServer(None, "chain", "hash", NoCompression())

    async def ready():
        server._updated = asyncio.Condition()

    loop.run(ready())
    return SnapshotPublisher(server, loop, torch.float16, updates=True, every=every), server, loop


def test_with_refresh_every_two_rounds_the_chain_steps_on_refresh_rounds_by_the_sum_of_both():
    weights = _trajectory(12)
    publisher, server, loop = _publisher(every=2)
    fp16 = torch.float16
    served_updates = {}
    try:
        follower = None
        for round_ in range(1, 12):
            restart = round_ == 7  # a merge at round 7: the chain starts again at the next refresh round
            publisher.publish(round_, {}, {0: weights[round_]}, {}, restart=restart)
            publisher.flush()  # the update is encoded on a thread of its own, then served
            update = server.snapshots.get("update:0")
            served_updates[round_] = None if update is None else update.round
            if round_ == 2:  # a follower takes the whole shard of the chain's first round
                follower = {k: v.to(fp16).float() for k, v in weights[2].items()}
            if update is not None and update.round == round_ and round_ <= 6:
                follower = {
                    k: add_update(follower[k], d, fp16).float() for k, d in _received(update.tensors).items()
                }
                # the update of round r brings a copy of round r - 2 to round r: both rounds' changes in one
                two_rounds = float((weights[round_]["w"] - weights[round_ - 2]["w"]).abs().max())
                assert _max_error(follower, weights[round_]) <= two_rounds / 127 + 2.0**-10 * 0.1
                assert _max_error(follower, weights[round_ - 1]) > two_rounds / 127 + 2.0**-10 * 0.1
    finally:
        publisher.shutdown()
        loop.stop()
    # round 1 is no refresh round: no chain; 2 starts it; 4 and 6 step it, each update served until the next;
    # the restart at 7 withdraws it, 8 starts the chain again, 10 steps it
    assert served_updates == {
        1: None,
        2: None,
        3: None,
        4: 4,
        5: 4,
        6: 6,
        7: None,
        8: None,
        9: None,
        10: 10,
        11: 10,
    }


@pytest.fixture
def held_encoder(monkeypatch):
    """(started, release): the publisher's update encoding sets `started`, then waits for `release`."""
    import spes_node.swarm.snapshots as snapshots

    started, release = threading.Event(), threading.Event()
    encode = snapshots.encode_update

    def held_encode(*args):
        started.set()
        assert release.wait(60)
        return encode(*args)

    monkeypatch.setattr(snapshots, "encode_update", held_encode)
    yield started, release
    release.set()


def test_an_update_is_encoded_after_publish_returns_and_not_served_if_its_chain_ended_meanwhile(held_encoder):
    started, release = held_encoder
    weights = _trajectory(4)
    publisher, server, loop = _publisher(every=1)
    try:
        publisher.publish(1, {}, {0: weights[1]}, {})  # the chain starts
        publisher.publish(2, {}, {0: weights[2]}, {})  # returns while round 2's update is being encoded
        assert started.wait(60)
        assert server.snapshots["shard:0"].round == 2 and "update:0" not in server.snapshots
        release.set()
        publisher.flush()
        assert server.snapshots["update:0"].round == 2
        started.clear(), release.clear()
        publisher.publish(3, {}, {0: weights[3]}, {})
        assert started.wait(60)
        publisher.publish(
            3, {}, {0: weights[3]}, {}, restart=True
        )  # a merge in round 3: the chain starts again
        release.set()
        publisher.flush()
        assert "update:0" not in server.snapshots, "an update of the ended chain would not fit the new one"
    finally:
        release.set()
        publisher.shutdown()
        loop.stop()


def test_a_publisher_shut_down_with_an_update_being_encoded_neither_waits_for_it_nor_hangs(held_encoder):
    started, release = held_encoder
    weights = _trajectory(3)
    publisher, server, loop = _publisher(every=1)
    publisher.publish(1, {}, {0: weights[1]}, {})
    publisher.publish(2, {}, {0: weights[2]}, {})
    assert started.wait(60)
    publisher.shutdown()
    loop.stop()  # the node stops its loop after the round's shutdown
    publisher.flush()  # returns: nothing more is encoded
    assert publisher._encoder.daemon, "an encoding in flight must not hold the process's exit"
    release.set()  # it finishes into a stopped loop: its publish gives up instead of waiting forever
    publisher._encoder.join(60)
    assert not publisher._encoder.is_alive()


# ---------------------------------------------------------------------------------------------- the choice


def test_a_copy_one_round_old_from_a_live_holder_is_refreshed_by_update_otherwise_whole():
    swarm = load_preset("tiny").swarm
    assert swarm.refresh_by_updates, "on by default"
    held = HeldCopy(round=6, peer="h")
    assert refresh_by_update(held, 7, ["x", "h"], swarm)
    assert not refresh_by_update(held, 8, ["h"], swarm), "two rounds behind: the whole shard"
    assert refresh_by_update(held, 6, ["h"], swarm), "of that round already: the next update, if served"
    assert not refresh_by_update(None, 7, ["h"], swarm), "a copy of no holder's state (seeded, premerge)"
    assert not refresh_by_update(held, 7, ["x"], swarm), "its holder left: another holder's chain differs"
    off = load_preset("tiny").replace(swarm={"refresh_by_updates": False}).swarm
    assert not refresh_by_update(held, 7, ["h"], off)
    lossy = load_preset("tiny").replace(swarm={"frozen_dtype": "bf16"}).swarm
    long_chain = HeldCopy(round=6, peer="h", updates=LOSSY_UPDATE_CHAIN)
    assert refresh_by_update(HeldCopy(6, "h", LOSSY_UPDATE_CHAIN - 1), 7, ["h"], lossy)
    assert not refresh_by_update(long_chain, 7, ["h"], lossy), "bf16 storage: the whole shard now and then"
    assert refresh_by_update(long_chain, 7, ["h"], swarm), "fp32 storage holds the chain exactly"


def test_with_refresh_every_two_rounds_a_copy_of_the_last_refresh_round_follows_the_update():
    swarm = load_preset("tiny").replace(swarm={"refresh_every": 2}).swarm
    assert refresh_by_update(HeldCopy(4, "h"), 6, ["h"], swarm), "of the last refresh: the update of 6"
    assert refresh_by_update(HeldCopy(6, "h"), 6, ["h"], swarm), "of this refresh already: the next update"
    assert not refresh_by_update(HeldCopy(2, "h"), 6, ["h"], swarm), "two refreshes behind: the whole shard"
    assert not refresh_by_update(HeldCopy(5, "h"), 6, ["h"], swarm), (
        "of round 5: no holder's chain steps there"
    )


def test_the_switch_is_validated():
    with pytest.raises(ValueError, match="refresh_by_updates"):
        load_preset("tiny").replace(swarm={"refresh_by_updates": "yes"})


# ---------------------------------------------------------------------------------------------- applying


@pytest.mark.parametrize("frozen_dtype", ["fp32", "bf16", "int8"])
def test_an_update_is_added_to_the_frozen_copy_only_when_it_is_the_updates_base(frozen_dtype):
    cfg = load_preset("tiny").replace(swarm={"num_shards": 2, "frozen_dtype": frozen_dtype})
    torch.manual_seed(0)
    model = MoEForCausalLM(cfg.model, cfg.swarm.num_shards)
    apply_ownership(model, [0], frozen_dtype)
    loop = LoopThread()
    frozen = FrozenCopies(cfg, model, loop, threading.Event())
    frozen.dtype = torch.float16  # snapshots served at fp16
    try:
        before = {k: v.clone() for k, v in shard_tensors(model, 1).items()}
        delta = {k: torch.full_like(v, 1e-2) for k, v in before.items()}

        def deliver(round_: int, tensors: dict) -> int:
            # as the background refresh does: the update is added to the copy held now, then applied between steps
            refresh = frozen.follow(1, frozen.held[1], Download(round_, tensors, 0, 0.0))
            if refresh is None:
                return 0
            assert all(t.dtype == torch.float16 for t in refresh.download.tensors.values()), "held at fp16"
            frozen._pending[1] = refresh
            return frozen.apply(own=[0])

        frozen.held[1] = HeldCopy(3, "h")
        assert deliver(4, delta) == 1
        after = shard_tensors(model, 1)
        step = {"fp32": 2.0**-10, "bf16": 2.0**-7, "int8": 0.1}[frozen_dtype]  # storage's rounding, relative
        for name, tensor in after.items():
            expected = before[name] + 1e-2
            assert torch.allclose(tensor, expected, atol=step * float(expected.abs().max())), name
        assert frozen.held[1] == HeldCopy(4, "h", 1)

        moved = {k: v.clone() for k, v in after.items()}
        assert deliver(6, delta) == 0, "an update of round 6 on a copy of round 4"
        huge = {k: torch.full_like(v, 1e6) for k, v in delta.items()}  # finite, but past fp16 once added
        assert deliver(5, huge) == 0
        # the copy was replaced (a catch-up took the whole shard) while its update downloaded: not applied
        pending = frozen.follow(1, frozen.held[1], Download(5, delta, 0, 0.0))
        assert pending is not None and pending.base == HeldCopy(4, "h", 1)
        frozen.held[1] = HeldCopy(5, "other")
        frozen._pending[1] = pending
        assert frozen.apply(own=[0]) == 0
        assert all(torch.equal(shard_tensors(model, 1)[k], moved[k]) for k in moved), "the copy changed"
    finally:
        loop.stop()


# ---------------------------------------------------------------------------------------------- swarm


REFRESH_LINE = re.compile(r"refresh of round (\d+): (.*)")
PART = re.compile(r"(\d+) (\w+) \((\d+) bytes\)")


def _refreshes(log: str) -> list[dict[str, tuple[int, int]]]:
    """Each refresh a node logged: part -> (shards, bytes)."""
    return [
        {part: (int(count), int(nbytes)) for count, part, nbytes in PART.findall(match[2])}
        for match in REFRESH_LINE.finditer(log)
    ]


@pytest.mark.swarm
@pytest.mark.timeout(900)
def test_two_nodes_refresh_each_others_shard_by_updates(tmp_path):
    """a holds shard 0, b shard 1 (tiny, 2 shards, a refresh every other round; no merge warm-up, whose rounds take
    whole shards): after b's first refresh of shard 0, its refreshes are updates (both rounds' changes in one) of
    about half the bytes of the whole shard, and b's frozen copy of shard 0 ends within the chain's rounding of a's
    weights of that round."""
    every = 2
    swarm = Swarm(
        tmp_path, run_id="updrefresh", num_shards=2, merge_interval=100000, averaging_timeout=30.0,
        matchmaking_time=4.0,
    )  # fmt: skip
    cfg = swarm.cfg.replace(train={"keep_checkpoints": 12}, swarm={"refresh_every": every})
    config = tmp_path / "updates.json"
    config.write_text(cfg.to_json())
    rounds = 8
    try:
        swarm.start("a", "--shard", "0", config=config)
        swarm.wait_for(lambda: "training shard 0" in swarm.log("a"), 300, "a training")
        swarm.start("b", "--shard", "1", "--max-rounds", str(rounds), config=config)
        assert swarm.wait_exit("b", 600) == 0, swarm.log("b")[-3000:]
        b = swarm.summary("b")
        swarm.wait_for(
            lambda: any(n.public_name == "a" and n.round > b["round"] for n in swarm.nodes().values()),
            120,
            "a past b's last round",
        )
        swarm.kill("a")
    finally:
        swarm.close()
    a_states = _round_end_states(cfg, tmp_path / "a", shard=0)
    saved = swarm.checkpoint("b")
    b_copy = shard_tensors(_model_of(cfg, saved.meta, saved.tensors), 0)

    refreshes = _refreshes(swarm.log("b"))
    print(f"b's refreshes of shard 0: {refreshes}")
    assert len(refreshes) >= rounds // every, refreshes
    assert all(int(m[1]) % every == 0 for m in REFRESH_LINE.finditer(swarm.log("b"))), (
        "refreshed off schedule"
    )
    # after the first, refreshes are updates; on a loaded machine one may find its holder a round further on and
    # take the whole shard instead (the fallback), never more than one
    by_update = [r for r in refreshes[1:] if set(r) == {"update"}]
    assert len(by_update) >= len(refreshes) - 2, refreshes
    update_bytes = [r["update"][1] for r in by_update]
    numel = sum(t.numel() for t in b_copy.values())
    # the whole shard travels at fp16 (2 bytes a weight), an update at 1 byte and a scale per 1024 weights
    assert max(update_bytes) < 0.55 * 2 * numel, (update_bytes, numel)
    if "shard" in refreshes[0]:
        assert max(update_bytes) < 0.55 * refreshes[0]["shard"][1], refreshes[0]
    assert "Traceback" not in swarm.log("a") + swarm.log("b")

    # b's last refresh asked for its last refresh round (a may have served a later one): the closest of a's
    # round-end states is one of those, and b's copy lies within the chain's rounding of it. That rounding is at
    # most twice (the follower's offset from its first whole download, and the last update) an int8 step of an
    # update's change, two rounds' here (its largest value / 254 per block), plus fp16's half step (2^-11 of the
    # weight): at most a round's largest change / 63 plus 2^-10 of the largest weight. We allow 2 x the first term
    # (a's checkpoint is fp32, the served state fp16) and check that a copy one round older would fail it.
    def distance(state):
        return distance_between(b_copy, state)

    best = min(a_states, key=lambda r: distance(a_states[r]))
    last_refresh = b["round"] - b["round"] % every
    assert best >= last_refresh, (best, b["round"], sorted(a_states))
    change = distance_between(a_states[best], a_states[best - 1])
    size = max(float(t.abs().max()) for t in a_states[best].values())
    tolerance = change / 32 + 2.0**-10 * size
    print(f"b's copy is {distance(a_states[best]):.3g} from a's round {best}; tolerance {tolerance:.3g}")
    assert distance(a_states[best]) <= tolerance, (distance(a_states[best]), tolerance)
    assert distance(a_states[best - 1]) > tolerance, "the tolerance cannot tell one round from the next"


def distance_between(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _model_of(cfg, meta: dict, tensors: dict[str, torch.Tensor]) -> MoEForCausalLM:
    model = MoEForCausalLM(cfg.model, cfg.swarm.num_shards)
    apply_ownership(model, meta["shards"], cfg.swarm.frozen_dtype)
    model.load_state_dict(tensors)
    return model


def _round_end_states(cfg, directory, shard: int) -> dict[int, dict[str, torch.Tensor]]:
    """Round -> a shard's weights in the node's checkpoints written at a round's end (before its next steps)."""
    states = {}
    for path in CheckpointManager(directory).list():
        meta = json.loads((path / META_FILE).read_text())["meta"]
        if meta["steps_into_round"] == 0:
            model = _model_of(cfg, meta, load_file(path / MODEL_FILE))
            states[meta["round"]] = shard_tensors(model, shard)
    return states
