"""The SPES round: what a node does after H local steps.

1. shared parameters averaged over every node that reaches the round within the matchmaking window;
2. the node's shard averaged among its replicas only (both all-reduces run at the same time);
3. frozen experts refreshed from their holders every `refresh_every` rounds, in the background;
4. the expert-merging warm-up on the node's own experts, when due.
No step waits for a particular peer: a group of one is a no-op, a failed all-reduce keeps the local weights.
A node's round moves by one per round; it jumps ahead only by catching up to a round most other nodes report
(`progress.should_catch_up`), taking their weights instead of averaging its old ones into theirs.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
import weakref
from typing import TYPE_CHECKING

import torch
from hivemind.p2p import PeerID
from hivemind.utils.timed_storage import get_dht_time

from spes_node.aio import LoopThread
from spes_node.daemon.placement import data_part, plan_rebalance
from spes_node.model.merge import merge_alpha, merge_due, merge_layer
from spes_node.model.ownership import load_shard_tensors, shard_tensors, shared_parameters
from spes_node.swarm import records, relay
from spes_node.swarm.averaging import (
    GroupAverager,
    GroupResult,
    NesterovOuter,
    PlainAverage,
    wire_compression,
)
from spes_node.swarm.progress import rank_holders, should_catch_up, wait_for_peers
from spes_node.swarm.robust import BanList
from spes_node.swarm.transfer import Snapshot, StateServer, TransferError, download_part

if TYPE_CHECKING:
    from spes_node.daemon.node import Node

logger = logging.getLogger(__name__)


class SpesRound:
    def __init__(self, node: Node):
        self.node = node
        self.cfg = node.cfg
        self.loop = LoopThread()
        self._pending: dict[int, dict[str, torch.Tensor]] = {}
        self._pending_lock = threading.Lock()
        self._refresh: concurrent.futures.Future | None = None
        self.shared_avg: GroupAverager | None = None
        self.shard_avg: GroupAverager | None = None
        self.last_report: dict = {}
        self._inflight: dict | None = None
        self.bans = BanList()
        self._circuits: dict[str, list[str]] = {}
        """Relay addresses of peers that take no direct connections, from their last records."""
        self._frozen_snapshots: dict[int, tuple[list, dict[str, torch.Tensor]]] = {}
        """Served copies of frozen shards, with weak references to the buffers they were copied from."""
        self._verified: set[str] = set()
        """Peers that proved themselves: they served us valid state or averaged with us."""
        self._failed: dict[str, int] = {}
        """Peers whose downloads failed, with how often; they are asked last."""
        self._round_started = time.perf_counter()
        self._round_seconds: float | None = None
        """How long our last round took (local steps and sync)."""

    # ------------------------------------------------------------------ setup

    def start(self) -> None:
        node, swarm = self.node, self.cfg.swarm
        self.p2p = self.loop.run(node.dht.replicate_p2p())
        self.server = StateServer(
            self.p2p,
            node.opts.run_id,
            node.config_hash,
            wire_compression(swarm.wire_compression),
            swarm_key=node.opts.swarm_key,
        )
        self.loop.run(self.server.start())
        self.shared_avg = self._averager("shared", self._shared_cpu())
        self.shard_avg = self._averager(f"shard{node.shard}", self._shard_cpu(node.shard))
        self.shared_outer = self._outer(shared_parameters(node.model))
        self.shard_outer = self._outer(shard_tensors(node.model, node.shard))
        self.publish_snapshots()

    def _averager(self, group: str, tensors: dict[str, torch.Tensor]) -> GroupAverager:
        """The averager of one group; its key carries the run id and the config hash."""
        swarm = self.cfg.swarm
        return GroupAverager(
            self.node.dht,
            f"{self.node.opts.run_id}_{self.node.config_hash[:16]}_{group}",
            tensors,
            compression=swarm.wire_compression,
            matchmaking_time=swarm.matchmaking_time,
            allreduce_timeout=swarm.averaging_timeout,
            client_mode=self.node.opts.client_mode,
            bans=self.bans,
            swarm_key=self.node.opts.swarm_key,
            max_weight=float(self.cfg.swarm.sync_steps * self.tokens_per_step()),
        )

    def tokens_per_step(self) -> int:
        """The most tokens a node trains on in one step (what bounds a peer's averaging weight)."""
        train = self.cfg.train
        return train.micro_batch_size * train.grad_accum * (train.seq_len + 1)

    def outer_state_dict(self) -> dict:
        """The outer optimisers' state, for checkpoints (empty for the plain average)."""
        return {
            kind: outer.state_dict()
            for kind, outer in (("shared", self.shared_outer), ("shard", self.shard_outer))
            if isinstance(outer, NesterovOuter)
        }

    def load_outer_state_dict(self, state: dict) -> None:
        for kind, outer, like in (
            ("shared", self.shared_outer, shared_parameters(self.node.model)),
            ("shard", self.shard_outer, shard_tensors(self.node.model, self.node.shard)),
        ):
            if isinstance(outer, NesterovOuter) and kind in state:
                outer.load_state_dict(state[kind], like)

    def _outer(self, start: dict[str, torch.Tensor]):
        """The outer optimiser of one group, starting from the weights the next round begins with."""
        swarm = self.cfg.swarm
        if swarm.outer_optimizer != "nesterov":
            return PlainAverage()
        outer = NesterovOuter(swarm.outer_lr, swarm.outer_momentum)
        outer.remember(start)
        return outer

    def _shared_cpu(self) -> dict[str, torch.Tensor]:
        """An fp32 CPU copy of the shared parameters (never a view of the live weights)."""
        return _cpu_copy(shared_parameters(self.node.model))

    def _shard_cpu(self, shard: int) -> dict[str, torch.Tensor]:
        return _cpu_copy(shard_tensors(self.node.model, shard))

    def _frozen_snapshot(self, shard: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """A CPU copy of a frozen shard, made again only when the shard's weights changed.

        Frozen weights are never changed in place: a refresh or merge stores new buffers (`ExpertShard.load_dense`),
        so the buffers' identity tells whether the last copy is still current. Weak references, so that the cache
        neither keeps replaced buffers alive nor mistakes a new buffer at a reused address for the old one.
        """
        buffers = [b for s in self.node.model.expert_shards(shard) for b in s.buffers()]
        cached = self._frozen_snapshots.get(shard)
        if cached is not None:
            refs, tensors = cached
            if len(refs) == len(buffers) and all(r() is b for r, b in zip(refs, buffers)):
                return tensors
        tensors = _cpu_copy(shard_tensors(self.node.model, shard), dtype)
        self._frozen_snapshots[shard] = ([weakref.ref(b) for b in buffers], tensors)
        return tensors

    def publish_snapshots(self, premerge: bool = False) -> None:
        """Serve the state as it is now: shared parameters and own shard (copies), frozen copies of the rest.

        With `premerge`, the own shard is also served as "premerge:<j>" for this round's merge inputs.
        """
        node = self.node
        round_ = node.status.round
        # what is served travels at wire precision anyway: keep the snapshots at that precision, not fp32
        dtype = torch.float16 if self.cfg.swarm.wire_compression == "fp16" else torch.float32
        parts = {"shared": _cpu_copy(shared_parameters(node.model), dtype)}
        for shard in range(self.cfg.swarm.num_shards):
            own = shard == node.shard
            if own:
                tensors = _cpu_copy(shard_tensors(node.model, shard), dtype)
                self._frozen_snapshots.pop(shard, None)
            else:
                tensors = self._frozen_snapshot(shard, dtype)
            parts[f"{'shard' if own else 'copy'}:{shard}"] = tensors
            self.loop.run(self.server.withdraw(f"{'copy' if own else 'shard'}:{shard}"))
            if own and premerge:
                parts[f"premerge:{shard}"] = tensors
            else:  # a premerge snapshot lives for its round only (slower replicas still fetch it after our merge)
                stale = self.server.snapshots.get(f"premerge:{shard}")
                if stale is not None and (not own or stale.round < round_):
                    self.loop.run(self.server.withdraw(f"premerge:{shard}"))
        for part, tensors in parts.items():
            self.loop.run(self.server.publish(part, Snapshot(round_, tensors)))

    # ------------------------------------------------------------------ the round

    def begin_round(self, overlap: bool) -> None:
        """Start both all-reduces on a copy of the weights. With `overlap`, training goes on meanwhile and
        `complete_round` later applies the average together with the local progress made since."""
        node = self.node
        node.status.state = "averaging"
        node.publish_record()
        self.finish_pending()
        gather = (node.status.round, node.trainer.step, node.tokens_since_sync)
        weight = float(max(node.tokens_since_sync, 1))
        shared_local = shared_parameters(node.model)
        shard_local = shard_tensors(node.model, node.shard)
        nodes = records.fetch_nodes(
            node.dht, node.opts.run_id, self.cfg.swarm.num_shards
        )  # the round's one read
        others = self._live_peers(nodes)
        replicas = {peer: n for peer, n in others.items() if node.shard in n.shards}
        # wait for peers that are about to finish this round, so that a node that fell out of step (a pause, a slow
        # step) meets the others again instead of missing them round after round
        extra = wait_for_peers(
            others,
            round_=node.status.round,
            sync_steps=self.cfg.swarm.sync_steps,
            tokens_per_step=self.tokens_per_step(),
            now=get_dht_time(),
            # at most one round: the published method waits for everyone (a barrier); we wait for whoever is
            # expected within a round, and a node slower than that meets the others at a later round
            cap=self._round_seconds if self._round_seconds else self.cfg.swarm.matchmaking_time,
            default_tokens_per_s=node.status.tokens_per_s,
        )
        logger.info(
            f"round {node.status.round + 1}: looking for groups ({len(others)} live peers"
            + (f", waiting up to {extra:.1f}s more for peers about to finish" if extra > 0 else "")
            + ")"
        )
        self._inflight = {
            "started": time.perf_counter(),
            "loss": node.end_round_loss(),
            "nodes": nodes,
            "shared": self.shared_avg.step(shared_local, weight, gather, extra) if others else None,
            "shard": self.shard_avg.step(shard_local, weight, gather, extra) if replicas else None,
            "sent_shared": _clone(shared_local) if overlap else None,
            "sent_shard": _clone(shard_local) if overlap else None,
        }
        if overlap:
            node.status.state = "training"

    def round_in_flight(self) -> bool:
        return self._inflight is not None

    def round_ready(self) -> bool:
        """True when the in-flight round's all-reduces are finished (never blocks)."""
        flight = self._inflight
        return flight is not None and all(
            flight[kind] is None or flight[kind][0].done() for kind in ("shared", "shard")
        )

    def complete_round(self) -> None:
        node = self.node
        flight, self._inflight = self._inflight, None
        shared_result, shared_avg = self._finish(self.shared_avg, flight["shared"])
        shard_result, shard_avg = self._finish(self.shard_avg, flight["shard"])
        for result, averaged, local, sent, outer, kind in (
            (shared_result, shared_avg, shared_parameters(node.model), flight["sent_shared"], self.shared_outer, "shared"),
            (shard_result, shard_avg, shard_tensors(node.model, node.shard), flight["sent_shard"], self.shard_outer, "shard"),
        ):  # fmt: skip
            node.status.add_bytes(kind, result.bytes_sent, result.bytes_received)
            apply_outer(outer, local, sent, averaged)
            self._verified.update(peer for peer in result.peers if peer != node.peer_id)
        # one round further, whatever the group claimed: no peer's claim moves the round (see `progress`)
        node.status.round += 1
        self._round_seconds = time.perf_counter() - self._round_started
        self._round_started = time.perf_counter()

        refreshed, merged, caught_up = 0, False, None
        if not node.stop_event.is_set():  # a stopping node skips what talks to other peers
            nodes = flight["nodes"]
            target = should_catch_up(node.status.round, (n.round for n in self._live_peers(nodes).values()))
            if target is not None:
                caught_up = self.catch_up(nodes, target)
            refreshed, merged = self._refresh_and_merge(nodes)
            self.maybe_rebalance(dict(nodes))
            self.settle_data_part(nodes)
        seconds = time.perf_counter() - flight["started"]
        errors = [r.error for r in (shared_result, shard_result) if r.error]
        self.last_report = {
            "round": node.status.round,
            "loss": flight["loss"],
            "shared_group": shared_result.group_size,
            "shard_group": shard_result.group_size,
            "bytes_shared": shared_result.bytes_sent + shared_result.bytes_received,
            "bytes_shard": shard_result.bytes_sent + shard_result.bytes_received,
            "seconds": seconds,
            "overlapped": flight["sent_shared"] is not None,
            "failed_parts": shared_result.failed_reducers + shard_result.failed_reducers,
            "errors": errors,
            "banned": sorted(self.bans.active()),
            "merged": merged,
            "refreshed": refreshed,
            "caught_up": caught_up,
        }
        logger.info(
            f"round {node.status.round} done: loss {flight['loss']:.4f}, shared group {shared_result.group_size}, "
            f"shard {node.shard} group {shard_result.group_size}, "
            f"{(self.last_report['bytes_shared'] + self.last_report['bytes_shard']) / 1e6:.2f} MB averaged, "
            f"{seconds:.1f}s"
            + (" (overlapped)" if self.last_report["overlapped"] else "")
            + (", merged" if merged else "")
            + (f", refreshed {refreshed}" if refreshed else "")
            + (f", caught up to round {caught_up}" if caught_up is not None else "")
        )
        for error in errors:
            logger.warning(f"round {node.status.round}: {error}")
        node.status.state = "training"

    def _refresh_and_merge(self, nodes: dict) -> tuple[int, bool]:
        """Refresh frozen experts (in the background) and run the merge warm-up when due; (refreshed, merged)."""
        node, swarm = self.node, self.cfg.swarm
        due_refresh = node.status.round % swarm.refresh_every == 0
        sync_step = node.status.round * swarm.sync_steps
        due_merge = merge_due(sync_step, swarm.merge_interval, swarm.merge_alpha0, swarm.merge_horizon)
        # The merge reads every expert as it was before anyone merged: holders serve that state as
        # "premerge:<j>" for this round only, and every node merges from the same copies, so replicas stay identical.
        self.publish_snapshots(premerge=due_merge)
        if due_refresh or due_merge:
            self.start_refresh(nodes, min_round=node.status.round, kind="premerge" if due_merge else "shard")
        if not due_merge:
            return 0, False
        refreshed = self.finish_pending()
        self.merge(sync_step)
        self.publish_snapshots()
        return refreshed, True

    def catch_up(self, nodes: dict, target: int) -> int | None:
        """Take the swarm's weights (own shard included) after missing rounds; the round reached, or None."""
        node = self.node
        logger.info(f"round {node.status.round} is behind the swarm's {target}: taking the swarm's weights")
        before = node.status.round
        self.download_swarm_state(nodes, include_own=True, min_round=target)
        return node.status.round if node.status.round > before else None

    def _live_peers(self, nodes: dict) -> dict:
        """Other nodes that may be averaging now; when there are none, the round is a local no-op."""
        return {
            peer: n
            for peer, n in nodes.items()
            if peer != self.node.peer_id and n.state in records.ACTIVE_STATES and peer not in self.bans
        }

    def _finish(self, averager: GroupAverager, handle):
        if handle is None:
            return GroupResult(1, 0.0, 0, 0), None
        control, _ = handle
        while not control.done():
            if self.node.stop_event.wait(0.1):
                control.cancel()
                break
        return averager.finish(handle)

    # ------------------------------------------------------------------ frozen experts

    def _holders(self, nodes: dict, shard: int | None) -> list[str]:
        """Peers to download a shard from (None: the shared parameters, from anyone), best first."""
        self._circuits.update({peer: relay.circuits_of(peer, n.maddrs) for peer, n in nodes.items()})
        servable = {peer: n for peer, n in nodes.items() if relay.serves_state(n)}
        return rank_holders(
            servable,
            shard=shard,
            me=self.node.peer_id,
            active_states=records.ACTIVE_STATES,
            excluded=self.bans.active(),
            verified=self._verified,
            failed=self._failed,
        )

    def _expected(self, part: str) -> dict[str, torch.Size]:
        if part == "shared":
            return {k: v.shape for k, v in shared_parameters(self.node.model).items()}
        shard = int(part.split(":")[1])
        return {k: v.shape for k, v in shard_tensors(self.node.model, shard).items()}

    async def _download_from(self, peers: list[str], part: str, min_round: int, exact: bool = False):
        """`part` from the first of `peers` that serves it at round `min_round` or later (exactly, with `exact`)."""
        last_error = None
        for peer in peers:
            try:
                download = await download_part(
                    self.p2p,
                    PeerID.from_base58(peer),
                    self.node.opts.run_id,
                    self.node.config_hash,
                    part,
                    self._expected(part),
                    min_round=min_round,
                    timeout=self.cfg.swarm.averaging_timeout,
                    circuits=self._circuits.get(peer, ()),
                    swarm_key=self.node.opts.swarm_key,
                )
                if download.round < min_round or (exact and download.round != min_round):
                    raise TransferError(
                        f"{part} from {peer} is of round {download.round}, we asked for {min_round}"
                    )
            except TransferError as e:
                last_error = e
                self._failed[peer] = self._failed.get(peer, 0) + 1
                logger.warning(f"download of {part} failed: {e}")
                continue
            self._verified.add(peer)
            self._failed.pop(peer, None)
            return download
        raise TransferError(f"no peer could serve {part}: {last_error}")

    def start_refresh(self, nodes: dict, min_round: int, kind: str = "shard") -> None:
        node = self.node
        wanted = [s for s in range(self.cfg.swarm.num_shards) if s != node.shard]
        holders = {shard: self._holders(nodes, shard) for shard in wanted}

        async def refresh():
            count = 0
            for shard in wanted:
                if not holders[shard]:
                    continue
                try:
                    download = await self._download_from(
                        holders[shard], f"{kind}:{shard}", min_round, exact=kind == "premerge"
                    )
                except TransferError as e:
                    logger.warning(f"refresh of shard {shard} skipped: {e}")
                    continue
                node.status.add_bytes("refresh", 0, download.nbytes)
                with self._pending_lock:
                    self._pending[shard] = download.tensors
                count += 1
            return count

        self._refresh = self.loop.submit(refresh())

    def apply_pending(self) -> int:
        """Load downloaded frozen experts into the model (between steps, on the training thread)."""
        with self._pending_lock:
            pending, self._pending = self._pending, {}
        for shard, tensors in pending.items():
            if shard != self.node.shard:
                load_shard_tensors(self.node.model, shard, tensors)
        return len(pending)

    def finish_pending(self) -> int:
        """Wait for the refresh in flight (at most its timeout; a stopping node does not wait) and apply it.

        A refresh that outlives its timeout is cancelled: what it has not delivered by then is never applied."""
        if self._refresh is not None:
            deadline = time.monotonic() + self.cfg.swarm.averaging_timeout * self.cfg.swarm.num_shards
            while not self._refresh.done() and time.monotonic() < deadline:
                if self.node.stop_event.is_set():
                    break
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
        return self.apply_pending()

    # ------------------------------------------------------------------ merge

    @torch.no_grad()
    def merge(self, sync_step: int) -> None:
        swarm, model, shard = self.cfg.swarm, self.node.model, self.node.shard
        alpha = merge_alpha(sync_step, swarm.merge_alpha0, swarm.merge_horizon)
        if alpha <= 0:
            return
        for layer in model.model.layers:
            dense = [s.dense() for s in layer.mlp.shards]
            gate_up = torch.cat([g for g, _ in dense]).float()
            down = torch.cat([d for _, d in dense]).float()
            own = layer.mlp.shards[shard]
            update = list(range(own.start, own.start + own.n))
            new_gate_up, new_down = merge_layer(gate_up, down, alpha, swarm.merge_topk, update)
            own.load_dense(
                new_gate_up[own.start : own.start + own.n], new_down[own.start : own.start + own.n]
            )

    # ------------------------------------------------------------------ joining and moving

    def download_swarm_state(self, nodes: dict, include_own: bool, min_round: int = 0) -> None:
        """Take the swarm's current weights: shared parameters, every shard (own shard only if `include_own`),
        each of round `min_round` or later."""
        node = self.node
        start = time.perf_counter()
        total = 0
        shared_peers = self._holders(nodes, None)
        if not shared_peers:
            return
        try:
            shared = self.loop.run(self._download_from(shared_peers, "shared", min_round))
        except TransferError as e:
            logger.warning(f"starting from local weights: {e}")
            return
        with torch.no_grad():
            for name, p in shared_parameters(node.model).items():
                p.copy_(shared.tensors[name])
        total += shared.nbytes
        node.status.round = max(node.status.round, shared.round)
        for shard in range(self.cfg.swarm.num_shards):
            if shard == node.shard and not include_own:
                continue
            peers = self._holders(nodes, shard)
            part = f"shard:{shard}"
            if not peers:
                peers, part = shared_peers, f"copy:{shard}"
            try:
                download = self.loop.run(self._download_from(peers, part, min_round))
            except TransferError as e:
                logger.warning(f"shard {shard} keeps its local weights: {e}")
                continue
            load_shard_tensors(node.model, shard, download.tensors)
            total += download.nbytes
        node.trainer.step = max(node.trainer.step, node.status.round * self.cfg.swarm.sync_steps)
        node.status.add_bytes("state_download", 0, total)
        self.shared_outer = self._outer(shared_parameters(node.model))
        self.shard_outer = self._outer(shard_tensors(node.model, node.shard))
        self.publish_snapshots()
        node.join_seconds = time.perf_counter() - start
        logger.info(
            f"downloaded the swarm state ({total / 1e6:.2f} MB) in {node.join_seconds:.1f}s, round {node.status.round}"
        )

    def settle_data_part(self, nodes: dict | None = None) -> None:
        """Move to another data part if a node with a smaller peer id reads ours, or narrow or widen ours as nodes
        come and go (`sharding.data_part`).

        `nodes`: the swarm's records, if just read; our own is ignored."""
        node, swarm = self.node, self.cfg.swarm
        if nodes is None:
            nodes = records.fetch_nodes(node.dht, node.opts.run_id, swarm.num_shards)
        nodes = {peer: n for peer, n in nodes.items() if peer != node.peer_id}
        current = node.data_part[0]
        part, num_parts = data_part(nodes, node.peer_id, current=current)
        if (part, num_parts) == tuple(node.data_part):
            return
        if part == current:
            logger.info(
                f"data part {part}: {num_parts} parts instead of {node.data_part[1]} (nodes came or went)"
            )
        else:
            logger.info(f"data part {current} is also read by a node with a smaller peer id: taking {part}")
        node.batcher.set_part(part, num_parts)
        # announced by the next heartbeat: a DHT store here would delay this node's next step
        node.data_part = (part, num_parts)

    def maybe_rebalance(self, nodes: dict) -> None:
        """`nodes`: the swarm's records as just read (changed here)."""
        node, swarm = self.node, self.cfg.swarm
        nodes[node.peer_id] = node.node_info()
        new = plan_rebalance(nodes, node.peer_id, swarm.num_shards, swarm.replication_target)
        if new is None or new == node.shard:
            return
        peers = self._holders(nodes, new)
        part = f"shard:{new}"
        if not peers:
            peers, part = self._holders(nodes, None), f"copy:{new}"
        try:
            download = self.loop.run(self._download_from(peers, part, 0)) if peers else None
        except TransferError as e:
            logger.warning(f"not moving to shard {new}: {e}")
            return
        logger.info(f"moving from shard {node.shard} to under-replicated shard {new}")
        old = node.shard
        node.trainer.set_ownership([new])
        if download is not None:
            load_shard_tensors(node.model, new, download.tensors)
        node.shard = new
        self.shard_avg.shutdown()
        self.shard_avg = self._averager(f"shard{new}", self._shard_cpu(new))
        self.shard_outer = self._outer(shard_tensors(node.model, new))
        self.publish_snapshots()  # the data part is the node's, whatever its shard: it stays
        node.publish_record()
        logger.info(f"now training shard {new} (was {old})")

    def helper_processes(self) -> list:
        """The averager processes (to be killed if they do not stop)."""
        return [a.averager for a in (self.shared_avg, self.shard_avg) if a is not None]

    def shutdown(self) -> None:
        if self._refresh is not None:
            self._refresh.cancel()
        for averager in (self.shared_avg, self.shard_avg):
            if averager is not None:
                averager.shutdown()
        try:
            self.loop.run(self.server.stop(), timeout=2)
            self.loop.run(self.p2p.shutdown(), timeout=2)
        except Exception as e:
            logger.debug(f"p2p shutdown: {e}")
        self.loop.stop()


def _cpu_copy(
    tensors: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    return {name: t.detach().to("cpu", dtype, copy=True) for name, t in tensors.items()}


def _clone(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in tensors.items()}


@torch.no_grad()
def apply_outer(outer, local: dict, sent: dict | None, averaged: dict | None) -> None:
    """Apply a round's result to the live weights.

    Without overlap (`sent` is None) the outer step acts on the weights directly. With overlap, the weights moved on
    after `sent` was handed to the all-reduce: the outer step acts on `sent`, and the local progress made since
    (local - sent) is added back on top of the new global weights.
    """
    if averaged is None:
        if isinstance(outer, NesterovOuter):
            outer.remember(sent if sent is not None else local)
        return
    target = sent if sent is not None else local
    delta = {k: local[k] - sent[k] for k in local} if sent is not None else None
    outer.apply(target, {k: v.to(target[k].device) for k, v in averaged.items()})
    if delta is not None:
        for k, tensor in local.items():
            tensor.copy_(target[k] + delta[k])
