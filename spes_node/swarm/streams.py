"""Streaming RPCs whose receiver closes first, so that the end of a stream is never lost.

hivemind's streaming handlers end by closing their side as soon as their last message is written. p2pd then
closes its libp2p stream, and yamux's `Stream.Close` is `CloseRead` then `CloseWrite`: `CloseRead` wakes the
daemon's other copy loop, whose read now fails, and that loop resets the stream. When the reset wins the race
against `CloseWrite`'s FIN, the receiving daemon marks the stream reset and drops whatever it holds that its client
has not read yet: a receiver that reads slower than the link (a loaded machine, large messages) loses the stream's
last messages. An all-reduce member then reported "peer X sent 16 parts, but we expected 18" and kept its own
values for that part, and a refresh download ended early and was fetched again.

So the side that knows when a stream is complete ends it: the receiver takes the messages it expects and closes
(`take`), and the serving handler, after its last message, waits for that close (`linger`) instead of closing
first. When the receiver has closed, everything was read; when a receiver never closes (it failed, or reads until
the end as hivemind's own clients do), the handler ends after `LINGER_SECONDS` as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

T = TypeVar("T")

LINGER_SECONDS = 30.0
"""How long a handler that sent everything waits for its receiver to close: long enough for a window of data
still in flight to arrive over a slow link (16 MiB at 10 Mbit/s takes 13 s)."""


async def linger(seconds: float = LINGER_SECONDS) -> None:
    """Wait, after a handler's last message, for the receiver to close the stream: hivemind then cancels the
    handler, and this raises CancelledError. Returns once `seconds` passed first (the handler then ends, closing
    its side, as hivemind's do)."""
    await asyncio.sleep(seconds)


async def take(stream: AsyncIterator[T], done: Callable[[T, int], bool]) -> AsyncIterator[T]:
    """The messages of `stream` up to the one for which `done(message, count so far)` is true, then the stream is
    closed: our side ends it once we hold all we expect. A stream that ends earlier ends here too."""
    count = 0
    try:
        async for message in stream:
            count += 1
            yield message
            if done(message, count):
                break
    finally:
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            await aclose()
