"""checkpoint_cost: what a checkpoint costs a real node, with and without frozen experts.

One node alone holding shard 0 (it founds its swarm; H is larger than the run, so no round's work interferes and the
other shards stay frozen) checkpoints by time every few seconds; its writer logs, for each checkpoint, the snapshot's
size, how long the training thread was paused to take it, and how long the background write took (serialisation,
sha256, fsync, rename, pruning). The size on disk is read from the checkpoints left. Steps are timed from the node's
tokens/s lines, for comparison with the pause.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from benchmarks.common import NODE_ENV, LoadMonitor, emit, median, mib, python_cmd, table, write_result
from spes_node.config import load_preset
from spes_node.daemon.checkpoint import CheckpointManager

SETTINGS = {"presets": ["tiny", "small"], "interval_minutes": 0.1, "checkpoints": 4, "timeout_s": 600}

WRITE_LINE = re.compile(
    r"checkpoint step (\d+): ([\d.]+) MiB, training paused (\d+) ms for the snapshot, written in ([\d.]+)s"
)
RATE_LINE = re.compile(r"step \d+ round \d+ .* tokens/s (\d+)")


def run_node(preset: str, frozen: bool, workdir: Path, settings: dict) -> dict:
    cfg = load_preset(preset).replace(
        train={
            "checkpoint_every": 0,
            "checkpoint_every_minutes": settings["interval_minutes"],
            "checkpoint_frozen_experts": frozen,
        },
        swarm={"sync_steps": 1_000_000},
    )
    config = workdir / f"{preset}-{frozen}.json"
    config.write_text(cfg.to_json())
    directory, log_path = workdir / f"{preset}-{frozen}", workdir / f"{preset}-{frozen}.log"
    command = python_cmd(
        "spes_node.cli", "join", "--config", str(config), "--run-id", f"ckpt-{preset}", "--checkpoint-dir",
        str(directory), "--device", "cpu", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--shard", "0",
        # what a GPU node does (on a CPU, auto writes in place): the pause for the snapshot, the write beside it
        "--checkpoint-writes", "background",
    )  # fmt: skip
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, **NODE_ENV)
        )
    deadline = time.monotonic() + settings["timeout_s"]
    try:
        while len(WRITE_LINE.findall(log_path.read_text())) < settings["checkpoints"]:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{preset} node ended or timed out:\n{log_path.read_text()[-2000:]}")
            time.sleep(0.5)
        process.send_signal(signal.SIGTERM)
        process.wait(120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    text = log_path.read_text()
    writes = [(float(m[2]), int(m[3]) / 1e3, float(m[4])) for m in WRITE_LINE.finditer(text)]
    rates = [int(m[1]) for m in RATE_LINE.finditer(text)][1:]  # the first window includes startup
    tokens_per_step = cfg.train.seq_len * cfg.train.micro_batch_size * cfg.train.grad_accum
    latest = CheckpointManager(directory).list()[-1]
    return {
        "preset": preset,
        "frozen_experts": frozen,
        "checkpoints": len(writes),
        "disk_mib": mib(sum(f.stat().st_size for f in latest.iterdir())),
        "snapshot_mib": writes[-1][0],
        "snapshot_ms_median": median([w[1] for w in writes]) * 1e3,
        "snapshot_ms_max": max(w[1] for w in writes) * 1e3,
        "write_s_median": median([w[2] for w in writes]),
        "write_s_max": max(w[2] for w in writes),
        "step_ms_median": median([tokens_per_step / r * 1e3 for r in rates if r]) if rates else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=SETTINGS["presets"])
    args = parser.parse_args()
    settings = {**SETTINGS, "presets": args.presets}
    rows = []
    with LoadMonitor() as load, tempfile.TemporaryDirectory() as tmp:
        for preset in settings["presets"]:
            for frozen in (True, False):
                emit(f"{preset}, frozen experts {'saved' if frozen else 'left out'} ...")
                rows.append(run_node(preset, frozen, Path(tmp), settings))
    headers = ["preset", "frozen", "disk MiB", "snapshot ms", "max", "write s", "max", "step ms"]
    emit(
        table(
            headers,
            [
                [
                    r["preset"],
                    r["frozen_experts"],
                    r["disk_mib"],
                    r["snapshot_ms_median"],
                    r["snapshot_ms_max"],
                    r["write_s_median"],
                    r["write_s_max"],
                    r["step_ms_median"],
                ]
                for r in rows
            ],  # fmt: skip
            title="checkpoint cost (medians over the run's checkpoints; the training thread waits only for the snapshot)",
        )
    )
    path = write_result("checkpoint_cost", settings, {"runs": rows}, load.summary())
    emit(f"wrote {path}")


if __name__ == "__main__":
    main()
