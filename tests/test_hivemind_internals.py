"""The places where spes-node leans on hivemind internals, each checked against the installed hivemind: these
fail when an upgrade changes what the project relies on (relay flags, the robust reducer's copies, the command
pipe that carries bans)."""

from __future__ import annotations

import inspect
import multiprocessing as mp
import os
import re
import signal
import sys
from pathlib import Path

import hivemind
import pytest
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.averager import DecentralizedAverager
from hivemind.averaging.control import StepControl
from hivemind.averaging.partition import TensorPartReducer
from hivemind.p2p import P2P
from hivemind.p2p.p2p_daemon_bindings.control import ControlClient
from hivemind.utils.mpfuture import MPFuture
from hivemind_locks import renew_wedged_hivemind_locks
from swarm_utils import run_captured

from spes_node.procs import NodeDHT, descendants
from spes_node.swarm import relay
from spes_node.swarm.bootstrap import start_bootstrap
from spes_node.swarm.robust import RobustPartReducer


@pytest.mark.swarm
def test_static_relays_reach_the_p2pd_command_line():
    bootstrap = start_bootstrap(["/ip4/127.0.0.1/tcp/0"])
    try:
        maddr = str(bootstrap.get_visible_maddrs()[0])
        # no initial peers: the flag is what is checked, and p2pd needs no connection to the relay to start
        dht = NodeDHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True, **relay.dht_kwargs([maddr]))
        try:
            commands = [
                Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") for pid in descendants(dht.pid)
            ]
            p2pd = [c for c in commands if c and c[0].endswith(b"p2pd")]
            assert p2pd, "no p2pd below the DHT process"
            assert b"-relayDiscovery=0" in p2pd[0], p2pd[0]
            assert any(arg.startswith(b"-trustedRelays=") for arg in p2pd[0]), p2pd[0]
        finally:
            dht.shutdown()
    finally:
        bootstrap.shutdown()


def test_p2pd_arguments_are_built_where_the_relay_patch_hooks_in():
    source = inspect.getsource(P2P.create)
    assert "_make_process_args(" in source
    assert "autoRelay=" in source and '"trustedRelays"' in source


def test_the_robust_reducer_copies_match_the_hivemind_they_replace():
    # RobustPartReducer replaces hivemind's reducer loop (parts kept per sender and part, a window ahead) on top of
    # the state hivemind's __init__ sets up, and the runner drives it through the same calls
    init = inspect.getsource(TensorPartReducer.__init__)
    for name in ("self.num_parts", "self.finished", "self.num_parts_received", "self.sender_failed_after"):
        assert name in init, name
    assert "self.reset_accumulators()" in init
    runner = inspect.getsource(AllReduceRunner)
    for call in ("tensor_part_reducer.accumulate_part(", "tensor_part_reducer.on_sender_failed(",
                 "tensor_part_reducer.finalize()", "tensor_part_reducer.finished.wait()"):  # fmt: skip
        assert call in runner, call
    assert set(inspect.signature(RobustPartReducer.accumulate_part).parameters) == set(
        inspect.signature(TensorPartReducer.accumulate_part).parameters
    )
    # the windowed stream handler reads the sender's stream as hivemind's rpc_aggregate_part hands it over
    assert "self._accumulate_parts_streaming(stream, sender_index)" in inspect.getsource(
        AllReduceRunner.rpc_aggregate_part
    )
    # RobustAverager._run_allreduce_inplace_ replaces hivemind's, registering its runner the same way
    source = inspect.getsource(DecentralizedAverager._run_allreduce_inplace_)
    assert "self._running_groups[group_id].set_result(runner)" in source
    assert "tensor.add_(update, alpha=self._averaging_alpha)" in source


def test_a_step_that_writes_differences_can_refuse_its_retries():
    # RobustAverager._step wraps hivemind's, which the command pipe calls with these keywords; with differences,
    # the averager clears the step's retry permission, which hivemind reads from `_allow_retries` before a retry
    assert "dict(step=step, future_for_init=future_for_init)" in inspect.getsource(DecentralizedAverager.step)
    assert "not step.allow_retries" in inspect.getsource(DecentralizedAverager._step)
    control = inspect.getsource(StepControl)
    assert "self._allow_retries = data_for_gather, deadline, allow_retries" in control
    assert "return self._allow_retries" in control


def test_bans_travel_on_the_averagers_command_pipe():
    # RobustAverager.set_peers sends ("_set_peers", args, kwargs) through hivemind's private pipe; the averager
    # process receives it and awaits getattr(self, method)(*args, **kwargs)
    assert "self._outer_pipe" in inspect.getsource(DecentralizedAverager.shutdown)
    run_internal = inspect.getsource(DecentralizedAverager._run_internal)
    assert "method, args, kwargs = self._inner_pipe.recv()" in run_internal
    assert "getattr(self, method)(*args, **kwargs)" in run_internal


def test_a_dead_averagers_handlers_can_be_released_in_the_name_of_its_socket():
    # handlers.Registration reads a replica's client socket from a private attribute, set where the replica is made;
    # the averager registers its RPCs through add_p2p_handlers, which RobustAverager overrides to note where; the
    # bindings remove a stream handler for their own listening socket and then drop their entry for it
    assert "self._client_listen_maddr = " in inspect.getsource(P2P.replicate)
    assert "await self.add_p2p_handlers(self._p2p, namespace=self.prefix)" in inspect.getsource(
        DecentralizedAverager._run_internal
    )
    remove = inspect.getsource(ControlClient.remove_stream_handler)
    assert "addr=self.listen_maddr.to_bytes()" in remove and "del self.handlers[proto]" in remove


def _hold_until_killed(lock, held) -> None:
    lock.acquire()
    held.set()
    signal.pause()


@pytest.mark.swarm
def test_a_fork_killed_holding_the_mpfuture_lock_wedges_it_until_the_backend_is_reset():
    # what an attack or fault test that kills an averager forked from the test worker can leave behind
    fork = mp.get_context("fork")
    held = fork.Event()
    holder = fork.Process(target=_hold_until_killed, args=(MPFuture._update_lock, held), daemon=True)
    holder.start()
    assert held.wait(60)
    os.kill(holder.pid, signal.SIGKILL)
    holder.join(60)
    assert holder.exitcode == -signal.SIGKILL
    # nobody else holds it, and nobody ever will release it: every later fork's result would wait on it
    assert not MPFuture._update_lock.acquire(block=False)

    assert renew_wedged_hivemind_locks(wait_s=1.0) == ["MPFuture._update_lock"]
    assert renew_wedged_hivemind_locks(wait_s=1.0) == []
    # after the reset a forked process delivers its result again, and a DHT (a fork that reports ready) starts
    future = MPFuture()
    sender = fork.Process(target=future.set_result, args=(42,), daemon=True)
    sender.start()
    assert future.result(timeout=120) == 42
    sender.join(60)
    dht = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=False)
    dht.run_in_background(await_ready=False)
    try:
        dht.wait_until_ready(timeout=120)
    finally:
        dht.shutdown()


# Each race runs in a fresh interpreter, which owns its logging and its forks' locks: first with the filter taken
# off (hivemind's own behaviour, which the filter is there for), then with it. The helper processes are forks, which
# take the loggers' filters as they are when forked; a marker line on stderr separates the two.
_PHASES = """
import logging, sys
from spes_node.logs import setup_logging

def phases(logger_name, scenario):
    for phase in ("unfiltered", "filtered"):
        setup_logging("INFO")
        logger = logging.getLogger(logger_name)
        if phase == "unfiltered":
            logger.filters.clear()
        else:
            logger.setLevel(logging.DEBUG)
        print("=== " + phase, file=sys.stderr, flush=True)
        scenario()
"""


def _run_phases(script: str) -> dict[str, str]:
    done = run_captured([sys.executable, "-c", _PHASES + script], timeout=420)
    assert done.returncode == 0, done.stderr[-3000:]
    _, unfiltered, filtered = re.split(r"^=== (?:un)?filtered$", done.stderr, flags=re.M)
    return {"unfiltered": unfiltered, "filtered": filtered}


# A request whose sender exits before the DHT reads it: the DHT process (stopped meanwhile, so that it cannot read it
# in time) then fails to fetch the request's pipe end from the sender.
_DEAD_SENDER = """
import multiprocessing as mp, os, signal
import hivemind

def scenario():
    dht = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)

    def send_and_exit():
        dht.get("key", return_future=True)
        os._exit(0)

    os.kill(dht.pid, signal.SIGSTOP)
    sender = mp.get_context("fork").Process(target=send_and_exit)
    sender.start()
    sender.join(120)
    os.kill(dht.pid, signal.SIGCONT)
    # the pipe is read in order: once this is answered, the dead sender's request was read before it
    dht.get("key", return_future=True).result(timeout=120)
    print("answered", sender.exitcode, file=sys.stderr, flush=True)
    dht.shutdown()

phases("hivemind.dht.dht", scenario)
"""


@pytest.mark.swarm
def test_a_request_from_an_exited_process_costs_the_dht_one_debug_line_not_a_traceback():
    # what an averager shut down mid-matchmaking leaves in its node's DHT pipe when the node stops or moves shards
    out = _run_phases(_DEAD_SENDER)
    for phase, text in out.items():
        assert "answered 0" in text, (phase, text[-3000:])
    assert "Traceback" in out["unfiltered"] and "resource_sharer" in out["unfiltered"], out["unfiltered"][
        -3000:
    ]
    assert "Traceback" not in out["filtered"], out["filtered"][-3000:]
    assert "dropped a request from a process that has exited" in out["filtered"], out["filtered"][-3000:]


# An averaging step cancelled while its all-reduce runs (what a stopping node does to its round): hivemind's averager
# sets the cancelled step's result when the all-reduce ends, which raises in a task nobody awaits. The other member
# is stopped from the moment the step is seen all-reducing until it is cancelled, so that the all-reduce cannot end
# first.
_CANCEL_MID_ALLREDUCE = """
import os, signal, time, torch, hivemind
from hivemind.averaging.control import AveragingStage

def scenario():
    first = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    second = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=first.get_visible_maddrs(), start=True)
    averagers = [
        hivemind.DecentralizedAverager([torch.randn(8_000_000)], dht, prefix="race", target_group_size=2,
                                       min_matchmaking_time=2.0, request_timeout=1.0, start=True)
        for dht in (first, second)
    ]
    controls = [a.step(wait=False, require_trigger=False) for a in averagers]
    deadline = time.monotonic() + 120
    while controls[0].stage != AveragingStage.RUNNING_ALLREDUCE:
        assert time.monotonic() < deadline and not controls[0].done(), controls[0].stage
        time.sleep(0.001)
    os.kill(averagers[1].pid, signal.SIGSTOP)
    cancelled = controls[0].cancel()
    os.kill(averagers[1].pid, signal.SIGCONT)
    print("cancelled", cancelled, type(controls[1].result(timeout=120)).__name__, file=sys.stderr, flush=True)
    # the cancelled step's all-reduce goes on in the background, holding its averager's tensors, and may end after
    # the other member's: shut down once it has (hivemind's _shutdown, called with a group still running, calls
    # finalize() on that group's future and fails with an AttributeError traceback, seen on a loaded machine).
    # The averager sets the step's result and forgets the group in the same turn of its loop as it lets go of the
    # tensors, before it reads the shutdown request
    with averagers[0].get_tensors():
        pass
    for averager in averagers:
        averager.shutdown()
    for dht in (first, second):
        dht.shutdown()
    print("shut down", file=sys.stderr, flush=True)

phases("asyncio", scenario)
"""


@pytest.mark.swarm
def test_a_step_cancelled_mid_allreduce_costs_the_averager_one_debug_line_not_a_traceback():
    out = _run_phases(_CANCEL_MID_ALLREDUCE)
    for phase, text in out.items():
        assert "cancelled True dict" in text and "shut down" in text, (phase, text[-3000:])
    unfiltered, filtered = out["unfiltered"], out["filtered"]
    assert "Task exception was never retrieved" in unfiltered, unfiltered[-3000:]
    assert "InvalidStateError" in unfiltered and "Traceback" in unfiltered, unfiltered[-3000:]
    assert "Traceback" not in filtered, filtered[-3000:]
    assert "an all-reduce finished after its step was cancelled" in filtered, filtered[-3000:]
