"""Which torch device a node or a command runs on."""

from __future__ import annotations

import torch


def resolve_device(device: str) -> torch.device:
    """`auto` (CUDA when available), `cpu`, `cuda` or `cuda:N`; ValueError for anything else."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: cuda requested but no CUDA device is available")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ValueError(f"device: expected auto, cpu or cuda, got '{device}'")
    return torch.device(device)
