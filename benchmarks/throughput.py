"""throughput_ratio: a node's training tokens/s over a run including its syncs, divided by the same loop without syncs.

The same swarm (same model, nodes, shards, data) runs with syncing, with overlapped syncing (`swarm.overlap`: a
round's all-reduce runs while the next round's steps go on) and with syncing turned off: the node loop, its
per-round checkpoints and its round count stay, only the round's work is skipped (see node_runner).

On a machine that others use too, the runs follow each other under different loads: raw tokens/s of two runs are
not comparable (their ratio is reported, with each run's load, but is not the headline). The headline compares each
run with itself: the share of a node's wall time spent inside training steps, over whole cycles of one sync plus H
steps (see `node_rate`), with syncing divided by without. A node's steps and its syncs run under the same load, so
this is the node's tokens/s divided by what the same loop would do at that load without syncs. With overlap, the
background all-reduce also slows the steps on a CPU (it competes for the same cores, as it would not with a GPU);
that slowdown is not in the share-of-time ratio, and the mean step time of each run is reported beside it.

The headline is the run with the preset's own round options: `overlap_shards` by default (the shards' all-reduces
run beside the next steps, `swarm.overlap_shards`), `overlap` with `swarm.overlap`, the sync as published with
neither; "as published" and "overlap" are reported beside it. `overlap_shards_lag` is `overlap_shards` with
`swarm.shared_lag_steps` = 1 (training goes on for a step while the shared all-reduce runs). `--variants` can add
`sync_int8` and `overlap_int8`: the same with int8 pseudo-gradients on the wire (`swarm.average = "updates"`,
`swarm.wire_compression = "int8"`), half the fp16 weights' bytes per all-reduce, and `sync_idle`: the sync as
published before nodes trained while waiting for slower peers (`swarm.train_while_waiting = false`: a node that
reaches the sync first idles in matchmaking).
`uneven` and `uneven_idle` are `sync` and `sync_idle` on unequal cards: node 0's steps take `slow_node_delay_s`
longer (counted as step time, as on a slower card), so that the others reach each sync first.

`--rate-mbit R` runs every node in its own network namespace behind a link shaped to R Mbit/s each way
(`benchmarks/netns.py`, tbf on each node's veth pair, as in the link benchmark), so that the sync's transfers take
the time they would on a home connection; results go to `results/throughput_<R>mbit.json`. Without it the nodes
talk over loopback (`results/throughput.json`), where a sync mostly waits on matchmaking.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import shutil
import time
from pathlib import Path

from benchmarks.common import LoadMonitor, emit, merge_latest, table, write_result
from benchmarks.swarm import BenchSwarm, NodeRun
from spes_node.config import SpesConfig, load_preset

logger = logging.getLogger(__name__)

SETTINGS = {
    "preset": "small",
    "num_nodes": 4,
    "num_shards": 2,
    "rounds": 2,
    "variants": ["sync", "no_sync", "overlap", "overlap_shards"],
    "timeout_s": 1200,
    "rate_mbit": None,
    "slow_node_delay_s": 1.0,
    "result": None,
}


def node_rate(node: NodeRun, sync_steps: int) -> dict:
    """Tokens/s of one node in steady state, and over the whole run.

    Steady state: from the end of the last step of round 1 to the end of the last step of the last round, which
    holds rounds-1 whole cycles of one sync plus H steps (an overlapped sync runs inside the next steps). The
    first round (warm-up) and the last sync (never overlapped: the node leaves after it) are outside.
    Whole run: from the end of the first step to the end of the last round.
    """
    steps, rounds = node.timeline["steps"], node.timeline["rounds"]
    if len(rounds) < 2 or len(steps) < 2 * sync_steps:
        raise RuntimeError(
            f"{node.name}: needs 2 rounds of {sync_steps} steps, has {len(rounds)} and {len(steps)}"
        )
    # round 1's steps: those before its sync began (H, or more where the node trained while waiting for peers)
    first = sum(1 for s in steps if s[0] <= rounds[0]["start"])
    start, end = steps[first - 1][0], steps[-1][0]
    tokens = sum(s[1] for s in steps[first:])
    run_start, run_end = steps[0][0], max(rounds[-1]["end"], steps[-1][0])
    run_tokens = sum(s[1] for s in steps[1:])
    compute = sum(s[2] for s in steps[first:])
    return {
        "tokens_per_s": tokens / (end - start),
        "compute_share": compute / (end - start),
        "steady_seconds": end - start,
        "steady_tokens": tokens,
        "whole_run_tokens_per_s": run_tokens / (run_end - run_start),
        "step_seconds_mean": compute / len(steps[first:]),
        "round_seconds": [r["end"] - r["start"] for r in rounds],
        "round_steps": [r.get("report", {}).get("steps") for r in rounds],
        "round_phases": [r.get("report", {}).get("phases", {}) for r in rounds],
        "round_stalled": [r.get("report", {}).get("stalled") for r in rounds],
        # the rounds whose syncs lie in the steady window (the last one, after which the node left, is not)
        "steady_stalled": [r.get("report", {}).get("stalled") for r in rounds if start <= r["start"] < end],
        # overlapping the shards: when the shared result landed after the round began (the part of the stall that
        # is its all-reduce)
        "steady_shared_landed_at": [
            r.get("report", {}).get("shared_landed_at") for r in rounds if start <= r["start"] < end
        ],
    }


VARIANTS = (
    "sync",
    "no_sync",
    "overlap",
    "overlap_shards",
    "overlap_shards_lag",
    "sync_int8",
    "overlap_int8",
    "sync_idle",
    "uneven",
    "uneven_idle",
)
HEADLINE_VARIANTS = ("sync", "no_sync", "overlap")
INT8_UPDATES = {"average": "updates", "wire_compression": "int8"}


def config(settings: dict, variant: str) -> SpesConfig:
    n, S = settings["num_nodes"], settings["num_shards"]
    swarm = {
        "num_shards": S,
        "replication_target": n // S,
        "overlap": variant.startswith("overlap") and not variant.startswith("overlap_shards"),
        "overlap_shards": variant.startswith("overlap_shards"),
        "shared_lag_steps": 1 if variant == "overlap_shards_lag" else 0,
        "train_while_waiting": not variant.endswith("_idle"),
    }
    return load_preset(settings["preset"]).replace(
        swarm={**swarm, **(INT8_UPDATES if variant.endswith("_int8") else {})}
    )


def run(workdir: Path, settings: dict | None = None, write_latest: bool = False) -> dict:
    """Run the variants and write the results; `write_latest`: merge the headlines into `latest.json` too (a run on
    its own; `python -m benchmarks` gathers them itself)."""
    settings = {**SETTINGS, **(settings or {})}
    variants = {}
    rate = settings["rate_mbit"]
    unknown = [name for name in settings["variants"] if name not in VARIANTS]
    if unknown or "no_sync" not in settings["variants"] or "sync" not in settings["variants"]:
        raise ValueError(
            f"variants must include sync and no_sync, from {VARIANTS}; got {settings['variants']}"
        )
    for name in settings["variants"]:
        cfg = config(settings, name)
        with LoadMonitor() as load, _network(settings["num_nodes"], rate) as network:
            swarm = BenchSwarm(
                workdir / name, cfg, settings["num_nodes"], run_id=f"tp_{name}", network=network
            )
            nodes = swarm.run(
                settings["rounds"],
                timeout=settings["timeout_s"],
                no_sync=name == "no_sync",
                step_delays={0: settings["slow_node_delay_s"]} if name.startswith("uneven") else None,
            )
        _drop_checkpoints(nodes)
        rates = [node_rate(n, cfg.swarm.sync_steps) for n in nodes]
        variants[name] = {
            "tokens_per_s_per_node": sum(r["tokens_per_s"] for r in rates) / len(rates),
            "compute_share": sum(r["compute_share"] for r in rates) / len(rates),
            "step_seconds_mean": sum(r["step_seconds_mean"] for r in rates) / len(rates),
            "whole_run_tokens_per_s_per_node": sum(r["whole_run_tokens_per_s"] for r in rates) / len(rates),
            "nodes": rates,
            "load": load.summary(),
            "failed_allreduces": sum(
                len(r["report"].get("errors", [])) for n in nodes for r in n.timeline["rounds"]
            ),
            "config": cfg.to_dict(),
        }
    share = variants["no_sync"]["compute_share"]
    base = variants["no_sync"]["tokens_per_s_per_node"]
    whole_base = variants["no_sync"]["whole_run_tokens_per_s_per_node"]
    preset = load_preset(settings["preset"]).swarm
    default = (
        "overlap"
        if preset.overlap
        else ("overlap_shards_lag" if preset.shared_lag_steps else "overlap_shards")
        if preset.overlap_shards
        else "sync"
    )
    default = default if default in variants else "sync"  # the preset's own not run: the sync as published
    other_ratios = {
        f"throughput_ratio_{name}": variants[name]["compute_share"] / share
        for name in variants
        if name not in HEADLINE_VARIANTS
    }
    result_name = settings.get("result") or (f"throughput_{rate:g}mbit" if rate else "throughput")
    results = {
        "throughput_ratio": variants[default]["compute_share"] / share,
        "headline_variant": default,
        "throughput_link_mbit": rate,
        "result_file": f"{result_name}.json",
        "throughput_ratio_as_published": variants["sync"]["compute_share"] / share,
        "throughput_ratio_overlap": (
            variants["overlap"]["compute_share"] / share if "overlap" in variants else None
        ),
        "raw_tokens_per_s_ratio": variants["sync"]["tokens_per_s_per_node"] / base,
        "raw_tokens_per_s_ratio_overlap": (
            variants["overlap"]["tokens_per_s_per_node"] / base if "overlap" in variants else None
        ),
        "raw_whole_run_ratio": variants["sync"]["whole_run_tokens_per_s_per_node"] / whole_base,
        **other_ratios,
        "method": "headline: share of wall time in training steps (steady state), with sync / without sync",
        "variants": variants,
    }
    emit(
        table(
            [
                "variant",
                "time in steps",
                "ratio",
                "tokens/s per node",
                "raw ratio",
                "step s",
                "round s",
                "steps/round",
                "matchmaking s",
                "all-reduce s",
                "after s",
                "stalled s",
                "shared landed s",
                "load",
            ],
            [
                [
                    name,
                    v["compute_share"],
                    v["compute_share"] / share,
                    v["tokens_per_s_per_node"],
                    v["tokens_per_s_per_node"] / base,
                    v["step_seconds_mean"],
                    sum(sum(r["round_seconds"]) / len(r["round_seconds"]) for r in v["nodes"])
                    / len(v["nodes"]),
                    _mean_round_steps(v["nodes"]),
                    *(_mean_phase(v["nodes"], phase) for phase in ("matchmaking", "allreduce", "after")),
                    _mean_stalled(v["nodes"]),
                    _mean_steady(v["nodes"], "steady_shared_landed_at"),
                    v["load"]["loadavg_1min_mean"],
                ]
                for name, v in variants.items()
            ],
            title=f"throughput ({settings['preset']}, {settings['num_nodes']} nodes, S={settings['num_shards']}, "
            f"{settings['rounds']} rounds of {config(settings, 'sync').swarm.sync_steps} steps, "
            + (f"links shaped to {rate:g} Mbit/s)" if rate else "loopback)"),
        )
    )
    loads = [v["load"] for v in variants.values()]
    write_result(result_name, settings, results, {"per_variant": loads})
    if write_latest:
        keys = ("throughput_ratio", "throughput_ratio_as_published", "throughput_ratio_overlap")
        merge_latest(
            {
                # a variant not run leaves latest.json's figure of another run alone
                **{key: results[key] for key in keys if results[key] is not None},
                # the suite's name for it (run_all); left out, latest.json kept another run's raw ratio
                "throughput_raw_tokens_per_s_ratio": results["raw_tokens_per_s_ratio"],
                "throughput_link_mbit": rate,
                **other_ratios,
            },
            details={"throughput": results["result_file"]},
        )
    return results


def _mean_round_steps(nodes: list[dict]) -> float | None:
    """Local steps per round over every node's rounds (H, plus steps trained while waiting for peers)."""
    steps = [s for node in nodes for s in node["round_steps"] if s is not None]
    return sum(steps) / len(steps) if steps else None


def _mean_phase(nodes: list[dict], phase: str) -> float | None:
    """Seconds of a round's `phase` (`RoundReport.phases`) over every node's rounds, the first (warm-up) left out."""
    seconds = [p[phase] for node in nodes for p in node.get("round_phases", [])[1:] if phase in p]
    return sum(seconds) / len(seconds) if seconds else None


def _drop_checkpoints(nodes: list[NodeRun]) -> None:
    """Remove the nodes' checkpoints, which the benchmark does not read: the small preset checkpoints every round,
    245 MiB a node, up to three kept, so each variant left about 3 GB in the workdir (20 GB for two runs)."""
    for node in nodes:
        for path in node.directory.glob("step-*"):
            shutil.rmtree(path, ignore_errors=True)


def _mean_stalled(nodes: list[dict]) -> float | None:
    """Seconds a round held training (`RoundReport.stalled`) over the rounds whose syncs lie in `node_rate`'s steady
    window, which the ratio measures: the last sync of a run, never overlapped (the node leaves after it), is not."""
    return _mean_steady(nodes, "steady_stalled")


def _mean_steady(nodes: list[dict], key: str) -> float | None:
    """The mean of a per-round figure over every node's steady rounds (see `_mean_stalled`), None where no round
    has one."""
    seconds = [s for node in nodes for s in node.get(key, []) if s is not None]
    return sum(seconds) / len(seconds) if seconds else None


def _network(num_nodes: int, rate_mbit: float | None):
    """Namespaces behind links shaped to `rate_mbit` for the nodes, or nothing (loopback)."""
    if rate_mbit is None:
        return contextlib.nullcontext()
    from benchmarks.netns import ShapedNetwork

    return ShapedNetwork(num_nodes, rate_mbit)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="runs/benchmarks/throughput")
    parser.add_argument(
        "--rate-mbit", type=float, default=None, help="shape each node's link (namespaces, root)"
    )
    parser.add_argument("--rounds", type=int, default=SETTINGS["rounds"])
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=VARIANTS,
        default=SETTINGS["variants"],
        help="runs to make (sync and no_sync always; the int8 ones average int8 pseudo-gradients)",
    )
    parser.add_argument("--no-latest", action="store_true", help="leave latest.json alone")
    parser.add_argument(
        "--result", default=None, help="results/<RESULT>.json (default: throughput or throughput_<R>mbit)"
    )
    parser.add_argument(
        "--slow-node-delay",
        type=float,
        default=SETTINGS["slow_node_delay_s"],
        help="seconds added to each step of node 0 in the uneven variants",
    )
    args = parser.parse_args()
    started = time.time()
    run(
        Path(args.workdir),
        {
            "rate_mbit": args.rate_mbit,
            "rounds": args.rounds,
            "variants": args.variants,
            "result": args.result,
            "slow_node_delay_s": args.slow_node_delay,
        },
        write_latest=not args.no_latest,
    )
    emit(f"throughput benchmark took {time.time() - started:.0f}s")


if __name__ == "__main__":
    main()
