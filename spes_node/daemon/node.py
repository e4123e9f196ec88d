"""The spes-node daemon: startup (DHT, config, checkpoint, shard, state download), the training loop, shutdown.

The loop reads like the method: H local steps, then one `sync()` (see `SpesRound`), then a checkpoint.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import random
import signal
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils.timed_storage import get_dht_time

from spes_node import __version__
from spes_node.aio import LoopThread
from spes_node.allocator import keep_large_blocks_mapped
from spes_node.config import SpesConfig, check_config_hash
from spes_node.daemon.capacity import ShardRequest, shard_capacity
from spes_node.daemon.checkpoint import (
    CheckpointError,
    CheckpointManager,
    rng_state,
    set_rng_state,
    take_snapshot,
)
from spes_node.daemon.checkpoint_writer import (
    CheckpointWriter,
    checkpoint_in_place,
    frozen_expert_names,
    without_frozen_experts,
)
from spes_node.daemon.data import TokenBatcher, validation_batches
from spes_node.daemon.metrics import NodeMetrics
from spes_node.daemon.pacing import RoundPacer
from spes_node.daemon.placement import assign_joiners, data_part, reachable
from spes_node.daemon.round import RoundInputs, RoundReport, SpesRound, StateTaken, live_peers, next_data_part
from spes_node.daemon.trainer import Trainer
from spes_node.devices import resolve_device
from spes_node.errors import SpesError
from spes_node.files import write_text_atomic
from spes_node.model.initial import initial_model
from spes_node.model.moe import MoEForCausalLM
from spes_node.model.ownership import load_state_in_place, owned_shards
from spes_node.model.tokenizer import training_tokenizer
from spes_node.procs import NodeDHT, kill_tree
from spes_node.swarm import reachability, records, relay
from spes_node.swarm.connections import aged_connections, close_connections
from spes_node.swarm.identity import load_or_create_identity
from spes_node.swarm.progress import ROUND_SLACK, RecentPeers, RoundMembers, consensus_round, should_catch_up
from spes_node.swarm.swarm_key import SwarmKey
from spes_node.swarm.watchdog import HANG_HEARTBEATS, DHTWatch

logger = logging.getLogger(__name__)

BOOTSTRAP_UNREACHABLE = "failed to connect to bootstrap peers"
"""How p2pd says that none of the `--peers` answered (it then exits)."""
BOOTSTRAP_RETRY_BASE_S, BOOTSTRAP_RETRY_MAX_S = 1.0, 8.0
"""Waits between attempts to reach the bootstrap peers: 1, 2, 4, 8, 8... seconds, within `join_timeout`."""

CONFIG_EXPIRATION_S = 3600.0
CONFIG_REPUBLISH_S = 600.0
SHUTDOWN_S = 10.0
"""A stopping node exits within this (plus the final checkpoint's write)."""
FINAL_WRITE_WAIT_S = 300.0
"""A stopping node waits this long for a checkpoint still being written before it writes the final one; past it,
that write is abandoned (the checkpoint before it stays) and there is no final checkpoint."""
ABSENT_GRACE_HEARTBEATS = 10
"""A node leaving after its last round waits this many heartbeats for a member of that round whose record expired
(a stalled node heartbeats again; a crashed one does not), within the averaging timeout; a round keeps expecting a
peer whose record a read missed this long after a read saw it (`RecentPeers`)."""
NETWORK_SHUTDOWN_S = 4.0
"""Of `SHUTDOWN_S`, what is kept for stopping the DHT (and the averagers, if not stopped yet) after the record is
withdrawn."""


NodesRead = tuple[dict[str, records.NodeInfo], dict[str, records.NodeInfo]]
"""A read of the swarm's node records: the live ones, and the peers the read missed that a recent one saw."""


class NodeError(SpesError):
    """A problem the user can fix; the CLI prints it as one line."""


class NodeFailed(SpesError):
    """The node stopped on a fault of its own while running (exit code 1, for a supervisor to start it again)."""

    exit_code = 1


@dataclass
class NodeOptions:
    """What may differ between the nodes of one swarm (everything else is in `SpesConfig`)."""

    peers: list[str] = field(default_factory=list)
    run_id: str = "spes"
    host_maddrs: list[str] = field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"])
    announce_maddrs: list[str] = field(default_factory=list)
    identity: Path | None = None
    shard: int | None = None
    """--shard N: train this shard (a one-shard --shards list)."""
    shards: ShardRequest = field(default_factory=ShardRequest)
    """--shards/--max-shards: which shards this node holds, or how many (`daemon.capacity`)."""
    data: str | None = None
    checkpoint_dir: Path = Path("checkpoints")
    device: str = "auto"
    max_rounds: int | None = None
    metrics_port: int | None = None
    public_name: str = ""
    client_mode: bool = False
    relays: list[str] = field(default_factory=list)
    """Peers to hold circuit relay reservations on (`spes_node.swarm.relay`)."""
    join_timeout: float = 30.0
    wait_peers: int = 1
    init_from: Path | None = None
    swarm_key: SwarmKey | None = None
    config_hash: str | None = None
    """The anchor: join only a swarm whose config has this hash (--config-hash)."""
    checkpoint_writes: str = "auto"
    """--checkpoint-writes: "background" (snapshot to host memory, written by a thread), "in-place" (the training
    thread writes the live tensors and waits), or "auto": in place when training on the CPU, whose training state
    is already in host memory, in the background otherwise (`checkpoint_writer`)."""


@dataclass
class NodeStatus:
    """What the node reports about itself: its DHT record, its metrics and its log lines."""

    state: str = "joining"
    round: int = 0
    tokens: int = 0
    tokens_per_s: float = 0.0
    loss: float = float("nan")
    loss_history: list[float] = field(default_factory=list)
    bytes_sent: dict[str, int] = field(default_factory=dict)
    bytes_received: dict[str, int] = field(default_factory=dict)

    def add_bytes(self, kind: str, sent: int, received: int) -> None:
        self.bytes_sent[kind] = self.bytes_sent.get(kind, 0) + sent
        self.bytes_received[kind] = self.bytes_received.get(kind, 0) + received


class Node:
    def __init__(self, cfg: SpesConfig | None, opts: NodeOptions):
        self.cfg, self.opts = cfg, opts
        self.status = NodeStatus()
        self.stop_event = threading.Event()
        self.rounds_done = 0
        self.steps_into_round = 0
        self.pacer: RoundPacer | None = None
        """When the round has another local step (H, then while waiting for slower peers); set with the config."""
        self.tokens_since_sync = 0
        self.round_losses: list[float] = []
        self._heartbeat: threading.Thread | None = None
        self.failure: str | None = None
        """Why the node stopped by itself (`run` raises it as `NodeFailed` once shut down)."""
        self.dht: NodeDHT | None = None
        self.sync: SpesRound | None = None
        self._net_loop: LoopThread | None = None
        """The event loop of the node's P2P calls (the DHT's p2p replica is bound to it); the round takes it over."""
        self.first_loss: float | None = None
        self.join_seconds = 0.0
        self.round_reports: list[dict] = []
        self._resume_rng: dict | None = None
        # set by the startup phases, in this order
        self.validator: RSASignatureValidator | None = None
        self.peer_id = ""
        self.visible_maddrs: list[str] = []
        self._swarm_args = ""
        self._logged_config_hash: str | None = None
        self._config_created_at: float | None = None
        self.config_hash = ""
        self.device: torch.device | None = None
        self.model: MoEForCausalLM | None = None
        self.checkpoints: CheckpointManager | None = None
        self.checkpoint_writer: CheckpointWriter | None = None
        self.shards: tuple[int, ...] = ()
        """The shards this node trains, in the order it took them."""
        self.batcher: TokenBatcher | None = None
        self.data_part: tuple[int, int] | None = None
        self.val_batches: list | None = None
        self.trainer: Trainer | None = None
        self.metrics: NodeMetrics | None = None

    @property
    def shard(self) -> int | None:
        """The first of the node's shards (None before it has any)."""
        return self.shards[0] if self.shards else None

    @shard.setter
    def shard(self, shard: int | None) -> None:
        self.shards = () if shard is None else (shard,)

    # ------------------------------------------------------------------ lifecycle

    def run(self) -> None:
        try:
            self.startup()
            self.train()
        finally:
            self.shutdown()
        if self.failure is not None:
            raise NodeFailed(self.failure)

    def install_signal_handlers(self) -> None:
        def handler(signum, _frame):
            if self.stop_event.is_set():
                logger.warning("second signal: exiting now")
                os._exit(128 + signum)
            logger.info(f"{signal.Signals(signum).name}: finishing cleanly (send again to exit at once)")
            self.stop_event.set()

        signal.signal(signal.SIGINT, handler)
        signal.signal(signal.SIGTERM, handler)
        # `kill -USR1 <pid>`: every thread's stack on stderr, for a node that seems stuck; it keeps running.
        # Refused (io.UnsupportedOperation, an OSError) where no file is behind stderr, as in-process under a runner
        try:
            faulthandler.register(signal.SIGUSR1, all_threads=True)
        except (ValueError, OSError, AttributeError):
            logger.debug("stderr is no file: SIGUSR1 prints no stacks")

    def startup(self) -> None:
        """The phases of joining, each one step further from this machine towards the swarm."""
        keep_large_blocks_mapped()  # before the helpers are forked and the model is built
        identity_path = self._prepare_local_files()
        self._join_dht(identity_path)
        checkpoint = self._load_checkpoint()
        nodes = self._take_shards(checkpoint)
        self._build_model_and_data(checkpoint, nodes)
        self._start_round(checkpoint, nodes)
        self._become_ready()

    def _prepare_local_files(self) -> Path:
        """The checkpoint directory (usable, or one clear error now) and the identity key; returns its path."""
        from spes_node.daemon.checkpoint import os_reason, prepare_directory

        opts = self.opts
        prepare_directory(opts.checkpoint_dir, replaced=("config.json", "summary.json"))
        identity_path = opts.identity or opts.checkpoint_dir / "identity.key"
        try:
            key = load_or_create_identity(identity_path)
        except OSError as e:
            raise NodeError(f"cannot create the identity file {identity_path}: {os_reason(e)}") from None
        self.validator = RSASignatureValidator(key)
        return identity_path

    def _join_dht(self, identity_path: Path) -> None:
        """Start the DHT and agree on the swarm's config (anchored, see `_agree_on_config`)."""
        self.dht = self._start_dht(str(identity_path))
        self.peer_id = self.dht.peer_id.to_base58()
        self.cfg = self._agree_on_config()
        self.config_hash = self.cfg.hash()
        if not self._check_reachability():
            self._restart_dht_as_client(str(identity_path))
        self._log_swarm_commands(self.config_hash)
        write_text_atomic(self.opts.checkpoint_dir / "config.json", self.cfg.to_json())

    def _check_reachability(self) -> bool:
        """A node that believes itself reachable asks a few live peers to dial it back (`reachability`); False
        when all that answer fail to: it must join as a client, as it takes no inbound connections, so placement
        must not make it the only holder of a shard. No peers, or no answer: True, it stays as it is."""
        opts = self.opts
        ports = reachability.tcp_ports(self.visible_maddrs)
        if opts.client_mode or not ports:
            return True
        nodes = records.fetch_nodes(self.dht, opts.run_id, self.cfg.swarm.num_shards, stop=self.stop_event)
        candidates = [peer for peer, n in live_peers(nodes, self.peer_id).items() if reachable(n)]
        # at random, not from the seeded generator: one honest peer that reaches us outweighs any that says no
        peers = random.SystemRandom().sample(candidates, min(len(candidates), reachability.MAX_ASKED))
        if not peers:
            return True
        loop = self._network_loop()
        try:
            p2p = loop.run(self.dht.replicate_p2p(), timeout=30)
            verdict = loop.run(
                reachability.dial_back(p2p, peers, ports, opts.run_id, reachability.ASK_TIMEOUT_S),
                timeout=reachability.ASK_TIMEOUT_S + 5,
            )
        except Exception as e:
            logger.warning(f"could not check whether peers reach this node: {type(e).__name__}: {e}")
            return True
        if verdict is False:
            logger.warning(
                f"none of {len(peers)} peer(s) could connect to this node (ports {ports}): joining as a client "
                "(--client-mode), as behind NAT or a firewall; open or forward the port to hold shards alone"
            )
            return False
        if verdict:
            logger.info("peers reach this node: it holds shards as a reachable peer")
        return True

    def _restart_dht_as_client(self, identity_path: str) -> None:
        """Start the DHT again in client mode, with the same identity: a DHT server that nobody can reach would
        sit in its peers' routing tables, and their lookups would wait on it."""
        loop = self._network_loop()
        try:  # the check's replica (the DHT keeps it): it would outlive the daemon it talks to
            replica = loop.run(self.dht.replicate_p2p(), timeout=10)
            loop.run(replica.shutdown(), timeout=10)
        except Exception as e:
            logger.debug(f"closing the check's p2p replica: {type(e).__name__}: {e}")
        self.dht.shutdown()
        self.opts = replace(self.opts, client_mode=True)
        self.dht = self._start_dht(identity_path)
        logger.info("DHT restarted in client mode: this node serves no DHT requests and holds no shard alone")

    def _network_loop(self) -> LoopThread:
        if self._net_loop is None:
            self._net_loop = LoopThread()
        return self._net_loop

    def _load_checkpoint(self):
        """The newest intact checkpoint of this run, or None."""
        self.checkpoints = CheckpointManager(self.opts.checkpoint_dir, keep=self.cfg.train.keep_checkpoints)
        self.checkpoint_writer = CheckpointWriter(self.checkpoints)
        try:
            checkpoint = self.checkpoints.latest()
        except CheckpointError as e:
            raise NodeError(str(e)) from None
        if checkpoint is not None and checkpoint.meta.get("config_hash") != self.config_hash:
            raise NodeError(
                f"checkpoint dir {self.opts.checkpoint_dir} holds a run with another config "
                f"(hash {str(checkpoint.meta.get('config_hash'))[:12]}); use another --checkpoint-dir"
            )
        return checkpoint

    def _take_shards(self, checkpoint) -> dict:
        """Choose the shards (the checkpoint's, --shard/--shards, or by placement), announce them and start the
        heartbeat; returns the other nodes' records as read then."""
        opts, num_shards = self.opts, self.cfg.swarm.num_shards
        if checkpoint is not None:
            shards = [int(s) for s in checkpoint.meta["shards"]]
            requested = [opts.shard] if opts.shard is not None else opts.shards.indices
            if requested is not None and list(requested) != shards:
                logger.warning(
                    f"resuming the checkpoint's shards {shards}, not the requested {list(requested)}"
                )
        else:
            shards = self._shards_to_hold()
        nodes = records.fetch_nodes(self.dht, opts.run_id, num_shards)
        nodes.pop(self.peer_id, None)
        outside = [s for s in shards if not 0 <= s < num_shards]
        if outside:
            raise NodeError(f"--shards: {outside[0]} is out of range [0, {num_shards})")
        self.shards = tuple(dict.fromkeys(shards))
        self.publish_record()  # at once, so that nodes choosing right after us count our shards
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, name="spes-heartbeat", daemon=True)
        self._heartbeat.start()
        return nodes

    def _build_model_and_data(self, checkpoint, nodes: dict) -> None:
        """The model with this node's ownership, its data part, the trainer; the checkpoint's state if resuming."""
        opts, cfg = self.opts, self.cfg
        self.device = resolve_device(opts.device)
        torch.manual_seed(cfg.train.seed)
        # made where it trains, one weight at a time, each frozen shard at its storage precision: no fp32 copy of
        # the whole model in host memory (25.8 GiB at spes-7b)
        self.model = initial_model(
            cfg.model,
            cfg.swarm.num_shards,
            cfg.train.seed,
            owned=self.shards,
            frozen_dtype=cfg.swarm.frozen_dtype,
            device=self.device,
            draw=opts.init_from is None,  # else every weight comes from the checkpoint
        )
        if opts.init_from is not None:
            from spes_node.model.hf_checkpoint import load_hf_weights

            load_hf_weights(self.model, opts.init_from)
            logger.info(f"initial weights from {opts.init_from}")

        tokenizer = training_tokenizer(cfg.data.tokenizer)
        spec = opts.data or cfg.data.source
        # a restarted node keeps its part (and so its place in the data) unless another node took it meanwhile
        resumed_part = checkpoint.meta.get("data_part") if checkpoint is not None else None
        part, num_parts = data_part(
            nodes, self.peer_id, current=int(resumed_part[0]) if resumed_part else None
        )
        self.batcher = TokenBatcher(
            spec,
            tokenizer,
            cfg.train.seq_len,
            cfg.train.micro_batch_size,
            part=part,
            num_parts=num_parts,
            seed=cfg.train.seed,
            val_fraction=cfg.data.val_fraction,
        )
        self.data_part = (part, num_parts)
        self.val_batches = validation_batches(
            spec,
            tokenizer,
            cfg.train.seq_len,
            cfg.train.micro_batch_size,
            cfg.train.eval_batches,
            val_fraction=cfg.data.val_fraction,
        )
        self.trainer = Trainer(cfg, self.model, self.batcher, self.device)
        self.pacer = RoundPacer(cfg.swarm.sync_steps, enabled=cfg.swarm.train_while_waiting)
        self.recent_peers = RecentPeers(ABSENT_GRACE_HEARTBEATS * cfg.swarm.heartbeat_s)
        if checkpoint is not None:
            self._resume(checkpoint)

    def _start_round(self, checkpoint, nodes: dict) -> None:
        """Serve our state and take the swarm's: a new node downloads everything; a resumed node behind the swarm
        catches up, its own shard included (its stale shard would otherwise pull its replicas back)."""
        self.sync = SpesRound(
            self.cfg,
            run_id=self.opts.run_id,
            config_hash=self.config_hash,
            peer_id=self.peer_id,
            dht=self.dht,
            model=self.model,
            shards=self.shards,
            stop_event=self.stop_event,
            set_ownership=self.trainer.set_ownership,
            swarm_key=self.opts.swarm_key,
            client_mode=self.opts.client_mode,
            loop=self._network_loop(),
        )
        # the config's seeded initial weights, the same on every node that neither resumed nor loaded --init-from
        fresh = checkpoint is None and self.opts.init_from is None
        self.sync.start(self.status.round, fresh=fresh)
        if checkpoint is not None:
            self._restore_outer(checkpoint)
        live = [n.round for n in nodes.values() if n.state in records.ACTIVE_STATES]
        behind = should_catch_up(self.status.round, live, slack=0)
        if checkpoint is None:
            # also at round 0: the swarm may have started from --init-from weights; the state of the round most
            # live nodes are in (a holder one round behind would start us a round late)
            taken = self.sync.take_swarm_state(nodes, self.status.round, min_round=consensus_round(live) or 0)
            if fresh and taken is not None and taken.round == 0:
                # the swarm's round-0 state is the seeded initial weights we hold too (at wire precision):
                # keep their shared anchor id instead of one of our own
                self.sync.adopt_initial_anchor()
            self._take_state(taken)
            self._join_mid_round()
        elif behind is not None:
            resumed_round = self.status.round
            self._take_state(self.sync.take_swarm_state(nodes, self.status.round, min_round=behind))
            if self.status.round > resumed_round:
                self.save_checkpoint(wait=True)  # written before we say so: the first steps run after it
                logger.info(
                    f"caught up from round {resumed_round} to the swarm's round {self.status.round} "
                    f"(checkpoint at step {self.trainer.step})"
                )
        if checkpoint is not None and not checkpoint.meta.get("frozen_experts", True):
            if self.status.round == int(checkpoint.meta["round"]):  # a catch-up downloaded them with the rest
                self._refetch_frozen_experts(nodes)

    def _refetch_frozen_experts(self, nodes: dict) -> None:
        """Download the frozen experts a checkpoint left out from their holders (the round's refresh), before the
        first step. A shard no live node holds keeps its initial weights (said in one line): a node that trains it
        later is refreshed from as usual."""
        owned = owned_shards(self.model)
        frozen = [s for s in range(self.cfg.swarm.num_shards) if s not in owned]
        held = {s for n in nodes.values() if n.state in records.ACTIVE_STATES for s in n.shards}
        unheld = [s for s in frozen if s not in held]
        if unheld:
            logger.warning(
                f"the checkpoint holds no frozen experts and no live node holds shard(s) {unheld}: "
                f"they start from their initial weights"
            )
        if len(unheld) == len(frozen):
            return
        self.sync.start_refresh(nodes, min_round=0)
        fetched = self.sync.finish_pending()
        self.status.add_bytes("refresh", 0, self.sync.take_refresh_bytes())
        logger.info(f"downloaded the frozen experts of {fetched} of {len(frozen) - len(unheld)} held shards")

    def _take_state(self, taken: StateTaken | None) -> None:
        """Apply a download of the swarm's state: its round, the step that round implies, bytes, time taken."""
        if taken is None:
            return
        self.status.round = max(self.status.round, taken.round)
        self.trainer.step = max(self.trainer.step, taken.min_step)
        self.status.add_bytes("state_download", 0, taken.nbytes)
        self.join_seconds = taken.seconds

    def _join_mid_round(self) -> None:
        """Start where the swarm is within its round: a joiner that began the round from step 0 would reach the
        sync several steps after the others and miss their groups. Its first round is shorter (and weighs less).

        The records are read again: over a slow link the swarm may have finished a round during the download. One
        round is the skew nodes tolerate (`progress.ROUND_SLACK`): the joiner then takes the swarm's round with the
        weights of the round before, as a node that finished its round a moment late would."""
        H = self.cfg.swarm.sync_steps
        nodes = records.fetch_nodes(self.dht, self.opts.run_id, self.cfg.swarm.num_shards)
        live = {p: n for p, n in nodes.items() if p != self.peer_id and n.state in records.ACTIVE_STATES}
        target = consensus_round(n.round for n in live.values())
        if target is not None and self.status.round < target <= self.status.round + ROUND_SLACK:
            logger.info(f"the swarm finished round {target} during the download: joining it there")
            self.status.round = target
        steps = consensus_round(
            (n.round_steps if n.round_steps is not None else n.step - self.status.round * H)
            for n in live.values()
            if n.round == self.status.round
        )
        if steps is None or not 0 < steps < H:
            steps = 0
        self.steps_into_round = steps
        self.trainer.step = max(self.trainer.step, self.status.round * H + steps)
        if steps:
            logger.info(f"joining round {self.status.round + 1} at its step {steps} of {H}, with the swarm")

    def _become_ready(self) -> None:
        """Announce training, wait for --wait-peers, settle the data part, then the first step may run."""
        self.status.state = "training"
        self.publish_record()
        self._wait_for_peers()
        self.sync.training_started()
        # replicas that started together may have taken the same data part; settle it before the first step
        # (after a round it would cost the mover the time to re-read its data while the others match)
        nodes = records.fetch_nodes(self.dht, self.opts.run_id, self.cfg.swarm.num_shards)
        self._set_data_part(next_data_part(nodes, self.peer_id, self.data_part))
        if self._resume_rng is not None:
            set_rng_state(self._resume_rng)  # last, so that nothing in startup draws from the restored state
        logger.info(
            f"node {self.peer_id} training {_shards_text(self.shards)} ({self.cfg.name}, round {self.status.round}, "
            f"data part {self.data_part[0]}/{self.data_part[1]}, device {self.device})"
        )
        self.metrics = NodeMetrics(self.opts.metrics_port)
        self.metrics.update(self.status, None, step=self.trainer.step)

    def _wait_for_peers(self) -> None:
        """With --wait-peers N, hold the first step until N nodes (this one included) are ready to train."""
        if self.opts.wait_peers <= 1:
            return
        deadline = time.monotonic() + self.opts.join_timeout * 4
        while not self.stop_event.is_set():
            nodes = records.fetch_nodes(self.dht, self.opts.run_id, self.cfg.swarm.num_shards)
            ready = [n for n in nodes.values() if n.state in records.ACTIVE_STATES]
            if len(ready) >= self.opts.wait_peers:
                return
            if time.monotonic() > deadline:
                raise NodeError(f"--wait-peers: only {len(ready)} of {self.opts.wait_peers} nodes showed up")
            self.stop_event.wait(0.5)

    def _shards_to_hold(self) -> list[int]:
        """The shards --shard/--shards name, else as many as the node's capacity (the memory plan) by placement."""
        request = self.opts.shards
        if self.opts.shard is not None:
            request = replace(request, indices=(self.opts.shard,))
        try:
            capacity = shard_capacity(self.cfg, request, resolve_device(self.opts.device))
        except ValueError as e:
            raise NodeError(str(e)) from None
        if request.indices is not None:
            return list(request.indices)
        logger.info(f"{request.describe()}: room for {capacity} of {self.cfg.swarm.num_shards} shards")
        return self._choose_shards(capacity)

    def _choose_shards(self, capacity: int = 1) -> list[int]:
        """Announce ourselves as joining, let simultaneous joiners appear, then take the neediest shards."""
        run_id, num_shards = self.opts.run_id, self.cfg.swarm.num_shards
        self.shards = ()
        records.publish_node(
            self.dht,
            run_id,
            self._joining_info(),
            self.validator,
            expiration_s=3 * self.cfg.swarm.heartbeat_s,
        )
        before = records.fetch_nodes(self.dht, run_id, num_shards)
        time.sleep(min(2.0, self.cfg.swarm.heartbeat_s))
        # both reads count: a holder whose heartbeat came late, or that one read missed, is still a holder (placed
        # without it, we would take a shard it already holds, and a rebalance would have to move someone later)
        nodes = {**before, **records.fetch_nodes(self.dht, run_id, num_shards)}
        nodes[self.peer_id] = self._joining_info()
        joiners = [p for p, n in nodes.items() if n.state == "joining" and not n.shards]
        target = self.cfg.swarm.replication_target
        return assign_joiners(nodes, joiners, num_shards, target=target, capacities={self.peer_id: capacity})[
            self.peer_id
        ]

    def _joining_info(self) -> records.NodeInfo:
        return records.NodeInfo(
            peer_id=self.peer_id,
            shards=[],
            state="joining",
            public_name=self.opts.public_name,
            client_mode=self.opts.client_mode,
        )

    def _start_dht(self, identity_path: str) -> NodeDHT:
        """Start the DHT. A bootstrap peer that cannot be reached (down for a moment, a connection lost to a loaded
        link) is tried again, with growing waits, for `join_timeout` seconds in all; any other failure, or the
        last one, is the one line of `NodeError`."""
        opts = self.opts
        deadline = time.monotonic() + opts.join_timeout
        attempt = 0
        while True:
            try:
                dht = NodeDHT(
                    initial_peers=opts.peers or None,
                    host_maddrs=opts.host_maddrs,
                    announce_maddrs=opts.announce_maddrs or None,
                    identity_path=identity_path,
                    client_mode=opts.client_mode,
                    record_validators=records.record_validators(self.validator),
                    authorizer=opts.swarm_key.authorizer() if opts.swarm_key else None,
                    start=True,
                    startup_timeout=opts.join_timeout,
                    **relay.dht_kwargs(opts.relays),
                )
                break
            except Exception as e:
                reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                wait = min(BOOTSTRAP_RETRY_BASE_S * 2**attempt, BOOTSTRAP_RETRY_MAX_S)
                if (
                    opts.peers
                    and BOOTSTRAP_UNREACHABLE in reason
                    and time.monotonic() + wait < deadline
                    and not self.stop_event.is_set()
                ):
                    logger.warning(
                        f"cannot reach the bootstrap peers yet ({reason}): trying again in {wait:.0f}s"
                    )
                    self.stop_event.wait(wait)
                    attempt += 1
                    continue
                raise NodeError(
                    f"cannot start or reach the DHT ({', '.join(opts.peers) or 'no peers'}): {reason}"
                ) from None
        dht.note_children()
        if not opts.client_mode:
            maddrs = [str(m) for m in dht.get_visible_maddrs()]
            self.visible_maddrs = maddrs
        else:
            self.visible_maddrs = []
        # complete commands, so that a pasted one finds this swarm (others reach a client-mode node's swarm through
        # the peers it joined by); a private swarm's key is never printed
        if peers := " ".join(f"--peers {m}" for m in (self.visible_maddrs or opts.peers)):
            swarm = f"{peers} --run-id {opts.run_id}"
            swarm += " --swarm-key-file YOUR_SWARM_KEY_FILE" if opts.swarm_key else ""
            self._swarm_args = swarm
            if not opts.peers:
                # a founder logs them at once; a joiner after its peers have checked that they reach it
                self._log_swarm_commands(self.cfg.hash() if self.cfg is not None else opts.config_hash)
        if opts.relays:
            circuits = relay.circuit_maddrs(opts.relays, dht.peer_id.to_base58())
            logger.info(f"reachable through {len(circuits)} relay(s): {', '.join(circuits)}")
            self.visible_maddrs = [*circuits, *self.visible_maddrs][: records.MAX_MADDRS]
        return dht

    def _log_swarm_commands(self, config_hash: str | None) -> None:
        """Log the complete commands that join and watch this swarm, with the config hash that anchors a joiner
        (--config-hash) once it is known; logged again when the config is agreed if the hash was not known yet."""
        swarm, logged = self._swarm_args, self._logged_config_hash
        if not swarm or (config_hash is not None and config_hash == logged):
            return
        if config_hash:
            swarm += f" --config-hash {config_hash}"
        self._logged_config_hash = config_hash
        logger.info(f"to join this swarm: spes-node join {swarm}")
        logger.info(f"to watch it: spes-node status {swarm}")

    def _agree_on_config(self) -> SpesConfig:
        """The swarm config, anchored: the node takes only the config whose hash (recomputed from its JSON) is the
        anchor: --preset/--config, else --config-hash, else the config of its own checkpoint. Without an anchor it
        takes the config only if every published copy agrees, with a warning; counting copies decides nothing."""
        opts, cfg = self.opts, self.cfg
        saved = self._checkpoint_config_hash()
        if opts.config_hash and cfg is not None and cfg.hash() != opts.config_hash:
            raise NodeError(
                f"--config-hash {opts.config_hash[:12]} is not the hash of our config ({cfg.hash()[:12]})"
            )
        if opts.config_hash and saved and saved != opts.config_hash:
            raise NodeError(
                f"--config-hash {opts.config_hash[:12]} is not the config of the checkpoint in {opts.checkpoint_dir} "
                f"({saved[:12]}); use another --checkpoint-dir"
            )
        if cfg is not None:
            anchor, source = cfg.hash(), "--preset/--config"
        elif opts.config_hash:
            anchor, source = opts.config_hash, "--config-hash"
        else:
            anchor, source = saved, "the checkpoint"

        def settled(found: dict) -> bool:
            # a node that brought its config founds the swarm if there is none; others wait for theirs to show up
            return cfg is not None or (anchor in found if anchor else bool(found))

        deadline = time.monotonic() + (opts.join_timeout if opts.peers else 0)
        configs = records.fetch_configs(self.dht, opts.run_id)
        while opts.peers and not settled(configs) and time.monotonic() < deadline:
            time.sleep(1.0)
            configs = records.fetch_configs(self.dht, opts.run_id)
        seen = ", ".join(h[:12] for h in configs)
        if anchor is None:
            if not configs:
                from spes_node.daemon.status import no_swarm_message

                raise NodeError(no_swarm_message(self.dht, opts.run_id))
            if len(configs) > 1:
                raise NodeError(str(records.ConfigConflict(opts.run_id, list(configs))))
            record = next(iter(configs.values()))
            logger.warning(
                f"swarm '{opts.run_id}' runs config {record.config_hash[:12]}, taken unanchored (every published "
                f"copy agrees, but any peer can publish one): pass --config-hash {record.config_hash} to be sure"
            )
            cfg = SpesConfig.from_json(record.config_json)
        elif anchor in configs:
            record = configs[anchor]
            swarm_cfg = SpesConfig.from_json(record.config_json)
            if swarm_cfg.hash() != anchor:
                raise NodeError(
                    f"swarm '{opts.run_id}' config {anchor[:12]} reads as {swarm_cfg.hash()[:12]} with this version "
                    f"of spes-node ({__version__}); run the founder's version"
                )
            cfg = swarm_cfg
        elif configs:
            raise NodeError(
                f"config mismatch: swarm '{opts.run_id}' runs config {seen} but ours ({source}) is {anchor[:12]}; "
                + (
                    "join without --preset/--config, with --config-hash, to adopt the swarm's"
                    if cfg is not None
                    else "check the --config-hash the founder printed"
                )
            )
        elif cfg is None:
            from spes_node.daemon.status import no_swarm_message

            raise NodeError(no_swarm_message(self.dht, opts.run_id))
        else:
            record = None
            logger.info(f"founding swarm '{opts.run_id}' (config {cfg.hash()[:12]})")
        self._config_created_at = record.created_at if record is not None else None
        self.cfg = cfg
        self._publish_config()
        return cfg

    def _checkpoint_config_hash(self) -> str | None:
        """The config hash in the meta of this node's newest checkpoint, if it has one (the checkpoint itself is
        verified when it is loaded, after the config is agreed)."""
        from spes_node.daemon.checkpoint import META_FILE

        try:
            paths = CheckpointManager(self.opts.checkpoint_dir).list()
        except CheckpointError:
            return None
        for path in reversed(paths):
            try:
                return check_config_hash(json.loads((path / META_FILE).read_text())["meta"]["config_hash"])
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                continue
        return None

    def _restore_outer(self, checkpoint) -> None:
        """The outer optimiser's state (Nesterov momentum), saved beside the inner one."""
        outer = checkpoint.optimizer_part("outer")
        if outer:
            self.sync.load_outer_state_dict(outer)

    def _resume(self, checkpoint) -> None:
        meta = checkpoint.meta
        # without frozen experts (checkpoint_frozen_experts = false) they keep their initial weights until
        # `_refetch_frozen_experts` downloads them
        absent = (
            set()
            if meta.get("frozen_experts", True)
            else frozen_expert_names(self.model.state_dict(), meta["shards"])
        )
        # one tensor at a time, each on to the device as it is read: the host never holds the checkpoint whole
        # (23.3 GiB of weights and AdamW moments at spes-7b)
        try:
            missing, unexpected = load_state_in_place(self.model, checkpoint.tensors)
        except ValueError as e:
            raise NodeError(f"checkpoint {checkpoint.path} does not fit the model: {e}") from None
        if unexpected or set(missing) - absent:
            wrong = sorted(unexpected) or sorted(set(missing) - absent)
            raise NodeError(f"checkpoint {checkpoint.path} does not fit the model (e.g. {wrong[0]})")
        self.trainer.set_ownership([int(s) for s in meta["shards"]])
        by_name = checkpoint.optimizer_part("by_name", self.device)
        if by_name:
            self.trainer.optimizer = self.trainer._build_optimizer(by_name)
        self.trainer.step = int(meta["step"])
        self.status.round = int(meta["round"])
        self.status.tokens = int(meta.get("tokens", 0))
        self.status.loss_history = list(meta.get("loss_history", []))
        self.round_losses = [float(x) for x in meta.get("round_losses", [])]
        self.steps_into_round = int(meta.get("steps_into_round", 0))
        self.tokens_since_sync = int(meta.get("tokens_since_sync", 0))
        saved_part = meta.get("data_part")
        if saved_part and saved_part[0] == self.data_part[0] and meta.get("data_state") is not None:
            self.batcher.load_state_dict(meta["data_state"])
            # nodes came or went meanwhile: the same part, read narrower or wider from where it was
            self.batcher.set_part(*self.data_part)
        self._resume_rng = meta.get("rng")
        logger.info(
            f"resumed from {checkpoint.path.name}: round {self.status.round}, step {self.trainer.step}"
        )

    def shutdown(self) -> None:
        """Leave within `SHUTDOWN_S`: checkpoint, summary, withdraw the record, stop the networking.

        Only the checkpoint is local; every step that talks to the DHT or p2pd is bounded, so that a node whose
        helpers died first (a signal to the whole cgroup) still exits in time."""
        self.stop_event.set()
        started = time.monotonic()
        leaving = self.dht is not None and self.sync is not None
        if leaving:
            self.status.state = "leaving"
            try:
                self.save_checkpoint(wait=True)
            except Exception as e:
                logger.error(f"final checkpoint failed: {e}")
            self.write_summary()
        # counted from here: a large model's final checkpoint takes longer than the whole budget (spes-1b on a CPU
        # took 9 s), and the record must still be withdrawn after it
        checkpointed = time.monotonic()
        deadline = checkpointed + SHUTDOWN_S
        dht_answers = self.dht is not None and self.dht.is_alive()
        # the averagers and servers stop while the record is withdrawn (neither needs the other): a DHT that
        # hangs costs the withdrawal's bound once, not that plus the averagers' stop
        stopping = _Bounded(self.sync.shutdown, "stop averaging") if self.sync is not None else None
        if stopping is None and self._net_loop is not None:
            self._net_loop.stop()
        if leaving:
            if dht_answers:
                withdrawal = _Bounded(
                    lambda: records.withdraw_node(self.dht, self.opts.run_id, self.peer_id, self.validator),
                    "withdraw the node record",
                )
                dht_answers = withdrawal.join(deadline - time.monotonic() - NETWORK_SHUTDOWN_S)
            else:
                logger.warning("the DHT process is gone: the node record expires by itself")
        if stopping is not None:
            stopping.join(max(1.0, deadline - time.monotonic() - 2.0))
        if self.dht is not None:
            # a DHT that did not answer the withdrawal in its time hangs: it will not stop when asked either
            seconds = max(1.0, deadline - time.monotonic()) if dht_answers else 1.0
            _bounded(self.dht.shutdown, seconds, "stop the DHT")
        # a helper that did not stop when asked (hung, or stopped) would hold the exit: multiprocessing joins it
        helpers = [self.dht, *(self.sync.helper_processes() if self.sync is not None else [])]
        for helper in helpers:
            if helper is not None and helper.is_alive():
                logger.warning(
                    f"killing helper process {helper.pid} ({type(helper).__name__}), which did not stop"
                )
                kill_tree(helper.pid)
        if self.dht is not None:
            self.dht.end_orphans()
        logger.info(
            f"stopped: final checkpoint {checkpointed - started:.1f}s, network "
            f"{time.monotonic() - checkpointed:.1f}s"
        )

    # ------------------------------------------------------------------ training

    def train(self) -> None:
        H = self.cfg.swarm.sync_steps
        self.checkpoint_writer.start_clock(self.trainer.step)
        window_tokens, window_start = 0, time.perf_counter()
        while not self.stop_event.is_set():
            if self.opts.max_rounds is not None and self.rounds_done >= self.opts.max_rounds:
                break
            self.status.state = "training"
            while self.pacer.another_step(self.steps_into_round) and not self.stop_event.is_set():
                self.sync.apply_pending()
                self.status.add_bytes("refresh", 0, self.sync.take_refresh_bytes())
                if self.sync.shared_due(self.steps_into_round):
                    self.sync.land_shared(self.steps_into_round)
                if self.sync.round_ready():
                    self._complete_round()
                stats = self.trainer.train_step(self.status.round * H + min(self.steps_into_round, H))
                self.pacer.note_step(stats.seconds)
                self.steps_into_round += 1
                self.tokens_since_sync += stats.tokens
                self.status.tokens += stats.tokens
                self.round_losses.append(stats.ce_loss)
                self.status.loss = stats.ce_loss
                if self.first_loss is None:
                    self.first_loss = stats.ce_loss
                window_tokens += stats.tokens
                if self.trainer.step % self.cfg.train.log_every == 0:
                    elapsed = time.perf_counter() - window_start
                    self.status.tokens_per_s = window_tokens / max(elapsed, 1e-9)
                    window_tokens, window_start = 0, time.perf_counter()
                    logger.info(
                        f"step {self.trainer.step} round {self.status.round} loss {stats.ce_loss:.4f} "
                        f"lr {stats.lr:.2e} grad_norm {stats.grad_norm:.2f} tokens/s {self.status.tokens_per_s:.0f}"
                    )
                    self.metrics.update(self.status, self.sync.last_report, step=self.trainer.step)
                if self.steps_into_round < H:  # the round's end checkpoints, when due
                    self.checkpoint_if_due()
            if self.stop_event.is_set():
                break
            if self.sync.round_in_flight():
                self._complete_round()
            last = self.opts.max_rounds is not None and self.rounds_done + 1 >= self.opts.max_rounds
            overlap = self.cfg.swarm.overlap and not last
            # the shards' all-reduces only: the round waits for the shared parameters', then training goes on
            overlap_shards = self.cfg.swarm.overlap_shards and not overlap and not last
            if not self._at_sync(overlap, overlap_shards):
                continue
            self.steps_into_round = 0
            self.pacer.new_round()
            self.tokens_since_sync = 0
            if overlap_shards:
                if not self.cfg.swarm.shared_lag_steps:  # else it lands between the next steps (`shared_due`)
                    self.sync.land_shared()
                self.status.state = "training"
            elif not overlap:
                self._complete_round()
        if self.sync.round_in_flight():
            self._complete_round()
        if self.sync.finish_pending() and self.cfg.train.checkpoint_frozen_experts:
            # frozen experts changed, and checkpoints hold them: the final one is not a duplicate of the last one
            self.checkpoint_writer.key = None
        self.status.add_bytes("refresh", 0, self.sync.take_refresh_bytes())
        if self.opts.max_rounds is not None and self.rounds_done >= self.opts.max_rounds:
            self.await_round_members()

    def await_round_members(self) -> None:
        """Leaving after the last round of a `--max-rounds` run: announce it, then wait (at most the averaging
        timeout) until the other members of that round's groups have ended it too (`progress.RoundMembers`).

        Our own results can be complete while our last averaged parts are still on their way to a member (in
        p2pd's buffers, behind a slow reader); stopping the networking then would cut them off, and that member's
        round would lose a part. Both sides announce before they wait, so two nodes leaving together free each
        other."""
        members = self.round_reports[-1]["members"] if self.round_reports else []
        if not members or self.stop_event.is_set():
            return
        self.status.state = "leaving"
        self.publish_record()
        round_ = self.status.round
        awaited = RoundMembers(
            members, round_, absent_grace=ABSENT_GRACE_HEARTBEATS * self.cfg.swarm.heartbeat_s
        )
        behind = records.wait_for_nodes(
            self.dht,
            self.opts.run_id,
            lambda nodes, leaving: awaited.pending(nodes, leaving, time.monotonic()),
            timeout=self.cfg.swarm.averaging_timeout,
            num_shards=self.cfg.swarm.num_shards,
            stop=self.stop_event,
        )
        if self.stop_event.is_set():
            return
        if behind is None:
            logger.warning(
                f"leaving without knowing whether round {round_}'s members have ended it: no record read"
            )
        elif behind:
            logger.warning(
                f"leaving while {len(behind)} member(s) of round {round_} have not ended it: "
                + ", ".join(sorted(peer[:12] for peer in behind))
            )
        else:
            logger.info(f"round {round_}'s members have ended it: leaving")

    def _at_sync(self, overlap: bool, overlap_shards: bool) -> bool:
        """Step H: begin the round (True), or train on while the peers of our groups finish their steps (False).

        The records the decision read are the round's too when nothing came between: no refresh was in flight as
        they were read, so `_begin_round` does not wait on a holder before reading them. A second read there
        would cost every round one more DHT lookup on the training thread (a second or more across home links)."""
        read = None
        if not overlap:
            train_on, read = self._train_while_waiting()
            if train_on:
                return False
        self._begin_round(overlap, overlap_shards, read)
        return True

    def _train_while_waiting(self) -> tuple[bool, NodesRead | None]:
        """At the sync: whether to train on, instead of idling while the peers of our groups finish their steps;
        and the records read to decide, when the round can begin on them (see `_at_sync`).

        Once a round: the records are read and the round's wait for its slowest expected peer is worked out as the
        round itself will (`SpesRound.wait_ahead`). The node then trains until that peer is due, one step at a
        time while another fits (`pacing.RoundPacer`, so that steps slower than expected cost one step's error,
        not many), and its record announces when it will sync, so that a peer reaching the sync meanwhile waits for
        us in turn. The wait that is left, less than a step, is spent in matchmaking as before."""
        if not self.pacer.wants_wait():
            return False, None
        refreshing = self.sync.refresh_in_flight()
        read = self._read_nodes()
        wait = self.sync.wait_ahead(read[0], self.status.round, self.node_info())
        if not self.pacer.wait(wait):
            return False, None if refreshing else read
        logger.info(f"round {self.status.round + 1}: peers are {wait:.1f}s from the sync: training meanwhile")
        self.publish_record()
        return True, None

    def _read_nodes(self) -> NodesRead:
        """Read the swarm's node records: the live ones, and the peers this read missed that a recent read saw
        (`RecentPeers`, which every read at the sync keeps up to date)."""
        leaving: set[str] = set()
        nodes = records.fetch_nodes(
            self.dht, self.opts.run_id, self.cfg.swarm.num_shards, stop=self.stop_event, leaving=leaving
        )
        return nodes, self.recent_peers.update(nodes, leaving, time.monotonic())

    def _begin_round(
        self, overlap: bool, overlap_shards: bool = False, read: NodesRead | None = None
    ) -> None:
        """Announce that we average, read the swarm's records (the round's one read, unless `read` is one just
        taken) and start the all-reduces.

        The refresh in flight lands first: it may wait for a holder to finish the round it asked for, and the records
        are read after it, so that they show where that holder is now (see `progress.wait_for_peers`)."""
        self.status.state = "averaging"
        self.sync.finish_pending()
        self.publish_record()
        nodes, missed = read if read is not None else self._read_nodes()
        if self.cfg.swarm.fresh_connections:
            self._close_aged_connections(nodes)
        inputs = RoundInputs(
            round=self.status.round,
            step=self.trainer.step,
            tokens_since_sync=self.tokens_since_sync,
            loss=self.end_round_loss(),
            nodes=nodes,
            missed=missed,
            me=self.node_info(),
            data_part=self.data_part,
            steps=self.steps_into_round,
        )
        self.sync.begin_round(
            inputs, overlap=overlap, overlap_shards=overlap_shards, shared_lag=self.cfg.swarm.shared_lag_steps
        )
        if overlap:
            self.status.state = "training"

    def _close_aged_connections(self, nodes: dict[str, records.NodeInfo]) -> None:
        """Close the connections to the last round's group members whose records show they have ended it, so that
        this round's all-reduces dial fresh ones (`swarm.fresh_connections`, `swarm/connections.py`). A member still
        in that round keeps its connection (it may be receiving that round's last results from us), and so do a member
        at its sync already (it closed the connection to us itself), client-mode members and our relays
        (`connections.aged_connections`)."""
        members = self.round_reports[-1]["members"] if self.round_reports else []
        done = aged_connections(
            members, nodes, self.status.round, keep=relay.relay_peer_ids(self.opts.relays)
        )
        if done:
            closed = close_connections(self.dht, done)
            logger.info(
                f"round {self.status.round + 1}: closed {closed} connection(s) to last round's members"
            )

    def _complete_round(self) -> None:
        report = self.sync.complete_round()
        self._apply_round(report)
        self.metrics.update(self.status, self.sync.last_report, step=self.trainer.step)
        self.round_reports.append(self.sync.last_report)
        self.rounds_done += 1
        self.checkpoint_if_due(round_end=True)

    def _apply_round(self, report: RoundReport) -> None:
        """What the round changed: round, bytes, the trainer's step after a catch-up, shards, data part."""
        self.status.round = report.round
        for kind in report.bytes_sent.keys() | report.bytes_received.keys():
            self.status.add_bytes(kind, report.bytes_sent.get(kind, 0), report.bytes_received.get(kind, 0))
        if report.state_taken is not None:
            self.trainer.step = max(self.trainer.step, report.state_taken.min_step)
        self._set_data_part(report.data_part)
        moved = tuple(report.shards) != self.shards
        self.shards = tuple(report.shards)
        self.status.state = "training"
        if moved:
            self.publish_record()

    def _set_data_part(self, part: tuple[int, int] | None) -> None:
        """Read another data part (announced by the next heartbeat: a DHT store here would delay the next step)."""
        if part is None or part == self.data_part:
            return
        self.batcher.set_part(*part)
        self.data_part = part

    def end_round_loss(self) -> float:
        loss = sum(self.round_losses) / len(self.round_losses) if self.round_losses else float("nan")
        self.round_losses = []
        self.status.loss_history = (self.status.loss_history + [loss])[-64:]
        return loss

    def checkpoint_if_due(self, round_end: bool = False) -> None:
        """Checkpoint when `checkpoint_every` steps or `checkpoint_every_minutes` have passed (at a round's end,
        also when neither is set); see `checkpoint_writer.checkpoint_due`.

        While a round's all-reduces run beside the steps (`swarm.overlap_shards`, `swarm.overlap`), a checkpoint
        that comes due waits for the round's end, where it stays due: taken mid-round, it held the weights before
        the round's average landed (a resume from it loses the round), the round's end wrote the same step again
        (3.7 GiB twice within seconds at spes-1b), and a GPU node's host copy of it stacked on the round's own."""
        if not round_end and self.sync is not None and self.sync.round_in_flight():
            return
        train = self.cfg.train
        step = self.trainer.step
        if self.checkpoint_writer.due(
            step, train.checkpoint_every, train.checkpoint_every_minutes, round_end
        ):
            self.save_checkpoint()

    def save_checkpoint(self, wait: bool = False) -> None:
        """Snapshot the node's state (the training thread waits only for these CPU copies) and write it in the
        background; skipped while another write is in flight. `wait` (the final checkpoint, the one after a
        catch-up): first wait for a write in flight (at most `FINAL_WRITE_WAIT_S`), then for this one."""
        writer = self.checkpoint_writer
        if wait and not writer.wait(FINAL_WRITE_WAIT_S):
            logger.error(
                f"no checkpoint of step {self.trainer.step}: the write of step {writer.records[-1].step} did not end within "
                f"{FINAL_WRITE_WAIT_S:.0f}s and is abandoned; the checkpoint before it is kept"
            )
            return
        with_frozen = self.cfg.train.checkpoint_frozen_experts

        def take():
            meta = {
                "run_id": self.opts.run_id,
                "peer_id": self.peer_id,
                "config_hash": self.config_hash,
                "round": self.status.round,
                "step": self.trainer.step,
                "steps_into_round": self.steps_into_round,
                "tokens_since_sync": self.tokens_since_sync,
                "tokens": self.status.tokens,
                "shards": list(self.shards),
                "frozen_experts": with_frozen,
                "data_part": list(self.data_part),
                "data_state": self.batcher.state_dict(),
                "loss_history": self.status.loss_history,
                "round_losses": self.round_losses,
                "rng": rng_state(),
            }
            tensors = self.model.state_dict()
            if not with_frozen:
                tensors = without_frozen_experts(tensors, owned_shards(self.model))
            optimizer = {
                "by_name": self.trainer.optimizer_state_by_name(),
                "outer": self.sync.outer_state_dict(),
            }
            return take_snapshot(self.trainer.step, tensors, meta, optimizer, copy=not in_place)

        in_place = checkpoint_in_place(self.opts.checkpoint_writes, self.device)
        writer.submit(take, key=(self.trainer.step, self.status.round), in_place=in_place)
        if wait:
            writer.wait()

    def write_summary(self) -> None:
        """A small JSON beside the checkpoints: what `simulate` and the benchmarks read after the node exits."""
        summary = {
            "peer_id": self.peer_id,
            "shard": self.shard,
            "shards": list(self.shards),
            "round": self.status.round,
            "rounds_done": self.rounds_done,
            "step": self.trainer.step,
            "tokens": self.status.tokens,
            "tokens_per_s": self.status.tokens_per_s,
            "loss_history": self.status.loss_history,
            "first_loss": self.first_loss,
            "last_loss": self.status.loss,
            "bytes_sent": self.status.bytes_sent,
            "bytes_received": self.status.bytes_received,
            "rounds": self.round_reports,
            "join_seconds": self.join_seconds,
        }
        write_text_atomic(
            self.opts.checkpoint_dir / "summary.json", json.dumps(summary, indent=1, default=float)
        )

    # ------------------------------------------------------------------ record

    def node_info(self) -> records.NodeInfo:
        return records.NodeInfo(
            peer_id=self.peer_id,
            shards=list(self.shards),
            round=self.status.round,
            step=self.trainer.step if self.trainer is not None else 0,
            tokens=self.status.tokens,
            tokens_per_s=self.status.tokens_per_s,
            loss=self.status.loss if self.status.loss == self.status.loss else 0.0,
            state=self.status.state,
            version=__version__,
            public_name=self.opts.public_name,
            maddrs=self.visible_maddrs,
            client_mode=self.opts.client_mode,
            updated_at=0.0,
            expires_at=0.0,
            loss_history=[x for x in self.status.loss_history if x == x],
            bytes_sent=sum(self.status.bytes_sent.values()),
            bytes_received=sum(self.status.bytes_received.values()),
            data_part=self.data_part[0] if self.data_part is not None else None,
            sync_at=self._sync_at(),
            round_steps=self.steps_into_round
            if self.trainer is not None and not self._overlapping()
            else None,
        )

    def _sync_at(self) -> float:
        """When this node expects to begin its sync (DHT time), while it trains; 0 if it cannot tell yet, and while
        an overlapped round is in flight (its record's round is then the one it averages, not the one it trains:
        peers would wait for the sync after next)."""
        left = self.pacer.seconds_to_sync(self.steps_into_round) if self.pacer is not None else None
        if self.status.state != "training" or left is None or self._overlapping():
            return 0.0
        return get_dht_time() + left

    def _overlapping(self) -> bool:
        return self.sync is not None and self.sync.round_in_flight()

    def publish_record(self) -> None:
        records.publish_node(
            self.dht,
            self.opts.run_id,
            self.node_info(),
            self.validator,
            expiration_s=3 * self.cfg.swarm.heartbeat_s,
            stop=self.stop_event,
        )

    def _heartbeat_loop(self) -> None:
        last_config = time.monotonic()
        watch = DHTWatch(self.dht, HANG_HEARTBEATS * self.cfg.swarm.heartbeat_s)
        while not self.stop_event.wait(self.cfg.swarm.heartbeat_s):
            if not self._dht_alive(watch):
                return
            try:
                self.publish_record()
                if time.monotonic() - last_config > CONFIG_REPUBLISH_S:
                    self._publish_config()
                    last_config = time.monotonic()
            except Exception as e:
                logger.warning(f"heartbeat failed: {e}")

    def _dht_alive(self, watch: DHTWatch) -> bool:
        """False, with the node set to stop on a failure, when its DHT process has died or hangs (`watchdog`)."""
        problem = watch.problem()
        if problem is None:
            return True
        self.failure = (
            f"{problem}: the node stopped, as it cannot reach the swarm without it; start it again to rejoin from "
            "its checkpoint"
        )
        logger.error(self.failure)
        self.stop_event.set()
        return False

    def _publish_config(self) -> None:
        """Every node keeps the swarm config alive in the DHT, so it outlives the founder."""
        records.publish_config(
            self.dht, self.opts.run_id, self.cfg.to_json(), self.cfg.hash(), self.validator,
            expiration_s=CONFIG_EXPIRATION_S, created_at=self._config_created_at,
        )  # fmt: skip


def _shards_text(shards: tuple[int, ...]) -> str:
    return f"shard {shards[0]}" if len(shards) == 1 else f"shards {list(shards)}"


def _bounded(fn, seconds: float, what: str) -> bool:
    """Run `fn` in a daemon thread for at most `seconds`; a call that hangs (a dead DHT) is left behind. True if it
    returned in time (with or without an error)."""
    return _Bounded(fn, what).join(seconds)


class _Bounded:
    """`fn` running in a daemon thread from now on; `join` waits for it a bounded time (see `_bounded`)."""

    def __init__(self, fn, what: str):
        self.what, self.errors = what, []
        self.thread = threading.Thread(
            target=self._run, args=(fn,), name=f"spes-shutdown-{what}", daemon=True
        )
        self.thread.start()

    def _run(self, fn) -> None:
        try:
            fn()
        except Exception as e:
            self.errors.append(e)

    def join(self, seconds: float) -> bool:
        self.thread.join(max(0.0, seconds))
        if self.thread.is_alive():
            logger.warning(f"could not {self.what} within {seconds:.0f}s; going on")
            return False
        if self.errors:
            logger.warning(f"could not {self.what}: {self.errors[0]}")
        return True
