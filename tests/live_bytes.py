"""Host memory held by tensors, as torch sees it: `LiveBytes` counts the storages created under it while they live,
and the storages of tensors it was told about (`known`) until they are freed, with the peak of the sum."""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensor storages alive under this mode and their peak.

    Storages created under the mode count from their creation; views of them are not new. `known` tensors' storages
    are there before: with `count_known=False` they are only recognised (a view of one is not new), with
    `count_known=True` they count from the start and stop counting when freed (what giving them up saves)."""

    def __init__(self, known: Iterable[torch.Tensor] = (), count_known: bool = False):
        super().__init__()
        self.live: dict[int, int] = {}
        self.known: set[int] = set()
        self.now = self.peak = 0
        for tensor in known:
            storage = tensor.untyped_storage()
            pointer = storage.data_ptr()
            if not pointer or pointer in self.known or pointer in self.live:
                continue
            if count_known:
                self._track(storage, pointer)
            else:
                self.known.add(pointer)
        self.start = self.peak = self.now

    def _track(self, storage, pointer: int) -> None:
        self.live[pointer] = storage.nbytes()
        self.now += storage.nbytes()
        self.peak = max(self.peak, self.now)
        weakref.finalize(storage, self._free, pointer)

    def _free(self, pointer: int) -> None:
        self.now -= self.live.pop(pointer, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                pointer = storage.data_ptr()
                if pointer and pointer not in self.live and pointer not in self.known:  # views are not new
                    self._track(storage, pointer)
        return out
