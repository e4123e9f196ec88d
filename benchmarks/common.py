"""What every benchmark shares: the machine description, CPU load sampling, result files and tables."""

from __future__ import annotations

import datetime
import json
import logging
import os
import platform
import re
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = Path(__file__).resolve().parent / "results"
NODE_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
"""One torch thread per node process: on a 2-core machine more threads make every process much slower."""

logger = logging.getLogger(__name__)


def rss_kib(field: str = "VmRSS") -> int:
    """A memory field of this process's /proc/self/status in KiB (VmRSS: resident now, VmHWM: its peak)."""
    match = re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text())
    return int(match.group(1)) if match else 0


def reset_peak_rss() -> None:
    """Reset this process's resident-set high-water mark (VmHWM) to its resident size now."""
    Path("/proc/self/clear_refs").write_text("5")


def machine_info() -> dict[str, Any]:
    """CPU model, cores, memory, library versions and the code revision the numbers belong to."""
    import hivemind
    import torch

    cpu = "unknown"
    try:
        match = re.search(r"model name\s*:\s*(.+)", Path("/proc/cpuinfo").read_text())
        cpu = match.group(1).strip() if match else platform.processor() or "unknown"
    except OSError:
        pass
    memory_gib = None
    try:
        match = re.search(r"MemTotal:\s+(\d+)", Path("/proc/meminfo").read_text())
        memory_gib = round(int(match.group(1)) / 2**20, 1) if match else None
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": memory_gib,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "hivemind": hivemind.__version__,
        "os": platform.system(),
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
    }


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _cpu_times() -> tuple[float, float]:
    fields = [float(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)
    return sum(fields), idle


class LoadMonitor:
    """Samples the load average and the machine's CPU busy fraction while a benchmark runs.

    Other work on the machine competes with the benchmark for the same cores; the numbers say how much.
    """

    def __init__(self, interval: float = 5.0):
        self.interval = interval
        self.samples: list[tuple[float, float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="load-monitor", daemon=True)

    def __enter__(self) -> LoadMonitor:
        self.start_time = time.time()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=self.interval + 1)
        self.end_time = time.time()

    def _run(self) -> None:
        total, idle = _cpu_times()
        while not self._stop.wait(self.interval):
            new_total, new_idle = _cpu_times()
            busy = 1.0 - (new_idle - idle) / max(new_total - total, 1e-9)
            total, idle = new_total, new_idle
            self.samples.append((time.time(), os.getloadavg()[0], busy))

    def summary(self) -> dict[str, Any]:
        loads = [s[1] for s in self.samples] or [os.getloadavg()[0]]
        busy = [s[2] for s in self.samples]
        return {
            "loadavg_1min_mean": round(sum(loads) / len(loads), 2),
            "loadavg_1min_max": round(max(loads), 2),
            "cpu_busy_fraction_mean": round(sum(busy) / len(busy), 3) if busy else None,
            "seconds": round(getattr(self, "end_time", time.time()) - self.start_time, 1),
        }


GOALS = {
    "memory_ratio": ("<=", 0.45),
    "bytes_per_round_ratio_vs_diloco": ("<=", 0.5),
    "bytes_per_round_ratio_vs_diloco_int8": ("<=", 0.6),
    "link_utilisation": (">=", 0.8),
    "throughput_ratio": (">=", 0.95),
    "val_loss_ratio_vs_centralized": ("<=", 1.02),
}
"""The headline ratios' goals, as `latest.json` reports them."""


def goal_entry(key: str, value: float | None) -> dict[str, Any]:
    """`latest.json`'s goal record of a headline: the goal, the value and whether it is met (None: not measured)."""
    op, target = GOALS[key]
    met = None if value is None else value <= target if op == "<=" else value >= target
    return {"goal": f"{op} {target}", "value": value, "met": met}


def merge_latest(values: dict[str, Any], details: dict[str, str] | None = None) -> None:
    """Merge one benchmark's run into `latest.json`, keeping every other key: `values` replace theirs, `details`
    (benchmark -> the result file it wrote) replace those benchmarks' entries only, and every headline's goal record
    is made again from `GOALS` and the headline's value in the document."""
    path = RESULTS_DIR / "latest.json"
    document = json.loads(path.read_text()) if path.is_file() else {}
    document.update(values)
    if details:
        document["details"] = {**document.get("details", {}), **details}
    document["goals"] = {key: goal_entry(key, document.get(key)) for key in GOALS}
    path.write_text(json.dumps(document, indent=1) + "\n")


def write_result(name: str, settings: dict[str, Any], results: dict[str, Any], load: dict[str, Any]) -> Path:
    """`benchmarks/results/<name>.json`: the numbers with the machine, the date, the settings and the load."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    document = {
        "benchmark": name,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "load": load,
        "settings": settings,
        "results": results,
    }
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps(document, indent=1, default=_jsonable) + "\n")
    return path


def _jsonable(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"cannot write {type(value).__name__} as JSON")


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str = "") -> str:
    """A plain-text table with right-aligned numbers; floats get 3 significant decimals."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    lines = [title] if title else []
    lines.append(
        "  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(headers, widths)))
    )
    lines.append("  ".join("-" * w for w in widths))
    for row in cells:
        lines.append(
            "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
        )
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if value != value:
            return "nan"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        if abs(value) >= 10:
            return f"{value:.1f}"
        return f"{value:.3f}"
    return str(value)


def emit(text: str) -> None:
    """Benchmark output for the terminal (tables and one-line progress)."""
    print(text, flush=True)


def python_cmd(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def mib(nbytes: float) -> float:
    return nbytes / 2**20
