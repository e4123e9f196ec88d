"""memory_ratio: peak training memory of a node holding 1 of S shards, divided by that of a node training every expert.

Method: each configuration runs in a fresh subprocess (one torch thread). After imports and after the batch is
made, the probe resets the kernel's resident-set high-water mark (`/proc/self/clear_refs`) and notes the resident
size; it then builds the model, applies the ownership, builds the optimiser and runs a few training steps on the
same batch, and reads the high-water mark (VmHWM) after the build and again after the steps (reset in between).
The peak growth over the baseline is the measure: everything torch allocated for weights, gradients, AdamW state
and activations, including allocator slack. tracemalloc does not see torch's allocations and `ru_maxrss` cannot be
reset, hence VmHWM. Beside each measurement: the analytic bound (weights, gradients and two AdamW moments in fp32
for trainable parameters, frozen experts at their storage precision, no activations).

A second measure, `daemon`: the whole node process (`spes-node join`, alone, one short round) holding 1 of S shards
versus the DiLoCo stand-in (1 shard = every expert), peak RSS growth from startup to shutdown: it adds what the sync
machinery keeps in host memory (averager buffers, the fp32 snapshots the node serves to others).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import time
from pathlib import Path

from benchmarks.common import (
    NODE_ENV,
    REPO_ROOT,
    LoadMonitor,
    emit,
    mib,
    python_cmd,
    reset_peak_rss,
    rss_kib,
    table,
    write_result,
)

logger = logging.getLogger(__name__)

SETTINGS = {
    "preset": "small",
    "num_shards": 8,
    "steps": 3,
    "frozen_dtypes": ["bf16", "fp32", "int8"],
    "headline_frozen_dtype": "bf16",
    "daemon_rounds": 1,
    "daemon_sync_steps": 2,
    "torch_threads": 1,
}
FROZEN_BYTES = {"fp32": 4, "bf16": 2, "int8": 1}


def probe(
    preset: str,
    num_shards: int,
    owned: str,
    frozen_dtype: str,
    steps: int,
    activation_checkpointing: bool = False,
) -> dict:
    """Peak RSS growth (KiB) of building a model with this ownership and training `steps` steps on one batch."""
    import torch

    from spes_node.config import load_preset
    from spes_node.daemon.trainer import Trainer
    from spes_node.model.initial import initial_model

    torch.set_num_threads(1)
    cfg = load_preset(preset).replace(
        swarm={"num_shards": num_shards, "frozen_dtype": frozen_dtype},
        train={"activation_checkpointing": activation_checkpointing},
    )
    generator = torch.Generator().manual_seed(0)
    batch = torch.randint(
        0, cfg.model.vocab_size, (cfg.train.micro_batch_size, cfg.train.seq_len + 1), generator=generator
    )

    class SameBatch:
        def next_batch(self) -> torch.Tensor:
            return batch

    reset_peak_rss()
    baseline = rss_kib("VmRSS")
    model = initial_model(  # as a node makes it
        cfg.model,
        num_shards,
        cfg.train.seed,
        owned=[0] if owned == "one" else range(num_shards),
        frozen_dtype=frozen_dtype,
    )
    trainer = Trainer(cfg, model, SameBatch(), torch.device("cpu"))
    build_peak = rss_kib("VmHWM") - baseline
    reset_peak_rss()
    step_seconds = []
    for _ in range(steps):
        step_seconds.append(trainer.train_step().seconds)
    train_peak = rss_kib("VmHWM") - baseline
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return {
        "baseline_kib": baseline,
        "build_peak_kib": build_peak,
        "train_peak_kib": train_peak,
        "peak_kib": max(build_peak, train_peak),
        "tensor_bytes": {
            "parameters": params,
            "frozen_buffers": buffers,
            "gradients": sum(p.numel() * 4 for p in model.parameters() if p.requires_grad),
            "optimizer": trainer.optimizer_element_count() * 4,
        },
        "step_seconds": step_seconds,
    }


def analytic_bytes(cfg, num_shards: int, owned: int, frozen_dtype: str) -> int:
    """Weights + gradients + AdamW moments (fp32) of the trainable part, frozen experts at storage precision."""
    from spes_node.model.moe import analytic_param_count

    counts = analytic_param_count(cfg.model)
    trainable = counts["shared"] + counts["experts"] * owned // num_shards
    frozen = counts["experts"] * (num_shards - owned) // num_shards
    frozen_bytes = frozen * FROZEN_BYTES[frozen_dtype]
    if frozen_dtype == "int8":
        m = cfg.model
        rows_per_expert = 2 * m.expert_ffn + m.hidden_size
        frozen_experts = m.num_layers * m.num_experts * (num_shards - owned) // num_shards
        frozen_bytes += frozen_experts * rows_per_expert * 4
    return 16 * trainable + frozen_bytes


def _run_probe(owned: str, frozen_dtype: str, settings: dict, activation_checkpointing: bool = False) -> dict:
    spec = {
        "preset": settings["preset"],
        "num_shards": settings["num_shards"],
        "owned": owned,
        "frozen_dtype": frozen_dtype,
        "steps": settings["steps"],
        "activation_checkpointing": activation_checkpointing,
    }
    out = subprocess.run(
        python_cmd("benchmarks.memory", "--probe", json.dumps(spec)),
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env={**os.environ, **NODE_ENV},
        timeout=900,
    )
    if out.returncode != 0:
        raise RuntimeError(f"memory probe {spec} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _daemon_peak(num_shards: int, settings: dict, workdir: Path) -> dict:
    """Peak RSS growth of a lone node process over startup, a short round and shutdown."""
    from benchmarks.swarm import BenchSwarm
    from spes_node.config import load_preset

    cfg = load_preset(settings["preset"]).replace(
        swarm={"num_shards": num_shards, "sync_steps": settings["daemon_sync_steps"], "replication_target": 1}
    )
    swarm = BenchSwarm(workdir / f"daemon_s{num_shards}", cfg, 1, run_id=f"mem{num_shards}")
    node = swarm.run(max_rounds=settings["daemon_rounds"], timeout=600, pin_data=False)[0]
    timeline = node.timeline
    return {
        "rss_kib_before_startup": timeline["startup"]["rss_kib_before"],
        "rss_kib_peak": timeline["rss_kib_peak"],
        "peak_growth_kib": timeline["rss_kib_peak"] - timeline["startup"]["rss_kib_before"],
    }


def run(workdir: Path, settings: dict | None = None) -> dict:
    settings = {**SETTINGS, **(settings or {})}
    from spes_node.config import load_preset

    cfg = load_preset(settings["preset"])
    S = settings["num_shards"]
    with LoadMonitor() as load:
        all_experts = _run_probe("all", settings["headline_frozen_dtype"], settings)
        one = {dtype: _run_probe("one", dtype, settings) for dtype in settings["frozen_dtypes"]}
        # both nodes recompute their layers in backward (`train.activation_checkpointing`)
        recomputed = {
            owned: _run_probe(
                owned, settings["headline_frozen_dtype"], settings, activation_checkpointing=True
            )
            for owned in ("one", "all")
        }
        daemon = {
            "one_of_s": _daemon_peak(S, settings, workdir),
            "all_experts": _daemon_peak(1, settings, workdir),
        }
    all_bound = analytic_bytes(cfg, S, S, "fp32")
    by_dtype = {}
    for dtype, m in one.items():
        bound = analytic_bytes(cfg, S, 1, dtype)
        by_dtype[dtype] = {
            "measured_ratio": m["peak_kib"] / all_experts["peak_kib"],
            "measured_peak_mib": m["peak_kib"] / 1024,
            "train_phase_ratio": m["train_peak_kib"] / all_experts["train_peak_kib"],
            "analytic_ratio": bound / all_bound,
            "analytic_mib": mib(bound),
            "probe": m,
        }
    daemon_ratio = daemon["one_of_s"]["peak_growth_kib"] / daemon["all_experts"]["peak_growth_kib"]
    results = {
        "memory_ratio": by_dtype[settings["headline_frozen_dtype"]]["measured_ratio"],
        "by_frozen_dtype": by_dtype,
        "all_experts": {
            "measured_peak_mib": all_experts["peak_kib"] / 1024,
            "analytic_mib": mib(all_bound),
            "probe": all_experts,
        },
        "memory_ratio_activation_checkpointing": recomputed["one"]["peak_kib"]
        / recomputed["all"]["peak_kib"],
        "activation_checkpointing": recomputed,
        "daemon_rss_ratio": daemon_ratio,
        "daemon": daemon,
        "method": "peak VmHWM growth over model build + train steps, fresh subprocess per configuration",
    }
    rows = [
        [
            f"1 of {S} shards, frozen {dtype}",
            v["measured_peak_mib"],
            v["analytic_mib"],
            v["measured_ratio"],
            v["train_phase_ratio"],
            v["analytic_ratio"],
        ]
        for dtype, v in by_dtype.items()
    ]
    rows.append(
        ["all experts trainable", results["all_experts"]["measured_peak_mib"], mib(all_bound), 1.0, 1.0, 1.0]
    )
    emit(
        table(
            ["configuration", "peak MiB", "bound MiB", "ratio", "train-phase ratio", "bound ratio"],
            rows,
            title=f"memory ({settings['preset']} preset, {settings['steps']} steps, peak RSS growth)",
        )
    )
    emit(
        f"with activation checkpointing (frozen {settings['headline_frozen_dtype']}), 1 of {S} shards vs all experts: "
        f"{recomputed['one']['peak_kib'] / 1024:.0f} / {recomputed['all']['peak_kib'] / 1024:.0f} MiB "
        f"= {results['memory_ratio_activation_checkpointing']:.3f}"
    )
    emit(
        f"whole daemon process, 1 of {S} shards vs all experts: "
        f"{daemon['one_of_s']['peak_growth_kib'] / 1024:.0f} / {daemon['all_experts']['peak_growth_kib'] / 1024:.0f} MiB "
        f"= {daemon_ratio:.3f}"
    )
    write_result("memory", settings, results, load.summary())
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--probe", help="internal: measure one configuration (JSON) and print the result as JSON"
    )
    parser.add_argument("--workdir", default="runs/benchmarks/memory")
    args = parser.parse_args()
    if args.probe:
        spec = json.loads(args.probe)
        emit(json.dumps(probe(**spec)))
        return
    started = time.time()
    run(Path(args.workdir))
    emit(f"memory benchmark took {time.time() - started:.0f}s")


if __name__ == "__main__":
    main()
