"""Fresh connections for a round (`swarm.fresh_connections`): the p2p daemon closes them, the next request dials
again, and a swarm whose nodes close them every round still averages in full groups."""

from __future__ import annotations

import re

import hivemind
import pytest
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time
from swarm_utils import Swarm, stream_cut_rounds, wait_for

from spes_node.swarm.connections import aged_connections, close_connections, connected_peers
from spes_node.swarm.records import NodeInfo
from spes_node.swarm.relay import relay_peer_ids


@pytest.fixture
def two_dhts():
    a = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    b = hivemind.DHT(
        initial_peers=[str(m) for m in a.get_visible_maddrs()],
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        start=True,
    )
    try:
        yield a, b
    finally:
        b.shutdown()
        a.shutdown()


def test_closing_drops_the_connection_and_the_next_request_dials_again(two_dhts):
    a, b = two_dhts
    b_id = b.peer_id.to_base58()
    wait_for(lambda: b_id in connected_peers(a), 30, "a connection between a and b")
    ports = {_port(m) for dht in (a, b) for m in dht.get_visible_maddrs()}
    before = _established(ports)
    assert before, "no TCP connection between the two daemons"
    assert close_connections(a, [b_id]) == 1
    # the DHT still works between them: a store at one is read at the other, over a new TCP connection (a DHT may
    # dial again at any moment, so the old connection is told from a new one by its socket, not by its absence; the
    # ports may be the same, libp2p dials from its listening port)
    assert b.store("k", "v", expiration_time=get_dht_time() + 60)
    wait_for(
        lambda: getattr(a.get("k", latest=True), "value", None) == "v", 30, "the value stored at b, read at a"
    )
    after = _established(ports)
    assert after and not after & before, (before, after)
    # nothing to close for no peers, and none for a peer the daemon has never met
    assert close_connections(a, []) == 0
    assert close_connections(a, [PeerID(b"\x00\x24" + bytes(36)).to_base58()]) == 0


def test_a_shut_down_dht_is_a_warning_not_an_error(two_dhts, caplog):
    a, b = two_dhts
    b_id = b.peer_id.to_base58()
    a.shutdown()
    assert close_connections(a, [b_id], timeout=5.0) == 0
    assert "could not close the connections" in caplog.text


def test_two_holders_closing_their_connections_every_round_still_average_together(tmp_path):
    # rounds of 10 steps: a node closes a member's connection once the member's record shows it has ended the last
    # round, and the shards' all-reduce of an overlapped round (the default) begins only after the shared one has
    # landed. With 5 tiny steps (about a second) on a loaded machine, both nodes' last rounds were still running at
    # the next sync in 1 of 4 runs, and neither closed anything
    swarm = Swarm(
        tmp_path,
        num_shards=1,
        fresh_connections=True,
        matchmaking_time=30.0,
        averaging_timeout=20.0,
        sync_steps=10,
    )
    try:
        names = ("a", "b")
        for name in names:
            swarm.start(name, "--max-rounds", "3", "--wait-peers", "2")
        for name in names:
            assert swarm.wait_exit(name, 300) == 0, swarm.log(name)[-3000:]
        closed = []
        for name in names:
            rounds = swarm.summary(name)["rounds"]
            assert len(rounds) == 3, rounds
            # a stream cut now and then on a loaded machine (swarm_utils.STREAM_CUT) is allowed in one round
            cut = stream_cut_rounds(rounds)
            assert len(cut) <= 1, (cut, swarm.warnings(names))
            for report in rounds:
                assert report["shared_group"] == 2 and report["shard_groups"] == {"0": 2}, report
                assert report in cut or not report["errors"], (report, swarm.warnings(names))
            log = swarm.log(name)
            assert "Traceback" not in log
            closed += [
                int(n) for n in re.findall(r"closed (\d+) connection\(s\) to last round's members", log)
            ]
        # at the syncs of rounds 2 and 3, a node closes its connection to the other if the other's record shows it
        # has ended the last round (a slower node's may not yet), and if the other has not closed it first
        assert 1 <= len(closed) <= 4 and sum(closed) >= 1, closed
    finally:
        swarm.close()


def _port(maddr) -> int:
    return int(str(maddr).split("/tcp/")[1].split("/")[0])


def _established(ports: set[int]) -> set[tuple[int, int, int]]:
    """The established IPv4 TCP connections on this machine with an end at one of `ports`: (local port, remote
    port, socket inode), each connection seen from both of its ends."""
    out = set()
    with open("/proc/net/tcp") as table:
        for line in list(table)[1:]:
            fields = line.split()
            local, remote, state = (
                int(fields[1].split(":")[1], 16),
                int(fields[2].split(":")[1], 16),
                fields[3],
            )
            if state == "01" and (local in ports or remote in ports):
                out.add((local, remote, int(fields[9])))
    return out


def test_only_members_that_ended_the_round_and_can_be_dialled_again_are_chosen():
    def node(peer: str, round: int, client_mode: bool = False, state: str = "training") -> NodeInfo:
        return NodeInfo(peer_id=peer, shards=[0], round=round, client_mode=client_mode, state=state)

    nodes = {
        "ended": node("ended", 3),
        "ahead": node("ahead", 4),
        "still_in_it": node("still_in_it", 2),
        "at_its_sync": node("at_its_sync", 3, state="averaging"),
        "client": node("client", 3, client_mode=True),
        "relay": node("relay", 3),
    }
    members = ["ended", "ahead", "still_in_it", "at_its_sync", "client", "relay", "no_record"]
    assert aged_connections(members, nodes, last_round=3, keep={"relay"}) == ["ended", "ahead"]
    assert aged_connections([], nodes, last_round=3) == []
    relay_id = "12D3KooWRdRQFxnbcrMzRPBJmPNLsHvTMRSKKc1aPkd3mK5z4YpR"
    assert relay_peer_ids([f"/ip4/10.0.0.1/tcp/4000/p2p/{relay_id}/", "/ip4/10.0.0.2/tcp/4000"]) == {relay_id}
