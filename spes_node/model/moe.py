"""The OLMoE architecture with the experts of each layer stored as shards.

Pure model code: no networking. Numerically it is transformers' `OlmoeForCausalLM` (RMSNorm, QK-norm over the
full projection, rotary, softmax top-k router, SwiGLU experts, no shared expert); `hf_interop` converts state dicts.
The experts of a layer live in `num_shards` `ExpertShard` modules. A shard is either trainable (fp32 parameters)
or frozen (buffers in fp32, bf16 or int8 with per-row scales): which is decided outside the model
(`spes_node.model.ownership`) and applied with `ExpertShard.set_trainable`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from spes_node.config import ModelConfig

EXPERT_KEY = ".mlp.shards."


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotary_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.num_heads * cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.kv_heads * cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.q_norm(self.q_proj(x)).view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_norm(self.k_proj(x)).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.num_heads
        )
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class ExpertShard(nn.Module):
    """Experts `start .. start + n - 1` of one layer, in transformers' fused layout.

    `gate_up` is [n, 2 * ffn, d] (gate rows first, then up rows) and `down` is [n, d, ffn]. Trainable: fp32
    parameters. Frozen: buffers without gradient, in fp32, bf16 or int8 (symmetric, one scale per output row).
    """

    def __init__(self, cfg: ModelConfig, start: int, n: int):
        super().__init__()
        self.start, self.n, self.ffn, self.hidden = start, n, cfg.expert_ffn, cfg.hidden_size
        self.frozen_dtype: str | None = None
        self.gate_up = nn.Parameter(torch.empty(n, 2 * cfg.expert_ffn, cfg.hidden_size))
        self.down = nn.Parameter(torch.empty(n, cfg.hidden_size, cfg.expert_ffn))

    @property
    def trainable(self) -> bool:
        return self.frozen_dtype is None

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Both weights as fp32 tensors (views of the parameters when trainable)."""
        if self.trainable:
            return self.gate_up.data, self.down.data
        return self._dequantize("gate_up"), self._dequantize("down")

    @torch.no_grad()
    def load_dense(self, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        """Overwrite the weights from fp32 values, re-quantizing when frozen."""
        if self.trainable:
            self.gate_up.copy_(gate_up)
            self.down.copy_(down)
        else:
            self._store_frozen("gate_up", gate_up)
            self._store_frozen("down", down)

    def set_trainable(self, trainable: bool, frozen_dtype: str = "fp32") -> None:
        gate_up, down = (t.detach().clone() for t in self.dense())
        for name in ("gate_up", "down", "gate_up_scale", "down_scale"):
            if hasattr(self, name):
                delattr(self, name)
        if trainable:
            self.frozen_dtype = None
            self.gate_up = nn.Parameter(gate_up)
            self.down = nn.Parameter(down)
        else:
            self.frozen_dtype = frozen_dtype
            self._store_frozen("gate_up", gate_up)
            self._store_frozen("down", down)

    def linear(self, x: torch.Tensor, name: str, local: int) -> torch.Tensor:
        """`x @ W.T` for weight `name` ("gate_up" or "down") of local expert `local`.

        A frozen weight goes through `_FrozenLinear`, which keeps only the stored low-precision expert for
        backward: a cast (bf16 to fp32) or dequantized (int8) copy would otherwise be saved by autograd for
        every expert a batch routes to, which on a node with S shards is most of the model in fp32 again.
        """
        weight = getattr(self, name)[local]
        if self.trainable:
            return F.linear(x, weight.to(x.dtype))
        scale = getattr(self, f"{name}_scale")[local] if self.frozen_dtype == "int8" else None
        return _FrozenLinear.apply(x, weight, scale)

    @torch.no_grad()
    def fill(self, name: str, value: torch.Tensor) -> None:
        """Write fp32 `value` into weight `name` ("gate_up" or "down") in place, in the shard's storage form.

        For a model being made (`spes_node.model.initial`): a frozen weight's buffers are overwritten where they
        are, so a frozen copy that something still reads (a served snapshot) would change under it."""
        if self.trainable:
            getattr(self, name).copy_(value)
            return
        for target, stored in zip(self.stored(name), stored_form(value, self.frozen_dtype), strict=True):
            target.copy_(stored)

    def _store_frozen(self, name: str, value: torch.Tensor) -> None:
        stored = stored_form(value, self.frozen_dtype)
        self._set_buffer(name, stored[0])
        if len(stored) > 1:
            self._set_buffer(f"{name}_scale", stored[1])

    def _set_buffer(self, name: str, value: torch.Tensor) -> None:
        if name in self._buffers:
            self._buffers[name] = value.to(self._buffers[name].device)
        else:
            self.register_buffer(name, value)

    def stored(self, name: str) -> list[torch.Tensor]:
        """A frozen weight's buffers as `read_stored` takes them: the weight, and its per-row scale when int8."""
        if self.trainable:
            raise ValueError("a trainable shard's weights change in place: they are served as copies")
        scale = [getattr(self, f"{name}_scale")] if self.frozen_dtype == "int8" else []
        return [getattr(self, name), *scale]

    def _dequantize(self, name: str) -> torch.Tensor:
        value = getattr(self, name)
        if self.frozen_dtype == "int8":
            return value.float() * getattr(self, f"{name}_scale")
        return value.float()


class _FrozenLinear(torch.autograd.Function):
    """`x @ dense(W).T` for a frozen weight W (fp32, bf16, or int8 with per-row `scale`) that needs no gradient.

    Saves W as stored and rebuilds the dense weight in backward for the input's gradient, so activation memory
    holds no full-precision copy of frozen experts.
    """

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(weight, scale)
        ctx.x_dtype = x.dtype
        return F.linear(x, _dense(weight, scale, x.dtype))

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, grad: torch.Tensor):
        weight, scale = ctx.saved_tensors
        return (grad @ _dense(weight, scale, grad.dtype)).to(ctx.x_dtype), None, None


def stored_form(value: torch.Tensor, frozen_dtype: str) -> list[torch.Tensor]:
    """A weight's values as a frozen shard stores them: in fp32 or bf16, or int8 with its per-row fp32 scale
    (symmetric, one scale per output row)."""
    value = value.detach().float()
    if frozen_dtype == "int8":
        scale = value.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / 127.0
        quantized = (value / scale).round_().clamp_(-127, 127)  # one temporary beside the value
        return [quantized.to(torch.int8), scale]
    return [value.to(torch.bfloat16 if frozen_dtype == "bf16" else torch.float32)]


def read_stored(
    weight: torch.Tensor, scale: torch.Tensor | None = None, *, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """A frozen weight as stored (`ExpertShard.stored`) as a dense CPU tensor of `dtype`, with the values
    `ExpertShard.dense` gives (int8 dequantized in fp32, then rounded once to `dtype`). It may be the buffer itself
    when that is already a CPU tensor of `dtype`."""
    weight = weight.to("cpu")
    if scale is None:
        return weight.to(dtype)
    return (weight.float() * scale.to("cpu")).to(dtype)


def _dense(weight: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    dense = weight.to(dtype)
    return dense * scale.to(dtype) if scale is not None else dense


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, num_shards: int):
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = cfg.num_experts, cfg.top_k, cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        per_shard = cfg.num_experts // num_shards
        self.shards = nn.ModuleList(ExpertShard(cfg, s * per_shard, per_shard) for s in range(num_shards))
        self.per_shard = per_shard

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        router_logits = self.gate(x)
        probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)
        top_w, top_i = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        top_w = top_w.to(x.dtype)
        out = torch.zeros_like(x)
        with torch.no_grad():
            hits = torch.bincount(top_i.flatten(), minlength=self.num_experts).tolist()
        for expert, count in enumerate(hits):
            if count == 0:
                continue
            shard = self.shards[expert // self.per_shard]
            local = expert - shard.start
            token_idx, slot = torch.where(top_i == expert)
            h = x[token_idx]
            g, u = shard.linear(h, "gate_up", local).chunk(2, dim=-1)
            y = shard.linear(F.silu(g) * u, "down", local) * top_w[token_idx, slot, None]
            out.index_add_(0, token_idx, y.to(out.dtype))
        return out.reshape(shape), router_logits


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, num_shards: int):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = SparseMoE(cfg, num_shards)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        moe_out, router_logits = self.mlp(self.post_attention_layernorm(x))
        return x + moe_out, router_logits


class Embedding(nn.Embedding):
    """`nn.Embedding` without a draw of its own: `MoEForCausalLM.reset_parameters` draws every weight. torch's
    draw was wasted work, and on the meta device (where `initial_model` builds) its `normal_` imports
    torch._dynamo: 1.2 s of every process that built a model."""

    def reset_parameters(self) -> None:
        pass


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, num_shards: int):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, num_shards) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


@dataclass
class ModelOutput:
    logits: torch.Tensor
    loss: torch.Tensor | None = None
    ce_loss: torch.Tensor | None = None
    z_loss: torch.Tensor | None = None
    lb_loss: torch.Tensor | None = None


class MoEForCausalLM(nn.Module):
    """Decoder-only OLMoE language model whose experts are grouped into `num_shards` shards per layer."""

    def __init__(self, cfg: ModelConfig, num_shards: int = 1, seed: int | None = None):
        super().__init__()
        if cfg.num_experts % num_shards:
            raise ValueError(f"num_shards: {num_shards} does not divide num_experts {cfg.num_experts}")
        self.cfg, self.num_shards = cfg, num_shards
        self.activation_checkpointing = False
        """Recompute decoder layers in backward (`TrainConfig.activation_checkpointing`; the trainer sets it)."""
        self.model = Backbone(cfg, num_shards)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.reset_parameters(None if seed is None else torch.Generator().manual_seed(seed))

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Every parameter's `initial_value`, in `named_parameters` order, drawn from `generator` (default: torch's
        global generator, as left by the modules' own initialisation). With `seed` given to the constructor, these
        are the weights `spes_node.model.initial.initial_model` makes for that seed. Nothing is drawn on the meta
        device."""
        for name, p in self.named_parameters():
            if not p.is_meta:
                p.copy_(initial_value(self.cfg, name, p.shape, generator))

    def expert_shards(self, shard: int) -> list[ExpertShard]:
        """Shard `shard` of every layer, in layer order."""
        return [layer.mlp.shards[shard] for layer in self.model.layers]

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> ModelOutput:
        seq = input_ids.shape[1]
        x = self.model.embed_tokens(input_ids)
        positions = torch.arange(seq, device=input_ids.device)
        cos, sin = rotary_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, x.dtype)
        router_logits = []
        for layer in self.model.layers:
            if self.activation_checkpointing and torch.is_grad_enabled():
                x, logits = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, use_reentrant=False)
            else:
                x, logits = layer(x, cos, sin)
            router_logits.append(logits)
        logits = self.lm_head(self.model.norm(x))
        if labels is None:
            return ModelOutput(logits=logits)
        ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))
        z = torch.stack([torch.logsumexp(r.float(), dim=-1).pow(2).mean() for r in router_logits]).mean()
        lb = torch.stack([self._load_balance(r) for r in router_logits]).mean()
        loss = ce + self.cfg.z_loss * z + self.cfg.lb_loss * lb
        return ModelOutput(logits=logits, loss=loss, ce_loss=ce, z_loss=z, lb_loss=lb)

    def _load_balance(self, router_logits: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(router_logits.float(), dim=-1)
        top_i = torch.topk(probs, self.cfg.top_k, dim=-1).indices
        counts = torch.zeros_like(probs[0]).scatter_add_(
            0, top_i.flatten(), torch.ones_like(top_i.flatten(), dtype=probs.dtype)
        )
        fraction = counts / top_i.shape[0]
        return self.cfg.num_experts * (fraction * probs.mean(dim=0)).sum()


def initial_value(
    cfg: ModelConfig, name: str, shape: torch.Size, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Parameter `name`'s initial fp32 value on the CPU: ones for a norm's weight, else N(0, `init_std`) drawn from
    `generator`. Drawn on the CPU whatever the training device, so that every node of a seed starts the same."""
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    return torch.empty(shape).normal_(0.0, cfg.init_std, generator=generator)


def is_expert_name(name: str) -> bool:
    return EXPERT_KEY in name


def num_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def analytic_param_count(cfg: ModelConfig) -> dict[str, int]:
    """Parameter counts by kind, from the config alone."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    attention = cfg.hidden_size * (2 * q + 2 * kv) + q + kv
    per_layer = attention + cfg.num_experts * cfg.hidden_size + 2 * cfg.hidden_size
    embeddings = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_embeddings else 2)
    shared = cfg.num_layers * per_layer + embeddings + cfg.hidden_size
    experts = cfg.num_layers * cfg.num_experts * 3 * cfg.hidden_size * cfg.expert_ffn
    return {"shared": shared, "experts": experts, "total": shared + experts}
