"""`spes-node dht`: a bare bootstrap DHT peer (docker compose, public bootstrap nodes)."""

from __future__ import annotations

import click

from spes_node.cli.support import option, user_errors


@click.command()
@option("--host-maddrs", multiple=True, help="Multiaddrs to listen on.")
@option("--announce-maddrs", multiple=True, help="Multiaddrs other peers should dial.")
@option(
    "--identity",
    type=click.Path(dir_okay=False),
    help="Identity key file; created if missing. A fixed one gives a fixed multiaddr.",
)
@option("--peers", multiple=True, help="Other bootstrap peers.")
@option(
    "--reachability",
    type=click.Choice(["public", "auto"]),
    default="public",
    show_default=True,
    help="public: serve as a circuit relay for NAT'd nodes from the start; auto: only once AutoNAT confirms "
    "that peers can reach this one.",
)
@option("--swarm-key", help="Shared secret of a private swarm (prefer --swarm-key-file: argv is visible).")
@option("--swarm-key-file", type=click.Path(dir_okay=False), help="File holding the private swarm's key.")
@user_errors
def dht(host_maddrs, announce_maddrs, identity, peers, reachability, swarm_key, swarm_key_file) -> None:
    """A bare bootstrap DHT peer (for docker compose and public bootstrap nodes); it relays for NAT'd nodes."""
    from spes_node.logs import setup_logging
    from spes_node.swarm.bootstrap import run_bootstrap
    from spes_node.swarm.swarm_key import load_swarm_key

    setup_logging()
    run_bootstrap(
        list(host_maddrs) or ["/ip4/0.0.0.0/tcp/0"],
        list(announce_maddrs),
        identity,
        list(peers),
        reachability,
        load_swarm_key(swarm_key, swarm_key_file),
    )
