"""Streams whose receiver closes first (`swarm/streams.py`): real p2p daemons on 127.0.0.1."""

from __future__ import annotations

import asyncio

import pytest
import torch
from hivemind.compression import serialize_torch_tensor
from hivemind.p2p import P2P
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.streaming import split_for_streaming

from spes_node.swarm import streams
from spes_node.swarm.transfer import _TensorCount

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
MESSAGES, SIZE = 12, 1 << 20


async def _pair():
    server = await P2P.create(host_maddrs=LOOPBACK)
    client = await P2P.create(
        host_maddrs=LOOPBACK, initial_peers=[str(a) for a in await server.get_visible_maddrs()]
    )
    return server, client


async def _serve_and_read(linger_s: float, take: bool):
    """A handler sends MESSAGES parts of SIZE bytes and lingers; the client reads them one by one, slower than the
    link (a loaded receiver), and closes after the last one when `take`. Returns (parts read, how the handler's
    linger ended)."""
    server, client = await _pair()
    ended: asyncio.Future = asyncio.get_running_loop().create_future()

    async def handler(request, context):
        for _ in range(MESSAGES):
            yield averaging_pb2.AveragingData(
                code=averaging_pb2.AVERAGED_PART, tensor_part=runtime_pb2.Tensor(buffer=b"x" * SIZE)
            )
        try:
            await streams.linger(linger_s)
            ended.set_result("timed out")
        except asyncio.CancelledError:
            ended.set_result("the receiver closed")
            raise

    try:
        await server.add_protobuf_handler("parts", handler, averaging_pb2.AveragingData, stream_output=True)
        request = averaging_pb2.AveragingData(code=averaging_pb2.PART_FOR_AVERAGING)
        stream = await client.iterate_protobuf_handler(
            server.peer_id, "parts", request, averaging_pb2.AveragingData
        )
        if take:
            stream = streams.take(stream, lambda message, count: count >= MESSAGES)
        read = 0
        async for message in stream:
            assert len(message.tensor_part.buffer) == SIZE
            read += 1
            await asyncio.sleep(0.02)
        return read, await asyncio.wait_for(ended, 120)
    finally:
        await client.shutdown()
        await server.shutdown()


def test_a_handler_that_lingers_ends_when_its_receiver_has_read_everything_and_closed():
    # long linger: only the receiver's close can end it within the wait
    read, how = asyncio.run(_serve_and_read(linger_s=600.0, take=True))
    assert read == MESSAGES and how == "the receiver closed"


def test_a_receiver_that_reads_until_the_end_still_gets_everything_once_the_linger_is_over():
    # hivemind's own clients read until the stream ends: the handler's side closes after its linger, as before
    read, how = asyncio.run(_serve_and_read(linger_s=0.5, take=False))
    assert read == MESSAGES and how == "timed out"


@pytest.mark.parametrize("sizes", [[10], [300_000], [10, 300_000, 5], [300_000, 300_000]])
def test_a_download_is_complete_at_the_last_chunk_of_its_last_tensor(sizes):
    """`_TensorCount`: large tensors arrive in several chunks, the first of which carries the dtype and the count."""
    messages = [
        averaging_pb2.DownloadData(tensor_part=chunk)
        for size in sizes
        for chunk in split_for_streaming(serialize_torch_tensor(torch.zeros(size)), 2**16)
    ]
    assert len(messages) > len(sizes) or max(sizes) < 2**14
    done = _TensorCount(len(sizes))
    flags = [done(message, i + 1) for i, message in enumerate(messages)]
    assert flags == [False] * (len(messages) - 1) + [True]
    # fewer tensors than expected: never complete
    short = _TensorCount(len(sizes) + 1)
    assert not any(short(message, i + 1) for i, message in enumerate(messages))
