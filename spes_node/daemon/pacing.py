"""When a node's round has another local step: its first H, then, while it waits for slower peers, as long as
another step ends before the slowest of them is due (`swarm.train_while_waiting`).

The node reads how long its round would wait (`SpesRound.wait_ahead`) once it reaches step H and hands it to
`RoundPacer.wait`; the pacer keeps a moving average of the step time, says whether another step fits, and tells
when the node expects to sync, which its record announces (`NodeInfo.sync_at`) so that peers reaching the sync
meanwhile wait for it in turn. Time is `time.perf_counter` here and DHT time in the record.
"""

from __future__ import annotations

import time

from spes_node.swarm.progress import another_step_fits

STEP_TIME_SMOOTHING = 0.3
"""Weight of the latest step in the moving average of the step time."""


class RoundPacer:
    def __init__(self, sync_steps: int, enabled: bool = True):
        self.sync_steps, self.enabled = sync_steps, enabled
        self.step_seconds: float | None = None
        """A moving average of the training step's duration (None before the first step)."""
        self._until: float | None = None
        """While training through a wait: when to stop (`time.perf_counter`)."""
        self._asked = False

    def note_step(self, seconds: float) -> None:
        previous = self.step_seconds
        self.step_seconds = (
            seconds
            if previous is None
            else STEP_TIME_SMOOTHING * seconds + (1 - STEP_TIME_SMOOTHING) * previous
        )

    def another_step(self, steps_into_round: int) -> bool:
        """Whether the round has another local step: its first H, then while training through a wait."""
        if steps_into_round < self.sync_steps:
            return True
        if self._until is None or self.step_seconds is None:
            return False
        return another_step_fits(self._until - time.perf_counter(), self.step_seconds)

    def wants_wait(self) -> bool:
        """Whether to ask how long the round would wait: once a round, once a step time is known."""
        return self.enabled and not self._asked and self.step_seconds is not None

    def wait(self, seconds: float) -> bool:
        """The round would wait `seconds` for its slowest expected peer: train through it if a step fits."""
        self._asked = True
        if self.step_seconds is None or not another_step_fits(seconds, self.step_seconds):
            return False
        self._until = time.perf_counter() + seconds
        return True

    def seconds_to_sync(self, steps_into_round: int) -> float | None:
        """How long until the node syncs, while it trains (None before the first step)."""
        if self.step_seconds is None:
            return None
        if self._until is not None:
            return max(self._until - time.perf_counter(), 0.0)
        return max(self.sync_steps - steps_into_round, 0) * self.step_seconds

    def new_round(self) -> None:
        self._until, self._asked = None, False
