"""`spes-node status`: a read-only DHT client that shows who holds which experts and how training goes."""

from __future__ import annotations

import click


@click.command()
@click.option(
    "--peers",
    multiple=True,
    required=True,
    envvar="SPES_PEERS",
    show_envvar=True,
    help="Multiaddr of a swarm peer (repeat).",
)
@click.option(
    "--run-id", default="spes", show_default=True, envvar="SPES_RUN_ID", show_envvar=True, help="Swarm name."
)
@click.option("--json", "as_json", is_flag=True, envvar="SPES_JSON", show_envvar=True, help="Print JSON.")
@click.option("--watch", is_flag=True, envvar="SPES_WATCH", show_envvar=True, help="Refresh until Ctrl-C.")
@click.option(
    "--plot", "plot_path", envvar="SPES_PLOT", show_envvar=True, help="Also draw a PNG to this file."
)
@click.option(
    "--timeout",
    default=15.0,
    show_default=True,
    type=float,
    envvar="SPES_TIMEOUT",
    show_envvar=True,
    help="Seconds to reach the peers and find the swarm.",
)
@click.option(
    "--interval",
    default=5.0,
    show_default=True,
    type=float,
    envvar="SPES_INTERVAL",
    show_envvar=True,
    help="Seconds between refreshes with --watch.",
)
@click.option(
    "--config-hash",
    envvar="SPES_CONFIG_HASH",
    show_envvar=True,
    help="The swarm config's hash (the founder prints it): trust only that config.",
)
@click.option(
    "--swarm-key",
    envvar="SPES_SWARM_KEY",
    show_envvar=True,
    help="Shared secret of a private swarm (prefer --swarm-key-file: argv is visible).",
)
@click.option(
    "--swarm-key-file",
    type=click.Path(dir_okay=False),
    envvar="SPES_SWARM_KEY_FILE",
    show_envvar=True,
    help="File holding the private swarm's key.",
)
def status(
    peers, run_id, as_json, watch, plot_path, timeout, interval, config_hash, swarm_key, swarm_key_file
) -> None:
    """Show a swarm: its nodes, their progress, and which shards have too few replicas."""
    # the group imports this module to list the command: what it runs is imported when it runs
    from spes_node.cli.support import UserError
    from spes_node.logs import setup_logging

    try:
        from spes_node.config import check_config_hash

        anchor = check_config_hash(config_hash) if config_hash else None
        # hivemind's DHT client, authorizer and logging: imported once the light checks have passed
        setup_logging("WARNING")
        from spes_node.daemon.status import run_status
        from spes_node.swarm.swarm_key import load_swarm_key

        key = load_swarm_key(swarm_key, swarm_key_file)

        run_status(peers, run_id, as_json, watch, plot_path, timeout, interval, key, anchor)
    except ValueError as e:
        raise UserError(str(e).splitlines()[0] if str(e) else type(e).__name__) from None
