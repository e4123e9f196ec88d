"""Real swarms on 127.0.0.1: daemons as processes, a bootstrap DHT, hivemind averaging for real (tiny preset)."""

from __future__ import annotations

import signal
import socket
from pathlib import Path

import pytest
import torch
from hivemind.utils import get_dht_time
from swarm_utils import STREAM_CUT, Swarm, running, stream_cut_rounds, wait_for

from spes_node.procs import descendants
from spes_node.swarm.bootstrap import start_bootstrap
from spes_node.swarm.identity import load_or_create_identity, peer_id_of

pytestmark = pytest.mark.swarm

SWARM_TEST = {"averaging_timeout": 20.0}


@pytest.fixture
def swarm_factory(tmp_path):
    made = []

    def make(directory: Path | None = None, **kwargs) -> Swarm:
        made.append(Swarm(directory or tmp_path, **{**SWARM_TEST, **kwargs}))
        return made[-1]

    yield make
    for swarm in made:
        swarm.close()


def _shard_tensors(tensors: dict, shard: int) -> dict:
    return {k: v.float() for k, v in tensors.items() if f".mlp.shards.{shard}." in k}


def _shared_tensors(tensors: dict) -> dict:
    return {k: v.float() for k, v in tensors.items() if ".mlp.shards." not in k}


def _assert_close(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys() and a, what
    for name in a:
        # fp16 on the wire: each peer keeps its own part of the butterfly exact and gets the rest in fp16
        torch.testing.assert_close(
            a[name], b[name], rtol=2e-3, atol=2e-4, msg=lambda m, n=name: f"{what}: {n}: {m}"
        )


def test_four_nodes_two_replicas_agree_after_rounds(swarm_factory, tmp_path):
    # H = 5 and merge_interval = 10: the merge warm-up runs at round 2, round 3 is a plain round whose refresh
    # brings every frozen copy up to date. The weights agree only if the last round had everyone in it: a
    # matchmaking window of 6 s (instead of 2) lets a node that a loaded machine slowed down still make it.
    names = [f"n{i}" for i in range(4)]
    for attempt in range(2):
        attempt_dir = tmp_path / f"attempt{attempt}"
        attempt_dir.mkdir()
        swarm = swarm_factory(attempt_dir, num_shards=2, merge_interval=10, matchmaking_time=6.0)
        for name in names:
            swarm.start(name, "--max-rounds", "3", "--wait-peers", "4")
        for name in names:
            assert swarm.wait_exit(name, 240) == 0, swarm.log(name)[-3000:]
        summaries = {name: swarm.summary(name) for name in names}
        # A reducer that fails mid all-reduce leaves its part of the vector at each member's local values: the
        # round says so (`failed_parts`), and the replicas legitimately differ there until the next round. A node
        # that a loaded machine held past the last round's matchmaking window averaged alone, and says so too
        # (its group sizes). Each was seen about once in tens of loaded runs; such a run proves nothing about
        # agreement, so it is run once more. Nothing else leads to a second run, and every check below applies to
        # the run that is kept.
        final = {name: s["rounds"][-1] for name, s in summaries.items()}
        dirty = {
            name: (r.get("failed_parts", 0), r["shared_group"], r["shard_group"]) for name, r in final.items()
        }
        if all(d == (0, 4, 2) for d in dirty.values()) or attempt == 1:
            break
        print(f"last round (failed parts, shared group, shard group) {dirty}: running the swarm once more")
    assert all(d[0] == 0 for d in dirty.values()), f"failed parts in the last round of two runs: {dirty}"

    by_shard: dict[int, list[str]] = {}
    for name, s in summaries.items():
        by_shard.setdefault(s["shard"], []).append(name)
    assert sorted(len(v) for v in by_shard.values()) == [2, 2], by_shard
    for name, s in summaries.items():
        assert s["rounds_done"] == 3
        last = s["rounds"][-1]
        assert last["shared_group"] == 4 and last["shard_group"] == 2, (name, s["rounds"])

    checkpoints = {name: swarm.checkpoint(name) for name in names}
    # nodes that started together first took the same data part (0 of 1) and settled before the first step:
    # indices 0-3, whatever the shard (num_parts grows back as the others leave at the end)
    parts = {name: tuple(c.meta["data_part"]) for name, c in checkpoints.items()}
    assert sorted(part for part, _ in parts.values()) == [0, 1, 2, 3], parts
    states = {name: c.tensors for name, c in checkpoints.items()}
    reference = _shared_tensors(states[names[0]])
    for name in names[1:]:
        _assert_close(_shared_tensors(states[name]), reference, f"shared parameters of {name} vs {names[0]}")
    for shard, holders in by_shard.items():
        _assert_close(
            _shard_tensors(states[holders[0]], shard),
            _shard_tensors(states[holders[1]], shard),
            f"shard {shard} at its replicas {holders}",
        )
        other = by_shard[1 - shard][0]
        _assert_close(
            _shard_tensors(states[other], shard),
            _shard_tensors(states[holders[0]], shard),
            f"frozen copy of shard {shard} at {other} vs its holder {holders[0]}",
        )
    assert all("merged" in swarm.log(name) for name in names), "merge warm-up was due at round 2"


def test_rounds_begin_once_every_live_holder_is_in_not_at_the_end_of_the_window(swarm_factory):
    # a matchmaking window of 10 minutes: a round that waited it out would time this test out. Each node's groups
    # (the shared parameters, and the one shard both hold) expect the other node, which the records name, and begin
    # as soon as it has joined
    window = 600.0
    swarm = swarm_factory(num_shards=1, matchmaking_time=window)
    for rounds in _two_holders_three_rounds(swarm, ("a", "b")).values():
        # hivemind's all-reduce may lose a stream mid-part on a loaded machine ("sent k parts, but we expected n",
        # seen once in the full suite beside two busy loops): the round then still ends at once, which is what this
        # test is about. Allowed in one round of three; any other error fails it
        cut = stream_cut_rounds(rounds)
        assert len(cut) <= 1, (cut, swarm.warnings(("a", "b")))
        for report in rounds:
            # with an error, both nodes' warnings: a sender only learns "sent k parts, but we expected n"
            assert report["seconds"] < window, report
            assert report in cut or not report["errors"], (report, swarm.warnings(("a", "b")))
            # where the round's time went: every phase timed, together the round
            phases = report["phases"]
            assert set(phases) == {"matchmaking", "allreduce", "after"}, report
            assert phases["allreduce"] > 0 and phases["matchmaking"] < window, report
            assert sum(phases.values()) == pytest.approx(report["seconds"], abs=1e-3), report


def test_late_joiner_starts_from_swarm_weights(swarm_factory):
    swarm = swarm_factory(num_shards=2)
    for name in ("a", "b"):
        swarm.start(name, "--wait-peers", "2")
    swarm.wait_for(lambda: min((n.round for n in swarm.nodes().values()), default=0) >= 3, 180, "round 3")
    swarm.start("late", "--max-rounds", "1")
    assert swarm.wait_exit("late", 180) == 0, swarm.log("late")[-3000:]
    for name in ("a", "b"):
        swarm.procs[name].send_signal(signal.SIGTERM)
        assert swarm.wait_exit(name, 60) == 0, swarm.log(name)[-3000:]

    late = swarm.summary("late")
    fresh_loss = swarm.summary("a")["first_loss"]
    swarm_loss = min(swarm.summary(name)["loss_history"][2] for name in ("a", "b"))
    assert "downloaded the swarm state" in swarm.log("late")
    assert late["first_loss"] < fresh_loss - 1.0, (late["first_loss"], fresh_loss)
    # round means against round means: one step's loss (one batch of another data part) was 3.0-3.25 in runs,
    # against the swarm's round-3 means of 2.8-3.3, and once above their lowest + 0.5. A fresh node's first
    # round averages 4.9
    late_round = late["loss_history"][0]
    assert late_round < swarm_loss + 0.5, (late_round, swarm_loss)
    assert late["round"] >= 4


def test_config_mismatch_refused_and_sigterm_leaves_cleanly(swarm_factory, tmp_path):
    # heartbeat records live 3 heartbeats (60 s): the founder's is gone long before that only if it was withdrawn
    swarm = swarm_factory(heartbeat_s=20.0)
    swarm.start("founder")
    swarm.wait_for(
        lambda: any(n.state == "training" for n in swarm.nodes().values()), 120, "founder training"
    )

    other = tmp_path / "other.json"
    other.write_text(swarm.cfg.replace(swarm={"sync_steps": 7}).to_json())
    proc = swarm.start("stranger", config=other)
    swarm.expected_deaths.add("stranger")
    assert swarm.wait_exit("stranger", 120) != 0
    output = swarm.log("stranger")
    assert "config mismatch" in output and "Traceback" not in output
    assert proc.returncode == 2

    swarm.wait_for(lambda: _has_round(swarm), 120, "a round")
    record = next(n for n in swarm.nodes().values() if n.public_name == "founder")
    swarm.procs["founder"].send_signal(signal.SIGTERM)
    assert swarm.wait_exit("founder", 60) == 0, swarm.log("founder")[-3000:]
    assert swarm.checkpoint("founder") is not None
    assert (tmp_path / "founder" / "summary.json").exists()
    # the record is gone (a LEAVING tombstone replaced it) while the last heartbeat we saw is still unexpired
    swarm.wait_for(
        lambda: "founder" not in {n.public_name for n in swarm.nodes().values()}, 60, "the record to go"
    )
    assert get_dht_time() < record.expires_at, "the record is gone, but it may have expired: not withdrawn"


def _has_round(swarm: Swarm) -> bool:
    return any(n.round >= 1 for n in swarm.nodes().values())


def test_sigkill_does_not_stall_the_others(swarm_factory):
    # a window of 5 s (instead of 2): on a loaded machine (full suite, two busy loops) the two that stayed fell a
    # window apart, each reaching the sync as the other's 2 s window closed, and met in neither of the last 2 rounds
    swarm = swarm_factory(num_shards=2, matchmaking_time=5.0)
    for name in ("a", "b", "victim"):
        swarm.start(name, "--max-rounds", "4", "--wait-peers", "3")
    swarm.wait_for(lambda: min((n.round for n in swarm.nodes().values()), default=0) >= 1, 180, "round 1")
    # SIGKILL of the node's own process only (the OOM killer): its DHT and averager processes and p2pd follow
    helpers = descendants(swarm.procs["victim"].pid)
    assert len(helpers) >= 3, helpers  # DHT, p2pd, two averagers
    swarm.kill("victim")
    wait_for(lambda: not any(running(pid) for pid in helpers), 30, "the victim's helper processes to exit")
    for name in ("a", "b"):
        assert swarm.wait_exit(name, 240) == 0, swarm.log(name)[-3000:]
        s = swarm.summary(name)
        assert s["rounds_done"] == 4
        # without the victim, the two still average together (each round's group depends on matchmaking timing)
        assert any(r["shared_group"] == 2 for r in s["rounds"][-2:]), s["rounds"]


def test_a_joiner_tries_its_bootstrap_peer_again_until_it_answers(swarm_factory, tmp_path):
    # the only peer a node is given is not up yet (a restart of the bootstrap machine, a dropped connection):
    # p2pd gives up at once, and the node tries again instead of exiting
    swarm = swarm_factory()
    identity = tmp_path / "late.id"
    load_or_create_identity(identity)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    swarm.maddr = f"/ip4/127.0.0.1/tcp/{port}/p2p/{peer_id_of(identity).to_base58()}"
    swarm.start("late", "--max-rounds", "1")
    wait_for(lambda: "trying again" in swarm.log("late"), 120, "a first attempt that found nobody")
    late = start_bootstrap([f"/ip4/127.0.0.1/tcp/{port}"], identity=str(identity))
    try:
        assert swarm.wait_exit("late", 240) == 0, swarm.log("late")[-3000:]
    finally:
        late.shutdown()
    log = swarm.log("late")
    assert "cannot reach the bootstrap peers yet" in log and "Traceback" not in log, log[-3000:]


@pytest.mark.parametrize("shared_lag", [0, 1])
def test_overlapping_the_shards_only_lands_the_shared_average_at_once_and_the_shards_later(
    swarm_factory, tmp_path, shared_lag
):
    """With `shared_lag_steps` = 1, the shared average lands one step into the next round instead of at once."""
    names = ("a", "b")
    for attempt in range(2):
        # a window of 30 s: a group begins once both holders are in, so the window only matters when one node
        # reaches its round late. With 2 s, a node slowed by a loaded machine missed its partner's first round
        directory = tmp_path / f"attempt{attempt}"
        directory.mkdir()
        swarm = swarm_factory(
            directory, num_shards=1, overlap_shards=True, shared_lag_steps=shared_lag, matchmaking_time=30.0
        )
        reports = _two_holders_three_rounds(swarm, names)
        # hivemind's all-reduce loses the tail of a stream now and then on a loaded machine ("sent k parts, but we
        # expected n": in 2 of 20 runs of both cases beside two or three busy loops, in rounds 2 and 3, and
        # in round 1 in CI). The round keeps its local values there, and the replicas then differ, which is not what this
        # test is about: such a run is run once more. Nothing else leads to a second run ("sent 10 parts, but we
        # expected 11" in the last round was once a node that stopped its networking too early: a node now leaves
        # once the other has ended the round, `Node.await_round_members`), and every check applies to the run kept
        errors = [e for rounds in reports.values() for r in rounds for e in r["errors"]]
        if not errors or attempt == 1 or not all(STREAM_CUT.search(e) for e in errors):
            break
        print(f"a stream cut in an all-reduce ({errors}): running the two nodes once more")
    for name, rounds in reports.items():
        for report in rounds:
            assert not report["errors"], (report, swarm.warnings(names))
        # the shards' all-reduces ran beside the next steps; the last round (the node leaves after it) waited
        assert [r["overlapped"] for r in rounds] == [True, True, False], rounds
        # an all-reduce takes longer than the moment between the round's start and the next step's: with the lag,
        # the shared average lands after one step
        assert [r["shared_landed_after"] for r in rounds] == [shared_lag, shared_lag, 0], rounds
        # the shards' steps begin once the shared result has landed (they would share its links and cores); with the
        # lag, training goes on at once and they begin with the shared step
        for r in rounds[:2]:
            if shared_lag:
                assert r["shards_began_at"] < r["shared_landed_at"], r
            else:
                assert r["shards_began_at"] >= r["shared_landed_at"] > 0, r
        assert rounds[2]["shared_landed_at"] is None and rounds[2]["shards_began_at"] is not None, rounds[2]
        # the round held training for part of its time only: the step trained meanwhile is not in its stall
        assert all(r["stalled"] > 0 for r in rounds), rounds
        if shared_lag:
            assert all(r["stalled"] < r["seconds"] for r in rounds[:2]), rounds
        assert "Traceback" not in swarm.log(name)
    # the last round averaged both groups at once: both nodes leave with the same weights
    a, b = (swarm.checkpoint(name).tensors for name in names)
    _assert_close(_shared_tensors(a), _shared_tensors(b), "shared parameters of a vs b")
    _assert_close(_shard_tensors(a, 0), _shard_tensors(b, 0), "shard 0 at its replicas")


def _two_holders_three_rounds(swarm, names) -> dict[str, list[dict]]:
    """Start `names` (holders of the swarm's one shard) for 3 rounds; each node's round reports, once every node
    exited cleanly after 3 rounds in groups of both nodes."""
    for name in names:
        swarm.start(name, "--max-rounds", "3", "--wait-peers", "2")
    for name in names:
        assert swarm.wait_exit(name, 300) == 0, swarm.log(name)[-3000:]
    reports = {name: swarm.summary(name)["rounds"] for name in names}
    for rounds in reports.values():
        assert len(rounds) == 3, rounds
        for report in rounds:
            assert report["shared_group"] == 2 and report["shard_groups"] == {"0": 2}, report
    return reports
