"""Run every benchmark and gather the headline ratios in `benchmarks/results/latest.json`.

`python -m benchmarks` (all) or `python -m benchmarks memory quality` (some; latest.json is then left alone, since
every number in it must come from one run of the whole suite). A benchmark that fails is recorded with its error
and the suite goes on. The GPU step script only checks itself on the tiny preset when there is no GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import subprocess
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from benchmarks import bytes_per_round, link_utilisation, memory, quality, scale, throughput
from benchmarks.common import (
    REPO_ROOT,
    RESULTS_DIR,
    LoadMonitor,
    emit,
    goal_entry,
    machine_info,
    python_cmd,
    table,
)
from benchmarks.netns import NetnsUnavailable, check_available

logger = logging.getLogger(__name__)


def _gpu_step_check(workdir: Path) -> dict:
    import torch

    if torch.cuda.is_available():
        out = subprocess.run(python_cmd("benchmarks.gpu_step"), cwd=REPO_ROOT, capture_output=True, text=True)
        emit(out.stdout)
        return {
            "run_on_gpu": out.returncode == 0,
            "output": out.stdout[-4000:],
            "error": out.stderr[-2000:] or None,
        }
    out = subprocess.run(
        python_cmd(
            "benchmarks.gpu_step", "--tiny", "--device", "cpu", "--no-write", "--steps", "2", "--warmup", "1"
        ),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
    )
    emit(out.stdout)
    return {
        "run_on_gpu": False,
        "reason": "no CUDA device on this machine: the script ran on the tiny preset on CPU as a check only",
        "cpu_check_passed": out.returncode == 0,
        "cpu_check_output": out.stdout[-4000:],
    }


SUITE_THROUGHPUT = {"rate_mbit": 100.0, "rounds": 3}
"""The throughput goal is stated on 100 Mbit/s links: the suite runs it there (network namespaces, as root), over
3 rounds, and on loopback only where namespaces cannot be made (the result then says `throughput_link_mbit`
null)."""


def _throughput_settings() -> dict:
    try:
        check_available()
    except NetnsUnavailable as e:
        logger.warning(f"throughput on loopback: no network namespaces ({e})")
        return {"rounds": SUITE_THROUGHPUT["rounds"]}
    return dict(SUITE_THROUGHPUT)


BENCHMARKS: dict[str, Callable[[Path], dict]] = {
    "memory": lambda w: memory.run(w / "memory"),
    "scale": lambda w: scale.run(w / "scale"),
    "quality": lambda w: quality.run(w / "quality"),
    "throughput": lambda w: throughput.run(w / "throughput", _throughput_settings()),
    "bytes_per_round": lambda w: bytes_per_round.run(w / "bytes_per_round"),
    "link_utilisation": lambda w: link_utilisation.run(w / "link_utilisation"),
    "gpu_step": _gpu_step_check,
}


def gather(results: dict[str, dict], errors: dict[str, str], seconds: float, load: dict) -> dict:
    """The latest.json document: headline ratios, their goals, and where the details are."""

    def get(benchmark: str, key: str):
        return results.get(benchmark, {}).get(key)

    headline = {
        "memory_ratio": get("memory", "memory_ratio"),
        "bytes_per_round_ratio_vs_diloco": get("bytes_per_round", "bytes_per_round_ratio_vs_diloco"),
        "bytes_per_round_ratio_vs_diloco_int8": get(
            "bytes_per_round", "bytes_per_round_ratio_vs_diloco_int8"
        ),
        "link_utilisation": get("link_utilisation", "link_utilisation"),
        "throughput_ratio": get("throughput", "throughput_ratio"),
        "val_loss_ratio_vs_centralized": get("quality", "val_loss_ratio_vs_centralized"),
    }
    memory_detail = results.get("memory", {}).get("by_frozen_dtype", {})
    scale_detail = {
        size: {
            "status_fetch_s": r["status"]["fetch_summary_s_median"],
            "status_cli_s": r["status"]["cli_wall_s"],
            "status_nodes_seen": r["status"]["nodes_seen"],
            "join_startup_s": r["join"]["startup_s"],
            "join_process_s": r["join"]["process_wall_s"],
        }
        for size, r in results.get("scale", {}).get("by_size", {}).items()
    }
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "suite_seconds": round(seconds, 1),
        "load": load,
        **headline,
        "goals": {key: goal_entry(key, value) for key, value in headline.items()},
        "memory_ratio_by_frozen_dtype": {
            dtype: {"measured": v["measured_ratio"], "analytic": v["analytic_ratio"]}
            for dtype, v in memory_detail.items()
        },
        "memory_ratio_activation_checkpointing": get("memory", "memory_ratio_activation_checkpointing"),
        "memory_daemon_rss_ratio": get("memory", "daemon_rss_ratio"),
        "payload_ratio_vs_diloco": get("bytes_per_round", "payload_ratio_vs_diloco"),
        "link_utilisation_by_rate": {
            rate: r["utilisation_median"]
            for rate, r in results.get("link_utilisation", {}).get("by_rate", {}).items()
        },
        "throughput_ratio_overlap": get("throughput", "throughput_ratio_overlap"),
        "throughput_ratio_overlap_shards": get("throughput", "throughput_ratio_overlap_shards"),
        "throughput_headline_variant": get("throughput", "headline_variant"),
        "throughput_link_mbit": get("throughput", "throughput_link_mbit"),
        "throughput_ratio_as_published": get("throughput", "throughput_ratio_as_published"),
        "throughput_raw_tokens_per_s_ratio": get("throughput", "raw_tokens_per_s_ratio"),
        "val_loss_ratio_std": get("quality", "val_loss_ratio_std"),
        "val_loss_ratios": get("quality", "ratios"),
        "scale": scale_detail,
        "gpu_step": results.get("gpu_step"),
        "errors": errors,
        # a benchmark that names its result file otherwise (throughput on shaped links) says so
        "details": {
            name: result.get("result_file", f"{name}.json")
            for name, result in results.items()
            if name != "gpu_step"
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help=f"benchmarks to run: {', '.join(BENCHMARKS)} (default: all)")
    parser.add_argument("--workdir", default=str(REPO_ROOT / "runs" / "benchmarks"), help="scratch directory")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    unknown = [n for n in args.names if n not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark {unknown[0]!r} (choose from {', '.join(BENCHMARKS)})")
    names = args.names or list(BENCHMARKS)
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    results, errors = {}, {}
    started = time.time()
    with LoadMonitor(interval=15.0) as load:
        for name in names:
            emit(f"\n=== {name} ===")
            t = time.time()
            try:
                results[name] = BENCHMARKS[name](workdir)
            except Exception as e:
                errors[name] = (
                    f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
                )
                emit(f"{name} FAILED: {errors[name]}")
                logger.error(traceback.format_exc())
            emit(f"=== {name}: {time.time() - t:.0f}s")
    seconds = time.time() - started
    document = gather(results, errors, seconds, load.summary())
    emit(
        table(
            ["headline", "value", "goal", "met"],
            [[key, g["value"], g["goal"], g["met"]] for key, g in document["goals"].items()],
            title=f"\nspes-node benchmarks ({seconds / 60:.1f} min)",
        )
    )
    if args.names:
        emit("a subset ran: latest.json left as it was")
        return
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / "latest.json").write_text(json.dumps(document, indent=1) + "\n")
    emit(f"wrote {RESULTS_DIR / 'latest.json'}")


if __name__ == "__main__":
    main()
