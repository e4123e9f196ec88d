"""The memory plan of one node: GPU and host bytes of a config, read off the code paths that allocate them.

Pure arithmetic on the config, no torch. Every term follows what the code does:

GPU, static (`model.py`, `sharding.py`, `trainer.py`): the shared parameters (everything but expert weights) and
the held shards' experts are fp32 parameters with fp32 gradients and two fp32 AdamW moments; the other shards'
experts are buffers in `swarm.frozen_dtype` (int8 with one fp32 scale per output row).

GPU, activations: the tensors autograd saves in one forward pass of `MoEForCausalLM` at the micro-batch, as the
trainer runs it on a GPU (bf16 autocast): RMSNorm keeps its fp32 input and normalised value; under autocast each
of the q/k/v projections saves its own bf16 copy of the input, and the bf16 copies of the weights (cached for the
parameters, one per expert hit for a trainable expert's weight slice) stay alive until backward; SDPA keeps q, k,
v, the output and an fp32 log-sum-exp (flash kernels, no sequence x sequence matrix); every routed token keeps
its expert's gate/up output, SiLU, output and weighted output (plus its input and the SwiGLU product when the
expert trains: frozen experts go through `_FrozenLinear`, which keeps only the stored weight). The loss keeps the
fp32 log-softmax over the vocabulary and the logits stay referenced by the model output. With
`train.activation_checkpointing` a layer keeps only its input, and one layer's activations are rebuilt at a time
in backward. The backward pass then needs working memory: the two fp32 vocabulary-sized gradients of the loss,
and per layer the residual-stream gradients and the gradient buffers of the trainable expert weights. Between
steps, without gradients or activations, the merge warm-up works on one layer's experts in fp32 (a round's results
are worked out in host memory and copied into the weights tensor by tensor).
`compute="fp32"` is the same model without autocast (what the trainer runs on a CPU); tests/test_plan.py
measures both on a CPU against it.

Host (`rounds.py`, `averaging.py`, `transfer.py`, `checkpoint.py`, `node.py`): the round's state, which lives in
host memory whatever the training device (`devices.HOST`): a nesterov outer optimizer's two fp32 copies of the
trainable weights, `swarm.overlap`'s one more, the fp32 anchor of update averaging with the plain average; the
averagers' fp32 buffers of
the shared parameters and the held shards (hivemind's own copy, in shared memory; a round's result is read from
them), the served snapshots of every part at wire precision (fp16 or fp32), the refresh
downloads of every other shard (at snapshot precision, updates already added to the copy, held until the next
round applies them), a checkpoint's
CPU copy of the weights and AdamW state. At startup the model is made on its device one weight at a time
(`model.initial`), and a checkpoint being resumed is read one tensor at a time on to it (`tensor_file`): the host
holds one weight in fp32 and its stored form, not the model.

Sizes: the GPU total adds `CUDA_RESERVE` for what lives outside torch's allocator (CUDA context, cuBLAS
workspaces) and `ALLOCATOR_MARGIN` of the allocated peak for the caching allocator's rounding and fragmentation.
A card's size is what the driver reports (nvidia-smi), which `parse_size` reads from "48GB" as 48 GiB. The host
runtime of a GPU node (`HOST_RUNTIME`) is an assumption, not read off the code; a CPU node's (`HOST_RUNTIME_CPU`) is
measured.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field

from spes_node.config import ModelConfig, SpesConfig

KIB, MIB, GIB, TIB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
CUDA_RESERVE = GIB
"""GPU memory outside torch's caching allocator: the CUDA context and library workspaces (0.5-1 GiB)."""
ALLOCATOR_MARGIN = 0.05
"""Share of the allocated peak added for the caching allocator's block rounding and fragmentation."""
HOST_RUNTIME = 3 * GIB
"""Host memory of the process tree without the tensors counted here: the interpreter, torch and its CUDA libraries,
the hivemind DHT and averager processes, p2pd and the data pipeline. An assumption for a node on a GPU."""
HOST_RUNTIME_CPU = 5 * GIB // 4
"""The same for a node that trains on the CPU, which loads no CUDA libraries: a tiny node's whole process tree
peaked at 1.0 GiB (PSS, which counts the pages the forked helpers share with the node once; its tensors are a few
tens of MiB), plus a quarter for margin. `tests/test_capacity.py` measures it."""
COMPUTES = ("bf16", "fp32")
FROZEN_BYTES = {"fp32": 4, "bf16": 2, "int8": 1}
WIRE_SNAPSHOT_BYTES = {"fp16": 2, "none": 4, "int8": 2}
"""Bytes per element of the served snapshots (`SpesRound.start`: fp32 when the wire is uncompressed, else fp16:
served state is weights and is never quantised to 8 bits)."""

_UNITS = {
    "": None,
    "b": 1,
    "k": KIB,
    "kb": KIB,
    "kib": KIB,
    "m": MIB,
    "mb": MIB,
    "mib": MIB,
    "g": GIB,
    "gb": GIB,
    "gib": GIB,
    "t": TIB,
    "tb": TIB,
    "tib": TIB,
}


def parse_size(text: str) -> int:
    """'48GB', '24GiB', '80G', '512MB' -> bytes. Units are binary: a '48 GB' card reports 48 GiB to the driver."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = _UNITS.get(match.group(2).lower(), None) if match else None
    if match is None or unit is None:
        raise ValueError(f"--device-memory: expected a size like 48GB, 24GiB, 80G or 512MB, got '{text}'")
    value = int(float(match.group(1)) * unit)
    if value <= 0:
        raise ValueError(f"--device-memory: must be positive, got '{text}'")
    return value


def format_bytes(n: int) -> str:
    """Bytes in GiB (MiB below 1 GiB): the unit the driver reports a card's size in."""
    if abs(n) >= GIB:
        return f"{n / GIB:.2f} GiB"
    if abs(n) >= MIB:
        return f"{n / MIB:.1f} MiB"
    return f"{n / KIB:.1f} KiB"


@dataclass(frozen=True)
class Activations:
    """Activation bytes of one training micro-batch."""

    kept: int
    """Saved for backward (and the logits) when the forward pass ends."""
    peak: int
    """The most that the step holds at once beyond the static weights, gradients included as they exist then."""


@dataclass
class MemoryPlan:
    """Per-node memory of a config. Byte fields; GPU ones are for bf16 autocast unless `compute` says fp32."""

    name: str
    num_shards: int
    shards_held: int
    compute: str
    micro_batch_size: int
    seq_len: int
    grad_accum: int
    activation_checkpointing: bool
    frozen_dtype: str
    trainable_params: int
    """Shared parameters plus the held shards' experts."""
    frozen_params: int
    """Experts of the shards this node does not hold."""
    # GPU
    weights: int
    """Trainable weights, fp32."""
    grads: int
    """Their gradients, fp32, counted whole at the peak."""
    optimizer: int
    """AdamW's two moments, fp32."""
    frozen: int
    """Frozen experts at their storage precision."""
    outer: int
    """Nesterov outer optimizer state, the overlap's copy of the trainable weights and, averaging updates with the
    plain average, the fp32 anchor (0 as published): in host memory, whatever the training device."""
    activations: int
    """Activations kept for backward at the micro-batch, with the config's checkpointing setting."""
    working: int
    """Working memory on top of the above at the peak: the loss gradients, a recomputed layer and gradient buffers
    in backward (or the merge between steps, when that needs more)."""
    step_allocated: int
    """Peak of torch's allocated GPU memory in a training step (gradients counted whole)."""
    between_allocated: int
    """Peak between steps, with no gradients or activations: the merge warm-up."""
    allocated: int
    """Peak of torch's allocated GPU memory, the larger of the two: the sum of the fields above."""
    margin: int
    """`ALLOCATOR_MARGIN` of `allocated`."""
    reserve: int
    """`CUDA_RESERVE`."""
    gpu_total: int
    """What the card must have."""
    activations_checkpointed: int
    working_checkpointed: int
    gpu_total_checkpointed: int
    activations_full: int
    """Activations without activation checkpointing."""
    working_full: int
    gpu_total_full: int
    # host
    host_averager: int
    """fp32 buffers of the averaged tensors (shared parameters and held shards), in hivemind's shared memory, and
    as much again for the error-feedback residual when averaging updates over a lossy wire."""
    host_snapshots: int
    """Served copies of the shared parameters and of every shard, at wire precision; with refresh by updates, also
    each own shard's update chain at that precision and its served update (about 1 byte per weight)."""
    host_refresh: int
    """Refresh downloads of every other shard at snapshot precision, held until the next round applies them (whole
    shards as they travelled, updates already added to the copy)."""
    host_checkpoint: int
    """A checkpoint's CPU copy: trainable weights, AdamW moments (and outer state), and the frozen experts as stored
    when `train.checkpoint_frozen_experts` is on."""
    host_checkpoint_in_place: int
    """What a checkpoint written in place (`--checkpoint-writes in-place`) holds in host memory instead of its copy:
    its largest tensor, copied from the device alone (`tensor_file.write_tensors`); training waits for the write."""
    host_runtime: int
    """`HOST_RUNTIME`."""
    host_running: int
    """Peak while training: runtime, averager, snapshots, refresh and checkpoint. A round's result is read from the
    averagers' buffers (`GroupAverager.finish`), not copied out of them."""
    host_startup: int
    """At startup, beside the runtime: one weight as it is made (drawn in fp32, then its stored form: bf16, or int8
    with the scaled copy and row scales) or read from a checkpoint being resumed; the model itself is on the device.
    """
    host_init_from: int
    """At startup with `--init-from` instead, beside the runtime: one layer's shard put together in fp32 from a
    Hugging Face checkpoint with one matrix per expert, then its stored form (`hf_checkpoint.load_hf_weights`)."""
    host_total: int
    """The largest of the three."""
    device_memory: int | None = None
    """The card's memory as given (bytes)."""
    fits: bool | None = None
    """gpu_total <= device_memory; None without a device size."""
    advice: list[str] = field(default_factory=list)
    """What to change when it does not fit."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def param_counts(m: ModelConfig, num_shards: int) -> dict[str, int]:
    """Parameter counts by kind (`model.analytic_param_count`) plus what one shard holds."""
    q, kv = m.num_heads * m.head_dim, m.kv_heads * m.head_dim
    attention = m.hidden_size * (2 * q + 2 * kv) + q + kv
    per_layer = attention + m.num_experts * m.hidden_size + 2 * m.hidden_size
    embedding = m.vocab_size * m.hidden_size
    head = 0 if m.tie_embeddings else m.vocab_size * m.hidden_size
    shared = m.num_layers * per_layer + embedding + head + m.hidden_size
    expert = 3 * m.hidden_size * m.expert_ffn
    experts = m.num_layers * m.num_experts * expert
    return {
        "shared": shared,
        "shared_per_layer": per_layer,
        "embedding": embedding,
        "head": head,
        "expert": expert,
        "shard": experts // num_shards,
        "experts": experts,
        "total": shared + experts,
    }


def activation_bytes(
    cfg: SpesConfig, shards_held: int = 1, compute: str = "bf16", checkpointing: bool | None = None
) -> Activations:
    """Activation bytes of one micro-batch (`Activations`), by the saved tensors of each op of the forward pass."""
    if compute not in COMPUTES:
        raise ValueError(f"compute: expected one of {COMPUTES}, got '{compute}'")
    m, t, s = cfg.model, cfg.train, cfg.swarm
    ckpt = t.activation_checkpointing if checkpointing is None else checkpointing
    autocast = compute == "bf16"
    c = 2 if autocast else 4  # bytes of the compute dtype
    b, seq = t.micro_batch_size, t.seq_len
    T = b * seq  # tokens per micro-batch
    d, ffn, E, k, V, L, h = (
        m.hidden_size,
        m.expert_ffn,
        m.num_experts,
        m.top_k,
        m.vocab_size,
        m.num_layers,
        m.num_heads,
    )
    qd, kvd = m.num_heads * m.head_dim, m.kv_heads * m.head_dim
    per_shard = E // s.num_shards
    trainable_experts = shards_held * per_shard
    trainable_share = shards_held / s.num_shards  # of the routed tokens, for a balanced router
    routed = T * k
    counts = param_counts(m, s.num_shards)

    # --- one decoder layer, everything autograd saves
    residual_norm = 8 * T * d + 4 * T  # RMSNorm: fp32 input, fp32 normalised value, rsqrt
    proj_inputs = 3 * c * T * d if autocast else 4 * T * d  # q/k/v each cast their own copy under autocast
    qk_norm = (4 + c) * T * (qd + kvd) + 8 * T  # fp32 pre-norm value, normalised value in compute dtype
    attention = c * T * (2 * qd + 2 * kvd) + 4 * T * h  # SDPA: q, k, v, output; fp32 log-sum-exp
    router = c * T * d + 4 * T * E + 8 * T * k  # gate input, fp32 probabilities, top-k indices
    # per routed token: (token, slot) indices, gate/up output, SiLU, expert output, fp32 weighted output, weight;
    # a trainable expert also keeps its input and the SwiGLU product
    experts = routed * (16 + 3 * c * ffn + c * d + 4 * d + 4) + round(
        trainable_share * routed * (c * d + c * ffn)
    )
    shared_copies = 2 * ((2 * qd + 2 * kvd) * d + E * d) if autocast else 0  # autocast's cached weight casts
    weight_copies = shared_copies + (2 * trainable_experts * counts["expert"] if autocast else 0)
    layer = 2 * residual_norm + proj_inputs + qk_norm + attention + router + experts + weight_copies
    layer_input = 4 * T * d
    loss_per_layer = 8 * T * E + 4 * T + 8 * T * k + 4 * E  # z-loss and load-balancing terms on router logits
    head = (
        residual_norm  # final norm
        + c * T * d  # LM head input
        + (2 * V * d if autocast else 0)  # LM head weight's bf16 copy
        + 4 * T * V  # fp32 log-softmax
        + 8 * b * (seq + 1)  # token ids and labels (one batch)
        + 8 * seq * m.head_dim  # rotary cos and sin
    )
    logits = c * T * V  # referenced by the model output until the next micro-batch
    kept = (L * layer_input if ckpt else L * layer) + L * loss_per_layer + head + logits
    # with checkpointing the layers save nothing, but autocast's cache keeps their weights' bf16 casts until the
    # forward pass (and the loss) leave the autocast region, before backward
    cached = L * shared_copies if ckpt else 0

    # --- backward
    grads_head = 4 * (counts["head"] or counts["embedding"]) + 4 * d
    grads_layer = 4 * (counts["shared_per_layer"] + trainable_experts * counts["expert"])
    grads_all = 4 * (counts["shared"] + shards_held * counts["shard"])
    accumulating = t.grad_accum > 1  # gradients of earlier micro-batches are there from the start
    # per layer: the residual-stream gradients (fp32), and the trainable experts' weight gradients: each expert's
    # slice comes back as a zero-filled fp32 tensor of its shard's whole weight; with accumulation, the layer's
    # new gradients are summed in a buffer before they are added to the stored ones
    expert_buffers = 4 * per_shard * 2 * ffn * d + (
        4 * trainable_experts * counts["expert"] if accumulating else 0
    )
    layer_work = 3 * 4 * T * d + expert_buffers
    phases = [
        kept + cached + (grads_all if accumulating else 0),  # the end of the forward pass
        kept + 8 * T * V + (grads_all if accumulating else 0),  # the loss gradients at the start of backward
    ]
    for j in (0, L - 1):  # top and bottom layer; the phases are linear in between
        grads = grads_all if accumulating else grads_head + j * grads_layer
        held = (L - j) * layer_input + layer if ckpt else (L - j) * layer
        phases.append(logits + held + layer_work + grads)
    # AdamW's single-tensor path on a CPU makes one temporary of each parameter in turn; fused on a GPU, none
    optimizer_work = 0 if autocast else 4 * max(counts["embedding"], per_shard * 2 * ffn * d)
    phases.append(logits + grads_all + optimizer_work)
    return Activations(kept=kept + cached, peak=max(phases))


def memory_plan(
    cfg: SpesConfig,
    shards_held: int = 1,
    device_memory: int | None = None,
    *,
    compute: str = "bf16",
    advise: bool = True,
) -> MemoryPlan:
    """The memory of a node that holds `shards_held` shards of `cfg`, and whether it fits `device_memory` bytes."""
    s, t = cfg.swarm, cfg.train
    if not 1 <= shards_held <= s.num_shards:
        raise ValueError(f"--shards: expected 1 to {s.num_shards} (swarm.num_shards), got {shards_held}")
    if device_memory is not None and device_memory <= 0:
        raise ValueError(f"device memory: must be positive, got {device_memory}")
    counts = param_counts(cfg.model, s.num_shards)
    trainable = counts["shared"] + shards_held * counts["shard"]
    frozen_params = (s.num_shards - shards_held) * counts["shard"]
    frozen = frozen_params * FROZEN_BYTES[s.frozen_dtype]
    if s.frozen_dtype == "int8":  # one fp32 scale per output row: 2 * ffn gate/up and d down rows per expert
        experts = frozen_params // counts["expert"]
        frozen += experts * 4 * (2 * cfg.model.expert_ffn + cfg.model.hidden_size)
    weights = grads = 4 * trainable
    optimizer = 8 * trainable
    nesterov = 8 * trainable if s.outer_optimizer == "nesterov" else 0  # previous weights and velocity
    # overlap: the copy handed to the all-reduce (of the own shards only with overlap_shards), for Nesterov or
    # update averaging only (the plain average of weights lands as its difference: `averaging.MODES`); averaging
    # updates with the plain average: the fp32 anchor (the weights at the last sync; Nesterov's previous weights
    # serve as the anchor at no extra cost)
    anchor = 4 * trainable if s.average == "updates" and s.outer_optimizer != "nesterov" else 0
    copies = s.average == "updates" or s.outer_optimizer == "nesterov"
    overlapped = trainable if s.overlap else shards_held * counts["shard"] if s.overlap_shards else 0
    if s.overlap_shards and not s.overlap and s.shared_lag_steps:  # the shared parameters' copy too
        overlapped += counts["shared"]
    overlapped = overlapped if copies else 0
    outer = nesterov + 4 * overlapped + anchor
    static = weights + optimizer + frozen

    # between steps (no gradients, no activations): a round's results are worked out in host memory and copied into
    # the weights tensor by tensor (`anchors.apply_outer`), so the peak is the merge warm-up (`SpesRound.merge`),
    # which works on one layer's experts at a time in
    # fp32: dense copies of the frozen shards, the concatenation, `merge_layer`'s clone and the previous layer's
    # result, the normalised gate rows, and the held experts with their gathered neighbours
    m = cfg.model
    layer_experts = 4 * m.num_experts * counts["expert"]
    dense = 0 if s.frozen_dtype == "fp32" else layer_experts * (s.num_shards - shards_held) // s.num_shards
    held_rows = shards_held * (m.num_experts // s.num_shards)
    merge = (
        dense
        + (3 if m.num_layers > 1 else 2) * layer_experts
        + layer_experts // 3  # the gate rows (a third of each expert), normalised
        + 4 * held_rows * (s.merge_topk + 2) * 2 * m.expert_ffn * m.hidden_size
    )
    between = static + merge

    def totals(checkpointing: bool) -> tuple[int, int, int, int, int]:
        act = activation_bytes(cfg, shards_held, compute, checkpointing)
        step = static + max(grads + act.kept, act.peak)
        allocated = max(step, between)
        working = allocated - static - grads - act.kept
        margin = math.ceil(ALLOCATOR_MARGIN * allocated)
        return act.kept, working, step, allocated, allocated + margin + CUDA_RESERVE

    ckpt_kept, ckpt_working, _, _, ckpt_total = totals(True)
    full_kept, full_working, _, _, full_total = totals(False)
    kept, working, step, allocated, gpu_total = totals(t.activation_checkpointing)

    wire = WIRE_SNAPSHOT_BYTES[s.wire_compression]
    # averaging updates over a lossy wire: the error-feedback residual, fp32 in shared memory
    residual = 4 * trainable if s.average == "updates" and s.wire_compression != "none" else 0
    host_averager = 4 * trainable + residual
    # refresh by updates: each own shard's update chain at snapshot precision and its served int8 update
    chains = (wire + 1) * shards_held * counts["shard"] if s.refresh_by_updates else 0
    # the shared parameters and own shards at wire precision; frozen copies are served from their own buffers
    host_snapshots = wire * (counts["total"] - frozen_params) + chains
    # held at snapshot precision: whole shards as they travelled (`transfer.validate_tensors`), updates already
    # added to the copy (`SpesRound._follow`; each shard's decoded fp32 update lives only while it is added)
    # (`swarm.refresh_parallel` shards at most: a shard's download slot is given back once it is loaded)
    frozen_shards = s.num_shards - shards_held
    downloading = min(frozen_shards, s.refresh_parallel) if s.refresh_parallel else frozen_shards
    host_refresh = wire * downloading * counts["shard"]
    # frozen experts only when checkpoints hold them (a resume without them refetches them from the swarm)
    host_checkpoint = weights + optimizer + (frozen if t.checkpoint_frozen_experts else 0) + nesterov
    # a layer's gate_up of one shard's experts: its largest expert tensor
    rows = (m.num_experts // s.num_shards) * 2 * m.expert_ffn
    gate_up = rows * m.hidden_size
    # written in place, one tensor at a time: the largest is the embedding (or the head), or a layer's gate_up of
    # the held shard's experts; each in fp32, as are its AdamW moments
    largest = 4 * max(counts["embedding"], counts["head"], gate_up)
    host_running = HOST_RUNTIME + outer + host_averager + host_snapshots + host_refresh + host_checkpoint
    # made one weight at a time: the largest shared weight in fp32, or a shard's gate_up drawn in fp32 beside its
    # stored form (`moe.stored_form`: bf16, or int8 from a scaled fp32 copy, with fp32 row scales)
    made = {"fp32": 4, "bf16": 4 + 2, "int8": 4 + 4 + 1}[s.frozen_dtype]
    scales = 4 * rows if s.frozen_dtype == "int8" else 0
    host_startup = HOST_RUNTIME + max(4 * counts["embedding"], 4 * counts["head"], made * gate_up + scales)
    # --init-from: a layer's shard in fp32 (gate/up and down) beside, at most, one expert's matrix being read or the
    # gate/up's stored form (bf16; int8: its scaled fp32 copy, the int8 form and the row scales)
    stored = {"fp32": 0, "bf16": 2 * gate_up, "int8": 5 * gate_up + scales}[s.frozen_dtype]
    host_init_from = (
        HOST_RUNTIME + 4 * (gate_up + gate_up // 2) + max(4 * m.expert_ffn * m.hidden_size, stored)
    )
    plan = MemoryPlan(
        name=cfg.name,
        num_shards=s.num_shards,
        shards_held=shards_held,
        compute=compute,
        micro_batch_size=t.micro_batch_size,
        seq_len=t.seq_len,
        grad_accum=t.grad_accum,
        activation_checkpointing=t.activation_checkpointing,
        frozen_dtype=s.frozen_dtype,
        trainable_params=trainable,
        frozen_params=frozen_params,
        weights=weights,
        grads=grads,
        optimizer=optimizer,
        frozen=frozen,
        outer=outer,
        activations=kept,
        working=working,
        step_allocated=step,
        between_allocated=between,
        allocated=allocated,
        margin=gpu_total - allocated - CUDA_RESERVE,
        reserve=CUDA_RESERVE,
        gpu_total=gpu_total,
        activations_checkpointed=ckpt_kept,
        working_checkpointed=ckpt_working,
        gpu_total_checkpointed=ckpt_total,
        activations_full=full_kept,
        working_full=full_working,
        gpu_total_full=full_total,
        host_averager=host_averager,
        host_snapshots=host_snapshots,
        host_refresh=host_refresh,
        host_checkpoint=host_checkpoint,
        host_runtime=HOST_RUNTIME,
        host_checkpoint_in_place=largest,
        host_running=host_running,
        host_startup=host_startup,
        host_init_from=host_init_from,
        host_total=max(host_running, host_startup, host_init_from),
        device_memory=device_memory,
    )
    if device_memory is not None:
        plan.fits = gpu_total <= device_memory
        if not plan.fits and advise:
            plan.advice = _advice(cfg, shards_held, device_memory, compute)
    return plan


def max_shards(cfg: SpesConfig, device_memory: int, *, compute: str = "bf16") -> int:
    """The most shards a node of `cfg` can hold on `device_memory` bytes (0: not even one fits)."""
    best = 0
    for held in range(1, cfg.swarm.num_shards + 1):
        if memory_plan(cfg, held, device_memory, compute=compute, advise=False).fits:
            best = held
    return best


def host_need(cfg: SpesConfig, shards_held: int = 1) -> int:
    """Host memory of a node that trains on the CPU: its training state (the plan's allocated peak in fp32, what
    a GPU would hold) and the host-side buffers of a running node (`host_running`) live in the same memory, beside
    the CPU runtime (`HOST_RUNTIME_CPU`, no CUDA libraries). It writes its checkpoints in place
    (`checkpoint_writer`), so no checkpoint copy."""
    running = memory_plan(cfg, shards_held, advise=False)
    host = running.host_running - running.host_checkpoint - running.host_runtime + HOST_RUNTIME_CPU
    return memory_plan(cfg, shards_held, compute="fp32", advise=False).allocated + host


def host_shards_fit(cfg: SpesConfig, host_memory: int) -> int:
    """The most shards a node training on the CPU can hold in `host_memory` bytes (0: not even one fits)."""
    best = 0
    for held in range(1, cfg.swarm.num_shards + 1):
        if host_need(cfg, held) <= host_memory:
            best = held
    return best


def _advice(cfg: SpesConfig, held: int, device_memory: int, compute: str) -> list[str]:
    """Changes that make the plan fit: each single change that does, else the first combination that does."""
    t, s = cfg.train, cfg.swarm
    sequences = t.micro_batch_size * t.grad_accum

    def total(candidate: SpesConfig, shards: int) -> int:
        return memory_plan(candidate, shards, None, compute=compute, advise=False).gpu_total

    def batch(mb: int) -> tuple[str, dict]:
        accum = sequences // mb
        return f"train.micro_batch_size = {mb} with train.grad_accum = {accum}", {
            "micro_batch_size": mb,
            "grad_accum": accum,
        }

    # smaller micro-batches that keep the sequences per optimiser step
    smaller = [mb for mb in range(t.micro_batch_size - 1, 0, -1) if sequences % mb == 0]

    ckpt = ("train.activation_checkpointing = true", {"activation_checkpointing": True})
    dtypes = [d for d in ("bf16", "int8") if FROZEN_BYTES[d] < FROZEN_BYTES[s.frozen_dtype]]
    singles: list[tuple[str, int]] = []
    if held > 1 and (fewer := max_shards(cfg, device_memory, compute=compute)):
        singles.append((f"hold fewer shards: --shards {fewer}", total(cfg, fewer)))
    if not t.activation_checkpointing and (n := total(cfg.replace(train=ckpt[1]), held)) <= device_memory:
        singles.append((ckpt[0], n))
    for mb in smaller:
        label, change = batch(mb)
        if (n := total(cfg.replace(train=change), held)) <= device_memory:
            singles.append((label, n))
            break
    for dtype in dtypes:
        if (n := total(cfg.replace(swarm={"frozen_dtype": dtype}), held)) <= device_memory:
            singles.append((f"swarm.frozen_dtype = '{dtype}'", n))
            break
    found = [(f"{label} (needs {format_bytes(n)})") for label, n in singles]
    if not found:  # together: checkpointing, then smaller micro-batches, lower frozen precision, one shard
        labels, train = ([ckpt[0]] if not t.activation_checkpointing else []), dict(ckpt[1])
        steps = [([], {}, held)]
        steps += [([batch(mb)[0]], batch(mb)[1], held) for mb in smaller]
        last = [batch(1)[0]] if t.micro_batch_size > 1 else []
        steps += [
            (last + [f"swarm.frozen_dtype = '{d}'"], {**batch(1)[1], "frozen_dtype": d}, held) for d in dtypes
        ]
        if held > 1:
            steps.append((steps[-1][0] + ["--shards 1"], steps[-1][1], 1))
        n = 0
        for words, change, shards in steps:
            swarm = {"frozen_dtype": change["frozen_dtype"]} if "frozen_dtype" in change else {}
            candidate = cfg.replace(
                train={**train, **{k: v for k, v in change.items() if k != "frozen_dtype"}}
            )
            candidate = candidate.replace(swarm=swarm) if swarm else candidate
            n = total(candidate, shards)
            if n <= device_memory:
                found = [" and ".join(labels + words) + f" (needs {format_bytes(n)})"]
                break
        else:
            return [
                f"does not fit even with {' and '.join(labels + steps[-1][0]) or 'these settings'}: that needs "
                f"{format_bytes(n)}; use a larger card, or a swarm config with more shards (swarm.num_shards)"
            ]
    if any("train." in line or "swarm." in line for line in found):
        found.append("train.* and swarm.* belong to the swarm's config: every node must run the same one")
    return found


def plan_table(plan: MemoryPlan) -> str:
    """The plan as the CLI prints it."""
    lines = [
        f"{plan.name}: {plan.shards_held} of {plan.num_shards} shards held, micro-batch {plan.micro_batch_size} x "
        f"{plan.seq_len} tokens (grad_accum {plan.grad_accum}), "
        + ("bf16 autocast" if plan.compute == "bf16" else "fp32")
        + f", frozen experts {plan.frozen_dtype}, activation checkpointing "
        + ("on" if plan.activation_checkpointing else "off"),
        "",
    ]
    rows = [
        ("trainable weights (fp32)", plan.weights, None),
        ("gradients (fp32)", plan.grads, None),
        ("AdamW moments (fp32)", plan.optimizer, None),
        (f"frozen experts ({plan.frozen_dtype})", plan.frozen, None),
    ]
    rows += [
        ("activations at the micro-batch", plan.activations, None),
        ("working memory (backward, round)", plan.working, None),
        (f"allocator margin ({ALLOCATOR_MARGIN:.0%})", plan.margin, None),
        ("CUDA context and workspaces", plan.reserve, None),
        *([("outer optimizer, anchor, overlap copies", None, plan.outer)] if plan.outer else []),
        ("averager buffers, residual (fp32)", None, plan.host_averager),
        ("served snapshots (trained parts)", None, plan.host_snapshots),
        ("refresh downloads (wire precision)", None, plan.host_refresh),
        ("checkpoint copy", None, plan.host_checkpoint),
        ("runtime (torch, hivemind, p2pd)", None, plan.host_runtime),
    ]
    startup = "host at startup (made on the device)"
    width = max(len(startup), *(len(r[0]) for r in rows)) + 2
    lines.append(f"{'component':<{width}}{'GPU':>12}{'host':>12}")
    for name, gpu, host in rows:
        lines.append(
            f"{name:<{width}}{format_bytes(gpu) if gpu is not None else '-':>12}"
            f"{format_bytes(host) if host is not None else '-':>12}"
        )
    lines.append(f"{'total':<{width}}{format_bytes(plan.gpu_total):>12}{format_bytes(plan.host_running):>12}")
    lines.append(f"{startup:<{width}}{'':>12}{format_bytes(plan.host_startup):>12}")
    lines.append("")
    lines.append(f"with --init-from: host at startup {format_bytes(plan.host_init_from)}")
    lines.append(
        f"with checkpoints written in place (--checkpoint-writes in-place): host "
        f"{format_bytes(plan.host_running - plan.host_checkpoint + plan.host_checkpoint_in_place)} while training "
        f"(startup as above), "
        f"and training waits for each write of {format_bytes(plan.host_checkpoint)}"
    )
    other = "off" if plan.activation_checkpointing else "on"
    other_total = plan.gpu_total_full if plan.activation_checkpointing else plan.gpu_total_checkpointed
    other_act = plan.activations_full if plan.activation_checkpointing else plan.activations_checkpointed
    lines.append(
        f"with activation checkpointing {other}: activations {format_bytes(other_act)}, GPU total "
        f"{format_bytes(other_total)}"
    )
    if plan.device_memory is None:
        lines.append(f"needs a card of at least {format_bytes(plan.gpu_total)}")
    else:
        verdict = "yes" if plan.fits else "no"
        room = plan.device_memory - plan.gpu_total
        lines.append(
            f"fits {format_bytes(plan.device_memory)}: {verdict} "
            + (f"({format_bytes(room)} to spare)" if plan.fits else f"({format_bytes(-room)} short)")
        )
        for line in plan.advice:
            lines.append(f"  - {line}")
    return "\n".join(lines)
