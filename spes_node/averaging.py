"""Averaging groups over hivemind's DecentralizedAverager, and the outer optimisers applied to their result.

One `GroupAverager` per group: the shared parameters (every node) and each shard (its replicas only). Group keys
contain the run id and the config hash, so a node with another config can never enter a group.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

import torch
from hivemind import DHT
from hivemind.averaging import DecentralizedAverager
from hivemind.compression import CompressionBase, Float16Compression, NoCompression, Uniform8BitQuantization

logger = logging.getLogger(__name__)

WIRE_BYTES = {"none": 4, "fp16": 2, "uint8": 1}


def wire_compression(name: str) -> CompressionBase:
    return {"none": NoCompression(), "fp16": Float16Compression(), "uint8": Uniform8BitQuantization()}[name]


@dataclass
class GroupResult:
    group_size: int
    seconds: float
    bytes_sent: int
    bytes_received: int
    peers: dict[str, tuple] = field(default_factory=dict)
    error: str | None = None


class GroupAverager:
    """Averages a fixed list of named tensors with whoever is matchmaking under the same key."""

    def __init__(
        self,
        dht: DHT,
        prefix: str,
        tensors: dict[str, torch.Tensor],
        *,
        compression: str,
        matchmaking_time: float,
        allreduce_timeout: float,
        client_mode: bool,
    ):
        self.prefix, self.names = prefix, list(tensors)
        self.compression_name = compression
        self.numel = sum(t.numel() for t in tensors.values())
        self.matchmaking_time, self.allreduce_timeout = matchmaking_time, allreduce_timeout
        self.averager = DecentralizedAverager(
            [t.detach().float().cpu().clone() for t in tensors.values()],
            dht=dht,
            prefix=prefix,
            min_group_size=2,
            min_matchmaking_time=matchmaking_time,
            request_timeout=min(3.0, matchmaking_time / 2),
            allreduce_timeout=allreduce_timeout,
            compression=wire_compression(compression),
            client_mode=client_mode,
            start=True,
        )

    def step(self, tensors: dict[str, torch.Tensor], weight: float, gather: tuple):
        """Start averaging a copy of `tensors`; returns a handle for `finish`."""
        with self.averager.get_tensors() as buffers:
            for buffer, name in zip(buffers, self.names):
                buffer.copy_(tensors[name].detach())
        start = time.perf_counter()
        control = self.averager.step(
            weight=max(weight, 1e-6),
            gather=gather,
            timeout=self.matchmaking_time * 2 + self.allreduce_timeout,
            wait=False,
        )
        return control, start

    def finish(self, handle) -> tuple[GroupResult, dict[str, torch.Tensor] | None]:
        """Wait for the step; returns the averaged tensors, or None when no group formed or the all-reduce failed."""
        control, start = handle
        try:
            gathered = control.result()
        except Exception as e:  # hivemind raises several types for a failed round; none is fatal to us
            return GroupResult(1, time.perf_counter() - start, 0, 0, error=f"{type(e).__name__}: {e}"), None
        seconds = time.perf_counter() - start
        if not gathered or len(gathered) < 2:
            return GroupResult(1, seconds, 0, 0), None
        n = len(gathered)
        # hivemind's butterfly all-reduce: each peer sends (n-1)/n of its vector for reduce-scatter and the same
        # for all-gather, and receives as much; counted at the wire precision.
        moved = int(2 * (n - 1) / n * self.numel * WIRE_BYTES[self.compression_name])
        peers = {str(peer): value for peer, value in gathered.items()}
        with self.averager.get_tensors() as buffers:
            averaged = {name: buffer.clone() for name, buffer in zip(self.names, buffers)}
        return GroupResult(n, seconds, moved, moved, peers=peers), averaged

    def shutdown(self) -> None:
        try:
            self.averager.shutdown()
        except Exception as e:
            logger.debug(f"averager {self.prefix} shutdown: {e}")


class OuterOptimizer:
    """Turns the group average into the new local weights."""

    def apply(self, local: dict[str, torch.Tensor], averaged: dict[str, torch.Tensor]) -> None:
        raise NotImplementedError


class PlainAverage(OuterOptimizer):
    """As published: the new weights are the average (outer lr 1, no momentum)."""

    @torch.no_grad()
    def apply(self, local, averaged):
        for name, tensor in local.items():
            tensor.copy_(averaged[name])


class NesterovOuter(OuterOptimizer):
    """DiLoCo: the outer gradient is (previous global - average); SGD with Nesterov momentum on the global weights."""

    def __init__(self, lr: float, momentum: float):
        self.lr, self.momentum = lr, momentum
        self.previous: dict[str, torch.Tensor] = {}
        self.velocity: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def remember(self, local: dict[str, torch.Tensor]) -> None:
        """Record the global weights the next round starts from."""
        self.previous = {name: t.detach().float().cpu().clone() for name, t in local.items()}

    @torch.no_grad()
    def apply(self, local, averaged):
        if not self.previous:
            PlainAverage().apply(local, averaged)
            self.remember(local)
            return
        for name, tensor in local.items():
            grad = self.previous[name] - averaged[name]
            v = self.velocity.setdefault(name, torch.zeros_like(grad))
            v.mul_(self.momentum).add_(grad)
            new = self.previous[name] - self.lr * (grad + self.momentum * v)
            tensor.copy_(new)
        self.remember(local)


def finite_weight(value: float) -> float:
    return value if math.isfinite(value) and value > 0 else 1e-6
