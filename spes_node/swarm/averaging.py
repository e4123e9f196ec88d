"""Averaging groups over hivemind's DecentralizedAverager, and the outer optimisers applied to their result.

One `GroupAverager` per group: the shared parameters (every node) and each shard (its replicas only). Group keys
contain the run id and the config hash, so a node with another config can never enter a group. The all-reduce is
hivemind's with a robust reducer and checked results (`robust.py`); peers caught sending bad data are banned in a
`BanList` that the node's averagers share, and with a swarm key only its holders can enter a group.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

import torch
from hivemind import DHT
from hivemind.compression import CompressionBase, Float16Compression, NoCompression, Uniform8BitQuantization

from spes_node.swarm.robust import BanList, GroupOutcome, RobustAverager, RobustPolicy
from spes_node.swarm.swarm_key import SwarmKey

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
    rejected: dict[str, str] = field(default_factory=dict)
    """Peers caught sending bad data in this step (peer id -> why); they are banned from then on."""
    failed_reducers: int = 0
    """Group members whose part of the vector was not averaged (it kept our local values)."""
    failed_fraction: float = 0.0
    """The share of the vector that kept local values."""


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
        bans: BanList | None = None,
        swarm_key: SwarmKey | None = None,
        max_weight: float = math.inf,
    ):
        self.prefix, self.names = prefix, list(tensors)
        self.bans = bans if bans is not None else BanList()
        self.compression_name = compression
        self.numel = sum(t.numel() for t in tensors.values())
        self.matchmaking_time, self.allreduce_timeout = matchmaking_time, allreduce_timeout
        self.averager = RobustAverager(
            [t.detach().float().cpu().clone() for t in tensors.values()],
            dht=dht,
            prefix=prefix,
            min_group_size=2,
            min_matchmaking_time=matchmaking_time,
            request_timeout=min(3.0, matchmaking_time / 2),
            allreduce_timeout=allreduce_timeout,
            compression=wire_compression(compression),
            client_mode=client_mode,
            allow_state_sharing=False,
            swarm_key=swarm_key,
            policy=RobustPolicy(max_weight=max_weight),
            # a member silent this long mid all-reduce (a stalled or frozen machine) is dropped and its part kept
            # local, instead of holding the whole group until the averaging timeout
            next_chunk_timeout=max(2 * matchmaking_time, 5.0),
            shutdown_timeout=2.0,
            start=True,
        )

    def step(self, tensors: dict[str, torch.Tensor], weight: float, gather: tuple, wait_extra: float = 0.0):
        """Start averaging a copy of `tensors`; returns a handle for `finish`.

        Matchmaking lasts up to twice the matchmaking window, plus `wait_extra` seconds for peers that are
        expected soon; the all-reduce then has its own timeout."""
        with self.averager.get_tensors() as buffers:
            for buffer, name in zip(buffers, self.names):
                buffer.copy_(tensors[name].detach())
        self.averager.set_banned(self.bans.active())
        start = time.perf_counter()
        control = self.averager.step(
            weight=max(weight, 1e-6),
            gather=gather,
            timeout=self.matchmaking_time * 2 + max(0.0, wait_extra),
            wait=False,
        )
        return control, start

    def finish(self, handle) -> tuple[GroupResult, dict[str, torch.Tensor] | None]:
        """Wait for the step; returns the averaged tensors, or None when no group formed or the all-reduce failed."""
        control, start = handle
        try:
            outcome: GroupOutcome | None = control.result()
        except Exception as e:  # hivemind raises several types for a failed round; none is fatal to us
            return GroupResult(1, time.perf_counter() - start, 0, 0, error=f"{type(e).__name__}: {e}"), None
        seconds = time.perf_counter() - start
        if outcome is None:
            return GroupResult(1, seconds, 0, 0), None
        rejected = dict(outcome.rejected)
        peers = {}
        for peer, value in outcome.gathered.items():
            if valid_gather(value):
                peers[peer] = value
            else:
                rejected.setdefault(peer, f"malformed round info {str(value)[:64]!r}")
        for peer, reason in rejected.items():
            if self.bans.ban(peer, reason):
                logger.warning(f"ignoring peer {peer} for {self.bans.seconds:.0f}s ({self.prefix}): {reason}")
        n = len(peers)
        if n < 2:
            return GroupResult(1, seconds, 0, 0, rejected=rejected), None
        # hivemind's butterfly all-reduce: each peer sends (n-1)/n of its vector for reduce-scatter and the same
        # for all-gather, and receives as much; counted at the wire precision.
        moved = int(2 * (n - 1) / n * self.numel * WIRE_BYTES[self.compression_name])
        with self.averager.get_tensors() as buffers:
            averaged = {name: buffer.clone() for name, buffer in zip(self.names, buffers)}
        result = GroupResult(n, seconds, moved, moved, peers=peers, rejected=rejected)
        result.failed_reducers, result.failed_fraction = outcome.failed_reducers, outcome.failed_fraction
        if outcome.failed_reducers:
            result.error = (
                f"{outcome.failed_reducers} of {n} parts not averaged "
                f"({100 * outcome.failed_fraction:.0f}% of the vector kept local values)"
            )
        return result, averaged

    def shutdown(self) -> None:
        if not self.averager.is_alive():
            return
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
    """DiLoCo: the outer gradient is (previous global - average); SGD with Nesterov momentum on the global weights.

    Its state lives on the weights' device and is saved in checkpoints (`state_dict`)."""

    def __init__(self, lr: float, momentum: float):
        self.lr, self.momentum = lr, momentum
        self.previous: dict[str, torch.Tensor] = {}
        self.velocity: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def remember(self, local: dict[str, torch.Tensor]) -> None:
        """Record the global weights the next round starts from."""
        self.previous = {name: t.detach().float().clone() for name, t in local.items()}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Flat tensors by name (`previous.<name>`, `velocity.<name>`), on the CPU."""
        out = {f"previous.{k}": v.detach().to("cpu", copy=True) for k, v in self.previous.items()}
        out.update({f"velocity.{k}": v.detach().to("cpu", copy=True) for k, v in self.velocity.items()})
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor], like: dict[str, torch.Tensor]) -> None:
        """Restore what `state_dict` saved for the tensors in `like` (their names, devices and shapes)."""
        for kind, target in (("previous", self.previous), ("velocity", self.velocity)):
            target.clear()
            for name, tensor in like.items():
                saved = state.get(f"{kind}.{name}")
                if saved is not None and saved.shape == tensor.shape:
                    target[name] = saved.to(tensor.device, torch.float32, copy=True)

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


def valid_gather(value: object) -> bool:
    """A member's round info: (round, step, tokens since the last sync), non-negative ints of sane size."""
    return (
        isinstance(value, (tuple, list))
        and len(value) == 3
        and all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 62 for x in value)
    )
