"""The node keeps large host blocks in mappings of their own (`spes_node.allocator`), so that what it frees goes
back to the system instead of staying in a heap that its forked helpers hold copies of."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from spes_node.allocator import keep_large_blocks_mapped

PROBE = """
import sys, torch
from spes_node.allocator import keep_large_blocks_mapped
if sys.argv[1] == "fixed":
    assert keep_large_blocks_mapped()
big = torch.ones(16 << 20, dtype=torch.uint8)
del big  # glibc raises its mmap threshold to the size of a mapped block freed
tensor = torch.ones(2 << 20, dtype=torch.uint8)
for line in open("/proc/self/maps"):
    fields = line.split()
    low, high = (int(x, 16) for x in fields[0].split("-"))
    if low <= tensor.data_ptr() < high:
        print(fields[5] if len(fields) > 5 else "anonymous")
"""


def _mapping_of_a_2mib_tensor(mode: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    done = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, env=env, timeout=120, check=True
    )
    return done.stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_tensor_freed_after_a_large_one_is_mapped_on_its_own_only_with_the_threshold_fixed():
    # without: a 2 MiB tensor after a 16 MiB one was freed comes from the heap (what forked helpers keep copies of)
    assert _mapping_of_a_2mib_tensor("default") == "[heap]"
    assert _mapping_of_a_2mib_tensor("fixed") == "anonymous"


def test_a_threshold_the_user_chose_is_left_alone(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "4194304")
    assert keep_large_blocks_mapped() is False
