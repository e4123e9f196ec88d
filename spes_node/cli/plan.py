"""`spes-node plan`: a node's GPU and host memory for a config, whether it fits, and its bytes per round."""

from __future__ import annotations

import json

import click

from spes_node.cli.support import load_cfg, option, user_errors
from spes_node.daemon.plan import memory_plan, parse_size, plan_table
from spes_node.daemon.traffic import round_traffic, traffic_table


@click.command()
@option("--preset", help="Named config from configs/ (tiny, small, spes-1b, spes-7b).")
@option("--config", type=click.Path(dir_okay=False), help="Swarm config file (TOML or JSON).")
@option(
    "--device-memory",
    help="The GPU's memory as the driver reports it, e.g. 24GB, 48GiB, 80G (GB means GiB, as for GPU cards).",
)
@option("--shards", default="1", show_default=True, help="Shards this node holds (1 to swarm.num_shards).")
@option(
    "--nodes",
    type=int,
    help="Nodes in the swarm, for the bytes per round (default: enough for swarm.replication_target holders).",
)
@option(
    "--link-mbit", type=float, default=100.0, show_default=True, help="The node's link each way, in Mbit/s."
)
@option("--json", "as_json", is_flag=True, help="Print the plan as JSON (bytes).")
@user_errors
def plan(preset, config, device_memory, shards, nodes, link_mbit, as_json) -> None:
    """Per-node GPU and host memory of a config, whether it fits the GPU, and what to change if not; and the bytes a
    node moves per round, with the time they take on its link."""
    cfg = load_cfg(config, preset)
    if cfg is None:
        raise ValueError("plan: pass --preset NAME or --config FILE")
    if not shards.strip().isdigit():
        raise ValueError(f"--shards: expected a number of shards, got '{shards}'")
    if link_mbit <= 0:
        raise ValueError(f"--link-mbit: must be positive, got {link_mbit:g}")
    size = parse_size(device_memory) if device_memory else None
    result = memory_plan(cfg, int(shards), size)
    traffic = round_traffic(cfg, nodes, int(shards))
    if as_json:
        network = {**traffic.to_dict(), "link_mbit": link_mbit}
        network["allreduce_seconds"] = traffic.seconds(traffic.allreduce, link_mbit)
        network["stall_seconds"] = traffic.seconds(traffic.stalling, link_mbit)
        network["refresh_seconds"] = traffic.seconds(
            traffic.refresh_received + traffic.refresh_served, link_mbit
        )
        click.echo(json.dumps({**result.to_dict(), "network": network}, indent=1))
    else:
        click.echo(plan_table(result) + "\n\n" + traffic_table(traffic, link_mbit))
