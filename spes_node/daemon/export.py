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

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from spes_node.swarm import relay
from spes_node.swarm.progress import rank_holders
from spes_node.swarm.records import ACTIVE_STATES

if TYPE_CHECKING:
    import torch

    from spes_node.config import SpesConfig
    from spes_node.swarm.records import NodeInfo
    from spes_node.tensor_file import TensorFile

logger = logging.getLogger(__name__)

NODE_CONFIG_FILE = "config.json"


# ---------------------------------------------------------------------------------------------- sources


def load_checkpoint_weights(
    checkpoint_dir: str | Path, config: str | Path | None = None
) -> tuple[SpesConfig, dict[str, torch.Tensor], dict]:
    """The swarm config, the fp32 weights (our names) and provenance of a node's newest checkpoint.

    The config is `<checkpoint_dir>/config.json` unless `config` names a file; its hash must match the one in
    the checkpoint's metadata. Frozen experts stored in bf16 or int8 are dequantized as the node's forward does.
    """
    from spes_node.config import SpesConfig, load_config
    from spes_node.daemon.checkpoint import CheckpointManager
    from spes_node.model.moe import MoEForCausalLM
    from spes_node.model.ownership import apply_ownership, dense_state_dict, load_state_in_place

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
    tensors = checkpoint.tensors
    wrong = [k for k in tensors if k in expected and tensors.dtype(k) != expected[k].dtype]
    if wrong:
        raise ValueError(f"--checkpoint-dir: {checkpoint.path.name} stores {wrong[0]} in an unexpected dtype")
    try:
        missing, unexpected = load_state_in_place(model, tensors)
        if missing or unexpected:
            raise ValueError(f"{'missing' if missing else 'unexpected'} {(missing or unexpected)[0]}")
    except ValueError as e:
        raise ValueError(f"--checkpoint-dir: {checkpoint.path.name} does not fit the config: {e}") from None
    provenance = {
        "source": "checkpoint",
        "checkpoint": checkpoint.path.name,
        "step": checkpoint.step,
        "round": meta.get("round"),
        "peer_id": meta.get("peer_id"),
        "own_shards": owned,
    }
    return cfg, {k: v.detach().clone() for k, v in dense_state_dict(model).items()}, provenance


def _frozen_dtype(tensors: TensorFile, num_shards: int, owned: list[int]) -> str:
    import torch

    names = {torch.int8: "int8", torch.bfloat16: "bf16", torch.float32: "fp32"}
    found = {
        tensors.dtype(key)
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

    Only nodes that serve state (training or averaging, reachable directly or through a relay) count, and of those
    only the ones a node would ask (`progress.rank_holders`: a record claiming a round far ahead of the others'
    is left out); the most advanced come first. A shard comes from its holders; with `allow_copies`, a shard
    without a live holder comes from the frozen copy that every node keeps ("copy:<j>"), which is as old as that
    node's last refresh.
    """
    servable = {peer: n for peer, n in nodes.items() if relay.serves_state(n)}

    def ranked(shard: int | None) -> list[str]:
        peers = rank_holders(servable, shard=shard, me="", active_states=ACTIVE_STATES)
        return sorted(peers, key=lambda peer: (-servable[peer].round, -servable[peer].step, peer))

    servers = ranked(None)
    if not servers:
        raise ValueError(
            "no live node of the swarm serves its state (all are joining, leaving or unreachable client-mode)"
        )
    plan = {"shared": [(peer, "shared") for peer in servers]}
    orphans = []
    for shard in range(num_shards):
        holders = [(peer, f"shard:{shard}") for peer in ranked(shard)]
        if not holders:
            orphans.append(shard)
            holders = [(peer, f"copy:{shard}") for peer in servers] if allow_copies else []
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
    import torch

    from spes_node.aio import LoopThread
    from spes_node.config import SpesConfig
    from spes_node.model.moe import MoEForCausalLM
    from spes_node.model.ownership import shard_tensors, shared_parameters
    from spes_node.swarm import records
    from spes_node.swarm.client import open_client_dht
    from spes_node.swarm.fetch import StateFetcher
    from spes_node.swarm.transfer import TransferError

    dht = open_client_dht(peers, timeout, swarm_key)
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
        fetcher = StateFetcher(p2p, run_id, record.config_hash, timeout=timeout, swarm_key=swarm_key)
        fetcher.learn_circuits(nodes)
        weights: dict[str, torch.Tensor] = {}
        sources = {}
        for part, candidates in plan.items():
            request = candidates[0][1]
            try:
                peer, got = loop.run(fetcher.fetch([peer for peer, _ in candidates], request, expected[part]))
            except TransferError as e:
                raise ValueError(
                    f"could not download {part} from any of its {len(candidates)} live holders (last error: {e})"
                ) from None
            weights.update({name: t.float() for name, t in got.tensors.items()})
            sources[part] = {"peer_id": peer, "part": request, "round": got.round}
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


# ---------------------------------------------------------------------------------------------- reading


# ---------------------------------------------------------------------------------------------- command
