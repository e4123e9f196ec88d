"""Multi-host tests: every node in its own network namespace on a shaped link (see `netns.py`).

They need root and iproute2 (CI runs as root); elsewhere they skip with the reason.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
from netns import HostSwarm, Network, unavailable
from swarm_utils import NODE_ENV, run_captured

from spes_node.daemon.placement import replica_counts

REASON = unavailable()
pytestmark = [
    pytest.mark.netns,
    pytest.mark.swarm,
    pytest.mark.skipif(REASON is not None, reason=REASON or ""),
]

RATE_MBIT = 5
"""Every link: a few Mbit/s each way, so what crosses the simulated internet is what limits the rounds."""
RELAY_TEST_MBIT = 100
ALLREDUCE_BYTES = 50_000
"""A node sends about 1 MB of its parts per tiny round; heartbeats and DHT traffic are a few kB."""
ALLREDUCE_BEGINS = "peers begins"
"""What a node logs at debug level when one of its all-reduces starts (`robust.py`)."""


@pytest.fixture
def network():
    with Network() as net:
        yield net


@pytest.fixture
def net_swarm(tmp_path, network):
    made: list[HostSwarm] = []

    def make(**overrides) -> HostSwarm:
        made.append(HostSwarm(tmp_path, bootstrap_maddr=network.maddr(), **overrides))
        return made[-1]

    yield make
    for swarm in made:
        swarm.close()


def _by_name(swarm: HostSwarm) -> dict:
    return {n.public_name: n for n in swarm.nodes().values()}


def _sent_bytes(host) -> int:
    """Bytes the host has sent on its link (what its end of the bridge received)."""
    return int(Path(f"/sys/class/net/{host.veth}/statistics/rx_bytes").read_text())


def _round(swarm: HostSwarm, name: str) -> int:
    """The node's round as its record says (-1 while the record is missing, e.g. between two heartbeats)."""
    node = _by_name(swarm).get(name)
    return node.round if node is not None else -1


def test_kill_mid_allreduce_then_a_new_node_takes_the_weak_shard(network, net_swarm, tmp_path):
    swarm = net_swarm(num_shards=2, heartbeat_s=2.0, averaging_timeout=15.0)
    names = [f"n{i}" for i in range(4)]
    hosts = {name: network.add_host(name, rate_mbit=RATE_MBIT) for name in [*names, "joiner"]}
    for name in names:
        env = {"SPES_LOG_LEVEL": "DEBUG"} if name == "n3" else None
        swarm.start(name, "--wait-peers", "4", host=hosts[name], env=env)
    swarm.wait_for(lambda: min((n.round for n in _by_name(swarm).values()), default=0) >= 1, 300, "round 1")

    victim_name = "n3"
    victim = swarm.wait_for(lambda: _by_name(swarm).get(victim_name), 30, "the victim's record")
    # the victim logs (at debug level) when an all-reduce begins; the kill comes once its parts are on the wire
    assembled = swarm.log(victim_name).count(ALLREDUCE_BEGINS)
    swarm.wait_for(
        lambda: swarm.log(victim_name).count(ALLREDUCE_BEGINS) > assembled, 120, "the victim's next group"
    )
    sent = _sent_bytes(hosts[victim_name])
    swarm.wait_for(lambda: _sent_bytes(hosts[victim_name]) - sent > ALLREDUCE_BYTES, 30, "the victim's parts")
    killed_at = time.monotonic()
    swarm.crash(victim_name)
    survivors = names[:3]
    rounds_at_kill = {name: _round(swarm, name) for name in survivors}

    # the others finish that round within its timeout and keep training
    budget = 2 * swarm.cfg.swarm.matchmaking_time + swarm.cfg.swarm.averaging_timeout + 30
    swarm.wait_for(
        lambda: all(_round(swarm, name) >= max(rounds_at_kill.values()) + 2 for name in survivors),
        2 * budget,
        "the survivors to finish two more rounds",
    )
    assert time.monotonic() - killed_at < 2 * budget

    # the victim's record expires; its shard is weaker but still held
    swarm.wait_for(lambda: victim_name not in _by_name(swarm), 60, "the victim's record to expire")
    counts = replica_counts(swarm.nodes(), swarm.cfg.swarm.num_shards)
    assert min(counts) >= 1, f"a shard lost its last replica: {counts}"
    weak = counts.index(min(counts))
    assert weak == victim.shards[0] and counts[weak] < swarm.cfg.swarm.replication_target

    joined_at = time.monotonic()
    swarm.start("joiner", host=hosts["joiner"])
    joiner = swarm.wait_for(
        lambda: (n := _by_name(swarm).get("joiner")) is not None and n.state == "training" and n.shards and n,
        180,
        "the joiner to train",
    )
    assert joiner.shards == [weak]
    swarm.wait_for(lambda: _round(swarm, "joiner") > joiner.round, 180, "the joiner to finish a round")
    seconds_to_train = time.monotonic() - joined_at
    # a joiner whose download outlasted the swarm's round starts a little out of step; within three rounds it
    # meets the others (the survivors wait for a node expected within a round)
    swarm.wait_for(
        lambda: _round(swarm, "joiner") >= joiner.round + 3, 180, "the joiner to finish three rounds"
    )
    swarm.wait_for(
        lambda: replica_counts(swarm.nodes(), swarm.cfg.swarm.num_shards) == [2, 2],
        30,
        "two replicas per shard",
    )

    for name in [*survivors, "joiner"]:
        swarm.procs[name].send_signal(signal.SIGTERM)
    for name in [*survivors, "joiner"]:
        assert swarm.wait_exit(name, 120) == 0, swarm.log(name)[-3000:]
    for name in survivors:
        rounds = swarm.summary(name)["rounds"]
        assert all(r["seconds"] < budget for r in rounds), rounds
    summary = swarm.summary("joiner")
    assert max(r["shared_group"] for r in summary["rounds"]) >= 2, summary["rounds"]
    report = {
        "link_mbit": RATE_MBIT,
        "join_seconds": summary["join_seconds"],
        "seconds_from_start_to_first_round": round(seconds_to_train, 1),
        "state_download_bytes": summary["bytes_received"].get("state_download", 0),
    }
    (tmp_path / "join_report.json").write_text(json.dumps(report, indent=1))
    print(f"\njoin over a {RATE_MBIT} Mbit/s link: {report}")
    assert "downloaded the swarm state" in swarm.log("joiner")


def test_client_without_inbound_connectivity_trains_and_averages(network, net_swarm):
    swarm = net_swarm(num_shards=2, heartbeat_s=2.0)
    servers = {name: network.add_host(name, rate_mbit=RATE_MBIT) for name in ("s0", "s1")}
    client = network.add_host("client")
    network.block_inbound(client, RATE_MBIT)

    swarm.start("s0", "--shard", "0", "--wait-peers", "3", host=servers["s0"])
    swarm.start("s1", "--shard", "1", "--wait-peers", "3", host=servers["s1"])
    swarm.start(
        "client", "--shard", "0", "--wait-peers", "3", "--client-mode", "--max-rounds", "3", host=client
    )
    # the client's record can come before a loaded server's: it needs only the bootstrap peer
    swarm.wait_for(
        lambda: {"s0", "s1", "client"} <= set(_by_name(swarm)),
        180,
        "the three records",
        seen=lambda: str(sorted(_by_name(swarm))),
    )
    s0_ports = swarm.wait_for(servers["s0"].listening_ports, 60, "s0's listener")

    # the client reaches the others; nobody reaches the client, whatever listens there
    assert client.connects(servers["s0"].address, s0_ports[0])
    accepted = client.accepted_from(servers["s1"])
    assert not accepted, f"the client accepted on ports {accepted}"

    assert swarm.wait_exit("client", 300) == 0, swarm.log("client")[-3000:]
    summary = swarm.summary("client")
    assert summary["rounds_done"] == 3
    # it averaged as a client with both servers (shared) and with its shard's replica. On a loaded machine a round
    # may miss a group (hivemind's leader can begin its all-reduce just as a follower's search ends: the follower
    # averages alone, the leader without its part), so any of the three rounds counts
    rounds = [
        {
            k: r[k]
            for k in ("round", "shared_group", "shard_groups", "failed_parts", "errors", "banned", "phases")
        }
        for r in summary["rounds"]
    ]
    assert any(r["shared_group"] == 3 and r["shard_group"] == 2 for r in summary["rounds"]), (
        rounds,
        swarm.warnings(("s0", "s1", "client")),
    )
    assert summary["loss_history"][-1] < summary["first_loss"]


def test_client_behind_nat_is_reachable_through_a_relay(network, net_swarm, tmp_path):
    """The only holder of shard 1 takes no inbound connections; with --auto-relay it holds a reservation on the
    bootstrap peer and publishes circuit addresses. A peer that never met it reaches its state server through
    the relay (without the circuit address it cannot reach it at all).

    Full-size state transfers through the relay are attempted and reported, not asserted: streams to and from
    this NAT'd host are at times cut after their first 64 kB chunk (see the closing note of issue 5)."""
    swarm = net_swarm(num_shards=2, heartbeat_s=2.0)
    public = network.add_host("public", rate_mbit=RELAY_TEST_MBIT)
    nat = network.add_host("nat")
    network.block_inbound(nat, RELAY_TEST_MBIT)
    other = network.add_host("other", rate_mbit=RELAY_TEST_MBIT)

    swarm.start("public", "--shard", "0", "--wait-peers", "2", host=public)
    swarm.start("nat", "--shard", "1", "--wait-peers", "2", "--client-mode", "--auto-relay", host=nat)
    swarm.wait_for(lambda: min(_round(swarm, n) for n in ("public", "nat")) >= 2, 300, "two rounds")
    record = _by_name(swarm)["nat"]
    assert record.client_mode and record.shards == [1]
    circuits = [m for m in record.maddrs if "/p2p-circuit/" in m]
    assert circuits and all(m.startswith(swarm.maddr) for m in circuits), record.maddrs

    probe = run_captured(
        other.command(sys.executable, "-c", RELAY_PROBE, swarm.maddr, str(swarm.config_path), record.peer_id,
                      swarm.run_id, *circuits),
        timeout=240, env={**os.environ, **NODE_ENV},
    )  # fmt: skip
    assert probe.returncode == 0, probe.stdout[-2000:] + probe.stderr[-3000:]
    outcome = json.loads(probe.stdout.strip().splitlines()[-1])
    print(f"\nthe NAT'd node from a third host: {outcome}")
    # without the circuit address the node cannot be dialled; through the relay its state server answers
    assert "Connect failed" in outcome["direct"], outcome
    assert outcome["relayed_request"] == "answered", outcome
    for name in ("public", "nat"):
        swarm.procs[name].send_signal(signal.SIGTERM)
    for name in ("public", "nat"):
        assert swarm.wait_exit(name, 120) == 0, swarm.log(name)[-3000:]


RELAY_PROBE = """
import asyncio, json, sys
import hivemind, torch
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import PeerID
from spes_node.config import load_config
from spes_node.model.moe import MoEForCausalLM
from spes_node.model.ownership import shard_tensors
from spes_node.swarm.transfer import TransferError, download_part

boot, config_path, peer, run_id, *circuits = sys.argv[1:]
cfg = load_config(config_path)
with torch.device("meta"):
    expected = {k: v.shape for k, v in shard_tensors(MoEForCausalLM(cfg.model, cfg.swarm.num_shards), 1).items()}
dht = hivemind.DHT(initial_peers=[boot], client_mode=True, record_validators=[RSASignatureValidator()], start=True)
outcome = {}

async def main():
    p2p = await dht.replicate_p2p()
    peer_id = PeerID.from_base58(peer)
    try:
        await download_part(p2p, peer_id, run_id, cfg.hash(), "shard:1", expected, timeout=20)
        outcome["direct"] = "ok"
    except TransferError as e:
        outcome["direct"] = f"failed: {e}"[:200]
    # a request the server answers with a short "no such state": the handler was reached through the relay
    try:
        await download_part(p2p, peer_id, run_id, cfg.hash(), "premerge:0", {}, timeout=60, circuits=circuits)
        outcome["relayed_request"] = "served?"
    except TransferError as e:
        outcome["relayed_request"] = "answered" if "no such state" in str(e) else f"failed: {e}"[:200]
    try:
        got = await download_part(p2p, peer_id, run_id, cfg.hash(), "shard:1", expected, timeout=60, circuits=circuits)
        outcome["relayed_shard"] = f"ok: {got.nbytes} bytes in {got.seconds:.2f} s"
    except TransferError as e:
        outcome["relayed_shard"] = f"failed: {e}"[:200]

asyncio.run(main())
print(json.dumps(outcome))
dht.shutdown()
"""
