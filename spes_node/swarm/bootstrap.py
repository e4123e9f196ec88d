"""A bare DHT peer that others bootstrap from; with a fixed identity its multiaddr is known in advance."""

from __future__ import annotations

import logging
import signal
import threading

import hivemind

from spes_node.procs import NodeDHT
from spes_node.swarm import records, relay
from spes_node.swarm.identity import load_or_create_identity

logger = logging.getLogger(__name__)


def start_bootstrap(
    host_maddrs,
    announce_maddrs=(),
    identity: str | None = None,
    peers=(),
    reachability: str = "public",
    swarm_key=None,
) -> hivemind.DHT:
    """A DHT peer that stores records and, with public reachability, serves as a circuit relay for NAT'd nodes
    (see `spes_node.swarm.relay`); with `swarm_key` (a `SwarmKey`) it talks only to peers that hold the key."""
    if identity:
        load_or_create_identity(identity)
    return NodeDHT(
        initial_peers=list(peers) or None,
        host_maddrs=list(host_maddrs),
        announce_maddrs=list(announce_maddrs) or None,
        identity_path=identity,
        record_validators=records.record_validators(),
        authorizer=swarm_key.authorizer() if swarm_key else None,
        start=True,
        **relay.dht_kwargs((), reachability),
    )


def run_bootstrap(
    host_maddrs, announce_maddrs, identity, peers, reachability="public", swarm_key=None
) -> None:
    dht = start_bootstrap(host_maddrs, announce_maddrs, identity, peers, reachability, swarm_key)
    for maddr in dht.get_visible_maddrs():
        print(maddr, flush=True)
    logger.info("bootstrap DHT peer running; Ctrl-C to stop")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    dht.shutdown()
