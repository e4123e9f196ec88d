"""Attacks on the shared-parameter averaging by a stranger of an open swarm, built from hivemind's public API.

The attacker is hivemind's `DecentralizedAverager` on its own `hivemind.DHT`, joined to the swarm's bootstrap, as
a stranger of an open swarm builds it from public facts only: the run id, the config (the same preset), the group
key prefix `<run>_<config hash[:16]>_shared`, the class name in the nodes' protocol ids (`as_the_nodes_name_it`),
the averaged tensors (the shared parameters of a model of that config, in `shared_parameters` order, fp32, fp16 on
the wire), the gathered data the nodes expect, `[(round, step, tokens), tag]` (no swarm key here: an empty tag),
and the nodes' signed records (read with hivemind's signature validator). None of the project's own averaging
code runs in the attacker. Real daemons on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import re
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator  # noqa: UP035 (hivemind reads `typing` hints to find streaming RPCs)

import hivemind
import pytest
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.control import AveragingStage
from hivemind.compression import Float16Compression
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.timed_storage import get_dht_time
from swarm_utils import Swarm

from spes_node.model.moe import MoEForCausalLM
from spes_node.model.ownership import shared_parameters
from spes_node.swarm import records

pytestmark = pytest.mark.swarm

MATCHMAKING = 2.0
"""The swarm's matchmaking window (as in `swarm_utils.FAST`); the attacker uses the same."""


def _shared_tensors(swarm: Swarm, scale: float = 1.0) -> list[torch.Tensor]:
    """The shared parameters of a fresh model of the swarm's config, seeded like the nodes', times `scale`."""
    cfg = swarm.cfg
    model = MoEForCausalLM(cfg.model, cfg.swarm.num_shards, seed=cfg.train.seed)
    return [p.detach().float().clone() * scale for p in shared_parameters(model).values()]


def as_the_nodes_name_it(cls: type) -> type:
    """`cls` under the class name in the nodes' RPC protocol ids.

    hivemind names an averager's handlers `<prefix>::<class name>.rpc_*`, so a plain `DecentralizedAverager` and
    the nodes (class `RobustAverager`) cannot even call each other; the name is public (the source is open, and
    libp2p's identify protocol tells every connected peer which protocols a peer serves)."""
    cls.__name__ = cls.__qualname__ = "RobustAverager"
    # hivemind collects the handlers and the stub once per class: collect them again, under the new name
    cls._rpc_handlers = cls._stub_type = None
    return cls


@as_the_nodes_name_it
class PlainAverager(DecentralizedAverager):
    """hivemind's DecentralizedAverager, unchanged."""


@dataclass
class Step:
    started: float
    group: bool = False
    """A group formed (the step reached the all-reduce): with one attacker, a group with an honest node."""
    peers: set[str] = field(default_factory=set)
    """Groupmates (base58), when the step finished successfully."""
    error: str | None = None
    delay: float | None = None
    """How far ahead the step was scheduled (None: its matchmaking window, the earliest it can declare)."""


class StrangerAverager:
    """A hivemind averager (`PlainAverager` unless told) of the swarm's shared parameters on its own DHT.

    `claim` gives the (round, step, tokens) it gathers, `weight` the weight it declares, `tensors` what it sends
    at each step (copied in before the step: the all-reduce changes the averager's tensors in place)."""

    def __init__(self, swarm: Swarm, tensors: list[torch.Tensor], cls: type = PlainAverager, **kwargs):
        self.swarm = swarm
        self.tensors = tensors
        self.claim = lambda: (0, 0, 0)
        self.weight = 1.0
        self.delays = itertools.repeat(None)
        """The `delay` of each step of the loop."""
        self.steps: list[Step] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # hivemind's signature validator, as every reader of signed records needs (values carry their signature)
        self.dht = hivemind.DHT(
            initial_peers=[swarm.maddr],
            host_maddrs=["/ip4/127.0.0.1/tcp/0"],
            record_validators=[RSASignatureValidator(RSAPrivateKey())],
            start=True,
        )
        self.peer_id = self.dht.peer_id.to_base58()
        options = dict(
            prefix=f"{swarm.run_id}_{swarm.cfg.hash()[:16]}_shared",
            min_group_size=2,
            min_matchmaking_time=MATCHMAKING,
            request_timeout=min(3.0, MATCHMAKING / 2),
            allreduce_timeout=swarm.cfg.swarm.averaging_timeout,
            compression=Float16Compression(),
        )
        options.update(kwargs)
        # the averager process inherits this level: hivemind logs a traceback for every step without a group
        quiet = logging.getLogger("hivemind.averaging.averager")
        level = quiet.level
        quiet.setLevel(logging.CRITICAL)
        try:
            self.averager = cls([t.clone() for t in tensors], self.dht, start=True, **options)
        finally:
            quiet.setLevel(level)

    def honest_round(self) -> int:
        """The highest round in the swarm's public node records (read through the attacker's own DHT)."""
        nodes = records.fetch_nodes(self.dht, self.swarm.run_id, self.swarm.cfg.swarm.num_shards)
        return max((n.round for n in nodes.values()), default=0)

    def step_once(self, delay: float | None = None) -> Step:
        """One step: a group with whoever matches within twice the matchmaking window (after `delay`, if given)."""
        with self.averager.get_tensors() as buffers:
            for buffer, tensor in zip(buffers, self.tensors):
                buffer.copy_(tensor)
        step = Step(started=time.monotonic(), delay=delay)
        self.steps.append(step)
        control = self.averager.step(
            gather=[self.claim(), b""],
            weight=self.weight,
            scheduled_time=None if delay is None else get_dht_time() + delay,
            timeout=2 * MATCHMAKING + (delay or 0.0),
            allow_retries=False,
            wait=False,
        )
        while not control.done():
            if control.stage in (AveragingStage.AWAITING_TRIGGER, AveragingStage.RUNNING_ALLREDUCE):
                step.group = True
            time.sleep(0.02)
        try:
            gathered = control.result()
        except BaseException as e:  # no group, or a failed all-reduce
            step.error = f"{type(e).__name__}: {e}"
            return step
        if gathered:
            step.group = True
            step.peers = {peer.to_base58() for peer in gathered} - {self.peer_id}
        return step

    def start_loop(self) -> None:
        def loop():
            while not self._stop.is_set():
                self.step_once(next(self.delays))

        self._thread = threading.Thread(target=loop, name="stranger-averager", daemon=True)
        self._thread.start()

    def stop_loop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)

    def close(self) -> None:
        self.stop_loop()
        if self.averager.is_alive():
            try:
                self.averager.shutdown()
            except Exception:
                pass
        if self.averager.is_alive():
            os.kill(self.averager.pid, signal.SIGKILL)
        self.dht.shutdown()


@pytest.fixture
def swarm(tmp_path):
    made = Swarm(tmp_path, run_id="avg", num_shards=2, heartbeat_s=2.0, averaging_timeout=10.0)
    yield made
    made.close()


def _by_name(swarm: Swarm) -> dict[str, records.NodeInfo]:
    return {n.public_name: n for n in swarm.nodes().values()}


def _rounds(swarm: Swarm, names) -> dict[str, int]:
    """The rounds in the records of the nodes `names`; empty unless every one of them has a record."""
    found = {name: n.round for name, n in _by_name(swarm).items() if name in names}
    return found if found.keys() == set(names) else {}


def _shared_groups_after(log: str, marker: str) -> list[int]:
    """The shared group size of each round a node finished after the first line that contains `marker`."""
    if marker not in log:
        return []
    tail = log[log.index(marker) :].split("\n", 1)[-1]
    return [int(size) for size in re.findall(r"round \d+ done: .*?shared group (\d+)", tail)]


def _start_round(log: str) -> int:
    """The round a node started training at (after its state download), from its log."""
    found = re.search(r"training shard \d+ \(\S+, round (\d+),", log)
    assert found, log[-3000:]
    return int(found.group(1))


# ---------------------------------------------------------------------------------------------- round claims


def test_inflated_round_claims_with_a_huge_weight_move_no_round(swarm):
    honest = ("a", "b")
    max_rounds = 6
    for name in honest:
        swarm.start(name, "--max-rounds", str(max_rounds), "--wait-peers", "2")
    ids = swarm.wait_for(
        lambda: (found := _by_name(swarm)).keys() >= set(honest) and {n: found[n].peer_id for n in honest},
        240,
        "a and b's records",
    )
    # as the leader: a shorter window gives the stranger's requests an earlier expiration than a node that starts
    # looking, so the nodes ask it first. With the nodes' window it met them only when it joined a group before the
    # second honest node did (a group begins once its expected peers are in), and once in a run it never did
    attacker = StrangerAverager(swarm, _shared_tensors(swarm), min_matchmaking_time=MATCHMAKING / 2)
    seen_rounds: list[int] = []
    try:
        latest = [0]

        def claim():
            latest[0] = max(latest[0], attacker.honest_round())
            return (latest[0] + 999, (latest[0] + 999) * swarm.cfg.swarm.sync_steps, 10**9)

        attacker.claim, attacker.weight = claim, 1e9
        attacker.start_loop()

        def finished() -> bool:
            seen_rounds.extend(_rounds(swarm, honest).values())
            return all(swarm.procs[name].poll() is not None for name in honest)

        swarm.wait_for(finished, 240, "a and b to finish their rounds")
    finally:
        attacker.close()
    for name in honest:
        assert swarm.wait_exit(name, 30) == 0, swarm.log(name)[-3000:]

    # the attack took place: the stranger averaged with an honest node at least once
    with_honest = [s for s in attacker.steps if s.peers & set(ids.values())]
    summaries = {name: swarm.summary(name) for name in honest}
    in_three = [r for s in summaries.values() for r in s["rounds"] if r["shared_group"] == 3]
    print(
        f"\nstranger steps {len(attacker.steps)}, groups with an honest node {len(with_honest)}, "
        f"honest rounds in a group of 3: {len(in_three)}"
    )
    assert with_honest or in_three, ("the stranger never met an honest node", attacker.steps)
    for name in honest:  # its tensors passed the checks: a member whose claims were read, not a banned one
        assert f"ignoring peer {attacker.peer_id}" not in swarm.log(name), swarm.log(name)[-3000:]

    for name, summary in summaries.items():
        start = _start_round(swarm.log(name))
        assert summary["rounds_done"] == max_rounds
        assert summary["round"] == start + summary["rounds_done"], (name, start, summary["round"])
        reported = [r["round"] for r in summary["rounds"]]
        assert reported == list(range(start + 1, start + max_rounds + 1)), (name, reported)
        assert all(r["caught_up"] is None for r in summary["rounds"]), (name, summary["rounds"])
        assert "caught up" not in swarm.log(name), swarm.log(name)[-3000:]
    assert seen_rounds and max(seen_rounds) <= max_rounds + max(_start_round(swarm.log(n)) for n in honest), (
        seen_rounds
    )


# ---------------------------------------------------------------------------------------------- bans


def _honest_claim(attacker: StrangerAverager):
    """Round info like an honest node's: the swarm's round, its step, one round of tokens."""
    cfg = attacker.swarm.cfg
    tokens = (
        cfg.swarm.sync_steps * cfg.train.micro_batch_size * cfg.train.grad_accum * (cfg.train.seq_len + 1)
    )

    def claim():
        round_ = attacker.honest_round()
        return (round_, round_ * cfg.swarm.sync_steps, tokens)

    return claim, float(tokens)


def test_a_banned_stranger_is_refused_as_member_and_as_leader(swarm):
    honest = ("a", "b")
    for name in honest:
        swarm.start(name, "--wait-peers", "2")
    swarm.wait_for(lambda: _by_name(swarm).keys() >= set(honest), 240, "a and b's records")
    # a matchmaking window half the nodes': stepping without pause, the stranger is always declared with an
    # earlier expiration than a node that starts looking, i.e. as the leader that the node asks first
    attacker = StrangerAverager(
        swarm, _shared_tensors(swarm, scale=1e4), min_matchmaking_time=MATCHMAKING / 2
    )
    try:
        attacker.claim, attacker.weight = _honest_claim(attacker)
        # first, tensors 10^4 times the weights: the honest reducers reject them and ban the sender
        attacker.start_loop()
        ban = f"ignoring peer {attacker.peer_id}"
        swarm.wait_for(
            lambda: all(ban in swarm.log(name) for name in honest), 120, "both nodes to ban the stranger"
        )
        # then honest-looking tensors, in both roles: as the leader (steps at once, the earliest expiration) and as
        # a follower (steps scheduled a window ahead, a later expiration than the nodes already looking)
        attacker.tensors = _shared_tensors(swarm)
        attacker.delays = itertools.cycle([None, MATCHMAKING])
        banned_at = time.monotonic()

        def enough() -> bool:
            groups = {name: _shared_groups_after(swarm.log(name), ban) for name in honest}
            return len([s for s in attacker.steps if s.started > banned_at]) >= 4 and all(
                len(g) >= 3 and len(honest) in g for g in groups.values()
            )

        swarm.wait_for(
            enough,
            120,
            "three rounds of each node, one of them together, and four stranger steps after the ban",
        )
    finally:
        attacker.close()
        for name in honest:
            swarm.procs[name].send_signal(signal.SIGTERM)
    for name in honest:
        assert swarm.wait_exit(name, 60) == 0, swarm.log(name)[-3000:]

    before = [s for s in attacker.steps if s.started <= banned_at]
    after = [s for s in attacker.steps if s.started > banned_at]
    print(
        "\n".join(f"stranger step at {s.started - banned_at:+.1f}s: {s}" for s in attacker.steps),
        f"\nstranger steps before the ban {len(before)} ({sum(s.group for s in before)} in a group), "
        f"after {len(after)} ({sum(s.group for s in after)} in a group)",
    )
    assert any(s.group for s in before), "the ban came from a group with the stranger"
    assert len(after) >= 4 and {s.delay for s in after} == {None, MATCHMAKING}, after
    assert not [s for s in after if s.group], ("a group formed with a banned peer", after)
    for name in honest:
        rounds = swarm.summary(name)["rounds"]
        first = next(i for i, r in enumerate(rounds) if attacker.peer_id in r["banned"])
        later = rounds[first + 1 :]
        assert len(later) >= 3, (name, rounds)
        for report in later:
            assert attacker.peer_id in report["banned"], (name, report)
            # the stranger is in no group (its steps above, and no group larger than the honest nodes); a part
            # that failed in such a group failed between honest nodes under load, and says nothing of the ban
            assert report["shared_group"] <= len(honest), (name, report)
        assert any(r["shared_group"] == len(honest) for r in later), (
            "the honest nodes stopped averaging",
            rounds,
        )
        assert "Traceback" not in swarm.log(name)


# ---------------------------------------------------------------------------------------------- failing reducers


@as_the_nodes_name_it
class SilentReducer(DecentralizedAverager):
    """A groupmate that sends its own parts and reduces the part the group gives it, but never returns the result:
    its groupmates wait for that part until it dies."""

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        async for _reduced in super().rpc_aggregate_part(stream, context):
            pass  # reduced, and kept
        await asyncio.Event().wait()  # the stream stays open until this process dies
        yield averaging_pb2.AveragingData()  # never reached (an async generator, as hivemind expects)


def test_a_reducer_that_dies_mid_allreduce_is_counted_not_silent(swarm):
    honest = ("a", "b")
    for name in honest:
        swarm.start(name, "--wait-peers", "2")
    ids = swarm.wait_for(
        lambda: (found := _by_name(swarm)).keys() >= set(honest) and {found[n].peer_id: n for n in honest},
        240,
        "a and b's records",
    )
    attacker = StrangerAverager(swarm, _shared_tensors(swarm), cls=SilentReducer)
    try:
        attacker.claim, attacker.weight = _honest_claim(attacker)
        deadline = time.monotonic() + 120
        # its step succeeds once every groupmate has reduced the parts it sent (so they hold its data), while they
        # still wait for the part it reduces: then it dies
        while not (step := attacker.step_once()).peers & ids.keys():
            swarm.check_alive()
            assert time.monotonic() < deadline, (
                "the stranger never completed a step with a node",
                attacker.steps,
            )
        stranger = attacker.averager.peer_id.to_base58()
        os.kill(attacker.averager.pid, signal.SIGKILL)
        victims = [ids[peer] for peer in step.peers & ids.keys()]
        swarm.wait_for(
            lambda: all("parts not averaged" in swarm.log(name) for name in victims),
            60,
            f"{victims} to report the part that was not averaged",
        )
    finally:
        attacker.close()
        for name in honest:
            swarm.procs[name].send_signal(signal.SIGTERM)
    for name in honest:
        assert swarm.wait_exit(name, 60) == 0, swarm.log(name)[-3000:]

    for name in victims:
        log = swarm.log(name)
        reports = [r for r in swarm.summary(name)["rounds"] if r["failed_parts"]]
        print(f"\n{name}: {reports}")
        assert reports, (name, swarm.summary(name)["rounds"])
        report = reports[0]
        assert report["failed_parts"] >= 1 and any("parts not averaged" in e for e in report["errors"]), (
            report
        )
        # and why: the dead reducer by its peer id, with the error its stream ended on
        assert any(f"{stranger[:12]}: " in e for e in report["errors"]), report
        warning = re.search(rf"WARN(ING)? .*round {report['round']}: \d+ of \d+ parts not averaged", log)
        assert warning, log[-3000:]
        assert "Traceback" not in log
