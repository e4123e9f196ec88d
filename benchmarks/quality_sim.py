"""A swarm simulated in one process, deterministically: the training method without the network.

N node models train in turn on their own data parts (`TokenBatcher` part i of N) with the daemon's `Trainer`, and
every `sync_steps` steps a round is done the way the method defines it:
- shared parameters averaged over all nodes, each shard over its holders (a shard with one holder is left as is);
- the outer optimiser applied to each group's average (`PlainAverage` for SPES, `NesterovOuter` for DiLoCo), one per
  node and group as on a real node;
- frozen copies of the other shards refreshed from their holders' new weights, every `refresh_every` rounds (and on
  a merge round, whose merge reads every expert);
- the merge warm-up (`model.merge.merge_layer`) on the own shard when due, from the refreshed (pre-merge) copies.

Optionally each node's pseudo-gradient (start of round minus local weights) goes through hivemind's
`Uniform8BitQuantization` with error feedback before averaging: an emulation of an int8 wire codec (the
quantisation a node's update would see on the wire), not the daemon's own code path.

Runs of a setting differ only by their seed: no process scheduling, matchmaking or timeouts enter the numbers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from spes_node.config import SpesConfig
from spes_node.model.merge import merge_alpha, merge_due, merge_layer
from spes_node.model.moe import MoEForCausalLM
from spes_node.model.ownership import (
    apply_ownership,
    dense_state_dict,
    load_dense_state_dict,
    load_shard_tensors,
    shard_tensors,
    shared_parameters,
)
from spes_node.swarm.averaging import NesterovOuter, PlainAverage

logger = logging.getLogger(__name__)

WIRE_PART_VALUES = 2**19
"""hivemind splits each tensor into parts of 2**19 bytes after compression: 2**19 values at one byte each, and
compresses each part on its own."""


@dataclass(frozen=True)
class Setting:
    """One way to spend the same tokens."""

    name: str
    num_shards: int = 1
    """Shards per MoE layer; a node holds one."""
    replicas: int = 1
    """Holders per shard; nodes = num_shards * replicas. 0 means centralized (one model, the whole batch)."""
    outer: str = "average"
    """"average" (SPES as published) or "nesterov" (DiLoCo)."""
    merge: bool = True
    """The expert-merging warm-up."""
    wire: str = "fp32"
    """"fp32" or "int8" (pseudo-gradients quantised with error feedback)."""
    num_experts: int | None = None
    """Experts per layer, when not the preset's."""
    refresh_every: int = 1
    """Frozen copies refreshed every this many rounds (`swarm.refresh_every`)."""
    overlap_steps: int = 0
    """`swarm.overlap`: a round's result lands this many local steps into the next round, applied with the local
    progress made since (0: training waits for the round, as published). fp32 wire only."""
    overlap_groups: tuple[str, ...] = ("shared", "shard")
    """With overlap, the groups whose all-reduce runs beside the next round's steps; the others' result is applied
    at once, training waiting for it (("shard",): only the shards' all-reduces, the bulk of the bytes, overlap)."""
    shared_lag_steps: int = 0
    """With only the shards overlapped (`overlap_groups=("shard",)`), the shared parameters' result lands this many
    local steps into the next round instead of at once (`swarm.shared_lag_steps`: training goes on through the
    matchmaking and the shared all-reduce, for at most this many steps). fp32 wire only."""
    overlap_blend: float | None = None
    """With overlap, how the landed round meets the local weights: None adds the local progress made since to the
    round's result (the daemon's rule); a number b blends them instead, b x local + (1 - b) x result (Streaming
    DiLoCo's rule for overlapped rounds, which keeps part of the progress and part of the local drift)."""
    extra_steps: tuple[int, ...] = ()
    """Per node, local steps past H each round (`swarm.train_while_waiting`): a swarm of unequal cards, whose
    faster nodes train while they wait for the slowest instead of idling; () or 0: every node trains H steps."""
    description: str = ""

    @property
    def centralized(self) -> bool:
        return self.replicas == 0

    @property
    def num_nodes(self) -> int:
        return 1 if self.centralized else self.num_shards * self.replicas


def setting_config(base: SpesConfig, setting: Setting, total_batch: int) -> SpesConfig:
    """The per-node config: the micro-batch is the total batch split over the nodes."""
    if total_batch % setting.num_nodes:
        raise ValueError(f"total_batch: {total_batch} does not split over {setting.num_nodes} nodes")
    cfg = base.replace(
        train={"micro_batch_size": total_batch // setting.num_nodes},
        swarm={
            "num_shards": setting.num_shards,
            "replication_target": max(setting.replicas, 1),
            "outer_optimizer": setting.outer,
            "merge_alpha0": base.swarm.merge_alpha0 if setting.merge else 0.0,
            "refresh_every": setting.refresh_every,
        },
    )
    if setting.num_experts is not None:
        cfg = cfg.replace(model={"num_experts": setting.num_experts})
    return cfg


@dataclass
class RunLog:
    """What one run produced."""

    tokens: list[int] = field(default_factory=list)
    """Total tokens (all nodes) at each evaluation point."""
    val_loss: list[float] = field(default_factory=list)
    """Validation loss of the global model at each evaluation point."""
    train_loss: list[float] = field(default_factory=list)
    """Mean training cross-entropy over the steps since the previous point (all nodes)."""
    merges: int = 0
    int8_relative_error: list[float] = field(default_factory=list)
    """Per round: |dequantised - exact| / |exact| of the averaged pseudo-gradient of the shared parameters."""


@torch.no_grad()
def val_loss(model: MoEForCausalLM, batches: list[torch.Tensor]) -> float:
    """Token-weighted mean cross-entropy over the batches."""
    model.eval()
    total, tokens = 0.0, 0
    for batch in batches:
        out = model(batch[:, :-1], labels=batch[:, 1:])
        n = batch[:, 1:].numel()
        total += out.ce_loss.item() * n
        tokens += n
    return total / tokens


def initial_weights(cfg: SpesConfig, seed: int) -> dict[str, torch.Tensor]:
    """The seed's initial weights (our names, fp32, one shard): the same for every layout of the same model."""
    torch.manual_seed(seed)
    return {k: v.clone() for k, v in dense_state_dict(MoEForCausalLM(cfg.model, 1)).items()}


def reshard(state: dict[str, torch.Tensor], num_layers: int, num_shards: int) -> dict[str, torch.Tensor]:
    """The same weights under the names of a model with `num_shards` shards per layer."""
    out = {k: v for k, v in state.items() if ".mlp.shards." not in k}
    for layer in range(num_layers):
        prefix = f"model.layers.{layer}.mlp.shards."
        for kind in ("gate_up", "down"):
            held = sorted((int(k[len(prefix) :].split(".")[0]), v) for k, v in state.items()
                          if k.startswith(prefix) and k.endswith(f".{kind}"))  # fmt: skip
            full = torch.cat([v for _, v in held])
            for shard, part in enumerate(full.chunk(num_shards)):
                out[f"{prefix}{shard}.{kind}"] = part.clone()
    return out


def _batcher(cfg: SpesConfig, tokenizer, part: int, num_parts: int, seed: int, batch_size: int):
    from spes_node.daemon.data import TokenBatcher

    return TokenBatcher(
        cfg.data.source,
        tokenizer,
        cfg.train.seq_len,
        batch_size,
        part=part,
        num_parts=num_parts,
        seed=seed,
        val_fraction=cfg.data.val_fraction,
    )


class ConcatBatcher:
    """Several batchers side by side: one batch is each one's next batch, concatenated."""

    def __init__(self, batchers):
        self.batchers = batchers

    def next_batch(self) -> torch.Tensor:
        return torch.cat([b.next_batch() for b in self.batchers])


class Int8Wire:
    """One node's emulated int8 wire for one group: quantise (pseudo-gradient + residual), keep the new residual."""

    def __init__(self):
        from hivemind.compression import Uniform8BitQuantization

        self.codec = Uniform8BitQuantization()
        self.residual: dict[str, torch.Tensor] = {}

    def roundtrip(self, tensor: torch.Tensor) -> torch.Tensor:
        """What the receiver decodes: the codec's indices looked up in its codebook (as its `extract` does)."""
        flat = tensor.detach().float().reshape(-1)
        parts = []
        for part in flat.split(WIRE_PART_VALUES):
            if part.numel() < 2:  # the codec's std needs two values; a lone value travels as is here
                parts.append(part.clone())
                continue
            indices, codebook = self.codec.quantize(part)
            parts.append(torch.from_numpy(codebook)[torch.from_numpy(indices.astype("int64"))])
        return torch.cat(parts).reshape(tensor.shape)

    def send(self, name: str, delta: torch.Tensor) -> torch.Tensor:
        corrected = delta + self.residual.get(name, 0.0)
        sent = self.roundtrip(corrected)
        self.residual[name] = corrected - sent
        return sent

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.residual.values())


class SimNode:
    def __init__(
        self, cfg: SpesConfig, setting: Setting, index: int, init: dict, batcher, device: torch.device
    ):
        from spes_node.daemon.trainer import Trainer

        self.index = index
        self.shard = index % setting.num_shards
        self.model = MoEForCausalLM(cfg.model, setting.num_shards)
        load_dense_state_dict(self.model, init)
        apply_ownership(self.model, [self.shard], cfg.swarm.frozen_dtype)
        self.trainer = Trainer(cfg, self.model, batcher, device)
        self.outer = {
            "shared": self._outer(cfg, setting, "shared"),
            "shard": self._outer(cfg, setting, "shard"),
        }
        self.wire = {"shared": Int8Wire(), "shard": Int8Wire()} if setting.wire == "int8" else None

    def group(self, kind: str) -> dict[str, torch.Tensor]:
        if kind == "shared":
            return dict(shared_parameters(self.model))
        return shard_tensors(self.model, self.shard)

    def _outer(self, cfg: SpesConfig, setting: Setting, kind: str):
        if setting.outer != "nesterov":
            return PlainAverage()
        outer = NesterovOuter(cfg.swarm.outer_lr, cfg.swarm.outer_momentum)
        outer.remember(self.group(kind))
        return outer


class SimSwarm:
    """The nodes of one setting and the round between them."""

    def __init__(self, cfg: SpesConfig, setting: Setting, init: dict, tokenizer, seed: int):
        self.cfg, self.setting = cfg, setting
        device = torch.device("cpu")
        n = setting.num_nodes
        self.nodes = [
            SimNode(
                cfg,
                setting,
                i,
                init,
                _batcher(cfg, tokenizer, i, n, seed, cfg.train.micro_batch_size),
                device,
            )
            for i in range(n)
        ]
        # the global weights every round starts from (the pseudo-gradient's reference point)
        self.start = {
            "shared": {k: v.detach().clone() for k, v in self.nodes[0].group("shared").items()},
            "shard": {node.index: _clone(node.group("shard")) for node in self.nodes},
        }
        if (setting.overlap_steps or setting.shared_lag_steps) and setting.wire != "fp32":
            raise ValueError(f"{setting.name}: overlap is simulated with the fp32 wire only")
        self.pending: list[tuple[SimNode, str, dict, dict, int]] | None = None
        """With overlap, the round in flight: (node, group, its weights when the round began, the outer step's
        result on them, the local steps into the next round it lands after, at most H); `_land` adds the progress
        made since."""
        self.round = 0
        self.log = RunLog()
        self.int8_errors: list[tuple[float, float]] = []
        """Per round: (squared error, squared norm) of the averaged shared pseudo-gradient on the int8 wire."""

    def holders(self, shard: int) -> list[SimNode]:
        return [node for node in self.nodes if node.shard == shard]

    def train_round(self) -> tuple[float, int]:
        """Every node's `sync_steps` local steps (and its `extra_steps`), the round in flight landing after
        `overlap_steps` of them; (mean training loss, tokens)."""
        H = self.cfg.swarm.sync_steps
        lags = []
        if self.pending is not None:
            lags = sorted({lag for *_, lag in self.pending}) or [min(self._lag(), H)]
        losses, tokens, done = [], 0, 0
        for lag in lags:
            more, more_tokens = self._steps(done, lag)
            losses += more
            tokens += more_tokens
            self._land(lag)
            done = lag
        more, more_tokens = self._steps(done, H)
        losses += more
        tokens += more_tokens
        # at the learning rate of the round's end, as the daemon runs steps past H
        for node, extra in zip(self.nodes, self.setting.extra_steps):
            for _ in range(extra):
                stats = node.trainer.train_step((self.round + 1) * H)
                losses.append(stats.ce_loss)
                tokens += stats.tokens
        return sum(losses) / len(losses), tokens

    def _steps(self, begin: int, end: int) -> tuple[list[float], int]:
        """Steps `begin` to `end` of the round on every node."""
        H = self.cfg.swarm.sync_steps
        losses, tokens = [], 0
        for node in self.nodes:
            for k in range(begin, end):
                stats = node.trainer.train_step(self.round * H + k)
                losses.append(stats.ce_loss)
                tokens += stats.tokens
        return losses, tokens

    @torch.no_grad()
    def sync(self) -> None:
        """The round: the all-reduces, then (at once, or with overlap when the round lands) the refresh and the
        merge warm-up."""
        if self._lag():
            self.pending = []
        self._average("shared", self.nodes, self.start["shared"])
        for shard in range(self.setting.num_shards):
            holders = self.holders(shard)
            self._average("shard", holders, self.start["shard"][holders[0].index])
        self.round += 1
        if self.pending is None:
            self._after_round()

    @torch.no_grad()
    def land(self) -> None:
        """Apply the round in flight now, if any (the end of training)."""
        if self.pending is not None:
            self._land()

    def _lag(self, kind: str | None = None) -> int:
        """Local steps into the next round after which a group's result lands (0: at once); without `kind`, the
        longest of the groups'."""
        setting = self.setting
        lags = {
            "shared": setting.overlap_steps
            if "shared" in setting.overlap_groups
            else setting.shared_lag_steps,
            "shard": setting.overlap_steps if "shard" in setting.overlap_groups else 0,
        }
        return lags[kind] if kind is not None else max(lags.values())

    @torch.no_grad()
    def _land(self, lag: int | None = None) -> None:
        """Land the groups in flight whose lag is `lag` (all of them when None); the refresh and merge follow the
        last."""
        blend = self.setting.overlap_blend
        landing = [entry for entry in self.pending if lag is None or entry[4] == lag]
        for node, kind, before, result, _ in landing:
            for name, tensor in node.group(kind).items():
                if blend is None:
                    tensor.copy_(result[name] + (tensor - before[name]))
                else:
                    tensor.copy_(blend * tensor + (1 - blend) * result[name])
        self.pending = [entry for entry in self.pending if lag is not None and entry[4] != lag]
        if not self.pending:
            self.pending = None
            self._after_round()

    def _after_round(self) -> None:
        self._refresh_and_merge()
        self.start["shared"] = _clone(self.nodes[0].group("shared"))
        self.start["shard"] = {node.index: _clone(node.group("shard")) for node in self.nodes}

    def _refresh_and_merge(self) -> None:
        sync_step = self.round * self.cfg.swarm.sync_steps
        swarm = self.cfg.swarm
        merging = self.setting.merge and merge_due(
            sync_step, swarm.merge_interval, swarm.merge_alpha0, swarm.merge_horizon
        )
        if merging or self.round % self.setting.refresh_every == 0:
            self._refresh()
        if merging:
            for node in self.nodes:
                self._merge(node, sync_step)
            self.log.merges += 1

    def _average(self, kind: str, members: list[SimNode], start: dict[str, torch.Tensor]) -> None:
        locals_ = [m.group(kind) for m in members]
        if len(members) < 2:  # no group forms: the weights stay local, a Nesterov outer restarts from them
            for m, local in zip(members, locals_):
                if isinstance(m.outer[kind], NesterovOuter):
                    m.outer[kind].remember(local)
            return
        if self.setting.wire == "int8":
            averaged = {}
            for name in start:
                sent = [
                    m.wire[kind].send(name, start[name] - local[name]) for m, local in zip(members, locals_)
                ]
                exact = torch.stack([start[name] - local[name] for local in locals_]).mean(0)
                # the all-gather sends the averaged part at the wire precision too (no residual kept for it)
                delta = members[0].wire[kind].roundtrip(torch.stack(sent).mean(0))
                if kind == "shared":
                    self.int8_errors.append((float((delta - exact).norm() ** 2), float(exact.norm() ** 2)))
                averaged[name] = start[name] - delta
        else:
            averaged = {name: torch.stack([local[name] for local in locals_]).mean(0) for name in start}
        for m, local in zip(members, locals_):
            if self.pending is None or not self._lag(kind):
                m.outer[kind].apply(local, averaged)
                continue
            before, result = _clone(local), _clone(local)
            m.outer[kind].apply(result, averaged)
            self.pending.append((m, kind, before, result, min(self._lag(kind), self.cfg.swarm.sync_steps)))

    def _refresh(self) -> None:
        """Every node's frozen copy of shard j becomes the weights of j's (first) holder."""
        for shard in range(self.setting.num_shards):
            tensors = _clone(shard_tensors(self.holders(shard)[0].model, shard))
            for node in self.nodes:
                if node.shard != shard:
                    load_shard_tensors(node.model, shard, tensors)

    def _merge(self, node: SimNode, sync_step: int) -> None:
        """The daemon's merge: the own shard's experts pulled towards their most similar peers (all experts, as
        refreshed before the merge)."""
        swarm = self.cfg.swarm
        alpha = merge_alpha(sync_step, swarm.merge_alpha0, swarm.merge_horizon)
        for layer in node.model.model.layers:
            dense = [s.dense() for s in layer.mlp.shards]
            gate_up = torch.cat([g for g, _ in dense]).float()
            down = torch.cat([d for _, d in dense]).float()
            own = layer.mlp.shards[node.shard]
            update = list(range(own.start, own.start + own.n))
            new_gate_up, new_down = merge_layer(gate_up, down, alpha, swarm.merge_topk, update)
            own.load_dense(
                new_gate_up[own.start : own.start + own.n], new_down[own.start : own.start + own.n]
            )

    def global_weights(self) -> dict[str, torch.Tensor]:
        """The swarm's model: shared parameters (identical on every node after a round), each shard from a holder;
        with a round in flight, as it lands (the outer step's result, without the progress made since)."""
        out = {k: v.detach().clone() for k, v in shared_parameters(self.nodes[0].model).items()}
        for shard in range(self.setting.num_shards):
            out.update(_clone(shard_tensors(self.holders(shard)[0].model, shard)))
        for node, kind, _, result, _ in self.pending or []:
            if node is (self.nodes[0] if kind == "shared" else self.holders(node.shard)[0]):
                out.update(_clone(result))
        return out


def _clone(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in tensors.items()}


def train_setting(
    cfg: SpesConfig,
    setting: Setting,
    seed: int,
    steps: int,
    val: list[torch.Tensor],
    tokenizer,
    data_parts: int,
) -> tuple[dict[str, torch.Tensor], RunLog, dict]:
    """Train one setting for `steps` steps per node; (global weights, log, per-node memory of node 0).

    The centralized setting reads the streams of a `data_parts`-node swarm, concatenated."""
    init = reshard(initial_weights(cfg, seed), cfg.model.num_layers, setting.num_shards)
    if setting.centralized:
        return _train_centralized(cfg, setting, seed, steps, val, tokenizer, init, data_parts)
    H = cfg.swarm.sync_steps
    swarm = SimSwarm(cfg, setting, init, tokenizer, seed)
    probe = MoEForCausalLM(cfg.model, setting.num_shards)
    tokens = 0
    for _ in range(steps // H):
        loss, got = swarm.train_round()
        tokens += got
        swarm.sync()
        if len(swarm.log.tokens) == steps // H - 1:
            swarm.land()  # the last round lands before training ends
        load_dense_state_dict(probe, swarm.global_weights())
        swarm.log.tokens.append(tokens)
        swarm.log.train_loss.append(loss)
        swarm.log.val_loss.append(val_loss(probe, val))
    swarm.log.int8_relative_error = _per_round(swarm.int8_errors, len(swarm.log.tokens))
    memory = node_memory(swarm.nodes[0], val[0])
    return swarm.global_weights(), swarm.log, memory


def _per_round(errors: list[tuple[float, float]], rounds: int) -> list[float]:
    """Relative error of the averaged shared pseudo-gradient, one value per round (its tensors summed)."""
    if not errors:
        return []
    per = len(errors) // rounds
    out = []
    for r in range(rounds):
        chunk = errors[r * per : (r + 1) * per]
        out.append((sum(e for e, _ in chunk) / max(sum(x for _, x in chunk), 1e-30)) ** 0.5)
    return out


def _train_centralized(cfg, setting, seed, steps, val, tokenizer, init, parts):
    from spes_node.daemon.trainer import Trainer

    # the token streams of a `parts`-node swarm, each step every part's batch side by side
    per_part = cfg.train.micro_batch_size // parts
    batcher = ConcatBatcher([_batcher(cfg, tokenizer, i, parts, seed, per_part) for i in range(parts)])
    model = MoEForCausalLM(cfg.model, 1)
    load_dense_state_dict(model, init)
    apply_ownership(model, [0])
    trainer = Trainer(cfg, model, batcher, torch.device("cpu"))
    log, tokens, losses = RunLog(), 0, []
    H = cfg.swarm.sync_steps
    for step in range(steps):
        stats = trainer.train_step()
        tokens += stats.tokens
        losses.append(stats.ce_loss)
        if (step + 1) % H == 0:
            log.tokens.append(tokens)
            log.train_loss.append(sum(losses) / len(losses))
            log.val_loss.append(val_loss(model, val))
            losses = []
    return dense_state_dict(model), log, node_memory(PlainNode(model, trainer), val[0])


@dataclass
class PlainNode:
    """A model and its trainer without outer optimiser or wire state (centralized, or a one-node measurement)."""

    model: MoEForCausalLM
    trainer: object
    outer: dict = field(default_factory=dict)
    wire: dict | None = None


def node_memory(node: SimNode | PlainNode, batch: torch.Tensor) -> dict[str, int]:
    """Bytes one node holds for training, from its tensors: weights, gradients (one backward on `batch`, dropped
    afterwards), AdamW state, frozen experts, and the outer optimiser's / int8 wire's state."""
    model = node.model
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    frozen = sum(b.numel() * b.element_size() for b in model.buffers())
    model.train()
    model(batch[:, :-1], labels=batch[:, 1:]).loss.backward()
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    model.zero_grad(set_to_none=True)
    optimizer = sum(
        v.numel() * v.element_size()
        for state in node.trainer.optimizer.state.values()
        for v in state.values()
        if torch.is_tensor(v)
    )
    outer = 0
    for o in node.outer.values():
        if isinstance(o, NesterovOuter):
            outer += sum(t.numel() * t.element_size() for t in (*o.previous.values(), *o.velocity.values()))
    if node.wire:
        outer += sum(w.nbytes() for w in node.wire.values())
    return {
        "weights": weights,
        "grads": grads,
        "optimizer": optimizer,
        "frozen": frozen,
        "train_state": weights + grads + optimizer + frozen,
        "outer_state": outer,
        "total": weights + grads + optimizer + frozen + outer,
    }


def all_experts_node_memory(cfg: SpesConfig, batch: torch.Tensor) -> dict[str, int]:
    """Bytes of a node that trains every expert of `cfg.model` (one step taken to create the AdamW state)."""
    from spes_node.daemon.trainer import Trainer

    model = MoEForCausalLM(cfg.model, 1)
    apply_ownership(model, [0])

    class _One:
        def next_batch(self):
            return batch

    trainer = Trainer(cfg, model, _One(), torch.device("cpu"))
    trainer.train_step()
    return node_memory(PlainNode(model, trainer), batch)
