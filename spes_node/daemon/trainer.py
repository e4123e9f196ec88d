"""Local training of one node: AdamW over the shared parameters and the owned experts, warm-up + cosine."""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Collection
from dataclasses import dataclass

import torch

from spes_node.config import SpesConfig
from spes_node.model.moe import MoEForCausalLM
from spes_node.model.ownership import apply_ownership, check_shards, owned_shards

logger = logging.getLogger(__name__)


@dataclass
class StepStats:
    loss: float
    ce_loss: float
    tokens: int
    lr: float
    grad_norm: float
    seconds: float


def lr_at(step: int, cfg: SpesConfig) -> float:
    """Linear warm-up to the peak, then cosine to `min_lr_ratio` of it at `total_steps`, flat afterwards."""
    t = cfg.train
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    progress = min(1.0, (step - t.warmup_steps) / max(1, t.total_steps - t.warmup_steps))
    return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


class Trainer:
    """Owns the model's trainable state on one node; `train_step` is one optimiser step."""

    def __init__(self, cfg: SpesConfig, model: MoEForCausalLM, batcher, device: torch.device):
        self.cfg, self.model, self.batcher, self.device = cfg, model, batcher, device
        model.activation_checkpointing = cfg.train.activation_checkpointing
        self.step = 0
        self.optimizer = self._build_optimizer({})

    def _named_trainable(self) -> dict[str, torch.nn.Parameter]:
        return {name: p for name, p in self.model.named_parameters() if p.requires_grad}

    def _build_optimizer(self, previous: dict[str, dict]) -> torch.optim.AdamW:
        t = self.cfg.train
        named = self._named_trainable()
        decay = [p for name, p in named.items() if p.ndim >= 2]
        no_decay = [p for name, p in named.items() if p.ndim < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=t.lr,
            betas=(t.beta1, t.beta2),
            fused=self.device.type == "cuda",
        )
        for name, p in named.items():
            if name in previous:
                optimizer.state[p] = previous[name]
        return optimizer

    def optimizer_state_by_name(self, without: Collection[int] = ()) -> dict[str, dict]:
        """The optimiser state of each trainable parameter, by name; `without`: ids of parameters to leave out."""
        names = {id(p): name for name, p in self._named_trainable().items()}
        return {
            names[id(p)]: state
            for p, state in self.optimizer.state.items()
            if id(p) in names and id(p) not in without
        }

    def set_ownership(self, owned: list[int]) -> None:
        """Change which shards train; optimiser state of parameters that stay trainable is kept.

        The AdamW moments of the shards given up, and the optimiser's hold on their weights, go before the model
        makes the new shards' fp32 weights: a move (one shard for another) otherwise held the old shard's weights
        and moments beside the new shard's weights and its frozen copy, 1.3 GiB more than the node's own state at
        spes-1b, on top of the download the move loads (`tests/test_trainer.py` measures it)."""
        check_shards(self.model, owned)
        leaving = set(owned_shards(self.model)) - set(owned)
        given_up = {
            id(p) for s in leaving for expert in self.model.expert_shards(s) for p in expert.parameters()
        }
        previous = self.optimizer_state_by_name(without=given_up)
        self.optimizer = None
        apply_ownership(self.model, owned, self.cfg.swarm.frozen_dtype)
        self.model.to(self.device)
        self.optimizer = self._build_optimizer(previous)

    def optimizer_element_count(self) -> int:
        """Elements held in optimiser state (AdamW: two moments per trainable element)."""
        return sum(v.numel() for s in self.optimizer.state.values() for v in s.values() if v.ndim > 0)

    def _autocast(self):
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def train_step(self, schedule_step: int | None = None) -> StepStats:
        """One optimiser step, at the learning rate of `schedule_step` (default: this trainer's own step count).

        A node passes the swarm's step (its round x H plus its steps into the round, at most H): a node that
        trains past H while waiting for slower peers would otherwise run ahead on the schedule and reach its lowest
        rate long before the swarm."""
        t = self.cfg.train
        start = time.perf_counter()
        lr = lr_at(self.step if schedule_step is None else schedule_step, self.cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.model.train()
        total_loss = total_ce = 0.0
        tokens = 0
        for _ in range(t.grad_accum):
            batch = self.batcher.next_batch().to(self.device, non_blocking=True)
            with self._autocast():
                out = self.model(batch[:, :-1], labels=batch[:, 1:])
            (out.loss / t.grad_accum).backward()
            total_loss += out.loss.item() / t.grad_accum
            total_ce += out.ce_loss.item() / t.grad_accum
            tokens += batch[:, 1:].numel()
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        if t.grad_clip > 0:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, t.grad_clip))
        else:
            grad_norm = float(torch.norm(torch.stack([p.grad.norm() for p in params if p.grad is not None])))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return StepStats(total_loss, total_ce, tokens, lr, grad_norm, time.perf_counter() - start)

    @torch.no_grad()
    def evaluate(self, batches: list[torch.Tensor]) -> float:
        """Mean cross-entropy over validation batches."""
        if not batches:
            return float("nan")
        self.model.eval()
        losses = []
        for batch in batches:
            batch = batch.to(self.device)
            with self._autocast():
                losses.append(self.model(batch[:, :-1], labels=batch[:, 1:]).ce_loss.item())
        return sum(losses) / len(losses)
