"""Logging setup shared by the CLI commands: our lines in one format, hivemind's internals quieter."""

from __future__ import annotations

import logging
import os
import sys

QUIET = {
    "hivemind": logging.WARNING,
    # hivemind logs a traceback at ERROR whenever matchmaking finds nobody; a round without a group is normal
    # for SPES and the round reports it itself.
    "hivemind.averaging.averager": logging.CRITICAL,
    "hivemind.averaging.matchmaking": logging.ERROR,
    "hivemind.averaging.allreduce": logging.ERROR,
}


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
    for name, lvl in QUIET.items():
        logging.getLogger(name).setLevel(
            max(lvl, logging.getLevelName(level) if isinstance(level, str) else level)
        )
