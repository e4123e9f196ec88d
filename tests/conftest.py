"""Fixtures for every test."""

from __future__ import annotations

import warnings

import pytest
from hivemind_locks import renew_wedged_hivemind_locks
from swarm_utils import loopback_dhts


@pytest.fixture(autouse=True)
def _hivemind_locks_not_left_wedged(request):
    """After each test (autouse: torn down after the test's own fixtures have stopped its processes), free
    hivemind's process-wide locks if one of the test's killed or frozen forks left one held (`hivemind_locks`);
    the run's warnings summary names the test."""
    yield
    wedged = renew_wedged_hivemind_locks()
    if wedged:
        warnings.warn(
            f"{request.node.nodeid} left {', '.join(wedged)} held: MPFuture backend reset", stacklevel=1
        )


@pytest.fixture(scope="module")
def dhts():
    """Three DHT peers on 127.0.0.1 shared by a module's tests (averagers under a new prefix per test)."""
    peers = loopback_dhts(3)
    yield peers
    for dht in peers:
        dht.shutdown()
