"""A test-only entry point: `spes-node` whose averagers contribute corrupted tensors to every all-reduce.

    python tests/faulty_node.py FAULT join ...     FAULT: nan, inf or huge (random values of norm ~1e4 per element)

Anyone can run such a node: it is the released code with one subclass swapped in, so what the honest nodes
withstand here they withstand from a stranger.
"""

from __future__ import annotations

import sys

import torch

from spes_node.cli.main import run
from spes_node.daemon import round as round_module
from spes_node.swarm.averaging import GroupAverager

FAULTS = ("nan", "inf", "huge")


def corrupted(tensor: torch.Tensor, fault: str) -> torch.Tensor:
    if fault == "nan":
        return torch.full_like(tensor, float("nan"))
    if fault == "inf":
        return torch.full_like(tensor, float("inf"))
    return torch.randn_like(tensor) * 1e4


def faulty_averager(fault: str) -> type[GroupAverager]:
    class FaultyAverager(GroupAverager):
        """Hands the all-reduce corrupted copies instead of the node's weights."""

        def step(self, tensors, weight, gather, wait_extra=0.0, **kwargs):
            bad = {name: corrupted(t.detach().float().cpu(), fault) for name, t in tensors.items()}
            return super().step(bad, weight, gather, wait_extra, **kwargs)

    return FaultyAverager


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in FAULTS:
        sys.exit(f"usage: faulty_node.py {{{'|'.join(FAULTS)}}} join ...")
    round_module.GroupAverager = faulty_averager(sys.argv.pop(1))
    run()
