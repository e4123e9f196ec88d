import math

import pytest
import torch
from live_bytes import LiveBytes

from spes_node.config import load_preset
from spes_node.daemon.trainer import Trainer, lr_at
from spes_node.devices import resolve_device
from spes_node.model.moe import MoEForCausalLM, analytic_param_count
from spes_node.model.ownership import apply_ownership, shard_tensors, shared_parameters

CPU = torch.device("cpu")


class FixedBatcher:
    """Consecutive slices of one fixed token tensor, `batch_size` rows at a time."""

    def __init__(self, tokens: torch.Tensor, batch_size: int):
        self.tokens, self.batch_size, self.row = tokens, batch_size, 0

    def next_batch(self) -> torch.Tensor:
        rows = torch.arange(self.row, self.row + self.batch_size) % self.tokens.shape[0]
        self.row += self.batch_size
        return self.tokens[rows]


def _cfg(**train):
    return load_preset("tiny").replace(
        train={"seq_len": 32, "micro_batch_size": 2, "warmup_steps": 2, "total_steps": 20, **train}
    )


def _tokens(cfg, rows: int = 16, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.model.vocab_size, (rows, cfg.train.seq_len + 1), generator=generator)


def _trainer(cfg, owned, frozen_dtype=None, batch_size=None, seed=0):
    torch.manual_seed(seed)
    model = MoEForCausalLM(cfg.model, cfg.swarm.num_shards)
    apply_ownership(model, owned, frozen_dtype or cfg.swarm.frozen_dtype)
    batcher = FixedBatcher(_tokens(cfg), batch_size or cfg.train.micro_batch_size)
    return Trainer(cfg, model, batcher, CPU)


def _moment_elements(trainer: Trainer) -> int:
    total = 0
    for state in trainer.optimizer.state.values():
        assert set(state) == {"step", "exp_avg", "exp_avg_sq"}
        total += state["exp_avg"].numel() + state["exp_avg_sq"].numel()
    return total


def test_optimizer_state_covers_shared_and_owned_experts():
    cfg = _cfg()
    counts = analytic_param_count(cfg.model)
    num_shards = cfg.swarm.num_shards
    per_shard = counts["experts"] // num_shards
    assert per_shard * num_shards == counts["experts"]

    trainer = _trainer(cfg, [2])
    trainer.train_step()
    assert _moment_elements(trainer) == 2 * (counts["shared"] + per_shard)
    assert trainer.optimizer_element_count() == _moment_elements(trainer)
    in_state = {id(p) for p in trainer.optimizer.state}
    expected = list(shared_parameters(trainer.model).values()) + [
        getattr(shard, kind) for shard in trainer.model.expert_shards(2) for kind in ("gate_up", "down")
    ]
    assert in_state == {id(p) for p in expected}

    single = _cfg().replace(swarm={"num_shards": 1})
    everything = _trainer(single, [0])
    everything.train_step()
    assert _moment_elements(everything) == 2 * counts["total"]
    assert _moment_elements(everything) - _moment_elements(trainer) == 2 * (num_shards - 1) * per_shard


def test_optimizer_state_follows_ownership_changes():
    cfg = _cfg()
    trainer = _trainer(cfg, [0])
    trainer.train_step()
    shared_state = {
        name: trainer.optimizer.state[p]["exp_avg"].clone()
        for name, p in shared_parameters(trainer.model).items()
    }
    trainer.set_ownership([3])
    counts = analytic_param_count(cfg.model)
    assert trainer.optimizer_element_count() == 2 * counts["shared"]
    for name, p in shared_parameters(trainer.model).items():
        assert torch.equal(trainer.optimizer.state[p]["exp_avg"], shared_state[name])
    trainer.train_step()
    assert trainer.optimizer_element_count() == 2 * (counts["shared"] + counts["experts"] // 4)


@pytest.mark.parametrize("frozen_dtype", ["fp32", "bf16"])
def test_a_move_gives_up_the_old_shard_before_making_the_new_one(frozen_dtype):
    """Moving from shard 0 to shard 1: the tensors alive at any moment of `set_ownership` never exceed those alive
    before it. The old shard's AdamW moments go first, and its fp32 weights as it is frozen, so the new shard's fp32
    weights take their place; while the optimiser held them until the new one was built, the move peaked at the
    new shard's fp32 weights and the old one's frozen copy above where it started."""
    cfg = _cfg().replace(swarm={"frozen_dtype": frozen_dtype})
    trainer = _trainer(cfg, [0], frozen_dtype)
    trainer.train_step()  # AdamW's moments exist
    model = trainer.model
    shard = sum(t.nbytes for t in shard_tensors(model, 1).values())  # fp32, every layer
    moments = [v for state in trainer.optimizer.state.values() for v in state.values() if v.ndim > 0]
    held = list(model.parameters()) + list(model.buffers()) + moments
    live = LiveBytes(held, count_known=True)
    del held, moments  # the test's own hold on them
    with live:
        trainer.set_ownership([1])
    assert live.peak <= live.start, (
        f"peak {live.peak - live.start:+d} bytes over the start (a shard: {shard})"
    )
    assert live.now < live.start - shard, "the old shard's moments are still held"
    trainer.train_step()
    assert trainer.optimizer_element_count() == 2 * sum(
        p.numel() for p in model.parameters() if p.requires_grad
    )


@pytest.mark.parametrize("frozen_dtype", ["fp32", "bf16", "int8"])
def test_frozen_experts_receive_no_update(frozen_dtype):
    cfg = _cfg()
    trainer = _trainer(cfg, [1], frozen_dtype)
    model = trainer.model
    frozen_before = {name: buffer.clone() for name, buffer in model.named_buffers() if ".mlp.shards." in name}
    assert len(frozen_before) >= 2 * cfg.model.num_layers * (cfg.swarm.num_shards - 1)
    owned_before = {k: v.clone() for k, v in shard_tensors(model, 1).items()}
    shared_before = {k: v.detach().clone() for k, v in shared_parameters(model).items()}
    for _ in range(3):
        stats = trainer.train_step()
        assert math.isfinite(stats.loss) and stats.grad_norm > 0
    for name, buffer in model.named_buffers():
        if name in frozen_before:
            assert buffer.dtype == frozen_before[name].dtype
            assert torch.equal(buffer, frozen_before[name]), name
    for name, tensor in shard_tensors(model, 1).items():
        assert not torch.equal(tensor, owned_before[name]), name
    for name, p in shared_parameters(model).items():
        assert not torch.equal(p.detach(), shared_before[name]), name


def test_training_lowers_the_loss_on_repeated_data():
    cfg = _cfg(lr=3e-3, warmup_steps=1)
    trainer = _trainer(cfg, [0])
    trainer.batcher = FixedBatcher(_tokens(cfg, rows=2), 2)
    losses = [trainer.train_step().ce_loss for _ in range(8)]
    assert losses[-1] < losses[0] - 0.1, losses


def test_lr_schedule_warmup_cosine_and_floor():
    cfg = load_preset("tiny").replace(
        train={"lr": 1e-3, "warmup_steps": 10, "total_steps": 110, "min_lr_ratio": 0.1}
    )
    lr = [lr_at(step, cfg) for step in range(200)]
    assert lr[0] == pytest.approx(1e-4)
    assert lr[4] == pytest.approx(5e-4)
    assert lr[9] == pytest.approx(1e-3)
    assert all(a < b for a, b in zip(lr[:9], lr[1:10]))
    assert lr[10] == pytest.approx(1e-3)
    assert lr[60] == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5))
    assert lr[35] == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.25))))
    assert all(a >= b for a, b in zip(lr[10:110], lr[11:111]))
    assert lr[110] == pytest.approx(1e-4)
    assert all(value == pytest.approx(1e-4) for value in lr[110:])
    assert min(lr) == pytest.approx(1e-4)

    no_warmup = cfg.replace(train={"warmup_steps": 0})
    assert lr_at(0, no_warmup) == pytest.approx(1e-3)


def test_trainer_applies_the_scheduled_lr():
    cfg = _cfg(lr=2e-3, warmup_steps=4)
    trainer = _trainer(cfg, [0])
    for step in range(3):
        stats = trainer.train_step()
        assert stats.lr == pytest.approx(lr_at(step, cfg))
        assert all(group["lr"] == stats.lr for group in trainer.optimizer.param_groups)
    assert trainer.step == 3
    # a node past H steps in its round (training while it waits) runs at the swarm's step, not its own count
    stats = trainer.train_step(schedule_step=1)
    assert stats.lr == pytest.approx(lr_at(1, cfg)) and stats.lr != pytest.approx(lr_at(3, cfg))
    assert trainer.step == 4


def test_weight_decay_only_on_matrices():
    trainer = _trainer(_cfg(), [0])
    for group in trainer.optimizer.param_groups:
        dims = {p.ndim for p in group["params"]}
        assert dims == ({1} if group["weight_decay"] == 0 else {2, 3})
    assert {g["weight_decay"] for g in trainer.optimizer.param_groups} == {0.0, 0.1}
    assert trainer.optimizer.defaults["betas"] == (0.9, 0.95)


def _first_step(cfg, owned, batch_size):
    trainer = _trainer(cfg, owned, batch_size=batch_size)
    grads = {}
    step = trainer.optimizer.step

    def capture(*args, **kwargs):
        grads.update({name: p.grad.clone() for name, p in trainer.model.named_parameters()})
        return step(*args, **kwargs)

    trainer.optimizer.step = capture
    stats = trainer.train_step()
    return stats, grads


def _flat(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([grads[name].flatten() for name in sorted(grads)])


def test_gradient_accumulation_matches_a_larger_batch():
    base = _cfg(grad_clip=0.0).replace(model={"lb_loss": 0.0})
    accumulated, grads_a = _first_step(base.replace(train={"grad_accum": 2}), [0], batch_size=2)
    single, grads_b = _first_step(base, [0], batch_size=4)
    assert accumulated.tokens == single.tokens == 4 * base.train.seq_len
    assert accumulated.ce_loss == pytest.approx(single.ce_loss, rel=1e-5)
    assert accumulated.loss == pytest.approx(single.loss, rel=1e-5)
    assert sorted(grads_a) == sorted(grads_b)
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=1e-4, atol=1e-7, msg=name)


def test_gradient_accumulation_with_load_balancing_is_close():
    """The load-balancing loss is a product of batch means, so the micro-batch split changes it slightly."""
    base = _cfg(grad_clip=0.0)
    accumulated, grads_a = _first_step(base.replace(train={"grad_accum": 2}), [0], batch_size=2)
    single, grads_b = _first_step(base, [0], batch_size=4)
    assert accumulated.ce_loss == pytest.approx(single.ce_loss, rel=1e-5)
    assert accumulated.loss == pytest.approx(single.loss, rel=1e-3)
    cosine = torch.nn.functional.cosine_similarity(_flat(grads_a), _flat(grads_b), dim=0)
    assert cosine > 0.99


def test_gradient_clipping_bounds_the_update_norm():
    cfg = _cfg(grad_clip=1e-3)
    trainer = _trainer(cfg, [0])
    seen = {}
    step = trainer.optimizer.step

    def capture(*args, **kwargs):
        params = [p for g in trainer.optimizer.param_groups for p in g["params"]]
        seen["norm"] = torch.norm(torch.stack([p.grad.norm() for p in params])).item()
        return step(*args, **kwargs)

    trainer.optimizer.step = capture
    stats = trainer.train_step()
    assert stats.grad_norm > 1e-3
    assert seen["norm"] == pytest.approx(1e-3, rel=1e-3)


def test_evaluate_is_mean_cross_entropy_without_update():
    cfg = _cfg()
    trainer = _trainer(cfg, [0])
    batches = [_tokens(cfg, rows=2, seed=s) for s in range(2)]
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    loss = trainer.evaluate(batches)
    with torch.no_grad():
        expected = sum(trainer.model(b[:, :-1], labels=b[:, 1:]).ce_loss.item() for b in batches) / 2
    assert loss == pytest.approx(expected, rel=1e-6)
    assert all(torch.equal(v, before[k]) for k, v in trainer.model.state_dict().items())
    assert math.isnan(trainer.evaluate([]))


def test_resolve_device():
    assert resolve_device("cpu") == CPU
    assert resolve_device("auto").type in ("cpu", "cuda")
    with pytest.raises(ValueError, match="device"):
        resolve_device("gpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="cuda"):
            resolve_device("cuda")
