"""A bare DHT peer that others bootstrap from; with a fixed identity its multiaddr is known in advance."""

from __future__ import annotations

import logging
import signal
import threading

import hivemind
from hivemind.dht.crypto import RSASignatureValidator

from spes_node.identity import load_or_create_identity

logger = logging.getLogger(__name__)


def start_bootstrap(host_maddrs, announce_maddrs=(), identity: str | None = None, peers=()) -> hivemind.DHT:
    if identity:
        load_or_create_identity(identity)
    return hivemind.DHT(
        initial_peers=list(peers) or None,
        host_maddrs=list(host_maddrs),
        announce_maddrs=list(announce_maddrs) or None,
        identity_path=identity,
        record_validators=[RSASignatureValidator()],
        start=True,
    )


def run_bootstrap(host_maddrs, announce_maddrs, identity, peers) -> None:
    dht = start_bootstrap(host_maddrs, announce_maddrs, identity, peers)
    for maddr in dht.get_visible_maddrs():
        print(maddr, flush=True)
    logger.info("bootstrap DHT peer running; Ctrl-C to stop")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    dht.shutdown()
