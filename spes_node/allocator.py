"""The host allocator: memory a node frees goes back to the system, in the node and in its forked helpers.

glibc serves an allocation above its mmap threshold from a mapping of its own, which `free` unmaps. The threshold
starts at 128 KiB but rises to the size of each such block freed, up to 32 MiB; after that, the tensors below it
(a spes-1b node's weight, gradient, snapshot and update tensors are mostly a few MiB each) come from the heap,
where freed memory stays with the process, and where each helper forked from the node (DHT, averagers) keeps its
own copy of every heap page the node rewrites or frees afterwards. Measured with `benchmarks/host_memory.py`
(one spes-1b node on a CPU): its two averager processes held 1.4 and 0.8 GB with the threshold rising, 0.18 GB
each with it fixed at 1 MiB.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

logger = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3
"""mallopt's parameter number for the mmap threshold (malloc.h); setting it also stops the threshold rising."""
MMAP_THRESHOLD_BYTES = 1 << 20


def keep_large_blocks_mapped(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Call first thing in the node's process, before it forks helpers: blocks of `threshold` bytes and up get
    mappings of their own for the rest of the process's life, and its forks'. Not done where the user chose a
    threshold (`MALLOC_MMAP_THRESHOLD_`), nor off Linux or without glibc's mallopt. True when set."""
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    done = bool(mallopt(M_MMAP_THRESHOLD, threshold))
    if not done:
        logger.debug("mallopt refused the mmap threshold: freed host memory may stay with the process")
    return done
