"""Writing files and directories so that a crash at any moment leaves the old or the new version whole."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Make the entries of directory `path` (renames, new files) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_dir(tmp: Path, final: Path, *, durable: bool = False) -> None:
    """Put the directory `tmp` at `final`, replacing whatever is there.

    The old `final` is first renamed to `.old-<name>-<random>` beside it and removed only once `tmp` is in place,
    so a crash leaves either version whole (a leftover `.old-*` is the previous version). With `durable`, the
    renames are fsynced."""
    retired = None
    if final.exists():
        retired = final.parent / f".old-{final.name}-{uuid.uuid4().hex[:12]}"
        os.replace(final, retired)
    os.replace(tmp, final)
    if durable:
        fsync_dir(final.parent)
    if retired is not None:
        shutil.rmtree(retired, ignore_errors=True)


def write_text_atomic(path: Path, text: str) -> None:
    """Write `path` through a temporary sibling and a rename."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
