"""One large part downloaded from several of its holders at once: how many pieces (`piece_count`), which tensors
each piece holds (`plan_pieces`, balanced by size), which holders a piece asks in turn (`piece_order`), and the
pieces put back together (`join_pieces`). `StateFetcher.fetch` runs the downloads."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from spes_node.swarm.transfer import Download

SPLIT_MIN_BYTES = 4 << 20
"""A part is split only from this size on (fp32 bytes, 4 MiB: a million parameters). Each piece costs a stream of
its own, maybe a new connection (through a relay, several round trips), and the server's wait for its snapshot;
below a few MiB, which a volunteer's uplink of some tens of Mbit/s sends in about a second, those fixed costs are as
large as what a second holder's link saves. The tiny preset's parts (under 2 MiB) are therefore never split."""

MAX_PIECES = 4
"""A part is split across at most this many holders: each more one divides the time less, while every piece
waits for its slowest holder and a failed piece starts again elsewhere."""


def part_bytes(expected: Mapping[str, torch.Size]) -> int:
    """The part's size in fp32 bytes (what the codec sends scales with it alike for every tensor)."""
    return 4 * sum(shape.numel() for shape in expected.values())


def piece_count(expected: Mapping[str, torch.Size], holders: int) -> int:
    """Into how many pieces to split a part that `holders` peers serve: 1 (not split) below `SPLIT_MIN_BYTES`,
    else one per holder, at most `MAX_PIECES` and at most one per tensor."""
    if part_bytes(expected) < SPLIT_MIN_BYTES:
        return 1
    return max(1, min(holders, MAX_PIECES, len(expected)))


def plan_pieces(expected: Mapping[str, torch.Size], count: int) -> list[list[str]]:
    """The part's tensors in `count` disjoint pieces (none empty) of about equal size: the largest tensor first,
    each into the piece that is smallest so far (ties: by name, so that every node splits alike)."""
    count = min(count, len(expected))
    pieces: list[list[str]] = [[] for _ in range(count)]
    sizes = [0] * count
    for name in sorted(expected, key=lambda n: (-expected[n].numel(), n)):
        i = min(range(count), key=lambda j: (sizes[j], j))
        pieces[i].append(name)
        sizes[i] += expected[name].numel()
    return pieces


def piece_order(peers: Sequence[str], index: int, count: int) -> list[str]:
    """The holders piece `index` of `count` asks, in turn: its own (the `index`-th), then those that serve no
    piece, then the other pieces' holders (ranked as in `peers`)."""
    return [peers[index], *peers[count:], *peers[:index], *peers[index + 1 : count]]


def join_pieces(pieces: Sequence[Download], seconds: float) -> Download:
    """One download of the pieces' tensors: of the oldest piece's round, with every piece's bytes, from every
    piece's peer (the one that sent the most bytes first)."""
    sent: dict[str, int] = {}
    tensors: dict[str, torch.Tensor] = {}
    for piece in pieces:
        assert not tensors.keys() & piece.tensors.keys(), "pieces are disjoint"
        tensors.update(piece.tensors)
        for peer in piece.peers:
            sent[peer] = sent.get(peer, 0) + piece.nbytes
    return Download(
        round=min(piece.round for piece in pieces),
        tensors=tensors,
        nbytes=sum(piece.nbytes for piece in pieces),
        seconds=seconds,
        peers=tuple(sorted(sent, key=lambda peer: -sent[peer])),
    )
