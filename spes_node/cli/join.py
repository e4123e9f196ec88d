"""`spes-node join`: run a training node (found a swarm, or join one with --peers)."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import click

from spes_node.cli.support import load_cfg, option, user_errors

logger = logging.getLogger(__name__)


@click.command()
@option("--peers", multiple=True, help="Multiaddr of a swarm peer (repeat). Without it, found a new swarm.")
@option("--config", type=click.Path(dir_okay=False), help="Swarm config file (TOML or JSON).")
@option("--preset", help="Named config from configs/ (tiny, small, spes-1b, spes-7b).")
@option("--run-id", default="spes", show_default=True, help="Name of the swarm (training run).")
@option(
    "--config-hash",
    help="Hash of the swarm's config (the founder prints it): join only a swarm that runs this config.",
)
@option(
    "--host-maddrs", multiple=True, help="Multiaddrs to listen on (default: all interfaces, random port)."
)
@option("--announce-maddrs", multiple=True, help="Multiaddrs other peers should dial (public address).")
@option(
    "--identity", type=click.Path(dir_okay=False), help="Identity key file (default: in the checkpoint dir)."
)
@option(
    "--shard",
    default="auto",
    show_default=True,
    help="One shard to train (same as a one-shard --shards list), or 'auto' to leave it to --shards.",
)
@option(
    "--shards",
    default="auto",
    show_default=True,
    help="Shards to hold: 'auto' (as many as the memory plan fits in the GPU's memory, or on a CPU in the host "
    "memory available at start), a count K, or a list of indices like 0,2. Placement picks which.",
)
@option("--max-shards", type=int, help="Hold at most this many shards (caps --shards auto).")
@option("--data", help="Data spec: default, hf:NAME[:CONFIG], or local parquet/jsonl/text files.")
@option("--checkpoint-dir", default="checkpoints", show_default=True, type=click.Path(file_okay=False))
@option("--device", default="auto", show_default=True, help="auto, cpu or cuda.")
@option("--max-rounds", type=int, help="Leave after this many rounds.")
@option("--metrics-port", type=int, help="Serve Prometheus metrics on this port.")
@option("--public-name", default="", help="Name shown in `spes-node status`.")
@option(
    "--init-from",
    type=click.Path(file_okay=False),
    help="Start from the weights of this Hugging Face OLMoE directory (e.g. from `spes-node init`).",
)
@option(
    "--wait-peers",
    default=1,
    show_default=True,
    type=click.IntRange(1),
    help="Hold the first step until this many nodes (this one included) are in the swarm.",
)
@option(
    "--client-mode",
    is_flag=True,
    help="No inbound connections (behind NAT): train and average through others.",
)
@option(
    "--relay",
    "relays",
    multiple=True,
    help="Multiaddr of a peer to reserve a circuit relay slot on, so that others can download this node's "
    "state although it takes no inbound connections (repeatable; see --auto-relay).",
)
@option(
    "--auto-relay",
    is_flag=True,
    help="Use the --peers as relays (what a volunteer behind NAT wants, with --client-mode).",
)
@option(
    "--checkpoint-writes",
    type=click.Choice(["auto", "background", "in-place"]),
    default="auto",
    show_default=True,
    help="background: snapshot to host memory and write on a thread; in-place: training waits for the write, "
    "which copies one tensor at a time from the device (no copy of the training state; `spes-node plan` shows "
    "both); auto: in place on the CPU.",
)
@option("--swarm-key", help="Shared secret of a private swarm (prefer --swarm-key-file: argv is visible).")
@option("--swarm-key-file", type=click.Path(dir_okay=False), help="File holding the private swarm's key.")
@user_errors
def join(
    peers,
    config,
    preset,
    run_id,
    config_hash,
    host_maddrs,
    announce_maddrs,
    identity,
    shard,
    shards,
    max_shards,
    data,
    checkpoint_dir,
    device,
    max_rounds,
    metrics_port,
    public_name,
    init_from,
    wait_peers,
    client_mode,
    relays,
    auto_relay,
    checkpoint_writes,
    swarm_key,
    swarm_key_file,
) -> None:
    """Run a training node: found a swarm, or join one with --peers."""
    cfg = load_cfg(config, preset)
    if cfg is None and not peers:
        from spes_node.config import load_preset

        logger.info("no --preset or --config: founding a swarm with the 'tiny' preset")
        cfg = load_preset("tiny")
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", run_id):
        raise ValueError(f"--run-id: use 1-64 letters, digits, '_' or '-', got '{run_id}'")
    if config_hash:
        from spes_node.config import check_config_hash

        config_hash = check_config_hash(config_hash)
        if cfg is not None and cfg.hash() != config_hash:
            raise ValueError(
                f"--config-hash: {config_hash[:12]} is not the hash of the given --preset/--config ({cfg.hash()[:12]})"
            )
    from spes_node.daemon.capacity import check_shard_request, parse_shard_request

    request = parse_shard_request(shards, max_shards, shard)
    if max_rounds is not None and max_rounds < 1:
        raise ValueError("--max-rounds: must be >= 1")
    if device not in ("auto", "cpu", "cuda") and not device.startswith("cuda:"):
        raise ValueError(f"--device: expected auto, cpu or cuda, got '{device}'")
    if cfg is not None:  # else the node checks them against the swarm's config once it has it
        check_shard_request(request, cfg)
        _check_fits(cfg, request, device)
    relays = list(relays) or (list(peers) if auto_relay else [])
    if (relays or auto_relay) and not peers:
        raise ValueError("--relay/--auto-relay: relays are for nodes that join a swarm; pass --peers too")
    for maddr in relays:
        if "/p2p/" not in maddr:
            raise ValueError(f"--relay: {maddr} does not end with the relay's peer id (/p2p/...)")
    if data:
        from spes_node.daemon.data import check_data_spec

        check_data_spec(data)
    from spes_node.daemon.node import Node, NodeOptions
    from spes_node.logs import setup_logging
    from spes_node.swarm.swarm_key import load_swarm_key

    setup_logging()
    opts = NodeOptions(
        peers=list(peers),
        run_id=run_id,
        host_maddrs=list(host_maddrs) or ["/ip4/0.0.0.0/tcp/0"],
        announce_maddrs=list(announce_maddrs),
        identity=Path(identity) if identity else None,
        shard=None if shard == "auto" else int(shard),
        shards=request,
        data=data,
        checkpoint_dir=Path(checkpoint_dir),
        device=device,
        max_rounds=max_rounds,
        metrics_port=metrics_port,
        public_name=public_name,
        client_mode=client_mode,
        relays=relays,
        wait_peers=wait_peers,
        init_from=Path(init_from) if init_from else None,
        swarm_key=load_swarm_key(swarm_key, swarm_key_file),
        config_hash=config_hash or None,
        checkpoint_writes=checkpoint_writes,
    )
    node = Node(cfg, opts)
    node.install_signal_handlers()
    node.run()


def _check_fits(cfg, request, device: str) -> None:
    """Refuse now, before the DHT starts, a config that cannot fit even one shard on this GPU (a CPU node is not
    refused: host memory can be freed or swapped; the node warns)."""
    from spes_node.daemon.capacity import shard_capacity
    from spes_node.devices import resolve_device

    resolved = resolve_device(device)
    if resolved.type == "cuda":
        shard_capacity(cfg, request, resolved)
