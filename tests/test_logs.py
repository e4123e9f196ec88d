"""The node's logging setup: hivemind's internals quiet, and named loggers raised to DEBUG on request."""

from __future__ import annotations

import os
import subprocess
import sys

# one interpreter for both settings (importing hivemind costs seconds): each sets up logging again from the
# environment, as a node does once at start, and logs a line per logger and level
_SCRIPT = """
import logging, os, sys
from spes_node.logs import setup_logging

for setting in ("", "hivemind.averaging.allreduce, hivemind.p2p.p2p_daemon"):
    os.environ["SPES_DEBUG_LOGGERS"] = setting
    for name in ("hivemind.averaging.allreduce", "hivemind.p2p.p2p_daemon", "hivemind.dht.dht", "spes_node.x"):
        logging.getLogger(name).setLevel(logging.NOTSET)
    setup_logging("INFO")
    print("=== " + setting, file=sys.stderr, flush=True)
    for name in ("hivemind.averaging.allreduce", "hivemind.p2p.p2p_daemon", "hivemind.dht.dht", "spes_node.x"):
        logging.getLogger(name).debug("debug from " + name)
        logging.getLogger(name).info("info from " + name)
"""


def test_hivemind_is_quiet_by_default_and_named_loggers_log_debug_on_request():
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if not k.startswith("SPES_")},
    )
    assert done.returncode == 0, done.stderr
    default, named = done.stderr.split("=== ")[1:]
    # by default: our loggers at INFO, hivemind's at WARNING
    assert "info from spes_node.x" in default and "debug from spes_node.x" not in default, default
    assert "hivemind" not in default.split("\n", 1)[1], default
    # SPES_DEBUG_LOGGERS: the named ones at DEBUG, the rest as they were
    for name in ("hivemind.averaging.allreduce", "hivemind.p2p.p2p_daemon"):
        assert f"debug from {name}" in named and f"info from {name}" in named, named
    assert "hivemind.dht.dht" not in named and "debug from spes_node.x" not in named, named
    assert "info from spes_node.x" in named, named
