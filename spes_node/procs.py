"""A node's helper processes (hivemind's DHT and averagers, each with p2pd under the DHT) die with the node.

hivemind starts them as daemonic multiprocessing children, which only helps on a clean exit. When the node's
process is killed outright (the OOM killer, `kill -9`), they would go on running, holding memory, ports and a
place in the swarm's DHT. So each child asks the kernel for SIGTERM when its parent dies (PR_SET_PDEATHSIG, Linux)
and answers SIGTERM by killing its own children (p2pd) and exiting.

The node owns their lifetime, so they also leave the node's process group: Ctrl-C in a terminal, or a signal to
the whole group, reaches the node, which still needs its DHT (and p2pd) to withdraw its record and shut down in
order; a child that died with it would leave the node's last DHT calls hanging.

A forked child also starts with the node's memory, shared copy-on-write: each page the node writes afterwards
(every optimiser step writes every trainable weight) or frees (a refresh replaces frozen experts) stays behind in
the child as the child's own copy. An averager forked beside a spes-1b model on a CPU grew to 1.6-2.3 GB that way.
So a helper gives back the tensors it inherited and does not use, first thing (`release_inherited_tensors`).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import math
import multiprocessing
import os
import signal
import sys
import warnings
from collections.abc import Iterable
from pathlib import Path

import hivemind
import torch
from torch.overrides import TorchFunctionMode

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
NAME_CHARS = 15
"""The kernel keeps a process name (comm) of at most 15 bytes."""


def bind_to_parent(name: str | None = None) -> None:
    """Call first thing in a child process: it exits, with its own children, when its parent process dies. `name`
    (at most 15 bytes kept) is what `top`, `ps -o comm` and the OOM killer's log call it: hivemind's helpers are
    forks of the daemon, otherwise all called "python"."""
    if not sys.platform.startswith("linux"):
        return
    if name:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NAME, name.encode()[:NAME_CHARS])
    os.setpgid(0, 0)  # our own process group, which p2pd inherits: group signals for the node pass us by
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: exit_with_children())
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:
        exit_with_children()  # the parent died before the kernel was asked to tell us


def release_inherited_tensors(keep: Iterable[torch.Tensor] = (), min_bytes: int = 1 << 20) -> int:
    """Call first thing in a forked helper: empty the storages of the large CPU tensors it inherited (the node's
    weights, gradients, optimiser state, snapshots), except those of `keep` and those in shared memory, which the
    helper works on. In this process only: the node's own tensors are untouched. Returns the bytes given back."""
    kept = {t.untyped_storage().data_ptr() for t in keep}
    released, seen = 0, set()
    with warnings.catch_warnings():  # isinstance on some module attributes warns of deprecations
        warnings.simplefilter("ignore")
        objects = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    for obj in objects:
        try:
            if obj.device.type != "cpu" or obj.is_sparse or obj.is_shared():
                continue
            storage = obj.untyped_storage()
            pointer, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes < min_bytes or pointer in kept or pointer in seen:
                continue
            seen.add(pointer)
            storage.resize_(0)
        except (RuntimeError, NotImplementedError):
            # no storage of its own (a nested or functional tensor), or not resizable (memory torch does not own,
            # such as a mapped file): left as it is
            continue
        released += nbytes
    return released


def shared_empty(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A flat CPU tensor in shared memory, for a helper forked after it is made (an averager) to work on the same
    pages, that leaves nothing behind however the processes end.

    hivemind shares tensors by file name (torch's "file_system" strategy): each is a file in /dev/shm, which is
    memory, and the files are removed by torch's shm manager process when the last process using them exits. A
    stop that ends the manager as well (systemd's SIGTERM to every process of the service, an `ip netns pids` kill,
    a container runtime's kill in the host's /dev/shm) left them there until the machine restarts: at spes-7b the
    averagers' buffers, several GiB a stop. Made here by file descriptor instead, the memory has no name: the
    kernel frees it with the last process that maps it. A forked helper inherits the mapping; a tensor made here
    is not meant to be sent to another process by pickling.

    The process's sharing strategy stays as it is (`kept_in_place` says why)."""
    storage = torch.UntypedStorage._new_using_fd_cpu(numel * dtype.itemsize)
    return torch.empty(0, dtype=dtype).set_(storage, 0, (numel,), (1,))


class _KeepShared(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.share_memory_ and args[0].is_shared():
            return args[0]
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def kept_in_place():
    """Meanwhile, in this thread, `Tensor.share_memory_` leaves a tensor already in shared memory where it is. Around
    hivemind's averager as it is made: it calls `share_memory_` on every averaged tensor, which by file name (the
    process's strategy) copies a `shared_empty` block into a named file and moves the tensor there.

    Switching the process's strategy to "file_descriptor" meanwhile, as this once did, is not safe: the strategy
    is read by every thread. A DHT call from another thread sends its `MPFuture` to the DHT process by pickling,
    and pickling the future's shared state byte by the other strategy moves the whole block of such bytes (other
    futures' as well) to new memory, copied with the GIL released; a future's state written during the copy is
    lost, and one not yet written reads as whatever the block held. A node then failed to start with an
    `IndexError` from hivemind's `MPFuture._state`. A torch function mode is the thread's own."""
    with _KeepShared():
        yield


def shared_like(tensors: Iterable[torch.Tensor], dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Uninitialised tensors of the shapes of `tensors`, views of one `shared_empty` block (one file descriptor for
    all of them, not one each: spes-7b's groups have hundreds of tensors)."""
    shapes = [t.shape for t in tensors]
    sizes = [math.prod(shape) for shape in shapes]
    return [part.view(shape) for part, shape in zip(shared_empty(sum(sizes), dtype).split(sizes), shapes)]


def exit_with_children() -> None:
    for pid in children(os.getpid()):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    os._exit(0)


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and every process below it (a helper that did not stop when asked)."""
    for victim in [*descendants(pid), pid]:
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pass


def children(pid: int) -> list[int]:
    """Direct children of `pid`, from /proc."""
    return _children_by_parent().get(pid, [])


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children, grandchildren, ...), from one read of /proc."""
    tree, found, todo = _children_by_parent(), [], [pid]
    while todo:
        below = tree.get(todo.pop(), [])
        found.extend(below)
        todo.extend(below)
    return found


def start_time(pid: int) -> int | None:
    """When `pid` started (clock ticks after boot, from /proc), or None if there is no such process: with its pid,
    it names one process, where a pid alone may name a later one that reused it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def kill_if_same(pid: int, started: int | None) -> None:
    """SIGKILL `pid` if it is still the process that started at `started` (see `start_time`)."""
    if started is not None and start_time(pid) == started:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _children_by_parent() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        tree.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry.name))
    return tree


class NodeDHT(hivemind.DHT):
    """`hivemind.DHT` whose process (and its p2pd) dies with the process that started it."""

    _children: tuple[tuple[int, int | None], ...] = ()

    def run(self) -> None:
        bind_to_parent("spes-dht")
        super().run()

    def note_children(self) -> None:
        """Remember the processes the DHT process started (p2pd); in the parent, once the DHT is up."""
        self._children = tuple((pid, start_time(pid)) for pid in children(self.pid))

    def end_orphans(self) -> None:
        """End what the DHT process started, should it have died without doing so: killed outright, it leaves p2pd
        running with no parent, holding its port and its place in the swarm's DHT, after the node has exited."""
        for pid, started in self._children:
            kill_if_same(pid, started)
