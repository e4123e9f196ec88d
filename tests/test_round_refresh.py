"""A refresh of frozen experts that outlives its timeout is cancelled, and what it would deliver later is never
applied (no network: the download is a coroutine that never finishes in time)."""

import asyncio
import threading
import time

import pytest

from spes_node.aio import LoopThread
from spes_node.config import load_preset
from spes_node.daemon.frozen import FrozenCopies
from spes_node.daemon.round import SpesRound


def _round(cfg, stop_event: threading.Event, model=None) -> SpesRound:
    """A round with no network: only its event loop runs."""
    return SpesRound(
        cfg,
        run_id="test",
        config_hash="0" * 64,
        peer_id="me",
        dht=None,
        model=model,
        shards=[0],
        stop_event=stop_event,
    )


def test_a_refresh_past_its_timeout_is_cancelled_and_never_applied():
    cfg = load_preset("tiny").replace(swarm={"averaging_timeout": 1.0, "num_shards": 2})
    loop = LoopThread()
    frozen = FrozenCopies(cfg, None, loop, threading.Event())
    delivered = threading.Event()

    async def slow_refresh():
        await asyncio.sleep(3.0)  # past the 2 s timeout
        frozen._pending[1] = {"late": None}
        delivered.set()

    try:
        frozen._refresh = loop.submit(slow_refresh())
        future = frozen._refresh
        started = time.monotonic()
        assert frozen.finish(own=[0]) == 0
        waited = time.monotonic() - started
        assert waited < 10, waited  # its timeout is averaging_timeout x num_shards = 2 s
        assert future.cancelled() or future.done()
        assert frozen._refresh is None
        assert not delivered.wait(4.0), "the late refresh went on and delivered"
        assert not frozen._pending
    finally:
        loop.stop()


def test_a_stopping_node_does_not_wait_for_its_refresh():
    cfg = load_preset("tiny").replace(swarm={"averaging_timeout": 60.0})
    stop_event = threading.Event()
    loop = LoopThread()
    frozen = FrozenCopies(cfg, None, loop, stop_event)
    try:
        frozen._refresh = loop.submit(asyncio.sleep(300))
        stop_event.set()
        started = time.monotonic()
        frozen.finish(own=[0])
        assert time.monotonic() - started < 10  # not the 240 s its timeout allows
    finally:
        loop.stop()


def test_the_nesterov_outer_state_goes_through_a_checkpoint(tmp_path):
    import torch

    from spes_node.daemon.anchors import apply_outer
    from spes_node.daemon.checkpoint import CheckpointManager
    from spes_node.model.moe import MoEForCausalLM
    from spes_node.model.ownership import apply_ownership, shared_parameters

    cfg = load_preset("tiny").replace(swarm={"outer_optimizer": "nesterov"})
    model = MoEForCausalLM(cfg.model, cfg.swarm.num_shards)
    apply_ownership(model, [0])
    first, second = _round(cfg, threading.Event(), model), _round(cfg, threading.Event(), model)
    try:
        first.reset_outer()
        with torch.no_grad():
            averaged = {k: v.detach() * 0.9 for k, v in shared_parameters(model).items()}
        apply_outer(first.shared_outer, shared_parameters(model), None, averaged)
        CheckpointManager(tmp_path).save(1, {}, {}, {"by_name": {}, "outer": first.outer_state_dict()})

        second.reset_outer()
        second.load_outer_state_dict(CheckpointManager(tmp_path).latest().optimizer["outer"])
        for name, velocity in first.shared_outer.velocity.items():
            assert torch.equal(second.shared_outer.velocity[name], velocity), name
        for name, previous in first.shared_outer.previous.items():
            assert torch.equal(second.shared_outer.previous[name], previous), name
        assert first.shared_outer.velocity, "the outer step left no momentum to save"
    finally:
        first.loop.stop()
        second.loop.stop()


def test_a_round_serves_its_state_before_taking_a_groups_weights():
    """Two members may each take a part from the other in the same round (one's shared parameters, the other's
    shard): each asks for the other's state of this round, so each must serve it before downloading anything, or
    both wait on the other until the request times out and neither takes anything."""
    import torch

    from spes_node.daemon.round import RoundInputs, _Flight
    from spes_node.model.moe import MoEForCausalLM
    from spes_node.model.ownership import apply_ownership
    from spes_node.swarm import records
    from spes_node.swarm.transfer import TransferError

    cfg = load_preset("tiny").replace(swarm={"average": "updates", "num_shards": 1})
    model = MoEForCausalLM(cfg.model, cfg.swarm.num_shards)
    apply_ownership(model, [0])
    spes_round = _round(cfg, threading.Event(), model)
    events = []

    class Publisher:
        def publish(self, round_, shared, own, frozen, premerge=(), restart=False):
            events.append(("publish", round_, restart))

    class Fetcher:
        async def fetch(self, peers, part, expected, min_round, exact=False):
            events.append(("fetch", part, min_round))
            raise TransferError("no such state")

        def vouch(self, peers):
            pass

        def holders(self, nodes, shard, banned):
            return []

    try:
        spes_round.reset_outer()
        spes_round.publisher, spes_round.fetcher = Publisher(), Fetcher()
        spes_round.shard_avgs = {0: None}  # no replica of shard 0: never averaged
        spes_round._settle_anchor = lambda key, result, averaged, round_: (
            ("f" * 16, ["peer"], round_) if key == "shared" else None
        )
        me = records.NodeInfo(peer_id="me", shards=[0], round=4, state="training")
        inputs = RoundInputs(4, 40, 100, 3.0, {"me": me}, me, (0, 1))
        spes_round._inflight = _Flight(inputs, 0.0, None, {0: None}, None, {0: None})
        with torch.no_grad():
            report = spes_round.complete_round()
        assert report.round == 5
        fetches = [i for i, e in enumerate(events) if e[0] == "fetch"]
        assert fetches and events[fetches[0] - 1] == ("publish", 5, False), events
        assert report.resynced == []  # the download failed: it keeps its own anchor
    finally:
        spes_round.loop.stop()


def test_a_stopping_node_does_not_wait_for_an_averager_that_never_takes_its_step():
    # an averager process that hangs (its DHT frozen) never takes the step: hivemind's step waits for it without a
    # timeout; the round gives it up when the node stops, as no group
    cfg = load_preset("tiny")
    stop_event = threading.Event()
    spes_round = _round(cfg, stop_event)
    hung = threading.Event()
    errors = []
    try:
        assert spes_round._unless_stopped(lambda: ("control", 0.0), "shared", errors) == ("control", 0.0)
        threading.Timer(0.5, stop_event.set).start()
        started = time.monotonic()
        assert spes_round._unless_stopped(lambda: hung.wait(300) and None, "shared", errors) is None
        assert time.monotonic() - started < 10
        assert errors == []  # stopping is no failure
    finally:
        hung.set()
        spes_round.loop.stop()


def test_a_step_that_an_averager_never_takes_is_given_up_and_reported():
    # the node goes on training (this group not averaged this round) instead of waiting for it forever
    cfg = load_preset("tiny")
    spes_round = _round(cfg, threading.Event())
    hung = threading.Event()
    errors = []
    try:
        assert (
            spes_round._unless_stopped(lambda: hung.wait(300) and None, "shard1", errors, timeout=0.5) is None
        )
        assert len(errors) == 1 and "shard1" in errors[0] and "unresponsive" in errors[0], errors
    finally:
        hung.set()
        spes_round.loop.stop()


def test_an_overlapped_round_copies_only_the_groups_that_need_their_sent_weights():
    """Under overlap_shards, update averaging and a Nesterov step keep a host copy of each own shard while its
    all-reduce runs, to land the result with the progress made since, and anchor on it when a shard with no other
    holder is not averaged. The plain average of weights keeps none, with a group or without: its averagers
    return the difference that lands it (`averaging.MODES`)."""
    import torch

    from spes_node.daemon.round import RoundInputs
    from spes_node.model.moe import MoEForCausalLM
    from spes_node.model.ownership import apply_ownership, shard_tensors
    from spes_node.swarm import records

    for swarm, copied in (
        ({}, False),
        ({"average": "updates"}, True),
        ({"outer_optimizer": "nesterov"}, True),
    ):
        cfg = load_preset("tiny").replace(swarm={"num_shards": 1, **swarm})
        model = MoEForCausalLM(cfg.model, cfg.swarm.num_shards)
        apply_ownership(model, [0])
        spes_round = _round(cfg, threading.Event(), model)
        try:
            spes_round.reset_outer()
            me = records.NodeInfo(peer_id="me", shards=[0], round=4, state="training")
            with torch.no_grad():
                spes_round.begin_round(RoundInputs(4, 40, 100, 3.0, {"me": me}, me, (0, 1)), False, True)
            flight = spes_round._inflight
            assert flight.shards == {0: None}, "nobody else holds shard 0: no all-reduce"
            sent = flight.sent_shards[0]
            assert (sent is not None) == copied, swarm
            if copied:
                local = shard_tensors(model, 0)
                assert all(torch.equal(sent[k], local[k]) for k in local), swarm
            # with a group to average with (a step in flight)
            assert spes_round._keeps_sent("shard0", object()) == copied, swarm
            assert spes_round.differences == (not copied), swarm
        finally:
            spes_round.loop.stop()


def test_a_node_rounds_behind_the_swarm_averages_nothing_into_its_groups():
    """A node that the records show rounds behind (a joiner whose download outlasted rounds, a paused node) takes
    the swarm's weights at the round's end (`catch_up_target`); it starts no all-reduce first, which would average
    its old weights into the swarm's. Where it would end the round one behind the records, it averages (the skew of
    nodes ending a round a moment apart: `progress.should_catch_up`)."""
    from types import SimpleNamespace

    import torch

    from spes_node.daemon.round import RoundInputs
    from spes_node.model.moe import MoEForCausalLM
    from spes_node.model.ownership import apply_ownership
    from spes_node.swarm import records

    cfg = load_preset("tiny").replace(swarm={"num_shards": 1})
    model = MoEForCausalLM(cfg.model, cfg.swarm.num_shards)
    apply_ownership(model, [0])
    spes_round = _round(cfg, threading.Event(), model)
    started = []
    try:
        spes_round.reset_outer()
        # averagers that are never asked: the round hands each step to `_unless_stopped`, which records it
        spes_round.shared_avg = spes_round.shard_avgs[0] = SimpleNamespace(
            step=lambda *args, **kwargs: None, healthy=True
        )
        spes_round._unless_stopped = lambda start, key, *args, **kwargs: started.append(key) or object()
        me = records.NodeInfo(peer_id="me", shards=[0], round=4, state="training")
        for peer_round, averages in ((9, False), (7, False), (6, True), (4, True)):
            peer = records.NodeInfo(peer_id="peer", shards=[0], round=peer_round, state="training")
            started.clear()
            with torch.no_grad():
                spes_round.begin_round(
                    RoundInputs(4, 40, 100, 3.0, {"me": me, "peer": peer}, me, (0, 1)), False
                )
            flight, spes_round._inflight = spes_round._inflight, None
            if averages:
                assert sorted(started) == ["shard0", "shared"], peer_round
            else:
                assert not started and flight.shared is None and flight.shards == {0: None}, peer_round
    finally:
        spes_round.loop.stop()


def test_the_shards_begun_after_the_shared_result_look_only_for_its_groups_members():
    """Overlapping the shards only, their steps begin once the shared result has landed (`land_shared`), among the
    members of the shared group: a replica that missed it is out of step this round (a group waiting for it would
    wait out its window), and with nobody in the shared group no shard step begins (a node out of step would
    otherwise spend a second window alone, and its rounds would grow as long as the swarm's, never meeting it)."""
    from types import SimpleNamespace

    import torch

    from spes_node.daemon.round import RoundInputs
    from spes_node.model.moe import MoEForCausalLM
    from spes_node.model.ownership import apply_ownership
    from spes_node.swarm import records
    from spes_node.swarm.averaging import GroupResult

    cfg = load_preset("tiny").replace(swarm={"num_shards": 1})
    model = MoEForCausalLM(cfg.model, cfg.swarm.num_shards)
    apply_ownership(model, [0])
    spes_round = _round(cfg, threading.Event(), model)
    expected: dict[str, list[str]] = {}

    def started(start, key, *args, **kwargs):
        expected[key] = sorted(start.keywords["expected"])
        return object()

    try:
        spes_round.reset_outer()
        spes_round.shared_avg = spes_round.shard_avgs[0] = SimpleNamespace(
            step=lambda *args, **kwargs: None, healthy=True
        )
        spes_round._unless_stopped = started
        me = records.NodeInfo(peer_id="me", shards=[0], round=4, state="training")
        peers = {
            name: records.NodeInfo(peer_id=name, shards=[0], round=4, state="training") for name in ("p", "q")
        }
        for shared_group, shard_expected in (
            (["me", "p"], ["p"]),
            (["me", "p", "q"], ["p", "q"]),
            ([], None),
        ):
            expected.clear()
            with torch.no_grad():
                spes_round.begin_round(
                    RoundInputs(4, 40, 100, 3.0, {"me": me, **peers}, me, (0, 1)), False, True
                )
                assert expected == {"shared": ["p", "q"]}, "the shards' steps wait for the shared result"
                peers_info = {peer: (4, 40, 100) for peer in shared_group}
                result = GroupResult(max(len(shared_group), 1), 1.0, 0, 0, peers=peers_info)
                spes_round._finish = lambda averager, handle, result=result: (result, None)
                spes_round.land_shared()
            flight, spes_round._inflight = spes_round._inflight, None
            if shard_expected is None:
                assert "shard0" not in expected and flight.shards == {0: None}, expected
            else:
                assert expected["shard0"] == shard_expected and flight.shards[0] is not None, expected
    finally:
        spes_round.loop.stop()


def test_a_node_taking_the_swarm_state_takes_its_own_shard_of_the_shared_parameters_round():
    """The records a catching-up node reads may be a round old: the shared parameters then come of a later round
    than the records say. Its own shard must be of that round too (a holder in the middle of a merge still serves
    the round before's), and of an earlier one only when no holder serves that round; a frozen copy is of any round
    the records allow."""
    import torch

    from spes_node.model.moe import MoEForCausalLM
    from spes_node.model.ownership import apply_ownership, shard_tensors, shared_parameters
    from spes_node.swarm.transfer import Download, TransferError

    cfg = load_preset("tiny").replace(swarm={"num_shards": 2})
    model = MoEForCausalLM(cfg.model, cfg.swarm.num_shards)
    apply_ownership(model, [0])
    asked = []

    class Publisher:
        def publish(self, *args, **kwargs):
            pass

    class Fetcher:
        def __init__(self, newest: dict[str, int]):
            self.newest = newest  # the newest round each part is served at

        def holders(self, nodes, shard, banned):
            return ["holder"]

        def sources(self, nodes, shard, banned):
            return ["holder"], f"shard:{shard}"

        async def fetch(self, peers, part, expected, min_round, exact=False, split=True):
            asked.append((part, min_round))
            if self.newest[part] < min_round:
                raise TransferError(f"no {part} of round {min_round}")
            tensors = shared_parameters(model) if part == "shared" else shard_tensors(model, int(part[-1]))
            value = 7.0 if part.startswith("copy:") else 0.0
            served = {name: torch.full_like(t, value) for name, t in tensors.items()}
            return "holder", Download(self.newest[part], served, 0, 0.0, ("holder",))

    spes_round = _round(cfg, threading.Event(), model)
    try:
        spes_round.reset_outer()
        spes_round.publisher = Publisher()
        spes_round.fetcher = Fetcher({"shared": 20, "shard:0": 20, "shard:1": 20})
        taken = spes_round.take_swarm_state({}, 3, min_round=19)
        assert taken.round == 20
        assert asked == [("shared", 19), ("shard:0", 20), ("shard:1", 19)], asked

        asked.clear()
        spes_round.fetcher = Fetcher({"shared": 20, "shard:0": 19, "shard:1": 19})
        assert spes_round.take_swarm_state({}, 3, min_round=19).round == 20
        assert asked == [("shared", 19), ("shard:0", 20), ("shard:0", 19), ("shard:1", 19)], asked

        # the holder by the records moved away from shard 0 since they were read: it serves a frozen copy of it,
        # which the node takes rather than keep weights rounds older
        asked.clear()
        spes_round.fetcher = Fetcher({"shared": 20, "shard:0": -1, "copy:0": 20, "shard:1": 20})
        assert spes_round.take_swarm_state({}, 3, min_round=19).round == 20
        assert asked == [("shared", 19), ("shard:0", 20), ("shard:0", 19), ("copy:0", 19), ("shard:1", 19)], (
            asked
        )
        assert all(bool((t == 7.0).all()) for t in shard_tensors(model, 0).values())
    finally:
        spes_round.loop.stop()


@pytest.mark.parametrize("parallel, most", [(0, 3), (1, 1), (2, 2)])
def test_a_refresh_holds_at_most_refresh_parallel_shards_until_each_is_loaded(parallel, most, monkeypatch):
    """A shard downloaded for a refresh is held until it is loaded between steps: `refresh_parallel` bounds how many
    are downloading or waiting to be loaded at once (0: every frozen shard); the others wait for a slot."""
    import torch

    from spes_node.model.moe import MoEForCausalLM
    from spes_node.model.ownership import apply_ownership, load_shard_tensors
    from spes_node.swarm.transfer import Download

    cfg = load_preset("tiny").replace(
        swarm={"num_shards": 4, "refresh_parallel": parallel, "refresh_by_updates": False}
    )
    model = MoEForCausalLM(cfg.model, cfg.swarm.num_shards)
    apply_ownership(model, [0])
    loop = LoopThread()
    frozen = FrozenCopies(cfg, model, loop, threading.Event())
    counts = {"started": 0, "loaded": 0, "most": 0}

    class Fetcher:
        def holders(self, nodes, shard, excluded=()):
            return ["holder"]

        async def fetch(self, peers, part, expected, min_round=0, exact=False, split=True):
            counts["started"] += 1
            counts["most"] = max(counts["most"], counts["started"] - counts["loaded"])
            await asyncio.sleep(0.05)
            tensors = {name: torch.zeros(shape) for name, shape in expected.items()}
            return "holder", Download(min_round, tensors, 1, 0.0, ("holder",))

    def counting_load(*args):
        load_shard_tensors(*args)
        counts["loaded"] += 1  # before the shard's slot is given back

    try:
        frozen.fetcher = Fetcher()
        monkeypatch.setattr("spes_node.daemon.frozen.load_shard_tensors", counting_load)
        frozen.start({}, 3, own=[0], excluded=())
        assert frozen.finish(own=[0]) == 3, "every frozen shard is refreshed"
        assert counts["most"] == most, counts
    finally:
        loop.stop()
