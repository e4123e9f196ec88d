"""The memory plan: its arithmetic, the presets it sizes, the CLI, and a check against memory measured on a CPU.

The measured check runs real training steps of the tiny and small presets with the project's own code (model,
ownership, Trainer) and compares what they hold with the plan: parameters, gradients, AdamW state and frozen
experts to the byte, the activations at the end of the forward pass and the peak of the whole step within 15%.
The peak is tracked by a dispatch mode that sees every tensor storage the step creates and when it is freed.
The GPU path (bf16 autocast) is measured through CPU autocast, which takes the same casts in this model.
"""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from live_bytes import LiveBytes

from spes_node.cli import main
from spes_node.config import load_preset
from spes_node.daemon.plan import (
    CUDA_RESERVE,
    GIB,
    HOST_RUNTIME,
    MIB,
    activation_bytes,
    max_shards,
    memory_plan,
    param_counts,
    parse_size,
    plan_table,
)
from spes_node.daemon.round import merge_own_experts
from spes_node.daemon.traffic import round_traffic
from spes_node.daemon.trainer import Trainer
from spes_node.model.initial import initial_model
from spes_node.model.moe import MoEForCausalLM, analytic_param_count
from spes_node.model.ownership import apply_ownership

TOLERANCE = 0.15


# ---------------------------------------------------------------- arithmetic


def test_tiny_by_hand():
    cfg = load_preset("tiny")  # d=128, 2 layers, 4 heads, 8 experts of FFN 256, vocabulary 260, 4 shards
    d, layers, vocab, ffn = 128, 2, 260, 256
    per_layer = 4 * d * d + 2 * d + 8 * d + 2 * d  # q, k, v, o; q/k norms; router; two norms
    shared = layers * per_layer + 2 * vocab * d + d  # embedding, LM head, final norm
    shard = layers * 2 * 3 * d * ffn  # 2 experts per layer, gate/up/down each
    assert (shared, shard) == (200832, 393216)
    counts = analytic_param_count(cfg.model)
    assert (counts["shared"], counts["experts"]) == (shared, 4 * shard)

    plan = memory_plan(cfg)
    assert (plan.trainable_params, plan.frozen_params) == (shared + shard, 3 * shard)
    assert plan.weights == plan.grads == 4 * (shared + shard) == 2376192
    assert plan.optimizer == 8 * (shared + shard)
    assert plan.frozen == 4 * 3 * shard  # tiny keeps frozen experts in fp32
    assert plan.gpu_total == plan.allocated + plan.margin + CUDA_RESERVE
    parts = plan.weights + plan.grads + plan.optimizer + plan.frozen + plan.activations + plan.working
    assert plan.allocated == parts

    int8 = memory_plan(cfg.replace(swarm={"frozen_dtype": "int8"}))
    bf16 = memory_plan(cfg.replace(swarm={"frozen_dtype": "bf16"}))
    assert bf16.frozen == 2 * 3 * shard
    assert int8.frozen == 3 * shard + layers * 3 * 2 * 4 * (2 * ffn + d)  # fp32 scale per output row


def test_the_checkpoint_copy_holds_frozen_experts_only_when_checkpoints_do():
    cfg = load_preset("spes-1b")
    without = memory_plan(cfg.replace(train={"checkpoint_frozen_experts": False}))
    with_frozen = memory_plan(cfg.replace(train={"checkpoint_frozen_experts": True}))
    assert with_frozen.host_checkpoint - without.host_checkpoint == with_frozen.frozen > 0
    # a resume reads the checkpoint one tensor at a time, with or without frozen experts
    assert with_frozen.host_startup == without.host_startup


def test_update_averaging_and_refresh_by_updates_are_counted():
    # the round as published: overlap's copies (update averaging keeps them, the plain average does not) are
    # counted in test_overlap_costs_the_host_a_copy_of_what_it_hands_over_only_for_nesterov_or_update_averaging
    cfg = load_preset("spes-1b").replace(swarm={"refresh_by_updates": False} | WAITING)
    base = memory_plan(cfg)
    trainable = base.trainable_params
    plain = memory_plan(cfg.replace(swarm={"average": "updates", "wire_compression": "int8"}))
    assert plain.outer - base.outer == 4 * trainable  # the anchor
    assert plain.host_running - base.host_running == 2 * 4 * trainable  # the anchor and the residual
    assert plain.gpu_total == base.gpu_total  # the round's state is in host memory
    assert plain.host_averager - base.host_averager == 4 * trainable  # the error-feedback residual
    nesterov = memory_plan(cfg.replace(swarm={"outer_optimizer": "nesterov", "average": "updates"}))
    assert nesterov.outer == memory_plan(cfg.replace(swarm={"outer_optimizer": "nesterov"})).outer
    chains = memory_plan(cfg.replace(swarm={"refresh_by_updates": True}))
    shard = param_counts(cfg.model, cfg.swarm.num_shards)["shard"]
    assert chains.host_snapshots - base.host_snapshots == (2 + 1) * shard  # fp16 chain + int8 update


def test_more_shards_hold_more_trainable_bytes():
    cfg = load_preset("spes-7b")
    plans = [memory_plan(cfg, held) for held in range(1, cfg.swarm.num_shards + 1)]
    for fewer, more in zip(plans, plans[1:]):
        assert more.weights > fewer.weights and more.grads > fewer.grads and more.optimizer > fewer.optimizer
        assert more.frozen < fewer.frozen
        assert more.gpu_total > fewer.gpu_total
    assert plans[-1].frozen == 0 and plans[-1].host_refresh == 0
    assert max_shards(cfg, 80 * GIB) == 2
    with pytest.raises(ValueError, match="--shards"):
        memory_plan(cfg, 5)


@pytest.mark.parametrize("name", ["tiny", "small", "spes-1b", "spes-7b"])
def test_checkpointing_lowers_activations(name):
    plan = memory_plan(load_preset(name))
    assert plan.activations_checkpointed < plan.activations_full / 3
    assert plan.gpu_total_checkpointed <= plan.gpu_total_full  # equal where the merge sets the peak (small)
    for held in (1, 2):
        on = activation_bytes(load_preset(name), held, checkpointing=True)
        off = activation_bytes(load_preset(name), held, checkpointing=False)
        assert on.kept < off.kept and on.peak < off.peak


def test_activations_grow_with_the_micro_batch():
    cfg = load_preset("spes-1b")
    sizes = [memory_plan(cfg.replace(train={"micro_batch_size": mb})).activations for mb in (1, 2, 4, 8)]
    assert sizes == sorted(sizes) and sizes[-1] > 6 * sizes[0]  # nearly linear: weight casts are fixed


# ---------------------------------------------------------------- presets


def test_spes_7b_fits_a_48gb_card():
    plan = memory_plan(load_preset("spes-7b"), 1, parse_size("48GB"))
    assert plan.fits, plan_table(plan)
    assert plan.activation_checkpointing
    static = plan.weights + plan.grads + plan.optimizer + plan.frozen
    assert static == pytest.approx(40.1 * GIB, rel=0.002)  # the reading of the code paths
    assert max_shards(load_preset("spes-7b"), 48 * GIB) == 1
    small = memory_plan(load_preset("spes-7b"), 1, 24 * GIB)
    assert small.fits is False and small.advice and "does not fit even with" in small.advice[0]


WAITING = {"overlap": False, "overlap_shards": False}
"""Training waits for every all-reduce of a round, as published."""


@pytest.mark.parametrize(
    "swarm",
    [
        {"average": "updates", "wire_compression": "int8"},
        {"outer_optimizer": "nesterov"},
        {"overlap": True, "outer_optimizer": "nesterov"},
        {"average": "updates", "wire_compression": "int8", "outer_optimizer": "nesterov", "overlap": True},
    ],
)
def test_spes_7b_fits_a_48gb_card_with_any_round_options(swarm):
    """Anchors, Nesterov state and the overlap's copies are in host memory: they cost the host, not the card."""
    cfg = load_preset("spes-7b")
    published = memory_plan(cfg.replace(swarm=WAITING), 1, 48 * GIB)
    plan = memory_plan(cfg.replace(swarm=swarm), 1, 48 * GIB)
    assert plan.fits, plan_table(plan)
    assert plan.outer >= 4 * plan.trainable_params
    assert plan.gpu_total == published.gpu_total
    assert plan.host_running >= published.host_running + plan.outer
    assert "outer optimizer, anchor, overlap copies" in plan_table(plan)


def test_overlap_costs_the_host_a_copy_of_what_it_hands_over_only_for_nesterov_or_update_averaging():
    cfg = load_preset("spes-7b")
    counts = param_counts(cfg.model, cfg.swarm.num_shards)
    assert cfg.swarm.overlap_shards, "on by default"
    # the plain average of weights lands as its difference to what was handed over: no copy, overlapped or not
    outers = {
        options: memory_plan(cfg.replace(swarm=dict(options)), 2, 80 * GIB).outer
        for options in (
            tuple(WAITING.items()),
            (("overlap", False), ("overlap_shards", True)),
            (("overlap", True),),
        )
    }
    assert set(outers.values()) == {0}, outers
    for other in ({"outer_optimizer": "nesterov"}, {"average": "updates"}):
        published = memory_plan(cfg.replace(swarm=WAITING | other), 2, 80 * GIB)
        shards_only = memory_plan(
            cfg.replace(swarm={"overlap": False, "overlap_shards": True} | other), 2, 80 * GIB
        )
        everything = memory_plan(cfg.replace(swarm={"overlap": True} | other), 2, 80 * GIB)
        assert shards_only.outer - published.outer == 4 * 2 * counts["shard"], other
        assert everything.outer - published.outer == 4 * (counts["shared"] + 2 * counts["shard"]), other
        assert shards_only.gpu_total == published.gpu_total


def test_spes_1b_fits_a_24gb_card():
    cfg = load_preset("spes-1b")
    plan = memory_plan(cfg, 1, parse_size("24GB"))
    assert plan.fits, plan_table(plan)
    assert max_shards(cfg, 48 * GIB) == cfg.swarm.num_shards  # a 48 GB card can hold every expert


def test_advice_names_what_fits():
    cfg = load_preset("spes-1b").replace(train={"micro_batch_size": 8, "grad_accum": 4})
    plan = memory_plan(cfg, 1, 24 * GIB)
    assert plan.fits is False
    assert any(line.startswith("train.activation_checkpointing = true") for line in plan.advice)
    batch = [line for line in plan.advice if line.startswith("train.micro_batch_size")]
    assert batch and batch[0].startswith("train.micro_batch_size = 4 with train.grad_accum = 8")
    assert memory_plan(cfg.replace(train={"micro_batch_size": 4, "grad_accum": 8}), 1, 24 * GIB).fits
    held = memory_plan(load_preset("spes-1b"), 4, 24 * GIB)
    assert held.fits is False and any("--shards 1" in line for line in held.advice)
    assert memory_plan(cfg).fits is None and memory_plan(cfg).advice == []


# ---------------------------------------------------------------- sizes and the CLI


@pytest.mark.parametrize(
    "text, expected",
    [
        ("48GB", 48 * GIB),
        ("24GiB", 24 * GIB),
        ("80G", 80 * GIB),
        ("512MB", 512 * MIB),
        ("40.5gb", int(40.5 * GIB)),
        (" 1 TiB ", 1 << 40),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["48", "GB", "48XB", "-4GB", "0GB", "4 8GB", "", "48 G B"])
def test_bad_sizes_are_refused(text):
    with pytest.raises(ValueError, match="--device-memory"):
        parse_size(text)


def _cli(*args):
    return CliRunner().invoke(main, ["plan", *args], env={}, catch_exceptions=True)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--preset", "spes-7b", "--device-memory", "48 bananas"], "--device-memory"),
        (["--preset", "spes-7b", "--device-memory", "0GB"], "--device-memory"),
        (["--preset", "spes-7b", "--shards", "two"], "--shards"),
        (["--preset", "spes-7b", "--shards", "9"], "--shards"),
        (["--preset", "no-such-preset"], "unknown preset"),
        (["--preset", "spes-7b", "--nodes", "0"], "--nodes"),
        (["--preset", "spes-7b", "--link-mbit", "-3"], "--link-mbit"),
        ([], "--preset"),
    ],
)
def test_cli_bad_input_is_one_line(args, needle):
    result = _cli(*args)
    assert result.exit_code == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("spes-node: error: ") and needle in lines[0], result.stderr
    assert result.stdout == ""


def test_cli_table_and_json():
    result = _cli("--preset", "spes-7b", "--device-memory", "48GB")
    assert result.exit_code == 0, result.stderr
    for needle in (
        "trainable weights (fp32)",
        "AdamW moments",
        "frozen experts (bf16)",
        "activations",
        "total",
    ):
        assert needle in result.stdout
    assert "fits 48.00 GiB: yes" in result.stdout
    result = _cli("--preset", "spes-7b", "--device-memory", "24GB", "--json")
    data = json.loads(result.stdout)
    assert data["fits"] is False and data["device_memory"] == 24 * GIB and data["advice"]
    assert data["gpu_total"] == memory_plan(load_preset("spes-7b")).gpu_total
    result = _cli("--preset", "spes-1b", "--shards", "4", "--device-memory", "24GB")
    assert "fits 24.00 GiB: no" in result.stdout and "--shards 1" in result.stdout


def test_the_network_plan_counts_each_kind_from_the_parameter_counts():
    cfg = load_preset("small").replace(swarm={"num_shards": 2, "replication_target": 2, "refresh_every": 1})
    counts = param_counts(cfg.model, 2)
    t = round_traffic(cfg)
    assert (t.nodes, t.replicas) == (4, 2), "enough nodes for 2 holders of each of 2 shards"
    # butterfly all-reduce: sent + received 4 (g-1)/g of the vector, fp16; the refresh: the other shard's int8 update
    assert t.shared == pytest.approx(4 * 3 / 4 * counts["shared"] * 2)
    assert t.shard == pytest.approx(4 * 1 / 2 * counts["shard"] * 2)
    assert t.refresh_received == t.refresh_served == pytest.approx(counts["shard"] * 1)
    assert t.diloco == pytest.approx(4 * 3 / 4 * counts["total"] * 2)
    every_other = round_traffic(cfg.replace(swarm={"refresh_every": 2}))
    assert every_other.refresh_received == pytest.approx(t.refresh_received / 2)
    whole = round_traffic(cfg.replace(swarm={"refresh_by_updates": False}))
    assert whole.refresh_received == pytest.approx(counts["shard"] * 2), "whole shards at fp16"
    both = round_traffic(cfg, nodes=4, shards_held=2)
    assert both.refresh_received == 0 and both.replicas == 4
    # a round's bytes on a 100 Mbit/s link: half of them each way, both directions at once
    assert t.seconds(t.total, 100) == pytest.approx(t.total / 2 * 8 / 100e6)
    # what training waits for: every all-reduce, the shared parameters' alone when the shards' overlap, or none
    waiting = round_traffic(cfg.replace(swarm={"overlap": False, "overlap_shards": False}))
    shards_beside = round_traffic(cfg.replace(swarm={"overlap": False, "overlap_shards": True}))
    all_beside = round_traffic(cfg.replace(swarm={"overlap": True, "overlap_shards": True}))
    assert waiting.stalling == pytest.approx(t.shared + t.shard)
    assert shards_beside.stalling == pytest.approx(t.shared) and shards_beside.allreduce == waiting.allreduce
    assert all_beside.stalling == 0


def test_cli_prints_the_network_plan():
    result = _cli("--preset", "spes-7b", "--nodes", "16", "--link-mbit", "50")
    assert result.exit_code == 0, result.stderr
    assert "network per round (100 steps): 16 nodes, 4 holders a shard" in result.stdout
    assert "on a 50 Mbit/s link each way" in result.stdout
    expected = round_traffic(load_preset("spes-7b"), 16)
    assert f"training waits {expected.seconds(expected.stalling, 50):.0f} s of it" in result.stdout
    data = json.loads(_cli("--preset", "spes-7b", "--nodes", "16", "--link-mbit", "50", "--json").stdout)
    assert data["network"]["total"] == pytest.approx(expected.total)
    assert data["network"]["allreduce_seconds"] == pytest.approx(expected.seconds(expected.allreduce, 50))
    assert data["network"]["stall_seconds"] == pytest.approx(expected.seconds(expected.stalling, 50))


# ---------------------------------------------------------------- measured on a CPU


class _Batches:
    """Random tokens; the first batch (the warm-up step) is one sequence, to keep the test fast."""

    def __init__(self, cfg):
        self.cfg, self.generator, self.first = cfg, torch.Generator().manual_seed(0), True

    def next_batch(self) -> torch.Tensor:
        t = self.cfg.train
        shape = (1 if self.first else t.micro_batch_size, t.seq_len + 1)
        self.first = False
        return torch.randint(0, self.cfg.model.vocab_size, shape, generator=self.generator)


def _measure(cfg, compute: str) -> dict[str, int]:
    """One real training step of a node holding shard 0: its static bytes, its activations and its peak."""
    torch.manual_seed(0)
    model = MoEForCausalLM(cfg.model, cfg.swarm.num_shards)
    apply_ownership(model, [0], cfg.swarm.frozen_dtype)
    trainer = Trainer(cfg, model, _Batches(cfg), torch.device("cpu"))
    if compute == "bf16":  # the GPU path: bf16 autocast (on the CPU here)
        trainer._autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16)
    trainer.train_step()  # AdamW's state exists from the first step on

    measured: dict[str, int] = {}

    def grads_before_step(optimizer, args, kwargs):
        measured["grads"] = sum(p.grad.nbytes for g in optimizer.param_groups for p in g["params"])

    trainer.optimizer.register_step_pre_hook(grads_before_step)
    moments = [v for state in trainer.optimizer.state.values() for v in state.values() if v.ndim > 0]
    static = list(model.parameters()) + list(model.buffers()) + moments
    live = LiveBytes(static)
    saved: dict[int, int] = {}
    params = {p.untyped_storage().data_ptr() for p in static}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)

    def forward_end(_module, _inputs, output):
        hooks.__exit__(None, None, None)
        measured["forward_end"] = live.now
        measured["saved"] = sum(saved.values()) + output.logits.untyped_storage().nbytes()

    model.register_forward_pre_hook(lambda *_: hooks.__enter__())
    model.register_forward_hook(forward_end)
    with live:
        trainer.train_step()
    measured["weights"] = sum(p.nbytes for p in model.parameters() if p.requires_grad)
    measured["frozen"] = sum(b.nbytes for b in model.buffers())
    measured["optimizer"] = sum(v.nbytes for v in moments)
    measured["peak"] = sum(t.nbytes for t in static) + live.peak
    return measured


@pytest.mark.parametrize("name", ["tiny", "small"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["full", "checkpointed"])
@pytest.mark.parametrize("compute", ["fp32", "bf16"])
def test_plan_matches_a_measured_step(name, checkpointing, compute):
    cfg = load_preset(name).replace(train={"activation_checkpointing": checkpointing})
    plan = memory_plan(cfg, 1, compute=compute)
    measured = _measure(cfg, compute)
    exact = {key: getattr(plan, key) for key in ("weights", "grads", "optimizer", "frozen")}
    assert {key: measured[key] for key in exact} == exact

    def close(estimate: int, value: int, what: str) -> None:
        assert abs(estimate - value) <= TOLERANCE * value, f"{what}: plan {estimate}, measured {value}"

    close(plan.activations, measured["forward_end"], "activations at the end of the forward pass")
    if not checkpointing:  # the checkpointed layers save through their own hooks
        close(plan.activations, measured["saved"], "tensors saved for backward, and the logits")
    close(plan.step_allocated, measured["peak"], "peak of the step")


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_plan_matches_a_measured_merge(name):
    """Between steps, the merge warm-up (`round.merge_own_experts`) is the largest thing on the device for small models."""
    cfg = load_preset(name)
    model = MoEForCausalLM(cfg.model, cfg.swarm.num_shards)
    apply_ownership(model, [0], cfg.swarm.frozen_dtype)
    static = list(model.parameters()) + list(model.buffers())
    live = LiveBytes(static)
    with live:
        merge_own_experts(model, [0], 0, cfg.swarm)  # sync step 0: alpha is alpha0
    plan = memory_plan(cfg, 1)
    merge = plan.between_allocated - (plan.weights + plan.optimizer + plan.frozen)
    assert abs(merge - live.peak) <= TOLERANCE * live.peak, (merge, live.peak)


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_a_checkpoint_written_in_place_holds_its_largest_tensor(name):
    """Written in place, a checkpoint copies one tensor at a time to the host: the plan's figure for it is the
    largest tensor a node's checkpoint holds (weights, AdamW moments, frozen experts), counted on a real model."""
    cfg = load_preset(name)
    model = MoEForCausalLM(cfg.model, cfg.swarm.num_shards)
    apply_ownership(model, [0], cfg.swarm.frozen_dtype)
    tensors = list(model.state_dict().values())
    tensors += [torch.empty_like(p) for p in model.parameters() if p.requires_grad]  # the moments' sizes
    assert memory_plan(cfg, 1).host_checkpoint_in_place == max(t.nbytes for t in tensors)


@pytest.mark.parametrize("name", ["tiny", "small"])
@pytest.mark.parametrize("frozen_dtype", ["fp32", "bf16", "int8"])
def test_the_startup_figure_is_one_weight_made_as_measured(name, frozen_dtype):
    """A node makes its model on its device one weight at a time (`model.initial`): what the host holds beside the
    model is the largest weight drawn in fp32 and, frozen, its stored form; measured on a real model on the CPU,
    where the model itself is in the same memory and is not counted."""
    cfg = load_preset(name).replace(swarm={"frozen_dtype": frozen_dtype})
    with LiveBytes() as live:
        model = initial_model(
            cfg.model, cfg.swarm.num_shards, cfg.train.seed, owned=[0], frozen_dtype=frozen_dtype
        )
    assert live.now == sum(t.nbytes for t in model.state_dict().values())
    assert memory_plan(cfg, 1).host_startup - HOST_RUNTIME == live.peak - live.now > 0


@pytest.mark.parametrize("name", ["tiny", "small"])
@pytest.mark.parametrize("frozen_dtype", ["fp32", "bf16", "int8"])
def test_the_init_from_figure_is_one_layers_shard_as_measured(tmp_path, name, frozen_dtype):
    """`--init-from` loads a Hugging Face checkpoint (one matrix per expert, as an export writes it) one layer's
    shard at a time: what it holds beyond the model, counted with torch's allocations on a real model (a frozen
    shard's old buffers count until they are replaced), is the plan's figure."""
    from spes_node.model.hf_checkpoint import load_hf_weights, save_hf_checkpoint
    from spes_node.model.ownership import dense_state_dict

    cfg = load_preset(name).replace(swarm={"frozen_dtype": frozen_dtype})
    m, s = cfg.model, cfg.swarm
    save_hf_checkpoint(cfg, dense_state_dict(initial_model(m, s.num_shards, 1)), tmp_path / "hf")
    model = initial_model(m, s.num_shards, 2, owned=[0], frozen_dtype=frozen_dtype)
    with LiveBytes(model.state_dict().values(), count_known=True) as live:
        load_hf_weights(model, tmp_path / "hf")
    assert live.now == live.start
    assert memory_plan(cfg, 1).host_init_from - HOST_RUNTIME == live.peak - live.start
