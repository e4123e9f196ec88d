"""Stop and resume through the real CLI: a node alone founds its swarm, so each round's sync is a no-op."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from spes_node.daemon.checkpoint import MODEL_FILE, CheckpointManager

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(900)]

CONFIG = """
name = "resume-test"

[model]
vocab_size = 260
hidden_size = 64
num_layers = 2
num_heads = 4
num_experts = 8
top_k = 2
expert_ffn = 128
max_seq_len = 64

[train]
seq_len = 64
micro_batch_size = 4
warmup_steps = 2
total_steps = 100
log_every = 1
checkpoint_every = 2
keep_checkpoints = 5
eval_batches = 1

[swarm]
num_shards = 4
sync_steps = 4
heartbeat_s = 1.0
matchmaking_time = 1.0
"""
PROCESS_TIMEOUT = 400


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPES_")}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return env


def _start(config: Path, checkpoint_dir: Path, rounds: int, log: Path) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "spes_node.cli",
        "join",
        "--config",
        str(config),
        "--run-id",
        "r",
        "--checkpoint-dir",
        str(checkpoint_dir),
        "--host-maddrs",
        "/ip4/127.0.0.1/tcp/0",
        "--device",
        "cpu",
        "--max-rounds",
        str(rounds),
    ]
    with open(log, "wb") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=_env())


def _finish(*runs: tuple[subprocess.Popen, Path]) -> list[str]:
    logs = []
    try:
        for process, log in runs:
            code = process.wait(timeout=PROCESS_TIMEOUT)
            text = log.read_text()
            assert code == 0, f"exit {code}:\n{text[-3000:]}"
            assert "Traceback" not in text, text[-3000:]
            logs.append(text)
    finally:
        for process, _ in runs:
            if process.poll() is None:
                process.kill()
                process.wait()
    return logs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A: 2 rounds in one go. B: 1 round, exit, 1 more. D: B after its first round with the newest checkpoint
    damaged, run for 1 round. Two processes at a time."""
    root = tmp_path_factory.mktemp("resume")
    config = root / "cfg.toml"
    config.write_text(CONFIG)
    a, b, d = root / "A", root / "B", root / "D"
    _finish(
        (_start(config, a, 2, root / "A.log"), root / "A.log"),
        (_start(config, b, 1, root / "B1.log"), root / "B1.log"),
    )
    after_first = CheckpointManager(b).latest()
    shutil.copytree(b, d)
    (d / "identity.key").unlink()
    newest = max(d.glob("step-*"))
    with open(newest / MODEL_FILE, "r+b") as f:
        f.seek(-64, os.SEEK_END)
        tail = f.read(16)
        f.seek(-64, os.SEEK_END)
        f.write(bytes(x ^ 0xFF for x in tail))
    logs = _finish(
        (_start(config, b, 1, root / "B2.log"), root / "B2.log"),
        (_start(config, d, 1, root / "D.log"), root / "D.log"),
    )
    return {"a": a, "b": b, "d": d, "after_first": after_first, "b2_log": logs[0], "d_log": logs[1]}


def _summary(directory: Path) -> dict:
    return json.loads((directory / "summary.json").read_text())


def _assert_same_state(got, expected) -> None:
    assert got.step == expected.step
    assert list(got.tensors) == list(expected.tensors)
    different = [k for k in expected.tensors if not torch.equal(got.tensors[k], expected.tensors[k])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"
    got_opt, expected_opt = got.optimizer["by_name"], expected.optimizer["by_name"]
    assert sorted(got_opt) == sorted(expected_opt)
    for name, state in expected_opt.items():
        for key, value in state.items():
            assert torch.equal(got_opt[name][key], value), (name, key)
    for key in ("round", "step", "steps_into_round", "tokens", "shards", "data_part", "data_state"):
        assert got.meta[key] == expected.meta[key], key
    assert got.meta["rng"]["torch"] == expected.meta["rng"]["torch"]


def test_resume_gives_same_loss(runs):
    a, b = CheckpointManager(runs["a"]).latest(), CheckpointManager(runs["b"]).latest()
    assert a.step == 8 and a.meta["round"] == 2 and a.meta["steps_into_round"] == 0
    assert "resumed from step-00000004: round 1, step 4" in runs["b2_log"]
    _assert_same_state(b, a)
    summary_a, summary_b = _summary(runs["a"]), _summary(runs["b"])
    assert summary_b["rounds_done"] == 1 and summary_a["rounds_done"] == 2
    assert summary_b["step"] == summary_a["step"] == 8
    assert summary_b["last_loss"] == summary_a["last_loss"]
    assert summary_b["loss_history"] == summary_a["loss_history"]
    assert summary_a["last_loss"] < summary_a["first_loss"]


def test_corrupt_newest_checkpoint_falls_back_to_the_previous_one(runs):
    log = runs["d_log"]
    assert "spes_node.daemon.checkpoint: skipping corrupt checkpoint" in log
    assert "model.safetensors sha256 mismatch" in log
    assert "resumed from step-00000002: round 0, step 2" in log
    resumed = CheckpointManager(runs["d"]).latest()
    _assert_same_state(resumed, runs["after_first"])
    assert _summary(runs["d"])["step"] == 4


def test_mid_round_resume_keeps_the_round_loss(runs):
    assert _summary(runs["d"])["loss_history"] == runs["after_first"].meta["loss_history"]
