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
    from collections.abc import Mapping

    import torch

    from spes_node.config import ModelConfig, SpesConfig
    from spes_node.model.moe import MoEForCausalLM
    from spes_node.tensor_file import TensorFile

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
    """Load a Hugging Face OLMoE checkpoint directory (an export, `spes-node init`, or transformers' own) into our
    model, one tensor at a time.

    The checkpoint's architecture must be the model's; the model's ownership (which shards are frozen, and how)
    is kept. The weights are read from its safetensors files (`model.safetensors`, or the files its index names)
    as they are needed, and each shard of a layer is put together and loaded alone: the host holds one layer's
    shard in fp32 and its stored form (a layer's experts, when the file stores them fused), not the model. transformers'
    `from_pretrained` built the whole model in fp32 first (25.8 GiB at spes-7b). Pickled weights are not read.
    """
    from transformers import AutoConfig

    from spes_node.model.hf_interop import from_hf_config

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
    try:
        _load_tensors(model, _weight_files(hf_dir))
    except ValueError as e:
        raise ValueError(f"init weights: {hf_dir}: {error_line(e)}") from None
    logger.info(f"loaded initial weights from {hf_dir}")


def _weight_files(hf_dir: Path) -> dict[str, TensorFile]:
    """Each tensor's name in the checkpoint -> its safetensors file, opened to read one tensor at a time."""
    from spes_node.tensor_file import TensorFile

    index = hf_dir / f"{WEIGHTS_FILE}.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{index.name} does not read as an index: {error_line(e)}") from None
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and Path(v).name == v for k, v in weight_map.items()
        ):
            raise ValueError(f"{index.name}: its weight_map is not a map of names to files in the directory")
        files = {name: TensorFile(hf_dir / name) for name in set(weight_map.values())}
        missing = [name for name, file in weight_map.items() if name not in files[file]]
        if missing:
            raise ValueError(f"{weight_map[missing[0]]} lacks {missing[0]}, which the index places there")
        return {name: files[file] for name, file in weight_map.items()}
    if (hf_dir / WEIGHTS_FILE).is_file():
        single = TensorFile(hf_dir / WEIGHTS_FILE)
        return dict.fromkeys(single, single)
    raise ValueError(f"no {WEIGHTS_FILE} nor its index (pickled weights are not read)")


def _load_tensors(model: MoEForCausalLM, files: Mapping[str, TensorFile]) -> None:
    """Every weight of `model` from the checkpoint's tensors (transformers' names; experts one matrix per expert
    or fused per layer), in fp32; every tensor of the checkpoint must be used."""
    import torch

    from spes_node.model.ownership import shared_parameters

    cfg, used = model.cfg, set()

    def read(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in files:
            raise ValueError(f"it lacks {name}")
        if tuple(files[name].shape(name)) != tuple(shape):
            raise ValueError(f"{name} is {list(files[name].shape(name))}, the model's {list(shape)}")
        used.add(name)
        return files[name][name].float()

    with torch.no_grad():
        for name, p in shared_parameters(model).items():
            p.copy_(read(name, p.shape))
        ffn, d, per = cfg.expert_ffn, cfg.hidden_size, cfg.num_experts // model.num_shards
        for layer_index, layer in enumerate(model.model.layers):
            prefix = f"model.layers.{layer_index}.mlp.experts."
            if f"{prefix}gate_up_proj" in files:  # fused: [experts, 2 ffn, d] and [experts, d, ffn]
                gate_up = read(f"{prefix}gate_up_proj", (cfg.num_experts, 2 * ffn, d))
                down = read(f"{prefix}down_proj", (cfg.num_experts, d, ffn))
                for s, shard in enumerate(layer.mlp.shards):
                    shard.load_dense(gate_up[s * per : (s + 1) * per], down[s * per : (s + 1) * per])
                del gate_up, down
                continue
            for s, shard in enumerate(layer.mlp.shards):
                gate_up, down = torch.empty(per, 2 * ffn, d), torch.empty(per, d, ffn)
                for local, e in enumerate(range(s * per, (s + 1) * per)):
                    gate_up[local, :ffn] = read(f"{prefix}{e}.gate_proj.weight", (ffn, d))
                    gate_up[local, ffn:] = read(f"{prefix}{e}.up_proj.weight", (ffn, d))
                    down[local] = read(f"{prefix}{e}.down_proj.weight", (d, ffn))
                shard.load_dense(gate_up, down)
                del gate_up, down
    # the tied head is the embedding; older transformers saved rotary frequencies, which are recomputed
    ignored = {"lm_head.weight"} if cfg.tie_embeddings else set()
    unused = sorted(n for n in set(files) - used - ignored if not n.endswith("rotary_emb.inv_freq"))
    if unused:
        raise ValueError(f"it holds {unused[0]}, which the model has no place for")
