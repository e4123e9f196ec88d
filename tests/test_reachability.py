"""The dial-back check: peers connect back to a joining node, at the address they see it at, and say whether they
could. Real P2P peers on 127.0.0.1; the namespace test (a firewalled node) is in `test_netns_placement.py`."""

from __future__ import annotations

import asyncio
import socket

from hivemind.p2p import P2P
from hivemind.utils.multiaddr import Multiaddr

from spes_node.proto.state_pb2 import DialBackRequest, DialBackResponse
from spes_node.swarm.reachability import DialBackServer, dial_back, direct_hosts, tcp_ports

RUN = "reach"
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
PEER = "QmPYCTr6mLuQptqC1eGxKKoy6UQbAsQnFsCVgC4Eqi3Ewu"


def test_the_ports_and_hosts_come_from_direct_addresses_only():
    maddrs = [
        "/ip4/127.0.0.1/tcp/4001",
        f"/ip4/10.0.0.2/tcp/4001/p2p/{PEER}",
        "/ip6/::1/tcp/4002",
        f"/ip4/10.0.0.9/tcp/5000/p2p/{PEER}/p2p-circuit",
        "/ip4/127.0.0.1/udp/4003/quic",
        "not an address",
    ]
    assert tcp_ports(maddrs) == [4001, 4002]
    assert tcp_ports([f"/ip4/127.0.0.1/tcp/{p}" for p in range(1000, 1010)]) == [1000, 1001, 1002, 1003]
    addrs = [Multiaddr(m) for m in maddrs[:4]]
    assert direct_hosts(addrs) == ["127.0.0.1", "10.0.0.2", "::1"]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _check(ports_of_listener: bool, with_server: bool = True) -> tuple[bool | None, float]:
    """A server peer (answering dial-backs, or not) and a requester that listens on one port, asking the server to
    dial it back on that port (or on one where nothing listens)."""
    server = await P2P.create(host_maddrs=LOOPBACK)
    dial = DialBackServer(server, RUN)
    if with_server:
        await dial.start()
    maddrs = [str(a) for a in await server.get_visible_maddrs()]
    requester = await P2P.create(host_maddrs=LOOPBACK, initial_peers=maddrs)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    try:
        port = listener.getsockname()[1] if ports_of_listener else _closed_port()
        loop = asyncio.get_running_loop()
        started = loop.time()
        verdict = await dial_back(requester, [server.peer_id.to_base58()], [port], RUN, timeout=30.0)
        return verdict, loop.time() - started
    finally:
        listener.close()
        for p2p in (requester, server):
            await p2p.shutdown()


def test_a_peer_that_connects_back_says_so():
    verdict, _ = asyncio.run(_check(ports_of_listener=True))
    assert verdict is True


def test_a_peer_that_cannot_connect_back_says_so():
    verdict, _ = asyncio.run(_check(ports_of_listener=False))
    assert verdict is False


def test_peers_that_do_not_answer_give_no_verdict():
    # a peer of an older version, without the handler: the node stays as it announced itself
    verdict, seconds = asyncio.run(_check(ports_of_listener=True, with_server=False))
    assert verdict is None
    assert seconds < 30.0, "an error is an answer of no verdict, not a wait for the timeout"


def test_one_honest_peer_outweighs_peers_that_say_they_could_not():
    """A hostile peer, built on hivemind's public API, answers every dial-back with "reached nothing" (to make
    the node join as a client and hold fewer shards); an honest peer that reached the node decides."""

    async def check() -> bool | None:
        liar, honest = await P2P.create(host_maddrs=LOOPBACK), await P2P.create(host_maddrs=LOOPBACK)

        async def lie(_request: DialBackRequest, _context) -> DialBackResponse:
            return DialBackResponse()

        await liar.add_protobuf_handler(f"spes_dialback.{RUN}", lie, DialBackRequest)
        await DialBackServer(honest, RUN).start()
        maddrs = [str(a) for p2p in (liar, honest) for a in await p2p.get_visible_maddrs()]
        requester = await P2P.create(host_maddrs=LOOPBACK, initial_peers=maddrs)
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        try:
            peers = [liar.peer_id.to_base58(), honest.peer_id.to_base58()]
            lied = await dial_back(requester, peers[:1], [listener.getsockname()[1]], RUN, timeout=30.0)
            assert lied is False, "the liar alone decides for a node that asks only it"
            return await dial_back(requester, peers, [listener.getsockname()[1]], RUN, timeout=30.0)
        finally:
            listener.close()
            for p2p in (requester, liar, honest):
                await p2p.shutdown()

    assert asyncio.run(check()) is True
