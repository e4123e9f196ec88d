"""The averagers' buffers live in shared memory with no name (`procs.shared_empty`), and getting them there leaves
the process's sharing strategy alone: other threads pickle hivemind's futures by it all the while."""

from __future__ import annotations

from multiprocessing.reduction import ForkingPickler

import hivemind
import pytest
import torch
from hivemind.utils.mpfuture import MPFuture, SharedBytes

from spes_node.procs import kept_in_place, shared_like
from spes_node.swarm.robust import RobustAverager


def _block(future: MPFuture) -> int:
    """Where the shared byte that holds a future's state lives."""
    return future._shared_state_code.untyped_storage().data_ptr()


def test_shared_buffers_are_shared_and_stay_where_they_are_through_share_memory():
    buffers = shared_like([torch.zeros(3, 4), torch.zeros(5)])
    assert all(b.is_shared() for b in buffers)
    assert [b.shape for b in buffers] == [torch.Size([3, 4]), torch.Size([5])]
    before = [b.data_ptr() for b in buffers]
    plain = torch.zeros(8)
    with kept_in_place():
        for b in buffers:
            b.share_memory_()
        plain.share_memory_()  # not in shared memory yet: moved there as usual
    assert [b.data_ptr() for b in buffers] == before
    assert plain.is_shared()
    assert torch.multiprocessing.get_sharing_strategy() == "file_system"


@pytest.mark.swarm
def test_a_future_made_while_an_averager_is_built_stays_in_place_when_it_is_sent():
    """A node failed to start with an IndexError from hivemind's `MPFuture._state`: the averager was once built with
    the process's strategy switched to "file_descriptor", so a block of futures' state bytes made meanwhile was moved
    to new memory the next time any of its futures was pickled by file name (every DHT call pickles one), copied
    with the GIL released, losing what other threads wrote during the copy."""
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        with SharedBytes._lock:
            SharedBytes._buffer = None  # the next future starts a new block: the averager's own
        tensors = shared_like([torch.zeros(16)])
        averager = RobustAverager(tensors, dht, prefix="in_place", start=False)
        neighbour = MPFuture()  # a future another thread would make next, in the same block
        assert _block(averager._ready) == _block(neighbour)
        where = _block(averager._ready)
        ForkingPickler.dumps(averager._ready)  # as a DHT call sends its future to the DHT process
        ForkingPickler.dumps(neighbour)
        assert _block(averager._ready) == where, "the block of future states moved when a future was sent"
        assert averager._averaged_tensors[0].data_ptr() == tensors[0].data_ptr()
    finally:
        dht.shutdown()
