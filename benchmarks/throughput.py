"""throughput_ratio: a node's training tokens/s over a run including its syncs, divided by the same loop without syncs.

The same swarm (same model, nodes, shards, data) runs once with syncing and once with syncing turned off: the node
loop, its per-round checkpoints and its round count stay, only the round's work is skipped (see node_runner). The
runs follow each other on the same machine, so they see the same number of node processes; the load from other work
on the machine is recorded for each. A node's rate counts the tokens of every step after its first, over the time
from the end of its first step to the end of its last round. With `swarm.overlap`, a round's all-reduce runs while
the next round's steps go on; that variant is measured too.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from benchmarks.common import LoadMonitor, emit, table, write_result
from benchmarks.swarm import BenchSwarm, NodeRun
from spes_node.config import SpesConfig, load_preset

logger = logging.getLogger(__name__)

SETTINGS = {
    "preset": "small",
    "num_nodes": 4,
    "num_shards": 2,
    "rounds": 2,
    "variants": ["sync", "no_sync", "overlap"],
    "timeout_s": 1200,
}


def node_rate(node: NodeRun) -> dict:
    """Tokens/s of one node from the end of its first step to the end of its last round."""
    steps, rounds = node.timeline["steps"], node.timeline["rounds"]
    if len(steps) < 2 or not rounds:
        raise RuntimeError(f"{node.name}: too few steps or rounds to measure")
    start, end = steps[0][0], max(rounds[-1]["end"], steps[-1][0])
    tokens = sum(s[1] for s in steps[1:])
    compute = sum(s[2] for s in steps[1:])
    return {
        "tokens": tokens,
        "seconds": end - start,
        "tokens_per_s": tokens / (end - start),
        "step_seconds_total": compute,
        "round_seconds": [r["end"] - r["start"] for r in rounds],
    }


def config(settings: dict, overlap: bool) -> SpesConfig:
    n, S = settings["num_nodes"], settings["num_shards"]
    return load_preset(settings["preset"]).replace(
        swarm={"num_shards": S, "replication_target": n // S, "overlap": overlap}
    )


def run(workdir: Path, settings: dict | None = None) -> dict:
    settings = {**SETTINGS, **(settings or {})}
    variants = {}
    for name in settings["variants"]:
        cfg = config(settings, overlap=name == "overlap")
        with LoadMonitor() as load:
            nodes = BenchSwarm(workdir / name, cfg, settings["num_nodes"], run_id=f"tp_{name}").run(
                settings["rounds"], timeout=settings["timeout_s"], no_sync=name == "no_sync"
            )
        rates = [node_rate(n) for n in nodes]
        variants[name] = {
            "tokens_per_s_per_node": sum(r["tokens_per_s"] for r in rates) / len(rates),
            "nodes": rates,
            "load": load.summary(),
            "failed_allreduces": sum(
                len(r["report"].get("errors", [])) for n in nodes for r in n.timeline["rounds"]
            ),
            "config": cfg.to_dict(),
        }
    base = variants["no_sync"]["tokens_per_s_per_node"]
    results = {
        "throughput_ratio": variants["sync"]["tokens_per_s_per_node"] / base,
        "throughput_ratio_overlap": (
            variants["overlap"]["tokens_per_s_per_node"] / base if "overlap" in variants else None
        ),
        "variants": variants,
    }
    emit(
        table(
            ["variant", "tokens/s per node", "ratio", "mean round s", "load avg"],
            [
                [
                    name,
                    v["tokens_per_s_per_node"],
                    v["tokens_per_s_per_node"] / base,
                    sum(sum(r["round_seconds"]) / len(r["round_seconds"]) for r in v["nodes"])
                    / len(v["nodes"]),
                    v["load"]["loadavg_1min_mean"],
                ]
                for name, v in variants.items()
            ],
            title=f"throughput ({settings['preset']}, {settings['num_nodes']} nodes, S={settings['num_shards']}, "
            f"{settings['rounds']} rounds of {config(settings, False).swarm.sync_steps} steps)",
        )
    )
    loads = [v["load"] for v in variants.values()]
    write_result("throughput", settings, results, {"per_variant": loads})
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="runs/benchmarks/throughput")
    args = parser.parse_args()
    started = time.time()
    run(Path(args.workdir))
    emit(f"throughput benchmark took {time.time() - started:.0f}s")


if __name__ == "__main__":
    main()
