"""A node's lifecycle under real signals: Ctrl-C (SIGINT to the whole process group), a stop from an init system
(SIGTERM to every process) and a second signal. Real daemons on 127.0.0.1."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
from hivemind.utils import get_dht_time
from swarm_utils import Swarm

from spes_node.daemon.node import SHUTDOWN_S
from spes_node.procs import children, descendants, kill_if_same, start_time

pytestmark = pytest.mark.swarm

EXIT_S = 45.0
"""A signalled node's process is gone within this. The contract is tighter, `SHUTDOWN_S` after the final checkpoint
for the node's own stop, which the node logs and `_assert_stopped_in_time` reads; unloaded a tiny node exits about
2 s after the signal. On a machine as loaded as CI's, the last step and the teardown of an interpreter with torch and
its helper processes took up to 16.5 s: this bound is what still tells a hang."""


def _assert_stopped_in_time(swarm: Swarm, name: str, took: float) -> None:
    log = swarm.log(name)
    stopped = re.search(r"stopped: final checkpoint ([\d.]+)s, network ([\d.]+)s", log)
    assert stopped, log[-3000:]
    network = float(stopped.group(2))
    print(
        f"{name}: final checkpoint {stopped.group(1)}s, network {network:.1f}s, process gone after {took:.1f}s"
    )
    assert network <= SHUTDOWN_S + 0.5, log[-3000:]
    assert took < EXIT_S, (took, log[-3000:])


@pytest.fixture
def swarm(tmp_path):
    # records live 3 heartbeats (30 s): a record gone right after the exit was withdrawn, not expired
    made = Swarm(tmp_path, heartbeat_s=10.0)
    yield made
    made.close()


def _training_record(swarm: Swarm, name: str):
    def ready():
        node = next((n for n in swarm.nodes().values() if n.public_name == name), None)
        return node if node is not None and node.round >= 1 else None

    return swarm.wait_for(ready, 240, f"{name} to finish a round")


@pytest.mark.parametrize(
    "sig, group",
    [(signal.SIGINT, True), (signal.SIGTERM, True), (signal.SIGINT, False)],
    ids=["sigint-group", "sigterm-group", "sigint-main"],
)
def test_a_signal_stops_the_node_cleanly(swarm, sig, group):
    name = f"node-{sig.name.lower()}-{'group' if group else 'main'}"
    proc = swarm.start(name)
    record = _training_record(swarm, name)
    if not group and sig == signal.SIGINT:
        # SIGUSR1 prints every thread's stack (what wait_exit shows for a node that does not stop) and changes nothing
        os.kill(proc.pid, signal.SIGUSR1)
        swarm.wait_for(lambda: "Current thread" in swarm.log(name), 30, "the stacks")
        assert proc.poll() is None and "in train" in swarm.log(name)

    sent = time.monotonic()
    if group:  # what Ctrl-C in a terminal, or a stop that signals every process, does
        os.killpg(proc.pid, sig)
    else:
        os.kill(proc.pid, sig)
    code = swarm.wait_exit(name, 120)
    took = time.monotonic() - sent
    print(
        f"\n{sig.name} to the {'process group' if group else 'main process'}: exit {code} after {took:.1f}s"
    )
    assert code == 0, swarm.log(name)[-3000:]
    _assert_stopped_in_time(swarm, name, took)
    assert swarm.checkpoint(name) is not None
    assert (swarm.tmp / name / "summary.json").exists()
    # the record would live until its expiration: it is gone before that, so it was withdrawn
    assert get_dht_time() < record.expires_at
    assert all(n.public_name != name for n in swarm.nodes().values()), "record not withdrawn"
    assert "Traceback" not in swarm.log(name)


def test_a_node_whose_dht_hangs_still_stops_in_time_and_a_second_signal_exits_at_once(swarm):
    # the DHT process is frozen: every DHT call of the shutdown hangs, and the shutdown must bound them
    frozen = swarm.start("frozen")
    impatient = swarm.start("impatient")
    for name in ("frozen", "impatient"):
        _training_record(swarm, name)
    dht_processes = {
        name: _dht_process(proc.pid) for name, proc in (("frozen", frozen), ("impatient", impatient))
    }
    # killed at the end only if still the same processes: a pid freed meanwhile may be another test's by then
    frozen_tree = {pid: start_time(pid) for dht in dht_processes.values() for pid in (dht, *descendants(dht))}
    try:
        for name, pid in dht_processes.items():
            os.kill(pid, signal.SIGSTOP)
            os.kill(swarm.procs[name].pid, signal.SIGINT)
        sent = time.monotonic()
        # two signals sent together may arrive as one: send the second once the first was taken
        swarm.wait_for(
            lambda: "finishing cleanly" in swarm.log("impatient"), 60, "the first signal to be taken"
        )
        os.kill(impatient.pid, signal.SIGINT)
        assert swarm.wait_exit("impatient", 60) == 128 + signal.SIGINT, swarm.log("impatient")[-3000:]
        assert "second signal: exiting now" in swarm.log("impatient")

        assert swarm.wait_exit("frozen", 120) == 0, swarm.log("frozen")[-3000:]
        took = time.monotonic() - sent
        print(f"\nSIGINT with a frozen DHT: exit 0 after {took:.1f}s")
        _assert_stopped_in_time(swarm, "frozen", took)
        assert swarm.checkpoint("frozen") is not None
        assert "could not withdraw the node record" in swarm.log("frozen")
    finally:
        for pid, started in frozen_tree.items():
            kill_if_same(pid, started)


def _dht_process(node_pid: int) -> int:
    """The node's DHT process: the child that runs p2pd."""
    for child in children(node_pid):
        if any("p2pd" in Path(f"/proc/{pid}/cmdline").read_text() for pid in children(child)):
            return child
    raise AssertionError(f"no DHT process under {node_pid}")
