"""The node's logging setup: hivemind's internals quiet, and named loggers raised to DEBUG on request."""

from __future__ import annotations

import os
import subprocess
import sys

_SCRIPT = """
import logging
from spes_node.logs import setup_logging

setup_logging("INFO")
for name in ("hivemind.averaging.allreduce", "hivemind.p2p.p2p_daemon", "hivemind.dht.dht", "spes_node.x"):
    logging.getLogger(name).debug("debug from " + name)
    logging.getLogger(name).info("info from " + name)
"""


def _stderr(env: dict[str, str]) -> str:
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if not k.startswith("SPES_")} | env,
    )
    assert done.returncode == 0, done.stderr
    return done.stderr


def test_hivemind_is_quiet_and_our_loggers_log_info_by_default():
    out = _stderr({})
    assert "info from spes_node.x" in out and "debug from spes_node.x" not in out
    assert "hivemind" not in out, out


def test_named_loggers_log_debug_and_the_rest_stay_as_they_were():
    out = _stderr({"SPES_DEBUG_LOGGERS": "hivemind.averaging.allreduce, hivemind.p2p.p2p_daemon"})
    for name in ("hivemind.averaging.allreduce", "hivemind.p2p.p2p_daemon"):
        assert f"debug from {name}" in out and f"info from {name}" in out, out
    assert "hivemind.dht.dht" not in out and "debug from spes_node.x" not in out, out
    assert "info from spes_node.x" in out
