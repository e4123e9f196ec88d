"""Conversion between our sharded state dict and transformers' OLMoE (`OlmoeForCausalLM`) names and layout."""

from __future__ import annotations

import re

import torch

from spes_node.config import ModelConfig

_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.shards\.(\d+)\.(gate_up|down)$")
_HF_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")


def to_hf_config(cfg: ModelConfig, **extra):
    """The `transformers.OlmoeConfig` of a model config.

    Special token ids are left unset (OLMoE's defaults lie outside small vocabularies); pass them in `extra`.
    """
    from transformers import OlmoeConfig

    tokens = {"pad_token_id": None, "bos_token_id": None, "eos_token_id": None}
    return OlmoeConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.expert_ffn,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.kv_heads,
        num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.top_k,
        max_position_embeddings=cfg.max_seq_len,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        rms_norm_eps=cfg.rms_norm_eps,
        norm_topk_prob=cfg.norm_topk_prob,
        initializer_range=cfg.init_std,
        tie_word_embeddings=cfg.tie_embeddings,
        router_aux_loss_coef=cfg.lb_loss,
        **{**tokens, **extra},
    )


def from_hf_config(hf_config) -> ModelConfig:
    """The model config of a `transformers.OlmoeConfig`; inverse of `to_hf_config`."""
    kv_heads = hf_config.num_key_value_heads
    rope = getattr(hf_config, "rope_parameters", None) or {}
    return ModelConfig(
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        num_layers=hf_config.num_hidden_layers,
        num_heads=hf_config.num_attention_heads,
        num_kv_heads=0 if kv_heads in (None, hf_config.num_attention_heads) else kv_heads,
        num_experts=hf_config.num_experts,
        top_k=hf_config.num_experts_per_tok,
        expert_ffn=hf_config.intermediate_size,
        max_seq_len=hf_config.max_position_embeddings,
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        rms_norm_eps=hf_config.rms_norm_eps,
        norm_topk_prob=hf_config.norm_topk_prob,
        init_std=hf_config.initializer_range,
        tie_embeddings=bool(hf_config.tie_word_embeddings),
    )


def to_hf_state_dict(dense: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our names -> transformers' names; the shards of a layer are concatenated into the fused expert tensors.

    `dense` holds fp32 expert weights under our names (see `spes_node.model.ownership.dense_state_dict`).
    """
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for name, tensor in dense.items():
        match = _EXPERT.match(name)
        if match:
            layer, shard, kind = int(match[1]), int(match[2]), match[3]
            experts.setdefault((layer, kind), {})[shard] = tensor
        else:
            out[name] = tensor
    for (layer, kind), shards in experts.items():
        fused = torch.cat([shards[s] for s in sorted(shards)], dim=0)
        out[f"model.layers.{layer}.mlp.experts.{kind}_proj"] = fused
    return out


def from_hf_state_dict(hf: dict[str, torch.Tensor], num_shards: int) -> dict[str, torch.Tensor]:
    """transformers' names -> ours, splitting each layer's fused experts into `num_shards` shards."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in hf.items():
        match = _HF_EXPERT.match(name)
        if not match:
            out[name] = tensor
            continue
        layer, kind = int(match[1]), match[2].removesuffix("_proj")
        if tensor.shape[0] % num_shards:
            raise ValueError(f"{name}: {tensor.shape[0]} experts do not split into {num_shards} shards")
        for shard, part in enumerate(tensor.chunk(num_shards, dim=0)):
            out[f"model.layers.{layer}.mlp.shards.{shard}.{kind}"] = part.clone()
    return out
