import dataclasses
import hashlib
import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from live_bytes import LiveBytes

from spes_node.daemon.checkpoint import (
    CheckpointError,
    CheckpointManager,
    flatten_state,
    rng_state,
    set_rng_state,
    unflatten_state,
)

REPO_ROOT = Path(__file__).resolve().parent.parent


def assert_same(a, b, where="state"):
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for key in a:
            assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def sample_tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "fp32": torch.randn(4, 5, generator=g),
        "bf16": torch.randn(3, 7, generator=g).to(torch.bfloat16),
        "int8": torch.randint(-128, 127, (6,), generator=g, dtype=torch.int8),
        "scalar": torch.tensor(float(seed)),
    }


def save_two(directory: Path) -> CheckpointManager:
    manager = CheckpointManager(directory)
    for step in (1, 2):
        manager.save(
            step, sample_tensors(step), {"round": step}, optimizer={"state": {0: torch.ones(2) * step}}
        )
    return manager


def test_round_trip_tensors_and_meta(tmp_path):
    manager = CheckpointManager(tmp_path)
    tensors = sample_tensors(0)
    base = torch.arange(12.0).reshape(3, 4)
    tensors.update(tied_a=base, tied_b=base, transposed=base.T, param=torch.nn.Parameter(torch.ones(2)))
    meta = {"round": 4, "shards": [1, 3], "config_hash": "abc", "data": {"file": 2, "offset": 77}, "lr": 1e-4}

    path = manager.save(123, tensors, meta)

    assert path == tmp_path / "step-00000123"
    assert sorted(p.name for p in path.iterdir()) == ["meta.json", "model.safetensors"]
    checkpoint = manager.latest()
    assert checkpoint.step == 123 and checkpoint.path == path
    assert checkpoint.meta == meta
    assert checkpoint.optimizer is None
    expected = {k: v.detach().contiguous() for k, v in tensors.items()}
    assert_same(dict(checkpoint.tensors), expected)


def train_step(model, optimizer, scheduler, x, y):
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    scheduler.step()


def make_training(seed: int, lr: float):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10, eta_min=lr * 0.1)
    return model, optimizer, scheduler


def test_adamw_state_round_trip_continues_identically(tmp_path):
    x, y = torch.randn(32, 8), torch.randn(32, 4)
    model, optimizer, scheduler = make_training(seed=0, lr=1e-2)
    for _ in range(3):
        train_step(model, optimizer, scheduler, x, y)
    state = {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}
    CheckpointManager(tmp_path).save(3, model.state_dict(), {"round": 0}, optimizer=state)

    checkpoint = CheckpointManager(tmp_path).latest()
    assert_same(checkpoint.optimizer, state)
    assert all(type(k) is int for k in checkpoint.optimizer["optimizer"]["state"])
    assert checkpoint.optimizer["optimizer"]["state"][0]["step"].dtype == torch.float32
    restored, restored_optimizer, restored_scheduler = make_training(seed=1, lr=5e-1)
    restored.load_state_dict(checkpoint.tensors)
    restored_optimizer.load_state_dict(checkpoint.optimizer["optimizer"])
    restored_scheduler.load_state_dict(checkpoint.optimizer["scheduler"])

    train_step(model, optimizer, scheduler, x, y)
    train_step(restored, restored_optimizer, restored_scheduler, x, y)
    for (name, original), (_, resumed) in zip(
        model.named_parameters(), restored.named_parameters(), strict=True
    ):
        assert torch.equal(original, resumed), name


def test_flatten_round_trips_awkward_structures():
    state = {
        "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(2, dtype=torch.bfloat16)}, 7: {}},
        "param_groups": [{"params": [0, 7], "betas": (0.9, 0.95), "lr": 0.1, "foreach": None, "name": "x"}],
        "__dunder": 1,
        "tagged": {"__tensor__": "not a placeholder"},
        "mixed": {2.5: "float key", "s": [(), [torch.tensor([1, 2], dtype=torch.int8)]], None: True},
    }
    tensors, structure = flatten_state(state)
    assert all(isinstance(t, torch.Tensor) for t in tensors.values())
    restored = unflatten_state(json.loads(json.dumps(structure)), tensors)
    assert_same(restored, state)


def test_flatten_rejects_unsupported_values():
    with pytest.raises(TypeError, match=r"state\.scheduler\.fn"):
        flatten_state({"scheduler": {"fn": lambda step: step}})
    with pytest.raises(TypeError, match="dict key"):
        flatten_state({(1, 2): 3})


@pytest.mark.parametrize(
    "structure", [{"__tensor__": "t9"}, {"__bogus__": 1}, {"__tuple__": 3}, {"__items__": [[1]]}]
)
def test_unflatten_rejects_malformed_structures(structure):
    with pytest.raises(ValueError):
        unflatten_state(structure, {"t0": torch.zeros(1)})


def test_keep_prunes_oldest_and_latest_is_newest(tmp_path):
    manager = CheckpointManager(tmp_path, keep=2)
    for step in (5, 10, 15, 20):
        manager.save(step, sample_tensors(step), {"step": step})

    assert [p.name for p in manager.list()] == ["step-00000015", "step-00000020"]
    assert manager.latest().step == 20
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000015", "step-00000020"]


def test_prune_never_removes_the_checkpoint_just_written(tmp_path, caplog):
    manager = CheckpointManager(tmp_path, keep=2)
    for step in (10, 20):
        manager.save(step, sample_tensors(step), {})

    with caplog.at_level(logging.WARNING, logger="spes_node.daemon.checkpoint"):
        manager.save(3, sample_tensors(3), {})

    assert [p.name for p in manager.list()] == ["step-00000003", "step-00000020"]
    assert "below newer step 20" in caplog.text


def test_saving_the_same_step_twice_replaces_it(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(4, sample_tensors(1), {"version": 1})
    manager.save(4, sample_tensors(2), {"version": 2})

    checkpoint = manager.latest()
    assert checkpoint.meta == {"version": 2}
    assert_same(dict(checkpoint.tensors), sample_tensors(2))
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000004"]


def flip_model_byte(path: Path) -> None:
    data = bytearray((path / "model.safetensors").read_bytes())
    data[-3] ^= 0xFF
    (path / "model.safetensors").write_bytes(bytes(data))


def truncate_meta(path: Path) -> None:
    text = (path / "meta.json").read_bytes()
    (path / "meta.json").write_bytes(text[: len(text) // 2])


def edit_meta_value(path: Path) -> None:
    document = json.loads((path / "meta.json").read_text())
    document["meta"]["round"] = 99
    (path / "meta.json").write_text(json.dumps(document))


def truncate_optimizer(path: Path) -> None:
    os.truncate(path / "optimizer.safetensors", 10)


@pytest.mark.parametrize(
    "damage, reason",
    [
        (flip_model_byte, "model.safetensors sha256 mismatch"),
        (truncate_meta, "meta.json does not parse"),
        (edit_meta_value, "meta.json checksum mismatch"),
        (truncate_optimizer, "optimizer.safetensors has 10 bytes"),
        (lambda p: (p / "model.safetensors").unlink(), "model.safetensors is missing"),
        (lambda p: (p / "optimizer.safetensors").unlink(), "optimizer.safetensors is missing"),
        (lambda p: (p / "meta.json").unlink(), "meta.json is missing"),
    ],
)
def test_corrupt_newest_falls_back_to_previous(tmp_path, caplog, damage, reason):
    manager = save_two(tmp_path)
    damage(tmp_path / "step-00000002")

    with caplog.at_level(logging.WARNING, logger="spes_node.daemon.checkpoint"):
        checkpoint = manager.latest()

    assert checkpoint.step == 1
    assert checkpoint.meta == {"round": 1}
    assert_same(dict(checkpoint.tensors), sample_tensors(1))
    assert_same(checkpoint.optimizer, {"state": {0: torch.ones(2)}})
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert str(tmp_path / "step-00000002") in warnings[0] and reason in warnings[0]


def test_all_corrupt_raises(tmp_path):
    manager = save_two(tmp_path)
    for path in manager.list():
        flip_model_byte(path)
    with pytest.raises(CheckpointError, match="no loadable checkpoint"):
        manager.latest()


def test_empty_or_missing_directory_has_no_checkpoint(tmp_path):
    assert CheckpointManager(tmp_path).latest() is None
    assert CheckpointManager(tmp_path / "absent").latest() is None
    assert CheckpointManager(tmp_path / "absent").list() == []


def test_bad_input_is_rejected_and_writes_nothing(tmp_path):
    with pytest.raises(ValueError, match="keep"):
        CheckpointManager(tmp_path, keep=0)
    manager = CheckpointManager(tmp_path)
    with pytest.raises(ValueError, match="step"):
        manager.save(-1, {}, {})
    with pytest.raises(ValueError, match="meta"):
        manager.save(1, {}, {"bad": object()})
    with pytest.raises(ValueError, match="tensors"):
        manager.save(1, {"w": [1.0]}, {})
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "file").write_text("")
    with pytest.raises(CheckpointError, match="not a directory"):
        CheckpointManager(tmp_path / "file")


def test_interrupted_replacement_is_recovered(tmp_path):
    manager = save_two(tmp_path)
    retired = tmp_path / ".old-step-00000002-0123abcd"
    os.rename(tmp_path / "step-00000002", retired)

    assert manager.latest().step == 2
    assert manager.list()[-1] == retired

    manager.save(3, sample_tensors(3), {"round": 3})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000001", "step-00000002", "step-00000003"]
    assert manager.latest().step == 3


CRASHING_WRITER = """
import sys, torch
from spes_node.daemon.checkpoint import CheckpointManager
manager = CheckpointManager(sys.argv[1])
manager.save(1, {"w": torch.arange(1000, dtype=torch.float32)}, {"round": 1})
manager.save(2, {f"block{i}": torch.full((25 * 2**18,), float(i)) for i in range(8)}, {"round": 2})
"""


def test_crash_mid_write_keeps_previous_checkpoint(tmp_path):
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
    }
    writer = subprocess.Popen([sys.executable, "-c", CRASHING_WRITER, str(tmp_path)], env=env)
    try:
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob(".tmp-step-00000002-*")):
            assert writer.poll() is None, "writer exited before it started writing step 2"
            assert time.monotonic() < deadline, "writer never started writing step 2"
            time.sleep(0.001)
        writer.send_signal(signal.SIGKILL)
    finally:
        writer.kill()
        writer.wait()
    assert writer.returncode == -signal.SIGKILL
    assert not (tmp_path / "step-00000002").exists(), "the writer finished before it was killed"
    assert list(tmp_path.glob(".tmp-*"))

    manager = CheckpointManager(tmp_path)
    checkpoint = manager.latest()
    assert checkpoint.step == 1 and checkpoint.meta == {"round": 1}
    assert torch.equal(checkpoint.tensors["w"], torch.arange(1000, dtype=torch.float32))

    manager.save(3, {"w": torch.ones(3)}, {"round": 3})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000001", "step-00000003"]
    assert manager.latest().step == 3


def draw():
    return random.random(), float(np.random.rand()), torch.rand(4)


def test_rng_state_round_trips_through_json():
    state = json.loads(json.dumps(rng_state()))
    first = draw()
    random.random()
    torch.rand(10)
    set_rng_state(state)
    second = draw()
    assert first[:2] == second[:2]
    assert torch.equal(first[2], second[2])


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_rng_state_without_cuda_warns(caplog):
    state = rng_state()
    state["cuda"] = [state["torch"]]
    with caplog.at_level(logging.WARNING, logger="spes_node.daemon.checkpoint"):
        set_rng_state(state)
    assert "CUDA RNG states for 1 devices" in caplog.text


def test_the_files_are_safetensors_written_one_tensor_at_a_time(tmp_path):
    """Every dtype a node checkpoints, empty and 0-dim tensors, views that are not contiguous: the file loads with
    safetensors' own reader, its recorded sha256 and size are the file's, and writing it allocated one tensor's copy
    at a time (the non-contiguous views each need one), not a copy of them all."""
    from safetensors.torch import load_file

    big = torch.arange(4096.0).reshape(64, 64)
    tensors = {
        "f32_view": big.T,
        "f32_view_too": big[:, 1::2].T,
        "bf16": torch.randn(5, 3).to(torch.bfloat16),
        "f16": torch.randn(7).to(torch.float16),
        "i8": torch.randint(-127, 127, (4, 4), dtype=torch.int8),
        "i64": torch.tensor(12345678901),
        "bool": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 3),
    }
    live = LiveBytes(tensors.values())
    with live:
        path = CheckpointManager(tmp_path).save(7, tensors, {})
    assert live.peak <= big.nbytes, f"{live.peak} bytes alive at once while writing"
    loaded = load_file(path / "model.safetensors")
    assert_same({k: loaded[k] for k in tensors}, {k: v.contiguous() for k, v in tensors.items()})
    recorded = json.loads((path / "meta.json").read_text())["files"]["model.safetensors"]
    data = (path / "model.safetensors").read_bytes()
    assert recorded["size"] == len(data)
    assert recorded["sha256"] == hashlib.sha256(data).hexdigest()


def test_a_checkpoint_is_read_one_tensor_at_a_time_into_the_model(tmp_path):
    """Opening a checkpoint reads none of its tensors; loading it into a model holds one at a time beside the
    model (torch's `load_state_dict` makes a dict of what it is given: all of it at once); the optimizer's parts
    are read alone, each tensor once."""
    from spes_node.config import load_preset
    from spes_node.model.initial import initial_model
    from spes_node.model.ownership import load_state_in_place

    cfg = load_preset("tiny").model
    saved = initial_model(cfg, 4, 1, owned=[0], frozen_dtype="bf16")
    by_name = {
        name: {"step": torch.tensor(3.0), "exp_avg": torch.randn_like(p), "exp_avg_sq": torch.rand_like(p)}
        for name, p in saved.named_parameters()
    }
    outer = {"velocity": [torch.ones(3)]}
    CheckpointManager(tmp_path).save(
        5, saved.state_dict(), {}, optimizer={"by_name": by_name, "outer": outer}
    )
    model = initial_model(cfg, 4, 2, owned=[0], frozen_dtype="bf16")
    held = list(model.state_dict().values())
    largest = max(t.nbytes for t in held)

    with LiveBytes(held) as live:
        checkpoint = CheckpointManager(tmp_path).latest()
    assert live.peak == 0
    with LiveBytes(held) as live:
        missing, unexpected = load_state_in_place(model, checkpoint.tensors)
    assert (missing, unexpected) == ([], [])
    assert live.peak <= largest, f"{live.peak / largest:.2f} of the largest tensor alive at once"
    assert_same(dict(model.state_dict()), dict(saved.state_dict()))
    with LiveBytes(held) as live:  # what the node did before
        model.load_state_dict(checkpoint.tensors)
    assert live.peak >= sum(t.nbytes for t in saved.state_dict().values()) > 2 * largest

    with LiveBytes() as live:
        got = checkpoint.optimizer_part("by_name")
    assert live.peak == live.now == sum(t.nbytes for state in by_name.values() for t in state.values())
    assert_same(got, by_name)
    assert_same(checkpoint.optimizer_part("outer"), outer)
    assert checkpoint.optimizer_part("absent") is None

    other = initial_model(dataclasses.replace(cfg, expert_ffn=2 * cfg.expert_ffn), 4, 2, owned=[0])
    with pytest.raises(ValueError, match=r"mlp\.shards\.\d\.gate_up is \["):
        load_state_in_place(other, checkpoint.tensors)


def test_a_file_safetensors_wrote_reads_the_same(tmp_path):
    """Checkpoints written by safetensors' own writer (before ours) still load: its header orders tensors its own
    way and may carry metadata."""
    from safetensors.torch import save_file

    from spes_node.tensor_file import TensorFile

    tensors = sample_tensors(4)
    save_file(tensors, tmp_path / "f.safetensors", metadata={"format": "pt"})
    read = TensorFile(tmp_path / "f.safetensors", keys=list(tensors))
    assert list(read) == list(tensors)
    assert_same(dict(read), tensors)
    assert read.dtype("bf16") == torch.bfloat16 and read.shape("fp32") == (4, 5)


def _with_header(path: Path, header: dict, data: bytes) -> Path:
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)
    return path


@pytest.mark.parametrize(
    "header, data, reason",
    [
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4, "do not match"),
        ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, "do not match"),
        ({"a": {"dtype": "X9", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, "no valid dtype"),
        ({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8, "no valid dtype"),
        (
            {
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
            },
            b"\0" * 12,
            "overlap",
        ),  # fmt: skip
        ([1, 2], b"", "not a JSON object"),
    ],
)
def test_a_damaged_tensor_file_is_refused_when_opened(tmp_path, header, data, reason):
    from spes_node.tensor_file import TensorFile, TensorFileError

    path = _with_header(tmp_path / "f.safetensors", header, data)
    with pytest.raises(TensorFileError, match=reason) as failure:
        TensorFile(path)
    assert "\n" not in str(failure.value)


def test_a_file_that_is_no_tensor_file_is_refused(tmp_path):
    from spes_node.tensor_file import TensorFile, TensorFileError

    (tmp_path / "junk").write_bytes((1 << 40).to_bytes(8, "little") + b"{}")
    with pytest.raises(TensorFileError, match="header length"):
        TensorFile(tmp_path / "junk")
    (tmp_path / "short").write_bytes(b"\x01")
    with pytest.raises(TensorFileError, match="header length"):
        TensorFile(tmp_path / "short")
    path = _with_header(
        tmp_path / "f", {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8
    )
    with pytest.raises(TensorFileError, match="other tensors"):
        TensorFile(path, keys=["a", "b"])
