"""Expert-merging warm-up: early in training, pull each expert a little towards its most similar peers."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def merge_alpha(step: int, alpha0: float, horizon: int) -> float:
    """Merge strength at ``step``: alpha0 decaying linearly to zero at ``horizon``."""
    if horizon <= 0:
        raise ValueError(f"horizon must be positive, got {horizon}")
    return alpha0 * (1.0 - min(step / horizon, 1.0))


def merge_step_due(step: int, interval: int) -> bool:
    """Whether the merge runs at this (sync) step."""
    if interval <= 0:
        raise ValueError(f"interval must be positive, got {interval}")
    return step % interval == 0


def merge_due(step: int, interval: int, alpha0: float, horizon: int) -> bool:
    """Whether a merge (and the premerge download it needs) happens at this sync step: on the interval, while
    the warm-up's alpha is still above zero."""
    return merge_step_due(step, interval) and merge_alpha(step, alpha0, horizon) > 0


def merge_layer(
    gate_up: torch.Tensor, down: torch.Tensor, alpha: float, k: int, update: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge the experts of one MoE layer and return new ``(gate_up, down)`` tensors.

    ``gate_up`` is [E, 2I, H] with the gate rows first, ``down`` is [E, H, I] (transformers' OLMoE
    layout). Experts are compared by cosine similarity of their flattened gate projections; each
    expert i in ``update`` becomes theta_i + alpha * mean_j(theta_j - theta_i) over its K most
    similar other experts (K = min(k, E - 1)), for gate, up and down together, all computed from the
    values before the merge. Experts not in ``update`` keep their values.
    """
    num_experts, two_inter, hidden = gate_up.shape
    inter = two_inter // 2
    if two_inter != 2 * inter:
        raise ValueError(f"gate_up must have an even second dimension, got shape {tuple(gate_up.shape)}")
    if tuple(down.shape) != (num_experts, hidden, inter):
        raise ValueError(f"down must have shape {(num_experts, hidden, inter)}, got {tuple(down.shape)}")
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    rows = sorted(set(update))
    if any(not 0 <= expert < num_experts for expert in rows):
        raise ValueError(f"update must hold expert indices in [0, {num_experts}), got {list(update)}")

    new_gate_up, new_down = gate_up.detach().clone(), down.detach().clone()
    num_neighbours = min(k, num_experts - 1)
    if not rows or num_neighbours == 0 or alpha == 0.0:
        return new_gate_up, new_down

    with torch.no_grad():
        gate_up32, down32 = gate_up.detach().float(), down.detach().float()
        index = torch.tensor(rows, device=gate_up.device)
        gates = torch.nn.functional.normalize(gate_up32[:, :inter, :].reshape(num_experts, -1), dim=1)
        similarity = gates[index] @ gates.T
        similarity[torch.arange(len(rows), device=gate_up.device), index] = float("-inf")
        neighbours = similarity.topk(num_neighbours, dim=1).indices

        for target, source in ((new_gate_up, gate_up32), (new_down, down32)):
            own = source[index]
            pulled = own + alpha * (source[neighbours].mean(dim=1) - own)
            target[index] = pulled.to(target.dtype)
    return new_gate_up, new_down
