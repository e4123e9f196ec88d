"""Which experts a node trains, applied to a model, and the views of the model that the sync works on.

Shared parameters are everything that is not an expert weight (embeddings, LM head, attention, norms, router):
every node trains them. A node trains the experts of the shards it owns; every other shard is frozen.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn

from spes_node.model.moe import MoEForCausalLM, is_expert_name


def apply_ownership(model: MoEForCausalLM, owned: Iterable[int], frozen_dtype: str = "fp32") -> None:
    """Make the shards in `owned` trainable and freeze every other shard (stored in `frozen_dtype`)."""
    owned = set(owned)
    check_shards(model, owned)
    for layer in model.model.layers:
        for index, shard in enumerate(layer.mlp.shards):
            want_trainable = index in owned
            if shard.trainable != want_trainable or (
                not want_trainable and shard.frozen_dtype != frozen_dtype
            ):
                shard.set_trainable(want_trainable, frozen_dtype)


def check_shards(model: MoEForCausalLM, owned: Iterable[int]) -> None:
    """ValueError unless every shard in `owned` is one of the model's."""
    unknown = set(owned) - set(range(model.num_shards))
    if unknown:
        raise ValueError(f"shard: {sorted(unknown)} out of range [0, {model.num_shards})")


def owned_shards(model: MoEForCausalLM) -> list[int]:
    return [i for i, shard in enumerate(model.model.layers[0].mlp.shards) if shard.trainable]


def shared_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """Every non-expert parameter, by name, in a fixed order."""
    return {name: p for name, p in model.named_parameters() if not is_expert_name(name)}


def shard_tensors(model: MoEForCausalLM, shard: int) -> dict[str, torch.Tensor]:
    """The fp32 weights of one shard in every layer (views of the parameters when the shard is trainable)."""
    out = {}
    for layer_index, layer in enumerate(model.model.layers):
        gate_up, down = layer.mlp.shards[shard].dense()
        prefix = f"model.layers.{layer_index}.mlp.shards.{shard}"
        out[f"{prefix}.gate_up"] = gate_up
        out[f"{prefix}.down"] = down
    return out


def frozen_shard_buffers(model: MoEForCausalLM, shard: int) -> dict[str, list[torch.Tensor]]:
    """For each tensor of a frozen shard (named as in `shard_tensors`), the buffers it is stored in
    (`ExpertShard.stored`; `moe.read_stored` reads them)."""
    out = {}
    for layer_index, layer in enumerate(model.model.layers):
        expert_shard = layer.mlp.shards[shard]
        prefix = f"model.layers.{layer_index}.mlp.shards.{shard}"
        out[f"{prefix}.gate_up"] = expert_shard.stored("gate_up")
        out[f"{prefix}.down"] = expert_shard.stored("down")
    return out


@torch.no_grad()
def load_shard_tensors(model: MoEForCausalLM, shard: int, tensors: dict[str, torch.Tensor]) -> None:
    for layer_index, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{layer_index}.mlp.shards.{shard}"
        layer.mlp.shards[shard].load_dense(tensors[f"{prefix}.gate_up"], tensors[f"{prefix}.down"])


def dense_state_dict(model: MoEForCausalLM) -> dict[str, torch.Tensor]:
    """All weights as fp32 under our parameter names, frozen experts dequantized."""
    out = {name: p.detach() for name, p in shared_parameters(model).items()}
    for shard in range(model.num_shards):
        out.update(shard_tensors(model, shard))
    return out


@torch.no_grad()
def load_dense_state_dict(model: MoEForCausalLM, state: dict[str, torch.Tensor]) -> None:
    """Load fp32 weights under our names into a model of any ownership; every tensor must be present."""
    shared = shared_parameters(model)
    expected = set(shared) | {name for s in range(model.num_shards) for name in shard_tensors(model, s)}
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        raise ValueError(
            f"state dict mismatch: missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]}"
        )
    for name, p in shared.items():
        p.copy_(state[name])
    for shard in range(model.num_shards):
        load_shard_tensors(model, shard, state)


@torch.no_grad()
def load_state_in_place(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> tuple[list[str], list[str]]:
    """Copy each of `tensors` (named and stored as `model.state_dict()` has them) into the model's tensor of that
    name, wherever it lives, looking each up once and letting it go before the next: torch's `load_state_dict`
    first makes a dict of the mapping it is given, which for a checkpoint read on demand is all of it at once.
    Returns the names the model has and `tensors` lack, and those `tensors` have and the model lacks; nothing is
    copied when there are any of the latter. ValueError, naming it, for a tensor of another shape."""
    targets = model.state_dict(keep_vars=True)
    unexpected = [name for name in tensors if name not in targets]
    missing = [name for name in targets if name not in tensors]
    if unexpected:
        return missing, unexpected
    for name in tensors:
        value = tensors[name]
        if value.shape != targets[name].shape:
            raise ValueError(f"{name} is {list(value.shape)}, the model's {list(targets[name].shape)}")
        targets[name].copy_(value)
        del value
    return missing, unexpected
