"""The state server answers only with state of the round asked for (pure asyncio, no network)."""

import asyncio

import pytest
import torch

from spes_node.swarm.transfer import Snapshot, StateServer


def _server() -> StateServer:
    server = StateServer(p2p=None, run_id="r", config_hash="h", compression=None)
    server._updated = asyncio.Condition()
    return server


def test_a_stale_snapshot_is_never_served_in_place_of_the_round_asked_for():
    async def scenario():
        server = _server()
        await server.publish("premerge:1", Snapshot(4, {"w": torch.zeros(2)}))
        assert await server._wait_for("premerge:1", min_round=5, timeout=0.2) is None
        assert (await server._wait_for("premerge:1", min_round=4, timeout=0.2)).round == 4

        # a snapshot of the asked round that arrives while the request waits is served
        waiting = asyncio.create_task(server._wait_for("shard:1", min_round=6, timeout=5.0))
        await server.publish("shard:1", Snapshot(5, {"w": torch.zeros(2)}))
        await server.publish("shard:1", Snapshot(6, {"w": torch.ones(2)}))
        served = await waiting
        assert served is not None and served.round == 6

        await server.withdraw("premerge:1")
        assert await server._wait_for("premerge:1", min_round=0, timeout=0.1) is None

    asyncio.run(scenario())


def test_downloads_keep_the_precision_they_travelled_at_and_refuse_what_is_no_float():
    from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
    from hivemind.proto import runtime_pb2

    from spes_node.swarm.transfer import TransferError, validate_tensors

    expected = {"a": torch.Size([4, 8]), "b": torch.Size([8])}
    weights = {"a": torch.randn(4, 8).half(), "b": torch.randn(8)}
    # as the server sends them: fp16 snapshots on an fp16 wire, and an fp32 one
    travelled = [
        deserialize_torch_tensor(serialize_torch_tensor(weights[name], runtime_pb2.CompressionType.FLOAT16))
        for name in ("a", "b")
    ]
    out = validate_tensors(["a", "b"], travelled, expected, source="test")
    assert out["a"].dtype == torch.float16 and torch.equal(out["a"], weights["a"]), (
        "held at the wire's precision"
    )
    assert out["b"].dtype == torch.float32
    wide = validate_tensors(["a", "b"], [t.double() for t in travelled], expected, source="test")
    assert {t.dtype for t in wide.values()} == {torch.float32}, "float64 is not kept at twice the bytes"
    with pytest.raises(TransferError, match="not floating point"):
        validate_tensors(["a", "b"], [travelled[0].long(), travelled[1]], expected, source="test")
    broken = travelled[0].clone()
    broken[0, 0] = float("inf")
    with pytest.raises(TransferError, match="non-finite"):
        validate_tensors(["a", "b"], [broken, travelled[1]], expected, source="test")
