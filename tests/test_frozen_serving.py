"""Frozen copies are served from their own buffers, read when asked for: no copy of the frozen experts is kept for
serving, and a copy whose buffers were replaced is withdrawn rather than served as another round's state."""

import asyncio
import json
import weakref
from types import SimpleNamespace

import pytest
import torch
from hivemind.compression import NoCompression, deserialize_torch_tensor
from hivemind.utils.streaming import combine_from_streaming

from spes_node.aio import LoopThread
from spes_node.config import load_preset
from spes_node.model.moe import MoEForCausalLM, read_stored
from spes_node.model.ownership import apply_ownership, frozen_shard_buffers, load_shard_tensors, shard_tensors
from spes_node.proto.state_pb2 import StateRequest
from spes_node.swarm.snapshots import FrozenShard, SnapshotPublisher
from spes_node.swarm.transfer import Snapshot, StateServer, _TensorCount


def _model(frozen_dtype: str) -> MoEForCausalLM:
    cfg = load_preset("tiny")
    model = MoEForCausalLM(cfg.model, cfg.swarm.num_shards)
    apply_ownership(model, [0], frozen_dtype)
    return model


def _frozen_part(model: MoEForCausalLM, shard: int = 1) -> dict:
    publisher = SnapshotPublisher(server=None, loop=None, dtype=torch.float16)
    return publisher.frozen_part(FrozenShard(frozen_shard_buffers(model, shard), read_stored))


@pytest.mark.parametrize("frozen_dtype", ["fp32", "bf16", "int8"])
def test_a_frozen_shard_is_served_from_its_buffers_and_goes_stale_when_they_are_replaced(frozen_dtype):
    model = _model(frozen_dtype)
    part = _frozen_part(model)
    dense = {
        name: t.clone() for name, t in shard_tensors(model, 1).items()
    }  # fp32 dense() is the buffer itself
    assert set(part) == set(dense)
    for name, tensor in dense.items():
        served = part[name]()
        assert served.device.type == "cpu" and served.dtype == torch.float16
        assert torch.equal(served, tensor.to(torch.float16)), "the values a copy at wire precision would hold"

    # a refresh stores new buffers: the old ones are freed (the part holds no reference that keeps them), and the
    # part reads nothing rather than the new round's weights under the old round's name
    old = weakref.ref(model.expert_shards(1)[0].gate_up)
    load_shard_tensors(model, 1, {k: v + 1.0 for k, v in dense.items()})
    assert old() is None, "serving kept a replaced frozen buffer alive"
    assert all(deferred.stale and deferred() is None for deferred in part.values())


def test_own_shards_are_never_served_from_their_live_weights():
    model = _model("bf16")
    with pytest.raises(ValueError, match="in place"):
        frozen_shard_buffers(model, 0)


def _served(server: StateServer, part: str, round_: int) -> tuple[dict | None, dict[str, torch.Tensor]]:
    """(metadata, tensors) of what the server streams for one request, parsed as a downloader does."""

    async def collect():
        # read as a downloader does: up to the last chunk of the last tensor the metadata names, then close (the
        # handler waits for that close, `swarm/streams.py`)
        request = StateRequest(part=part, config_hash="h", min_round=round_)
        stream = server._handle(request, SimpleNamespace(remote_id="peer"))
        messages, complete = [], None
        async for message in stream:
            messages.append(message)
            complete = complete or _TensorCount(len(json.loads(message.metadata)["names"]))
            if complete(message, len(messages)):
                break
        await stream.aclose()
        return messages

    messages = asyncio.run(collect())
    if not messages:
        return None, {}
    metadata = json.loads(messages[0].metadata)
    tensors, chunks = [], []
    for message in messages:
        if message.tensor_part.dtype and chunks:
            tensors.append(deserialize_torch_tensor(combine_from_streaming(chunks)))
            chunks = []
        chunks.append(message.tensor_part)
    tensors.append(deserialize_torch_tensor(combine_from_streaming(chunks)))
    return metadata, dict(zip(metadata["names"], tensors))


def test_the_server_streams_a_frozen_part_and_withdraws_it_once_its_buffers_are_replaced():
    model = _model("bf16")
    server = StateServer(p2p=None, run_id="r", config_hash="h", compression=NoCompression())

    async def start():
        server._updated = asyncio.Condition()
        await server.publish("copy:1", Snapshot(3, _frozen_part(model)))

    asyncio.run(start())
    metadata, tensors = _served(server, "copy:1", 3)
    assert metadata["round"] == 3
    dense = shard_tensors(model, 1)
    assert set(tensors) == set(dense)
    assert all(torch.equal(tensors[name], dense[name].to(torch.float16)) for name in dense)
    sent = server.bytes_sent
    assert sent >= sum(2 * t.numel() for t in dense.values())

    load_shard_tensors(model, 1, {k: v + 1.0 for k, v in dense.items()})
    assert _served(server, "copy:1", 3) == (None, {}), "a replaced copy is not served"
    assert "copy:1" not in server.snapshots and server.bytes_sent == sent


def test_a_merge_round_serves_its_shard_only_once_merged_and_its_merge_inputs_as_premerge():
    # a node that joins or catches up during a holder's merge asks for the shard of that round: it must get the
    # merged weights (what the holder's round ends with), never the merge's inputs under the round's name
    server = StateServer(p2p=None, run_id="r", config_hash="h", compression=NoCompression())
    loop = LoopThread("test-publisher")
    try:
        loop.run(_condition(server))  # the server's state, without a p2p to listen on
        publisher = SnapshotPublisher(server, loop, torch.float32)
        before, inputs, merged = ({"w": torch.full((3,), value)} for value in (1.0, 2.0, 3.0))
        publisher.publish(4, {}, {0: before}, {})
        publisher.publish(5, {}, {0: inputs}, {}, premerge=[0])
        assert server.snapshots["shard:0"].round == 4, "the merge inputs were served as round 5's shard"
        assert torch.equal(server.snapshots["premerge:0"].tensors["w"], inputs["w"])
        waiting = loop.submit(server._wait_for("shard:0", min_round=5, timeout=30))
        publisher.publish(5, {}, {0: merged}, {}, restart=True)
        served = waiting.result(30)
        assert served.round == 5 and torch.equal(served.tensors["w"], merged["w"])
        # the merge inputs stay served for the round (slower replicas merge from them), then go
        assert torch.equal(server.snapshots["premerge:0"].tensors["w"], inputs["w"])
        publisher.publish(6, {}, {0: merged}, {})
        assert "premerge:0" not in server.snapshots
    finally:
        loop.stop()


def test_a_shard_the_node_moved_away_from_or_to_is_refused_at_once_not_after_the_timeout():
    # a requester that read the node's record before it moved asks for the shard it no longer trains (or for a
    # frozen copy of the one it trains now): "no such state" at once, while a part of a later round is waited for
    server = StateServer(p2p=None, run_id="r", config_hash="h", compression=NoCompression())
    loop = LoopThread("test-publisher")
    try:
        loop.run(_condition(server))
        publisher = SnapshotPublisher(server, loop, torch.float32)
        model = MoEForCausalLM(load_preset("tiny").model, 2)
        apply_ownership(model, [1])
        publisher.publish(
            4, {}, {1: {"w": torch.ones(3)}}, {0: FrozenShard(frozen_shard_buffers(model, 0), read_stored)}
        )
        assert set(server.snapshots) == {"shared", "shard:1", "copy:0"}
        for part in ("shard:0", "copy:1"):
            # an hour's timeout: only the answer at once ends it within the minute the test waits
            assert loop.submit(server._wait_for(part, min_round=4, timeout=3600)).result(60) is None, part
        # an older round of a part it serves is waited for, as before
        waiting = loop.submit(server._wait_for("shard:1", min_round=5, timeout=30))
        publisher.publish(
            5, {}, {1: {"w": torch.ones(3)}}, {0: FrozenShard(frozen_shard_buffers(model, 0), read_stored)}
        )
        assert waiting.result(30).round == 5
    finally:
        loop.stop()


async def _condition(server: StateServer) -> None:
    server._updated = asyncio.Condition()
