"""The swarm's model as a Hugging Face OLMoE checkpoint, and such checkpoints read back into our model.

Two sources: a node's checkpoint directory (its own shard plus the frozen copies it holds, with the swarm config
that the node writes beside its checkpoints as `config.json`), or the live swarm (shared parameters from any
serving node, each shard from one of its holders, over hivemind's P2P). The output directory holds `config.json`
(an `OlmoeConfig`), the weights as safetensors in transformers' per-expert layout (which every transformers
version that knows OLMoE loads), the tokenizer, `generation_config.json`, the swarm config (`spes-config.json`)
and where the weights came from (`spes-export.json`). It is written to a temporary sibling and renamed into place.

Heavy libraries are imported inside the functions: the CLI imports this module to register its command.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import click

from spes_node import relay

if TYPE_CHECKING:
    import torch

    from spes_node.config import ModelConfig, SpesConfig
    from spes_node.model import MoEForCausalLM
    from spes_node.records import NodeInfo

logger = logging.getLogger(__name__)

NODE_CONFIG_FILE = "config.json"
SPES_CONFIG_FILE = "spes-config.json"
PROVENANCE_FILE = "spes-export.json"
WEIGHTS_FILE = "model.safetensors"
MAX_SHARD_SIZE = "5GB"
SERVING_STATES = ("training", "averaging")
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


# ---------------------------------------------------------------------------------------------- sources


def load_checkpoint_weights(
    checkpoint_dir: str | Path, config: str | Path | None = None
) -> tuple[SpesConfig, dict[str, torch.Tensor], dict]:
    """The swarm config, the fp32 weights (our names) and provenance of a node's newest checkpoint.

    The config is `<checkpoint_dir>/config.json` unless `config` names a file; its hash must match the one in
    the checkpoint's metadata. Frozen experts stored in bf16 or int8 are dequantized as the node's forward does.
    """
    from spes_node.checkpoint import CheckpointManager
    from spes_node.config import SpesConfig, load_config
    from spes_node.model import MoEForCausalLM
    from spes_node.sharding import apply_ownership, dense_state_dict

    directory = Path(checkpoint_dir)
    if not directory.is_dir():
        raise ValueError(f"--checkpoint-dir: {directory} is not a directory")
    if config is not None:
        cfg = load_config(config)
    else:
        config_path = directory / NODE_CONFIG_FILE
        if not config_path.is_file():
            raise ValueError(
                f"--checkpoint-dir: {config_path} not found (the node writes it at startup); pass --config"
            )
        try:
            cfg = SpesConfig.from_json(config_path.read_text())
        except OSError as e:
            raise ValueError(f"cannot read {config_path}: {e.strerror or e}") from None
    checkpoint = CheckpointManager(directory).latest()
    if checkpoint is None:
        raise ValueError(f"--checkpoint-dir: no checkpoint in {directory}")
    meta = checkpoint.meta
    if meta.get("config_hash") not in (None, cfg.hash()):
        raise ValueError(
            f"--checkpoint-dir: {checkpoint.path.name} was written with config {str(meta['config_hash'])[:12]}, "
            f"but the config read has hash {cfg.hash()[:12]}"
        )
    owned = [int(s) for s in meta.get("shards", [])]
    model = MoEForCausalLM(cfg.model, cfg.swarm.num_shards)
    apply_ownership(model, owned, _frozen_dtype(checkpoint.tensors, cfg.swarm.num_shards, owned))
    expected = model.state_dict()
    wrong = [k for k, v in checkpoint.tensors.items() if k in expected and v.dtype != expected[k].dtype]
    if wrong:
        raise ValueError(f"--checkpoint-dir: {checkpoint.path.name} stores {wrong[0]} in an unexpected dtype")
    try:
        model.load_state_dict(checkpoint.tensors, strict=True)
    except RuntimeError as e:
        reason = str(e).strip().splitlines()[0]
        raise ValueError(
            f"--checkpoint-dir: {checkpoint.path.name} does not fit the config: {reason}"
        ) from None
    provenance = {
        "source": "checkpoint",
        "checkpoint": checkpoint.path.name,
        "step": checkpoint.step,
        "round": meta.get("round"),
        "peer_id": meta.get("peer_id"),
        "own_shards": owned,
    }
    return cfg, {k: v.detach().clone() for k, v in dense_state_dict(model).items()}, provenance


def _frozen_dtype(tensors: dict[str, torch.Tensor], num_shards: int, owned: list[int]) -> str:
    import torch

    names = {torch.int8: "int8", torch.bfloat16: "bf16", torch.float32: "fp32"}
    found = {
        tensors[key].dtype
        for shard in range(num_shards)
        if shard not in owned and (key := f"model.layers.0.mlp.shards.{shard}.gate_up") in tensors
    }
    if len(found) > 1 or not found <= set(names):
        raise ValueError(f"--checkpoint-dir: frozen experts are stored in {sorted(map(str, found))}")
    return names[found.pop()] if found else "fp32"


def plan_downloads(
    nodes: dict[str, NodeInfo], num_shards: int, allow_copies: bool = False
) -> dict[str, list[tuple[str, str]]]:
    """For every part of the model ("shared", "shard:<j>"), the (peer, part to request) to try, best first.

    Only nodes that serve state (training or averaging, reachable directly or through a relay) count; the most advanced come
    first. A shard comes from its holders; with `allow_copies`, a shard without a live holder comes from the
    frozen copy that every node keeps ("copy:<j>"), which is as old as that node's last refresh.
    """
    servers = sorted(
        (n for n in nodes.values() if n.state in SERVING_STATES and relay.serves_state(n)),
        key=lambda n: (-n.round, -n.step, n.peer_id),
    )
    if not servers:
        raise ValueError(
            "no live node of the swarm serves its state (all are joining, leaving or unreachable client-mode)"
        )
    plan = {"shared": [(n.peer_id, "shared") for n in servers]}
    orphans = []
    for shard in range(num_shards):
        holders = [(n.peer_id, f"shard:{shard}") for n in servers if shard in n.shards]
        if not holders:
            orphans.append(shard)
            holders = [(n.peer_id, f"copy:{shard}") for n in servers] if allow_copies else []
        plan[f"shard:{shard}"] = holders
    if orphans and not allow_copies:
        listed = ", ".join(map(str, orphans))
        raise ValueError(
            f"shard{'s' if len(orphans) > 1 else ''} {listed} of {num_shards} "
            f"{'have' if len(orphans) > 1 else 'has'} no live holder; "
            "pass --allow-copies to take the frozen copies that other nodes keep"
        )
    if orphans:
        logger.warning(f"shards {orphans} have no live holder: exporting other nodes' frozen copies")
    return plan


def fetch_swarm_weights(
    peers: list[str], run_id: str, allow_copies: bool = False, timeout: float = 60.0, swarm_key=None
) -> tuple[SpesConfig, dict[str, torch.Tensor], dict]:
    """The swarm config and the latest global weights (our names, fp32) assembled from live nodes; `swarm_key`
    (a `SwarmKey`) for a private swarm."""
    import hivemind
    import torch
    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.p2p import PeerID

    from spes_node import records
    from spes_node.aio import LoopThread
    from spes_node.config import SpesConfig
    from spes_node.model import MoEForCausalLM
    from spes_node.sharding import shard_tensors, shared_parameters
    from spes_node.transfer import TransferError, download_part

    try:
        dht = hivemind.DHT(
            initial_peers=list(peers),
            client_mode=True,
            record_validators=[RSASignatureValidator()],
            authorizer=swarm_key.authorizer() if swarm_key else None,
            start=True,
            startup_timeout=timeout,
        )
    except Exception as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"--peers: cannot reach the DHT ({', '.join(peers)}): {reason}") from None
    loop, p2p = LoopThread("spes-export"), None
    try:
        record = records.fetch_config(dht, run_id)
        if record is None:
            raise ValueError(f"--run-id: no swarm '{run_id}' found at the given peers")
        cfg = SpesConfig.from_json(record.config_json)
        nodes = records.fetch_nodes(dht, run_id, cfg.swarm.num_shards)
        plan = plan_downloads(nodes, cfg.swarm.num_shards, allow_copies)
        with torch.device("meta"):
            skeleton = MoEForCausalLM(cfg.model, cfg.swarm.num_shards)
        expected = {"shared": {k: v.shape for k, v in shared_parameters(skeleton).items()}}
        for shard in range(cfg.swarm.num_shards):
            expected[f"shard:{shard}"] = {k: v.shape for k, v in shard_tensors(skeleton, shard).items()}
        p2p = loop.run(dht.replicate_p2p())
        weights: dict[str, torch.Tensor] = {}
        sources = {}
        for part, candidates in plan.items():
            errors = []
            for peer, request in candidates:
                try:
                    got = loop.run(
                        download_part(
                            p2p, PeerID.from_base58(peer), run_id, record.config_hash, request, expected[part],
                            timeout=timeout, circuits=relay.circuits_of(peer, nodes[peer].maddrs),
                            swarm_key=swarm_key,
                        )
                    )  # fmt: skip
                except TransferError as e:
                    logger.warning(f"{request} from {peer} failed: {e}")
                    errors.append(str(e))
                    continue
                weights.update(got.tensors)
                sources[part] = {"peer_id": peer, "part": request, "round": got.round}
                break
            else:
                raise ValueError(
                    f"could not download {part} from any of its {len(candidates)} live holders"
                    + (f" (last error: {errors[-1]})" if errors else "")
                )
    finally:
        if p2p is not None:
            try:
                loop.run(p2p.shutdown(), timeout=5)
            except Exception as e:
                logger.debug(f"p2p shutdown: {e}")
        loop.stop()
        dht.shutdown()
    rounds = sorted({s["round"] for s in sources.values()})
    if len(rounds) > 1:
        logger.warning(f"the parts come from different rounds {rounds}: the swarm is between syncs")
    provenance = {"source": "swarm", "run_id": run_id, "config_hash": record.config_hash, "parts": sources}
    return cfg, weights, provenance


# ---------------------------------------------------------------------------------------------- writing


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
    from spes_node.tokenizer import load_tokenizer

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
        _install(tmp, out)
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


def _install(tmp: Path, out: Path) -> None:
    retired = None
    if out.exists():
        retired = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:12]}"
        os.replace(out, retired)
    os.replace(tmp, out)
    if retired is not None:
        shutil.rmtree(retired, ignore_errors=True)


def _write_hf_files(cfg: SpesConfig, weights: dict[str, torch.Tensor], tokenizer, directory: Path) -> None:
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    from spes_node.hf_interop import to_hf_config

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
    from spes_node.hf_interop import to_hf_state_dict

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


# ---------------------------------------------------------------------------------------------- reading


def load_hf_weights(model: MoEForCausalLM, hf_dir: str | Path) -> None:
    """Load a Hugging Face OLMoE checkpoint directory (an export or `spes-node init`) into our model.

    The checkpoint's architecture must be the model's; the model's ownership (which shards are frozen, and how)
    is kept.
    """
    import torch
    from transformers import AutoConfig, OlmoeForCausalLM

    from spes_node.hf_interop import from_hf_config, from_hf_state_dict
    from spes_node.sharding import load_dense_state_dict

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


def error_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


# ---------------------------------------------------------------------------------------------- command


def export_command() -> click.Command:
    """The `spes-node export` command (built on call, so that cli.py can register it without an import cycle)."""
    from spes_node.cli import option, user_errors

    @click.command("export")
    @option("--checkpoint-dir", type=click.Path(file_okay=False), help="A node's checkpoint directory.")
    @option("--config", type=click.Path(dir_okay=False), help="Swarm config, if the checkpoint dir has none.")
    @option(
        "--peers", multiple=True, help="Multiaddr of a swarm peer (repeat): export the live swarm's model."
    )
    @option("--run-id", default="spes", show_default=True, help="Name of the swarm (with --peers).")
    @option(
        "--allow-copies", is_flag=True, help="With --peers: take frozen copies of shards without a holder."
    )
    @option(
        "--timeout",
        default=60.0,
        show_default=True,
        type=click.FloatRange(min=1),
        help="Seconds per download.",
    )
    @option("--out", required=True, type=click.Path(file_okay=False), help="Output directory.")
    @option("--force", is_flag=True, help="Replace a non-empty --out.")
    @option("--swarm-key", help="With --peers: a private swarm's key (prefer --swarm-key-file).")
    @option(
        "--swarm-key-file", type=click.Path(dir_okay=False), help="With --peers: file with the swarm's key."
    )
    @user_errors
    def export(
        checkpoint_dir, config, peers, run_id, allow_copies, timeout, out, force, swarm_key, swarm_key_file
    ) -> None:
        """Write the model as a Hugging Face OLMoE checkpoint (from a checkpoint dir or from live peers)."""
        from spes_node.logs import setup_logging

        setup_logging("WARNING")
        if bool(checkpoint_dir) == bool(peers):
            raise ValueError("pass either --checkpoint-dir or --peers")
        if config and not checkpoint_dir:
            raise ValueError("--config: only used with --checkpoint-dir (a swarm publishes its own config)")
        check_out_dir(Path(out), force)
        if checkpoint_dir:
            cfg, weights, provenance = load_checkpoint_weights(checkpoint_dir, config)
        else:
            from spes_node.swarm_key import load_swarm_key

            key = load_swarm_key(swarm_key, swarm_key_file)
            cfg, weights, provenance = fetch_swarm_weights(list(peers), run_id, allow_copies, timeout, key)
        save_hf_checkpoint(cfg, weights, out, force=force, provenance=provenance)
        click.echo(
            f"exported {cfg.name} ({sum(t.numel() for t in weights.values()) / 1e6:.1f}M parameters) to {out}"
        )

    return export
