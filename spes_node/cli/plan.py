"""`spes-node plan`: a node's GPU and host memory for a config, and whether it fits."""

from __future__ import annotations

import json

import click

from spes_node.cli.support import load_cfg, option, user_errors
from spes_node.daemon.plan import memory_plan, parse_size, plan_table


@click.command()
@option("--preset", help="Named config from configs/ (tiny, small, spes-1b, spes-7b).")
@option("--config", type=click.Path(dir_okay=False), help="Swarm config file (TOML or JSON).")
@option(
    "--device-memory",
    help="The GPU's memory as the driver reports it, e.g. 24GB, 48GiB, 80G (GB means GiB, as for GPU cards).",
)
@option("--shards", default="1", show_default=True, help="Shards this node holds (1 to swarm.num_shards).")
@option("--json", "as_json", is_flag=True, help="Print the plan as JSON (bytes).")
@user_errors
def plan(preset, config, device_memory, shards, as_json) -> None:
    """Per-node GPU and host memory of a config, whether it fits the GPU, and what to change if not."""
    cfg = load_cfg(config, preset)
    if cfg is None:
        raise ValueError("plan: pass --preset NAME or --config FILE")
    if not shards.strip().isdigit():
        raise ValueError(f"--shards: expected a number of shards, got '{shards}'")
    size = parse_size(device_memory) if device_memory else None
    result = memory_plan(cfg, int(shards), size)
    click.echo(json.dumps(result.to_dict(), indent=1) if as_json else plan_table(result))
