"""Checkpoints of real daemons: by time, in the background, and without frozen experts (refetched on resume)."""

import logging
import re
import signal

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from swarm_utils import Swarm

from spes_node.daemon.checkpoint import MODEL_FILE, CheckpointManager
from spes_node.daemon.checkpoint_writer import frozen_expert_names
from spes_node.daemon.node import Node, NodeOptions
from spes_node.model.moe import MoEForCausalLM
from spes_node.model.ownership import shard_tensors

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(600)]

WRITE_LINE = re.compile(
    r"checkpoint step (\d+): ([\d.]+) MiB, training paused (\d+) ms for the snapshot, written in ([\d.]+)s"
)


def test_checkpoints_by_time_mid_round(tmp_path):
    """No round ends (H is large) and no step interval: only the time interval can checkpoint mid-round."""
    swarm = Swarm(tmp_path, run_id="bytime", sync_steps=100000)
    cfg = swarm.cfg.replace(train={"checkpoint_every": 0, "checkpoint_every_minutes": 0.05})
    config = tmp_path / "bytime.json"
    config.write_text(cfg.to_json())
    try:
        swarm.start("a", "--checkpoint-writes", "background", config=config)  # on a CPU, auto writes in place

        def three_written():
            steps = [int(m[1]) for m in WRITE_LINE.finditer(swarm.log("a"))]
            return steps if len(steps) >= 3 else None

        steps = swarm.wait_for(three_written, 300, "three checkpoints by time")
        swarm.kill("a", signal.SIGTERM)
        assert swarm.procs["a"].returncode == 0, swarm.log("a")[-3000:]
    finally:
        swarm.close()
    log = swarm.log("a")
    final = CheckpointManager(tmp_path / "a").latest()
    summary = swarm.summary("a")
    assert (
        final.step == summary["step"]
        and final.meta["round"] == 0
        and final.meta["steps_into_round"] == final.step
    )
    assert steps == sorted(steps) and len(set(steps)) == len(steps)
    assert steps[0] > 0, "the first checkpoint by time came at the start"
    # every 3 s, not every step: the node trained many steps in between (a tiny step takes well under a second)
    written = [int(m[1]) for m in WRITE_LINE.finditer(log)]
    assert summary["step"] > len(written) + 3, written
    assert "Traceback" not in log


def _checkpoint_tensors(directory) -> list[dict[str, torch.Tensor]]:
    """The model tensors of every checkpoint in `directory` that is there when read (the node prunes as it goes)."""
    out = []
    for path in CheckpointManager(directory).list():
        try:
            out.append(load_file(path / MODEL_FILE))
        except (OSError, SafetensorError):
            continue
    return out


def test_resume_without_frozen_experts_downloads_them_from_the_holder(tmp_path, caplog):
    """b trains shard 1 beside a holder of shard 0 for one round and exits; it resumes while the holder is in its
    next round (long rounds), so b is not behind the swarm and takes nothing but the frozen experts."""
    swarm = Swarm(tmp_path, run_id="refetch", sync_steps=250)
    cfg = swarm.cfg.replace(train={"checkpoint_frozen_experts": False, "keep_checkpoints": 20})
    config = tmp_path / "nofrozen.json"
    config.write_text(cfg.to_json())
    node = None
    try:
        swarm.start("holder", "--shard", "0", config=config)
        swarm.start("b", "--shard", "1", "--max-rounds", "1", config=config)
        assert swarm.wait_exit("b", 400) == 0, swarm.log("b")[-3000:]
        saved = CheckpointManager(tmp_path / "b").latest()
        assert saved.meta["frozen_experts"] is False and saved.meta["shards"] == [1]
        assert not frozen_expert_names(saved.tensors, [1]), "frozen experts were saved"
        assert "model.layers.0.mlp.shards.1.gate_up" in saved.tensors
        assert "written in place" in swarm.log("b"), "a node on the CPU writes its checkpoints in place"

        # b resumes in this process, so that its model can be read once it is ready to train
        node = Node(cfg, NodeOptions(
            peers=[swarm.maddr], run_id="refetch", checkpoint_dir=tmp_path / "b", device="cpu",
            host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        ))  # fmt: skip
        with caplog.at_level(logging.INFO, logger="spes_node.daemon.node"):
            node.startup()
        got = {k: v.clone() for k, v in shard_tensors(node.model, 0).items()}
        if "caught up" in caplog.text:
            pytest.fail(
                "the holder finished its next round before b resumed (b caught up instead): longer rounds"
            )
        holder_states = _checkpoint_tensors(tmp_path / "holder")
    finally:
        if node is not None:
            node.shutdown()
        swarm.close()

    initial = shard_tensors(MoEForCausalLM(cfg.model, cfg.swarm.num_shards, seed=cfg.train.seed), 0)
    assert any(not torch.equal(got[k], initial[k]) for k in got), "shard 0 kept its initial weights"
    # the holder served the state of one of its rounds (at the wire's fp16); its round-end checkpoints hold them
    wire = cfg.swarm.wire_compression
    assert wire == "fp16"
    matches = [
        state
        for state in holder_states
        if all(torch.equal(got[k], state[k].to(torch.float16).to(got[k].dtype)) for k in got)
    ]
    assert matches, f"shard 0 equals none of the holder's {len(holder_states)} checkpoints"
    assert f"resumed from {saved.path.name}" in caplog.text
    assert "no live node holds shard(s) [2, 3]: they start from their initial weights" in caplog.text
    assert "downloaded the frozen experts of 1 of 1 held shards" in caplog.text
