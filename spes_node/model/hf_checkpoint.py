"""A Hugging Face OLMoE checkpoint of our model: written atomically (config, tokenizer, safetensors, provenance)
and read back into a model of any ownership."""

from __future__ import annotations

import json
import logging
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from spes_node.errors import error_line
from spes_node.files import replace_dir

if TYPE_CHECKING:
    import torch

    from spes_node.config import ModelConfig, SpesConfig
    from spes_node.model.moe import MoEForCausalLM

logger = logging.getLogger(__name__)

ARCHITECTURE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_layers",
    "num_heads",
    "kv_heads",
    "num_experts",
    "top_k",
    "expert_ffn",
    "rope_theta",
    "rms_norm_eps",
    "norm_topk_prob",
    "tie_embeddings",
)
"""Fields of the model config that a loaded checkpoint must match."""

SPES_CONFIG_FILE = "spes-config.json"

PROVENANCE_FILE = "spes-export.json"

WEIGHTS_FILE = "model.safetensors"

MAX_SHARD_SIZE = "5GB"


def save_hf_checkpoint(
    cfg: SpesConfig,
    weights: dict[str, torch.Tensor],
    out: str | Path,
    *,
    tokenizer=None,
    force: bool = False,
    provenance: dict | None = None,
) -> Path:
    """Write `weights` (our names, fp32) as a Hugging Face OLMoE checkpoint directory, atomically.

    `tokenizer` defaults to the config's (`cfg.data.tokenizer`). An existing non-empty `out` is refused unless
    `force`, then replaced as a whole.
    """
    from spes_node.model.tokenizer import load_tokenizer

    out = Path(out)
    check_out_dir(out, force)
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg.data.tokenizer)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:12]}"
    try:
        tmp.mkdir()
        _write_hf_files(cfg, weights, tokenizer, tmp)
        (tmp / SPES_CONFIG_FILE).write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
        if provenance is not None:
            document = {**provenance, "config_hash": cfg.hash()}
            (tmp / PROVENANCE_FILE).write_text(json.dumps(document, indent=2) + "\n")
        replace_dir(tmp, out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ValueError(f"--out: cannot write {out}: {e.strerror or e}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info(f"wrote a Hugging Face OLMoE checkpoint to {out}")
    return out


def check_out_dir(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out: {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ValueError(f"--out: {out} exists and is not empty (pass --force to replace it)")


def _write_hf_files(cfg: SpesConfig, weights: dict[str, torch.Tensor], tokenizer, directory: Path) -> None:
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    from spes_node.model.hf_interop import to_hf_config

    hf_config = to_hf_config(
        cfg.model,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        architectures=["OlmoeForCausalLM"],
    )
    hf_config.save_pretrained(directory)
    GenerationConfig.from_model_config(hf_config).save_pretrained(directory)
    tensors = per_expert_state_dict(weights, cfg.model)
    split = split_torch_state_dict_into_shards(
        tensors, max_shard_size=MAX_SHARD_SIZE, filename_pattern="model{suffix}.safetensors"
    )
    for filename, names in split.filename_to_tensors.items():
        save_file({name: tensors[name] for name in names}, directory / filename, metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())}}
        index["weight_map"] = split.tensor_to_filename
        (directory / f"{WEIGHTS_FILE}.index.json").write_text(json.dumps(index, indent=2) + "\n")
    tokenizer.model_max_length = cfg.model.max_seq_len
    tokenizer.save_pretrained(directory)


def per_expert_state_dict(weights: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """transformers' OLMoE names, one gate/up/down matrix per expert, contiguous fp32 tensors."""
    from spes_node.model.hf_interop import to_hf_state_dict

    out = {}
    for name, tensor in to_hf_state_dict(weights).items():
        tensor = tensor.detach().float().cpu()
        if name.endswith(".mlp.experts.gate_up_proj"):
            prefix = name.removesuffix("gate_up_proj")
            for expert in range(tensor.shape[0]):
                out[f"{prefix}{expert}.gate_proj.weight"] = tensor[expert, : cfg.expert_ffn].clone()
                out[f"{prefix}{expert}.up_proj.weight"] = tensor[expert, cfg.expert_ffn :].clone()
        elif name.endswith(".mlp.experts.down_proj"):
            prefix = name.removesuffix("down_proj")
            for expert in range(tensor.shape[0]):
                out[f"{prefix}{expert}.down_proj.weight"] = tensor[expert].clone()
        else:
            out[name] = tensor.contiguous()
    if cfg.tie_embeddings:
        out.pop("lm_head.weight", None)
    return out


def load_hf_weights(model: MoEForCausalLM, hf_dir: str | Path) -> None:
    """Load a Hugging Face OLMoE checkpoint directory (an export or `spes-node init`) into our model.

    The checkpoint's architecture must be the model's; the model's ownership (which shards are frozen, and how)
    is kept.
    """
    import torch
    from transformers import AutoConfig, OlmoeForCausalLM

    from spes_node.model.hf_interop import from_hf_config, from_hf_state_dict
    from spes_node.model.ownership import load_dense_state_dict

    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise ValueError(f"init weights: {hf_dir} is not a directory")
    try:
        hf_config = AutoConfig.from_pretrained(hf_dir)
    except Exception as e:
        raise ValueError(f"init weights: cannot read {hf_dir / 'config.json'}: {error_line(e)}") from None
    if hf_config.model_type != "olmoe":
        raise ValueError(f"init weights: {hf_dir} holds a '{hf_config.model_type}' model, not OLMoE")
    theirs = from_hf_config(hf_config)
    for name in ARCHITECTURE_FIELDS:
        if getattr(theirs, name) != getattr(model.cfg, name):
            raise ValueError(
                f"model.{name}: the config says {getattr(model.cfg, name)!r} but {hf_dir} has {getattr(theirs, name)!r}"
            )
    hf_model = OlmoeForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    state = from_hf_state_dict(hf_model.state_dict(), model.num_shards)
    if model.cfg.tie_embeddings:
        state.pop("lm_head.weight", None)
    load_dense_state_dict(model, state)
    logger.info(f"loaded initial weights from {hf_dir}")
