"""Which experts a node trains, applied to a model, and the views of the model that the sync works on.

Shared parameters are everything that is not an expert weight (embeddings, LM head, attention, norms, router):
every node trains them. A node trains the experts of the shards it owns; every other shard is frozen.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import torch
from torch import nn

from spes_node.model import MoEForCausalLM, is_expert_name


def apply_ownership(model: MoEForCausalLM, owned: Iterable[int], frozen_dtype: str = "fp32") -> None:
    """Make the shards in `owned` trainable and freeze every other shard (stored in `frozen_dtype`)."""
    owned = set(owned)
    unknown = owned - set(range(model.num_shards))
    if unknown:
        raise ValueError(f"shard: {sorted(unknown)} out of range [0, {model.num_shards})")
    for layer in model.model.layers:
        for index, shard in enumerate(layer.mlp.shards):
            want_trainable = index in owned
            if shard.trainable != want_trainable or (
                not want_trainable and shard.frozen_dtype != frozen_dtype
            ):
                shard.set_trainable(want_trainable, frozen_dtype)


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


def data_part(nodes, peer_id: str, current: int | None = None) -> tuple[int, int]:
    """This node's part of the data, (part, num_parts), disjoint from what every other live node reads.

    `nodes`: the swarm's records by peer id (our own, if present, is ignored); `current`: the part this node
    reads now (or read before a restart), None when it has none. Shards play no part: any two nodes read
    different documents, whatever the number of replicas of their shards.

    Part index: global, one per node, announced in the record (`NodeInfo.data_part`). A node keeps `current`
    unless a node with a smaller peer id announces the same index (two nodes that started at the same moment,
    or a part taken while its node was down); the others with a taken index, in peer id order, and then a
    node without one, take the lowest indices nobody announces, in order. Nodes that see the same records so
    reach distinct indices in one step, and a node keeps its index, hence its place in the data, for as long
    as it lives and across restarts.

    Documents: `TokenBatcher` reads training document t when t % num_parts == part. Here num_parts is the
    smallest power of two above the part index at which no other node's index (after the moves above) is
    congruent to ours; it changes as nodes come and go, and a change of num_parts for the same index only
    narrows or widens the documents read (`TokenBatcher.set_part` then keeps the position).
    Disjointness: let p != q with num_parts L_p <= L_q (both powers of two, so L_p divides L_q). A document
    t read by both has t = q (mod L_q), hence t = q (mod L_p), and t = p (mod L_p), so q = p (mod L_p),
    which the choice of L_p excludes. This holds once the nodes have read each other's records (at startup,
    after --wait-peers, and every round); until then a new node may read documents that a node whose
    num_parts it halves still reads. Coverage: when the indices in use are 0..n-1 with 2^(k-1) < n <= 2^k,
    every document is read: index r < 2^(k-1) reads the documents r mod 2^(k-1) alone, or splits them with
    index r + 2^(k-1) at num_parts 2^k. An index whose node is gone stays unread until a new node takes it.
    """
    claims = {
        peer: n.data_part
        for peer, n in nodes.items()
        if peer != peer_id and n.state != "leaving" and n.data_part is not None and n.data_part >= 0
    }
    if current is not None and current >= 0:
        claims[peer_id] = current
    owners: dict[int, str] = {}
    for peer in sorted(claims):
        owners.setdefault(claims[peer], peer)
    movers = sorted(peer for peer, part in claims.items() if owners[part] != peer)
    if peer_id not in claims:
        movers.append(peer_id)
    free = (index for index in itertools.count() if index not in owners)
    settled = {peer: part for part, peer in owners.items()} | dict(zip(movers, free))
    part = settled.pop(peer_id)
    others = set(settled.values())
    num_parts = 1
    while num_parts <= part or any(q % num_parts == part for q in others):
        num_parts *= 2
    return part, num_parts
