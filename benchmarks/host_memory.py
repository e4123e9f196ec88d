"""host_memory: the host memory of real spes-1b nodes on this CPU machine, against the memory plan.

Each node is a real `spes-node join` (instrumented by `benchmarks.node_runner`) of the spes-1b model at full size
(1 of 4 shards held, frozen experts as the preset stores them), with the training shortened so that a CPU runs it:
short sequences, micro-batch 1, no accumulation, a round every `sync_steps` steps, a checkpoint every round. A node
is a process tree (the daemon, hivemind's DHT and averager processes, their p2p daemons), so the sampler sums the
proportional set size (PSS, `/proc/<pid>/smaps_rollup`) over every process of the tree twice a second: shared
memory (hivemind's averager buffers) counts once, split between the processes that map it. The peak of that sum
is the node's host memory.

It is compared with:
- the plan's figure for a node training on the CPU (`plan.host_need`: the training state a GPU would hold, in fp32,
  plus the host-side buffers of a running node);
- the model as stored (trainable weights and AdamW moments in fp32, frozen experts at storage precision), which the
  issue's goal for a GPU node's host memory is stated against (1.5x). On a CPU the training state lives in the same
  memory, so the measured figure includes it: the ratio is an upper bound of what a GPU node would show.

Before starting, the plan's need for the requested number of nodes is checked against the memory available; nodes
that do not fit are not started, and the result says so, unless `--start-anyway`: the plan is an upper bound, and
whether two nodes fit on a 24 GB machine is then measured. The nodes' processes are made the kernel's first choice
for the OOM killer (`oom_score_adj` 1000), so a run that does not fit ends a node, which the result records with
the lowest memory available seen during the run.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import threading
import time
from pathlib import Path

from benchmarks.common import LoadMonitor, emit, mib, table, write_result
from benchmarks.swarm import BenchSwarm, SwarmFailed

logger = logging.getLogger(__name__)

SETTINGS = {
    "preset": "spes-1b",
    "nodes": 1,
    "rounds": 3,
    "sync_steps": 2,
    "seq_len": 128,
    "micro_batch_size": 1,
    "grad_accum": 1,
    "sample_interval_s": 0.5,
    "timeout_s": 1500,
    "same_shard": False,
}
GIB = 1024**3


def rehearsal_config(settings: dict):
    """The preset at full model size, with the training shortened for a CPU and data that needs no download."""
    from spes_node.config import load_preset

    return load_preset(settings["preset"]).replace(
        train={
            "seq_len": settings["seq_len"],
            "micro_batch_size": settings["micro_batch_size"],
            "grad_accum": settings["grad_accum"],
            "warmup_steps": 1,
            "checkpoint_every": settings["sync_steps"],
            "checkpoint_every_minutes": 0,
            "log_every": 1,
        },
        # with --same-shard every node stays a replica of shard 0: at a replication target of 1, placement moves
        # one of two nodes to an uncovered shard after the first round (a shard move, not replicas, is then measured)
        swarm={
            "sync_steps": settings["sync_steps"],
            "replication_target": settings["nodes"] if settings.get("same_shard") else 1,
            "matchmaking_time": 5.0,
        },
        data={"tokenizer": "bytes", "source": "default"},
    )


def _children() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    return children


def _pss_kib(pid: int) -> int:
    try:
        match = re.search(r"^Pss:\s+(\d+)", Path(f"/proc/{pid}/smaps_rollup").read_text(), re.M)
    except OSError:
        return 0
    return int(match.group(1)) if match else 0


def tree_pss(root: int) -> dict[int, tuple[str, int]]:
    """pid -> (process name, PSS in KiB) for every process of the tree under `root`."""
    children, stack, out = _children(), [root], {}
    while stack:
        pid = stack.pop()
        out[pid] = (_name(pid), _pss_kib(pid))
        stack.extend(children.get(pid, []))
    return out


def _name(pid: int) -> str:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    words = [a.decode(errors="replace") for a in argv if a]
    # hivemind's helper processes are forks of the daemon: the same command line, told apart by their threads
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        comm = "?"
    return f"{Path(words[0]).name if words else comm} ({comm})"


def tree_pss_kib(root: int, tree: dict[int, tuple[str, int]] | None = None) -> tuple[int, int]:
    """(PSS of the process tree under `root`, PSS of `root` alone), in KiB; from `tree` (`tree_pss`) if read."""
    tree = tree_pss(root) if tree is None else tree
    return sum(pss for _, pss in tree.values()), tree.get(root, ("", 0))[1]


def _oom_kills() -> int:
    """The kernel's count of OOM kills since boot (/proc/vmstat)."""
    match = re.search(r"^oom_kill (\d+)$", Path("/proc/vmstat").read_text(), re.M)
    return int(match.group(1)) if match else 0


def _first_for_oom_killer(processes: dict[int, tuple[str, int]], done: set[int]) -> None:
    """Each process not in `done` (once set, a process keeps its score; a fork inherits it)."""
    for pid in processes.keys() - done:
        done.add(pid)
        try:
            Path(f"/proc/{pid}/oom_score_adj").write_text("1000")
        except OSError:
            pass  # gone, or not ours to change


def _startup_seconds(timeline: dict) -> float | None:
    startup = timeline.get("startup", {})
    return startup["end"] - startup["start"] if "end" in startup and "start" in startup else None


def _mem_available() -> int:
    match = re.search(r"MemAvailable:\s+(\d+)", Path("/proc/meminfo").read_text())
    return int(match.group(1)) * 1024


def run(workdir: Path, settings: dict | None = None) -> dict:
    settings = {**SETTINGS, **(settings or {})}
    from spes_node.daemon.plan import host_need, memory_plan, param_counts

    cfg = rehearsal_config(settings)
    counts = param_counts(cfg.model, cfg.swarm.num_shards)
    plan = memory_plan(cfg, 1, advise=False)
    stored = plan.weights + plan.optimizer + plan.frozen
    need = host_need(cfg, 1)
    available = _mem_available()
    results = {
        "model_params": counts["total"],
        "plan_host_need_bytes": need,
        "plan_host_running_bytes": plan.host_running,
        "model_as_stored_bytes": stored,
        "mem_available_bytes": available,
        "nodes_fit_by_plan": need * settings["nodes"] <= available,
    }
    if not results["nodes_fit_by_plan"] and not settings.get("start_anyway"):
        results["finding"] = (
            f"{settings['nodes']} nodes need {need * settings['nodes'] / GIB:.1f} GiB by the plan; "
            f"{available / GIB:.1f} GiB is available: not started"
        )
        return results

    swarm = BenchSwarm(workdir, cfg, settings["nodes"], run_id="host-memory")
    peaks = [{"tree_kib": 0, "main_kib": 0, "peak_at": None} for _ in range(settings["nodes"])]
    timelines: list[list] = [[] for _ in range(settings["nodes"])]
    start = time.time()
    results["started_at"] = time.strftime("%H:%M:%S")
    failure: list[BaseException] = []
    lowest_available, oom_kills = available, _oom_kills()
    oom_scored: set[int] = set()

    def go():
        try:
            shards = [0] * settings["nodes"] if settings["same_shard"] else None
            swarm.run(
                max_rounds=settings["rounds"], timeout=settings["timeout_s"], pin_data=False, shards=shards
            )
        except (SwarmFailed, OSError) as e:
            failure.append(e)

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    while thread.is_alive():
        lowest_available = min(lowest_available, _mem_available())
        for i, proc in enumerate(list(swarm.procs)):
            if proc.poll() is None:
                processes = tree_pss(proc.pid)
                _first_for_oom_killer(processes, oom_scored)
                tree, own = tree_pss_kib(proc.pid, processes)
                timelines[i].append([round(time.time() - start, 1), tree >> 10, own >> 10])
                if tree > peaks[i]["tree_kib"]:
                    by_process = sorted(
                        ((name, pss >> 10) for name, pss in processes.values()), key=lambda p: -p[1]
                    )
                    peaks[i].update(
                        tree_kib=tree, peak_at=time.strftime("%H:%M:%S"), peak_by_process_mib=by_process
                    )
                peaks[i]["main_kib"] = max(peaks[i]["main_kib"], own)
        thread.join(settings["sample_interval_s"])
    results["lowest_mem_available_bytes"] = lowest_available
    results["oom_kills"] = _oom_kills() - oom_kills
    if failure:
        if not results["oom_kills"]:
            raise failure[0]
        results["finding"] = (
            f"the kernel's OOM killer ended {results['oom_kills']} process(es) of the nodes (the other nodes were "
            f"then stopped), with {lowest_available / GIB:.1f} GiB the lowest available: {settings['nodes']} "
            "nodes do not fit"
        )
    for i, node in enumerate(swarm.nodes):
        rounds = node.summary.get("rounds", [])
        peaks[i].update(
            rounds=len(rounds),
            group_sizes=[r["shared_group"] for r in rounds],
            shard_group_sizes=[r["shard_group"] for r in rounds],
            startup_seconds=_startup_seconds(node.timeline),
            peak_ratio_to_plan=peaks[i]["tree_kib"] * 1024 / need,
            peak_ratio_to_model_as_stored=peaks[i]["tree_kib"] * 1024 / stored,
            # [seconds since start, tree PSS MiB, daemon PSS MiB]; `peak_at` is wall-clock time, as in the node's log
            timeline_mib=timelines[i],
        )
    results["nodes"] = peaks
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=SETTINGS["nodes"])
    parser.add_argument("--rounds", type=int, default=SETTINGS["rounds"])
    parser.add_argument("--workdir", default="runs/benchmarks/host_memory")
    parser.add_argument(
        "--start-anyway", action="store_true", help="start the nodes even where the plan says they do not fit"
    )
    parser.add_argument(
        "--same-shard",
        action="store_true",
        help="every node holds shard 0: replicas, whose shard all-reduces run (beside the steps, by default)",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = {
        **SETTINGS,
        "nodes": args.nodes,
        "rounds": args.rounds,
        "start_anyway": args.start_anyway,
        "same_shard": args.same_shard,
    }
    with LoadMonitor() as load:
        results = run(Path(args.workdir), settings)
    emit(
        table(
            ["", "GiB"],
            [
                [
                    "model as stored (fp32 trainable + AdamW, frozen as stored)",
                    results["model_as_stored_bytes"] / GIB,
                ],
                ["plan: host need of a CPU node", results["plan_host_need_bytes"] / GIB],
                ["memory available at start", results["mem_available_bytes"] / GIB],
                *(
                    [["memory available, lowest during the run", results["lowest_mem_available_bytes"] / GIB]]
                    if "lowest_mem_available_bytes" in results
                    else []
                ),
            ],
            title=f"host memory ({settings['preset']}, {settings['nodes']} node(s), {settings['rounds']} rounds)",
        )
    )
    if "finding" in results:
        emit(results["finding"])
    for i, node in enumerate(results.get("nodes", [])):
        emit(
            f"node{i}: peak PSS {mib(node['tree_kib'] * 1024):.0f} MiB (daemon process {mib(node['main_kib'] * 1024):.0f} MiB), "
            f"{node['peak_ratio_to_plan']:.2f}x the plan, {node['peak_ratio_to_model_as_stored']:.2f}x the model as "
            f"stored, at {node['peak_at']}; rounds {node['rounds']}, groups {node['group_sizes']}, shard groups "
            f"{node['shard_group_sizes']}"
        )
    name = "host_memory" if settings["nodes"] == 1 else f"host_memory_{settings['nodes']}nodes"
    name += "_replicas" if settings["same_shard"] else ""
    emit(f"wrote {write_result(name, settings, results, load.summary())}")


if __name__ == "__main__":
    main()
