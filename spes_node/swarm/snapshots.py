"""What a node serves to others: snapshots of its state after each round, published on its `StateServer`.

Parts: "shared" (shared parameters), "shard:<j>" for each shard the node trains, "copy:<j>" for the frozen copy
it keeps of every other shard, and "premerge:<j>" for an own shard's weights before a merge warm-up (served for
that round only: slower replicas fetch it after our merge). Snapshots are CPU copies at wire precision, never
views of the live weights.

With `updates`, a holder also serves "update:<j>" for each own shard: the change of the shard since the round
before, int8 blockwise (`codecs.BlockwiseInt8`), so that a node whose frozen copy is one round old refreshes it
for about half the bytes of the whole shard at fp16. The update is taken against the holder's published chain
(what a follower that applied every update holds, `encode_update`), not against the previous weights, so a
follower's error stays within one round's rounding however many rounds it follows.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Collection, Mapping

import torch
from hivemind.compression import CompressionInfo
from hivemind.proto import runtime_pb2

from spes_node.aio import LoopThread
from spes_node.swarm.codecs import WIRE_CODECS
from spes_node.swarm.transfer import Snapshot, StateServer

Tensors = Mapping[str, torch.Tensor]


class FrozenShard:
    """A frozen shard as the publisher sees it: its buffers (whose identity tells whether its weights changed)
    and how to read its weights as fp32 tensors (which may cost a dequantisation)."""

    def __init__(self, buffers: list[torch.Tensor], read: Callable[[], Tensors]):
        self.buffers, self.read = buffers, read


class SnapshotPublisher:
    """Publishes a node's snapshots on its state server, copying a frozen shard again only when it changed.

    With `updates`, each own shard also has an update chain (see the module docstring): the state a follower of
    our updates holds, at `dtype`. It costs one more copy of the own shards at `dtype` (none in a round where the
    chain restarted: it is then the served snapshot itself), plus the served update at about 1 byte per weight.
    """

    def __init__(self, server: StateServer, loop: LoopThread, dtype: torch.dtype, updates: bool = False):
        self.server, self.loop, self.dtype, self.updates = server, loop, dtype, updates
        self._frozen: dict[int, tuple[list, dict[str, torch.Tensor]]] = {}
        """Served copies of frozen shards, with weak references to the buffers they were copied from."""
        self._chains: dict[int, tuple[int, dict[str, torch.Tensor]]] = {}
        """Own shard -> (round, the state a follower of our updates holds at that round)."""

    def frozen_copy(self, shard: int, frozen: FrozenShard) -> dict[str, torch.Tensor]:
        """A CPU copy of a frozen shard, made again only when the shard's weights changed.

        Frozen weights are never changed in place: a refresh or merge stores new buffers (`ExpertShard.load_dense`),
        so the buffers' identity tells whether the last copy is still current. Weak references, so that the cache
        neither keeps replaced buffers alive nor mistakes a new buffer at a reused address for the old one.
        """
        cached = self._frozen.get(shard)
        if cached is not None:
            refs, tensors = cached
            if len(refs) == len(frozen.buffers) and all(r() is b for r, b in zip(refs, frozen.buffers)):
                return tensors
        tensors = cpu_copy(frozen.read(), self.dtype)
        self._frozen[shard] = ([weakref.ref(b) for b in frozen.buffers], tensors)
        return tensors

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
        the own shards in `premerge` also as "premerge:<j>" (this round's merge inputs). `restart`: the own shards'
        weights changed within a round already published (a merge, weights taken from the swarm): their update
        chains start again from these weights, and followers take the whole shard next."""
        parts = {"shared": cpu_copy(shared, self.dtype)}
        for shard, tensors in own.items():
            self._frozen.pop(shard, None)
            parts[f"shard:{shard}"] = copied = cpu_copy(tensors, self.dtype)
            self._run(self.server.withdraw(f"copy:{shard}"))
            if shard in premerge:
                parts[f"premerge:{shard}"] = copied
            else:
                self._withdraw_stale_premerge(shard, round_)
            if self.updates:
                self._advance_chain(shard, round_, copied, restart, parts)
        for shard, frozen_shard in frozen.items():
            parts[f"copy:{shard}"] = self.frozen_copy(shard, frozen_shard)
            self._chains.pop(shard, None)
            for part in ("shard", "premerge", "update"):
                self._run(self.server.withdraw(f"{part}:{shard}"))
        for part, tensors in parts.items():
            self._run(self.server.publish(part, Snapshot(round_, tensors)))

    def _advance_chain(
        self, shard: int, round_: int, served: dict[str, torch.Tensor], restart: bool, parts: dict
    ) -> None:
        """Add this round's "update:<j>" to `parts` when the chain is at the round before; keep the served one when
        the round is published again unchanged; otherwise start the chain again (and serve no update)."""
        chain = self._chains.get(shard)
        if chain is not None and not restart and chain[0] == round_:
            return
        if chain is not None and not restart and chain[0] == round_ - 1:
            parts[f"update:{shard}"], advanced = encode_update(chain[1], served, self.dtype)
            self._chains[shard] = (round_, advanced)
            return
        self._chains[shard] = (round_, served)
        self._run(self.server.withdraw(f"update:{shard}"))

    def _withdraw_stale_premerge(self, shard: int, round_: int) -> None:
        """A premerge snapshot lives for its round only (slower replicas still fetch it after our merge)."""
        stale = self.server.snapshots.get(f"premerge:{shard}")
        if stale is not None and stale.round < round_:
            self._run(self.server.withdraw(f"premerge:{shard}"))

    def _run(self, coro) -> None:
        self.loop.run(coro)


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
