"""What a node serves to others: snapshots of its state after each round, published on its `StateServer`.

Parts: "shared" (shared parameters), "shard:<j>" for each shard the node trains, "copy:<j>" for the frozen copy
it keeps of every other shard, and "premerge:<j>" for an own shard's weights before a merge warm-up (served for
that round only: slower replicas fetch it after our merge). In a merge round, "shard:<j>" of the round is the
merged shard only: a node that joins or catches up then never takes the weights before the merge as the round's.
Snapshots of trained weights are CPU copies at wire precision, never views of the live weights; frozen copies are
read from their own buffers when asked for, since those are never changed in place (`transfer.Deferred`).

With `updates`, a holder also serves "update:<j>" for each own shard: the change of the shard since the last
refresh (`every` rounds before: the swarm's `refresh_every`), int8 blockwise (`codecs.BlockwiseInt8`), so that a
node whose frozen copy is of the last refresh brings it up to date for about half the bytes of the whole shard at
fp16, however many rounds apart refreshes are. The chain steps on the refresh rounds (multiples of `every`), so
that every holder's chain and every follower's copy meet on the same rounds. The update is taken against the
holder's published chain (what a follower that applied every update holds, `encode_update`), not against the
previous weights, so a follower's error stays within one refresh's rounding however many refreshes it follows.

Encoding an update (a difference, a quantisation and the chain's next step over the whole shard) takes a CPU a
while: seconds at spes-7b's shards. It runs on a thread of its own, after `publish` has returned, so the round's
training does not wait for it; "update:<j>" is published when it is ready, and a follower asking for it meanwhile
is answered once it is (`StateServer` waits for a part of the round asked for).
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from functools import partial

import torch
from hivemind.compression import CompressionInfo
from hivemind.proto import runtime_pb2

from spes_node.aio import LoopThread
from spes_node.swarm.codecs import WIRE_CODECS
from spes_node.swarm.transfer import Deferred, Snapshot, StateServer

Tensors = Mapping[str, torch.Tensor]

logger = logging.getLogger(__name__)


class FrozenShard:
    """A frozen shard as the publisher sees it: for each of its tensors, the buffers its weights are stored in
    (never changed in place) and how to read them as a CPU tensor of a given dtype (`read(*buffers, dtype=...)`,
    which may cost a dequantisation)."""

    def __init__(self, buffers: Mapping[str, Sequence[torch.Tensor]], read: Callable[..., torch.Tensor]):
        self.buffers, self.read = buffers, read


class SnapshotPublisher:
    """Publishes a node's snapshots on its state server.

    With `updates`, each own shard also has an update chain (see the module docstring): the state a follower of
    our updates holds, at `dtype`, stepping every `every` rounds. It costs one more copy of the own shards at
    `dtype` (none in a round where the chain restarted: it is then the served snapshot itself), plus the served
    update at about 1 byte per weight.
    """

    def __init__(
        self, server: StateServer, loop: LoopThread, dtype: torch.dtype, updates: bool = False, every: int = 1
    ):
        if every < 1:
            raise ValueError(f"every: must be at least 1, got {every}")
        self.server, self.loop, self.dtype, self.updates, self.every = server, loop, dtype, updates, every
        self._chains: dict[int, tuple[int, Chain]] = {}
        """Own shard -> (round, the state a follower of our updates holds at that round, or its encoding)."""
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._encoder: threading.Thread | None = None
        """Encodes updates, one at a time, in order; a daemon thread, so that an encoding in flight never holds the
        node's exit."""
        self._closed = False
        self._lock = threading.Lock()
        """Held while the chains change, and while an encoded update is published: an update whose chain ended
        meanwhile is never served."""

    def frozen_part(self, frozen: FrozenShard) -> dict[str, Deferred]:
        """A frozen shard served from its own buffers, read one tensor at a time when asked for: no copy of it is
        kept (at spes-7b, the frozen experts are 9 GiB at bf16). Its buffers are never changed in place, so what
        is served is this round's state while they live; once a refresh or merge replaces them, the part is
        withdrawn until the next publish."""
        return {
            name: Deferred(buffers, partial(frozen.read, dtype=self.dtype))
            for name, buffers in frozen.buffers.items()
        }

    def publish(
        self,
        round_: int,
        shared: Tensors,
        own: Mapping[int, Tensors],
        frozen: Mapping[int, FrozenShard],
        premerge: Collection[int] = (),
        restart: bool = False,
    ) -> None:
        """Serve the state of round `round_`: the shared parameters, the own shards and copies of the frozen ones;
        the own shards in `premerge` as "premerge:<j>" (this round's merge inputs) instead of "shard:<j>", which the
        merged weights' publish serves. `restart`: the own shards' weights changed within a round already published
        (a merge, weights taken from the swarm): their update chains start again from these weights, and followers
        take the whole shard next."""
        with self._lock:
            self._publish(round_, shared, own, frozen, premerge, restart)

    def _publish(self, round_, shared, own, frozen, premerge, restart) -> None:
        # each part replaces the one before it as soon as it is copied, after the parts that go are withdrawn: the
        # old snapshot is given up part by part while the new one is made, instead of all of both at once
        for shard, frozen_shard in frozen.items():
            self._chains.pop(shard, None)
            for part in ("shard", "premerge", "update"):
                self._run(self.server.withdraw(f"{part}:{shard}"))
            self._put(round_, f"copy:{shard}", self.frozen_part(frozen_shard))
        self._put(round_, "shared", cpu_copy(shared, self.dtype))
        for shard, tensors in own.items():
            self._run(self.server.withdraw(f"copy:{shard}"))
            copied = cpu_copy(tensors, self.dtype)
            if shard in premerge:
                # not the round's "shard:<j>": that is the merged shard, published after the merge. Until then
                # the one before stays served, and a node taking the state of this round waits for the merged one
                self._put(round_, f"premerge:{shard}", copied)
                continue
            self._put(round_, f"shard:{shard}", copied)
            self._withdraw_stale_premerge(shard, round_)
            if self.updates:
                self._advance_chain(shard, round_, copied, restart)

    def _put(self, round_: int, part: str, tensors) -> None:
        self._run(self.server.publish(part, Snapshot(round_, tensors)))

    def _advance_chain(self, shard: int, round_: int, served: dict[str, torch.Tensor], restart: bool) -> None:
        """On a refresh round (a multiple of `every`), encode this round's "update:<j>" (served once ready, see
        `_encode`) when the chain is at the refresh before, or start the chain again from `served` (serving no
        update) when it is not. Between refresh rounds, and when a round is published again unchanged, the chain
        and its served update stay. `restart` (the weights changed within a published round) ends the chain: it
        starts again at the next refresh round, so that its rounds stay those followers refresh on."""
        chain = None if restart else self._chains.get(shard)
        refresh_round = round_ % self.every == 0
        if chain is not None and chain[0] == round_:
            return
        if chain is not None and refresh_round and chain[0] == round_ - self.every:
            # the update of the round before stops being served: a follower asks for this round's
            self._run(self.server.withdraw(f"update:{shard}"))
            encoding = self._submit(self._encode, shard, round_, chain[1], served)
            self._chains[shard] = (round_, encoding)
            return
        if chain is not None and not refresh_round and chain[0] > round_ - self.every:
            return
        self._run(self.server.withdraw(f"update:{shard}"))
        if refresh_round:
            self._chains[shard] = (round_, served)
        else:
            self._chains.pop(shard, None)

    def _encode(self, shard: int, round_: int, base: Chain, served: dict[str, torch.Tensor]) -> dict:
        """On the encoder's thread: the update of `round_` from the chain's state `base`; served at once unless
        the chain moved on meanwhile. Returns the chain's next state."""
        try:
            update, advanced = encode_update(_chain_state(base), served, self.dtype)
        except Exception as e:
            # followers take the whole shard; the chain starts again at the next refresh round
            logger.warning(f"update of shard {shard} for round {round_} not encoded: {type(e).__name__}: {e}")
            update, advanced = None, None
        if self._closed:  # the node is stopping: nothing more is served
            return advanced
        with self._lock:
            chain = self._chains.get(shard)
            # still this encoding's chain: a restart replaces it by weights, a later refresh by another round
            if chain is not None and chain[0] == round_ and isinstance(chain[1], concurrent.futures.Future):
                if update is None:
                    del self._chains[shard]
                else:
                    try:  # bounded: the node's loop may be stopping
                        self.loop.run(self.server.publish(f"update:{shard}", Snapshot(round_, update)), 10.0)
                    except Exception as e:
                        logger.debug(f"update of shard {shard} for round {round_} not served: {e!r}")
        return advanced

    def _submit(self, fn: Callable, *args) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self._closed:
            future.cancel()
            return future
        self._jobs.put((future, fn, args))
        if self._encoder is None:
            self._encoder = threading.Thread(target=self._work, name="spes-update", daemon=True)
            self._encoder.start()
        return future

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn, args = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as e:
                    future.set_exception(e)

    def flush(self) -> None:
        """Wait until every update being encoded is served (or dropped, its chain having ended)."""
        if self._encoder is not None and not self._closed:
            self._submit(lambda: None).result()

    def shutdown(self) -> None:
        """Encode nothing more (what is being encoded finishes on its daemon thread, and is not waited for)."""
        self._closed = True
        self._jobs.put(None)

    def _withdraw_stale_premerge(self, shard: int, round_: int) -> None:
        """A premerge snapshot lives for its round only (slower replicas still fetch it after our merge)."""
        stale = self.server.snapshots.get(f"premerge:{shard}")
        if stale is not None and stale.round < round_:
            self._run(self.server.withdraw(f"premerge:{shard}"))

    def _run(self, coro) -> None:
        self.loop.run(coro)


Chain = dict[str, torch.Tensor] | concurrent.futures.Future
"""An update chain's state at its round, or the encoding that computes it."""


def _chain_state(chain: Chain) -> dict[str, torch.Tensor]:
    return chain.result() if isinstance(chain, concurrent.futures.Future) else chain


def cpu_copy(tensors: Tensors, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    return {name: t.detach().to("cpu", dtype, copy=True) for name, t in tensors.items()}


def encode_update(
    base: Tensors, target: Tensors, dtype: torch.dtype
) -> tuple[dict[str, runtime_pb2.Tensor], dict[str, torch.Tensor]]:
    """(the int8 update from `base` towards `target`, serialized as it travels; `base` with it applied, as a
    follower gets it). The follower's distance to `target` is one encoding's rounding, whatever `base` was."""
    codec = WIRE_CODECS["int8"]
    serialized, advanced = {}, {}
    for name, tensor in target.items():
        delta = tensor.float() - base[name].float()
        serialized[name] = codec.compress(delta, CompressionInfo.from_tensor(delta))
        advanced[name] = add_update(base[name], codec.extract(serialized[name]), dtype)
    return serialized, advanced


def add_update(base: torch.Tensor, delta: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One step of an update chain, the same on holder and follower: `base` + `delta` in fp32, rounded to the
    snapshot precision `dtype` (so that both hold the same values bit for bit)."""
    return (base.float() + delta.to(base.device)).to(dtype)
