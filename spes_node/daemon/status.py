"""`spes-node status`: a read-only view of a swarm, from the DHT records of its config and nodes.

The pure part turns records into a summary dict (the `--json` output) and renders it as text or as a
picture; the command around it is a client-mode DHT peer that opens no port and writes nothing.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from spes_node.daemon.placement import (
    reachable_counts,
    replica_counts,
    shard_experts,
    under_replicated,
    unreachable_only,
)
from spes_node.swarm.client import open_client_dht
from spes_node.swarm.records import ACTIVE_STATES
from spes_node.swarm.relay import circuits_of

if TYPE_CHECKING:
    import hivemind

    from spes_node.swarm.records import ConfigInfo, NodeInfo

logger = logging.getLogger(__name__)

POLL_S = 1.0


class SwarmNotFound(ValueError):
    """No config and no node record under the run id."""


KNOWN_RUN_IDS = ("spes", "simulate")
"""The default run ids of `join`/`status` and of `simulate`. The DHT cannot list the run ids it holds, so when a
run id is not found these are looked up, as the likeliest names of the swarm the user meant."""


def other_swarms(dht: hivemind.DHT, run_id: str) -> list[str]:
    """Which of `KNOWN_RUN_IDS` (other than `run_id`) have a config or node records at these peers."""
    from spes_node.swarm import records

    found = []
    for other in KNOWN_RUN_IDS:
        if other == run_id:
            continue
        try:
            held = records.fetch_config(dht, other) is not None or bool(records.fetch_nodes(dht, other))
        except ValueError:  # conflicting configs published under that run id: a swarm all the same
            held = True
        except Exception as e:  # a failed lookup only costs the hint
            logger.debug(f"could not look up swarm '{other}': {e}")
            held = False
        if held:
            found.append(other)
    return found


def other_swarms_hint(dht: hivemind.DHT, run_id: str) -> str:
    """'; the peers hold swarm 'simulate' (pass --run-id simulate)' or, with none found, advice on --run-id."""
    others = other_swarms(dht, run_id)
    if others:
        names = " and ".join(f"'{other}'" for other in others)
        return f"; the peers hold swarm {names} (pass --run-id {others[0]})"
    return "; check --run-id (a node logs the complete join and status commands when it starts)"


def no_swarm_message(dht: hivemind.DHT, run_id: str) -> str:
    """What a node says when the peers answered but hold no swarm under its run id (never: found a new one)."""
    return (
        f"no swarm '{run_id}' at the given peers: they answered but hold no config under that run id"
        + other_swarms_hint(dht, run_id)
    )


# ---------------------------------------------------------------------------------------------- summary


def _model_summary(config_json: str) -> tuple[dict[str, Any] | None, Any]:
    """(model description, SpesConfig) from the config record's JSON; (None, None) if this version can't read it."""
    from spes_node.config import SpesConfig

    try:
        cfg = SpesConfig.from_json(config_json)
    except ValueError as e:
        logger.warning(f"cannot read the swarm config with this version of spes-node: {e}")
        return None, None
    from spes_node.model.moe import analytic_param_count

    m = cfg.model
    counts = analytic_param_count(m)
    active = counts["shared"] + counts["experts"] * m.top_k // m.num_experts
    model = {
        "name": cfg.name,
        "params_total": counts["total"],
        "params_active": active,
        "params_shared": counts["shared"],
        "params_experts": counts["experts"],
        "num_layers": m.num_layers,
        "hidden_size": m.hidden_size,
        "num_experts": m.num_experts,
        "top_k": m.top_k,
    }
    return model, cfg


def _loss_or_none(loss: float) -> float | None:
    """Nodes publish 0.0 before their first step; report that as unknown."""
    return loss if math.isfinite(loss) and loss > 0 else None


def _reach(node: NodeInfo) -> str:
    """How peers reach a node: "direct", "relay" (client mode with circuit addresses: small requests only, bulk
    state downloads are not dependable) or "none" (client mode)."""
    if not node.client_mode:
        return "direct"
    return "relay" if circuits_of(node.peer_id, node.maddrs) else "none"


def _node_summary(node: NodeInfo, now: float) -> dict[str, Any]:
    return {
        "peer_id": node.peer_id,
        "public_name": node.public_name,
        "shards": sorted(node.shards),
        "round": node.round,
        "step": node.step,
        "tokens": node.tokens,
        "tokens_per_s": node.tokens_per_s,
        "loss": _loss_or_none(node.loss),
        "state": node.state,
        "last_seen_s": max(0.0, now - node.updated_at),
        "expires_in_s": max(0.0, node.expires_at - now),
        "version": node.version,
        "client_mode": node.client_mode,
        "reachable": _reach(node),
        "maddrs": list(node.maddrs),
        "loss_history": list(node.loss_history),
        "bytes_sent": node.bytes_sent,
        "bytes_received": node.bytes_received,
    }


def summarize(
    run_id: str,
    config: ConfigInfo | None,
    nodes: Mapping[str, NodeInfo],
    now: float,
    warnings: Sequence[str] = (),
    config_hashes: Sequence[str] | None = None,
) -> dict[str, Any]:
    """The swarm as `status --json` prints it: DHT records (`fetch_config`, `fetch_nodes`) at DHT time `now`.

    `config` is the config status trusts (the one anchored by --config-hash, or the only one published);
    `config_hashes` every config hash seen in the DHT; `warnings` what went wrong while reading (bad records,
    failed reads, conflicting configs). Without a readable config, the shard count is guessed from the highest
    shard id held and the experts of each shard are left empty.
    """
    model, cfg = _model_summary(config.config_json) if config is not None else (None, None)
    if cfg is not None:
        num_shards, target = cfg.swarm.num_shards, cfg.swarm.replication_target
    else:
        num_shards = 1 + max((s for n in nodes.values() for s in n.shards), default=-1)
        target = None
    ordered = sorted(
        nodes.values(), key=lambda n: (sorted(n.shards) or [num_shards], n.public_name, n.peer_id)
    )
    counts, reachable = replica_counts(nodes, num_shards), reachable_counts(nodes, num_shards)
    shards = []
    for shard in range(num_shards):
        experts = list(shard_experts(shard, cfg.model.num_experts, num_shards)) if cfg is not None else []
        holders = [n.peer_id for n in ordered if shard in n.shards]
        shards.append(
            {
                "shard": shard,
                "experts": experts,
                "replicas": counts[shard],
                "reachable_replicas": reachable[shard],
                "holders": holders,
            }
        )
    losses = [loss for n in nodes.values() if (loss := _loss_or_none(n.loss)) is not None]
    return {
        "run_id": run_id,
        "config_hash": config.config_hash if config is not None else None,
        "config_hashes": list(config_hashes) if config_hashes is not None else [],
        "software_version": config.software_version if config is not None else None,
        "model": model,
        "num_shards": num_shards,
        "replication_target": target,
        "sync_steps": cfg.swarm.sync_steps if cfg is not None else None,
        "highest_round": max((n.round for n in nodes.values()), default=0),
        "total_tokens": sum(n.tokens for n in nodes.values()),
        "tokens_per_s": sum(n.tokens_per_s for n in nodes.values() if n.state in ACTIVE_STATES),
        "mean_loss": sum(losses) / len(losses) if losses else None,
        "nodes": [_node_summary(n, now) for n in ordered],
        "shards": shards,
        "under_replicated": under_replicated(nodes, num_shards, target) if target is not None else [],
        "no_holder": [shard for shard in range(num_shards) if counts[shard] == 0],
        "unreachable_only": unreachable_only(nodes, num_shards),
        "dht_time": now,
        "warnings": list(dict.fromkeys(warnings)),
    }


# ---------------------------------------------------------------------------------------------- text


def short_peer(peer_id: str) -> str:
    return peer_id[-8:]


def _count(value: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.1f}{unit}"
    return f"{value:.0f}"


def _loss(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _experts(experts: Sequence[int]) -> str:
    if not experts:
        return "?"
    return str(experts[0]) if len(experts) == 1 else f"{experts[0]}-{experts[-1]}"


def _printable(text: str) -> str:
    """A warning (it may quote what a peer wrote) without control characters that would drive the terminal."""
    return "".join(c if c.isprintable() else "?" for c in text)


def _table(header: Sequence[str], rows: list[Sequence[str]], right: set[int]) -> list[str]:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]

    def line(cells: Sequence[str]) -> str:
        parts = [
            str(c).rjust(w) if i in right else str(c).ljust(w) for i, (c, w) in enumerate(zip(cells, widths))
        ]
        return "  ".join(parts).rstrip()

    return [line(header)] + [line(row) for row in rows]


def render(summary: Mapping[str, Any]) -> str:
    """The human-readable status: swarm line, node table, shard coverage."""
    config_hash = summary["config_hash"]
    model = summary["model"]
    head = f"swarm {summary['run_id']}"
    if config_hash:
        head += f"  config {config_hash[:12]}"
    elif summary.get("config_hashes"):
        head += f"  config untrusted ({len(summary['config_hashes'])} published, see warnings)"
    else:
        head += "  config unknown (no config record)"
    if summary["software_version"]:
        head += f"  v{summary['software_version']}"
    lines = [head]
    lines += [f"WARNING: {_printable(warning)}" for warning in summary.get("warnings", [])]
    if model is not None:
        lines.append(
            f"model {model['name']}: {_count(model['params_total'])} params, {_count(model['params_active'])} "
            f"active; {model['num_layers']} layers, {model['num_experts']} experts top-{model['top_k']} "
            f"in {summary['num_shards']} shards"
        )
    nodes = summary["nodes"]
    lines.append(
        f"{len(nodes)} node{'s' if len(nodes) != 1 else ''}  round {summary['highest_round']}  "
        f"tokens {_count(summary['total_tokens'])}  {_count(summary['tokens_per_s'])} tok/s  "
        f"mean loss {_loss(summary['mean_loss'])}"
    )
    lines.append("")
    header = (
        "PEER",
        "NAME",
        "SHARDS",
        "ROUND",
        "STEP",
        "TOKENS",
        "TOK/S",
        "LOSS",
        "STATE",
        "SEEN",
        "INBOUND",
    )
    rows = [
        (
            short_peer(n["peer_id"]),
            n["public_name"] or "-",
            ",".join(map(str, n["shards"])) or "-",
            str(n["round"]),
            str(n["step"]),
            _count(n["tokens"]),
            _count(n["tokens_per_s"]),
            _loss(n["loss"]),
            n["state"],
            f"{n['last_seen_s']:.0f}s",
            n.get("reachable", "direct"),
        )
        for n in nodes
    ]
    lines += _table(header, rows, right={3, 4, 5, 6, 7, 9}) if rows else ["(no live nodes)"]
    lines.append("")
    names = {n["peer_id"]: n["public_name"] or short_peer(n["peer_id"]) for n in nodes}
    rows = [
        (
            str(s["shard"]),
            _experts(s["experts"]),
            str(s["replicas"]),
            ", ".join(names[p] for p in s["holders"]) or "-",
            "; ".join(_shard_flags(summary, s["shard"])),
        )
        for s in summary["shards"]
    ]
    lines += (
        _table(("SHARD", "EXPERTS", "REPLICAS", "HOLDERS", ""), rows, right={2}) if rows else ["(no shards)"]
    )
    return "\n".join(lines)


def _shard_flags(summary: Mapping[str, Any], shard: int) -> list[str]:
    flags = []
    if shard in summary.get("no_holder", []):
        flags.append("NO HOLDER (experts not trained)")
    if shard in summary.get("unreachable_only", []):
        flags.append("NO REACHABLE HOLDER (client mode only: its state cannot be downloaded)")
    if shard in summary["under_replicated"]:
        flags.append(f"UNDER-REPLICATED (target {summary['replication_target']})")
    return flags


# ---------------------------------------------------------------------------------------------- picture


def plot(summary: Mapping[str, Any], path: str | os.PathLike) -> None:
    """Write a PNG: shard coverage (shards x nodes, replicas) and each node's loss by round."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    nodes, shards = summary["nodes"], summary["shards"]
    names = [n["public_name"] or short_peer(n["peer_id"]) for n in nodes]
    at_risk = set(summary["under_replicated"]) | set(summary.get("unreachable_only", []))
    fig = Figure(figsize=(11, 4.5), layout="constrained")
    cover, losses = fig.subplots(1, 2, width_ratios=[1, 1.4])

    matrix = [[1.0 if s["shard"] in n["shards"] else 0.0 for n in nodes] for s in shards]
    if nodes and shards:
        cover.imshow(matrix, cmap="Greens", vmin=0, vmax=1.4, aspect="auto")
    cover.set_xticks(range(len(nodes)), names, rotation=45, ha="right")
    cover.set_yticks(
        range(len(shards)),
        [f"shard {s['shard']} ({_experts(s['experts'])}): {s['replicas']}x" for s in shards],
    )
    for label, s in zip(cover.get_yticklabels(), shards):
        if s["shard"] in at_risk:
            label.set_color("tab:red")
    cover.set_xticks([i - 0.5 for i in range(len(nodes) + 1)], minor=True)
    cover.set_yticks([i - 0.5 for i in range(len(shards) + 1)], minor=True)
    cover.grid(which="minor", color="0.75", linewidth=1)
    cover.tick_params(which="minor", length=0)
    cover.set_xlim(-0.5, max(len(nodes), 1) - 0.5)
    cover.set_ylim(max(len(shards), 1) - 0.5, -0.5)
    target = summary["replication_target"]
    cover.set_title(f"coverage (replicas; red: below target {target})" if target else "coverage (replicas)")

    for name, node in zip(names, nodes):
        history = node["loss_history"]
        if history:
            first = node["round"] - len(history) + 1
            losses.plot(range(first, first + len(history)), history, marker="o", markersize=3, label=name)
    losses.xaxis.set_major_locator(MaxNLocator(integer=True))
    losses.set_xlabel("round")
    losses.set_ylabel("loss (mean over the round)")
    losses.set_title("loss by round")
    losses.grid(alpha=0.3)
    if any(n["loss_history"] for n in nodes):
        losses.legend(fontsize="small")
    fig.suptitle(
        f"swarm {summary['run_id']}: {len(nodes)} nodes, round {summary['highest_round']}, "
        f"{_count(summary['total_tokens'])} tokens"
    )

    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, format="png", dpi=100)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------- network


def open_dht(peers: Sequence[str], timeout: float, swarm_key=None) -> hivemind.DHT:
    """A client DHT that can read the swarm's signed records (see `swarm.client`)."""
    return open_client_dht(peers, timeout, swarm_key)


def _num_shards(config) -> int | None:
    """The swarm's shard count from its (validated, signed) config record, to check node records against."""
    if config is None:
        return None
    try:
        return int(json.loads(config.config_json)["swarm"]["num_shards"])
    except (ValueError, KeyError, TypeError):
        return None


def _hashes(hashes: Sequence[str]) -> str:
    return ", ".join(hashes[:4]) + (f" and {len(hashes) - 4} more" if len(hashes) > 4 else "")


def _trusted_config(
    run_id: str, configs: Mapping[str, ConfigInfo], config_hash: str | None, warnings: list[str]
) -> ConfigInfo | None:
    """The config status trusts: the one anchored by `config_hash`, else the only one published; the rest is
    reported in `warnings` (copies are never counted: anyone can publish many)."""
    if config_hash is not None:
        others = [h for h in configs if h != config_hash]
        if config_hash not in configs:
            warnings.append(
                f"no config with hash {config_hash} is published in swarm '{run_id}'"
                + (f" (published: {_hashes(others)})" if others else "")
            )
        elif others:
            warnings.append(
                f"{len(others)} other config(s) published in swarm '{run_id}' and ignored: {_hashes(others)}"
            )
        return configs.get(config_hash)
    if len(configs) > 1:
        warnings.append(
            f"swarm '{run_id}' has {len(configs)} conflicting configs published ({_hashes(list(configs))}); "
            f"none is trusted: pass --config-hash with the hash the founder printed"
        )
        return None
    return next(iter(configs.values()), None)


def fetch_summary(dht: hivemind.DHT, run_id: str, config_hash: str | None = None) -> dict[str, Any]:
    """Read the swarm's records once; raises SwarmNotFound if the run id has neither config nor nodes.

    The summary's `warnings` say what could not be read (bad records, failed reads) and which configs conflict.
    """
    from hivemind.utils import get_dht_time

    from spes_node.swarm import records

    warnings: list[str] = []
    configs = records.fetch_configs(dht, run_id, warnings)
    config = _trusted_config(run_id, configs, config_hash, warnings)
    nodes = records.fetch_nodes(dht, run_id, _num_shards(config), warnings)
    if not configs and not nodes:
        reason = f": {warnings[0]}" if warnings else " (no config or node records)"
        raise SwarmNotFound(f"no swarm '{run_id}' found at the given peers{reason}")
    if not nodes:
        warnings.append(
            f"no live node record of swarm '{run_id}' could be read: its nodes left, or their records are unreadable"
        )
    return summarize(run_id, config, nodes, get_dht_time(), warnings, list(configs))


def find_swarm(
    dht: hivemind.DHT, run_id: str, timeout: float, config_hash: str | None = None
) -> dict[str, Any]:
    """`fetch_summary`, retried until the run's records appear or `timeout` seconds have passed."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return fetch_summary(dht, run_id, config_hash)
        except SwarmNotFound as e:
            if time.monotonic() + POLL_S > deadline:
                raise SwarmNotFound(f"{e} after {timeout:.0f}s{other_swarms_hint(dht, run_id)}") from None
        time.sleep(POLL_S)


def _show(summary: dict[str, Any], as_json: bool, watch: bool, plot_path: str | None) -> None:
    if plot_path:
        plot(summary, plot_path)
    if as_json:
        text = json.dumps(summary, indent=None if watch else 2)
    else:
        text = render(summary)
    if watch and sys.stdout.isatty() and not as_json:
        text = "\x1b[H\x1b[2J" + text
    click.echo(text)


def run_status(
    peers: Sequence[str],
    run_id: str,
    as_json: bool,
    watch: bool,
    plot_path: str | None,
    timeout: float,
    interval: float,
    swarm_key=None,
    config_hash: str | None = None,
) -> None:
    if timeout <= 0:
        raise ValueError("--timeout: must be positive")
    if interval <= 0:
        raise ValueError("--interval: must be positive")
    if plot_path and not Path(plot_path).resolve().parent.is_dir():
        raise ValueError(f"--plot: directory {Path(plot_path).resolve().parent} does not exist")
    started = time.monotonic()
    stop = threading.Event()
    if watch:
        # Ctrl-C only sets a flag: a KeyboardInterrupt raised inside a DHT call could leave the DHT unable to shut down
        signal.signal(signal.SIGINT, lambda *_: stop.set())
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
    dht = open_dht(peers, timeout, swarm_key)
    try:
        summary = find_swarm(dht, run_id, max(POLL_S, timeout - (time.monotonic() - started)), config_hash)
        _show(summary, as_json, watch, plot_path)
        while watch and not stop.wait(interval):
            try:
                summary = fetch_summary(dht, run_id, config_hash)
            except SwarmNotFound as e:
                click.echo(f"{time.strftime('%H:%M:%S')} {e}", err=True)
                continue
            _show(summary, as_json, watch, plot_path)
    except KeyboardInterrupt:
        pass
    finally:
        dht.shutdown()
