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


HOST = torch.device("cpu")
"""Where a round's per-round state lives whatever the training device: the anchors of update averaging, the Nesterov
outer optimizer's state and the overlap's copies of the trainable weights. Each is read and written once a round,
next to the averager's buffers, which are in host memory too; on a GPU they would cost as much GPU memory as the
trainable weights each (7.8 GiB at spes-7b)."""


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """An fp32 copy of `tensor` in host memory (a copy even when it is there already)."""
    return tensor.detach().to(HOST, torch.float32, copy=True)
