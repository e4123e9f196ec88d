"""bytes_per_round_ratio_vs_diloco: bytes a node sends plus receives per round, SPES versus the DiLoCo stand-in.

Both swarms run the same model, the same number of nodes and the same wire precision; the DiLoCo stand-in is the
same code with one shard holding every expert (every node trains and all-reduces the whole model). A second pair
(`bytes_per_round_ratio_vs_diloco_int8`) averages int8 pseudo-gradients with error feedback and a Nesterov outer
step on both sides, as DiLoCo is deployed; state served to refreshes and joiners stays at fp16 (weights are never
sent at 8 bits; a frozen copy of the last refresh is brought up to date by its holder's int8 update since then).
SPES refreshes its frozen experts every `refresh_every` rounds (2 here; `benchmarks.quality` compares the loss of
refreshing every round and every other round). Each node sits in its own network namespace, so the headline counts real bytes on its link (all traffic: all-reduce, refresh, DHT,
headers), per complete round window. The breakdown by kind is the nodes' own accounting: all-reduce bytes are
computed by the node from hivemind's butterfly formula at wire precision, refresh bytes are the serialized tensor
bytes that arrived (received) or that the node's state server streamed (served). The reference implementation's
central-server scheme, and larger swarms, are given analytically.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from benchmarks.common import LoadMonitor, emit, merge_latest, table, write_result
from benchmarks.netns import NetnsUnavailable, check_available
from benchmarks.network_runs import NetworkRun, run_shaped_swarm
from spes_node.config import SpesConfig, load_preset
from spes_node.daemon.plan import param_counts
from spes_node.daemon.traffic import round_traffic

logger = logging.getLogger(__name__)

SETTINGS = {
    "preset": "small",
    "num_nodes": 4,
    "spes_num_shards": 2,
    "sync_steps": 2,
    "refresh_every": 2,
    "rounds": 5,
    "rate_mbit": 200,
    "timeout_s": 1200,
    "int8": True,
}
UPDATES_INT8 = {"average": "updates", "wire_compression": "int8", "outer_optimizer": "nesterov"}
"""The int8 pair: pseudo-gradients at 8 bits with error feedback, DiLoCo's Nesterov outer step."""
KINDS = ("shared", "shard", "refresh_received", "refresh_served")


def configs(settings: dict) -> dict[str, SpesConfig]:
    base = load_preset(settings["preset"])
    n = settings["num_nodes"]
    spes_shards = settings["spes_num_shards"]
    spes = {
        "num_shards": spes_shards,
        "sync_steps": settings["sync_steps"],
        "refresh_every": settings["refresh_every"],
        "replication_target": n // spes_shards,
    }
    diloco = {"num_shards": 1, "sync_steps": settings["sync_steps"], "replication_target": n}
    cfgs = {"spes": base.replace(swarm=spes), "diloco": base.replace(swarm=diloco)}
    if settings.get("int8"):
        cfgs["spes_int8"] = base.replace(swarm={**spes, **UPDATES_INT8})
        cfgs["diloco_int8"] = base.replace(swarm={**diloco, **UPDATES_INT8})
    return cfgs


def steady_rounds(refresh_every: int, rounds: int) -> range:
    """The round windows of the steady state: from the round after the first refresh (every node's first refresh of
    its frozen copies takes whole shards; later refreshes of a copy of the last refresh move the holder's update),
    whole refresh periods only, so that refresh rounds and the rounds between them count as often as they occur."""
    first = refresh_every + 1
    periods = (rounds - first) // refresh_every  # windows 1 .. rounds - 1 are complete
    if periods < 1:
        raise ValueError(f"rounds: {rounds} holds no whole refresh period after the first refresh")
    return range(first, first + periods * refresh_every)


def per_round(run: NetworkRun, steady: range) -> dict:
    """Mean bytes per node per complete round of the steady state (`steady_rounds`): by kind (accounting) and on
    the wire; with the same figures over every complete round (the first refresh included) under "all_rounds"."""
    windows = [w for w in run.windows if w.round in steady]
    if not windows:
        raise RuntimeError(
            f"{run.label}: no complete round windows in rounds {steady.start}-{steady.stop - 1}"
        )
    result = _mean_window(run, windows)
    result["all_rounds"] = _mean_window(run, run.windows)
    return result


def _mean_window(run: NetworkRun, windows: list) -> dict:
    count = len(windows)
    by_kind = {
        "shared": sum(w.payload_sent["shared"] + w.payload_received["shared"] for w in windows) / count,
        "shard": sum(w.payload_sent["shard"] + w.payload_received["shard"] for w in windows) / count,
        "refresh_received": sum(w.payload_received["refresh"] for w in windows) / count,
        "refresh_served": sum(w.payload_sent["refresh_served"] for w in windows) / count,
    }
    failed = sum(len(r["report"].get("errors", [])) for n in run.nodes for r in n.timeline["rounds"])
    groups = sorted(
        {
            (r["report"]["shared_group"], r["report"]["shard_group"])
            for n in run.nodes
            for r in n.timeline["rounds"]
        }
    )
    return {
        "windows": count,
        "payload_by_kind": by_kind,
        "payload_total": sum(by_kind.values()),
        "wire_total": sum(w.wire_total for w in windows) / count,
        "wire_sent": sum(w.wire_sent for w in windows) / count,
        "wire_received": sum(w.wire_received for w in windows) / count,
        "failed_allreduces": failed,
        "group_sizes_seen": groups,
        "seconds": run.seconds,
    }


def analytic(cfg: SpesConfig, num_nodes: int) -> dict[str, float]:
    """Bytes per node per round from parameter counts: the node's network plan (`daemon.traffic`, one shard held;
    its docstring has the terms) as this benchmark reports it."""
    t = round_traffic(cfg, num_nodes)
    spes = {
        "shared": t.shared,
        "shard": t.shard,
        "refresh_received": t.refresh_received,
        "refresh_served": t.refresh_served,
        "total": t.total,
    }
    counts = param_counts(cfg.model, cfg.swarm.num_shards)
    own = counts["shared"] + counts["shard"]
    return {
        **{f"spes_{k}": v for k, v in spes.items()},
        "diloco_total": t.diloco,
        "server_total": t.server,
        "server_total_fp32": own * 4 + counts["total"] * 4,
        "spes_vs_diloco": t.total / t.diloco,
        "server_vs_diloco": t.server / t.diloco,
    }


def run(workdir: Path, settings: dict | None = None, write_latest: bool = False) -> dict:
    """Run the four swarms and write `bytes_per_round.json`; `write_latest`: merge the headlines into
    `latest.json` too (a run on its own; `python -m benchmarks` gathers them itself)."""
    settings = {**SETTINGS, **(settings or {})}
    cfgs = configs(settings)
    n, S = settings["num_nodes"], settings["spes_num_shards"]
    try:
        check_available()
        netns_problem = None
    except NetnsUnavailable as e:
        netns_problem = str(e)
        logger.warning(f"no network namespaces ({e}): counting the nodes' accounting on 127.0.0.1 only")
    with LoadMonitor() as load:
        runs = {
            name: run_shaped_swarm(
                name,
                cfg,
                n,
                settings["rate_mbit"],
                settings["rounds"],
                workdir / name,
                settings["timeout_s"],
                use_netns=netns_problem is None,
            )
            for name, cfg in cfgs.items()
        }
    steady = steady_rounds(settings["refresh_every"], settings["rounds"])
    measured = {name: per_round(r, steady) for name, r in runs.items()}
    spes, diloco = measured["spes"], measured["diloco"]
    headline_kind = "payload_total" if netns_problem else "wire_total"
    predicted = analytic(cfgs["spes"], n)
    int8 = {}
    if "spes_int8" in measured:
        int8 = {
            "bytes_per_round_ratio_vs_diloco_int8": measured["spes_int8"][headline_kind]
            / measured["diloco_int8"][headline_kind],
            "payload_ratio_vs_diloco_int8": measured["spes_int8"]["payload_total"]
            / measured["diloco_int8"]["payload_total"],
            "bytes_per_round_ratio_vs_diloco_int8_all_rounds": measured["spes_int8"]["all_rounds"][
                headline_kind
            ]
            / measured["diloco_int8"]["all_rounds"][headline_kind],
            "analytic_int8_same_setting": analytic(cfgs["spes_int8"], n),
        }
    extrapolated = {
        f"{preset} S={shards} n={nodes} refresh_every={every}": analytic(
            load_preset(preset).replace(swarm={"num_shards": shards, "refresh_every": every}), nodes
        )
        for preset, shards, nodes in (("small", 8, 16), ("spes-1b", 4, 8), ("spes-7b", 4, 8))
        for every in (1, 2, 4)
    }
    results = {
        "bytes_per_round_ratio_vs_diloco": spes[headline_kind] / diloco[headline_kind],
        "payload_ratio_vs_diloco": spes["payload_total"] / diloco["payload_total"],
        "bytes_per_round_ratio_vs_diloco_all_rounds": spes["all_rounds"][headline_kind]
        / diloco["all_rounds"][headline_kind],
        **int8,
        "measured": measured,
        "analytic_same_setting": predicted,
        "analytic_other_settings": extrapolated,
        "counting": (
            f"headline: the nodes' accounting (no namespaces: {netns_problem})"
            if netns_problem
            else "headline: link counters of each node's namespace (all traffic); by kind: the nodes' accounting"
        ),
    }
    mb = 1e6
    names = list(measured)
    rows = [
        [
            kind,
            *(measured[name]["payload_by_kind"][kind] / mb for name in names),
            predicted[f"spes_{kind}"] / mb,
        ]
        for kind in KINDS
    ]
    rows.append(
        [
            "payload total",
            *(measured[name]["payload_total"] / mb for name in names),
            predicted["spes_total"] / mb,
        ]
    )
    rows.append(["on the wire (tx+rx)", *(measured[name]["wire_total"] / mb for name in names), None])
    emit(
        table(
            ["MB per node per round", *names, "spes analytic"],
            rows,
            title=f"bytes per round ({settings['preset']}, {n} nodes, SPES S={S} x {n // S} replicas, "
            f"{cfgs['spes'].swarm.wire_compression} weights or int8 updates on the wire, "
            f"{settings['rate_mbit']} Mbit/s links)",
        )
    )
    emit(
        f"rounds {steady.start}-{steady.stop - 1} (steady state); over every round, the first refresh (whole shards) "
        f"included: {results['bytes_per_round_ratio_vs_diloco_all_rounds']:.3f} of DiLoCo"
        + (f", int8 {int8['bytes_per_round_ratio_vs_diloco_int8_all_rounds']:.3f}" if int8 else "")
    )
    emit(
        f"ratio vs DiLoCo: wire {results['bytes_per_round_ratio_vs_diloco']:.3f}, payload "
        f"{results['payload_ratio_vs_diloco']:.3f}, analytic {predicted['spes_vs_diloco']:.3f}; reference server scheme "
        f"{predicted['server_total'] / mb:.1f} MB per node ({predicted['server_vs_diloco']:.3f} of DiLoCo)"
    )
    if int8:
        emit(
            f"int8 updates, ratio vs DiLoCo int8: wire {int8['bytes_per_round_ratio_vs_diloco_int8']:.3f}, payload "
            f"{int8['payload_ratio_vs_diloco_int8']:.3f}, analytic "
            f"{int8['analytic_int8_same_setting']['spes_vs_diloco']:.3f}"
        )
    emit(
        table(
            ["analytic setting", "SPES MB", "DiLoCo MB", "server MB", "SPES/DiLoCo"],
            [
                [k, v["spes_total"] / mb, v["diloco_total"] / mb, v["server_total"] / mb, v["spes_vs_diloco"]]
                for k, v in extrapolated.items()
            ],
        )
    )
    settings = {**settings, "configs": {name: cfg.to_dict() for name, cfg in cfgs.items()}}
    write_result("bytes_per_round", settings, results, load.summary())
    if write_latest:
        merge_latest(
            {
                key: results.get(key)
                for key in (
                    "bytes_per_round_ratio_vs_diloco",
                    "bytes_per_round_ratio_vs_diloco_int8",
                    "payload_ratio_vs_diloco",
                )
            }
        )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="runs/benchmarks/bytes_per_round")
    parser.add_argument("--no-latest", action="store_true", help="leave latest.json alone")
    args = parser.parse_args()
    started = time.time()
    run(Path(args.workdir), write_latest=not args.no_latest)
    emit(f"bytes-per-round benchmark took {time.time() - started:.0f}s")


if __name__ == "__main__":
    main()
