"""The node's event loop thread: a stream handler cancelled at shutdown is not logged as an error."""

import asyncio
import logging

from spes_node.aio import LoopThread


def test_a_cancelled_connection_handler_is_not_an_error_but_other_failures_are(caplog, tmp_path):
    thread = LoopThread("test-net")
    path = str(tmp_path / "socket")
    accepted = asyncio.Event()

    async def handler(reader, writer):
        thread.loop.call_soon(accepted.set)
        await asyncio.sleep(3600)  # a request in flight when the loop stops

    async def connect():
        server = await asyncio.start_unix_server(handler, path)
        reader, writer = await asyncio.open_unix_connection(path)
        await asyncio.wait_for(accepted.wait(), 30)
        return server, writer

    try:
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            thread.run(connect(), timeout=30)
            thread.stop()  # cancels the handler task: Python 3.11 reports that through the loop's handler
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    finally:
        thread.stop()

    other = LoopThread("test-net-2")
    try:
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            caplog.clear()
            other.loop.call_soon_threadsafe(
                other.loop.call_exception_handler, {"message": "boom", "exception": RuntimeError("boom")}
            )
            other.run(asyncio.sleep(0.1), timeout=30)
        assert "boom" in caplog.text
    finally:
        other.stop()
