"""Whether other peers can open connections to this node: a dial-back check at join.

A node behind NAT or a firewall that was not started with `--client-mode` announces itself reachable, and placement
then gives it shards nobody else holds, which no peer can download. Its own view cannot tell: hivemind's start-up
ping-back reuses the connection the node opened, and p2pd does not report AutoNAT's verdict. So a joining node asks
a few live peers to dial it back (`dial_back`): each opens a fresh TCP connection to the node's listening ports, at
the address it sees the request come from, and says which ones completed.

The server (`DialBackServer`) dials only the requester's own address, as its connection shows it, at most
`MAX_PORTS` ports, one check at a time per requester: a stranger can make it connect to nothing but itself.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Sequence

from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.utils.multiaddr import Multiaddr

from spes_node.proto.state_pb2 import DialBackRequest, DialBackResponse
from spes_node.swarm.relay import CIRCUIT

logger = logging.getLogger(__name__)

HANDLER_PREFIX = "spes_dialback"
MAX_PORTS = 4
CONNECT_TIMEOUT_S = 3.0
MAX_ASKED = 3
"""A joining node asks at most this many live peers."""
ASK_TIMEOUT_S = 10.0
"""How long a joining node waits for their answers."""


def tcp_ports(maddrs: Iterable[str]) -> list[int]:
    """The TCP ports of direct (not relayed) addresses, in order, without repeats, at most `MAX_PORTS`."""
    ports: list[int] = []
    for text in maddrs:
        if CIRCUIT in text:
            continue
        try:
            port = int(Multiaddr(text).value_for_protocol("tcp"))
        except Exception:
            continue
        if port not in ports:
            ports.append(port)
    return ports[:MAX_PORTS]


def direct_hosts(addrs: Iterable[Multiaddr]) -> list[str]:
    """The IP addresses of direct connections among `addrs` (a peer's connections as p2pd lists them)."""
    hosts: list[str] = []
    for addr in addrs:
        if CIRCUIT in str(addr):
            continue
        for protocol in ("ip4", "ip6"):
            try:
                host = addr.value_for_protocol(protocol)
            except Exception:
                continue
            if host and host not in hosts:
                hosts.append(host)
    return hosts


async def can_connect(host: str, port: int, timeout: float = CONNECT_TIMEOUT_S) -> bool:
    """Whether a TCP connection to `host:port` completes within `timeout` seconds (it is closed at once)."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except (OSError, asyncio.TimeoutError):
        return False
    writer.close()
    try:
        await writer.wait_closed()
    except OSError:
        pass
    return True


class DialBackServer:
    """Answers `DialBackRequest`s: connects back to the requester, at its connection's address only."""

    def __init__(self, p2p: P2P, run_id: str):
        self.p2p = p2p
        self.handler_name = f"{HANDLER_PREFIX}.{run_id}"
        self._busy: set[PeerID] = set()

    async def start(self) -> None:
        await self.p2p.add_protobuf_handler(self.handler_name, self._handle, DialBackRequest)

    async def stop(self) -> None:
        await self.p2p.remove_protobuf_handler(self.handler_name)

    async def _handle(self, request: DialBackRequest, context: P2PContext) -> DialBackResponse:
        requester = context.remote_id
        if requester in self._busy:
            return DialBackResponse()
        self._busy.add(requester)
        try:
            peers = await self.p2p.list_peers()
            hosts = [h for info in peers if info.peer_id == requester for h in direct_hosts(info.addrs)]
            if not hosts:  # relayed: there is no address of its own to dial (an error is no verdict)
                raise ValueError("no direct connection to the requester")
            ports = list(dict.fromkeys(p for p in request.ports if 0 < p < 65536))[:MAX_PORTS]
            reached = [port for port in ports if any([await can_connect(host, port) for host in hosts[:2]])]
            return DialBackResponse(reached=reached)
        finally:
            self._busy.discard(requester)


async def dial_back(
    p2p: P2P, peers: Sequence[str], ports: Sequence[int], run_id: str, timeout: float
) -> bool | None:
    """Ask `peers` (at once) to connect back to us on `ports`: True as soon as one did, False when every peer that
    answered within `timeout` seconds reached none, None when none answered (no verdict)."""
    handler = f"{HANDLER_PREFIX}.{run_id}"
    request = DialBackRequest(ports=list(ports)[:MAX_PORTS])

    async def ask(peer: str) -> bool:
        response = await p2p.call_protobuf_handler(
            PeerID.from_base58(peer), handler, request, DialBackResponse
        )
        return bool(response.reached)

    tasks = [asyncio.create_task(ask(peer)) for peer in peers]
    answered = False
    try:
        for next_done in asyncio.as_completed(tasks, timeout=timeout):
            try:
                reached = await next_done
            except asyncio.TimeoutError:
                break
            except Exception as e:  # a peer of an older version, gone, or unreachable: no answer
                logger.debug(f"dial-back request failed: {type(e).__name__}: {e}")
                continue
            if reached:
                return True
            answered = True
    finally:
        for task in tasks:
            task.cancel()
    return False if answered else None
