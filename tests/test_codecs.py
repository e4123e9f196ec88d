"""The int8 wire codec and the hivemind internals update averaging relies on (pure, no network)."""

from __future__ import annotations

import inspect

import pytest
import torch
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.partition import TensorPartContainer
from hivemind.compression import CompressionInfo, deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto import runtime_pb2

from spes_node.swarm.codecs import BLOCK, BlockwiseInt8, wire_compression


def test_blockwise_int8_rounds_each_value_within_half_a_step_of_its_block():
    x = torch.randn(3 * BLOCK + 17) * torch.logspace(-4, 1, 3 * BLOCK + 17)
    x[BLOCK : 2 * BLOCK] = 0.0  # a block that did not move stays exactly zero
    codec = BlockwiseInt8()
    message = codec.compress(x, CompressionInfo.from_tensor(x))
    assert len(message.buffer) == x.numel() + 4 * 4  # one int8 per value, one fp32 scale per block
    y = deserialize_torch_tensor(message)  # hivemind's decoder picks ours by the message's type
    assert y.shape == x.shape and y.dtype == torch.float32
    steps = torch.nn.functional.pad(x.abs(), (0, -x.numel() % BLOCK)).view(-1, BLOCK).amax(1) / 127
    bound = steps.repeat_interleave(BLOCK)[: x.numel()] / 2 + 1e-12
    assert bool(((x - y).abs() <= bound * (1 + 1e-5)).all())
    assert bool((y[BLOCK : 2 * BLOCK] == 0).all())
    assert torch.equal(deserialize_torch_tensor(serialize_torch_tensor(x, runtime_pb2.BLOCKWISE_8BIT)), y)


@pytest.mark.parametrize("cut", [1, 5])
def test_a_malformed_int8_message_is_refused(cut):
    x = torch.randn(2000)
    message = wire_compression("int8").compress(x, CompressionInfo.from_tensor(x))
    message.buffer = message.buffer[:-cut]
    with pytest.raises(ValueError, match="malformed"):
        deserialize_torch_tensor(message)


def test_the_hivemind_internals_update_averaging_replaces_are_where_it_expects():
    # RobustAllReduceRunner counts bytes through _get_peer_stub and rpc_aggregate_part, and replaces
    # _accumulate_parts_streaming and the local branch of _communicate_with_peer (copies of hivemind's)
    communicate = inspect.getsource(AllReduceRunner._communicate_with_peer)
    assert "self._get_peer_stub(peer_id).rpc_aggregate_part(" in communicate
    assert "self.parts_for_local_averaging" in communicate
    streaming = inspect.getsource(AllReduceRunner._accumulate_parts_streaming)
    assert (
        "self.tensor_part_reducer.accumulate_part(" in streaming
        and "averaged_part - tensor_part" in streaming
    )
    # CheckedPartContainer re-implements iterate_input_parts_for with a residual, from these attributes
    source = inspect.getsource(TensorPartContainer)
    for name in ("_input_parts_by_peer", "_inputs_consumed_by_peer", "num_parts_by_tensor", "prefetch"):
        assert name in source, name
