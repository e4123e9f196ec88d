"""Reachability-aware placement across a real firewall: every node in its own network namespace (see `netns.py`),
one of them behind a NAT-like filter that kills every connection opened to it.

The rule under test (`spes_node.daemon.placement`): a node that takes no inbound connections takes only shards that
already have a reachable holder whenever one exists, even if that leaves it room to spare; placement by coverage
alone would hand it the shards nobody holds, and it would become their sole holder, whose state nobody can
download.

How a node knows that it takes no inbound connections: from `--client-mode`, or from the dial-back check at join
(`spes_node.swarm.reachability`): live peers open fresh connections to it and say whether they could. hivemind's
own start-up check cannot tell (the bootstrap peer "pings back" over the connection the node opened itself), and
between nodes that serve the DHT the harm stays hidden (the NAT'd node dials each of them itself, and they reuse
that connection), but a peer it never dials, such as a client-mode joiner, could not download the shards it alone
held. The last test starts the NAT'd node without the flag.
"""

from __future__ import annotations

import pytest
from netns import Host, HostSwarm, Network, unavailable
from swarm_utils import status_json

from spes_node.daemon.placement import replica_counts
from spes_node.swarm.records import ACTIVE_STATES

REASON = unavailable()
pytestmark = [
    pytest.mark.netns,
    pytest.mark.swarm,
    pytest.mark.skipif(REASON is not None, reason=REASON or ""),
]

LINK_MBIT = 100
"""Fast links: what is tested is who holds what, not bandwidth (`block_inbound` shapes the link it filters)."""
PUBLIC_SHARDS = 2
NAT_ROOM = 3
"""The NAT'd node has room for more shards than the public node holds: placement by coverage alone would give it
the two shards nobody holds."""


@pytest.fixture
def network():
    with Network() as net:
        yield net


@pytest.fixture
def swarm(tmp_path, network):
    swarm = HostSwarm(tmp_path, bootstrap_maddr=network.maddr(), run_id="reach", heartbeat_s=2.0)
    yield swarm
    swarm.close()


def _record(swarm: HostSwarm, name: str):
    """The node's record once it names its shards (None before)."""
    return next((n for n in swarm.nodes().values() if n.public_name == name and n.shards), None)


def _round(swarm: HostSwarm, name: str) -> int:
    node = _record(swarm, name)
    return node.round if node is not None else -1


def _start_public_then_nat(
    swarm: HostSwarm, network: Network, *nat_args: str
) -> tuple[Host, Host, list[int]]:
    """A public node with room for `PUBLIC_SHARDS` joins first; then a node behind the firewall, with room for
    `NAT_ROOM`, joins with `nat_args`. Returns both hosts and the public node's shards."""
    public = network.add_host("public", rate_mbit=LINK_MBIT)
    nat = network.add_host("nat")
    network.block_inbound(nat, LINK_MBIT)
    swarm.start("public", "--shards", str(PUBLIC_SHARDS), "--wait-peers", "2", host=public)
    first = swarm.wait_for(lambda: _record(swarm, "public"), 180, "the public node's record")
    if len(first.shards) != PUBLIC_SHARDS or first.client_mode:
        pytest.fail(f"the public node's record: {first}")  # not an assert: see `_inbound_blocked`
    swarm.start("nat", "--shards", str(NAT_ROOM), "--wait-peers", "2", *nat_args, host=nat)
    return public, nat, sorted(first.shards)


def _inbound_blocked(nat: Host, public: Host) -> None:
    """The firewall works: nothing that listens on the NAT'd host (its p2p daemon, a probe listener) takes a
    connection from the public host, while the NAT'd host connects to the public node. Fails with
    `pytest.fail`, not an AssertionError, so that an expected failure cannot hide a broken setup."""
    public_ports = public.listening_ports()
    if not public_ports or not nat.connects(public.address, public_ports[0]):
        pytest.fail(f"the NAT'd host cannot connect to the public node (ports {public_ports})")
    accepted = nat.accepted_from(public)
    if accepted:
        pytest.fail(f"the NAT'd host accepted connections on ports {accepted}: no firewall")


def test_nat_node_in_client_mode_takes_only_shards_with_a_reachable_holder(swarm, network):
    public, nat, public_shards = _start_public_then_nat(swarm, network, "--client-mode")
    uncovered = sorted(set(range(swarm.cfg.swarm.num_shards)) - set(public_shards))

    record = swarm.wait_for(lambda: _record(swarm, "nat"), 180, "the NAT'd node's record")
    assert record.client_mode
    # room for three, but only the public node's two shards have a reachable holder: it takes those and no more
    assert f"--shards {NAT_ROOM}: room for {NAT_ROOM} of" in swarm.log("nat")
    assert sorted(record.shards) == public_shards, (record.shards, public_shards)
    _inbound_blocked(nat, public)

    # both train and average across the firewall (the NAT'd node as a client), and placement holds
    swarm.wait_for(
        lambda: min(_round(swarm, name) for name in ("public", "nat")) >= 2, 300, "two rounds on both nodes"
    )
    counts = replica_counts(swarm.nodes(), swarm.cfg.swarm.num_shards)
    assert counts == [2 if s in public_shards else 0 for s in range(len(counts))], counts

    summary = status_json(swarm)
    reach = {n["public_name"]: n["reachable"] for n in summary["nodes"]}
    assert reach == {"public": "direct", "nat": "none"}, reach
    by_shard = {s["shard"]: s for s in summary["shards"]}
    assert all(by_shard[s]["reachable_replicas"] >= 1 for s in record.shards), summary["shards"]
    assert summary["unreachable_only"] == []
    # the shards nobody reachable has room for stay untrained rather than held where nobody can download them
    assert summary["no_holder"] == uncovered

    # a reachable node with room for them takes them: now every shard has a reachable holder
    wide = network.add_host("wide", rate_mbit=LINK_MBIT)
    swarm.start("wide", "--shards", str(len(uncovered)), host=wide)
    joined = swarm.wait_for(
        lambda: (n := _record(swarm, "wide")) is not None and n.state in ACTIVE_STATES and n,
        240,
        "the public node with room for the uncovered shards to train",
    )
    assert sorted(joined.shards) == uncovered
    # the public node dialled it back at join: it holds them as a reachable node
    assert not joined.client_mode and "peers reach this node" in swarm.log("wide"), swarm.log("wide")[-3000:]
    summary = status_json(swarm)
    assert summary["no_holder"] == [] and summary["unreachable_only"] == [], summary["shards"]
    assert all(s["reachable_replicas"] >= 1 for s in summary["shards"]), summary["shards"]


def test_nat_node_without_client_mode_is_not_the_sole_holder_of_a_shard(swarm, network):
    public, nat, public_shards = _start_public_then_nat(swarm, network)
    record = swarm.wait_for(lambda: _record(swarm, "nat"), 180, "the NAT'd node's record")
    _inbound_blocked(nat, public)
    # what is true, whatever the record says: only the public node takes inbound connections
    sole = sorted(set(record.shards) - set(public_shards))
    assert not sole, (
        f"the NAT'd node announces itself reachable and is the sole holder of shards {sole} "
        f"(it holds {sorted(record.shards)}, the public node {public_shards})"
    )
    # because the public node could not dial it back: it joined as a client, and says why
    assert record.client_mode and record.maddrs == [], record
    assert "could connect to this node" in swarm.log("nat"), swarm.log("nat")[-3000:]
    log = swarm.log("nat")
    # its DHT serves nobody either, and the command it prints for others names its peers, not its own address
    assert "DHT restarted in client mode" in log, log[-3000:]
    join = next(line for line in log.splitlines() if "to join this swarm: " in line)
    assert f"/ip4/{nat.address}/" not in join and "--peers " in join, join
