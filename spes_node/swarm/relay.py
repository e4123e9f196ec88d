"""Circuit relays (libp2p circuit relay v2, which hivemind's p2pd ships) for volunteers behind NAT.

A node with no inbound connectivity runs in client mode: it reaches every peer, no peer reaches it. That is
enough to average (hivemind's client-mode averagers send their tensors and receive the result), but not to
serve its own state: a shard held only by such a node could not be refreshed, exported or handed to a joiner.
With relays, the node reserves a slot on reachable peers (its bootstrap peers by default) and publishes
circuit addresses `<relay>/p2p-circuit/p2p/<self>` in its signed record; a peer that needs its state dials it
through the relay. All-reduce traffic never goes through a relay (the node still averages as a client), only
the state downloads others ask of it.

Any peer whose reachability is public serves as a relay (p2pd's default relay service); `spes-node dht`
declares itself public, since a bootstrap peer that nobody can reach is of no use anyway.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Sequence

logger = logging.getLogger(__name__)

CIRCUIT = "/p2p-circuit"
REACHABILITY = ("auto", "public", "private")

_installed = False


def dht_kwargs(relays: Sequence[str], reachability: str = "auto") -> dict:
    """Keyword arguments for `hivemind.DHT` (passed on to `hivemind.P2P.create`).

    With `relays`, the node asks those peers for relay reservations as soon as it starts. It also declares its
    reachability private: libp2p only looks for relays once it believes it is not reachable, and a node that
    asks for relays knows that already.
    """
    if reachability not in REACHABILITY:
        raise ValueError(f"reachability must be one of {', '.join(REACHABILITY)}, not {reachability!r}")
    kwargs: dict = {}
    if relays:
        _use_static_relays()
        kwargs.update(use_relay=True, use_auto_relay=True, trusted_relays=list(relays))
        reachability = "private" if reachability == "auto" else reachability
    if reachability != "auto":
        kwargs["force_reachability"] = reachability
    return kwargs


def _use_static_relays() -> None:
    """Make p2pd use the given relays at once instead of discovering candidates first.

    With relay discovery on (p2pd's default, and hivemind does not expose the flag), libp2p's autorelay waits
    for four candidate relays or for three minutes, whichever comes first: a small swarm waits the full three
    minutes before its NAT'd nodes become reachable. With discovery off, the trusted relays are the static set
    and a reservation is made within a second of start-up. hivemind builds p2pd's command line in
    `P2P._make_process_args`; this appends one flag to it when trusted relays are given. The DHT starts p2pd in
    a forked child, which inherits the change.
    """
    global _installed
    if _installed:
        return
    from hivemind.p2p import P2P

    make_args = P2P._make_process_args

    def with_static_relays(*args, **kwargs) -> list[str]:
        out = make_args(*args, **kwargs)
        if kwargs.get("autoRelay") and kwargs.get("trustedRelays"):
            out.append("-relayDiscovery=0")
        return out

    P2P._make_process_args = staticmethod(with_static_relays)
    _installed = True


def circuit_maddrs(relays: Iterable[str], peer_id: str) -> list[str]:
    """The addresses at which a node with reservations on `relays` can be dialled."""
    out = []
    for relay in relays:
        relay = relay.rstrip("/")
        if "/p2p/" not in relay:
            raise ValueError(f"relay address {relay!r} does not name the relay's peer id (/p2p/...)")
        out.append(f"{relay}{CIRCUIT}/p2p/{peer_id}")
    return out


def relay_peer_ids(relays: Iterable[str]) -> set[str]:
    """The peer ids (base58) named by relay multiaddrs (`.../p2p/<id>`)."""
    return {relay.rstrip("/").rsplit("/p2p/", 1)[1] for relay in relays if "/p2p/" in relay}


def circuits_of(peer_id: str, maddrs: Iterable[str]) -> list[str]:
    """The circuit addresses among a record's `maddrs` that lead to `peer_id` itself.

    A record is signed by its owner, but what it says is still untrusted: only addresses that end at the
    record's own peer id through a relay are dialled, so a record cannot make us dial an arbitrary peer.
    """
    suffix = f"{CIRCUIT}/p2p/{peer_id}"
    return [m for m in maddrs if m.endswith(suffix) and m.count(CIRCUIT) == 1 and m.startswith("/")]


def serves_state(info) -> bool:
    """Whether peers can reach this node (a `records.NodeInfo`) to download state: directly or by relay."""
    return not info.client_mode or bool(circuits_of(info.peer_id, info.maddrs))


async def dial(p2p, peer, maddrs: Sequence[str]) -> None:
    """Connect to `peer` at `maddrs` (circuit addresses from its record), so that the streams opened next use
    that connection. Errors are left to the stream that follows, which names the peer."""
    addrs = []
    for maddr in maddrs:
        try:
            addrs.append(_WireMaddr(maddr.removesuffix(f"/p2p/{peer.to_base58()}")))
        except Exception as e:
            logger.debug(f"unusable relay address {maddr!r}: {e}")
    if not addrs:
        return
    try:
        await p2p._client.connect(peer, addrs)
    except Exception as e:
        logger.debug(f"dialling {peer} through a relay failed: {type(e).__name__}: {e}")


class _WireMaddr:
    """A multiaddr in the binary form p2pd parses.

    hivemind's multiaddr codec writes a `/p2p/<id>` component as a CIDv1, which p2pd's multiaddr parser
    rejects ("length greater than remaining number of bytes in buffer"); libp2p's wire form is the peer id's
    bare multihash. Other components are written by hivemind's codec as they are.
    """

    def __init__(self, text: str):
        from hivemind.p2p import PeerID
        from hivemind.utils.multiaddr import Multiaddr

        out = bytearray()
        for part in re.split(r"(/p2p/[^/]+|/p2p-circuit)", text):
            if not part:
                continue
            if part == CIRCUIT:
                out += _uvarint(P_CIRCUIT)
            elif part.startswith("/p2p/"):
                multihash = PeerID.from_base58(part[len("/p2p/") :]).to_bytes()
                out += _uvarint(P_P2P) + _uvarint(len(multihash)) + multihash
            else:
                out += Multiaddr(part).to_bytes()
        self._bytes = bytes(out)

    def to_bytes(self) -> bytes:
        return self._bytes


P_P2P, P_CIRCUIT = 421, 290
"""Multicodec codes of the `p2p` and `p2p-circuit` multiaddr protocols."""


def _uvarint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)
