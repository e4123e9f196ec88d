"""A group's anchor and how a round's result moves the live weights.

A group's anchor is its weights at the last sync. Averaging weights, the plain average lands as its difference
to the weights handed over (`apply_difference`), and a Nesterov step acts on the averaged weights
(`apply_outer`). Averaging updates, the round's averaged pseudo-gradient is applied to the anchor, which becomes
the new weights and the next anchor (`apply_update`).
Anchors have ids: members that shared an anchor and applied the same average agree on the next id
(`settle_anchor`); a node whose anchor the group did not share takes the group's weights once, within a bound
(`resync_acceptable`). Pure functions: the round (`round.py`) owns the anchors and calls these.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from spes_node.swarm.averaging import NesterovOuter, next_anchor_id


@torch.no_grad()
def apply_difference(local: dict, difference: dict | None) -> None:
    """The plain average of weights, from its difference to the weights handed over (`averaging.MODES`), into the
    live weights: the average, plus whatever was trained since the hand-over (nothing when training waited)."""
    if difference is None:
        return
    for name, tensor in local.items():
        tensor.add_(difference[name].to(tensor.device, tensor.dtype))


@torch.no_grad()
def apply_outer(outer, local: dict, sent: dict | None, averaged: dict | None) -> None:
    """Apply a round's result to the live weights.

    Without overlap (`sent` is None) the outer step acts on the weights directly. With overlap, the weights moved on
    after `sent` (a copy in host memory) was handed to the all-reduce: the outer step gives the new global weights,
    and the local progress made since (local - sent) is added back on top (`_keep_progress`).
    """
    if averaged is None:
        if isinstance(outer, NesterovOuter):
            outer.remember(sent if sent is not None else local)
        return
    with _keep_progress(local, sent):
        outer.apply(local, averaged)  # each tensor copied where it is needed, not the group at once


def initial_anchor_id(config_hash: str) -> str:
    """The anchor id of the config's seeded initial weights: the same on every fresh node of a swarm."""
    return next_anchor_id(f"init:{config_hash}", [], 0)


@dataclass(frozen=True)
class AnchorDecision:
    new_id: str | None
    """The group's next anchor id for us; None: an id of our own (nobody shares our weights)."""
    take_id: str | None = None
    """When most of the group shared another anchor: its next id, which we take with its weights."""
    take_from: list[str] = field(default_factory=list)
    """The members that shared that anchor (whom to download the group's weights from)."""


def settle_anchor(
    mine: str, anchors: Mapping[str, str | None], all_averaged: bool, round_: int
) -> AnchorDecision:
    """After a round averaging updates: the members that shared our anchor applied the same average to the same
    weights, so they agree on the next id (`next_anchor_id` of the old id, those members, the round). When the
    anchor most members shared (ties: the smallest id) is not ours, we are to take that anchor's weights.

    `anchors`: each member's anchor id (ourselves included), empty when no group formed. `all_averaged`: every
    part of the vector was averaged (otherwise members hold different results: nobody shares an anchor)."""
    if not anchors or not all_averaged:
        return AnchorDecision(None)
    by_id: dict[str, list[str]] = {}
    for peer, anchor_id in anchors.items():
        if anchor_id is not None:
            by_id.setdefault(anchor_id, []).append(peer)
    if mine not in by_id:
        return AnchorDecision(None)
    best = min(by_id, key=lambda anchor_id: (-len(by_id[anchor_id]), anchor_id))
    ours = next_anchor_id(mine, by_id[mine], round_)
    if best == mine:
        return AnchorDecision(ours)
    return AnchorDecision(ours, next_anchor_id(best, by_id[best], round_), sorted(by_id[best]))


@torch.no_grad()
def apply_update(outer, local: dict, sent: dict | None, anchor: dict, update: dict | None) -> None:
    """Averaging updates: apply a round's averaged pseudo-gradient to the anchor, which becomes the new weights
    (and the next anchor). Without a group, the trained weights are the new anchor (with overlap: those handed
    over). With overlap, as `apply_outer`: the local progress made since `sent` is added back on top."""
    if update is None:
        handed = sent if sent is not None else local
        if isinstance(outer, NesterovOuter):
            outer.remember(handed)
        else:
            for name, tensor in anchor.items():
                tensor.copy_(handed[name])
        return
    with _keep_progress(local, sent):
        if isinstance(outer, NesterovOuter):
            outer.apply_update(local, anchor, update)  # remembers the new weights as its next anchor
        else:
            for name, tensor in anchor.items():
                tensor.sub_(update[name].to(tensor.device))
                local[name].copy_(tensor)


@contextmanager
def _keep_progress(local: dict, sent: dict | None) -> Iterator[None]:
    """Around an outer step that writes the new global weights into `local`: with overlap, the progress made since
    `sent` was handed over is kept and added back on top. It is worked out in place of `sent`, tensor by tensor
    (the copy is spent: it was only kept for this), so landing a group takes no second copy of it in host memory."""
    if sent is not None:
        for name, tensor in local.items():
            sent[name].neg_().add_(tensor.to(sent[name].device))
    yield
    if sent is not None:
        for name, tensor in local.items():
            tensor.add_(sent[name].to(tensor.device))


RESYNC_UPDATES = 8.0
"""How many of a round's averaged updates (by norm) a group's weights may lie from ours to be taken."""
RESYNC_RELATIVE = 2e-3
"""Plus this fraction of our weights' norm: fp16 snapshots round each weight by up to 2^-11 of itself."""


def update_norm(update: Mapping[str, torch.Tensor] | None) -> float:
    if not update:
        return 0.0
    return float(torch.sqrt(sum(t.float().pow(2).sum() for t in update.values())))


@torch.no_grad()
def resync_acceptable(
    downloaded: Mapping[str, torch.Tensor], current: Mapping[str, torch.Tensor], norm: float
) -> str | None:
    """None when `downloaded` (a group's weights, from peers) is finite and within RESYNC_UPDATES averaged updates
    (`norm`) plus RESYNC_RELATIVE of our weights' norm of ours; else why not. Bounds what a group whose anchor
    claims are false can do to a node that follows them: move it by a few rounds' worth of updates."""
    distance, own = 0.0, 0.0
    for name, mine in current.items():
        theirs = downloaded[name].float().to(mine.device)
        if not torch.isfinite(theirs).all():
            return f"{name} is not finite"
        distance += float((theirs - mine.float()).pow(2).sum())
        own += float(mine.float().pow(2).sum())
    distance, own = distance**0.5, own**0.5
    bound = RESYNC_UPDATES * norm + RESYNC_RELATIVE * own
    if distance > bound:
        return (
            f"they are {distance:.4g} from ours, more than {bound:.4g} ({RESYNC_UPDATES:g} rounds' updates)"
        )
    return None
