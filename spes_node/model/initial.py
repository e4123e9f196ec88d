"""A node's model at its seed's initial weights, made on its device one tensor at a time.

`MoEForCausalLM(cfg, num_shards, seed)` builds every weight in fp32 on the CPU; a node then freezes the shards it
does not train (`apply_ownership`) and moves the model to its device. At spes-7b that is 25.8 GiB of host memory
for a model that a GPU node keeps none of, and a frozen shard exists in fp32 before it is stored in bf16 or int8.
`initial_model` makes the same weights without either: the model's layout is built on the meta device with its
ownership applied, its storage is allocated where it will live, and each weight is then drawn on the CPU in fp32
and written into its place in the shard's storage form. The host holds one weight at a time in fp32 (its storage
form too when it is frozen, and int8's rounding temporaries).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from spes_node.config import ModelConfig
from spes_node.model.moe import ExpertShard, MoEForCausalLM, initial_value
from spes_node.model.ownership import apply_ownership


@torch.no_grad()
def initial_model(
    cfg: ModelConfig,
    num_shards: int,
    seed: int,
    *,
    owned: Iterable[int] | None = None,
    frozen_dtype: str = "fp32",
    device: torch.device | str = "cpu",
    draw: bool = True,
) -> MoEForCausalLM:
    """The model of `seed` with the shards in `owned` trainable (all of them when None) and every other one frozen
    in `frozen_dtype`, on `device`: the weights of `MoEForCausalLM(cfg, num_shards, seed)` with `apply_ownership`
    applied, made without an fp32 copy of the whole model. `draw=False` leaves the storage as allocated, for a
    caller that writes every weight itself (`--init-from`; drawing spes-7b's weights takes a CPU core 1.5 minutes)."""
    with torch.device("meta"):
        model = MoEForCausalLM(cfg, num_shards)
    # the order and shapes the weights are drawn in: every expert weight is still a parameter here
    drawn = [(name, p.shape) for name, p in model.named_parameters()]
    if owned is not None:
        apply_ownership(model, owned, frozen_dtype)
    model.to_empty(device=device)
    if cfg.tie_embeddings:  # `to_empty` gives each module its own tensor
        model.lm_head.weight = model.model.embed_tokens.weight
    generator = torch.Generator().manual_seed(seed)
    for name, shape in drawn if draw else ():
        value = initial_value(cfg, name, shape, generator)
        module_name, _, attribute = name.rpartition(".")
        module = model.get_submodule(module_name)
        if isinstance(module, ExpertShard):
            module.fill(attribute, value)
        else:
            getattr(module, attribute).copy_(value)
        del value
    return model
