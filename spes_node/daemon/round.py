"""The SPES round: what a node does after H local steps.

1. shared parameters averaged over every node that reaches the round within the matchmaking window;
2. each shard the node trains averaged among its replicas only (all all-reduces run at the same time);
3. frozen experts refreshed from their holders every `refresh_every` rounds, in the background (`frozen`): by the
   holder's update of the round when the node's copy is one round old, by the whole shard otherwise;
4. the expert-merging warm-up on the node's own experts, when due.
No step waits for a particular peer: a group of one is a no-op, a failed all-reduce keeps the local weights.
A node's round moves by one per round; it jumps ahead only by catching up to a round most other nodes report
(`progress.should_catch_up`), taking their weights instead of averaging its old ones into theirs.

`SpesRound` is a component of the node: it is handed what it needs (config, DHT, model, the swarm's records read
once per round) and returns what happened (`RoundReport`, `StateTaken`) for the node to apply. The decisions it
takes are the pure functions at the end of this module.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field, replace
from functools import partial

import hivemind
import torch
from hivemind.utils.timed_storage import get_dht_time

from spes_node.aio import LoopThread
from spes_node.config import SpesConfig, SwarmConfig
from spes_node.daemon.anchors import (
    apply_difference,
    apply_outer,
    apply_update,
    initial_anchor_id,
    resync_acceptable,
    settle_anchor,
    update_norm,
)
from spes_node.daemon.frozen import FrozenCopies, HeldCopy, refresh_due, shard_shapes
from spes_node.daemon.placement import data_part, plan_rebalance_move
from spes_node.devices import to_host
from spes_node.model.merge import merge_alpha, merge_due, merge_layer
from spes_node.model.moe import MoEForCausalLM, read_stored
from spes_node.model.ownership import (
    frozen_shard_buffers,
    load_shard_tensors,
    shard_tensors,
    shared_parameters,
)
from spes_node.swarm import records
from spes_node.swarm.averaging import (
    STEP_GRACE_SECONDS,
    GroupAverager,
    GroupResult,
    NesterovOuter,
    PlainAverage,
    StepHandle,
    next_anchor_id,
    wire_compression,
)
from spes_node.swarm.fetch import StateFetcher
from spes_node.swarm.progress import excused_peers, longest_wait, no_shows, peer_etas, should_catch_up
from spes_node.swarm.reachability import DialBackServer
from spes_node.swarm.robust import BanList
from spes_node.swarm.snapshots import FrozenShard, SnapshotPublisher
from spes_node.swarm.swarm_key import SwarmKey
from spes_node.swarm.transfer import StateServer, TransferError

logger = logging.getLogger(__name__)


@dataclass
class RoundInputs:
    """What the node hands the round when it begins one."""

    round: int
    """The round the node has completed so far."""
    step: int
    tokens_since_sync: int
    loss: float
    """The mean loss of the round's local steps."""
    nodes: dict[str, records.NodeInfo]
    """The swarm's records, read once for this round."""
    me: records.NodeInfo
    """The node's own record as it is now."""
    data_part: tuple[int, int]
    steps: int = 0
    """Local steps of the round: H, plus any trained while waiting for slower peers."""
    missed: dict[str, records.NodeInfo] = field(default_factory=dict)
    """Peers this read missed that were live a moment ago (`progress.RecentPeers`): still expected in the groups."""


@dataclass
class StateTaken:
    """The swarm's state, downloaded into the model (by a joiner, or by a node that caught up)."""

    round: int
    """The round of the state taken (never below the node's own)."""
    min_step: int
    """The trainer step that round implies: the trainer's step moves up to it."""
    nbytes: int
    seconds: float


@dataclass
class RoundReport:
    """What a completed round changed; the node applies it (status, trainer, data, record, metrics)."""

    round: int
    loss: float
    shards: tuple[int, ...]
    data_part: tuple[int, int]
    shared_group: int
    shard_groups: dict[int, int]
    bytes_sent: dict[str, int] = field(default_factory=dict)
    bytes_received: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    overlapped: bool = False
    failed_parts: int = 0
    errors: list[str] = field(default_factory=list)
    banned: list[str] = field(default_factory=list)
    merged: bool = False
    refreshed: int = 0
    caught_up: int | None = None
    state_taken: StateTaken | None = None
    """Set when the round caught up by downloading the swarm's state."""
    resynced: list[str] = field(default_factory=list)
    """Averaging updates: parts whose weights were taken from group members that shared another anchor."""
    anchors: dict[str, str] = field(default_factory=dict)
    """Averaging updates: each group's anchor id after the round ("shared", "shard<j>"); nodes whose ids are
    equal hold the same weights there."""
    steps: int = 0
    """Local steps of the round: H, plus any trained while waiting for slower peers."""
    steps_while_waiting: int = 0
    """Of `steps`, those past H (`swarm.train_while_waiting`)."""
    phases: dict[str, float] = field(default_factory=dict)
    """Where the round's `seconds` went: "matchmaking" (finding groups, waiting for their members), "allreduce"
    (the longest of its all-reduces) and "after" (applying the averages, then catching up, refreshing, merging and
    publishing). With `overlapped`, the first two also hold the local steps trained meanwhile."""
    shared_landed_after: int = 0
    """Local steps trained after the round began and before the shared result landed (`swarm.shared_lag_steps`)."""
    shared_landed_at: float | None = None
    """Seconds after the round began that the shared result landed, when it landed before the rest (`land_shared`)."""
    shards_began_at: float | None = None
    """Seconds after the round began that its first shard step began (None without one): with `overlap_shards`,
    once the shared result has landed (unless `shared_lag_steps`); otherwise beside the shared step, at 0."""
    stalled: float = 0.0
    """Seconds the round held the training thread: starting it, waiting for the results it applies (all of them,
    or the shared parameters' with `overlap_shards`), applying them and what follows (`after`). With overlap,
    `seconds` runs beside the steps and only this stalls training. The node's own work at the sync (its record,
    the records' read, a checkpoint) comes on top."""
    members: list[str] = field(default_factory=list)
    """The other peers of the round's groups (a node leaving after this round waits until they have ended it)."""

    def add_bytes(self, kind: str, sent: int, received: int) -> None:
        self.bytes_sent[kind] = self.bytes_sent.get(kind, 0) + sent
        self.bytes_received[kind] = self.bytes_received.get(kind, 0) + received

    def as_dict(self) -> dict:
        """The form summaries, metrics and tests read."""
        return {
            "round": self.round,
            "loss": self.loss,
            "shared_group": self.shared_group,
            "shards": list(self.shards),
            "shard_group": min(self.shard_groups.values(), default=1),
            "shard_groups": dict(self.shard_groups),
            "bytes_shared": self.bytes_sent.get("shared", 0) + self.bytes_received.get("shared", 0),
            "bytes_shard": self.bytes_sent.get("shard", 0) + self.bytes_received.get("shard", 0),
            "seconds": self.seconds,
            "overlapped": self.overlapped,
            "failed_parts": self.failed_parts,
            "errors": list(self.errors),
            "banned": list(self.banned),
            "merged": self.merged,
            "refreshed": self.refreshed,
            "caught_up": self.caught_up,
            "resynced": list(self.resynced),
            "anchors": dict(self.anchors),
            "steps": self.steps,
            "steps_while_waiting": self.steps_while_waiting,
            "phases": dict(self.phases),
            "shared_landed_after": self.shared_landed_after,
            "shared_landed_at": self.shared_landed_at,
            "shards_began_at": self.shards_began_at,
            "stalled": self.stalled,
            "members": list(self.members),
        }


@dataclass
class _Flight:
    """A round whose all-reduces are running."""

    inputs: RoundInputs
    started: float
    shared: StepHandle | None
    shards: dict[int, StepHandle | None]
    sent_shared: dict[str, torch.Tensor] | None
    sent_shards: dict[int, dict[str, torch.Tensor] | None]
    errors: list[str] = field(default_factory=list)
    """Steps that could not start (an averager that did not take its step in time)."""
    waited_for: list[str] = field(default_factory=list)
    """Peers whose records made the round wait for them (see `progress.no_shows`)."""
    shared_landed: tuple[GroupResult, dict[str, torch.Tensor] | None] | None = None
    """Overlapping the shards only: the shared parameters' result, applied already (`land_shared`)."""
    shared_landed_after: int = 0
    """Local steps trained before `land_shared` applied it."""
    shared_landed_at: float | None = None
    """`time.perf_counter()` when `land_shared` had applied it."""
    stalled: float = 0.0
    """Seconds the training thread spent in `begin_round` and `land_shared` so far."""
    overlapped: bool = False
    """Some of the round's all-reduces run while training goes on (`swarm.overlap`, `swarm.overlap_shards`)."""
    shared_lag: int = 0
    """Overlapping the shards only: local steps training may go on while the shared all-reduce runs
    (`swarm.shared_lag_steps`; 0: `land_shared` is called at once)."""
    deferred_shards: dict[int, Callable[..., tuple[StepHandle | None, dict[str, torch.Tensor] | None]]] = (
        field(default_factory=dict)
    )
    """Overlapping the shards only, without a lag: the shards' steps, begun by `land_shared` once the shared
    result is in, among the members of its group (each returns its handle and the host copy it keeps, as
    `begin_round` would have)."""

    def handles(self) -> list:
        return [self.shared, *self.shards.values()]


class SpesRound:
    def __init__(
        self,
        cfg: SpesConfig,
        *,
        run_id: str,
        config_hash: str,
        peer_id: str,
        dht: hivemind.DHT | None,
        model: MoEForCausalLM | None,
        shards: Iterable[int],
        stop_event: threading.Event,
        set_ownership: Callable[[list[int]], None] | None = None,
        swarm_key: SwarmKey | None = None,
        client_mode: bool = False,
        loop: LoopThread | None = None,
    ):
        """`set_ownership`: makes the model and the optimiser train other shards (before their weights are loaded,
        so that they arrive at full precision); called when the node moves to another shard. `loop`: the event loop
        for its P2P calls (its own if None; stopped by `shutdown` either way)."""
        self.cfg, self.run_id, self.config_hash, self.peer_id = cfg, run_id, config_hash, peer_id
        self.dht, self.model, self.stop_event = dht, model, stop_event
        self.shards = tuple(shards)
        self.set_ownership, self.swarm_key, self.client_mode = set_ownership, swarm_key, client_mode
        self.loop = loop or LoopThread()
        self.bans = BanList()
        self.shared_avg: GroupAverager | None = None
        self.shard_avgs: dict[int, GroupAverager] = {}
        self.shared_outer: PlainAverage | NesterovOuter | None = None
        self.shard_outers: dict[int, PlainAverage | NesterovOuter] = {}
        self.fetcher: StateFetcher | None = None
        self.publisher: SnapshotPublisher | None = None
        self.p2p = None
        self.server: StateServer | None = None
        self.dial_back: DialBackServer | None = None
        self.last_report: dict = {}
        self._inflight: _Flight | None = None
        self.frozen = FrozenCopies(cfg, model, self.loop, stop_event)
        """The copies of the shards this node does not train, and their refreshes."""
        self._round_started = time.perf_counter()
        self._round_seconds: float | None = None
        """How long our last round took (local steps and sync)."""
        self._no_shows: dict[str, int] = {}
        """Peers waited for in vain, rounds in a row (`progress.no_shows`)."""
        self._waited_ahead: set[str] = set()
        """Peers the node trained extra steps for before this round (`wait_ahead`): waited for, for the no-shows."""
        self.updates = cfg.swarm.average == "updates"
        """Average pseudo-gradients from anchors (`swarm.average = "updates"`) instead of the weights."""
        self.differences = not self.updates and cfg.swarm.outer_optimizer != "nesterov"
        """The plain average of weights: the averagers return each average's difference to what was handed over,
        which lands on the live weights as it is, trained on since or not (no host copy of the handed-over weights;
        `averaging.MODES`)."""
        self._anchors: dict[str, dict[str, torch.Tensor]] = {}
        """Updates mode, plain average: each group's weights at its last sync (Nesterov keeps them as `previous`)."""
        self.anchor_ids: dict[str, str] = {}
        """Updates mode: each group's anchor id ("shared", "shard<j>"); equal ids mean equal anchors."""
        self._own_ids = 0

    # ------------------------------------------------------------------ setup

    def start(self, round_: int, fresh: bool = False) -> None:
        """Start serving state (as of round `round_`) and join the averaging groups. `fresh`: the model holds the
        config's seeded initial weights (no checkpoint, nothing downloaded), which every fresh node shares."""
        swarm = self.cfg.swarm
        self.p2p = self.loop.run(self.dht.replicate_p2p())
        # served state is weights, not updates: never quantised to 8 bits (fp16 unless the wire is uncompressed)
        state_wire = "none" if swarm.wire_compression == "none" else "fp16"
        self.server = StateServer(
            self.p2p,
            self.run_id,
            self.config_hash,
            wire_compression(state_wire),
            swarm_key=self.swarm_key,
        )
        self.loop.run(self.server.start())
        if not self.client_mode:  # a client takes no connections: it cannot dial anyone back either way
            self.dial_back = DialBackServer(self.p2p, self.run_id)
            self.loop.run(self.dial_back.start())
        # what is served travels at that precision anyway: keep the snapshots at that precision, not fp32
        dtype = torch.float16 if state_wire == "fp16" else torch.float32
        self.publisher = SnapshotPublisher(
            self.server, self.loop, dtype, updates=swarm.refresh_by_updates, every=swarm.refresh_every
        )
        self.fetcher = StateFetcher(
            self.p2p,
            self.run_id,
            self.config_hash,
            timeout=swarm.averaging_timeout,
            swarm_key=self.swarm_key,
            me=self.peer_id,
        )
        self.frozen.fetcher, self.frozen.dtype = self.fetcher, dtype
        self.shared_avg = self._averager("shared", shared_parameters(self.model))
        for shard in self.shards:
            self.shard_avgs[shard] = self._averager(f"shard{shard}", shard_tensors(self.model, shard))
        self.reset_outer(anchor_id=initial_anchor_id(self.config_hash) if fresh else None)
        self.publish_snapshots(round_)

    def _averager(self, group: str, tensors: dict[str, torch.Tensor]) -> GroupAverager:
        """The averager of one group; its key carries the run id and the config hash."""
        swarm = self.cfg.swarm
        return GroupAverager(
            self.dht,
            f"{self.run_id}_{self.config_hash[:16]}_{group}",
            tensors,
            compression=swarm.wire_compression,
            matchmaking_time=swarm.matchmaking_time,
            allreduce_timeout=swarm.averaging_timeout,
            client_mode=self.client_mode,
            bans=self.bans,
            swarm_key=self.swarm_key,
            max_weight=float(swarm.sync_steps * tokens_per_step(self.cfg)),
            average="differences" if self.differences else swarm.average,
        )

    def reset_outer(self, anchor_id: str | None = None) -> None:
        """Outer optimisers (and, averaging updates, anchors) that start from the weights as they are now.

        `anchor_id`: the id of these weights if other nodes hold the very same ones; otherwise an id of our own."""
        self.shared_outer = self._outer(shared_parameters(self.model))
        self.shard_outers = {shard: self._outer(shard_tensors(self.model, shard)) for shard in self.shards}
        for key, tensors in self._groups():
            self._reanchor(key, tensors, anchor_id)

    def adopt_initial_anchor(self) -> None:
        """Name every group's anchor as the config's seeded initial weights (after downloading round-0 state)."""
        for key in self.anchor_ids:
            self.anchor_ids[key] = initial_anchor_id(self.config_hash)

    def _groups(self) -> list[tuple[str, dict[str, torch.Tensor]]]:
        """(anchor key, live tensors) of every group this node averages."""
        groups = [("shared", shared_parameters(self.model))]
        return groups + [(f"shard{shard}", shard_tensors(self.model, shard)) for shard in self.shards]

    def _outer_of(self, key: str) -> PlainAverage | NesterovOuter | None:
        return self.shared_outer if key == "shared" else self.shard_outers.get(int(key[len("shard") :]))

    def anchor(self, key: str) -> dict[str, torch.Tensor]:
        """A group's anchor: the weights at its last sync (a Nesterov optimiser's `previous`, no second copy)."""
        outer = self._outer_of(key)
        return outer.previous if isinstance(outer, NesterovOuter) else self._anchors[key]

    @torch.no_grad()
    def _reanchor(self, key: str, tensors: dict[str, torch.Tensor], anchor_id: str | None = None) -> None:
        """The group's anchor becomes `tensors` as they are now, with `anchor_id` or an id of our own."""
        if not self.updates:
            return
        outer = self._outer_of(key)
        if isinstance(outer, NesterovOuter):
            outer.remember(tensors)
        elif key in self._anchors and self._anchors[key].keys() == tensors.keys():
            for name, tensor in tensors.items():
                self._anchors[key][name].copy_(tensor)
        else:
            self._anchors[key] = {name: to_host(t) for name, t in tensors.items()}
        if anchor_id is None:
            self._own_ids += 1
            anchor_id = next_anchor_id("own", [self.peer_id], self._own_ids)
        self.anchor_ids[key] = anchor_id

    def _outer(self, start: dict[str, torch.Tensor]) -> PlainAverage | NesterovOuter:
        """The outer optimiser of one group, starting from the weights the next round begins with."""
        swarm = self.cfg.swarm
        if swarm.outer_optimizer != "nesterov":
            return PlainAverage()
        outer = NesterovOuter(swarm.outer_lr, swarm.outer_momentum)
        outer.remember(start)
        return outer

    def outer_state_dict(self) -> dict:
        """The outer optimisers' state, for checkpoints (empty for the plain average): "shared", "shard" for the
        first own shard and "shard:<j>" for further ones."""
        return {
            key: outer.state_dict() for key, _, outer in self._outers() if isinstance(outer, NesterovOuter)
        }

    def load_outer_state_dict(self, state: dict) -> None:
        for key, shard, outer in self._outers():
            if isinstance(outer, NesterovOuter) and key in state:
                like = shared_parameters(self.model) if shard is None else shard_tensors(self.model, shard)
                outer.load_state_dict(state[key], like)

    def _outers(self) -> list[tuple[str, int | None, PlainAverage | NesterovOuter | None]]:
        """(checkpoint key, shard or None for the shared parameters, outer optimiser)."""
        keyed = [("shared", None, self.shared_outer)]
        for index, shard in enumerate(self.shards):
            keyed.append(("shard" if index == 0 else f"shard:{shard}", shard, self.shard_outers.get(shard)))
        return keyed

    def publish_snapshots(self, round_: int, premerge: bool = False, restart: bool = False) -> None:
        """Serve the state as it is now, as of round `round_` (see `snapshots.SnapshotPublisher`); with `premerge`,
        the own shards also as this round's merge inputs; with `restart`, the own shards changed within a round
        already published (their update chains start again)."""
        model = self.model
        frozen = {
            shard: FrozenShard(frozen_shard_buffers(model, shard), read_stored)
            for shard in range(self.cfg.swarm.num_shards)
            if shard not in self.shards
        }
        own = {shard: shard_tensors(model, shard) for shard in self.shards}
        self.publisher.publish(
            round_,
            shared_parameters(model),
            own,
            frozen,
            premerge=self.shards if premerge else (),
            restart=restart,
        )

    # ------------------------------------------------------------------ the round

    def begin_round(
        self, inputs: RoundInputs, overlap: bool, overlap_shards: bool = False, shared_lag: int = 0
    ) -> None:
        """Start the all-reduces on a copy of the weights. With `overlap`, training goes on meanwhile and
        `complete_round` later applies the average together with the local progress made since; with
        `overlap_shards`, the same for the shards' groups only, once `land_shared` has applied the shared one; with
        `shared_lag` too, training goes on for up to that many steps before the shared one lands (`shared_due`)."""
        shared_lag = shared_lag if overlap_shards and not overlap else 0
        called = time.perf_counter()
        self.finish_pending()
        restarted = self._restart_unhealthy_averagers()
        gather = (inputs.round, inputs.step, inputs.tokens_since_sync)
        # steps past H (trained while waiting for slower peers) weigh nothing more: every reducer counts a weight
        # as at most H steps' tokens (`max_weight`), so that no peer can claim most of a group's average
        weight = float(max(inputs.tokens_since_sync, 1))
        shared_local = shared_parameters(self.model)
        shards_local = {shard: shard_tensors(self.model, shard) for shard in self.shards}
        others = live_peers({**inputs.missed, **inputs.nodes}, self.peer_id, self.bans.active())
        behind = catch_up_target(inputs.round + 1, inputs.nodes, self.peer_id, self.bans.active())
        if behind is not None:
            # `complete_round` takes the swarm's weights (the same records, the same target): averaging ours into
            # the groups first would pull the swarm's weights back towards a state rounds old (a joiner whose
            # download outlasted rounds gave its first group half the weight)
            logger.info(
                f"round {inputs.round + 1}: the swarm is at round {behind}: not averaging, taking its weights"
            )
            others = {}
        extra, etas = self._expected_wait(others, inputs.round, inputs.me)
        missed = len(others.keys() & inputs.missed.keys())
        logger.info(
            f"round {inputs.round + 1}: looking for groups ({len(others)} live peers"
            + (f", {missed} of them missing from this read of the records" if missed else "")
            + (f", waiting up to {extra:.1f}s more for peers about to finish" if extra > 0 else "")
            + ")"
        )

        errors: list[str] = restarted  # the round's report says so, and status shows it

        def step(averager: GroupAverager, key: str, local: dict[str, torch.Tensor], expected: list[str]):
            # a group led by us begins once every expected peer has joined, not at the end of the window
            if not self.updates:
                start = partial(averager.step, local, weight, gather, extra, expected=expected)
            else:
                anchored = (*gather, self.anchor_ids[key])
                start = partial(
                    averager.step, local, weight, anchored, extra, anchor=self.anchor(key), expected=expected
                )
            return self._unless_stopped(start, key, errors, averager=averager)

        def shard_step(shard: int, local: dict[str, torch.Tensor], in_step: Collection[str] | None = None):
            # `in_step`: begun after the shared result, the members of its group; a replica that did not make it
            # is out of step this round (waiting for it would cost the window), and with no member at all, neither
            # would any replica come: the step is not begun (a node out of step keeps a round of one window)
            replicas = [
                peer
                for peer, n in others.items()
                if shard in n.shards and (in_step is None or peer in in_step)
            ]
            handle = step(self.shard_avgs[shard], f"shard{shard}", local, replicas) if replicas else None
            keeps = (overlap or overlap_shards) and self._keeps_sent(f"shard{shard}", handle)
            return handle, _to_host(local) if keeps else None

        shared_handle = step(self.shared_avg, "shared", shared_local, list(others)) if others else None
        # Overlapping the shards only, the round waits for the shared all-reduce alone: begun beside it, the
        # shards' (many times its bytes) would share its links and cores, and it would end with them. They begin
        # once the shared result has landed, on the same weights (training waits until then), and run beside
        # the next steps as before, among the shared group's members (`shard_step`'s `in_step`).
        defer = overlap_shards and not overlap and not shared_lag and shared_handle is not None
        deferred = {shard: partial(shard_step, shard, local) for shard, local in shards_local.items()}
        begun = {} if defer else {shard: start() for shard, start in deferred.items()}
        not_begun = (None, None)
        self._inflight = _Flight(
            inputs=inputs,
            started=time.perf_counter(),
            shared=shared_handle,
            shards={shard: begun.get(shard, not_begun)[0] for shard in shards_local},
            sent_shared=_to_host(shared_local)
            if (overlap or shared_lag) and self._keeps_sent("shared", shared_handle)
            else None,
            sent_shards={shard: begun.get(shard, not_begun)[1] for shard in shards_local},
            errors=errors,
            waited_for=sorted(self._waited_ahead | {peer for peer, eta in etas.items() if eta > 0}),
            overlapped=((overlap or shared_lag) and shared_handle is not None)
            or ((overlap or overlap_shards) and any(h is not None for h, _ in begun.values())),
            shared_lag=shared_lag,
            deferred_shards=deferred if defer else {},
        )
        self._waited_ahead = set()
        self._inflight.stalled = time.perf_counter() - called

    def _keeps_sent(self, key: str, handle) -> bool:
        """Whether an overlapped group keeps a host copy of the weights it hands over: to land its result with the
        local progress made since, or, with no group to average with, as the anchor that update averaging and a
        Nesterov step take (`apply_update`, `apply_outer`). The plain average of weights needs none: its averager
        returns the difference to add (`differences`)."""
        return not self.differences and (
            handle is not None or self.updates or isinstance(self._outer_of(key), NesterovOuter)
        )

    def training_started(self) -> None:
        """The node's first step is about to run: its first round is timed from here (see `wait_cap`)."""
        self._round_started = time.perf_counter()

    def wait_ahead(self, nodes: Mapping[str, records.NodeInfo], round_: int, me: records.NodeInfo) -> float:
        """Before the round: the seconds its groups would wait for peers about to finish it, which the node trains
        through instead of idling (`progress.another_step_fits`). Those peers count as waited for: if they do not come,
        they are no-shows, as if the round itself had waited (a record claiming a peer about to finish would
        otherwise stretch every round by a wait's worth of steps, for good)."""
        others = live_peers(nodes, self.peer_id, self.bans.active())
        wait, etas = self._expected_wait(others, round_, me)
        self._waited_ahead = {peer for peer, eta in etas.items() if eta > 0}
        return wait

    def _expected_wait(
        self, others: Mapping[str, records.NodeInfo], round_: int, me: records.NodeInfo
    ) -> tuple[float, dict[str, float]]:
        """Seconds this round's groups wait beyond the matchmaking window for the live peers `others`, and each
        peer's eta.

        A round waits for peers about to finish it, so that a node that fell out of step (a pause, a slow step)
        meets the others again instead of missing them round after round; but not for a peer that was waited for
        in vain before (a record may claim a peer about to finish forever), and at most `wait_cap`."""
        excused = excused_peers(self._no_shows)
        etas = peer_etas(
            {peer: node for peer, node in others.items() if peer not in excused},
            round_=round_,
            sync_steps=self.cfg.swarm.sync_steps,
            tokens_per_step=tokens_per_step(self.cfg),
            now=get_dht_time(),
            default_tokens_per_s=me.tokens_per_s,
        )
        cap = wait_cap(
            self._round_seconds, self.cfg.swarm.matchmaking_time, time.perf_counter() - self._round_started
        )
        return longest_wait(etas, cap), etas

    def _unless_stopped(
        self,
        start: Callable[[], StepHandle],
        key: str,
        errors: list[str],
        timeout: float | None = None,
        averager: GroupAverager | None = None,
    ) -> StepHandle | None:
        """`start()`, an averager's step, run in a thread; None (no group) if the node stops first, or if the step
        has not started after `timeout` seconds (by default twice the matchmaking window and a grace), which is
        added to `errors` (and `averager` is marked unresponsive: the next round replaces it).

        A step waits, without a timeout, for its averager process to take it (and for the lock of the shared
        buffers): an averager process that hangs (its DHT frozen, its loop wedged) would otherwise hold the round,
        and the node's training, forever. The thread left waiting is a daemon."""
        if timeout is None:
            timeout = 2 * self.cfg.swarm.matchmaking_time + STEP_GRACE_SECONDS
        deadline = time.perf_counter() + timeout
        box: dict = {}

        def run() -> None:
            try:
                box["handle"] = start()
            except BaseException as e:  # raised again on the round's thread
                box["error"] = e

        thread = threading.Thread(target=run, name="spes-step", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.1)
            if thread.is_alive() and self.stop_event.is_set():
                logger.warning("stopping while an averager has not taken its step: not waiting for it")
                return None
            if thread.is_alive() and time.perf_counter() >= deadline:
                error = (
                    f"{key}: the averager did not take its step in {timeout:.0f}s (unresponsive): no group"
                )
                logger.error(error)
                errors.append(error)
                if averager is not None:
                    averager.unresponsive = True
                return None
        if "error" in box:
            raise box["error"]
        return box["handle"]

    def _restart_unhealthy_averagers(self) -> list[str]:
        """Replace each averager whose process died (the OOM killer picks the largest helper) or that did not take
        or end its last step in time, on the group's live weights: it would otherwise cost every round a step's
        deadline, and its group would never average again. Returns a line for each one replaced or not."""
        said = []
        groups = [
            (self.shared_avg, "shared", None),
            *((self.shard_avgs.get(s), f"shard{s}", s) for s in self.shards),
        ]
        for averager, key, shard in groups:
            if averager is None or averager.healthy:
                continue
            tensors = shared_parameters(self.model) if shard is None else shard_tensors(self.model, shard)
            why = (
                "did not take or end its step in time"
                if averager.unresponsive
                else f"process exited (code {averager.averager.exitcode})"
            )
            logger.warning(f"{key}: the averager {why}: starting a new one")
            try:
                averager.restart(tensors)
                said.append(f"{key}: the averager {why}: a new one started")
            except Exception as e:
                # no new process (no memory, the DHT gone): this round goes without the group, the next tries again
                said.append(f"{key}: the averager {why} and could not be restarted: {type(e).__name__}: {e}")
                logger.error(said[-1])
        return said

    def land_shared(self, steps_since: int = 0) -> None:
        """Overlapping the shards only: wait for the shared parameters' all-reduce and apply its result now, with
        the local progress of the `steps_since` steps trained since the round began (`shared_lag`), before training
        goes on (`complete_round` reports it with the rest of the round)."""
        flight = self._inflight
        called = time.perf_counter()
        result, averaged = self._finish(self.shared_avg, flight.shared)
        self._apply("shared", self.shared_outer, shared_parameters(self.model), flight.sent_shared, averaged)
        flight.shared_landed, flight.shared_landed_after = (result, averaged), steps_since
        flight.shared_landed_at = time.perf_counter()
        for shard, start in flight.deferred_shards.items():
            if self.stop_event.is_set():  # a node on its way out begins no group
                break
            flight.shards[shard], flight.sent_shards[shard] = start(in_step=set(result.peers))
            flight.overlapped |= flight.shards[shard] is not None
        flight.deferred_shards = {}
        flight.stalled += time.perf_counter() - called

    def shared_due(self, steps_since: int) -> bool:
        """Whether the shared result of a round begun with a `shared_lag` lands now, `steps_since` local steps
        after the round began: once its all-reduce is over (never blocks), or once the lag's steps are trained
        (`land_shared` then waits for it)."""
        flight = self._inflight
        if flight is None or not flight.shared_lag or flight.shared_landed is not None:
            return False
        return flight.shared is None or flight.shared.over() or steps_since >= flight.shared_lag

    def _apply(self, key: str, outer, local: dict, sent: dict | None, averaged: dict | None) -> None:
        """A group's result into `local` (see `anchors.apply_difference`, `anchors.apply_update` and
        `anchors.apply_outer`)."""
        if self.differences:
            apply_difference(local, averaged)
        elif self.updates:
            apply_update(outer, local, sent, self.anchor(key), averaged)
        else:
            apply_outer(outer, local, sent, averaged)

    def round_in_flight(self) -> bool:
        return self._inflight is not None

    def refresh_in_flight(self) -> bool:
        """Whether a refresh of frozen copies is still downloading (`finish_pending` would wait for it)."""
        return self.frozen.in_flight

    def round_ready(self) -> bool:
        """True when the in-flight round's all-reduces are finished or past their deadline (never blocks)."""
        flight = self._inflight
        return flight is not None and all(h is None or h.over() for h in flight.handles())

    def complete_round(self) -> RoundReport:
        """Apply the averages, then (unless the node is stopping) catch up, refresh, merge, rebalance and settle
        the data part; returns what changed."""
        called = time.perf_counter()
        flight, self._inflight = self._inflight, None
        inputs = flight.inputs
        landed = flight.shared_landed
        shared_result, shared_avg = landed if landed else self._finish(self.shared_avg, flight.shared)
        groups = [
            (
                "shared",
                "shared",
                shared_result,
                shared_avg,
                shared_parameters(self.model),
                flight.sent_shared,
                self.shared_outer,
            )
        ]
        shard_results = {}
        for shard, handle in flight.shards.items():
            result, averaged = self._finish(self.shard_avgs[shard], handle)
            shard_results[shard] = result
            local = shard_tensors(self.model, shard)
            groups.append(
                (
                    "shard",
                    f"shard{shard}",
                    result,
                    averaged,
                    local,
                    flight.sent_shards[shard],
                    self.shard_outers[shard],
                )
            )
        # one round further, whatever the group claimed: no peer's claim moves the round (see `progress`)
        report = RoundReport(
            round=inputs.round + 1,
            loss=inputs.loss,
            shards=self.shards,
            data_part=inputs.data_part,
            shared_group=shared_result.group_size,
            shard_groups={shard: r.group_size for shard, r in shard_results.items()},
            overlapped=flight.overlapped,
            steps=inputs.steps,
            steps_while_waiting=max(inputs.steps - self.cfg.swarm.sync_steps, 0),
            shared_landed_after=flight.shared_landed_after,
        )
        began = [h.started for h in flight.shards.values() if h is not None]
        if began:  # steps handed over just before the flight was made count as its start
            report.shards_began_at = max(min(began) - flight.started, 0.0)
        if flight.shared_landed_at is not None:
            report.shared_landed_at = flight.shared_landed_at - flight.started
        report.errors.extend(flight.errors)
        averaged_in = time.perf_counter() - flight.started
        allreduce = max((group[2].allreduce_seconds for group in groups), default=0.0)
        report.phases = {"matchmaking": max(averaged_in - allreduce, 0.0), "allreduce": allreduce}
        joined = set(shared_result.peers).union(*(r.peers for r in shard_results.values()))
        report.members = sorted(joined - {self.peer_id})
        self._no_shows = no_shows(self._no_shows, flight.waited_for, joined)
        resyncs = []
        for kind, key, result, averaged, local, sent, outer in groups:
            report.add_bytes(kind, result.bytes_sent, result.bytes_received)
            if not (key == "shared" and landed is not None):  # else applied by `land_shared` already
                self._apply(key, outer, local, sent, averaged)
            if self.updates:
                resync = self._settle_anchor(key, result, averaged is not None, report.round)
                if resync is not None:
                    resyncs.append((key, *resync, update_norm(averaged)))
            self.fetcher.vouch(result.peers)
            report.failed_parts += result.failed_reducers
            if result.error:
                report.errors.append(result.error)
        self._round_seconds = time.perf_counter() - self._round_started
        self._round_started = time.perf_counter()

        if not self.stop_event.is_set():  # a stopping node skips what talks to other peers
            nodes = inputs.nodes
            target = catch_up_target(report.round, nodes, self.peer_id, self.bans.active())
            if target is not None:
                self._catch_up(report, nodes, target)
            elif resyncs:
                # serve this round's state before taking any: a member we take one part from may be taking
                # another part from us at the same moment, and neither may wait on the other's download
                self.publish_snapshots(report.round, premerge=merge_due_at(report.round, self.cfg.swarm))
                for key, anchor_id, peers, their_round, norm in resyncs:
                    self._resync(report, key, anchor_id, peers, their_round, norm)
            own_taken = any(part.startswith("shard:") for part in report.resynced)
            # a state taken from the swarm is merged already when the round was a merge round, and its frozen
            # copies are as fresh as a refresh would make them: a refresh asked for now waited for the holders'
            # next round, with the node's own round start behind it (and the holder's round waiting for the node)
            taken = report.state_taken is not None
            report.refreshed, report.merged = self._refresh_and_merge(
                nodes, report.round, own_taken, merge=not taken, refresh=not taken
            )
            self._maybe_rebalance(nodes, inputs.me, report.round)
            report.shards = self.shards
            report.data_part = next_data_part(nodes, self.peer_id, inputs.data_part) or inputs.data_part
        report.seconds = time.perf_counter() - flight.started
        report.phases["after"] = report.seconds - averaged_in
        report.banned = sorted(self.bans.active())
        report.add_bytes("refresh", 0, self.take_refresh_bytes())
        report.anchors = {key: anchor_id[:16] for key, anchor_id in self.anchor_ids.items()}
        report.stalled = flight.stalled + time.perf_counter() - called
        self.last_report = report.as_dict()
        self._log(report)
        return report

    def _log(self, report: RoundReport) -> None:
        shard_groups = ", ".join(f"shard {s} group {g}" for s, g in report.shard_groups.items())
        summary = report.as_dict()
        logger.info(
            f"round {report.round} done: loss {report.loss:.4f}, shared group {report.shared_group}, {shard_groups}, "
            f"{(summary['bytes_shared'] + summary['bytes_shard']) / 1e6:.2f} MB averaged, {report.seconds:.1f}s "
            f"({', '.join(f'{phase} {seconds:.1f}s' for phase, seconds in report.phases.items())}; "
            f"training stalled {report.stalled:.1f}s)"
            + (" (overlapped)" if report.overlapped else "")
            + (
                f", shared average landed {report.shared_landed_after} step(s) in"
                if report.shared_landed_after
                else ""
            )
            + (
                f", {report.steps_while_waiting} steps trained while waiting"
                if report.steps_while_waiting
                else ""
            )
            + (", merged" if report.merged else "")
            + (f", refreshed {report.refreshed}" if report.refreshed else "")
            + (f", caught up to round {report.caught_up}" if report.caught_up is not None else "")
        )
        for error in report.errors:
            logger.warning(f"round {report.round}: {error}")

    def _catch_up(self, report: RoundReport, nodes: dict, target: int) -> None:
        """Take the swarm's weights (own shards included) after missing rounds."""
        logger.info(f"round {report.round} is behind the swarm's {target}: taking the swarm's weights")
        taken = self.take_swarm_state(nodes, report.round, min_round=target)
        if taken is None:
            return
        if taken.round > report.round:
            report.caught_up = taken.round
        report.round = taken.round
        report.state_taken = taken
        report.add_bytes("state_download", 0, taken.nbytes)

    def _settle_anchor(
        self, key: str, result: GroupResult, averaged: bool, round_: int
    ) -> tuple[str, list[str], int] | None:
        """The group's next anchor id after a round; (anchor id, peers, their round) to take the weights from
        when most of the group shared an anchor other than ours."""
        # the ids name the round by what every member saw (members may count one round apart)
        group_round = max((info[0] for info in result.peers.values()), default=round_)
        decision = settle_anchor(
            self.anchor_ids[key],
            result.anchors if averaged else {},
            all_averaged=averaged and result.error is None and not result.failed_reducers,
            round_=group_round,
        )
        if decision.new_id is None:
            self._own_ids += 1
            self.anchor_ids[key] = next_anchor_id("own", [self.peer_id], self._own_ids)
        else:
            self.anchor_ids[key] = decision.new_id
        if decision.take_from:
            # their round as they finish this one (a member may count one round more or less than we do)
            their_round = max(result.peers[peer][0] for peer in decision.take_from) + 1
            return decision.take_id, decision.take_from, their_round
        return None

    def _resync(
        self, report: RoundReport, key: str, anchor_id: str, peers: list[str], their_round: int, norm: float
    ) -> None:
        """Take a group's weights from members that shared an anchor other than ours (we missed rounds, joined, or
        caught up): an update applied to another anchor would never bring us together again.

        Weights from peers are untrusted: they are taken only if they lie within `resync_acceptable`'s distance
        of ours (a few of this round's averaged updates, `norm`); a node further off catches up instead."""
        part = "shared" if key == "shared" else f"shard:{key[len('shard') :]}"
        # in a merge round, the group's weights before the merge (we merge them ourselves after this)
        source = part if key == "shared" or not merge_due_at(their_round, self.cfg.swarm) else f"pre{part}"
        try:
            _, download = self.loop.run(
                self.fetcher.fetch(peers, source, self._expected(part), their_round, exact=True)
            )
        except TransferError as e:
            logger.warning(f"{part}: keeps an anchor of its own this round: {e}")
            return
        current = (
            shared_parameters(self.model) if key == "shared" else shard_tensors(self.model, int(key[5:]))
        )
        reason = resync_acceptable(download.tensors, current, norm)
        if reason is not None:
            logger.warning(f"{part}: not taking the group's weights: {reason}")
            return
        if key == "shared":
            with torch.no_grad():
                for name, p in shared_parameters(self.model).items():
                    p.copy_(download.tensors[name])
            tensors = shared_parameters(self.model)
        else:
            shard = int(key[len("shard") :])
            load_shard_tensors(self.model, shard, download.tensors)
            tensors = shard_tensors(self.model, shard)
        self._reanchor(key, tensors, anchor_id)
        report.add_bytes("resync", 0, download.nbytes)
        report.resynced.append(part)
        logger.info(f"{part}: took the group's weights from its other members (anchor {anchor_id[:8]})")

    def _finish(self, averager: GroupAverager, handle: StepHandle | None) -> tuple[GroupResult, dict | None]:
        if handle is None:
            return GroupResult(1, 0.0, 0, 0), None
        while not handle.over():
            if self.stop_event.wait(0.1):
                handle.control.cancel()
                break
        return averager.finish(handle)

    # ------------------------------------------------------------------ frozen experts

    def _expected(self, part: str) -> dict[str, torch.Size]:
        if part == "shared":
            return {k: v.shape for k, v in shared_parameters(self.model).items()}
        return shard_shapes(self.model, _shard_of(part))

    def _refresh_and_merge(
        self, nodes: dict, round_: int, own_taken: bool = False, merge: bool = True, refresh: bool = True
    ) -> tuple[int, bool]:
        """Refresh frozen experts (in the background) and run the merge warm-up when due (and `merge`: not when
        the round's state was taken from the swarm, merged already; `refresh`: not when the frozen copies were
        just taken with it); (refreshed, merged). `own_taken`: an own shard's weights were taken from its group
        after this round was first published."""
        swarm = self.cfg.swarm
        due_refresh, due_merge = refresh and refresh_due(round_, swarm), merge and merge_due_at(round_, swarm)
        # The merge reads every expert as it was before anyone merged: holders serve that state as
        # "premerge:<j>" for this round only, and every node merges from the same copies, so replicas stay identical.
        self.publish_snapshots(round_, premerge=due_merge, restart=own_taken)
        if due_refresh or due_merge:
            self.start_refresh(nodes, min_round=round_, kind="premerge" if due_merge else "shard")
        if not due_merge:
            return 0, False
        refreshed = self.finish_pending()
        merge_own_experts(self.model, self.shards, round_ * swarm.sync_steps, swarm)
        for (
            shard
        ) in self.shards:  # replicas merge the same inputs alike: the merged weights keep the anchor's id
            key = f"shard{shard}"
            self._reanchor(key, shard_tensors(self.model, shard), self.anchor_ids.get(key))
        self.publish_snapshots(round_, restart=True)
        return refreshed, True

    def start_refresh(self, nodes: dict, min_round: int, kind: str = "shard") -> None:
        """Refresh every frozen shard of round `min_round` or later in the background (`FrozenCopies.start`)."""
        self.frozen.start(nodes, min_round, self.shards, self.bans.active(), kind=kind)

    def apply_pending(self) -> int:
        """Load what the refresh delivered so far (between steps); returns how many frozen shards changed."""
        return self.frozen.apply(self.shards)

    def take_refresh_bytes(self) -> int:
        """Bytes the background refreshes downloaded since the last call."""
        return self.frozen.take_bytes()

    def finish_pending(self) -> int:
        """Wait for the refresh in flight (at most its timeout) and load what it delivered; returns how many frozen
        shards changed (`FrozenCopies.finish`)."""
        return self.frozen.finish(self.shards)

    # ------------------------------------------------------------------ joining and moving

    def take_swarm_state(
        self, nodes: Mapping[str, records.NodeInfo], round_: int, min_round: int = 0, include_own: bool = True
    ) -> StateTaken | None:
        """Take the swarm's current weights: shared parameters and every shard (own shards only if `include_own`),
        each of round `min_round` or later, own shards of the shared parameters' round or later where a holder
        serves it. `round_`: the node's round now. None if not even the shared parameters could be had (the model
        is then unchanged)."""
        start = time.perf_counter()
        excluded = self.bans.active()
        shared_peers = self.fetcher.holders(nodes, None, excluded)
        if not shared_peers:
            return None
        try:
            _, shared = self.loop.run(
                self.fetcher.fetch(shared_peers, "shared", self._expected("shared"), min_round)
            )
        except TransferError as e:
            logger.warning(f"starting from local weights: {e}")
            return None
        with torch.no_grad():
            for name, p in shared_parameters(self.model).items():
                p.copy_(shared.tensors[name])
        total = shared.nbytes
        round_ = max(round_, shared.round)
        for shard in range(self.cfg.swarm.num_shards):
            if shard in self.shards and not include_own:
                continue
            peers, part = self.fetcher.sources(nodes, shard, excluded)
            # a frozen copy of the holder's served shard; one that will follow the holder's updates comes whole
            frozen = shard not in self.shards and part == f"shard:{shard}"
            follows = frozen and self.cfg.swarm.refresh_by_updates
            # a shard we train is of the shared parameters' round (the records read may be a round old): one of an
            # earlier round would pull its replicas back, and during a holder's merge it is the round before
            rounds = (
                [shared.round, min_round]
                if shard in self.shards and shared.round > min_round
                else [min_round]
            )
            try:
                peer, download = self._fetch_first_round(peers, part, rounds, split=not follows)
            except TransferError as e:
                # the records were read before a node moved to or from this shard: its holders by them serve only
                # a frozen copy of it now, or the copies asked for are a new holder's own shard. Asked the other
                # way, any node's is better than keeping weights rounds older (a joiner's own shard kept its
                # initial weights while the node that had trained it held them as a copy)
                other = f"copy:{shard}" if part.startswith("shard:") else f"shard:{shard}"
                try:
                    peer, download = self._fetch_first_round(shared_peers, other, [min_round], split=True)
                except TransferError:
                    logger.warning(f"shard {shard} keeps its local weights: {e}")
                    continue
                logger.info(f"shard {shard}: taken as {other} from {peer[:12]} ({part} is served by none)")
                part, frozen, follows = other, False, False
            load_shard_tensors(self.model, shard, download.tensors)
            self.frozen.held.pop(shard, None)
            if frozen:
                self.frozen.held[shard] = HeldCopy(download.round, peer)
            total += download.nbytes
        self.reset_outer()
        self.publish_snapshots(round_, restart=True)
        taken = StateTaken(round_, round_ * self.cfg.swarm.sync_steps, total, time.perf_counter() - start)
        logger.info(
            f"downloaded the swarm state ({total / 1e6:.2f} MB) in {taken.seconds:.1f}s, round {round_}"
        )
        return taken

    def _fetch_first_round(self, peers: list[str], part: str, rounds: list[int], split: bool):
        """(peer, download) of `part` of the first of `rounds` (each a least round) its holders serve."""
        for i, min_round in enumerate(rounds):
            try:
                return self.loop.run(
                    self.fetcher.fetch(peers, part, self._expected(part), min_round, split=split)
                )
            except TransferError as e:
                if i == len(rounds) - 1:
                    raise
                logger.info(f"no {part} of round {min_round} or later ({e}): taking an earlier round's")

    def _maybe_rebalance(self, nodes: dict, me: records.NodeInfo, round_: int) -> None:
        """Leave one of our shards for the one placement sends us to, if this node is the one to move
        (`rebalance_move`); our other shards stay."""
        move = rebalance_move(nodes, me, self.shards, self.cfg.swarm)
        if move is None:
            return
        old, new = move
        peers, part = self.fetcher.sources(nodes, new, self.bans.active())
        try:
            download = (
                self.loop.run(self.fetcher.fetch(peers, part, self._expected(part)))[1] if peers else None
            )
        except TransferError as e:
            logger.warning(f"not moving to shard {new}: {e}")
            return
        logger.info(f"moving from shard {old} to shard {new}, which the swarm needs more")
        shards = tuple(new if s == old else s for s in self.shards)
        if self.set_ownership is not None:
            self.set_ownership(list(shards))
        if download is not None:
            load_shard_tensors(self.model, new, download.tensors)
            download = None  # the shard's weights are in the model now: not held beside its averager's copy
        self.frozen.held.pop(new, None)
        self.shards = shards
        self.shard_avgs.pop(old).shutdown()
        self.shard_avgs[new] = self._averager(f"shard{new}", shard_tensors(self.model, new))
        self.shard_outers.pop(old, None)
        self.shard_outers[new] = self._outer(shard_tensors(self.model, new))
        self._anchors.pop(f"shard{old}", None)
        self.anchor_ids.pop(f"shard{old}", None)
        self._reanchor(f"shard{new}", shard_tensors(self.model, new))  # an id of our own until a clean round
        self.publish_snapshots(round_)  # the data part is the node's, whatever its shard: it stays
        logger.info(f"now training shard {new} (was {old})")

    def helper_processes(self) -> list:
        """The averager processes (to be killed if they do not stop)."""
        return [a.averager for a in (self.shared_avg, *self.shard_avgs.values()) if a is not None]

    def shutdown(self) -> None:
        self.frozen.cancel()
        if self.publisher is not None:
            self.publisher.shutdown()
        for averager in (self.shared_avg, *self.shard_avgs.values()):
            if averager is not None:
                averager.shutdown()
        try:
            if self.server is not None:
                self.loop.run(self.server.stop(), timeout=2)
            if self.dial_back is not None:
                self.loop.run(self.dial_back.stop(), timeout=2)
            if self.p2p is not None:
                self.loop.run(self.p2p.shutdown(), timeout=2)
        except Exception as e:
            logger.debug(f"p2p shutdown: {e}")
        self.loop.stop()


# ---------------------------------------------------------------------------------------------- decisions


def tokens_per_step(cfg: SpesConfig) -> int:
    """The most tokens a node trains on in one step (what bounds a peer's averaging weight)."""
    train = cfg.train
    return train.micro_batch_size * train.grad_accum * (train.seq_len + 1)


def live_peers(nodes: Mapping[str, records.NodeInfo], me: str, banned: Iterable[str] = ()) -> dict:
    """Other nodes that may be averaging now; when there are none, the round is a local no-op."""
    banned = set(banned)
    return {
        peer: n
        for peer, n in nodes.items()
        if peer != me and n.state in records.ACTIVE_STATES and peer not in banned
    }


def catch_up_target(
    round_: int, nodes: Mapping[str, records.NodeInfo], me: str, banned: Iterable[str] = ()
) -> int | None:
    """The round to catch up to after completing `round_`: the consensus of the other live, unbanned nodes when
    it is more than one round ahead (`progress.should_catch_up`), else None."""
    return should_catch_up(round_, (n.round for n in live_peers(nodes, me, banned).values()))


def wait_cap(
    last_round_seconds: float | None, matchmaking_time: float, this_round_so_far: float | None = None
) -> float:
    """How long a round may wait for peers about to finish: at most one round (ours, as the last one took).

    The published method waits for everyone (a barrier); we wait for whoever is expected within a round, and a
    node slower than that meets the others at a later round. Before a first round: this one as long as it has
    taken so far (its steps: a round, for a node that trained it from the start), at least the matchmaking window;
    a node whose cards are slower than ours by more than that window is met from the first round on, not the
    second."""
    if last_round_seconds:
        return last_round_seconds
    return max(matchmaking_time, this_round_so_far or 0.0)


def merge_due_at(round_: int, swarm: SwarmConfig) -> bool:
    """The merge warm-up runs after round `round_` (at sync step round x H) when its schedule says so."""
    return merge_due(round_ * swarm.sync_steps, swarm.merge_interval, swarm.merge_alpha0, swarm.merge_horizon)


def next_data_part(
    nodes: Mapping[str, records.NodeInfo], me: str, current: tuple[int, int]
) -> tuple[int, int] | None:
    """The data part to read from now on, or None to keep `current` (see `placement.data_part`): another part if a
    node with a smaller peer id reads ours, the same one narrower or wider as nodes come and go."""
    others = {peer: n for peer, n in nodes.items() if peer != me}
    part, num_parts = data_part(others, me, current=current[0])
    if (part, num_parts) == tuple(current):
        return None
    if part == current[0]:
        logger.info(f"data part {part}: {num_parts} parts instead of {current[1]} (nodes came or went)")
    else:
        logger.info(f"data part {current[0]} is also read by a node with a smaller peer id: taking {part}")
    return part, num_parts


def rebalance_move(
    nodes: Mapping[str, records.NodeInfo], me: records.NodeInfo, shards: tuple[int, ...], swarm: SwarmConfig
) -> tuple[int, int] | None:
    """(shard to leave, shard to take) when the swarm's one move (`placement.plan_rebalance_move`) is this node's,
    else None. `nodes`: the swarm's records; ours is replaced by `me`, whose shards are `shards`."""
    view = dict(nodes)
    view[me.peer_id] = replace(me, shards=list(shards))
    move = plan_rebalance_move(view, swarm.num_shards, swarm.replication_target)
    if move is None or move.peer != me.peer_id:
        return None
    return move.source, move.destination


@torch.no_grad()
def merge_own_experts(
    model: MoEForCausalLM, shards: Iterable[int], sync_step: int, swarm: SwarmConfig
) -> None:
    """The expert-merging warm-up on the experts of `shards`, from every expert's current (pre-merge) weights."""
    alpha = merge_alpha(sync_step, swarm.merge_alpha0, swarm.merge_horizon)
    if alpha <= 0:
        return
    shards = list(shards)
    for layer in model.model.layers:
        dense = [s.dense() for s in layer.mlp.shards]
        gate_up = torch.cat([g for g, _ in dense]).float()
        down = torch.cat([d for _, d in dense]).float()
        own = [layer.mlp.shards[shard] for shard in shards]
        update = [i for s in own for i in range(s.start, s.start + s.n)]
        new_gate_up, new_down = merge_layer(gate_up, down, alpha, swarm.merge_topk, update)
        for s in own:
            s.load_dense(new_gate_up[s.start : s.start + s.n], new_down[s.start : s.start + s.n])


def _shard_of(part: str) -> int:
    return int(part.split(":")[1])


def _to_host(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: to_host(t) for name, t in tensors.items()}
