"""Averaging groups over hivemind's DecentralizedAverager, and the outer optimisers applied to their result.

One `GroupAverager` per group: the shared parameters (every node) and each shard (its replicas only). Group keys
contain the run id and the config hash, so a node with another config can never enter a group. The all-reduce is
hivemind's with a robust reducer and checked results (`robust.py`); peers caught sending bad data are banned in a
`BanList` that the node's averagers share, and with a swarm key only its holders can enter a group.

**Two modes** (`swarm.average`):

- `weights` (as published): `step(weights, weight, gather)`, then `finish(handle)` returns the group's average
  of the weights; `outer.apply(local, averaged)` makes it the new weights.
- `updates`: `step(current, weight, gather, anchor=anchor)` sends the pseudo-gradient `anchor - current` (anchor:
  the weights at the last sync), then `finish(handle)` returns the group's averaged pseudo-gradient, the same
  values on every member; `outer.apply_update(local, anchor, update)` writes the new weights (plain:
  `anchor - update`; Nesterov: DiLoCo's outer step with `update` as the outer gradient) and the caller keeps them
  as its next anchor. What compression drops is fed back (error feedback, `robust.py`): a residual of 4 bytes per
  averaged value in shared memory (`GroupAverager.residual_bytes`), on both legs of the all-reduce, so the sum of
  the averaged updates over rounds tracks the sum of the exact averages within one round's rounding. Wire
  compression `int8` (`codecs.py`) is meant for this mode.

**Anchors.** Update averaging only converges among members that share their anchor: an update applied to two
different anchors leaves them as far apart as before. Each member puts a short anchor id into its gathered round
info, `(round, step, tokens, anchor_id)` (`valid_gather`); `GroupResult.anchors` reports every member's id and
`GroupResult.shared_anchor` the id if all members had the same one. After a round in which the group shared its
anchor and every part was averaged (`GroupResult.clean`), every member computes the same next id with
`next_anchor_id(previous, members, round)`; a member whose round was not clean derives an id that is its own.

**Bytes** in `GroupResult` are the serialized all-reduce messages this member sent and received, counted in the
averager process (`robust.py`); `estimated_bytes` is hivemind's butterfly formula, an estimate for planning only.
"""

from __future__ import annotations

import hashlib
import logging
import math
import string
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, NamedTuple

import torch
from hivemind import DHT
from hivemind.utils.timed_storage import get_dht_time

from spes_node.config import WIRE_BYTES
from spes_node.devices import HOST, to_host
from spes_node.procs import shared_like
from spes_node.swarm.codecs import wire_compression
from spes_node.swarm.robust import BanList, GroupOutcome, RobustAverager, RobustPolicy
from spes_node.swarm.swarm_key import SwarmKey

logger = logging.getLogger(__name__)

MODES = ("weights", "differences", "updates")
"""What a group averages and `GroupAverager.finish` returns: the weights, and their average; the weights, and the
average's difference to what this member handed over (what a plain average adds to its weights, with or without
training since: no copy of the handed-over weights is needed to land it); pseudo-gradients, and their average."""
ANCHOR_ID_CHARS = 32


def estimated_bytes(numel: int, group_size: int, compression: str) -> int:
    """Bytes one member sends (and as many it receives) in hivemind's butterfly all-reduce: (n-1)/n of the vector
    to the reducers and as much back, at the wire precision. An estimate; `GroupResult` has the counted bytes."""
    return int(2 * (group_size - 1) / group_size * numel * WIRE_BYTES[compression])


@dataclass
class GroupResult:
    group_size: int
    seconds: float
    bytes_sent: int
    """Serialized all-reduce messages this member sent (0 when no all-reduce completed)."""
    bytes_received: int
    """Serialized all-reduce messages this member received."""
    peers: dict[str, tuple] = field(default_factory=dict)
    """Members (ourselves included) -> their round info, `(round, step, tokens[, anchor_id])`."""
    error: str | None = None
    rejected: dict[str, str] = field(default_factory=dict)
    """Peers caught sending bad data in this step (peer id -> why); they are banned from then on."""
    failed_reducers: int = 0
    """Group members whose part of the vector was not averaged (it kept our local values)."""
    failed_fraction: float = 0.0
    """The share of the vector that kept local values."""
    allreduce_seconds: float = 0.0
    """Of `seconds`, the all-reduce (the rest was matchmaking: finding the group, waiting for its members)."""

    @property
    def anchors(self) -> dict[str, str | None]:
        """Each member's anchor id (None for a member that gave none)."""
        return {peer: info[3] if len(info) > 3 else None for peer, info in self.peers.items()}

    @property
    def shared_anchor(self) -> str | None:
        """The anchor id every member of the group gave, or None if they differ or one gave none."""
        ids = set(self.anchors.values())
        return ids.pop() if len(ids) == 1 and None not in ids and self.group_size >= 2 else None

    @property
    def clean(self) -> bool:
        """A group formed, it shared its anchor and every part of the vector was averaged: its members hold the
        same result."""
        return self.error is None and not self.failed_reducers and self.shared_anchor is not None


class StepHandle(NamedTuple):
    """A step in flight, from `GroupAverager.step`."""

    control: Any
    """hivemind's StepControl: `done()`, `cancel()`, `result()`."""
    started: float
    """`time.perf_counter()` when the step was handed to the averager."""
    deadline: float
    """`time.perf_counter()` past which hivemind should have ended the step, whatever happened in the group
    (matchmaking, a late retry, the all-reduce's own timeout, and a grace); an averager with no outcome by then
    is unresponsive, and `finish` gives the step up."""

    def over(self) -> bool:
        """The step is done, or past its deadline (never blocks)."""
        return self.control.done() or time.perf_counter() >= self.deadline


STEP_GRACE_SECONDS = 30.0
RESTART_EXIT_SECONDS = 5.0
"""How long a restart waits for the old averager process to exit after SIGTERM, then after SIGKILL."""
MAX_WORK_RATIO = 16.0
"""Updates mode: how much a sender's claimed work (tokens trained since the sync) beyond a full round, or beyond
ours if more, can widen its distance limit (`RobustPolicy.max_work_ratio`; our own update is also scaled up to a
full round). Honest members differ by several times: one trains on while it waits for a slower peer, a joiner
trains only the rest of its first round; with the plain limit of 4 times our update's norm, an honest node that
trained 20 steps was banned by one that trained 6. A liar gains at most this factor on the bound, and its weight
in the average is still capped at one round's tokens."""


class GroupAverager:
    """Averages a fixed list of named tensors with whoever is matchmaking under the same key.

    `average="updates"` averages pseudo-gradients (see the module docstring), `average="differences"` averages
    weights and returns each average's difference to what was handed over (`MODES`); `error_feedback=False` turns
    the residual off (for comparison). `step_grace`: seconds past a step's own timeouts before `finish` gives up an
    averager that gave no outcome."""

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
        average: str = "weights",
        error_feedback: bool = True,
        step_grace: float = STEP_GRACE_SECONDS,
    ):
        if average not in MODES:
            raise ValueError(f"average: expected one of {MODES}, got {average!r}")
        self.prefix, self.names, self.average = prefix, list(tensors), average
        self.bans = bans if bans is not None else BanList()
        self.compression_name = compression
        self.numel = sum(t.numel() for t in tensors.values())
        self.matchmaking_time, self.allreduce_timeout = matchmaking_time, allreduce_timeout
        self.client_mode = client_mode
        self.step_grace = step_grace
        self.unresponsive = False
        """Set when the averager did not take a step, or gave no outcome, in time: see `healthy`."""
        self.restarts = 0
        self._start = partial(
            RobustAverager,
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
            policy=RobustPolicy(
                max_weight=max_weight, max_work_ratio=MAX_WORK_RATIO if average == "updates" else 1.0
            ),
            # a member silent this long mid all-reduce (a stalled or frozen machine) is dropped and its part kept
            # local, instead of holding the whole group until the averaging timeout
            next_chunk_timeout=max(2 * matchmaking_time, 5.0),
            shutdown_timeout=2.0,
            updates=average == "updates",
            differences=average == "differences",
            error_feedback=error_feedback,
            start=True,
        )
        self.averager = self._start(shared_buffers(tensors))

    @property
    def healthy(self) -> bool:
        """The averager process is alive and took its last step and gave its outcome in time. A process the OOM
        killer ended, or one whose loop hangs, would otherwise cost every round a step's whole deadline, and its
        group would never average again."""
        return not self.unresponsive and self.averager.is_alive()

    def restart(self, tensors: dict[str, torch.Tensor]) -> None:
        """Replace the averager process with a new one on `tensors` (the group's live weights): the old one is
        terminated, then killed if it does not exit. The error-feedback residual starts again from zero; a step
        thread left waiting on the old process stays blocked (a daemon thread)."""
        if list(tensors) != self.names:
            raise ValueError(f"{self.prefix}: a restart needs the same tensors, in the same order")
        old = self.averager
        if old.is_alive():
            old.terminate()  # a helper exits with its children on SIGTERM (`procs.bind_to_parent`)
            old.join(RESTART_EXIT_SECONDS)
            if old.is_alive():
                old.kill()
                old.join(RESTART_EXIT_SECONDS)
        if not self.client_mode:  # a client registers no handlers
            old.release_handlers()
        self.averager = self._start(shared_buffers(tensors))
        self.unresponsive = False
        self.restarts += 1

    @property
    def residual_bytes(self) -> int:
        """Host memory the error-feedback residual takes (0 without one)."""
        residual = self.averager.residual
        return sum(t.numel() * t.element_size() for t in residual) if residual is not None else 0

    def step(
        self,
        tensors: dict[str, torch.Tensor],
        weight: float,
        gather: tuple,
        wait_extra: float = 0.0,
        *,
        anchor: dict[str, torch.Tensor] | None = None,
        expected: Collection[str] = (),
    ):
        """Start averaging a copy of `tensors` (with updates: of `anchor - tensors`, plus the residual); returns a
        handle for `finish`.

        A group we lead begins as soon as every `expected` peer (base58) has joined, or else at the end of its
        window: the matchmaking time plus `wait_extra` seconds for peers expected soon (the round bounds it, and
        stops waiting for a peer that did not come when it was waited for: `progress.no_shows`). Alone, we keep
        looking for two matchmaking times plus `wait_extra`, three in client mode (`search_seconds`). The all-reduce
        then has its own timeout."""
        if (anchor is not None) != (self.average == "updates"):
            raise ValueError(f"{self.prefix}: an anchor is needed to average updates, and only then")
        residual = self.averager.residual
        with self.averager.get_tensors() as buffers:
            for i, (buffer, name) in enumerate(zip(buffers, self.names)):
                if anchor is None:
                    buffer.copy_(tensors[name].detach())
                else:
                    buffer.copy_(anchor[name].detach() - tensors[name].detach().to(anchor[name].device))
                if residual is not None:
                    buffer.add_(residual[i])
        self.averager.set_peers(self.bans.active(), expected)
        start = time.perf_counter()
        wait_extra = max(0.0, wait_extra)
        matchmaking = self.search_seconds(wait_extra)
        # hivemind's leader begins at its declared time, the scheduled one (unscheduled: the matchmaking time after
        # the step, when a leader with one follower began without the peers that the round was waiting for). The
        # whole wait: a window stretched by one matchmaking time at most let a node further out of step (a joiner
        # whose download outlasted a round) miss its group round after round
        window_end = get_dht_time() + self.matchmaking_time + wait_extra
        control = self.averager.step(
            weight=max(weight, 1e-6),
            gather=gather,
            scheduled_time=window_end,
            timeout=matchmaking,
            wait=False,
        )
        # hivemind may start a last matchmaking attempt just before its deadline, then the all-reduce
        deadline = start + 2 * matchmaking + self.allreduce_timeout + self.step_grace
        return StepHandle(control, start, deadline)

    def search_seconds(self, wait_extra: float = 0.0) -> float:
        """How long a step looks for a group: two matchmaking windows plus `wait_extra`, and one window more in
        client mode.

        A client is found by no one: it joins a leader that has declared itself, and hivemind's leader refuses a
        follower whose search ends before the leader's group begins (a window after the leader came). With two
        windows, a client could join only leaders that came in the first window of its search; one that reached the
        sync two seconds before both servers (a loaded machine, matchmaking windows of 2 s) was refused by both, and
        averaged alone while they averaged together. With three, leaders that come in its first two windows."""
        return self.matchmaking_time * (3 if self.client_mode else 2) + wait_extra

    def finish(self, handle: StepHandle) -> tuple[GroupResult, dict[str, torch.Tensor] | None]:
        """Wait for the step, until its deadline at most; returns the averaged tensors (with updates: the averaged
        pseudo-gradient; with differences: the average minus what this member handed over), or None when no group
        formed, the all-reduce failed or the averager gave no outcome in time (the step is then cancelled, and the
        result's `error` says so).

        The averaged tensors are the averager's own buffers, not a copy (a copy was 4 bytes per averaged value in
        host memory at every round's end: 1.2 GiB at spes-1b, all of a node's groups at once); they hold the result
        until this averager's next `step`, which the caller must not start before it has used them."""
        control, start, deadline = handle
        try:
            outcome: GroupOutcome | None = control.result(timeout=max(0.0, deadline - time.perf_counter()))
        except TimeoutError:
            control.cancel()
            seconds = time.perf_counter() - start
            error = f"the averager gave no outcome in {seconds:.0f}s (unresponsive): step given up"
            logger.error(f"{self.prefix}: {error}")
            self.unresponsive = True
            return GroupResult(1, seconds, 0, 0, error=error), None
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
        # the all-reduce has written the buffers: nothing writes them again before our next step
        with self.averager.get_tensors() as buffers:
            averaged = dict(zip(self.names, buffers))
        result = GroupResult(
            n, seconds, outcome.bytes_sent, outcome.bytes_received, peers=peers, rejected=rejected
        )
        result.failed_reducers, result.failed_fraction = outcome.failed_reducers, outcome.failed_fraction
        result.allreduce_seconds = min(outcome.allreduce_seconds, seconds)
        if outcome.failed_reducers:
            why = "; ".join(f"{peer[:12]}: {reason}" for peer, reason in outcome.reducer_errors.items())
            result.error = (
                f"{outcome.failed_reducers} of {n} parts not averaged "
                f"({100 * outcome.failed_fraction:.0f}% of the vector kept local values)"
                + (f": {why}" if why else "")
            )
        return result, averaged

    def shutdown(self) -> None:
        if not self.averager.is_alive():
            return
        try:
            self.averager.shutdown()
        except Exception as e:
            logger.debug(f"averager {self.prefix} shutdown: {e}")


def shared_buffers(tensors: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """fp32 copies of `tensors` in shared memory, where an averager keeps them (hivemind's averager process works on
    the same pages), made one tensor at a time from the tensors as they are, wherever they live: a copy in host
    memory first, then the averager's, had two copies of a group in host memory at once (1.7 GiB for a spes-1b
    shard), at startup and at every shard move."""
    buffers = shared_like(tensors.values())  # `procs.shared_empty`: nothing left in /dev/shm however we end
    for buffer, tensor in zip(buffers, tensors.values()):
        buffer.copy_(tensor.detach())
    return buffers


class OuterOptimizer:
    """Turns the group average into the new local weights."""

    def apply(self, local: dict[str, torch.Tensor], averaged: dict[str, torch.Tensor]) -> None:
        """Weights mode: `averaged` is the group's average of the weights."""
        raise NotImplementedError

    def apply_update(
        self, local: dict[str, torch.Tensor], anchor: dict[str, torch.Tensor], update: dict[str, torch.Tensor]
    ) -> None:
        """Updates mode: write into `local` the new weights from `anchor` (the weights at the last sync) and the
        group's averaged pseudo-gradient `update` (anchor minus trained weights)."""
        raise NotImplementedError


class PlainAverage(OuterOptimizer):
    """As published: the new weights are the average (outer lr 1, no momentum)."""

    @torch.no_grad()
    def apply(self, local, averaged):
        for name, tensor in local.items():
            tensor.copy_(averaged[name])

    @torch.no_grad()
    def apply_update(self, local, anchor, update):
        for name, tensor in local.items():
            tensor.copy_(anchor[name] - update[name].to(anchor[name].device))


class NesterovOuter(OuterOptimizer):
    """DiLoCo: the outer gradient is (previous global - average); SGD with Nesterov momentum on the global weights.

    Its state lives in host memory (`devices.HOST`), whatever the weights' device, and is saved in checkpoints
    (`state_dict`)."""

    def __init__(self, lr: float, momentum: float):
        self.lr, self.momentum = lr, momentum
        self.previous: dict[str, torch.Tensor] = {}
        self.velocity: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def remember(self, local: dict[str, torch.Tensor]) -> None:
        """Record the global weights the next round starts from."""
        self.previous = {name: to_host(t) for name, t in local.items()}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Flat tensors by name (`previous.<name>`, `velocity.<name>`), on the CPU."""
        out = {f"previous.{k}": to_host(v) for k, v in self.previous.items()}
        out.update({f"velocity.{k}": to_host(v) for k, v in self.velocity.items()})
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor], like: dict[str, torch.Tensor]) -> None:
        """Restore what `state_dict` saved for the tensors in `like` (their names and shapes), in host memory."""
        for kind, target in (("previous", self.previous), ("velocity", self.velocity)):
            target.clear()
            for name, tensor in like.items():
                saved = state.get(f"{kind}.{name}")
                if saved is not None and saved.shape == tensor.shape:
                    target[name] = to_host(saved)

    @torch.no_grad()
    def apply(self, local, averaged):
        if not self.previous:
            PlainAverage().apply(local, averaged)
            self.remember(local)
            return
        self._step(
            local, self.previous, lambda name: self.previous[name] - averaged[name].to(HOST, torch.float32)
        )

    @torch.no_grad()
    def apply_update(self, local, anchor, update):
        self._step(local, anchor, lambda name: update[name].to(HOST, torch.float32))

    def _step(self, local, anchor, outer_grad: Callable[[str], torch.Tensor]) -> None:
        """The outer step from `anchor` along `outer_grad(name)`, tensor by tensor, written into `local`; the new
        weights, worked out in host memory, are also the next `previous` (no copy back from the training device)."""
        for name, tensor in local.items():
            grad = outer_grad(name)
            v = self.velocity.setdefault(name, torch.zeros_like(grad))
            v.mul_(self.momentum).add_(grad)
            new = anchor[name] - self.lr * (grad + self.momentum * v)
            tensor.copy_(new)
            self.previous[name] = new


def valid_gather(value: object) -> bool:
    """A member's round info: (round, step, tokens since the last sync), non-negative ints of sane size, and
    optionally its anchor id (1 to 32 lowercase hex digits)."""
    return (
        isinstance(value, (tuple, list))
        and len(value) in (3, 4)
        and all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 62 for x in value[:3])
        and (len(value) == 3 or valid_anchor_id(value[3]))
    )


def valid_anchor_id(value: object) -> bool:
    return (
        isinstance(value, str)
        and 0 < len(value) <= ANCHOR_ID_CHARS
        and all(c in string.hexdigits and not c.isupper() for c in value)
    )


def next_anchor_id(previous: str, members: Iterable[str], round: int) -> str:
    """The anchor id after a clean round: the same on every member of the group, whatever their order.

    A member whose round was not clean passes only itself as `members`, which gives an id of its own."""
    text = "\n".join([previous, *sorted(members), str(round)])
    return hashlib.sha256(text.encode()).hexdigest()[:ANCHOR_ID_CHARS]
