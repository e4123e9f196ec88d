"""Background checkpoints: when one is due, the snapshot, the single writer thread, and a crash while it writes."""

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from spes_node.daemon.checkpoint import CheckpointError, CheckpointManager, take_snapshot
from spes_node.daemon.checkpoint_writer import (
    CheckpointWriter,
    checkpoint_due,
    checkpoint_in_place,
    frozen_expert_names,
    without_frozen_experts,
)

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "step, last, seconds, every_steps, every_minutes, round_end, due",
    [
        (5, 0, 0.0, 0, 0.0, False, False),  # nothing set: only round ends
        (5, 0, 1e6, 0, 0.0, True, True),
        (99, 0, 0.0, 100, 0.0, False, False),
        (100, 0, 0.0, 100, 0.0, False, True),
        (100, 99, 0.0, 100, 0.0, False, True),  # at multiples of the interval, not 100 steps after the last
        (150, 100, 0.0, 100, 0.0, False, False),
        (201, 199, 0.0, 100, 0.0, False, True),  # skipped at 200 while another was written: still due
        (200, 200, 0.0, 100, 0.0, False, False),
        (105, 100, 1799.0, 1000, 30.0, False, False),
        (105, 100, 1800.0, 1000, 30.0, False, True),  # time first
        (1000, 990, 10.0, 1000, 30.0, False, True),  # steps first
        (105, 100, 10.0, 1000, 30.0, True, False),  # with a time interval, a round end alone is not enough
        (105, 100, 10.0, 0, 30.0, True, False),
        (0, 0, 1800.0, 0, 30.0, False, True),
    ],
)
def test_checkpoint_due(step, last, seconds, every_steps, every_minutes, round_end, due):
    assert checkpoint_due(step, last, seconds, every_steps, every_minutes, round_end) is due


def test_frozen_expert_names():
    names = [
        "model.embed_tokens.weight",
        "model.layers.0.mlp.gate.weight",
        "model.layers.0.mlp.shards.0.gate_up",
        "model.layers.0.mlp.shards.1.gate_up",
        "model.layers.0.mlp.shards.1.down_scale",
        "model.layers.11.mlp.shards.12.down",
    ]
    assert frozen_expert_names(names, [0]) == {
        "model.layers.0.mlp.shards.1.gate_up",
        "model.layers.0.mlp.shards.1.down_scale",
        "model.layers.11.mlp.shards.12.down",
    }
    assert frozen_expert_names(names, [1, 12]) == {"model.layers.0.mlp.shards.0.gate_up"}
    kept = without_frozen_experts({n: torch.zeros(1) for n in names}, [12])
    assert sorted(kept) == [
        "model.embed_tokens.weight",
        "model.layers.0.mlp.gate.weight",
        "model.layers.11.mlp.shards.12.down",
    ]


def test_snapshot_is_a_copy_at_storage_precision(tmp_path):
    weight = torch.arange(12.0).reshape(3, 4)
    frozen = torch.ones(5, dtype=torch.bfloat16)
    moment = torch.full((3, 4), 2.0)
    tensors = {"w": weight, "tied": weight, "frozen": frozen, "wt": weight.T}
    snapshot = take_snapshot(7, tensors, {"round": 1}, optimizer={"state": {0: {"exp_avg": moment}}})

    assert snapshot.tensors["frozen"].dtype == torch.bfloat16
    assert snapshot.tensors["w"] is snapshot.tensors["tied"]  # tied weights copied once
    assert snapshot.nbytes == 2 * 12 * 4 + 5 * 2 + 12 * 4  # w, wt, frozen, exp_avg
    assert snapshot.seconds >= 0
    with torch.no_grad():  # training goes on after the snapshot
        weight.add_(100.0)
        frozen.zero_()
        moment.zero_()

    CheckpointManager(tmp_path).write(snapshot)
    loaded = CheckpointManager(tmp_path).latest()
    assert torch.equal(loaded.tensors["w"], torch.arange(12.0).reshape(3, 4))
    assert torch.equal(loaded.tensors["tied"], torch.arange(12.0).reshape(3, 4))
    assert torch.equal(loaded.tensors["wt"], torch.arange(12.0).reshape(3, 4).T)
    assert torch.equal(loaded.tensors["frozen"], torch.ones(5, dtype=torch.bfloat16))
    assert torch.equal(loaded.optimizer["state"][0]["exp_avg"], torch.full((3, 4), 2.0))


class GatedManager(CheckpointManager):
    """A manager whose writes wait for `release` (fault injection: a slow disk)."""

    def __init__(self, directory):
        super().__init__(directory)
        self.started, self.release = threading.Event(), threading.Event()

    def write(self, snapshot):
        self.started.set()
        assert self.release.wait(30), "never released"
        return super().write(snapshot)


def snapshot_of(step: int):
    return lambda: take_snapshot(step, {"w": torch.full((4,), float(step))}, {"step": step})


def test_one_write_in_flight_others_skipped(tmp_path, caplog):
    manager = GatedManager(tmp_path)
    writer = CheckpointWriter(manager)
    taken = []

    def counted(step):
        def take():
            taken.append(step)
            return snapshot_of(step)()

        return take

    assert writer.submit(counted(1), key=1)
    assert manager.started.wait(10)
    with caplog.at_level(logging.INFO, logger="spes_node.daemon.checkpoint_writer"):
        assert not writer.submit(counted(2), key=2)
        assert not writer.submit(counted(3), key=3)
    assert taken == [1], "a snapshot was taken while a write was in flight"
    assert caplog.text.count("checkpoint skipped: step 1 is still being written") == 1
    assert writer.busy() and not writer.wait(0.05)

    manager.release.set()
    assert writer.wait(10)
    assert [p.name for p in manager.list()] == ["step-00000001"]
    record = writer.records[-1]
    assert record.step == 1 and record.write_seconds is not None and record.error is None

    assert not writer.submit(counted(1), key=1)  # the same state again
    assert writer.submit(counted(4), key=4) and writer.wait(10)
    assert taken == [1, 4]
    assert manager.latest().step == 4


def test_an_in_place_write_is_done_before_submit_returns_and_copies_nothing(tmp_path, caplog):
    """A node training on the CPU writes its live tensors on the training thread: no copy of the training state
    in the same memory, and the tensors cannot change while they are written, since the trainer is the writer."""
    weights = {"w": torch.arange(8.0)}
    moments = {"by_name": {"w": {"exp_avg": torch.ones(8)}}}
    seen = []

    class Watching(CheckpointManager):
        def write(self, snapshot):
            seen.append(
                (snapshot.tensors["w"].data_ptr(), threading.current_thread() is threading.main_thread())
            )
            return super().write(snapshot)

    writer = CheckpointWriter(Watching(tmp_path))
    take = lambda: take_snapshot(5, weights, {"round": 1}, moments, copy=False)  # noqa: E731
    with caplog.at_level(logging.INFO, logger="spes_node.daemon.checkpoint_writer"):
        assert writer.submit(take, key=5, in_place=True)
    assert not writer.busy(), "nothing left in flight"
    assert seen == [(weights["w"].data_ptr(), True)], "the live tensor, written on the caller's thread"
    assert "written in place" in caplog.text and "(training waited)" in caplog.text
    loaded = CheckpointManager(tmp_path).latest()
    assert loaded.step == 5 and torch.equal(loaded.tensors["w"], weights["w"])
    record = writer.records[-1]
    assert record.in_place and record.write_seconds is not None and record.error is None


@pytest.mark.parametrize(
    "writes, device, in_place",
    [
        ("auto", "cpu", True),
        ("auto", "cuda", False),
        ("background", "cpu", False),
        ("in-place", "cuda", True),
    ],
)
def test_where_checkpoints_are_written(writes, device, in_place):
    assert checkpoint_in_place(writes, torch.device(device)) is in_place


def test_failed_write_is_logged_and_tried_again(tmp_path, caplog):
    class FullDisk(CheckpointManager):
        fail = True

        def write(self, snapshot):
            if self.fail:
                raise CheckpointError("cannot write checkpoint: No space left on device")
            return super().write(snapshot)

    CheckpointManager(tmp_path).save(1, {"w": torch.ones(2)}, {})
    manager = FullDisk(tmp_path)
    writer = CheckpointWriter(manager)
    with caplog.at_level(logging.ERROR, logger="spes_node.daemon.checkpoint_writer"):
        assert writer.submit(snapshot_of(2), key=2)
        assert writer.wait(10)
    assert (
        "checkpoint of step 2 not written" in caplog.text and "the previous checkpoint is kept" in caplog.text
    )
    assert writer.records[-1].error and writer.key is None
    assert manager.latest().step == 1

    manager.fail = False
    assert writer.submit(snapshot_of(2), key=2) and writer.wait(10)
    assert manager.latest().step == 2


def test_due_counts_from_the_start_and_the_last_snapshot(tmp_path):
    writer = CheckpointWriter(CheckpointManager(tmp_path))
    writer.start_clock(100)
    assert writer.due(100 + 1, every_steps=0, every_minutes=0, round_end=True)
    assert not writer.due(100, every_steps=10, every_minutes=0)
    assert not writer.due(109, every_steps=10, every_minutes=0)
    assert writer.due(110, every_steps=10, every_minutes=0)
    assert writer.due(112, every_steps=10, every_minutes=0)  # 110 was not taken
    writer.submit(snapshot_of(112))
    writer.wait(10)
    writer.start_clock(0)  # a snapshot was taken: the clock is not reset
    assert not writer.due(119, every_steps=10, every_minutes=0)
    assert writer.due(120, every_steps=10, every_minutes=0)
    assert not writer.due(119, every_steps=0, every_minutes=1)
    assert writer.due(113, every_steps=0, every_minutes=1e-9)


BACKGROUND_WRITER = """
import sys, torch
from pathlib import Path
from spes_node.daemon.checkpoint import CheckpointManager, take_snapshot
from spes_node.daemon.checkpoint_writer import CheckpointWriter

directory = Path(sys.argv[1])
writer = CheckpointWriter(CheckpointManager(directory))
weights = {"w": torch.arange(1000, dtype=torch.float32)}
writer.submit(lambda: take_snapshot(1, weights, {"round": 1}))
assert writer.wait(60)
weights = {f"block{i}": torch.full((25 * 2**18,), float(i)) for i in range(8)}
writer.submit(lambda: take_snapshot(2, weights, {"round": 2}))
(directory / "submitted").write_text("")  # the training thread is free again while the writer writes
step = 0
while True:  # training goes on
    with torch.no_grad():
        weights["block0"].add_(1.0)
    step += 1
    if step == 10:
        (directory / "training").write_text("")
"""


def test_sigkill_while_the_background_writer_writes_keeps_the_previous_checkpoint(tmp_path):
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
    }
    process = subprocess.Popen([sys.executable, "-c", BACKGROUND_WRITER, str(tmp_path)], env=env)
    try:
        deadline = time.monotonic() + 120
        # the writer has begun step 2 (its temporary directory exists) and the training thread goes on meanwhile
        while not (list(tmp_path.glob(".tmp-step-00000002-*")) and (tmp_path / "training").exists()):
            assert process.poll() is None, "the process exited before step 2 was being written"
            assert time.monotonic() < deadline, "step 2 was never being written while training went on"
            time.sleep(0.001)
        process.send_signal(signal.SIGKILL)
    finally:
        process.kill()
        process.wait()
    assert process.returncode == -signal.SIGKILL
    assert not (tmp_path / "step-00000002").exists(), "the write ended before the kill"

    manager = CheckpointManager(tmp_path)
    checkpoint = manager.latest()
    assert checkpoint.step == 1 and checkpoint.meta == {"round": 1}
    assert torch.equal(checkpoint.tensors["w"], torch.arange(1000, dtype=torch.float32))
    writer = CheckpointWriter(manager)
    assert writer.submit(lambda: take_snapshot(3, {"w": torch.ones(3)}, {"round": 3})) and writer.wait(30)
    assert [p.name for p in manager.list()] == ["step-00000001", "step-00000003"]
    assert not list(tmp_path.glob(".tmp-*"))
