"""`spes-node init`: a Hugging Face OLMoE starting point, upcycled from a dense model."""

from __future__ import annotations

from pathlib import Path

import click

from spes_node.cli.support import load_cfg, option, user_errors
from spes_node.model.upcycle import ROUTER_INITS, UpcycleOptions, upcycle


@click.command("init")
@option("--upcycle-from", required=True, type=click.Path(file_okay=False), help="Dense HF model directory.")
@option("--experts", required=True, type=int, help="Experts per MoE layer.")
@option("--top-k", required=True, type=int, help="Experts each token is routed to.")
@option("--noise", default=0.0, show_default=True, type=float, help="Std of the noise added to experts.")
@option("--noise-fraction", default=0.5, show_default=True, type=float, help="Share of entries noised.")
@option("--router", default="normal", show_default=True, type=click.Choice(ROUTER_INITS))
@option("--seed", default=0, show_default=True, type=int, help="Seed of noise and router.")
@option("--shards", type=int, help="Shards per layer in the swarm config (default: the base config's).")
@option("--preset", help="Base for the train/swarm/data sections of the swarm config.")
@option("--config", type=click.Path(dir_okay=False), help="Base config file instead of a preset.")
@option("--tokenizer", help="data.tokenizer of the swarm config (a hub id or a path every node has).")
@option("--out", required=True, type=click.Path(file_okay=False), help="Output directory.")
@option("--force", is_flag=True, help="Replace a non-empty --out.")
@user_errors
def init(
    upcycle_from,
    experts,
    top_k,
    noise,
    noise_fraction,
    router,
    seed,
    shards,
    preset,
    config,
    tokenizer,
    out,
    force,
) -> None:
    """Start a swarm's model from a dense Hugging Face model (upcycling to an OLMoE MoE)."""
    from spes_node.logs import setup_logging
    from spes_node.model.evaluate import quiet_transformers

    setup_logging("WARNING")
    quiet_transformers()
    opts = UpcycleOptions(experts, top_k, noise, noise_fraction, router, seed)
    cfg = upcycle(upcycle_from, out, opts, load_cfg(config, preset), shards, tokenizer, force)
    click.echo(
        f"upcycled {Path(upcycle_from).name} into {cfg.model.num_experts} experts (top-{cfg.model.top_k}) "
        f"in {cfg.swarm.num_shards} shards: {out}"
    )
    click.echo(
        f"found a swarm with: spes-node join --config {Path(out) / 'spes-config.json'} --init-from {out}"
    )
