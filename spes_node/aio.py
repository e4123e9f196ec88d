"""One asyncio event loop (uvloop) in a background thread: the node's networking runs here, torch code never waits on it mid-step."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

import uvloop

T = TypeVar("T")


class LoopThread:
    def __init__(self, name: str = "spes-net"):
        self.loop = uvloop.new_event_loop()
        self.loop.set_exception_handler(_quiet_cancellations)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return self.submit(coro).result(timeout)

    def stop(self) -> None:
        """Cancel what is still running in the loop, then stop it."""
        if not self.loop.is_running():
            return

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            self.run(cancel_all(), timeout=5)
        except Exception:
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)


def _quiet_cancellations(loop: asyncio.AbstractEventLoop, context: dict) -> None:
    """Python 3.11's stream server reports a connection handler task that was cancelled (as `stop` cancels every
    task, with a peer's request in flight) as an error with a traceback: a cancellation is not an error. Anything
    else goes to the default handler."""
    if isinstance(context.get("exception"), asyncio.CancelledError):
        return
    loop.default_exception_handler(context)
