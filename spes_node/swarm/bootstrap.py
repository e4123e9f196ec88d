"""A bare DHT peer that others bootstrap from; with a fixed identity its multiaddr is known in advance."""

from __future__ import annotations

import logging
import signal
import threading

import hivemind

from spes_node.errors import SpesError
from spes_node.procs import NodeDHT
from spes_node.swarm import records, relay
from spes_node.swarm.identity import load_or_create_identity
from spes_node.swarm.watchdog import DHTWatch

logger = logging.getLogger(__name__)

HANG_CHECK_S = 5.0
"""How often a running bootstrap asks whether its DHT process and p2pd still serve it."""
HANG_S = 300.0
"""How long its DHT process may leave the question unanswered before it counts as hung."""


class BootstrapStopped(SpesError):
    """Its DHT process or p2pd died while it ran: a fault met while running (exit code 1), not bad input."""

    exit_code = 1


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
    dht = NodeDHT(
        initial_peers=list(peers) or None,
        host_maddrs=list(host_maddrs),
        announce_maddrs=list(announce_maddrs) or None,
        identity_path=identity,
        record_validators=records.record_validators(),
        authorizer=swarm_key.authorizer() if swarm_key else None,
        start=True,
        **relay.dht_kwargs((), reachability),
    )
    dht.note_children()
    return dht


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
    # a bootstrap whose DHT process or p2pd died would go on answering nothing: it exits instead, for its
    # supervisor (docker compose's restart policy, systemd) to start it again at the same address
    watch = DHTWatch(dht, HANG_S)
    while not stop.wait(HANG_CHECK_S):
        if (problem := watch.problem()) is not None:
            dht.terminate()  # a shutdown would wait on the p2pd that is gone
            dht.join(10)
            dht.end_orphans()
            raise BootstrapStopped(f"{problem}: the bootstrap DHT peer stopped; start it again")
    dht.shutdown()
