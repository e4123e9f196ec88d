"""Checkpoints in the background: when one is due, what it holds, and the thread that writes it.

The training thread only takes a snapshot (`checkpoint.take_snapshot`: CPU copies) and goes on; one writer thread
serialises it, hashes, fsyncs, renames it into place and prunes (`CheckpointManager.write`). At most one write is
in flight: a checkpoint that comes due meanwhile is skipped, and taken at the first step after the write ends
(it is still due then). A crash mid-write leaves the previous checkpoint intact, as a synchronous write would.

A node that trains on the CPU writes in place instead: its training state is already in host memory, where the
snapshot would be a second copy of it (3.7 GiB at spes-1b), and copying it costs the training thread a good part
of what the write does. The training thread then writes the live tensors itself and waits for the write.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Collection, Hashable
from dataclasses import dataclass

import torch

from spes_node.daemon.checkpoint import CheckpointError, CheckpointManager, Snapshot

logger = logging.getLogger(__name__)

_SHARD_TENSOR = re.compile(r".*\.mlp\.shards\.(\d+)\..*")


def checkpoint_due(
    step: int,
    last_step: int,
    seconds_since: float,
    every_steps: int,
    every_minutes: float,
    round_end: bool = False,
) -> bool:
    """Whether a checkpoint is due at `step`, the last one (or the start of training) at `last_step` and
    `seconds_since` ago.

    Due at every multiple of `every_steps` or every `every_minutes` minutes, whichever comes first (0: that one is
    off); a multiple passed since the last checkpoint (one skipped while another was written) stays due. At a
    round's end: always when `every_minutes` is 0 (small presets checkpoint every round), else only when one of the
    two is due (at large presets a checkpoint every round would cost more than it saves)."""
    if every_steps and step // every_steps > last_step // every_steps:
        return True
    if every_minutes:
        return seconds_since >= every_minutes * 60.0
    return round_end


CHECKPOINT_WRITES = ("auto", "background", "in-place")


def checkpoint_in_place(writes: str, device: torch.device) -> bool:
    """Whether a node writes its checkpoints in place (see the module docstring): `writes` is one of
    `CHECKPOINT_WRITES`; "auto" writes in place on the CPU."""
    if writes not in CHECKPOINT_WRITES:
        raise ValueError(
            f"--checkpoint-writes: expected one of {', '.join(CHECKPOINT_WRITES)}, got {writes!r}"
        )
    return writes == "in-place" or (writes == "auto" and device.type == "cpu")


def frozen_expert_names(names: Collection[str], owned: Collection[int]) -> set[str]:
    """The names among `names` (a model's state dict keys) of expert tensors of shards not in `owned`."""
    owned = {int(s) for s in owned}
    return {name for name in names if (m := _SHARD_TENSOR.fullmatch(name)) and int(m[1]) not in owned}


@dataclass
class WriteRecord:
    """One checkpoint handed to the writer: what it cost the training thread and the writer."""

    step: int
    nbytes: int
    snapshot_seconds: float
    """The training thread's share: taking the snapshot."""
    write_seconds: float | None = None
    """Serialisation, sha256, fsync, rename and pruning on the writer thread; None while in flight."""
    error: str | None = None
    in_place: bool = False
    """Written from the live tensors on the training thread, which waited for the write."""


class CheckpointWriter:
    """Writes snapshots into a `CheckpointManager` on a background thread, one at a time."""

    def __init__(self, manager: CheckpointManager):
        self.manager = manager
        self.key: Hashable | None = None
        """The key of the last checkpoint handed over whose write has not failed (see `submit`)."""
        self.records: list[WriteRecord] = []
        """Every checkpoint handed over, oldest first (the newest 64)."""
        self._thread: threading.Thread | None = None
        self._skipped_while: int | None = None
        self._last: tuple[int, float] | None = None
        """(step, monotonic time) of the last snapshot, or of `start_clock`."""

    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start_clock(self, step: int) -> None:
        """Count the intervals from `step`, now (the start of training), unless a snapshot was taken already."""
        if self._last is None:
            self._last = (step, time.monotonic())

    def due(self, step: int, every_steps: int, every_minutes: float, round_end: bool = False) -> bool:
        """`checkpoint_due` since the last snapshot taken or `start_clock` (else the first call starts the clock)."""
        self.start_clock(step)
        last_step, last_time = self._last
        return checkpoint_due(
            step, last_step, time.monotonic() - last_time, every_steps, every_minutes, round_end
        )

    def submit(
        self, take: Callable[[], Snapshot], key: Hashable | None = None, in_place: bool = False
    ) -> bool:
        """Take a snapshot with `take` (on the caller's thread) and write it in the background; with `in_place`,
        write it on the caller's thread before returning (`take` then need not copy anything).

        Returns False without calling `take` while a write is in flight (logged once per write), or when `key`
        is that of the last checkpoint handed over (the state has not changed since)."""
        if key is not None and key == self.key:
            return False
        if self.busy():
            writing = self.records[-1].step
            if self._skipped_while != writing:
                self._skipped_while = writing
                logger.info(f"checkpoint skipped: step {writing} is still being written")
            return False
        snapshot = take()
        self._last = (snapshot.step, time.monotonic())
        record = WriteRecord(snapshot.step, snapshot.nbytes, snapshot.seconds, in_place=in_place)
        self.records = [*self.records[-63:], record]
        self.key = key
        if in_place:
            self._write(snapshot, record, key)
            return True
        self._thread = threading.Thread(
            target=self._write, args=(snapshot, record, key), name="spes-checkpoint-writer", daemon=True
        )
        self._thread.start()
        return True

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the write in flight, at most `timeout` seconds; True when none is in flight any more."""
        if self._thread is not None:
            self._thread.join(timeout)
        return not self.busy()

    def _write(self, snapshot: Snapshot, record: WriteRecord, key: Hashable | None) -> None:
        start = time.perf_counter()
        try:
            self.manager.write(snapshot)
        except CheckpointError as e:
            # a full disk or a directory gone read-only: the previous checkpoint stays intact (writes go to a
            # temporary directory first); the next checkpoint tries again
            record.error = str(e)
            if self.key == key:
                self.key = None
            try:
                kept = "the previous checkpoint is kept" if self.manager.list() else "no checkpoint yet"
            except CheckpointError:
                kept = "the checkpoint directory cannot be read"
            logger.error(f"checkpoint of step {snapshot.step} not written ({e}); {kept}")
            return
        except Exception as e:
            record.error = f"{type(e).__name__}: {e}"
            if self.key == key:
                self.key = None
            logger.exception(f"checkpoint of step {snapshot.step} not written")
            return
        finally:
            record.write_seconds = time.perf_counter() - start
        if record.in_place:
            logger.info(
                f"checkpoint step {record.step}: {record.nbytes / 2**20:.1f} MiB, written in place in "
                f"{record.write_seconds:.2f}s (training waited)"
            )
            return
        logger.info(
            f"checkpoint step {record.step}: {record.nbytes / 2**20:.1f} MiB, training paused "
            f"{record.snapshot_seconds * 1e3:.0f} ms for the snapshot, written in {record.write_seconds:.2f}s"
        )


def without_frozen_experts(
    tensors: dict[str, torch.Tensor], owned: Collection[int]
) -> dict[str, torch.Tensor]:
    """A model state dict without the expert tensors of shards not in `owned` (the swarm can give them back)."""
    frozen = frozen_expert_names(tensors, owned)
    return {name: t for name, t in tensors.items() if name not in frozen}
