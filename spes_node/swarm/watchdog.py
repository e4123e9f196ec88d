"""Whether the node's own DHT process still serves it.

The averagers work through the DHT process's p2pd and its DHT, so without it nothing of the node reaches the swarm;
a node that went on would train alone for good, each DHT call waiting out its timeout round after round. The
heartbeat thread asks here once a heartbeat, without waiting: the process has exited (the OOM killer, a crash), its
p2pd has, or it has not answered a call that needs no network for `hang_s` seconds (stopped, or wedged on a lock
that a dead process held). The node then stops as on a signal, final checkpoint included, and exits with a failure for its
supervisor to start it again."""

from __future__ import annotations

import time

import hivemind

HANG_HEARTBEATS = 30
"""Heartbeats without an answer after which the DHT process counts as hung: 60 s at tiny, 15 min at spes-7b. A
loaded machine delays an answer by seconds, not by this."""
HANG_CHECKS = 3
"""Checks in a row that must find the same call unanswered: a machine suspended with a call in flight (a laptop
asleep for hours) finds it unanswered once on waking, and answered at the next check."""


async def _answer(_dht, node) -> int | None:
    """Runs in the DHT process, and needs its loop and nothing else (no peer, no network): the exit code of its p2pd,
    None while it runs (`tests/test_helper_faults.py` checks where hivemind keeps that process)."""
    p2pd = getattr(node.p2p, "_child", None)
    return None if p2pd is None else p2pd.returncode


def p2pd_exit_code(dht: hivemind.DHT, timeout: float = 10.0) -> int | None:
    """The exit code of `dht`'s p2pd, None while it runs or when the DHT process does not answer within `timeout`
    seconds (a loaded machine: that is a hang's question, `DHTWatch`'s, not this one's)."""
    try:
        return dht.run_coroutine(_answer, return_future=True).result(timeout)
    except Exception:
        return None


class DHTWatch:
    def __init__(self, dht: hivemind.DHT, hang_s: float):
        self.dht, self.hang_s = dht, hang_s
        self._probe = None
        self._answered = time.monotonic()
        self._unanswered_checks = 0

    def problem(self) -> str | None:
        """Why the DHT process no longer serves the node, or None while it does. Never blocks."""
        if not self.dht.is_alive():
            return f"the DHT process exited (code {self.dht.exitcode})"
        now = time.monotonic()
        if self._probe is not None and not self._probe.done():
            self._unanswered_checks += 1
            waited = now - self._answered
            if waited > self.hang_s and self._unanswered_checks >= HANG_CHECKS:
                return f"the DHT process has not answered for {waited:.0f}s (hung)"
            return None
        if self._probe is not None:
            self._answered = now  # answered (a call that failed in it still means its loop runs)
            if self._probe.exception() is None and (code := self._probe.result()) is not None:
                return f"the DHT process's p2pd exited (code {code})"
        self._probe = self.dht.run_coroutine(_answer, return_future=True)
        self._unanswered_checks = 0
        return None
