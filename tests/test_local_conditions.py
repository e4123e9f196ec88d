"""Bad local conditions (a read-only or unusable checkpoint directory, a full disk) end in one clear line, or, for a
periodic checkpoint, in an error in the log while the node trains on; never in a traceback.

Tests run as root, for whom file modes mean nothing: read-only places are read-only tmpfs mounts, immutable
files (chattr +i) or paths below a regular file; a full disk is a tiny tmpfs or a tensor writer that leaves a partial
file and raises ENOSPC."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner

import spes_node.daemon.checkpoint
import spes_node.logs
from spes_node.cli import main
from spes_node.config import load_preset
from spes_node.daemon.checkpoint import CheckpointError, CheckpointManager
from spes_node.daemon.checkpoint_writer import CheckpointWriter
from spes_node.daemon.node import Node, NodeOptions
from spes_node.swarm.identity import load_or_create_identity


class DHTStarted(Exception):
    """Raised instead of starting the DHT: a bad checkpoint directory must be refused before."""


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(list(args), capture_output=True, text=True)
    if check and result.returncode != 0:
        pytest.skip(f"`{' '.join(args)}` is not possible here (needs root): {result.stderr.strip()}")
    return result


@contextmanager
def tmpfs(path: Path, size: str = "64k"):
    """A small tmpfs mounted at `path` for the duration (skips the test where mounting is not allowed)."""
    path.mkdir(exist_ok=True)
    _run("mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path))
    try:
        yield path
    finally:
        _run("umount", "-l", str(path), check=False)


def remount_read_only(path: Path) -> None:
    _run("mount", "-o", "remount,ro", str(path))
    probe = _run("touch", str(path / "probe"), check=False)
    assert probe.returncode != 0, "the read-only remount still takes writes"


@contextmanager
def immutable(path: Path):
    """`chattr +i`: not even root may change, replace or remove the file."""
    _run("chattr", "+i", str(path))
    try:
        yield path
    finally:
        _run("chattr", "-i", str(path), check=False)


def _tensors(n: int = 16) -> dict[str, torch.Tensor]:
    return {"w": torch.arange(n, dtype=torch.float32)}


def _failing_writer(path, _tensors):
    Path(path).write_bytes(b"partial")  # what a writer leaves when the disk fills up mid-file
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


# ------------------------------------------------------------------------------------ checkpoint manager


def test_full_disk_is_a_checkpoint_error_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    manager = CheckpointManager(tmp_path)
    manager.save(1, _tensors(), {"round": 1})
    monkeypatch.setattr(spes_node.daemon.checkpoint, "write_tensors", _failing_writer)
    with pytest.raises(CheckpointError) as info:
        manager.save(2, _tensors(), {"round": 2})
    assert "step-00000002" in str(info.value) and "No space left on device" in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000001"]
    latest = manager.latest()
    assert latest.step == 1 and latest.meta == {"round": 1}
    assert torch.equal(latest.tensors["w"], _tensors()["w"])


def test_full_tmpfs_is_a_checkpoint_error_and_keeps_the_previous_checkpoint(tmp_path):
    with tmpfs(tmp_path / "small", size="64k") as small:
        manager = CheckpointManager(small)
        manager.save(1, _tensors(), {"round": 1})
        with pytest.raises(CheckpointError, match="step-00000002.*No space left on device"):
            manager.save(2, _tensors(100_000), {"round": 2})  # 400 kB on a 64 kB file system
        assert sorted(p.name for p in small.iterdir()) == ["step-00000001"]
        assert manager.latest().meta == {"round": 1}


def test_read_only_directory_is_a_checkpoint_error(tmp_path):
    with tmpfs(tmp_path / "ro") as ro:
        remount_read_only(ro)
        with pytest.raises(CheckpointError, match="Read-only file system"):
            CheckpointManager(ro).save(1, _tensors(), {})


def test_directory_below_a_regular_file_is_a_checkpoint_error(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="unusable"):
        CheckpointManager(tmp_path / "file" / "ckpt").save(1, _tensors(), {})


# ------------------------------------------------------------------------------------ `spes-node join`


@pytest.fixture
def join(monkeypatch):
    """`spes-node join --checkpoint-dir DIR ...` in-process; the DHT never starts."""

    def refuse(*_args, **_kwargs):
        raise DHTStarted("the DHT was started")

    monkeypatch.setattr(Node, "_start_dht", refuse)
    monkeypatch.setattr(spes_node.logs, "setup_logging", lambda *a, **k: None)
    for key in [k for k in os.environ if k.startswith("SPES_")]:
        monkeypatch.delenv(key)

    def invoke(checkpoint_dir: Path, *args: str):
        argv = ["join", "--checkpoint-dir", str(checkpoint_dir), "--device", "cpu", *args]
        return CliRunner().invoke(main, argv, catch_exceptions=True)

    return invoke


def _one_line(result, *needles: str) -> str:
    assert not isinstance(result.exception, DHTStarted), (
        "the node started its DHT before checking the directory"
    )
    assert result.exit_code not in (0, 1), (result.exit_code, result.exception)  # 1: an uncaught exception
    assert "Traceback" not in result.output + result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("spes-node: error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_join_with_a_read_only_checkpoint_directory(tmp_path, join):
    with tmpfs(tmp_path / "ro") as ro:
        remount_read_only(ro)
        _one_line(join(ro), str(ro), "Read-only file system")


def test_join_with_a_read_only_checkpoint_directory_that_holds_its_identity(tmp_path, join):
    with tmpfs(tmp_path / "ro") as ro:
        load_or_create_identity(ro / "identity.key")
        remount_read_only(ro)
        _one_line(join(ro), str(ro), "Read-only file system")


def test_join_with_a_checkpoint_directory_that_cannot_be_created(tmp_path, join):
    (tmp_path / "file").write_text("x")
    _one_line(join(tmp_path / "file" / "ckpt"), str(tmp_path / "file" / "ckpt"), "Not a directory")


def test_join_with_an_identity_file_that_cannot_be_created(tmp_path, join):
    (tmp_path / "file").write_text("x")
    identity = tmp_path / "file" / "identity.key"
    _one_line(join(tmp_path / "ckpt", "--identity", str(identity)), str(identity), "Not a directory")


def test_join_with_a_read_only_file_in_the_checkpoint_directory(tmp_path, join):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    with immutable(ckpt / "config.json"):
        _one_line(join(ckpt), str(ckpt / "config.json"), "read-only")


def test_join_with_an_unusable_checkpoint_directory_subprocess(tmp_path):
    (tmp_path / "file").write_text("x")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPES_")}
    result = subprocess.run(
        [sys.executable, "-m", "spes_node.cli", "join", "--checkpoint-dir", str(tmp_path / "file" / "ckpt")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if "spes-node: error:" in line]
    assert len(lines) == 1 and "Not a directory" in lines[0], result.stderr


# ------------------------------------------------------------------------------------ periodic checkpoints


def _node_with_state(directory: Path, checkpoint_writes: str = "auto") -> Node:
    """A Node on the CPU with just what `save_checkpoint` reads."""
    node = Node(None, NodeOptions(checkpoint_dir=directory, checkpoint_writes=checkpoint_writes))
    node.device = torch.device("cpu")
    node.peer_id, node.config_hash, node.shard, node.data_part = "QmNode", "c" * 64, 0, (0, 1)
    node.model = torch.nn.Linear(2, 2)
    node.batcher = SimpleNamespace(state_dict=lambda: {"position": 0})
    node.trainer = SimpleNamespace(step=1, optimizer_state_by_name=lambda: {})
    node.sync = SimpleNamespace(outer_state_dict=lambda: {})
    node.checkpoints = CheckpointManager(directory)
    node.checkpoint_writer = CheckpointWriter(node.checkpoints)
    node.cfg = load_preset("tiny")
    return node


@pytest.mark.parametrize("writes", ["background", "in-place"])
def test_full_disk_during_a_periodic_checkpoint_logs_and_trains_on(tmp_path, monkeypatch, caplog, writes):
    node = _node_with_state(tmp_path, writes)
    node.save_checkpoint()
    assert node.checkpoint_writer.wait(60)
    node.trainer.step = 2
    writer = spes_node.daemon.checkpoint.write_tensors
    monkeypatch.setattr(spes_node.daemon.checkpoint, "write_tensors", _failing_writer)
    with caplog.at_level(logging.ERROR, logger="spes_node.daemon"):
        node.save_checkpoint()  # must not raise: the write fails, the training loop goes on
        assert node.checkpoint_writer.wait(60)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, errors
    assert "step 2" in errors[0] and "No space left on device" in errors[0], errors[0]
    assert "previous checkpoint is kept" in errors[0], errors[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000001"]
    assert node.checkpoints.latest().step == 1

    monkeypatch.setattr(spes_node.daemon.checkpoint, "write_tensors", writer)
    node.save_checkpoint()  # the failed step is not remembered as saved: the next try writes it
    assert node.checkpoint_writer.wait(60)
    assert node.checkpoints.latest().step == 2


# ------------------------------------------------------------------------------------ shutdown


def test_a_slow_final_checkpoint_still_leaves_time_to_withdraw_the_record(monkeypatch, caplog):
    """The shutdown budget starts after the final checkpoint: a large model's checkpoint can take longer than the
    whole budget (spes-1b on a CPU: 9 s), and the record must still be withdrawn after it."""
    import spes_node.daemon.node as node_module

    clock = {"offset": 0.0}
    real_monotonic = time.monotonic
    monkeypatch.setattr(node_module.time, "monotonic", lambda: real_monotonic() + clock["offset"])
    withdrawn = []

    def withdraw(dht, run_id, peer_id, validator):
        time.sleep(0.2)  # a DHT store takes a moment: a call given no time at all is left behind
        withdrawn.append(peer_id)
        return True

    monkeypatch.setattr(node_module.records, "withdraw_node", withdraw)

    class Helper:
        pid = -1

        def __init__(self):
            self.alive = True

        def is_alive(self):
            return self.alive

        def shutdown(self):
            self.alive = False

        def end_orphans(self):  # `NodeDHT`'s: nothing was orphaned here
            pass

    class Sync(Helper):
        def helper_processes(self):
            return []

    def slow_checkpoint(wait):
        clock["offset"] += 2 * node_module.SHUTDOWN_S  # the write takes twice the whole shutdown budget

    node = Node.__new__(Node)
    node.stop_event = threading.Event()
    node.dht, node.sync = Helper(), Sync()
    node.status = SimpleNamespace(state="training")
    node.opts = SimpleNamespace(run_id="run")
    node.peer_id, node.validator = "peer", None
    node.save_checkpoint = slow_checkpoint
    node.write_summary = lambda: None
    with caplog.at_level(logging.WARNING, logger="spes_node.daemon.node"):
        node.shutdown()
    assert withdrawn == ["peer"]
    assert not any("could not" in r.getMessage() for r in caplog.records), caplog.text
    assert not node.dht.alive and not node.sync.alive


def test_a_checkpoint_due_while_a_round_runs_beside_the_steps_waits_for_its_end(tmp_path):
    """A checkpoint every 5 steps, due at step 6, while the round that began at step 5 still runs (its shards'
    all-reduces beside the steps): nothing is written until the round's end, which writes it."""
    node = _node_with_state(tmp_path)
    node.cfg = node.cfg.replace(train={"checkpoint_every": 5, "checkpoint_every_minutes": 0})
    in_flight = [True]
    node.sync = SimpleNamespace(outer_state_dict=lambda: {}, round_in_flight=lambda: in_flight[0])
    node.checkpoint_if_due()  # starts the clock at step 1
    node.trainer.step = 6
    node.checkpoint_if_due()
    assert not list(tmp_path.iterdir()), "written while the round ran"
    in_flight[0] = False
    node.checkpoint_if_due(round_end=True)
    assert node.checkpoint_writer.wait(60)
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000006"]
    node.trainer.step = 11
    node.checkpoint_if_due()  # no round in flight: written at once
    assert node.checkpoint_writer.wait(60)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000006", "step-00000011"]
