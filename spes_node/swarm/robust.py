"""Robust averaging: what a peer sends is checked before it is used, and no single peer drags the result far.

hivemind's butterfly all-reduce splits the averaged vector into parts; peer i reduces part i for the whole group
and sends every sender back (result - that sender's part). Peers are trusted in two places, and both are replaced:

- as a **reducer**, we aggregate the parts that every sender streams to us (`RobustPartReducer`);
- as a **sender**, we add to our weights whatever a reducer returns (`CheckedPartContainer`).

**Checks.** A part must have the expected shape, a floating dtype and finite values, come with a finite
non-negative weight, and lie within `max_distance_ratio` times the reference norm of our own part (the reference
is our part's norm, or the group's lower-median part norm if larger, so that one huge sender cannot stretch it).
A result from a reducer must be finite, of our part's shape, and move our part by at most twice that bound (an
honest reducer's result is within the bound of its own part, and so was ours). A part or result that fails is
dropped, its sender is reported, and the node bans it for `BAN_SECONDS` (`BanList`): when we lead a group it is
refused at matchmaking; when it is in our group anyway its parts get weight 0 and its reductions are not used
(we keep our own values for that part). The gathered metadata is checked too: each member's entry must decode,
name a known mode and carry a valid swarm-key tag (`swarm_key.py`); bandwidth hints are not used (all None), so
no member can claim a larger share of the reduction. A member that fails is treated as a client (no share) and
ignored. These rules depend only on what the whole group received, so honest members still agree on the
partition.

**Aggregation: centered clipping** (Karimireddy, He and Jaggi, 2021), one step around our own part c:

    result = c + sum_i w_i clip(x_i - c, tau) / sum_i w_i,    clip(v, tau) = v min(1, tau / |v|),

with tau the median of the distances |x_i - c| (our own 0 included; never below `min_clip_ratio` times the
reference norm) and each weight capped at `weight_cap` times the group's lower-median weight. Why this rule:

- groups are small: a shard's replicas are 2-4 peers. A coordinate-wise median of 2 values is their mean, and of
  3-4 it throws away most of the honest information every round; a trimmed mean must cut at least one value on
  each side, which leaves one or two of four and biases honest averaging all the time. Centered clipping leaves
  honest peers alone (their distances are at most tau) and costs nothing when nobody misbehaves.
- its center is a point the reducer trusts: its own weights, which started the round from the same average as
  everyone's and are H local steps away from the honest mean, so one step suffices (no iterations).
- breakdown: with f bad senders among n and f < n/2, tau is the distance of an honest peer (our 0 counts), so
  each bad peer moves the result by at most w/W tau, about the spread of honest replicas. With n = 2 no rule can
  tell who is right: the validation bound limits the damage (at most `max_distance_ratio` times our norm, times
  the bad peer's weight share, per round), and the swarm key keeps strangers out of such groups.
- cost: O(n d) per part (distances and one weighted sum) like the plain mean; a median needs a sort per
  coordinate, O(n d log n).

A part is reduced once, by its reducer, and every member receives that result, so replicas stay identical
whatever the rule; the rule only decides how far one peer can pull them.

**Averaging updates** (`RobustAverager(updates=True)`). hivemind returns each sender the difference between the
part's average and the sender's own (compressed) part, compressed again; a member then holds the average plus its
own rounding of both legs, which in weights mode the next average pulls back, but which updates applied to an
anchor keep forever. So in this mode a reducer compresses each part's average once and sends every sender, and
applies itself, the same bytes (`UpdateBroadcast`): all members apply bitwise the same update. Error feedback
makes the rounding exact over rounds: a sender stores, per chunk, what compressing it dropped (input minus its
decoded copy) in a residual (shared memory, made before the averager process starts); the reducer stores what
the broadcast dropped at its own part, divided by its weight share (at most the group size), since its input
counts with that share; a chunk whose reducer failed keeps our input there and stores zero. The next step adds
the residual to the input (`GroupAverager.step`). Then, with steady weights, the summed averaged updates differ
from the sum of the exact averages by exactly the group's mean residual, one round's rounding
(tests/test_averaging_updates.py). Our own part is never compressed on the way in. An all-reduce that fails
after chunks went out loses their previous residual (at most one round's rounding once). Updates are checked by
the same distance bound as weights, relative to our own update's norm, raised by work: an honest update grows with
the tokens trained for it, and members do not train equal amounts per round (a fast node trains on while it
waits for a slower one, a joiner trains only the rest of its first round). Our own update counts as if scaled
up to a full round (`own_scale`: our tokens alone decide it), and a sender that claims k times a full round (or
our tokens, if more) may lie min(k, `max_work_ratio`) times farther (`RobustPolicy.max_work_ratio`). With the
bound of 4 alone, an honest member that trained 20 steps was banned by one that trained 6. A part's reference
norm is also never below what our whole update has at the part's length (`part_floor`): the experts of one part
may see none of our tokens in a round, leaving our update there at weight decay alone, while a replica's saw
many; with our part's norm alone, two honest replicas of a shard banned each other in round 1.

**Bytes.** `RobustAllReduceRunner` counts the serialized messages of the all-reduce (protobuf size, tensor
buffer plus a few bytes of header per chunk) in both roles: as a sender (our parts out, results in, through a
counting stub) and as a reducer (parts in, results out); `GroupOutcome` carries the totals.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import signal
import threading
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, AsyncIterator  # noqa: UP035 (hivemind reads `typing` hints to find streaming RPCs)

import hivemind.averaging.averager
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.matchmaking import Matchmaking
from hivemind.averaging.partition import (
    AllreduceException,
    BannedException,
    TensorPartContainer,
    TensorPartReducer,
)
from hivemind.compression import (
    CompressionBase,
    CompressionInfo,
    NoCompression,
    deserialize_torch_tensor,
    serialize_torch_tensor,
)
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.asyncio import achain, amap_in_executor, as_aiter, azip
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.timed_storage import get_dht_time

from spes_node.procs import bind_to_parent, kept_in_place, release_inherited_tensors, shared_like
from spes_node.swarm import streams
from spes_node.swarm.handlers import Registration, release_stream_handlers
from spes_node.swarm.swarm_key import SwarmKey

logger = logging.getLogger(__name__)

BAN_SECONDS = 3600.0
PART_WINDOW = 8
"""How many parts of a sender's stream a reducer takes in ahead of the results it has sent back (hivemind: 1)."""
MAX_BANS = 4096
UNKNOWN_GROUP_GRACE = 1.0
"""Seconds an averager that may no longer join a group goes on waiting before it refuses a part sent for that
group (`RobustAverager.rpc_aggregate_part`)."""
UNKNOWN_GROUP_POLL = 0.05
_TINY = 1e-12
_MODES = (AveragingMode.NODE.value, AveragingMode.CLIENT.value)


@dataclass(frozen=True)
class RobustPolicy:
    """How suspicious a reducer is of what its group sends."""

    max_distance_ratio: float = 4.0
    """A part farther than this times the reference norm from our own part is rejected."""
    weight_cap: float = 2.0
    """A sender's weight counts at most this times the group's lower-median weight."""
    min_clip_ratio: float = 1e-3
    """The clipping radius never falls below this times the reference norm."""
    max_weight: float = math.inf
    """No sender's weight counts for more than this (what the config lets a node train in one round)."""
    max_work_ratio: float = 1.0
    """Updates: a sender claiming k > 1 times the work (tokens trained) of a full round, or of ours if more, has its
    distance limit raised min(k, this) times, and a reducer's result may move our part this many times the plain
    bound (both also scaled by `own_scale`). 1: no raise (weights, whose size does not grow with training)."""


@dataclass
class Aggregate:
    result: torch.Tensor
    rejected: dict[int, str]
    """Index of each rejected part -> why."""
    own_share: float = 0.0
    """The share of the result's weight that our own part had (0 when it was not used)."""


def check_part(part: Any, shape: torch.Size) -> str | None:
    """Why `part` cannot be used as a tensor of `shape`, or None."""
    if not isinstance(part, torch.Tensor):
        return f"a {type(part).__name__}, not a tensor"
    if part.shape != shape:
        return f"shape {tuple(part.shape)}, expected {tuple(shape)}"
    if not part.dtype.is_floating_point:
        return f"dtype {part.dtype}"
    if part.numel() and not all(math.isfinite(float(x)) for x in torch.aminmax(part)):
        # NaN and inf both reach the minimum or the maximum; one pass, no boolean copy of the part
        return "non-finite values"
    return None


def _check_weight(weight: Any) -> str | None:
    if not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight < 0:
        return f"weight {weight!r}"
    return None


def _lower_median(values: Sequence[float]) -> float:
    return sorted(values)[(len(values) - 1) // 2]


def robust_mean(
    parts: Sequence[torch.Tensor],
    weights: Sequence[float],
    shape: torch.Size,
    own: int | None = None,
    policy: RobustPolicy = RobustPolicy(),
    reference_floor: float = 0.0,
) -> Aggregate:
    """Centered-clipping mean of `parts` around `parts[own]` (around their coordinate-wise median without one).

    `reference_floor`: the reference norm is never below this (updates: our whole update's size at this part's
    length, `part_floor`, since one part of our own update can be near zero while an honest replica's is not).

    The reducer of every all-reduce part runs this in the averager's event loop, so it works part by part without
    stacking the senders' copies: one difference from the center per other sender, their norms, and the result
    as the center plus their clipped, weighted sum (float32, like the parts)."""
    rejected: dict[int, str] = {}
    valid = []
    for i, (part, weight) in enumerate(zip(parts, weights)):
        reason = check_part(part, shape) or _check_weight(weight)
        if reason is None:
            valid.append(i)
        else:
            rejected[i] = reason
    if not valid:
        own_part = parts[own] if own is not None else None
        fallback = own_part if isinstance(own_part, torch.Tensor) else torch.zeros(shape)
        return Aggregate(fallback.float().reshape(shape), rejected)

    xs = [parts[i].float().reshape(-1) for i in valid]
    own_k = valid.index(own) if own in valid else None
    center = xs[own_k] if own_k is not None else torch.stack(xs).median(dim=0).values
    diffs = [None if k == own_k else x - center for k, x in enumerate(xs)]
    distances = [0.0 if d is None else float(d.norm()) for d in diffs]
    reference = max(float(center.norm()), _lower_median([float(x.norm()) for x in xs]), reference_floor)
    limit = policy.max_distance_ratio * reference + _TINY
    limits = [limit * ratio for ratio in _work_ratios(weights, valid, own, policy)]
    keep = [k for k, i in enumerate(valid) if i == own or distances[k] <= limits[k]]
    for k, i in enumerate(valid):
        if k not in keep:
            rejected[i] = f"{distances[k]:.3g} away from ours, more than {limits[k]:.3g}"

    w = [min(float(weights[valid[k]]), policy.max_weight) for k in keep]
    cap = policy.weight_cap * _lower_median(w)
    w = [min(x, cap) for x in w] if cap > 0 else w
    total = math.fsum(w)
    own_kept = next((k for k, j in enumerate(keep) if valid[j] == own), None)
    if total <= 0:
        return Aggregate(
            center.reshape(shape).clone(), rejected, own_share=1.0 if own_kept is not None else 0.0
        )
    own_share = w[own_kept] / total if own_kept is not None else 0.0
    kept_distances = sorted(distances[k] for k in keep)
    tau = max(kept_distances[len(keep) // 2], policy.min_clip_ratio * reference, _TINY)
    result = center.clone()
    for k, weight in zip(keep, w):
        if diffs[k] is not None and weight > 0:
            result.add_(diffs[k], alpha=min(tau / max(distances[k], _TINY), 1.0) * weight / total)
    return Aggregate(result.reshape(shape), rejected, own_share)


def update_rms(tensors: Iterable[torch.Tensor]) -> float:
    """Root mean square of the values of `tensors` (our whole update in update averaging), in float64."""
    total, count = 0.0, 0
    for tensor in tensors:
        total += float(torch.linalg.vector_norm(tensor, dtype=torch.float32).double() ** 2)
        count += tensor.numel()
    return math.sqrt(total / count) if count else 0.0


def part_floor(rms: float, numel: int) -> float:
    """The norm a part of `numel` values would have at root mean square `rms`: the least reference norm for a part
    of our update. Updates are not spread evenly: the experts of one part may have seen none of our tokens in a
    round (AdamW then moves them by weight decay alone, four orders of magnitude less), while a replica's saw many.
    Our own part's norm alone made an honest replica look 200 times too far, and banned it. The floor comes from our
    own tensors only, so no peer can raise it."""
    return rms * math.sqrt(numel)


def own_scale(own_weight: float, policy: RobustPolicy) -> float:
    """Updates: how many times a full round's tokens (`max_weight`) our own weight is short of, at least 1. A
    joiner's first update covers the rest of a round only; its reference norm is scaled up as if it had trained the
    whole round. Our weight alone decides it: no peer's claim moves it."""
    if policy.max_work_ratio <= 1.0 or not math.isfinite(policy.max_weight):
        return 1.0
    return max(1.0, policy.max_weight / max(own_weight, 1.0))


def _work_ratios(
    weights: Sequence[float], valid: Sequence[int], own: int | None, policy: RobustPolicy
) -> list[float]:
    """For each valid sender, how many times farther than the plain limit its part may lie: our update scaled to a
    full round (`own_scale`), times the work the sender claims beyond that (over ours, or a full round's if more),
    between 1 and `policy.max_work_ratio`. Without our part, the group's lower-median weight stands for ours."""
    if policy.max_work_ratio <= 1.0:
        return [1.0] * len(valid)
    base = float(weights[own]) if own in valid else _lower_median([float(weights[j]) for j in valid])
    full = max(base, policy.max_weight) if math.isfinite(policy.max_weight) else base
    if full <= 0:
        return [policy.max_work_ratio] * len(valid)
    scale = own_scale(base, policy)
    return [scale * min(max(float(weights[i]) / full, 1.0), policy.max_work_ratio) for i in valid]


def check_result(
    delta: Any,
    local: torch.Tensor,
    policy: RobustPolicy = RobustPolicy(),
    own_weight: float | None = None,
    reference_floor: float = 0.0,
) -> str | None:
    """Why a reducer's result (a delta for our part `local`) cannot be used, or None. Updates: the bound grows by
    `max_work_ratio`, and by `own_scale` of our weight when it is given; our part's norm counts as at least
    `reference_floor` (`part_floor`)."""
    reason = check_part(delta, local.shape)
    if reason is not None:
        return reason
    scale = max(policy.max_work_ratio, 1.0) * (
        own_scale(own_weight, policy) if own_weight is not None else 1.0
    )
    reference = max(float(local.float().norm()), reference_floor)
    bound = 2 * policy.max_distance_ratio * scale * reference + _TINY
    moved = float(delta.float().norm())
    if not moved <= bound:
        return f"its result moves our part by {moved:.3g}, more than {bound:.3g}"
    return None


# ---------------------------------------------------------------------------------------------- hivemind parts


class UpdateBroadcast:
    """A reducer's side of update averaging: the average of each part is compressed once, every member (ourselves
    included) gets those same bytes, and what the compression dropped goes into our residual at that part.

    The dropped amount is scaled by 1 / (our share of the part's weight), at most the number of senders: our input
    counts with that share in the next average, so the next average gets it back whole when the group's weights
    repeat (equal weights: exactly; a member with a small share feeds back less, never a spike)."""

    def __init__(self, compression: CompressionBase, residual_parts: Sequence[torch.Tensor] | None):
        self.compression, self.residual_parts = compression, residual_parts

    def encode(
        self, part_index: int, average: torch.Tensor, own_share: float, senders: int
    ) -> tuple[torch.Tensor, runtime_pb2.Tensor]:
        """(what every member applies, the message that carries it) for one reduced part."""
        message = self.compression.compress(average, CompressionInfo.from_tensor(average))
        value = deserialize_torch_tensor(message)  # the decoder every receiver runs
        if self.residual_parts is not None:
            gain = min(1.0 / own_share, float(senders)) if own_share > 0 else 0.0
            self.residual_parts[part_index].copy_((average - value).reshape(-1) * gain)
        return value, message


class RobustPartReducer(TensorPartReducer):
    """Collects every sender's copy of each part and reduces them with `robust_mean`, part after part.

    hivemind's reducer takes part k + 1 from nobody until every sender's part k is in, so all links to a reducer
    move in lockstep and one that stalls a moment (a scheduling delay, a loss on a shaped link) stalls the others.
    This one keeps whatever parts arrive, from any sender and for any part not yet reduced, and reduces each part
    as soon as it is complete and every earlier one is reduced. How far a sender may run ahead is up to whoever
    feeds it (`RobustAllReduceRunner` reads at most `PART_WINDOW` parts of a stream ahead of the results it has
    sent back). A sender that fails or is rejected counts for none of the parts not yet reduced.

    With a `broadcast` (update averaging), each part's result is the pair (value, message) of
    `UpdateBroadcast.encode` instead of a tensor."""

    def __init__(
        self,
        part_shapes: Sequence[torch.Size],
        num_senders: int,
        *,
        local_sender: int | None,
        policy: RobustPolicy,
        on_reject: Callable[[int, str], None],
        broadcast: UpdateBroadcast | None = None,
        reference_rms: float = 0.0,
    ):
        self.local_sender, self.policy, self.on_reject = local_sender, policy, on_reject
        self.broadcast = broadcast
        self.reference_rms = reference_rms
        """Root mean square of our whole input: each part's reference norm is at least its `part_floor`."""
        self.contributions: dict[int, dict[int, tuple[torch.Tensor, float]]] = {}
        """Part index -> sender -> (its part, its weight), for the parts not yet reduced."""
        self.part_futures: dict[int, asyncio.Future] = {}
        self._reducing = False
        super().__init__(part_shapes, num_senders)

    def reset_accumulators(self):
        # hivemind's __init__ calls this once to start at part 0; no running sum is kept
        self.current_part_index = 0
        if self.num_parts == 0:
            self.finalize()

    def _part_future(self, part_index: int) -> asyncio.Future:
        future = self.part_futures.get(part_index)
        if future is None:
            future = self.part_futures[part_index] = asyncio.get_running_loop().create_future()
        return future

    def _expected(self, part_index: int) -> int:
        return sum(part_index < failed_after for failed_after in self.sender_failed_after)

    async def accumulate_part(
        self, sender_index: int, part_index: int, tensor_part: torch.Tensor, weight: float = 1.0
    ) -> Any:
        """Keep `tensor_part` as this sender's copy of the part and return the part's result once it is reduced."""
        assert 0 <= sender_index < self.num_senders, "invalid sender index"
        assert 0 <= part_index < self.num_parts, "invalid part index"
        if self.finished.is_set():
            raise AllreduceException(f"attempted to aggregate part in a finalized {type(self).__name__}")
        if self.sender_failed_after[sender_index] != math.inf:
            raise BannedException(f"sender {sender_index} was banned in background")
        if part_index != self.num_parts_received[sender_index]:
            raise AllreduceException(
                f"sender {sender_index} sent part {part_index}, expected {self.num_parts_received[sender_index]}"
            )
        self.num_parts_received[sender_index] += 1
        future = self._part_future(part_index)
        self.contributions.setdefault(part_index, {})[sender_index] = (tensor_part, weight)
        self._reduce_ready()
        result = await asyncio.shield(future)  # one waiter cancelled must not cancel the part for the others
        if part_index >= self.sender_failed_after[sender_index]:
            raise BannedException(f"sender {sender_index} was banned before part {part_index} was reduced")
        return result

    def on_sender_failed(self, sender_index: int):
        """Leave that sender out of every part not yet reduced, including those it has sent."""
        self.sender_failed_after[sender_index] = min(
            self.num_parts_received[sender_index], self.current_part_index
        )
        for part in self.contributions.values():
            part.pop(sender_index, None)
        self._reduce_ready()

    def _reduce_ready(self):
        if self._reducing:  # a rejection reported from inside the loop below: the loop goes on by itself
            return
        self._reducing = True
        try:
            while not self.finished.is_set() and self.current_part_index < self.num_parts:
                index = self.current_part_index
                parts = self.contributions.get(index, {})
                assert len(parts) <= self._expected(index)
                if len(parts) < self._expected(index):
                    return
                rejected = self._reduce(index, self.contributions.pop(index, {}))
                self.current_part_index += 1
                # reported once the part is done, as hivemind bans: a rejected sender still gets this result
                for sender, reason in rejected:
                    self.on_reject(sender, reason)
            if self.current_part_index >= self.num_parts:
                self.finalize()
        finally:
            self._reducing = False

    def _reduce(self, index: int, parts: dict[int, tuple[torch.Tensor, float]]) -> list[tuple[int, str]]:
        """Set the result of part `index` from `parts`; returns the (sender, why) of the parts rejected."""
        senders = sorted(parts)
        aggregate = robust_mean(
            [parts[s][0] for s in senders],
            [parts[s][1] for s in senders],
            self.part_shapes[index],
            own=senders.index(self.local_sender) if self.local_sender in senders else None,
            policy=self.policy,
            reference_floor=part_floor(self.reference_rms, self.part_shapes[index].numel()),
        )
        result: Any = aggregate.result
        if self.broadcast is not None:
            used = len(senders) - len(aggregate.rejected)
            result = self.broadcast.encode(index, result, aggregate.own_share, used)
        # its waiters hold the future; out of the dict, the result goes once they have it (hivemind's reducer kept
        # one part's result at a time, not the whole share)
        future = self.part_futures.pop(index, None)  # None: nobody sent this part (every sender failed)
        if future is not None and not future.done():
            future.set_result(result)
        return [
            (senders[position], reason)
            for position, reason in aggregate.rejected.items()
            if senders[position] != self.local_sender
        ]

    def finalize(self):
        if self.finished.is_set():
            return
        self.finished.set()
        for future in self.part_futures.values():
            if not future.done():
                future.cancel()
        self.contributions.clear()
        if self.num_parts and self.num_senders:
            expected, received = self.num_parts * self.num_senders, sum(self.num_parts_received)
            if received != expected:
                logger.warning(f"Reducer: received {received / expected * 100:.1f}% of input tensors")


class CheckedPartContainer(TensorPartContainer):
    """Checks every result a reducer returns before it is added to our weights.

    With `return_deltas=False` (update averaging) results are the values to apply, not differences. With a
    `residual` (tensors shaped like ours), each chunk we send stores there what its compression dropped, and a
    chunk whose reducer fails stores zero (we keep our whole input there)."""

    def __init__(
        self,
        *args,
        local_index: int,
        policy: RobustPolicy,
        on_bad_result: Callable[[int, str], None],
        residual: Sequence[torch.Tensor] | None = None,
        own_weight: float | None = None,
        reference_rms: float = 0.0,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        self.local_index, self.policy, self.on_bad_result = local_index, policy, on_bad_result
        self.own_weight = own_weight
        """Our weight in the all-reduce (tokens trained): bounds results in update averaging (`check_result`)."""
        self.reference_rms = reference_rms
        """Root mean square of our whole input: a result is bounded as if our part were at least that large."""
        self.failed_reducers: set[int] = set()
        """Peers (indices) whose parts we kept at our local values because they did not reduce them."""
        self.residual_parts_by_peer = self._residual_views(residual) if residual is not None else None
        """For each peer, views of the residual aligned with our input parts for that peer."""
        self._kept_from = list(self.num_parts_by_peer)
        """For each peer, the first part we keep local (its reducer failed); its residual stays zero."""
        self._residual_lock = threading.Lock()

    def _residual_views(self, residual: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
        # hivemind splits tensor after tensor into parts and deals them to peers in increasing order, so the
        # peers' parts, one peer after the other, are the parts of the tensors in order
        parts = [part for queue in self._input_parts_by_peer for part, _ in queue]
        views, index = [], 0
        for tensor, local, count in zip(residual, self.local_tensors, self.num_parts_by_tensor):
            assert tensor.shape == local.shape and tensor.dtype == local.dtype, (
                "residual does not match the input"
            )
            flat, offset = tensor.view(-1), 0
            for part in parts[index : index + count]:
                assert part.data_ptr() == local.data_ptr() + offset * local.element_size(), "unexpected split"
                views.append(flat[offset : offset + part.numel()])
                offset += part.numel()
            index += count
        bounds = [0, *itertools.accumulate(self.num_parts_by_peer)]
        return [views[start:end] for start, end in zip(bounds, bounds[1:])]

    @torch.no_grad()
    async def iterate_input_parts_for(self, peer_index: int) -> AsyncIterator[runtime_pb2.Tensor]:
        if self.residual_parts_by_peer is None:
            async for message in super().iterate_input_parts_for(peer_index):
                yield message
            return
        assert not self._inputs_consumed_by_peer[peer_index], (
            "input parts of a given peer are already deallocated."
        )
        self._inputs_consumed_by_peer[peer_index] = True
        items = list(zip(self._input_parts_by_peer[peer_index], self.residual_parts_by_peer[peer_index]))
        async for message in amap_in_executor(
            lambda index: self._compress_keeping_residual(peer_index, index, *items[index]),
            as_aiter(*range(len(items))),
            max_prefetch=self.prefetch,
        ):
            yield message

    def _compress_keeping_residual(
        self, peer_index: int, part_index: int, part_and_info: tuple, residual: torch.Tensor
    ) -> runtime_pb2.Tensor:
        part, info = part_and_info
        message = self.compression.compress(part, info)
        dropped = part - deserialize_torch_tensor(message).reshape(part.shape)
        with self._residual_lock:
            if part_index < self._kept_from[peer_index]:
                residual.copy_(dropped)
        return message

    def register_failed_reducer(self, peer_index: int):
        if self._outputs_registered_by_peer[peer_index] < self.num_parts_by_peer[peer_index]:
            self.failed_reducers.add(peer_index)
        if self.residual_parts_by_peer is not None:
            with self._residual_lock:
                first = self._outputs_registered_by_peer[peer_index]
                self._kept_from[peer_index] = min(self._kept_from[peer_index], first)
                for residual in self.residual_parts_by_peer[peer_index][first:]:
                    residual.zero_()
        super().register_failed_reducer(peer_index)

    def register_processed_part(self, peer_index: int, part_index: int, part: torch.Tensor):
        inputs = self._input_parts_by_peer[peer_index]
        if peer_index != self.local_index and part_index < len(inputs):
            local = inputs[part_index][0]
            delta = part if self.return_deltas or check_part(part, local.shape) else part - local
            floor = part_floor(self.reference_rms, local.numel())
            reason = check_result(delta, local, self.policy, self.own_weight, floor)
            if reason is not None:
                self.on_bad_result(peer_index, reason)
                raise AllreduceException(f"rejected a result of peer #{peer_index}: {reason}")
        super().register_processed_part(peer_index, part_index, part)


class RobustAllReduceRunner(AllReduceRunner):
    """hivemind's all-reduce with a robust reducer, checked results, and `ignored` peers at weight 0.

    `updates`: every member gets the same compressed average of each part (see the module docstring), and the
    runner yields values to apply instead of differences. `residual`: tensors shaped like ours that receive what
    compression drops (`CheckedPartContainer`, `UpdateBroadcast`). `window`: how many parts of each sender's stream it
    takes in ahead of the results sent back (`PART_WINDOW` when it is made). `bytes_sent` and `bytes_received` count the
    serialized messages of the all-reduce, in both roles."""

    def __init__(
        self,
        *,
        tensors: Sequence[torch.Tensor],
        peer_fractions: tuple[float, ...],
        policy: RobustPolicy,
        ignored: Collection[PeerID],
        on_reject: Callable[[PeerID, str], None],
        updates: bool = False,
        residual: Sequence[torch.Tensor] | None = None,
        **kwargs,
    ):
        container_kwargs = {
            k: kwargs[k]
            for k in ("compression", "part_size_bytes", "tensor_infos", "prefetch")
            if k in kwargs
        }
        super().__init__(tensors=tensors, peer_fractions=peer_fractions, **kwargs)
        self._on_reject = on_reject
        self.ignored = frozenset(ignored) - {self.peer_id}
        self.updates = updates
        self.window = PART_WINDOW
        assert self.window >= 1, "a reducer must take at least the part it reduces"
        self.bytes_sent = self.bytes_received = 0
        self.reducer_errors: dict[PeerID, str] = {}
        """Reducers whose part failed, and why (hivemind logs it at DEBUG only)."""
        self._serving = 0
        self._served = asyncio.Event()
        self._served.set()
        # hivemind's __init__ built a plain container and reducer: replace both before anything runs
        self.tensor_part_reducer.finished.set()
        index = self.ordered_peer_ids.index(self.peer_id)
        # updates: a part's reference norm is at least what our whole update has at its length (`part_floor`);
        # weights are alike part by part, so they keep their own part's norm
        reference_rms = update_rms(tensors) if updates else 0.0
        self.tensor_part_container = CheckedPartContainer(
            tensors,
            peer_fractions,
            return_deltas=not updates,
            local_index=index,
            policy=policy,
            on_bad_result=self._reject_reducer,
            residual=residual,
            own_weight=self.weight,
            reference_rms=reference_rms,
            **container_kwargs,
        )
        self.parts_for_local_averaging = self.tensor_part_container.get_raw_input_parts(index)
        senders = self.sender_peer_ids
        broadcast = None
        if updates:
            own_residual = self.tensor_part_container.residual_parts_by_peer
            broadcast = UpdateBroadcast(
                kwargs.get("compression", NoCompression()), own_residual[index] if own_residual else None
            )
        self.tensor_part_reducer = RobustPartReducer(
            tuple(part.shape for part in self.parts_for_local_averaging),
            len(senders),
            local_sender=senders.index(self.peer_id) if self.peer_id in senders else None,
            policy=policy,
            on_reject=self._reject_sender,
            broadcast=broadcast,
            reference_rms=reference_rms,
        )
        for peer in self.ignored & set(self.sender_peer_ids):
            self.banned_senders.add(peer)
            self.tensor_part_reducer.on_sender_failed(self.sender_peer_ids.index(peer))

    def _reject_sender(self, sender_index: int, reason: str) -> None:
        peer = self.sender_peer_ids[sender_index]
        self._on_reject(peer, f"sent a bad part: {reason}")
        if peer not in self.banned_senders:
            self.banned_senders.add(peer)
            self.tensor_part_reducer.on_sender_failed(sender_index)

    def _reject_reducer(self, peer_index: int, reason: str) -> None:
        self._on_reject(self.ordered_peer_ids[peer_index], f"returned a bad result: {reason}")

    async def _communicate_with_peer(self, peer_id: PeerID):
        if peer_id in self.ignored:
            self.tensor_part_container.register_failed_reducer(self.ordered_peer_ids.index(peer_id))
            return
        if self.updates and peer_id == self.peer_id:
            # hivemind's local branch, registering the value every member gets instead of a difference
            peer_index = self.ordered_peer_ids.index(peer_id)
            sender_index = self.sender_peer_ids.index(peer_id)
            for part_index, tensor_part in enumerate(self.parts_for_local_averaging):
                value, _ = await self.tensor_part_reducer.accumulate_part(
                    sender_index, part_index, tensor_part, weight=self.weight
                )
                self.tensor_part_container.register_processed_part(peer_index, part_index, value)
            return
        try:
            await super()._communicate_with_peer(peer_id)
        except Exception as e:  # hivemind has registered the part as failed; the round reports why
            self.reducer_errors[peer_id] = f"{type(e).__name__}: {e}"[:200]
            raise

    def _get_peer_stub(self, peer: PeerID):
        expected = self.tensor_part_container.num_parts_by_peer[self.ordered_peer_ids.index(peer)]
        return _CountingStub(super()._get_peer_stub(peer), self, expected)

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        self._serving += 1
        self._served.clear()
        averaged, ended, serving = 0, "its input ended", True

        def served() -> None:
            nonlocal serving
            if serving:
                serving = False
                self._serving -= 1
                if not self._serving:
                    self._served.set()

        try:
            async for message in super().rpc_aggregate_part(self.counted(stream, received=True), context):
                self.bytes_sent += message.ByteSize()
                if message.code == averaging_pb2.AVERAGED_PART:
                    averaged += 1
                else:  # a refusal (a stale group, a cancelled step) or an error, told to the sender as such
                    ended = f"answered {averaging_pb2.MessageCode.Name(message.code)}"
                yield message
            if 0 < averaged == self.tensor_part_reducer.num_parts:
                # every result is out (`wait_served` waits no longer): the sender closes once it has read them
                # (`streams`), and closing first could lose the last of them; a sender that reads on until the
                # stream ends (hivemind's own) is not waited for
                served()
                await streams.linger()
        # a CancelledError once every result is out: the sender closed, as it should
        except BaseException as e:
            ended = type(e).__name__
            raise
        finally:
            served()
            expected = self.tensor_part_reducer.num_parts
            if 0 < expected != averaged:
                # the sender reports only "sent k parts, but we expected n": say here why we stopped
                banned = context.remote_id in self.banned_senders
                logger.warning(
                    f"sent {context.remote_id} {averaged} of {expected} averaged parts: "
                    + ("it was banned from this all-reduce" if banned else ended)
                )

    async def counted(self, messages: AsyncIterator, *, received: bool) -> AsyncIterator:
        async for message in messages:
            if received:
                self.bytes_received += message.ByteSize()
            else:
                self.bytes_sent += message.ByteSize()
            yield message

    async def wait_served(self, timeout: float) -> None:
        """Wait (at most `timeout` s) until we have streamed their results to the members whose parts we reduce:
        our own results can be complete while the last messages to others are still going out."""
        try:
            await asyncio.wait_for(self._served.wait(), timeout)
        except asyncio.TimeoutError:
            logger.debug(f"{self}: results still streaming to peers after {timeout:.1f}s")

    async def _accumulate_parts_streaming(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], sender_index: int
    ):
        # hivemind's reads a sender's next part only once it has sent back the result of the last, so every link to
        # this reducer waits for the slowest; here a reader takes up to `window` parts ahead into the reducer while
        # the results go back in order. With updates, every sender gets the part's one compressed average instead
        # of its own difference.
        reducer, loop = self.tensor_part_reducer, asyncio.get_running_loop()
        in_flight: asyncio.Queue = asyncio.Queue()
        slots = asyncio.Semaphore(self.window)

        async def read() -> None:
            try:
                index = 0
                async for tensor_part, weight, compression in amap_in_executor(
                    lambda msg: (
                        deserialize_torch_tensor(msg.tensor_part),
                        msg.weight,
                        msg.tensor_part.compression,
                    ),
                    stream,
                    max_prefetch=self.tensor_part_container.prefetch,
                ):
                    await slots.acquire()
                    result = asyncio.ensure_future(
                        reducer.accumulate_part(sender_index, index, tensor_part, weight=weight)
                    )
                    in_flight.put_nowait((tensor_part, compression, result))
                    index += 1
            finally:
                in_flight.put_nowait(None)

        reader = asyncio.create_task(read())
        part_index = 0
        try:
            while (item := await in_flight.get()) is not None:
                tensor_part, compression, result = item
                try:
                    averaged = await result
                except BannedException:
                    logger.debug(f"Sender {sender_index} is already banned")
                    break
                slots.release()
                part_index += 1
                if self.updates:
                    message = averaged[1]
                else:
                    message = await loop.run_in_executor(
                        None, _delta_message, averaged, tensor_part, compression
                    )
                yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=message)
            if part_index < reducer.num_parts and reader.done() and not reader.cancelled():
                reader.result()  # the sender's stream failed (a timeout, a broken connection): say so
        finally:
            _discard(reader)
            while not in_flight.empty():
                if (item := in_flight.get_nowait()) is not None:
                    _discard(item[2])
            if part_index != reducer.num_parts:
                await self._ban_sender(self.sender_peer_ids[sender_index])


def _discard(task: asyncio.Future) -> None:
    """Cancel `task`, or take its exception if it has one (a banned sender's parts end in BannedException), so that
    asyncio does not log it as never retrieved."""
    if not task.done():
        task.cancel()
    elif not task.cancelled():
        task.exception()


def _delta_message(averaged: torch.Tensor, sent: torch.Tensor, compression: int) -> runtime_pb2.Tensor:
    """What a reducer sends back in weights mode: the part's result minus what the sender sent."""
    return serialize_torch_tensor(averaged - sent, compression)


class _CountingStub:
    """A peer's averaging stub that counts the bytes of the all-reduce messages both ways, and closes the stream of
    results once the `expected` parts are in (or the reducer refused): the reducer waits for that close
    (`streams`)."""

    def __init__(self, stub, runner: RobustAllReduceRunner, expected: int):
        self._stub, self._runner, self._expected = stub, runner, expected

    async def rpc_aggregate_part(self, requests: AsyncIterator[averaging_pb2.AveragingData]):
        stream = await self._stub.rpc_aggregate_part(self._runner.counted(requests, received=False))
        return self._runner.counted(streams.take(stream, self._complete), received=True)

    def _complete(self, message: averaging_pb2.AveragingData, count: int) -> bool:
        return count >= self._expected or message.code != averaging_pb2.AVERAGED_PART


# ---------------------------------------------------------------------------------------------- the averager


@dataclass
class GroupOutcome:
    """What a robust step returns: the trusted members' gathered data and the peers caught misbehaving."""

    gathered: dict[str, Any]
    """Peer id (base58) -> the `gather` it sent, for members whose data was used (ourselves included)."""
    rejected: dict[str, str]
    """Peer id (base58) -> why it was rejected in this step."""
    failed_reducers: int = 0
    """Members whose part of the vector kept our local values (they failed, were banned or sent a bad result)."""
    failed_fraction: float = 0.0
    """The share of our vector that kept local values for that reason."""
    bytes_sent: int = 0
    """Serialized all-reduce messages we sent (our parts to reducers, results to senders)."""
    bytes_received: int = 0
    """Serialized all-reduce messages we received."""
    reducer_errors: dict[str, str] = field(default_factory=dict)
    """Peer id (base58) -> why its part failed, for reducers that failed on the way (not the banned or ignored)."""
    allreduce_seconds: float = 0.0
    """From the group's assembly to the end of its all-reduce (the rest of a step is matchmaking)."""


def open_gathered(entry: bytes, peer_id: bytes, prefix: str, swarm_key: SwarmKey | None) -> tuple[int, Any]:
    """(mode, gather) of a member's gathered entry ([bandwidth, mode, [gather, tag]] as hivemind and
    `RobustAverager.step` pack it); ValueError if it is malformed or, with a swarm key, lacks a valid tag."""
    try:
        _bandwidth, mode, user_bytes = MSGPackSerializer.loads(entry)
        payload, tag = MSGPackSerializer.loads(user_bytes)
    except Exception as e:
        raise ValueError(f"malformed gathered data ({type(e).__name__})") from None
    if mode not in _MODES:
        raise ValueError(f"unknown averaging mode {mode!r}")
    if swarm_key is not None and not swarm_key.check_join_tag(prefix, peer_id, tag):
        raise ValueError("no valid swarm key tag")
    return mode, payload


class RobustAverager(DecentralizedAverager):
    """A DecentralizedAverager that checks its groupmates (see the module docstring) and refuses banned peers.

    `gather` values travel with this peer's swarm-key tag; `step(...).result()` is a `GroupOutcome`.
    Bans and the expected group are set from the parent process with `set_peers` before a step.

    `updates=True` averages updates (see the module docstring): the tensors hold what to send, and after a step
    the value every member applied. `differences=True`: after a step, the tensors hold the average minus what they
    held before (hivemind's runner yields exactly that); a step whose all-reduce has begun writing them is then
    never tried again, since a retry would average differences as if they were weights. With `error_feedback` and
    a lossy compression, `residual` (shared memory, shaped like the tensors) holds what compression dropped in the
    last all-reduce; whoever fills the tensors for the next step adds it (`GroupAverager` does).
    """

    def run(self) -> None:
        # the averager process dies with the node's process, even when that one is SIGKILLed; named by its group
        bind_to_parent(f"spes-{self.prefix.rsplit('_', 1)[-1]}")
        released = release_inherited_tensors(keep=[*self._averaged_tensors, *(self.residual or ())])
        logger.debug(f"averager {self.prefix}: gave back {released / 2**20:.0f} MiB of inherited tensors")
        # hivemind builds its matchmaking from this module-level name; in this (child) process, ours
        hivemind.averaging.averager.Matchmaking = SpesMatchmaking
        super().run()

    def __init__(
        self,
        averaged_tensors: Sequence[torch.Tensor],
        dht,
        *,
        prefix: str,
        swarm_key: SwarmKey | None = None,
        policy: RobustPolicy = RobustPolicy(),
        updates: bool = False,
        differences: bool = False,
        error_feedback: bool = True,
        start: bool = True,
        **kwargs,
    ):
        if updates and differences:
            raise ValueError("differences are of averaged weights, not of averaged updates")
        # hivemind moves the tensors to shared memory: ours are there already, with no name (`procs.shared_empty`)
        with kept_in_place():
            super().__init__(averaged_tensors, dht, prefix=prefix, start=False, **kwargs)
        self.policy, self.swarm_key, self.updates = policy, swarm_key, updates
        self.differences = differences
        self._step_control = None
        lossy = not isinstance(self.allreduce_kwargs.get("compression"), NoCompression)
        self.residual: tuple[torch.Tensor, ...] | None = None
        if updates and error_feedback and lossy:
            # before the averager process starts, so that it shares these buffers with us
            dtype = self._averaged_tensors[0].dtype
            self.residual = tuple(t.zero_() for t in shared_like(self._averaged_tensors, dtype))
        self._banned: frozenset[PeerID] = frozenset()
        self._tag = swarm_key.join_tag(prefix, self.peer_id.to_bytes()) if swarm_key is not None else b""
        self.registration = Registration()
        """Where the averager process registers its RPCs with p2pd (`release_handlers`)."""
        if start:
            self.run_in_background(await_ready=True)

    async def add_p2p_handlers(self, p2p, wrapper=None, *, namespace=None, balanced=False) -> None:
        # in the averager process, as it starts: noted first, so that a registration is never left unnoted
        self.registration.record(p2p)
        await super().add_p2p_handlers(p2p, wrapper, namespace=namespace, balanced=balanced)

    def release_handlers(self) -> int:
        """Once the averager process is gone (killed, or ended by a restart): remove the RPCs it registered with the
        node's p2pd, so that a new averager of the same group can register them (`handlers`). Returns how many."""
        if self.is_alive():
            raise RuntimeError(f"averager {self.prefix}: its process still runs and serves its handlers")
        self._collect_rpc_handlers()
        names = [
            self._get_handle_name(self.prefix, handler.method_name)
            for handler in self._rpc_handlers
            if handler.stream_input or handler.stream_output
        ]
        return release_stream_handlers(self.registration, names)

    def run_in_background(self, await_ready: bool = True, timeout: float | None = None) -> None:
        # hivemind sets SIGINT to "ignore" in the calling process before it forks the averager; the node handles
        # SIGINT (Ctrl-C) itself, so its handler comes back once the child has started
        main = threading.current_thread() is threading.main_thread()
        previous = signal.getsignal(signal.SIGINT) if main else None
        try:
            super().run_in_background(await_ready=await_ready, timeout=timeout)
        finally:
            if main and previous is not None:
                signal.signal(signal.SIGINT, previous)

    async def _shutdown(self, timeout: float | None) -> None:
        # hivemind's _shutdown calls finalize() on the futures of its running groups, which have no such method (and
        # a runner's finalize returns nothing to wait for): a node stopped during an all-reduce logged an
        # AttributeError traceback from each such averager. Cancel the groups' all-reduces instead.
        if not self.client_mode:
            try:
                await self.remove_p2p_handlers(self._p2p, namespace=self.prefix)
            except OSError as e:
                # p2pd is gone (its DHT process was killed, and the node is stopping for it): so are the handlers
                logger.debug(f"{self.prefix}: handlers not removed, p2pd does not answer: {e}")
        cancel_running_groups(self._running_groups.values())

    def step(self, gather: Any = None, **kwargs):
        return super().step(gather=[gather, self._tag], **kwargs)

    async def _step(self, *, step, future_for_init) -> None:
        # in the averager process: the step whose all-reduce may write differences (see `differences`)
        self._step_control = step
        try:
            await super()._step(step=step, future_for_init=future_for_init)
        finally:
            if self._step_control is step:
                self._step_control = None

    def set_peers(self, banned: Collection[str], expected: Collection[str] = ()) -> None:
        """For the next step on: peers (base58) to refuse and ignore, and the peers expected in our group (a group
        we lead begins its all-reduce as soon as all of them have joined; see `SpesMatchmaking`)."""
        self._outer_pipe.send(("_set_peers", [sorted(banned), sorted(expected)], {}))

    async def _set_peers(self, banned: list[str], expected: list[str]) -> None:
        self._banned = frozenset(PeerID.from_base58(peer) for peer in banned)
        if isinstance(getattr(self, "_matchmaking", None), SpesMatchmaking):
            self._matchmaking.banned = self._banned
            self._matchmaking.expected = (
                frozenset(PeerID.from_base58(peer) for peer in expected) - self._banned
            )

    def _open(self, peer: PeerID, entry: bytes) -> tuple[int, Any]:
        return open_gathered(entry, peer.to_bytes(), self.prefix, self.swarm_key)

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        reason = "banned" if context.remote_id in self._banned else None
        if reason is None:
            try:
                self._open(context.remote_id, request.gather)
            except ValueError as e:
                reason = str(e)
        if reason is not None:
            logger.debug(f"refusing {context.remote_id} in group {self.prefix}: {reason}")
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for response in super().rpc_join_group(request, context):
            yield response
        # the follower closes once it has read our last answer (hivemind's does, in any case): closing first could
        # lose that answer, a "begin" among them, and the follower would look on for a group it is in (`streams`)
        await streams.linger()

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """hivemind's, except for a group this averager has not registered. hivemind waits, with no timeout, until
        the averager registers some group: right for a member whose leader's "begin" is still on its way, wrong for
        one that gave up on that leader (its wait for the leader's answer ran out just as the leader began the group
        with it) and goes on looking for another. Every member of that group then waited on it for their
        all-reduce's timeouts. Here the wait lasts while a group may still come to us, and a part for a group that
        cannot is refused (`BAD_GROUP_ID`): its sender keeps its own values there at once."""
        request = await anext(stream)
        if not await self._group_may_still_come(request.group_id):
            logger.debug(f"refusing a part from {context.remote_id} for a group we are not in")
            yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
            return
        async for message in super().rpc_aggregate_part(achain(as_aiter(request), stream), context):
            yield message

    async def _group_may_still_come(self, group_id: bytes) -> bool:
        """Wait while a group that is not registered yet may still be ours: while a join request of ours is in
        flight (or one to us is being answered), a leader has accepted us, or a group is assembled and about to be
        registered. False once none of these has held for `UNKNOWN_GROUP_GRACE` seconds; True once the group is
        registered, or once hivemind's own wait would end (any group registered, or no step looking for one), for
        hivemind to answer as it does."""
        matchmaking = self._matchmaking
        loop = asyncio.get_running_loop()
        quiet_since = None
        while group_id not in self._running_groups and not self._pending_groups_registered.is_set():
            busy = (
                matchmaking.lock_request_join_group.locked()
                or matchmaking.current_leader is not None
                or matchmaking.assembled_group.done()
            )
            if busy:
                quiet_since = None
            elif quiet_since is None:
                quiet_since = loop.time()
            elif loop.time() - quiet_since >= UNKNOWN_GROUP_GRACE:
                return False
            await asyncio.sleep(UNKNOWN_GROUP_POLL)
        return True

    async def _aggregate_with_group(
        self, group_info: GroupInfo, min_vector_size: int, **kwargs
    ) -> GroupOutcome:
        loop = asyncio.get_running_loop()
        if loop.get_exception_handler() is None:
            loop.set_exception_handler(quiet_cancelled)
        rejected: dict[PeerID, str] = {}
        payloads: dict[PeerID, Any] = {}
        entries = []
        for peer, entry in zip(group_info.peer_ids, group_info.gathered):
            try:
                mode, payloads[peer] = self._open(peer, entry)
            except ValueError as e:
                mode = AveragingMode.CLIENT.value
                if peer != self.peer_id:
                    rejected[peer] = str(e)
            entries.append(self.serializer.dumps([None, mode, self.serializer.dumps(None)]))
        ignored = frozenset(rejected) | (self._banned & frozenset(group_info.peer_ids))
        sanitized = GroupInfo(group_info.group_id, group_info.peer_ids, tuple(entries))
        report: dict[str, Any] = {}
        await super()._aggregate_with_group(
            sanitized,
            min_vector_size,
            ignored=ignored,
            on_reject=rejected.setdefault,
            report=report,
            **kwargs,
        )
        return GroupOutcome(
            failed_reducers=int(report.get("reducers", 0)),
            failed_fraction=float(report.get("fraction", 0.0)),
            bytes_sent=int(report.get("bytes_sent", 0)),
            bytes_received=int(report.get("bytes_received", 0)),
            reducer_errors=dict(report.get("reducer_errors", {})),
            allreduce_seconds=float(report.get("seconds", 0.0)),
            gathered={
                peer.to_base58(): payloads[peer]
                for peer in group_info.peer_ids
                if peer in payloads and peer not in ignored and peer not in rejected
            },
            rejected={peer.to_base58(): reason for peer, reason in rejected.items()},
        )

    async def _run_allreduce_inplace_(
        self,
        tensors: Sequence[torch.Tensor],
        group_info: GroupInfo,
        group_id: bytes | None = None,
        *,
        ignored: Collection[PeerID] = (),
        on_reject: Callable[[PeerID, str], Any] = lambda peer, reason: None,
        report: dict[str, Any] | None = None,
        **kwargs,
    ):
        # hivemind's _run_allreduce_inplace_ with RobustAllReduceRunner (this averager is never auxiliary); with
        # updates, the runner yields the values to apply, not differences
        group_id = group_info.group_id if group_id is None else group_id
        began = time.perf_counter()
        runner = RobustAllReduceRunner(
            p2p=self._p2p,
            servicer_type=type(self),
            prefix=self.prefix,
            tensors=tensors,
            group_id=group_id,
            ordered_peer_ids=group_info.peer_ids,
            policy=self.policy,
            ignored=ignored,
            on_reject=on_reject,
            updates=self.updates,
            residual=self.residual,
            **kwargs,
        )
        assert group_id in self._running_groups, f"group {group_id} was not registered"
        self._running_groups[group_id].set_result(runner)
        logger.debug(f"all-reduce of {self.prefix} with {len(group_info.peer_ids)} peers begins")
        async for tensor, update in azip(as_aiter(*tensors), runner):
            if self.updates:
                tensor.copy_(update)
            elif self.differences:
                if self._step_control is not None:
                    # hivemind 1.1.12 reads a step's retry permission from here, in this process
                    self._step_control._allow_retries = False
                tensor.copy_(update)
                if self._averaging_alpha != 1.0:
                    tensor.mul_(self._averaging_alpha)
            else:
                tensor.add_(update, alpha=self._averaging_alpha)
            self.last_updated = get_dht_time()
            self._state_updated.set()
        await runner.wait_served(self.next_chunk_timeout or 5.0)
        if report is not None:
            container = runner.tensor_part_container
            report["reducers"] = len(container.failed_reducers)
            report["fraction"] = container.failed_size / max(1, sum(t.numel() for t in tensors))
            report["bytes_sent"], report["bytes_received"] = runner.bytes_sent, runner.bytes_received
            report["reducer_errors"] = {peer.to_base58(): why for peer, why in runner.reducer_errors.items()}
            report["seconds"] = time.perf_counter() - began


def quiet_cancelled(loop: asyncio.AbstractEventLoop, context: dict) -> None:
    """The averager loop's exception handler: an all-reduce cancelled part-way (its timeout, a member gone) can
    leave one of hivemind's futures holding a CancelledError that nothing reads, which asyncio would log as an
    error with a traceback when the future is collected. The round reports the failed all-reduce already; that one
    goes to the debug log, anything else to asyncio's default handler."""
    if isinstance(context.get("exception"), asyncio.CancelledError):
        logger.debug(f"{context.get('message')}: {context.get('future')!r}")
        return
    loop.default_exception_handler(context)


def cancel_running_groups(groups: Iterable[asyncio.Future]) -> int:
    """Cancel the all-reduces of an averager's running groups (futures of their runners, some not set yet);
    returns how many runners were finalized."""
    finalized = 0
    for future in list(groups):
        if not future.done():
            future.cancel()
        elif not future.cancelled() and future.exception() is None:
            future.result().finalize(cancel=True)
            finalized += 1
    return finalized


class SpesMatchmaking(Matchmaking):
    """hivemind's matchmaking with three changes:

    - a banned peer is never asked to lead our group (as a leader we refuse them in
      `RobustAverager.rpc_join_group`): a node that caught a peer cheating meets it in neither role;
    - a leader's "begin all-reduce" that arrives after our search already ended (our group was assembled, or the
      search timed out or was cancelled, in the same turn of the event loop) is declined instead of failing
      hivemind's assertion in a background task, which logged a traceback and ended the search the same way.
      The leader's all-reduce goes on without us, as it does for any member that does not show up;
    - a group we lead begins as soon as every `expected` peer (the live holders that the DHT records name) has
      joined, instead of always waiting out the matchmaking window. hivemind begins a group once it holds
      `target_group_size` members; here that size exists only at the moment the expected peers are all in, so
      nobody is ever refused for a full group: a stranger that joins first cannot crowd an expected peer out, and
      a peer that the records do not name yet (a node that just joined) is welcome until the group begins. When
      an expected peer does not come, the group waits out the window as before.
    """

    banned: frozenset[PeerID] = frozenset()
    expected: frozenset[PeerID] = frozenset()

    @property
    def target_group_size(self) -> int | None:
        """The group's size once every expected peer has joined us, else None (hivemind's "no target")."""
        followers = getattr(self, "current_followers", None)
        if not self.expected or followers is None or not self.expected <= followers.keys() | {self.peer_id}:
            return None
        return len(followers) + 1

    @target_group_size.setter
    def target_group_size(self, value: int | None) -> None:
        if value is not None:  # hivemind sets its constructor's argument, which RobustAverager never gives
            raise ValueError("SpesMatchmaking sizes groups by the expected peers, not by target_group_size")

    async def _request_join_group(self, leader: PeerID):
        if leader in self.banned:
            logger.debug(f"not joining the group of banned peer {leader}")
            return None
        return await super()._request_join_group(leader)

    async def follower_assemble_group(self, leader: PeerID, msg):
        if self.assembled_group.done():
            logger.debug(f"{leader} began an all-reduce with us after our search had ended: not joining it")
            return None
        return await super().follower_assemble_group(leader, msg)


# ---------------------------------------------------------------------------------------------- bans and faults


@dataclass(frozen=True)
class Ban:
    reason: str
    until: float


class BanList:
    """Peers caught sending bad data, each ignored until its ban expires; shared by a node's averagers."""

    def __init__(self, seconds: float = BAN_SECONDS, max_peers: int = MAX_BANS):
        self.seconds, self.max_peers = seconds, max_peers
        self._bans: dict[str, Ban] = {}
        self._lock = threading.Lock()

    def ban(self, peer: str, reason: str) -> bool:
        """Ban (or re-ban) `peer`; True if it was not banned before."""
        with self._lock:
            self._prune()
            new = peer not in self._bans
            if new and len(self._bans) >= self.max_peers:
                del self._bans[min(self._bans, key=lambda p: self._bans[p].until)]
            self._bans[peer] = Ban(reason, time.monotonic() + self.seconds)
            return new

    def active(self) -> dict[str, str]:
        """Banned peer -> reason."""
        with self._lock:
            self._prune()
            return {peer: ban.reason for peer, ban in self._bans.items()}

    def __contains__(self, peer: object) -> bool:
        return peer in self.active()

    def _prune(self) -> None:
        now = time.monotonic()
        for peer in [p for p, ban in self._bans.items() if ban.until <= now]:
            del self._bans[peer]
