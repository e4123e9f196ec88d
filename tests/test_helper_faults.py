"""A node's averager process killed under it (as the OOM killer does, which picks the largest helper): the node
starts a new one at its next round and averages that group with its peers again. Real daemons on 127.0.0.1."""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from pathlib import Path

import hivemind
import pytest
from swarm_utils import Swarm, launch, running, wait_for

from spes_node.procs import children, descendants, kill_if_same, kill_tree, start_time
from spes_node.swarm.watchdog import DHTWatch, p2pd_exit_code

pytestmark = pytest.mark.swarm

RESTARTED = re.compile(
    r"shard0: the averager (process exited \(code -9\)|did not take or end its step in time): starting a new one"
)


def _helpers(pid: int, name: str) -> list[int]:
    """The node's descendant processes called `name` (helpers name themselves: `procs.bind_to_parent`)."""
    found = []
    for child in descendants(pid):
        try:
            if Path(f"/proc/{child}/comm").read_text().strip() == name:
                found.append(child)
        except OSError:  # gone meanwhile
            continue
    return found


def test_a_node_whose_averager_was_killed_starts_a_new_one_and_averages_that_group_again(tmp_path):
    swarm = Swarm(tmp_path, num_shards=1)
    try:
        for name in ("a", "b"):
            swarm.start(name, "--wait-peers", "2")
        swarm.wait_for(lambda: "round 2 done" in swarm.log("a"), 240, "a's round 2")
        (killed,) = _helpers(swarm.procs["a"].pid, "spes-shard0")
        os.kill(killed, signal.SIGKILL)

        def averaged_again():
            log = swarm.log("a")
            restart = RESTARTED.search(log)
            # a round that a's new averager of shard 0 took part in, with b
            return (
                restart
                if restart and re.search(r"round \d+ done: .*shard 0 group 2", log[restart.end() :])
                else None
            )

        restart = swarm.wait_for(averaged_again, 300, "a new averager of shard 0 to average with b")
        print(f"\n{restart[0]}")
        (new,) = _helpers(swarm.procs["a"].pid, "spes-shard0")
        assert new != killed
        for name in ("a", "b"):
            swarm.procs[name].send_signal(signal.SIGTERM)
        for name in ("a", "b"):
            assert swarm.wait_exit(name, 120) == 0, swarm.log(name)[-3000:]
        # the round that replaced it says so in its report (status shows a round's errors)
        said = [
            e
            for r in swarm.summary("a")["rounds"]
            for e in r["errors"]
            if e.startswith("shard0: the averager")
        ]
        assert len(said) == 1 and said[0].endswith("a new one started"), said
        # the new averager is one of the node's helpers: it ends with the node
        swarm.wait_for(lambda: not Path(f"/proc/{new}").exists(), 60, "the new averager to end with its node")
    finally:
        swarm.close()


def test_a_node_whose_dht_process_died_stops_with_its_checkpoint_and_one_line_and_leaves_no_p2pd(tmp_path):
    """Without its DHT process a node reaches nobody: it used to train on alone for good, every DHT call waiting out
    its 30 s timeout, and the killed process's p2pd outlived the node. It stops now, for a supervisor to restart."""
    swarm = Swarm(tmp_path, num_shards=1)
    try:
        swarm.start("a")
        swarm.wait_for(lambda: "round 2 done" in swarm.log("a"), 240, "a's round 2")
        (dht,) = _helpers(swarm.procs["a"].pid, "spes-dht")
        p2pd = [(pid, start_time(pid)) for pid in children(dht)]
        assert p2pd, "the DHT process runs p2pd"
        os.kill(dht, signal.SIGKILL)
        swarm.expected_deaths.add("a")
        code = swarm.wait_exit("a", 180)
        log = swarm.log("a")
        assert code == 1, log[-3000:]
        errors = [line for line in log.splitlines() if line.startswith("spes-node: error:")]
        assert len(errors) == 1 and "the DHT process exited (code -9)" in errors[0], log[-3000:]
        assert "Traceback" not in log, log[-3000:]
        # the final checkpoint holds the last step trained
        last_step = max(int(step) for step in re.findall(r"step (\d+) round", log))
        assert swarm.checkpoint("a").step >= last_step
        # p2pd ends with the node: the node kills it as it stops (`NodeDHT.end_orphans`), where it would otherwise
        # live until its next write to its stdout, a pipe to the dead process
        swarm.wait_for(lambda: not any(running(*p) for p in p2pd), 30, "the orphaned p2pd to end")
    finally:
        swarm.close()


def test_the_watch_tells_a_dht_process_that_serves_from_one_that_hangs_or_died():
    """Real DHT processes: one that answers is never reported, however long it runs; one stopped (SIGSTOP, as a
    process wedged on a lock) is reported hung once it has not answered for `hang_s`; a killed one, at once."""
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    # orphaned by the kill below, and ended at the end
    p2pd = [(pid, start_time(pid)) for pid in children(dht.pid)]
    try:
        # well above an answer's delay on a loaded machine (a pipe and a loop)
        watch = DHTWatch(dht, hang_s=5.0)
        answering_since = time.monotonic()
        while time.monotonic() - answering_since < 10.0:  # twice hang_s, every answer in time
            assert watch.problem() is None
            time.sleep(0.1)
        os.kill(dht.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        problem = wait_for(watch.problem, 60, "the stopped DHT process to be reported")
        assert "has not answered for" in problem and "(hung)" in problem, problem
        assert time.monotonic() - stopped >= 5.0
        # a machine suspended with a call in flight: on waking, the call is late but answered by the next checks
        woken = DHTWatch(dht, hang_s=5.0)
        assert woken.problem() is None  # sends its call, which the stopped process leaves unanswered
        woken._answered -= 3600  # as if the machine had slept for an hour since
        assert woken.problem() is None, "one late check is no hang"
        os.kill(dht.pid, signal.SIGCONT)
        wait_for(woken._probe.done, 30, "the late call to be answered")
        assert woken.problem() is None and woken._unanswered_checks == 0
        os.kill(dht.pid, signal.SIGKILL)
        dht.join(30)
        assert watch.problem() == "the DHT process exited (code -9)"
    finally:
        for pid, started in [(dht.pid, start_time(dht.pid)), *p2pd]:
            kill_if_same(pid, started)


def test_the_watch_tells_a_dht_process_whose_p2pd_died():
    """Without p2pd the DHT process answers, but reaches no one (nor do the averagers, which use the same p2pd)."""
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        watch = DHTWatch(dht, hang_s=60.0)
        (p2pd,) = children(dht.pid)
        assert watch.problem() is None
        os.kill(p2pd, signal.SIGKILL)
        problem = wait_for(watch.problem, 60, "the DHT process without p2pd to be reported")
        assert problem == "the DHT process's p2pd exited (code -9)", problem
    finally:
        dht.shutdown()


def _shm_bytes(pids) -> dict[str, int]:
    """torch's shared-memory files in /dev/shm made by `pids` (named torch_<pid>_...), with their sizes."""
    found = {}
    for pid in pids:
        for path in Path("/dev/shm").glob(f"torch_{pid}_*"):
            try:
                found[path.name] = path.stat().st_size
            except OSError:  # removed meanwhile
                continue
    return found


def test_a_node_killed_with_all_its_processes_leaves_its_averagers_buffers_nowhere(tmp_path):
    """systemd's stop signals every process of a service at once, torch's shm manager included, and so does the
    kill of a network namespace's processes; a file in /dev/shm (memory) that the manager did not remove stays until
    the machine restarts. The averagers' buffers (at spes-7b several GiB) must not be such files."""
    swarm = Swarm(tmp_path, num_shards=1)
    try:
        node = swarm.start("a", "--wait-peers", "1")
        swarm.wait_for(lambda: "round 2 done" in swarm.log("a"), 240, "round 2")
        # the DHT and averager processes, p2pd, torch's shm manager (its name cut to 15 bytes by the kernel)
        tree = [node.pid, *descendants(node.pid)]
        assert _helpers(node.pid, "torch_shm_manag"), "no shm manager to kill: the test shows nothing"
        swarm.expected_deaths.add("a")
        kill_tree(node.pid)
        node.wait(30)
        wait_for(lambda: not any(running(pid) for pid in tree), 60, "every process of the node to end")
    finally:
        swarm.close()
    left = _shm_bytes(tree)
    for name in left:  # the machine's memory back before anything is asserted
        (Path("/dev/shm") / name).unlink(missing_ok=True)
    # hivemind's own small shared buffers (its futures' states) may stay: bytes, not the groups' tensors
    assert sum(left.values()) < 4096, f"left in /dev/shm: {left}"


def _p2pd_below(pid: int) -> int:
    return wait_for(lambda: next(iter(_helpers(pid, "p2pd")), None), 60, "p2pd")


def test_a_bootstrap_whose_p2pd_exited_says_so_and_exits_for_its_supervisor_to_restart_it(tmp_path):
    """`spes-node dht` without p2pd would answer nobody for good; docker compose restarts it if it exits."""
    out = tmp_path / "dht.log"
    proc = launch(
        [sys.executable, "-m", "spes_node.cli", "dht", "--host-maddrs", "/ip4/127.0.0.1/tcp/0"], out
    )
    try:
        wait_for(lambda: "/p2p/" in out.read_text(), 120, "the bootstrap's multiaddr")
        # what the test bootstrap's p2pd met (`Swarm.keep_bootstrap`)
        os.kill(_p2pd_below(proc.pid), signal.SIGTERM)
        code = proc.wait(120)
        text = out.read_text()
        assert code == 1, text
        assert "Traceback" not in text, text
        errors = [line for line in text.splitlines() if line.startswith("spes-node: error")]
        # p2pd exits 143 on SIGTERM, or 0 when the DHT's connection to it closed first
        assert len(errors) == 1 and re.fullmatch(
            r"spes-node: error: the DHT process's p2pd exited \(code (0|143)\): the bootstrap DHT peer stopped; "
            r"start it again",
            errors[0],
        ), text
        assert not descendants(proc.pid)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


def test_the_test_swarm_starts_its_bootstrap_again_should_its_p2pd_exit(tmp_path):
    """The tests' bootstrap is infrastructure (`Swarm.keep_bootstrap`): after its p2pd exits, records of nodes that
    joined before and after show up again, and a node started afterwards joins at the same address."""
    swarm = Swarm(tmp_path)
    try:
        swarm.start("a", "--shard", "0")
        swarm.wait_for(lambda: any(n.public_name == "a" for n in swarm.nodes().values()), 120, "a's record")
        maddr = swarm.maddr
        os.kill(_p2pd_below(swarm.bootstrap.pid), signal.SIGTERM)
        wait_for(lambda: p2pd_exit_code(swarm.bootstrap) is not None, 60, "p2pd to exit")
        with pytest.warns(UserWarning, match="bootstrap p2pd exited"):
            swarm.start("b", "--shard", "1")
        assert swarm.maddr == maddr and len(swarm.bootstrap_restarts) == 1
        names = lambda: {n.public_name for n in swarm.nodes().values()}  # noqa: E731
        swarm.wait_for(lambda: names() >= {"a", "b"}, 120, "both records", seen=lambda: str(names()))
        swarm.wait_for(lambda: "shared group 2" in swarm.log("b"), 240, "b averaging with a")
    finally:
        swarm.close()
