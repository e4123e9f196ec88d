"""Logging setup shared by the CLI commands: our lines in one format, hivemind's internals quieter."""

from __future__ import annotations

import concurrent.futures
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


class BenignRaceFilter(logging.Filter):
    """Turns a traceback that hivemind logs for a known, harmless race into one DEBUG line: records whose
    exception is an `exc_type` raised in a file ending with `raised_in`."""

    def __init__(self, exc_type: type[BaseException], raised_in: str, message: str):
        super().__init__()
        self.exc_type, self.raised_in, self.message = exc_type, raised_in, message

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not (isinstance(exc, self.exc_type) and _raised_in(exc.__traceback__, self.raised_in)):
            return True
        record.msg, record.args = f"{self.message} ({type(exc).__name__})", ()
        record.levelno, record.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
        record.exc_info = record.exc_text = None
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


BENIGN_RACES = {
    # hivemind's DHT process reads a request whose sender has exited since it sent it: a request carries a pipe end
    # for its result, which the DHT fetches from the sender (`multiprocessing.resource_sharer`), and the sender is
    # gone. An averager shut down mid-matchmaking (a node that stops or changes shards) leaves one behind. Nobody
    # waits for that result any more, and the DHT carries on.
    "hivemind.dht.dht": (OSError, "resource_sharer.py", "dropped a request from a process that has exited"),
    # an averaging step cancelled while its all-reduce runs (a node that stops mid-round, or gives up an
    # unresponsive step): hivemind's averager then sets the result of the cancelled step, which raises in a task
    # nobody awaits, and asyncio logs it when the task is collected. The step was over for the node already.
    "asyncio": (
        concurrent.futures.InvalidStateError,
        "hivemind/averaging/averager.py",
        "an all-reduce finished after its step was cancelled",
    ),
}


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
    for name, (exc_type, raised_in, message) in BENIGN_RACES.items():
        race_logger = logging.getLogger(name)
        race_logger.filters[:] = [f for f in race_logger.filters if not isinstance(f, BenignRaceFilter)]
        race_logger.addFilter(BenignRaceFilter(exc_type, raised_in, message))
    for name, lvl in QUIET.items():
        logging.getLogger(name).setLevel(
            max(lvl, logging.getLevelName(level) if isinstance(level, str) else level)
        )
    # a few of hivemind's internals at DEBUG without the rest (a node at DEBUG logs every DHT request): e.g.
    # SPES_DEBUG_LOGGERS=hivemind.averaging.allreduce,hivemind.p2p.p2p_daemon for why an all-reduce lost a stream
    for name in filter(None, (n.strip() for n in os.environ.get("SPES_DEBUG_LOGGERS", "").split(","))):
        logging.getLogger(name).setLevel(logging.DEBUG)
