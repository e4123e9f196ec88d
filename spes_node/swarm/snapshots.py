"""What a node serves to others: snapshots of its state after each round, published on its `StateServer`.

Parts: "shared" (shared parameters), "shard:<j>" for each shard the node trains, "copy:<j>" for the frozen copy
it keeps of every other shard, and "premerge:<j>" for an own shard's weights before a merge warm-up (served for
that round only: slower replicas fetch it after our merge). Snapshots are CPU copies at wire precision, never
views of the live weights.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Collection, Mapping

import torch

from spes_node.aio import LoopThread
from spes_node.swarm.transfer import Snapshot, StateServer

Tensors = Mapping[str, torch.Tensor]


class FrozenShard:
    """A frozen shard as the publisher sees it: its buffers (whose identity tells whether its weights changed)
    and how to read its weights as fp32 tensors (which may cost a dequantisation)."""

    def __init__(self, buffers: list[torch.Tensor], read: Callable[[], Tensors]):
        self.buffers, self.read = buffers, read


class SnapshotPublisher:
    """Publishes a node's snapshots on its state server, copying a frozen shard again only when it changed."""

    def __init__(self, server: StateServer, loop: LoopThread, dtype: torch.dtype):
        self.server, self.loop, self.dtype = server, loop, dtype
        self._frozen: dict[int, tuple[list, dict[str, torch.Tensor]]] = {}
        """Served copies of frozen shards, with weak references to the buffers they were copied from."""

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
    ) -> None:
        """Serve the state of round `round_`: the shared parameters, the own shards and copies of the frozen ones;
        the own shards in `premerge` also as "premerge:<j>" (this round's merge inputs)."""
        parts = {"shared": cpu_copy(shared, self.dtype)}
        for shard, tensors in own.items():
            self._frozen.pop(shard, None)
            parts[f"shard:{shard}"] = copied = cpu_copy(tensors, self.dtype)
            self._run(self.server.withdraw(f"copy:{shard}"))
            if shard in premerge:
                parts[f"premerge:{shard}"] = copied
            else:
                self._withdraw_stale_premerge(shard, round_)
        for shard, frozen_shard in frozen.items():
            parts[f"copy:{shard}"] = self.frozen_copy(shard, frozen_shard)
            self._run(self.server.withdraw(f"shard:{shard}"))
            self._run(self.server.withdraw(f"premerge:{shard}"))
        for part, tensors in parts.items():
            self._run(self.server.publish(part, Snapshot(round_, tensors)))

    def _withdraw_stale_premerge(self, shard: int, round_: int) -> None:
        """A premerge snapshot lives for its round only (slower replicas still fetch it after our merge)."""
        stale = self.server.snapshots.get(f"premerge:{shard}")
        if stale is not None and stale.round < round_:
            self._run(self.server.withdraw(f"premerge:{shard}"))

    def _run(self, coro) -> None:
        self.loop.run(coro)


def cpu_copy(tensors: Tensors, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    return {name: t.detach().to("cpu", dtype, copy=True) for name, t in tensors.items()}
