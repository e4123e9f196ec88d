"""Logging setup shared by the CLI commands: our lines in one format, hivemind's internals quieter."""

from __future__ import annotations

import logging
import os
import sys
from types import TracebackType

QUIET = {
    "hivemind": logging.WARNING,
    # hivemind logs a traceback at ERROR whenever matchmaking finds nobody; a round without a group is normal
    # for SPES and the round reports it itself.
    "hivemind.averaging.averager": logging.CRITICAL,
    "hivemind.averaging.matchmaking": logging.ERROR,
    "hivemind.averaging.allreduce": logging.ERROR,
}


class DroppedRequestFilter(logging.Filter):
    """hivemind's DHT process logs a traceback at ERROR when it reads a request whose sender has exited since it
    sent it: a request carries a pipe end for its result, and the DHT fetches that from the sender (Python's
    `multiprocessing.resource_sharer`), which is gone. An averager that is shut down mid-matchmaking leaves such a
    request behind, so a node that stops or changes shards would print one. Nobody waits for that result any more
    and the DHT carries on: the record becomes one DEBUG line."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not (isinstance(exc, OSError) and _raised_in(exc.__traceback__, "resource_sharer.py")):
            return True
        record.msg, record.args = (
            f"dropped a request from a process that has exited ({type(exc).__name__})",
            (),
        )
        record.levelno, record.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
        record.exc_info = record.exc_text = None
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


def _raised_in(tb: TracebackType | None, filename: str) -> bool:
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.endswith(filename):
            return True
        tb = tb.tb_next
    return False


def setup_logging(level: str | int = "INFO", stream=sys.stderr) -> None:
    level = os.environ.get("SPES_LOG_LEVEL", level)
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    try:
        from hivemind.utils.logging import use_hivemind_log_handler

        use_hivemind_log_handler("nowhere")
    except ImportError:
        pass
    dht_logger = logging.getLogger("hivemind.dht.dht")
    if not any(isinstance(f, DroppedRequestFilter) for f in dht_logger.filters):
        dht_logger.addFilter(DroppedRequestFilter())
    for name, lvl in QUIET.items():
        logging.getLogger(name).setLevel(
            max(lvl, logging.getLevelName(level) if isinstance(level, str) else level)
        )
