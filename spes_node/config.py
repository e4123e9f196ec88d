"""The swarm configuration: one root dataclass, read from a TOML preset or file, hashed for the swarm record.

Everything in `SpesConfig` must be identical on every node of a swarm (its hash is compared on join). What may
differ between nodes (device, checkpoint directory, peers, shard) lives in `NodeOptions` in node.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import tomllib

PRESETS_DIR = Path(__file__).resolve().parent / "presets"  # also reachable as configs/ at the top level
FROZEN_DTYPES = ("fp32", "bf16", "int8")
OUTER_OPTIMIZERS = ("average", "nesterov")
WIRE_COMPRESSIONS = ("none", "fp16", "int8")
WIRE_BYTES = {"none": 4, "fp16": 2, "uint8": 1, "int8": 1}
"""Approximate bytes per value on the wire, for estimates (the all-reduce counts the real bytes)."""
AVERAGE_MODES = ("weights", "updates")
MAX_HEARTBEAT_S = 3600.0
"""Longest heartbeat period: records expire after 3 heartbeats, so a dead node shows for up to 3 of them."""


@dataclass
class ModelConfig:
    """The OLMoE architecture (as transformers' `OlmoeForCausalLM` implements it)."""

    vocab_size: int = 260
    """Size of the token vocabulary (embedding rows and logits)."""
    hidden_size: int = 128
    """Model width d."""
    num_layers: int = 2
    """Number of decoder layers, each attention + MoE."""
    num_heads: int = 4
    """Attention heads."""
    num_kv_heads: int = 0
    """Key/value heads for grouped-query attention; 0 means equal to num_heads."""
    num_experts: int = 8
    """Experts per MoE layer (E)."""
    top_k: int = 2
    """Experts each token is routed to."""
    expert_ffn: int = 256
    """Hidden size of each SwiGLU expert."""
    max_seq_len: int = 2048
    """Longest sequence the rotary embedding is configured for."""
    rope_theta: float = 10000.0
    """Rotary embedding base."""
    rms_norm_eps: float = 1e-5
    """Epsilon of every RMSNorm."""
    norm_topk_prob: bool = False
    """Renormalise the top-k router probabilities to sum to one (OLMoE: false)."""
    init_std: float = 0.02
    """Standard deviation of the normal weight initialisation."""
    tie_embeddings: bool = False
    """Share the input embedding with the LM head."""
    z_loss: float = 1e-3
    """Coefficient of the router z-loss."""
    lb_loss: float = 0.01
    """Coefficient of the load-balancing loss."""

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def validate(self) -> None:
        _require_finite(self, "model")
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_experts",
            "top_k",
            "expert_ffn",
        ):
            _require(getattr(self, name) > 0, f"model.{name}", "must be positive")
        _require(self.hidden_size % self.num_heads == 0, "model.num_heads", "must divide model.hidden_size")
        _require(self.num_kv_heads >= 0, "model.num_kv_heads", "must be >= 0")
        _require(self.num_heads % self.kv_heads == 0, "model.num_kv_heads", "must divide model.num_heads")
        _require(self.top_k <= self.num_experts, "model.top_k", "must be <= model.num_experts")
        _require(self.max_seq_len > 0, "model.max_seq_len", "must be positive")
        _require(self.rope_theta > 0, "model.rope_theta", "must be positive")
        _require(self.rms_norm_eps > 0, "model.rms_norm_eps", "must be positive")
        _require(self.init_std >= 0, "model.init_std", "must be >= 0")
        _require(self.z_loss >= 0, "model.z_loss", "must be >= 0")
        _require(self.lb_loss >= 0, "model.lb_loss", "must be >= 0")


@dataclass
class TrainConfig:
    """Local training: inner optimiser, schedule and batch."""

    seq_len: int = 128
    """Tokens per training sequence."""
    micro_batch_size: int = 8
    """Sequences per forward/backward pass."""
    grad_accum: int = 1
    """Micro-batches accumulated per optimiser step."""
    lr: float = 3e-3
    """Peak learning rate of the inner AdamW."""
    min_lr_ratio: float = 0.1
    """The cosine schedule ends at lr * min_lr_ratio."""
    warmup_steps: int = 20
    """Linear warm-up steps."""
    total_steps: int = 2000
    """Length of the cosine schedule in local steps; training may continue at the floor."""
    weight_decay: float = 0.1
    """AdamW weight decay."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    grad_clip: float = 1.0
    """Global gradient-norm clip (0 disables)."""
    seed: int = 0
    """Seed of the initial weights (the same on every node) and of the data order."""
    log_every: int = 10
    """Log one line every this many steps."""
    checkpoint_every: int = 0
    """Checkpoint every this many steps (0: off); see `checkpoint_every_minutes` for round ends and exit."""
    checkpoint_every_minutes: float = 0.0
    """Also checkpoint every this many minutes, whichever comes first with `checkpoint_every`; when set, a round's
    end checkpoints only when one of the two is due (0: off, and every round's end checkpoints). Always on exit."""
    checkpoint_frozen_experts: bool = True
    """Save the frozen experts in checkpoints; without them a resumed node downloads them from their holders."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer in the backward pass instead of keeping its activations: less memory (the
    activations are the same for every node, frozen experts included), about a third more compute."""
    keep_checkpoints: int = 3
    """Checkpoints kept on disk."""
    eval_batches: int = 4
    """Validation batches used for evaluation loss."""

    def validate(self) -> None:
        _require_finite(self, "train")
        for name in (
            "seq_len",
            "micro_batch_size",
            "grad_accum",
            "total_steps",
            "log_every",
            "keep_checkpoints",
        ):
            _require(getattr(self, name) > 0, f"train.{name}", "must be positive")
        _require(self.lr > 0, "train.lr", "must be positive")
        _require(0 <= self.min_lr_ratio <= 1, "train.min_lr_ratio", "must be in [0, 1]")
        _require(self.warmup_steps >= 0, "train.warmup_steps", "must be >= 0")
        _require(self.weight_decay >= 0, "train.weight_decay", "must be >= 0")
        _require(0 <= self.beta1 < 1, "train.beta1", "must be in [0, 1)")
        _require(0 <= self.beta2 < 1, "train.beta2", "must be in [0, 1)")
        _require(self.grad_clip >= 0, "train.grad_clip", "must be >= 0")
        _require(self.checkpoint_every >= 0, "train.checkpoint_every", "must be >= 0")
        _require(self.checkpoint_every_minutes >= 0, "train.checkpoint_every_minutes", "must be >= 0")
        _require(self.eval_batches >= 0, "train.eval_batches", "must be >= 0")


@dataclass
class SwarmConfig:
    """SPES: shards, rounds, averaging, refresh and the expert-merging warm-up."""

    num_shards: int = 4
    """S: the experts of each layer are split into this many shards."""
    sync_steps: int = 100
    """H: local steps per round."""
    refresh_every: int = 1
    """Refresh frozen experts from their holders every this many rounds."""
    refresh_parallel: int = 0
    """Frozen shards a refresh downloads at once (0: every one). Each is held at snapshot precision from the start
    of its download until it is loaded between steps, so this bounds what a refresh holds in host memory to that
    many shards (9 GiB at spes-7b with every one); the others wait their turn."""
    refresh_by_updates: bool = True
    """Refresh a frozen copy of the last refresh by its holder's int8 update since then instead of the whole shard
    (holders keep one more fp16 copy of their own shards for it); false: always the whole shard."""
    replication_target: int = 2
    """Wanted replicas per shard; a shard below it is under-replicated."""
    outer_optimizer: str = "average"
    """'average' (plain mean, as published) or 'nesterov' (DiLoCo outer step on the pseudo-gradient)."""
    outer_lr: float = 0.7
    """Outer learning rate for 'nesterov'."""
    outer_momentum: float = 0.9
    """Outer momentum for 'nesterov'."""
    frozen_dtype: str = "fp32"
    """Storage of frozen experts: fp32, bf16 or int8."""
    wire_compression: str = "fp16"
    """Compression of tensors on the wire: none, fp16 or int8 (blockwise absmax, meant for `average = "updates"`;
    state served to joiners and refreshes always travels at fp16 or better)."""
    average: str = "weights"
    """What the all-reduces average: 'weights', or 'updates' (the pseudo-gradient since the last sync, with error
    feedback of what compression drops)."""
    overlap: bool = False
    """Keep training while a round's all-reduce runs and apply its result with the local progress made meanwhile
    (false: training waits for the round, as published)."""
    overlap_shards: bool = True
    """Overlap the shards' all-reduces only (the bulk of a round's bytes): training waits for the shared parameters'
    all-reduce, applies its result, then begins the shards' (among the shared group's members, so that they do not
    share its links) and goes on while they run; their result is applied with the local progress made meanwhile.
    With the plain average of weights (the default) it costs no memory: the averagers return the average's
    difference to what was handed over; Nesterov and update averaging keep an fp32 host copy of the own shards
    while they run. On by default: no measurable loss in the quality simulation (6 seeds), 0.952-0.956 of the loop
    without syncs on 100 Mbit/s links against 0.886-0.897 (false: both all-reduces at once, training waits for
    every all-reduce, as published). The last round of a `--max-rounds` run waits. `overlap` overlaps every group and
    supersedes it."""
    shared_lag_steps: int = 0
    """With `overlap_shards`: training goes on for up to this many local steps while the shared parameters'
    all-reduce (its matchmaking included) runs, and its result lands with the local progress made meanwhile, at the
    first step boundary after it is done, or after that many steps (training then waits for it). A node that reaches
    the sync before the last member of its shared group trains through that wait, up to a step, instead of idling
    (0: training waits for the shared all-reduce). Costs no memory with the plain average of weights; Nesterov and
    update averaging keep an fp32 host copy of the shared parameters while it runs. Off by default: one step's lag
    cost 0.6% of the validation and held-out losses in the quality simulation (6 seeds; docs/performance.md)."""
    train_while_waiting: bool = True
    """A node that reaches the sync while peers it averages with are still training goes on training, step by step
    while another ends before the slowest of them is due by its record (at most a round's wait), instead of idling
    in matchmaking; the extra steps are part of its round, at the learning rate of its end, and weigh no more than
    H steps (false: it waits at step H, as published)."""
    fresh_connections: bool = True
    """At the sync, the node closes its connections to the last round's group members that have ended that round
    (not to client-mode members, its relays, or members at their sync already: `connections.aged_connections`), so
    that the round's all-reduces run on fresh ones: among 3 peers on 50 Mbit/s links, all-reduces after the second
    on the same connections ran at 0.65-0.79 of the link, at 0.83-0.90 with the connections closed first
    (docs/performance.md).
    False: connections stay open for as long as the p2p daemon keeps them."""
    matchmaking_time: float = 5.0
    """Seconds a node waits to gather peers into an averaging group."""
    averaging_timeout: float = 60.0
    """Seconds after which an all-reduce gives up on slow or dead peers."""
    heartbeat_s: float = 5.0
    """Period of the node record heartbeat; records expire after 3 heartbeats."""
    merge_interval: int = 500
    """Expert merging runs on sync steps that are multiples of this."""
    merge_alpha0: float = 0.02
    """Initial merge strength alpha0."""
    merge_horizon: int = 10000
    """Steps T over which alpha decays linearly to zero."""
    merge_topk: int = 4
    """K: most similar experts each expert is pulled towards."""

    def validate(self, model: ModelConfig) -> None:
        _require_finite(self, "swarm")
        _require(self.num_shards > 0, "swarm.num_shards", "must be positive")
        _require(
            model.num_experts % self.num_shards == 0,
            "swarm.num_shards",
            f"must divide model.num_experts ({model.num_experts})",
        )
        for name in ("sync_steps", "refresh_every", "replication_target", "merge_interval", "merge_horizon"):
            _require(getattr(self, name) > 0, f"swarm.{name}", "must be positive")
        _require(
            self.refresh_parallel >= 0, "swarm.refresh_parallel", "must be >= 0 (0: every shard at once)"
        )
        _require(
            0 <= self.shared_lag_steps < self.sync_steps,
            "swarm.shared_lag_steps",
            f"must be >= 0 and below swarm.sync_steps ({self.sync_steps})",
        )
        _require(
            self.outer_optimizer in OUTER_OPTIMIZERS,
            "swarm.outer_optimizer",
            f"must be one of {OUTER_OPTIMIZERS}",
        )
        _require(self.frozen_dtype in FROZEN_DTYPES, "swarm.frozen_dtype", f"must be one of {FROZEN_DTYPES}")
        _require(
            self.wire_compression in WIRE_COMPRESSIONS,
            "swarm.wire_compression",
            f"must be one of {WIRE_COMPRESSIONS}"
            + (
                " (uint8, hivemind's uniform 8-bit, does not decode with numpy 2: use int8)"
                if self.wire_compression == "uint8"
                else ""
            ),
        )
        _require(self.average in AVERAGE_MODES, "swarm.average", f"must be one of {AVERAGE_MODES}")
        _require(self.outer_lr > 0, "swarm.outer_lr", "must be positive")
        _require(0 <= self.outer_momentum < 1, "swarm.outer_momentum", "must be in [0, 1)")
        _require(self.matchmaking_time > 0, "swarm.matchmaking_time", "must be positive")
        _require(self.averaging_timeout > 0, "swarm.averaging_timeout", "must be positive")
        _require(
            0 < self.heartbeat_s <= MAX_HEARTBEAT_S,
            "swarm.heartbeat_s",
            f"must be in (0, {MAX_HEARTBEAT_S:.0f}]",
        )
        _require(self.merge_alpha0 >= 0, "swarm.merge_alpha0", "must be >= 0")
        _require(self.merge_topk > 0, "swarm.merge_topk", "must be positive")


@dataclass
class DataConfig:
    """Where tokens come from."""

    tokenizer: str = "bytes"
    """'bytes' (embedded byte-level tokenizer) or a Hugging Face tokenizer directory or hub id."""
    source: str = "default"
    """Default data spec: 'default' (embedded corpus), 'hf:NAME[:CONFIG]', or local parquet/jsonl/text files."""
    val_fraction: float = 0.02
    """Fraction of documents held out for validation."""

    def validate(self, model: ModelConfig) -> None:
        _require_finite(self, "data")
        _require(0 < self.val_fraction < 1, "data.val_fraction", "must be in (0, 1)")
        _require(bool(self.tokenizer), "data.tokenizer", "must not be empty")


@dataclass
class SpesConfig:
    """The root configuration of a swarm."""

    name: str = "custom"
    """Preset or config name, for display."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The architecture ([model] table)."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Local training ([train] table)."""
    swarm: SwarmConfig = field(default_factory=SwarmConfig)
    """SPES rounds and shards ([swarm] table)."""
    data: DataConfig = field(default_factory=DataConfig)
    """Tokenizer and data ([data] table)."""

    def validate(self) -> SpesConfig:
        self.model.validate()
        self.train.validate()
        self.swarm.validate(self.model)
        self.data.validate(self.model)
        _require(
            self.train.seq_len <= self.model.max_seq_len, "train.seq_len", "must be <= model.max_seq_len"
        )
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        """Canonical JSON: the bytes that are hashed and published in the swarm record."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    def hash(self) -> str:
        return config_digest(self.to_json())

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SpesConfig:
        return _build(cls, data, prefix="").validate()

    @classmethod
    def from_json(cls, text: str) -> SpesConfig:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"config: not valid JSON: {e}") from None
        return cls.from_dict(data)

    def replace(self, **sections: dict[str, Any]) -> SpesConfig:
        """A copy with some fields overridden, e.g. `cfg.replace(swarm={"sync_steps": 5})`."""
        data = self.to_dict()
        for section, values in sections.items():
            if section not in data or not isinstance(data[section], dict):
                raise ValueError(f"config: unknown section '{section}'")
            data[section].update(values)
        return SpesConfig.from_dict(data)


CONFIG_HASH_RE = re.compile(r"[0-9a-f]{64}")
"""A config hash as stored and compared: the 64 lowercase hex digits of a sha256."""


def config_digest(config_json: str) -> str:
    """The hash of a config's JSON text (the one swarm records carry beside it): sha256 hex digest."""
    return hashlib.sha256(config_json.encode()).hexdigest()


def check_config_hash(value: str) -> str:
    """A --config-hash as the user gave it: the 64 hex digits of a config's sha256 (case ignored)."""
    text = value.strip().lower()
    if not CONFIG_HASH_RE.fullmatch(text):
        raise ValueError(f"--config-hash: expected the 64 hex digits the founder printed, got '{value[:80]}'")
    return text


def list_presets() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.toml"))


def load_preset(name: str) -> SpesConfig:
    path = PRESETS_DIR / f"{name}.toml"
    if not path.is_file():
        raise ValueError(f"unknown preset '{name}' (available: {', '.join(list_presets())})")
    return load_config(path)


def load_config(path: str | Path) -> SpesConfig:
    """Read a TOML (or JSON) config file; errors name the file and the field."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ValueError(f"cannot read config {path}: {e.strerror or e}") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"config {path}: {e}") from None
    try:
        return SpesConfig.from_dict(data)
    except ValueError as e:
        raise ValueError(f"config {path}: {e}") from None


def _build(cls: type, data: Any, prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ValueError(f"{prefix.rstrip('.') or 'config'}: expected a table, got {type(data).__name__}")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(f"unknown field '{prefix}{unknown[0]}'")
    kwargs = {}
    for name, value in data.items():
        f = known[name]
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            kwargs[name] = _build(type(default), value, prefix=f"{prefix}{name}.")
        else:
            kwargs[name] = _coerce(value, default, f"{prefix}{name}")
    return cls(**kwargs)


def _coerce(value: Any, default: Any, name: str) -> Any:
    expected = type(default)
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if expected is bool and not isinstance(value, bool):
        raise ValueError(f"{name}: expected true or false, got {value!r}")
    if expected is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"{name}: expected an integer, got {value!r}")
    if not isinstance(value, expected):
        raise ValueError(f"{name}: expected {expected.__name__}, got {value!r}")
    return value


def _require(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {message}")


def _require_finite(section: Any, prefix: str) -> None:
    """Every float field of a config section is a finite number: inf and nan pass most range checks, then break
    timers (an infinite heartbeat kills the heartbeat thread) or the optimiser."""
    for f in fields(section):
        value = getattr(section, f.name)
        if isinstance(value, float):
            _require(math.isfinite(value), f"{prefix}.{f.name}", f"must be a finite number, got {value}")
