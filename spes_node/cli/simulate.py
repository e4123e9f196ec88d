"""`spes-node simulate`: a bootstrap DHT and N daemons as processes on 127.0.0.1, a live view, then a summary."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from spes_node.cli.support import load_cfg, option, user_errors


@click.command()
@option(
    "--nodes",
    type=click.IntRange(1, 16),
    help="Training daemons to start (default: one per shard of the config, so that every expert trains).",
)
@option("--preset", default="tiny", show_default=True)
@option("--config", type=click.Path(dir_okay=False), help="Config file instead of a preset.")
@option("--max-rounds", default=5, show_default=True, type=click.IntRange(1))
@option(
    "--workdir",
    default="runs/simulate",
    show_default=True,
    type=click.Path(file_okay=False),
    help="Each run writes its config, logs and checkpoints into a new run-NNN directory in it; nothing there "
    "is deleted.",
)
@option("--run-id", default="simulate", show_default=True, help="Name of the simulated swarm (for `status`).")
@option("--data", help="Data spec for every node (default: the config's).")
@user_errors
def simulate(nodes, preset, config, max_rounds, workdir, run_id, data) -> None:
    """A local swarm: a bootstrap DHT plus N daemons on 127.0.0.1, a live view, then a summary."""
    from spes_node.daemon.simulation import run_simulation
    from spes_node.logs import setup_logging

    setup_logging("WARNING")
    cfg = load_cfg(config, None if config else preset)
    code = run_simulation(
        cfg, num_nodes=nodes, max_rounds=max_rounds, workdir=Path(workdir), data=data, run_id=run_id
    )
    sys.exit(code)
