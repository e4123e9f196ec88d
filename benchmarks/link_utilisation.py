"""link_utilisation: how much of a shaped link a SPES round uses while it transfers.

Each node sits in a network namespace whose link is shaped with tbf to the rate in both directions. Its link
counters are sampled 20 times a second. In each complete round window (see network_runs) the transfer time T runs
from the first to the last 50 ms interval in which either direction moved more than 5% of the rate (idle gaps in
between count). Utilisation = payload of the busier direction / (T x rate), where payload is the node's own
accounting (all-reduce parts at wire precision plus refresh tensors sent or received): 1.0 means the bottleneck
direction carried useful bytes at full rate for the whole transfer. Also reported: the same with all bytes on the
wire, and with T starting when the round's sync begins (so that the matchmaking wait counts).
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from benchmarks.bytes_per_round import SETTINGS as BYTES_SETTINGS
from benchmarks.bytes_per_round import configs
from benchmarks.common import LoadMonitor, emit, median, table, write_result
from benchmarks.netns import NetnsUnavailable, check_available
from benchmarks.network_runs import NetworkRun, RoundWindow, run_shaped_swarm

logger = logging.getLogger(__name__)

SETTINGS = {**BYTES_SETTINGS, "rates_mbit": [50, 200]}


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


def summarize(run: NetworkRun) -> dict:
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


def run(workdir: Path, settings: dict | None = None) -> dict:
    settings = {**SETTINGS, **(settings or {})}
    cfg = configs(settings)["spes"]
    try:
        check_available()
    except NetnsUnavailable as e:
        results = {"link_utilisation": None, "reason": f"network namespaces unavailable: {e}"}
        emit(f"link utilisation: not measured ({results['reason']})")
        write_result("link_utilisation", settings, results, {})
        return results
    with LoadMonitor() as load:
        by_rate = {
            str(rate): summarize(
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
    results = {
        "link_utilisation": min(r["utilisation_median"] for r in by_rate.values()),
        "by_rate": by_rate,
        "headline": "the lower of the per-rate medians over nodes and complete rounds",
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
            title=f"link utilisation (SPES, {settings['preset']}, {settings['num_nodes']} nodes, S={settings['spes_num_shards']})",
        )
    )
    write_result("link_utilisation", {**settings, "config": cfg.to_dict()}, results, load.summary())
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="runs/benchmarks/link_utilisation")
    args = parser.parse_args()
    started = time.time()
    run(Path(args.workdir))
    emit(f"link-utilisation benchmark took {time.time() - started:.0f}s")


if __name__ == "__main__":
    main()
