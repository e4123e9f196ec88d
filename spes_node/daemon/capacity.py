"""How many shards a node holds: what the user asked for (--shards, --max-shards) against the memory plan and the
device's memory.

`--shards auto` (the default) holds as many shards as the memory plan (`daemon.plan`) fits:
- on a CUDA device, in the card's memory: its total, or, when other processes hold part of it, what is free
  plus the plan's CUDA reserve (which covers our own context);
- on a CPU, in the host memory available when the node starts (MemAvailable): the node's fp32 training state
  and its host-side buffers live there together (`plan.host_need`). Nodes started together on one machine
  each see the same available memory.
An explicit count or list is taken as given (with a warning where the plan says it does not fit). A CUDA device
that cannot hold even one shard is refused with the plan's advice.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from spes_node.config import SpesConfig
from spes_node.daemon.plan import (
    CUDA_RESERVE,
    format_bytes,
    host_need,
    host_shards_fit,
    max_shards,
    memory_plan,
)

if TYPE_CHECKING:  # torch is imported where a device is asked: `join` checks its flags without it
    import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShardRequest:
    """The shards asked for on the command line: a list of indices, a count, or as many as fit (auto)."""

    indices: tuple[int, ...] | None = None
    """--shards i,j,... or --shard N: exactly these."""
    count: int | None = None
    """--shards K: K shards chosen by placement."""
    max_shards: int | None = None
    """--max-shards K: at most K shards, whatever fits."""

    @property
    def auto(self) -> bool:
        return self.indices is None and self.count is None

    def describe(self) -> str:
        if self.indices is not None:
            return "--shards " + ",".join(map(str, self.indices))
        return f"--shards {self.count}" if self.count is not None else "--shards auto"


def parse_shard_request(shards: str, max_shards: int | None = None, shard: str = "auto") -> ShardRequest:
    """--shards (auto, a count K, or a list i,j,...), --max-shards and the single-shard --shard N, checked
    against each other (not yet against a config: see `check_shard_request`)."""
    text = str(shards).strip().lower()
    single = str(shard).strip().lower()
    if max_shards is not None and max_shards < 1:
        raise ValueError(f"--max-shards: must be at least 1, got {max_shards}")
    if single != "auto":
        if not single.isdigit():
            raise ValueError(f"--shard: expected a shard index or 'auto', got '{shard}'")
        if text != "auto":
            raise ValueError("--shard and --shards: pass one of them (--shards i,j,... lists several shards)")
        return ShardRequest(indices=(int(single),), max_shards=max_shards)
    if text == "auto":
        return ShardRequest(max_shards=max_shards)
    if "," in text:
        parts = [p.strip() for p in text.split(",")]
        if not all(p.isdigit() for p in parts):
            raise ValueError(
                f"--shards: expected auto, a count or a list of shard indices like 0,2, got '{shards}'"
            )
        indices = tuple(int(p) for p in parts)
        if len(set(indices)) != len(indices):
            raise ValueError(f"--shards: shard listed twice in '{shards}'")
        if max_shards is not None and len(indices) > max_shards:
            raise ValueError(f"--shards lists {len(indices)} shards, more than --max-shards {max_shards}")
        return ShardRequest(indices=indices, max_shards=max_shards)
    if not text.isdigit() or int(text) < 1:
        raise ValueError(
            f"--shards: expected auto, a count (1 or more) or a list of indices like 0,2, got '{shards}'"
        )
    count = int(text)
    if max_shards is not None and count > max_shards:
        raise ValueError(f"--shards {count} is more than --max-shards {max_shards}")
    return ShardRequest(count=count, max_shards=max_shards)


def check_shard_request(request: ShardRequest, cfg: SpesConfig) -> None:
    """The request against the swarm's shard count (swarm.num_shards)."""
    num_shards = cfg.swarm.num_shards
    if request.indices is not None:
        for index in request.indices:
            if index >= num_shards:
                flag = "--shards" if len(request.indices) > 1 else "--shard"
                raise ValueError(f"{flag}: {index} is out of range [0, {num_shards}) (swarm.num_shards)")
    if request.count is not None and request.count > num_shards:
        raise ValueError(
            f"--shards: {request.count} is more than the swarm's {num_shards} shards (swarm.num_shards)"
        )


def device_memory(device: torch.device) -> tuple[int, str]:
    """The memory the node's training state may use on `device`, in bytes, and where that figure comes from."""
    if device.type == "cuda":
        import torch

        free, total = torch.cuda.mem_get_info(device)
        budget = min(total, free + CUDA_RESERVE)
        source = f"{format_bytes(total)} card" + (
            "" if budget == total else f", {format_bytes(free)} free (other processes hold the rest)"
        )
        return budget, source
    return available_host_memory(), "host memory available now"


def available_host_memory() -> int:
    """MemAvailable of /proc/meminfo (what can be allocated without swapping), else the free physical pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def shard_capacity(
    cfg: SpesConfig, request: ShardRequest, device: torch.device, memory: int | None = None
) -> int:
    """How many shards this node holds: the request's count or list length, or for auto the most the memory plan
    fits in `memory` bytes (default: `device_memory(device)`), capped by --max-shards.

    ValueError (one line, with the plan's advice) when a CUDA device cannot hold even one shard. On a CPU a node
    that does not fit one shard by the plan still takes one, with a warning: host memory can be freed or swapped.
    """
    check_shard_request(request, cfg)
    if memory is None:
        memory, source = device_memory(device)
    else:
        source = "given"
    cap = request.max_shards or cfg.swarm.num_shards
    if device.type == "cuda":
        fit = max_shards(cfg, memory)
        if fit == 0:
            plan = memory_plan(cfg, 1, memory)
            advice = "; ".join(plan.advice) or "use a larger card"
            raise ValueError(
                f"{cfg.name} does not fit this GPU even with one shard: it needs {format_bytes(plan.gpu_total)}, "
                f"the device has {format_bytes(memory)} ({source}); {advice}"
            )
        need = lambda k: memory_plan(cfg, k).gpu_total  # noqa: E731
    else:
        fit = host_shards_fit(cfg, memory)
        need = lambda k: host_need(cfg, k)  # noqa: E731
        if fit == 0:
            logger.warning(
                f"{cfg.name} needs about {format_bytes(need(1))} of host memory for one shard, "
                f"{format_bytes(memory)} is available: holding one shard anyway"
            )
            fit = 1
    if request.auto:
        return min(fit, cap)
    wanted = len(request.indices) if request.indices is not None else request.count
    if wanted > fit:
        logger.warning(
            f"{request.describe()}: the memory plan fits {fit} shard(s) in {format_bytes(memory)} ({source}); "
            f"{wanted} need about {format_bytes(need(wanted))}"
        )
    return wanted
