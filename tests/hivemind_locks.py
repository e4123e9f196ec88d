"""hivemind's process-wide locks, and what a test that kills its own forks leaves behind in them.

hivemind's MPFuture (`_update_lock`, `_initialization_lock`) and SharedBytes (`_lock`) guard their pipes and
shared memory with multiprocessing locks made at import and inherited by every fork. A DHT or averager process
forked from a test worker and killed or frozen (the attack and fault tests do both) while it holds one leaves it
held for good: every later fork of that worker that sends a result waits on it forever, so the next test's DHT
never becomes ready (seen in a loaded suite run: two network-namespace tests in a row each waited out their
600 s timeout in `DHT.wait_until_ready`, their DHT processes in `MPFuture._send_update`)."""

from __future__ import annotations

from hivemind.utils.mpfuture import MPFuture, SharedBytes

HELD_FOR_GOOD_S = 10.0
"""A lock held this long is wedged: a live process holds one only for a pipe write or a shared-memory allocation."""


def hivemind_locks() -> dict[str, object]:
    return {
        "MPFuture._update_lock": MPFuture._update_lock,
        "MPFuture._initialization_lock": MPFuture._initialization_lock,
        "SharedBytes._lock": SharedBytes._lock,
    }


def renew_wedged_hivemind_locks(wait_s: float = HELD_FOR_GOOD_S) -> list[str]:
    """Call between tests, once a test's processes are gone: when one of the locks stays held, reset hivemind's
    MPFuture backend (`MPFuture.reset_backend`: new locks, a new result pipe for this process), so that the
    processes forked from here on start with free ones. Futures still pending in this process break, which is
    why it is done only when a lock is wedged. Returns the names of the locks that were."""
    wedged = []
    for name, lock in hivemind_locks().items():
        if lock.acquire(timeout=wait_s):
            lock.release()
        else:
            wedged.append(name)
    if wedged:
        MPFuture.reset_backend()
    return wedged
