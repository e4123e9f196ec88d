"""Upcycling: a dense Hugging Face decoder (Llama, Qwen2, Qwen3, OLMo, OLMo2) turned into an OLMoE-shaped MoE.

Embeddings, LM head, attention projections and norms are copied; every expert of a layer starts as the dense MLP
(gate/up/down), optionally plus Gaussian noise on a random fraction of its entries; the router starts from a
choice of initialisations. The MoE renormalises its top-k weights (`norm_topk_prob`), so that with identical
experts its MLP output equals the dense MLP's whatever the router says.

Where OLMoE cannot express the dense model exactly, the function changes, and a warning says so:
- OLMoE applies RMSNorm to the whole query and key projections. Llama, Qwen2 and OLMo have no such norm: the
  weights are set to ones, so queries and keys are rescaled to unit RMS per token (attention logits change
  scale). Qwen3 normalises each head separately: its per-head weights are tiled over the heads, but the RMS is
  then taken over all heads together. OLMo2's norms have OLMoE's shape and are copied.
- OLMo normalises with a LayerNorm without weights (RMSNorm here); OLMo2 normalises the outputs of attention and
  MLP rather than their inputs: those norms start as ones.
- Attention biases (Qwen2), rotary scaling, sliding windows and QKV clipping are not part of the architecture
  and are dropped.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from spes_node.config import ModelConfig, SpesConfig

logger = logging.getLogger(__name__)

FAMILIES = ("llama", "qwen2", "qwen3", "olmo", "olmo2")
ROUTER_INITS = ("normal", "zero", "orthogonal")


@dataclass
class UpcycleOptions:
    """How the experts and the router of the MoE start."""

    num_experts: int
    """Experts per layer."""
    top_k: int
    """Experts per token."""
    noise: float = 0.0
    """Standard deviation of the Gaussian noise added to expert weights (absolute, not relative)."""
    noise_fraction: float = 0.5
    """Fraction of the entries of each expert weight that receive noise."""
    router: str = "normal"
    """'normal' (N(0, init std)), 'zero' (uniform probabilities) or 'orthogonal' (orthogonal rows)."""
    seed: int = 0
    """Seed of the noise and of the router."""

    def validate(self) -> UpcycleOptions:
        if self.num_experts < 1:
            raise ValueError(f"--experts: must be positive, got {self.num_experts}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"--top-k: must be in [1, --experts], got {self.top_k}")
        if self.noise < 0:
            raise ValueError(f"--noise: must be >= 0, got {self.noise}")
        if not 0 <= self.noise_fraction <= 1:
            raise ValueError(f"--noise-fraction: must be in [0, 1], got {self.noise_fraction}")
        if self.router not in ROUTER_INITS:
            raise ValueError(f"--router: must be one of {ROUTER_INITS}, got '{self.router}'")
        return self


def moe_config(dense_config, opts: UpcycleOptions) -> tuple[ModelConfig, list[str]]:
    """The OLMoE architecture of the upcycled model, and notes on what of the dense config does not carry over."""
    from spes_node.config import ModelConfig

    family = dense_config.model_type
    if family not in FAMILIES:
        raise ValueError(
            f"--upcycle-from: '{family}' models are not supported (supported: {', '.join(FAMILIES)})"
        )
    if getattr(dense_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"--upcycle-from: the MLP activation is {dense_config.hidden_act}, OLMoE needs silu")
    heads, hidden = dense_config.num_attention_heads, dense_config.hidden_size
    head_dim = getattr(dense_config, "head_dim", None) or hidden // heads
    if head_dim * heads != hidden:
        raise ValueError(
            f"--upcycle-from: head_dim {head_dim} x {heads} heads != hidden_size {hidden}; OLMoE cannot express it"
        )
    notes = []
    rope = getattr(dense_config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        notes.append(
            f"rotary scaling '{rope['rope_type']}' dropped: plain rotary embedding with the same theta"
        )
    if getattr(dense_config, "use_sliding_window", False) or "sliding_attention" in (
        getattr(dense_config, "layer_types", None) or []
    ):
        notes.append("sliding-window attention dropped: every layer attends to the full context")
    if getattr(dense_config, "clip_qkv", None):
        notes.append("QKV clipping dropped")
    cfg = ModelConfig(
        vocab_size=dense_config.vocab_size,
        hidden_size=hidden,
        num_layers=dense_config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(dense_config, "num_key_value_heads", None) or heads,
        num_experts=opts.num_experts,
        top_k=opts.top_k,
        expert_ffn=dense_config.intermediate_size,
        max_seq_len=dense_config.max_position_embeddings,
        rope_theta=float(rope.get("rope_theta", getattr(dense_config, "rope_theta", 10000.0))),
        rms_norm_eps=float(getattr(dense_config, "rms_norm_eps", None) or 1e-5),
        norm_topk_prob=True,
        init_std=float(getattr(dense_config, "initializer_range", 0.02)),
        tie_embeddings=bool(getattr(dense_config, "tie_word_embeddings", False)),
    )
    cfg.validate()
    return cfg, notes


def upcycle_state_dict(
    dense: dict[str, torch.Tensor], family: str, cfg: ModelConfig, opts: UpcycleOptions
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The MoE's weights under transformers' OLMoE names (fused experts) from a dense state dict.

    Every dense tensor must be used or knowingly dropped; anything else is an error rather than a silent loss.
    """
    import torch

    g = torch.Generator().manual_seed(opts.seed)
    left = dict(dense)
    notes: list[str] = []
    out: dict[str, torch.Tensor] = {}

    def take(name: str) -> torch.Tensor:
        if name not in left:
            raise ValueError(f"--upcycle-from: the checkpoint has no {name}")
        return left.pop(name).detach().float()

    q_width, kv_width = cfg.num_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    out["model.embed_tokens.weight"] = take("model.embed_tokens.weight")
    out["model.norm.weight"] = torch.ones(cfg.hidden_size) if family == "olmo" else take("model.norm.weight")
    if cfg.tie_embeddings:
        left.pop("lm_head.weight", None)
    else:
        out["lm_head.weight"] = take("lm_head.weight")
    dropped_bias = False
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out[f"{p}self_attn.{proj}.weight"] = take(f"{p}self_attn.{proj}.weight")
            bias = left.pop(f"{p}self_attn.{proj}.bias", None)
            dropped_bias |= bias is not None and bool(bias.abs().max() > 0)
        if family == "olmo2":
            out[f"{p}self_attn.q_norm.weight"] = take(f"{p}self_attn.q_norm.weight")
            out[f"{p}self_attn.k_norm.weight"] = take(f"{p}self_attn.k_norm.weight")
        elif family == "qwen3":
            out[f"{p}self_attn.q_norm.weight"] = take(f"{p}self_attn.q_norm.weight").repeat(cfg.num_heads)
            out[f"{p}self_attn.k_norm.weight"] = take(f"{p}self_attn.k_norm.weight").repeat(cfg.kv_heads)
        else:
            out[f"{p}self_attn.q_norm.weight"] = torch.ones(q_width)
            out[f"{p}self_attn.k_norm.weight"] = torch.ones(kv_width)
        if family in ("olmo", "olmo2"):
            out[f"{p}input_layernorm.weight"] = torch.ones(cfg.hidden_size)
            out[f"{p}post_attention_layernorm.weight"] = torch.ones(cfg.hidden_size)
            for name in ("post_attention_layernorm.weight", "post_feedforward_layernorm.weight"):
                left.pop(p + name, None)
        else:
            out[f"{p}input_layernorm.weight"] = take(f"{p}input_layernorm.weight")
            out[f"{p}post_attention_layernorm.weight"] = take(f"{p}post_attention_layernorm.weight")
        gate_up = torch.cat([take(f"{p}mlp.gate_proj.weight"), take(f"{p}mlp.up_proj.weight")])
        down = take(f"{p}mlp.down_proj.weight")
        for name in ("gate_proj.bias", "up_proj.bias", "down_proj.bias"):
            dropped_bias |= left.pop(f"{p}mlp.{name}", None) is not None
        out[f"{p}mlp.experts.gate_up_proj"] = _replicate(gate_up, opts, g)
        out[f"{p}mlp.experts.down_proj"] = _replicate(down, opts, g)
        out[f"{p}mlp.gate.weight"] = _router(opts.router, cfg, g)
    if left:
        raise ValueError(
            f"--upcycle-from: do not know where {sorted(left)[0]} goes in OLMoE ({len(left)} such tensors)"
        )
    if dropped_bias:
        notes.append("attention/MLP biases dropped (OLMoE has none)")
    if family in ("llama", "qwen2", "olmo"):
        notes.append("no q/k norms in the dense model: set to ones (queries and keys get unit RMS)")
    if family == "qwen3":
        notes.append("per-head q/k norms tiled over the heads: OLMoE normalises over all heads together")
    if family == "olmo":
        notes.append("OLMo's weightless LayerNorms become RMSNorms with unit weights")
    if family == "olmo2":
        notes.append(
            "OLMo2's norms of sublayer outputs cannot be placed in OLMoE: its input norms start as ones"
        )
    return out, notes


def _replicate(weight: torch.Tensor, opts: UpcycleOptions, g: torch.Generator) -> torch.Tensor:
    import torch

    experts = weight.unsqueeze(0).repeat(opts.num_experts, 1, 1)
    if opts.noise > 0 and opts.noise_fraction > 0:
        for expert in experts:
            mask = torch.rand(expert.shape, generator=g) < opts.noise_fraction
            expert.add_(torch.randn(expert.shape, generator=g) * opts.noise * mask)
    return experts


def _router(kind: str, cfg: ModelConfig, g: torch.Generator) -> torch.Tensor:
    import torch

    shape = (cfg.num_experts, cfg.hidden_size)
    if kind == "zero":
        return torch.zeros(shape)
    if kind == "normal":
        return torch.randn(shape, generator=g) * cfg.init_std
    weight = torch.empty(shape)
    torch.nn.init.orthogonal_(weight, gain=cfg.init_std * cfg.hidden_size**0.5, generator=g)
    return weight


def upcycle(
    dense_dir: str | Path,
    out: str | Path,
    opts: UpcycleOptions,
    base: SpesConfig | None = None,
    num_shards: int | None = None,
    tokenizer: str | None = None,
    force: bool = False,
) -> SpesConfig:
    """Upcycle the dense model in `dense_dir`; write an OLMoE checkpoint and its swarm config to `out`.

    The swarm config takes its train, swarm and data sections from `base` (default: the built-in defaults), its
    model section from the MoE, `num_shards` if given, and `tokenizer` as `data.tokenizer` (default: "bytes"
    for the embedded byte tokenizer, else the output directory, which every node must then have).
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from spes_node.config import SpesConfig
    from spes_node.errors import error_line
    from spes_node.model.hf_checkpoint import check_out_dir, save_hf_checkpoint
    from spes_node.model.hf_interop import from_hf_state_dict
    from spes_node.model.tokenizer import is_byte_tokenizer, load_tokenizer

    opts.validate()
    dense_dir, out = Path(dense_dir), Path(out)
    if not dense_dir.is_dir():
        raise ValueError(f"--upcycle-from: {dense_dir} is not a directory")
    check_out_dir(out, force)
    try:
        dense_config = AutoConfig.from_pretrained(dense_dir)
    except Exception as e:
        raise ValueError(f"--upcycle-from: cannot read the config in {dense_dir}: {error_line(e)}") from None
    model_cfg, notes = moe_config(dense_config, opts)
    if tokenizer is not None:
        hf_tokenizer = load_tokenizer(tokenizer)
    else:
        try:
            hf_tokenizer = AutoTokenizer.from_pretrained(dense_dir)
        except Exception as e:
            raise ValueError(
                f"--upcycle-from: no usable tokenizer in {dense_dir} ({error_line(e)}); pass --tokenizer"
            ) from None
        tokenizer = "bytes" if is_byte_tokenizer(hf_tokenizer) else str(out.resolve())
    data = (base or SpesConfig()).to_dict()
    data["name"] = f"upcycled-{dense_config.model_type}"
    data["model"] = asdict(model_cfg)
    data["data"]["tokenizer"] = tokenizer
    if num_shards is not None:
        data["swarm"]["num_shards"] = num_shards
    try:
        cfg = SpesConfig.from_dict(data)
    except ValueError as e:
        raise ValueError(f"{e} (see --shards, --experts and --preset/--config)") from None
    if tokenizer == str(out.resolve()):
        logger.warning(
            f"data.tokenizer is {tokenizer}: every node needs the tokenizer there; "
            "pass --tokenizer with a hub id or a path valid on all nodes"
        )

    dense_model = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32)
    hf_state, more = upcycle_state_dict(dense_model.state_dict(), dense_config.model_type, model_cfg, opts)
    del dense_model
    notes += more
    for note in notes:
        logger.warning(f"upcycling: {note}")
    weights = from_hf_state_dict(hf_state, cfg.swarm.num_shards)
    provenance = {
        "source": "upcycle",
        "dense_model": dense_dir.name,
        "dense_model_type": dense_config.model_type,
        "options": asdict(opts),
        "notes": notes,
    }
    save_hf_checkpoint(cfg, weights, out, tokenizer=hf_tokenizer, force=force, provenance=provenance)
    return cfg
