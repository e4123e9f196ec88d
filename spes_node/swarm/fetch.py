"""Fetching state from the swarm: which peers to ask (`progress.rank_holders`), falling back to the next holder and,
for a shard nobody holds, to the frozen copies others keep ("copy:<j>"), through relays where a peer takes no
direct connections. A large part with several holders comes from several of them at once (`split`). The round (refresh, catch-up, rebalance), joiners and `export --peers` share it.

The fetcher remembers which peers proved themselves (they served us valid state, or averaged with us) and which
failed us (asked last next time), and never takes a part older than the round it asked for.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection, Mapping, Sequence

import torch
from hivemind.p2p import P2P, PeerID

from spes_node.swarm import relay
from spes_node.swarm.progress import rank_holders
from spes_node.swarm.records import ACTIVE_STATES, NodeInfo
from spes_node.swarm.split import join_pieces, piece_count, piece_order, plan_pieces
from spes_node.swarm.swarm_key import SwarmKey
from spes_node.swarm.transfer import Download, TransferError, download_part

logger = logging.getLogger(__name__)

Shapes = Mapping[str, torch.Size]


class StateFetcher:
    """Downloads parts of the model state ("shared", "shard:<j>", "copy:<j>", "premerge:<j>", "update:<j>": see
    `snapshots`) from live peers."""

    def __init__(
        self,
        p2p: P2P,
        run_id: str,
        config_hash: str,
        *,
        timeout: float,
        swarm_key: SwarmKey | None = None,
        me: str = "",
    ):
        self.p2p, self.run_id, self.config_hash = p2p, run_id, config_hash
        self.timeout, self.swarm_key, self.me = timeout, swarm_key, me
        self.verified: set[str] = set()
        """Peers that proved themselves: they served us valid state or averaged with us."""
        self.failed: dict[str, int] = {}
        """Peers whose downloads failed, with how often; they are asked last."""
        self.circuits: dict[str, list[str]] = {}
        """Relay addresses of peers that take no direct connections, from their last records."""

    def vouch(self, peers: Collection[str]) -> None:
        """Peers that averaged with us: asked first."""
        self.verified.update(peer for peer in peers if peer != self.me)

    def holders(
        self, nodes: Mapping[str, NodeInfo], shard: int | None, excluded: Collection[str] = ()
    ) -> list[str]:
        """Peers to download a shard from (None: the shared parameters, from anyone), best first."""
        self.learn_circuits(nodes)
        servable = {peer: n for peer, n in nodes.items() if relay.serves_state(n)}
        return rank_holders(
            servable,
            shard=shard,
            me=self.me,
            active_states=ACTIVE_STATES,
            excluded=excluded,
            verified=self.verified,
            failed=self.failed,
        )

    def learn_circuits(self, nodes: Mapping[str, NodeInfo]) -> None:
        """Remember the relay addresses the records give for peers that take no direct connections."""
        self.circuits.update({peer: relay.circuits_of(peer, n.maddrs) for peer, n in nodes.items()})

    def sources(
        self, nodes: Mapping[str, NodeInfo], shard: int, excluded: Collection[str] = ()
    ) -> tuple[list[str], str]:
        """(peers, part) for a shard: its holders and "shard:<j>", or, without any, every server and "copy:<j>"."""
        peers = self.holders(nodes, shard, excluded)
        if peers:
            return peers, f"shard:{shard}"
        return self.holders(nodes, None, excluded), f"copy:{shard}"

    async def fetch(
        self,
        peers: list[str],
        part: str,
        expected: Shapes,
        min_round: int = 0,
        exact: bool = False,
        split: bool = True,
    ) -> tuple[str, Download]:
        """(peer, download) of `part` of round `min_round` or later (exactly `min_round`, with `exact`) from `peers`,
        best first, each failing one replaced by the next; TransferError when they cannot serve all of it.

        A large part with several holders is split (`split.piece_count`): its pieces come from as many holders at
        once, a piece whose holder fails from the next holder, every piece of the round asked for; the download is
        of its oldest piece's round. Such a download holds no one holder's state: `peer` is the one that sent the
        most bytes and `download.peers` names them all. With `split=False` one holder serves the whole part: for a
        copy that will follow that holder's updates ("update:<j>" fits only the chain of who served the copy). When the
        pieces cannot all be had, the whole part is asked for from one holder at a time."""
        count = piece_count(expected, len(peers)) if split else 1
        failing: set[str] = set()  # peers that failed a piece: the other pieces do not ask them again
        if count == 1:
            download = await self._first_of(peers, part, expected, min_round, exact, None, failing)
            return download.peers[0], download
        start = time.perf_counter()
        tasks = [
            asyncio.create_task(
                self._first_of(piece_order(peers, i, count), part, expected, min_round, exact, names, failing)
            )
            for i, names in enumerate(plan_pieces(expected, count))
        ]
        try:
            pieces = await asyncio.gather(*tasks)
        except TransferError as e:
            # a holder that serves whole parts only (an older version ignores the names asked for) fails every
            # piece; so would a piece nobody has at the round asked for. Whole, from one holder at a time, as an
            # unsplit download would have been asked for
            logger.warning(f"{part} did not come in pieces ({e}); asking for it whole")
            download = await self._first_of(peers, part, expected, min_round, exact, None, set())
            return download.peers[0], download
        finally:
            for task in tasks:
                task.cancel()
        download = join_pieces(pieces, time.perf_counter() - start)
        logger.info(
            f"{part}: {len(pieces)} pieces from {len(download.peers)} holders, {download.nbytes} bytes"
        )
        return download.peers[0], download

    async def _first_of(
        self,
        peers: Sequence[str],
        part: str,
        expected: Shapes,
        min_round: int,
        exact: bool,
        names: list[str] | None,
        failing: set[str],
    ) -> Download:
        """`part` (only `names`, unless None) from the first of `peers` that serves it of the round asked for,
        skipping the peers in `failing` and adding those that fail."""
        what = part if names is None else f"{len(names)} tensors of {part}"
        last_error = None
        for peer in peers:
            if peer in failing:
                continue
            try:
                download = await self._download(peer, part, expected, min_round, names, exact)
                if download.round < min_round or (exact and download.round != min_round):
                    raise TransferError(
                        f"{part} from {peer} is of round {download.round}, we asked for {min_round}"
                    )
            except TransferError as e:
                last_error = e
                self.failed[peer] = self.failed.get(peer, 0) + 1
                failing.add(peer)
                logger.warning(f"download of {what} failed: {e}")
                continue
            self.verified.add(peer)
            self.failed.pop(peer, None)
            return download
        raise TransferError(f"no peer could serve {what}: {last_error or 'none left to ask'}")

    async def fetch_update(self, peer: str, part: str, expected: Shapes, round_: int) -> Download | None:
        """`part` of exactly round `round_` from `peer` (an update: only the chain of the peer that served our copy
        fits it), or None. A peer on another round, or whose chain started again, is not at fault: it is neither
        counted as failed nor warned about (the whole shard, fetched next, counts the peers that fail it)."""
        try:
            download = await self._download(peer, part, expected, round_, exact=True)
        except TransferError as e:
            logger.info(f"no {part} of round {round_}: {e}")
            return None
        if download.round != round_:
            logger.info(f"no {part} of round {round_}: {peer} serves round {download.round}")
            return None
        return download

    async def _download(
        self,
        peer: str,
        part: str,
        expected: Shapes,
        min_round: int,
        names: list[str] | None = None,
        exact: bool = False,
    ) -> Download:
        return await download_part(
            self.p2p,
            PeerID.from_base58(peer),
            self.run_id,
            self.config_hash,
            part,
            expected,
            min_round=min_round,
            timeout=self.timeout,
            circuits=self.circuits.get(peer, ()),
            swarm_key=self.swarm_key,
            names=names,
            max_round=min_round if exact else None,
        )
