"""Frozen experts: a node's copies of the shards it does not train, kept fresh from their holders.

Every `refresh_every` rounds each frozen shard is downloaded in the background (`FrozenCopies.start`), every shard
at once (or `swarm.refresh_parallel` at a time, a slot given back as a shard is loaded), each from its own holders:
by the holder's update since the last refresh when the copy is of that refresh and came from that holder
(`refresh_by_update`), by the whole shard otherwise. An update is added to the copy as soon as it
arrives, off the training thread; what arrived waits at snapshot precision until the training thread loads it
between steps (`apply`). A round waits for the refresh in flight, at most its timeout, before it reads the swarm's
records (`finish`); a refresh past its timeout is cancelled and never applied.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, replace
from functools import partial

import torch

from spes_node.aio import LoopThread
from spes_node.config import SpesConfig, SwarmConfig
from spes_node.model.moe import MoEForCausalLM
from spes_node.model.ownership import load_shard_tensors, shard_tensors
from spes_node.swarm import records
from spes_node.swarm.fetch import StateFetcher
from spes_node.swarm.snapshots import add_update
from spes_node.swarm.transfer import Download, TransferError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HeldCopy:
    """A frozen copy that holds a holder's served state: its round, that holder, and how many updates in a row it
    has followed since it took the whole shard. A copy that will follow updates is downloaded whole from its holder;
    one split across holders (`StateFetcher.fetch`, only where copies follow no updates) names the one that sent the
    most."""

    round: int
    peer: str
    updates: int = 0


@dataclass
class Refresh:
    """A frozen shard's download, applied between steps: `part` ("shard", "premerge" or "update") from `peer`. For an
    update, `download` holds the copy with the update already added (`FrozenCopies.follow`) and `base` the copy it
    was added to: it is applied only if that copy is still the one held."""

    part: str
    peer: str
    download: Download
    base: HeldCopy | None = None
    release: Callable[[], None] | None = None
    """Gives back the refresh's download slot (`swarm.refresh_parallel`) once the shard is loaded or dropped."""


class FrozenCopies:
    """The refreshes of one node's frozen shards: what each copy holds (`held`), the refresh in flight and what it
    delivered. `fetcher` and `dtype` (the precision snapshots are served at) are set once the node serves state."""

    def __init__(
        self, cfg: SpesConfig, model: MoEForCausalLM | None, loop: LoopThread, stop_event: threading.Event
    ):
        self.cfg, self.model, self.loop, self.stop_event = cfg, model, loop, stop_event
        self.fetcher: StateFetcher | None = None
        self.dtype = torch.float16
        self.held: dict[int, HeldCopy] = {}
        """Frozen shard -> what its copy holds, when that is a holder's served state (see `refresh_by_update`)."""
        self._pending: dict[int, Refresh] = {}
        self._pending_lock = threading.Lock()
        self._refresh: concurrent.futures.Future | None = None
        self._bytes = 0
        """Bytes downloaded by background refreshes since the last call of `take_bytes`."""

    def start(
        self,
        nodes: Mapping[str, records.NodeInfo],
        min_round: int,
        own: Collection[int],
        excluded: Collection[str],
        kind: str = "shard",
    ) -> None:
        """Download every shard not in `own` of round `min_round` or later (exactly, for "premerge") in the
        background, each from its own holders: by the update that follows the copy when `refresh_by_update` says
        so, falling back to the whole shard when that fails (or to nothing, when the copy is already of
        `min_round`); `apply` loads them."""
        swarm = self.cfg.swarm
        wanted = [s for s in range(swarm.num_shards) if s not in own]
        holders = {shard: self.fetcher.holders(nodes, shard, excluded) for shard in wanted}
        expected = {shard: shard_shapes(self.model, shard) for shard in wanted}
        by_update = {
            shard: self.held[shard]
            for shard in wanted
            if kind == "shard" and refresh_by_update(self.held.get(shard), min_round, holders[shard], swarm)
        }
        # a copy that will follow its holder's updates comes whole from that holder, never split across several
        follows = kind == "shard" and swarm.refresh_by_updates

        async def one(shard: int, slots: asyncio.Semaphore | None) -> Refresh | None:
            if slots is None:
                return await download(shard, None)
            await slots.acquire()
            release = partial(_release_soon, self.loop, slots)
            try:
                refresh = await download(shard, release)
            except BaseException:
                slots.release()
                raise
            if refresh is None:
                slots.release()
            return refresh

        async def download(shard: int, release: Callable[[], None] | None) -> Refresh | None:
            """The shard's refresh, put where `apply` finds it (and gives its slot back), or None."""
            refresh, held, spent = None, by_update.get(shard), 0
            if held is not None:
                update = await self.fetcher.fetch_update(
                    held.peer, f"update:{shard}", expected[shard], held.round + swarm.refresh_every
                )
                if update is not None:
                    # added to the copy now, off the training thread: what waits for the next round is the new
                    # copy at snapshot precision, not the decoded update in fp32 beside it
                    refresh = await asyncio.to_thread(self.follow, shard, held, update)
                    spent = 0 if refresh is not None else update.nbytes  # a misfit: the whole shard next
                elif held.round >= min_round:
                    return None  # the copy is of the round asked for already
            if refresh is None:
                try:
                    peer, whole = await self.fetcher.fetch(
                        holders[shard],
                        f"{kind}:{shard}",
                        expected[shard],
                        min_round,
                        exact=kind == "premerge",
                        split=not follows,
                    )
                except TransferError as e:
                    logger.warning(f"refresh of shard {shard} skipped: {e}")
                    return None
                refresh = Refresh(kind, peer, whole)
            refresh.release = release
            with self._pending_lock:
                self._bytes += refresh.download.nbytes + spent
                self._pending[shard] = refresh
            return refresh

        async def refresh():
            # every shard at once (or `refresh_parallel` at a time), each from its own holders: the downloads share
            # the links of several peers instead of taking turns. A shard's slot is given back once it is loaded
            # between steps, so that no more than that many are ever held
            slots = asyncio.Semaphore(swarm.refresh_parallel) if swarm.refresh_parallel else None
            done = await asyncio.gather(*(one(shard, slots) for shard in wanted if holders[shard]))
            done = [r for r in done if r is not None]
            by_part = {}
            for r in done:
                count, nbytes = by_part.get(r.part, (0, 0))
                by_part[r.part] = (count + 1, nbytes + r.download.nbytes)
            if by_part:
                logger.info(
                    f"refresh of round {min_round}: "
                    + ", ".join(
                        f"{count} {part} ({nbytes} bytes)" for part, (count, nbytes) in by_part.items()
                    )
                )
            return len(done)

        self._refresh = self.loop.submit(refresh())

    @property
    def in_flight(self) -> bool:
        """A refresh is still downloading: `finish` would wait for it."""
        return self._refresh is not None and not self._refresh.done()

    def take_bytes(self) -> int:
        """Bytes the background refreshes downloaded since the last call."""
        with self._pending_lock:
            nbytes, self._bytes = self._bytes, 0
        return nbytes

    def apply(self, own: Collection[int]) -> int:
        """Load downloaded frozen experts into the model (between steps, on the training thread): a whole shard as
        it is, an update added to the copy; shards in `own` (trained here since) are skipped. Returns how many
        shards changed."""
        with self._pending_lock:
            pending, self._pending = self._pending, {}
        applied = 0
        while pending:
            shard, refresh = pending.popitem()
            release = refresh.release
            applied += self._load(shard, refresh, own)
            del refresh  # its download is let go before the next shard's may begin
            if release is not None:
                release()
        return applied

    def _load(self, shard: int, refresh: Refresh, own: Collection[int]) -> int:
        """One shard's refresh into the model (1), or not (0: trained here now, or its update fits no more)."""
        if shard in own:
            return 0
        held = self.held.pop(shard, None)
        if refresh.part == "update" and held != refresh.base:
            logger.warning(
                f"shard {shard}: the copy changed while its update of round {refresh.download.round} "
                "downloaded: not applied"
            )
            return 0
        load_shard_tensors(self.model, shard, refresh.download.tensors)
        # a premerge copy is no round's served shard: the next refresh takes the whole shard
        if refresh.part != "premerge":
            updates = held.updates + 1 if refresh.part == "update" else 0
            self.held[shard] = HeldCopy(refresh.download.round, refresh.peer, updates)
        return 1

    def follow(self, shard: int, held: HeldCopy, download: Download) -> Refresh | None:
        """An update from `held.peer` added to the frozen copy of `shard` that `held` describes
        (`snapshots.add_update`, at snapshot precision), ready to load; None when the update is not of the refresh
        after the copy (`refresh_every` rounds on) or the sum is not finite. Runs beside training: it only reads the copy, which nothing but
        `apply` (on the training thread, after this) replaces."""
        round_ = download.round
        if round_ != held.round + self.cfg.swarm.refresh_every:
            logger.warning(f"shard {shard}: the update of round {round_} is not for our copy: not applied")
            return None
        current = shard_tensors(self.model, shard)
        out = {}
        for name, delta in download.tensors.items():
            out[name] = add_update(current[name], delta, self.dtype)
            if not torch.isfinite(out[name]).all():
                logger.warning(f"shard {shard}: the update of round {round_} from {held.peer} overflows")
                return None
        return Refresh("update", held.peer, replace(download, tensors=out), base=held)

    def finish(self, own: Collection[int]) -> int:
        """Wait for the refresh in flight (at most its timeout; a stopping node does not wait) and apply it.

        A refresh that outlives its timeout is cancelled: what it has not delivered by then is never applied."""
        applied = 0
        if self._refresh is not None:
            deadline = time.monotonic() + self.cfg.swarm.averaging_timeout * self.cfg.swarm.num_shards
            while not self._refresh.done() and time.monotonic() < deadline:
                if self.stop_event.is_set():
                    break
                # what has arrived is loaded meanwhile: with `refresh_parallel`, the next downloads wait for it
                applied += self.apply(own)
                try:
                    self._refresh.result(timeout=0.2)
                except concurrent.futures.TimeoutError:
                    continue
                except Exception as e:
                    logger.warning(f"refresh failed: {e}")
            if not self._refresh.done():
                self._refresh.cancel()
                logger.warning("refresh did not finish in time: cancelled")
            self._refresh = None
        return applied + self.apply(own)

    def cancel(self) -> None:
        """Stop the refresh in flight (the node is stopping)."""
        if self._refresh is not None:
            self._refresh.cancel()


def _release_soon(loop: LoopThread, slots: asyncio.Semaphore) -> None:
    """Give a download slot back from another thread (the training thread, once the shard is loaded)."""
    try:
        loop.loop.call_soon_threadsafe(slots.release)
    except RuntimeError:  # the loop has stopped (the node is stopping): no download waits for the slot
        pass


def shard_shapes(model: MoEForCausalLM, shard: int) -> dict[str, torch.Size]:
    """The names and shapes of a shard's tensors: what a download of it must hold."""
    return {k: v.shape for k, v in shard_tensors(model, shard).items()}


def refresh_due(round_: int, swarm: SwarmConfig) -> bool:
    """Frozen experts are refreshed after every `refresh_every`-th round."""
    return round_ % swarm.refresh_every == 0


LOSSY_UPDATE_CHAIN = 4
"""A frozen copy stored in bf16 or int8 follows at most this many updates in a row, then takes the whole shard:
its storage rounds every sum (and drops an update smaller than half its precision), and over a chain of updates
those roundings add up instead of staying within one."""


def refresh_by_update(
    held: HeldCopy | None, round_: int, holders: Collection[str], swarm: SwarmConfig
) -> bool:
    """Whether a frozen copy is refreshed for round `round_` by the update that follows it (its holder's change
    over the `refresh_every` rounds after `held.round`, against what that holder served) rather than the whole
    shard: the copy is of a refresh round (holders' update chains step only on those), of the last refresh or later
    (a holder may count one round more than we do), it came from a holder we may still ask, and a copy stored
    lossily has not yet followed `LOSSY_UPDATE_CHAIN` updates."""
    every = swarm.refresh_every
    if not swarm.refresh_by_updates or held is None or held.peer not in holders:
        return False
    if held.round % every != 0 or held.round < round_ - every:
        return False
    return swarm.frozen_dtype == "fp32" or held.updates < LOSSY_UPDATE_CHAIN
