"""A refresh of frozen experts that outlives its timeout is cancelled, and what it would deliver later is never
applied; a round's matchmaking never waits for a refresh in flight (no network: the downloads are coroutines)."""

import asyncio
import threading
import time

from spes_node.config import load_preset
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
    spes_round = _round(cfg, threading.Event())
    delivered = threading.Event()

    async def slow_refresh():
        await asyncio.sleep(3.0)  # past the 2 s timeout
        spes_round._pending[1] = {"late": None}
        delivered.set()

    try:
        spes_round._submit_refresh(slow_refresh())
        future = spes_round._refresh
        started = time.monotonic()
        assert spes_round.finish_pending() == 0
        waited = time.monotonic() - started
        assert waited < 10, waited  # its timeout is averaging_timeout x num_shards = 2 s
        assert future.cancelled() or future.done()
        assert spes_round._refresh is None
        assert not delivered.wait(4.0), "the late refresh went on and delivered"
        assert not spes_round._pending
    finally:
        spes_round.loop.stop()


def test_a_stopping_node_does_not_wait_for_its_refresh():
    cfg = load_preset("tiny").replace(swarm={"averaging_timeout": 60.0})
    stop_event = threading.Event()
    spes_round = _round(cfg, stop_event)
    try:
        spes_round._submit_refresh(asyncio.sleep(300))
        stop_event.set()
        started = time.monotonic()
        spes_round.finish_pending()
        assert time.monotonic() - started < 10  # not the 240 s its timeout allows
    finally:
        spes_round.loop.stop()


def test_a_round_does_not_wait_for_a_refresh_in_flight_and_applies_it_when_it_lands():
    """A holder one round behind answers our refresh only once it finished that round, with us in its group: a
    node that waited for the refresh before its own matchmaking took turns with such a holder and never met it.
    The round goes on at once; the copy is applied between steps when it lands; a refresh that is still
    downloading is not replaced by the next round's, and one past its timeout is cancelled at the next round."""
    import torch

    from spes_node.daemon.round import _Refresh
    from spes_node.model.moe import MoEForCausalLM
    from spes_node.model.ownership import apply_ownership, shard_tensors
    from spes_node.swarm.transfer import Download

    cfg = load_preset("tiny").replace(swarm={"averaging_timeout": 30.0, "num_shards": 2})
    model = MoEForCausalLM(cfg.model, cfg.swarm.num_shards)
    apply_ownership(model, [0])
    spes_round = _round(cfg, threading.Event(), model)
    fresh = {k: torch.full_like(v.float(), 0.5) for k, v in shard_tensors(model, 1).items()}
    release, landed = threading.Event(), threading.Event()

    async def held_by_a_holder_behind():
        await asyncio.to_thread(release.wait)
        with spes_round._pending_lock:
            spes_round._pending[1] = _Refresh("shard", "behind", Download(5, fresh, 1, 0.1))
        landed.set()
        return 1

    try:
        spes_round._submit_refresh(held_by_a_holder_behind())
        started = time.monotonic()
        spes_round._settle_refresh()  # what `begin_round` does before its matchmaking
        assert time.monotonic() - started < 1.0, "the round waited for the refresh"
        assert spes_round._refresh is not None and not spes_round._refresh.done()

        # the next round's refresh of the same shard does not cancel the one still downloading
        spes_round.start_refresh({}, min_round=6)
        assert not spes_round._refresh.done()

        release.set()
        assert landed.wait(10)
        assert spes_round.apply_pending() == 1  # between two steps
        for name, tensor in shard_tensors(model, 1).items():
            torch.testing.assert_close(tensor.float(), fresh[name], msg=name)
        assert spes_round._held[1].round == 5

        # one that outlives its timeout is cancelled by the next round, without waiting, and never applied
        spes_round._submit_refresh(asyncio.sleep(300))
        stuck = spes_round._refresh
        spes_round._refresh_deadline = time.monotonic()
        started = time.monotonic()
        spes_round._settle_refresh()
        assert time.monotonic() - started < 1.0
        assert spes_round._refresh is None
        assert stuck.cancelled() or stuck.done()
    finally:
        release.set()
        spes_round.loop.stop()


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
