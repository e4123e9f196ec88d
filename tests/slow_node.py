"""A test-only entry point: `spes-node` whose every training step takes SECONDS longer, as on a slower GPU.

python tests/slow_node.py SECONDS join ...
"""

from __future__ import annotations

import sys
import time

from spes_node.cli.main import run
from spes_node.daemon.trainer import Trainer


def slowed(seconds: float):
    original = Trainer.train_step

    def train_step(self: Trainer, *args, **kwargs):
        stats = original(self, *args, **kwargs)
        time.sleep(seconds)  # the slower card's extra time per step (the fault this entry point stands for)
        return stats

    return train_step


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: slow_node.py SECONDS join ...")
    Trainer.train_step = slowed(float(sys.argv.pop(1)))
    run()
