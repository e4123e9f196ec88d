"""`spes-node export`: the global model as a Hugging Face OLMoE checkpoint."""

from __future__ import annotations

from pathlib import Path

import click

from spes_node.cli.support import option, user_errors


@click.command("export")
@option("--checkpoint-dir", type=click.Path(file_okay=False), help="A node's checkpoint directory.")
@option("--config", type=click.Path(dir_okay=False), help="Swarm config, if the checkpoint dir has none.")
@option("--peers", multiple=True, help="Multiaddr of a swarm peer (repeat): export the live swarm's model.")
@option("--run-id", default="spes", show_default=True, help="Name of the swarm (with --peers).")
@option("--allow-copies", is_flag=True, help="With --peers: take frozen copies of shards without a holder.")
@option(
    "--timeout",
    default=60.0,
    show_default=True,
    type=click.FloatRange(min=1),
    help="Seconds per download.",
)
@option("--out", required=True, type=click.Path(file_okay=False), help="Output directory.")
@option("--force", is_flag=True, help="Replace a non-empty --out.")
@option("--swarm-key", help="With --peers: a private swarm's key (prefer --swarm-key-file).")
@option("--swarm-key-file", type=click.Path(dir_okay=False), help="With --peers: file with the swarm's key.")
@user_errors
def export(
    checkpoint_dir, config, peers, run_id, allow_copies, timeout, out, force, swarm_key, swarm_key_file
) -> None:
    """Write the model as a Hugging Face OLMoE checkpoint (from a checkpoint dir or from live peers)."""
    if bool(checkpoint_dir) == bool(peers):
        raise ValueError("pass either --checkpoint-dir or --peers")
    if config and not checkpoint_dir:
        raise ValueError("--config: only used with --checkpoint-dir (a swarm publishes its own config)")
    from spes_node.daemon.export import fetch_swarm_weights, load_checkpoint_weights
    from spes_node.logs import setup_logging
    from spes_node.model.hf_checkpoint import check_out_dir, save_hf_checkpoint

    setup_logging("WARNING")
    check_out_dir(Path(out), force)
    if checkpoint_dir:
        cfg, weights, provenance = load_checkpoint_weights(checkpoint_dir, config)
    else:
        from spes_node.swarm.swarm_key import load_swarm_key

        key = load_swarm_key(swarm_key, swarm_key_file)
        cfg, weights, provenance = fetch_swarm_weights(list(peers), run_id, allow_copies, timeout, key)
    save_hf_checkpoint(cfg, weights, out, force=force, provenance=provenance)
    click.echo(
        f"exported {cfg.name} ({sum(t.numel() for t in weights.values()) / 1e6:.1f}M parameters) to {out}"
    )
