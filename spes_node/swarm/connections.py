"""Fresh connections for a round's all-reduces: the node's p2p daemon closes its connections to the peers it is
about to average with, and matchmaking dials them again.

Why (`benchmarks.link_utilisation --fresh`, docs/performance.md): among 3 peers on 50 Mbit/s links, the third and
later all-reduces over the same connections ran at 0.70-0.75 of the link, against 0.83-0.89 for the first two; with
the connections reset before every all-reduce, all of them ran at 0.84-0.90. The state that slows them lives in a
connection that has carried two all-reduces (not in the averager's process, the congestion control, the kernel's
socket buffers or the reducer's window); which layer holds it is not known.

A closed connection costs a new handshake and TCP's slow start, well under a second against an all-reduce of
seconds to minutes. A node closes its connections only at the sync, once its own refresh downloads have landed,
and only to peers whose records show they have ended the last round (a peer still receiving the last results of
that round would lose them). A download that a peer is taking from us then is cut and asked again (`split.py`),
and a DHT request in flight fails and is retried by its caller.

Never closed: connections to a client-mode peer (no inbound connectivity: only it can dial again, and if it
reserved a relay slot on us, closing would end the reservation its circuit address depends on) and to the peers
this node holds its own relay reservations on.
"""

from __future__ import annotations

import logging
from collections.abc import Container, Iterable, Mapping
from functools import partial

from hivemind import DHT
from hivemind.p2p import PeerID

from spes_node.swarm.records import NodeInfo

logger = logging.getLogger(__name__)


def aged_connections(
    members: Iterable[str], nodes: Mapping[str, NodeInfo], last_round: int, keep: Container[str] = ()
) -> list[str]:
    """The peers among the last round's group `members` whose connections to close before the next round: those
    whose records show they have ended round `last_round` and are not at their sync yet, that peers can dial (not
    client mode), and not in `keep` (the node's own relays).

    A peer at its sync already ("averaging") came there first and closed its connection to us then, and its
    matchmaking may be running on the new one: closing that would cut it. So each pair's connection is closed once
    a round, by whichever of the two reaches the sync first (both, when they read each other's records before
    either says it is averaging)."""
    return [
        peer
        for peer in members
        if (info := nodes.get(peer)) is not None
        and info.round >= last_round
        and info.state != "averaging"
        and not info.client_mode
        and peer not in keep
    ]


def close_connections(dht: DHT, peers: Iterable[str], timeout: float = 10.0) -> int:
    """Ask the node's p2p daemon to close its connections to `peers` (base58 ids); returns how many it closed. A
    peer with no connection, or one the daemon fails to close, is skipped (the failure is logged); nothing raises."""
    ids = tuple(PeerID.from_base58(peer).to_bytes() for peer in peers)
    if not ids:
        return 0
    try:
        return dht.run_coroutine(partial(_close_in_dht, ids), return_future=True).result(timeout=timeout)
    except Exception as e:  # a DHT process that is shutting down or stalled: the round goes on as it is
        logger.warning(f"could not close the connections to {len(ids)} peer(s): {type(e).__name__}: {e}")
        return 0


def connected_peers(dht: DHT, timeout: float = 10.0) -> dict[str, list[str]]:
    """The peers (base58 ids) the node's p2p daemon holds connections to, with each connection's remote address
    (a new connection to the same peer has another: at least the dialling side's port differs)."""
    return dht.run_coroutine(_list_in_dht, return_future=True).result(timeout=timeout)


async def _list_in_dht(_dht, node) -> dict[str, list[str]]:
    peers: dict[str, list[str]] = {}
    for info in await node.p2p.list_peers():
        peers.setdefault(info.peer_id.to_base58(), []).extend(str(addr) for addr in info.addrs)
    return peers


async def _close_in_dht(ids: tuple[bytes, ...], _dht, node) -> int:
    """Runs in the DHT process, which owns the p2p daemon's control connection (`DHT.run_coroutine`)."""
    connected = await _list_in_dht(_dht, node)
    closed = 0
    for raw in ids:
        peer = PeerID(raw)
        if peer.to_base58() not in connected:
            continue
        try:
            await node.p2p._client.disconnect(peer)
            closed += 1
        except Exception as e:
            logger.debug(f"p2pd did not close the connection to {peer}: {type(e).__name__}: {e}")
    return closed
