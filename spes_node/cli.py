"""The `spes-node` command line: parse flags, build the config, run the command. Every flag also reads SPES_<FLAG>."""

from __future__ import annotations

import functools
import logging
import re
import sys
from pathlib import Path

import click

from spes_node import __version__
from spes_node.errors import SpesError

logger = logging.getLogger(__name__)


class UserError(click.ClickException):
    """One line on stderr, exit code 2 (click's usage-error convention for bad input)."""

    exit_code = 2

    def show(self, file=None) -> None:
        click.echo(f"spes-node: error: {self.message}", err=True, file=file)


def user_errors(fn):
    """Turn the errors a user can fix into one clear line and a non-zero exit, never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except KeyboardInterrupt:
            sys.exit(130)
        except (ValueError, SpesError, FileNotFoundError, PermissionError) as e:
            raise UserError(str(e).splitlines()[0] if str(e) else type(e).__name__) from None

    return wrapper


def option(*names, **kwargs):
    """A click option that also reads SPES_<FLAG> from the environment."""
    flag = next(n for n in names if n.startswith("--"))
    kwargs.setdefault("envvar", "SPES_" + flag[2:].upper().replace("-", "_"))
    kwargs.setdefault("show_envvar", True)
    return click.option(*names, **kwargs)


def load_cfg(config: str | None, preset: str | None):
    from spes_node.config import load_config, load_preset

    if config and preset:
        raise ValueError("pass either --config or --preset, not both")
    if config:
        return load_config(config)
    if preset:
        return load_preset(preset)
    return None


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="spes-node")
def main() -> None:
    """spes-node: train a mixture-of-experts model with peers over the internet (SPES)."""


@main.command()
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
    help="Shard to train, or 'auto' to take the least replicated.",
)
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
    if shard != "auto" and not shard.isdigit():
        raise ValueError(f"--shard: expected a shard index or 'auto', got '{shard}'")
    if max_rounds is not None and max_rounds < 1:
        raise ValueError("--max-rounds: must be >= 1")
    if cfg is not None and shard != "auto" and int(shard) >= cfg.swarm.num_shards:
        raise ValueError(f"--shard: {shard} is out of range [0, {cfg.swarm.num_shards})")
    if device not in ("auto", "cpu", "cuda") and not device.startswith("cuda:"):
        raise ValueError(f"--device: expected auto, cpu or cuda, got '{device}'")
    if config_hash:
        from spes_node.records import check_config_hash

        config_hash = check_config_hash(config_hash)
        if cfg is not None and cfg.hash() != config_hash:
            raise ValueError(
                f"--config-hash: {config_hash[:12]} is not the hash of the given --preset/--config ({cfg.hash()[:12]})"
            )
    relays = list(relays) or (list(peers) if auto_relay else [])
    if (relays or auto_relay) and not peers:
        raise ValueError("--relay/--auto-relay: relays are for nodes that join a swarm; pass --peers too")
    for maddr in relays:
        if "/p2p/" not in maddr:
            raise ValueError(f"--relay: {maddr} does not end with the relay's peer id (/p2p/...)")
    if data:
        from spes_node.data import check_data_spec

        check_data_spec(data)
    from spes_node.logs import setup_logging
    from spes_node.node import Node, NodeOptions
    from spes_node.swarm_key import load_swarm_key

    setup_logging()
    opts = NodeOptions(
        peers=list(peers),
        run_id=run_id,
        host_maddrs=list(host_maddrs) or ["/ip4/0.0.0.0/tcp/0"],
        announce_maddrs=list(announce_maddrs),
        identity=Path(identity) if identity else None,
        shard=None if shard == "auto" else int(shard),
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
    )
    node = Node(cfg, opts)
    node.install_signal_handlers()
    node.run()


@main.command()
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
    from spes_node.logs import setup_logging
    from spes_node.simulate import run_simulation

    setup_logging("WARNING")
    cfg = load_cfg(config, None if config else preset)
    code = run_simulation(
        cfg, num_nodes=nodes, max_rounds=max_rounds, workdir=Path(workdir), data=data, run_id=run_id
    )
    sys.exit(code)


@main.command()
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
    from spes_node.bootstrap import run_bootstrap
    from spes_node.logs import setup_logging
    from spes_node.swarm_key import load_swarm_key

    setup_logging()
    run_bootstrap(
        list(host_maddrs) or ["/ip4/0.0.0.0/tcp/0"],
        list(announce_maddrs),
        identity,
        list(peers),
        reachability,
        load_swarm_key(swarm_key, swarm_key_file),
    )


@main.command()
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
    import json

    from spes_node.plan import memory_plan, parse_size, plan_table

    cfg = load_cfg(config, preset)
    if cfg is None:
        raise ValueError("plan: pass --preset NAME or --config FILE")
    if not shards.strip().isdigit():
        raise ValueError(f"--shards: expected a number of shards, got '{shards}'")
    size = parse_size(device_memory) if device_memory else None
    result = memory_plan(cfg, int(shards), size)
    click.echo(json.dumps(result.to_dict(), indent=1) if as_json else plan_table(result))


from spes_node.status import status  # noqa: E402

main.add_command(status)


def _add_hf_commands() -> None:
    from spes_node.evaluate import eval_command, generate_command
    from spes_node.export import export_command
    from spes_node.upcycle import init_command

    for command in (export_command(), init_command(), eval_command(), generate_command()):
        main.add_command(command)


_add_hf_commands()


def run() -> None:
    """The console entry point: click's own usage errors also become one line."""
    try:
        code = main(standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("spes-node: aborted", err=True)
        sys.exit(130)
    except click.ClickException as e:
        message = e.format_message().splitlines()[0] if e.format_message() else type(e).__name__
        if isinstance(e, UserError):
            message = e.message
        click.echo(f"spes-node: error: {message}", err=True)
        sys.exit(e.exit_code)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    run()
