"""link_utilisation: how much of a shaped link averaging uses while it transfers, where the link is the limit.

Main measurement (`link_allreduce.py`): 3 averaging peers (and 2, at 50 and 200 Mbit/s), each in its own
network namespace behind a tbf-shaped link, all-reduce a vector of tens of millions of values (fp16 on the wire)
with `GroupAverager`, at 50 and 200 Mbit/s and 1 Gbit/s. Nothing else runs in the peers, so the link is the limit as long as the cores keep up;
the CPU seconds of the peers' processes during each transfer are reported beside the utilisation, so that a
reader sees where the cores become the limit. The headline `link_utilisation` is the lower of the 50 and
200 Mbit/s medians.

Second table (`--rounds`, and in the suite): the earlier measurement on whole SPES rounds of 4 full nodes of the
small preset, where training, refresh and matchmaking share the same cores. Each node sits in a network namespace
whose link is shaped with tbf to the rate in both directions. In each complete round window (see network_runs)
the transfer time T runs from the first to the last 50 ms interval in which either direction moved more than 5%
of the rate (idle gaps in between count). Utilisation = payload of the busier direction / (T x rate), where
payload is the node's own accounting (all-reduce parts plus refresh tensors sent or received). Also reported: the
same with all bytes on the wire, and with T starting when the round's sync begins.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from benchmarks import common
from benchmarks.bytes_per_round import SETTINGS as BYTES_SETTINGS
from benchmarks.bytes_per_round import configs
from benchmarks.common import LoadMonitor, emit, median, table, write_result
from benchmarks.link_allreduce import measure
from benchmarks.link_allreduce import summarize as summarize_allreduce
from benchmarks.netns import TBF_BURST, TBF_LATENCY, NetnsUnavailable, check_available
from benchmarks.network_runs import NetworkRun, RoundWindow, run_shaped_swarm
from spes_node.config import SwarmConfig

logger = logging.getLogger(__name__)

SETTINGS = {
    "peers": 3,
    "also_peers": {2: [50, 200]},
    "rates_mbit": [50, 200, 1000],
    "params_by_rate": {"50": 25_000_000, "200": 50_000_000, "1000": 50_000_000},
    "steps": 3,
    "compression": "fp16",
    "part_size_bytes": None,
    "part_window": None,
    "tbf_burst": TBF_BURST,
    "tbf_latency": TBF_LATENCY,
    "namespace_sysctls": {},
    "fresh": "disconnect" if SwarmConfig().fresh_connections else None,
    "headline_rates_mbit": [50, 200],
    "full_nodes": {**BYTES_SETTINGS, "rates_mbit": [50, 200]},
}


def window_utilisation(w: RoundWindow, rate_mbit: float) -> dict | None:
    if w.active_start is None or w.active_end <= w.active_start:
        return None
    bytes_per_s = rate_mbit * 1e6 / 8
    span = w.active_end - w.active_start
    sent, received = sum(w.payload_sent.values()), sum(w.payload_received.values())
    busier = max(sent, received)
    return {
        "node": w.node,
        "round": w.round,
        "transfer_seconds": span,
        "payload_sent": sent,
        "payload_received": received,
        "utilisation": busier / (span * bytes_per_s),
        "utilisation_wire": max(w.active_wire_sent, w.active_wire_received) / (span * bytes_per_s),
        "utilisation_from_sync_start": busier / ((w.active_end - w.start) * bytes_per_s),
        "busier_direction_mb_per_s": busier / span / 1e6,
    }


def summarize_rounds(run: NetworkRun) -> dict:
    per_window = [u for w in run.windows if (u := window_utilisation(w, run.rate_mbit)) is not None]
    if not per_window:
        raise RuntimeError(f"{run.label}: no round moved data")
    return {
        "rate_mbit": run.rate_mbit,
        "utilisation_median": median([u["utilisation"] for u in per_window]),
        "utilisation_wire_median": median([u["utilisation_wire"] for u in per_window]),
        "utilisation_from_sync_start_median": median([u["utilisation_from_sync_start"] for u in per_window]),
        "transfer_seconds_median": median([u["transfer_seconds"] for u in per_window]),
        "windows": per_window,
        "failed_allreduces": sum(
            len(r["report"].get("errors", [])) for n in run.nodes for r in n.timeline["rounds"]
        ),
    }


def run_allreduce(workdir: Path, settings: dict, peers: int, rates: list[int]) -> dict:
    by_rate = {}
    for rate in rates:
        params = settings["params_by_rate"][str(rate)]
        emit(f"link: {peers} peers, {params / 1e6:.0f}M values at {rate} Mbit/s ...")
        measures = measure(
            rate,
            params,
            peers,
            settings["steps"],
            workdir / f"allreduce_{peers}peers_{rate}mbit",
            burst=settings["tbf_burst"],
            latency=settings["tbf_latency"],
            compression=settings["compression"],
            part_size=settings["part_size_bytes"],
            part_window=settings["part_window"],
            sysctls=settings["namespace_sysctls"],
            fresh=settings["fresh"],
        )
        by_rate[str(rate)] = {"params": params, **summarize_allreduce(measures, rate)}
    emit(
        table(
            [
                "link",
                "values",
                "on wire s",
                "bytes/rate s",
                "util. up",
                "util. down",
                "wire up",
                "wire down",
                "peer cores",
                "of which p2pd",
                "all peers",
                "machine busy",
            ],
            [
                [
                    f"{rate} Mbit/s",
                    f"{r['params'] / 1e6:.0f}M",
                    r["wire_seconds_median"],
                    r["ideal_seconds_median"],
                    r["utilisation_up_median"],
                    r["utilisation_down_median"],
                    r["utilisation_wire_up_median"],
                    r["utilisation_wire_down_median"],
                    r["cpu_cores_busy_median"],
                    r["cpu_cores_busy_p2pd_median"],
                    r["peers_cpu_cores_busy_median"],
                    r["machine_busy_median"],
                ]
                for rate, r in by_rate.items()
            ],
            title=(
                f"link utilisation of an all-reduce ({peers} peers, {settings['compression']}, "
                f"tbf burst {settings['tbf_burst']}, latency {settings['tbf_latency']}"
                + "".join(f", {k}={v}" for k, v in settings["namespace_sysctls"].items())
                + "; medians over peers and all-reduces after the first)"
            ),
        )
    )
    for rate, r in by_rate.items():
        emit(
            f"{rate} Mbit/s, all-reduce after all-reduce: utilisation "
            + " ".join(f"{u:.3f}" for u in r["utilisation_by_step"])
            + "; TCP segments retransmitted "
            + " ".join(f"{x:.2%}" for x in r["tcp_retransmitted_by_step"])
        )
    return by_rate


def run_rounds(workdir: Path, settings: dict) -> dict:
    cfg = configs(settings)["spes"]
    by_rate = {
        str(rate): summarize_rounds(
            run_shaped_swarm(
                "spes",
                cfg,
                settings["num_nodes"],
                rate,
                settings["rounds"],
                workdir / f"spes_{rate}mbit",
                settings["timeout_s"],
            )
        )
        for rate in settings["rates_mbit"]
    }
    emit(
        table(
            ["link", "utilisation", "wire", "from sync start", "transfer s", "MB/s busier dir."],
            [
                [
                    f"{rate} Mbit/s",
                    r["utilisation_median"],
                    r["utilisation_wire_median"],
                    r["utilisation_from_sync_start_median"],
                    r["transfer_seconds_median"],
                    median([u["busier_direction_mb_per_s"] for u in r["windows"]]),
                ]
                for rate, r in by_rate.items()
            ],
            title=(
                f"link utilisation of whole rounds (SPES, {settings['preset']}, {settings['num_nodes']} full "
                f"nodes, S={settings['spes_num_shards']})"
            ),
        )
    )
    return {"by_rate": by_rate, "config": cfg.to_dict()}


def run(
    workdir: Path,
    settings: dict | None = None,
    rounds: bool = True,
    write_latest: bool = False,
    result_name: str = "link_utilisation",
) -> dict:
    settings = {**SETTINGS, **(settings or {})}
    try:
        check_available()
    except NetnsUnavailable as e:
        results = {"link_utilisation": None, "reason": f"network namespaces unavailable: {e}"}
        emit(f"link utilisation: not measured ({results['reason']})")
        write_result(result_name, settings, results, {})
        return results
    with LoadMonitor() as load:
        by_rate = run_allreduce(workdir, settings, settings["peers"], settings["rates_mbit"])
        by_peers = {
            str(n): run_allreduce(workdir, settings, n, rates) for n, rates in settings["also_peers"].items()
        }
        round_results = run_rounds(workdir, settings["full_nodes"]) if rounds else None
    headline = {
        r: by_rate[str(r)]["utilisation_median"] for r in settings["headline_rates_mbit"] if str(r) in by_rate
    } or {r: v["utilisation_median"] for r, v in by_rate.items()}
    results = {
        "link_utilisation": min(headline.values()),
        "headline": (
            "the lower of the median utilisations (busier direction, averager-counted bytes over time on the "
            f"wire x rate) at {' and '.join(str(r) for r in headline)} Mbit/s"
        ),
        "by_rate": by_rate,
        "by_rate_other_group_sizes": by_peers,
        "rounds": round_results
        if round_results is not None
        else "not run (python -m benchmarks.link_utilisation --rounds runs it)",
    }
    write_result(result_name, settings, results, load.summary())
    if write_latest:
        update_latest(results)
    return results


def update_latest(results: dict) -> None:
    """Merge the link headline into `latest.json`, keeping every other key."""
    common.merge_latest(
        {
            "link_utilisation": results["link_utilisation"],
            "link_utilisation_by_rate": {
                rate: r["utilisation_median"] for rate, r in results["by_rate"].items()
            },
        }
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="runs/benchmarks/link_utilisation")
    parser.add_argument("--rounds", action="store_true", help="also measure whole rounds of 4 full nodes")
    parser.add_argument("--rates", type=int, nargs="*", help="link rates in Mbit/s (default 50 200 1000)")
    parser.add_argument("--peers", type=int)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--part-size", type=int, help="all-reduce part size in bytes (default: hivemind's)")
    parser.add_argument(
        "--part-window",
        type=int,
        help="parts a reducer takes ahead per sender (default: the code's; 1: lockstep)",
    )
    parser.add_argument("--tbf-burst", help=f"tbf bucket of each shaped link (default {TBF_BURST})")
    parser.add_argument(
        "--sysctl",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set in every peer's namespace (e.g. net.ipv4.tcp_congestion_control=reno); repeatable",
    )
    parser.add_argument(
        "--fresh",
        choices=["none", "averager", "connections", "disconnect", "peer"],
        help="for every all-reduce: the same connections, a new averager in each peer (same DHT and p2p daemon), "
        "the peers' connections to each other reset (ss -K), the peers' connections closed by their p2p daemons "
        "(as a node with swarm.fresh_connections does), or new peer processes (default: as the node's default, "
        f"{SETTINGS['fresh'] or 'none'})",
    )
    parser.add_argument("--values", type=int, help="values per all-reduce at every rate (default: by rate)")
    parser.add_argument("--no-latest", action="store_true", help="leave latest.json alone")
    parser.add_argument("--result", default="link_utilisation", help="name of the result file in results/")
    args = parser.parse_args()
    settings = {}
    if args.rates:
        settings["rates_mbit"] = args.rates
    if args.peers:
        settings["peers"], settings["also_peers"] = args.peers, {}
    if args.steps:
        settings["steps"] = args.steps
    if args.part_size:
        settings["part_size_bytes"] = args.part_size
    if args.part_window:
        settings["part_window"] = args.part_window
    if args.tbf_burst:
        settings["tbf_burst"] = args.tbf_burst
    if args.sysctl:
        if not all("=" in item for item in args.sysctl):
            parser.error("--sysctl takes KEY=VALUE")
        settings["namespace_sysctls"] = dict(item.split("=", 1) for item in args.sysctl)
    if args.fresh:
        settings["fresh"] = None if args.fresh == "none" else args.fresh
    if args.values:
        settings["params_by_rate"] = {
            str(rate): args.values for rate in SETTINGS["rates_mbit"] + (args.rates or [])
        }
    started = time.time()
    run(
        Path(args.workdir),
        settings,
        rounds=args.rounds,
        write_latest=not args.no_latest,
        result_name=args.result,
    )
    emit(f"link-utilisation benchmark took {time.time() - started:.0f}s")


if __name__ == "__main__":
    main()
