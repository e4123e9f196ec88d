"""val_loss_ratio_vs_centralized: validation loss at equal total tokens, swarms versus one process with the whole batch.

Runs (tiny preset, every swarm 4 nodes started together, the same steps per node, data parts pinned so that node i
reads part i of 4 in every run):
- spes: SPES with S=2 shards, 2 replicas per shard (the headline);
- spes_r1: SPES with S=4, 1 replica per shard;
- spes_no_merge: as spes with the expert-merging warm-up off (merge_alpha0 = 0);
- diloco: the DiLoCo stand-in (S=1: every node trains and averages the whole model);
- centralized: one process, one model, each step on the 4 nodes' batches concatenated (the same token streams),
  for the same number of steps: the same total tokens.
A swarm's model is assembled from its nodes' final checkpoints the way the swarm defines it: shared parameters
averaged over the nodes, each shard averaged over its holders. Every model is evaluated on the same held-out
batches (mean cross-entropy). The mean loss of each node's own final weights (its frozen copies included) is
reported too. Training-loss curves against total tokens go to `results/loss_curves.png`.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

import torch

from benchmarks.common import RESULTS_DIR, LoadMonitor, emit, table, write_result
from benchmarks.swarm import BenchSwarm, NodeRun
from spes_node.config import SpesConfig, load_preset

logger = logging.getLogger(__name__)

SETTINGS = {
    "preset": "tiny",
    "num_nodes": 4,
    "steps": 200,
    "sync_steps": 20,
    "matchmaking_time": 2.0,
    "heartbeat_s": 1.0,
    "val_batches": 16,
    "runs": ["spes", "spes_r1", "spes_no_merge", "diloco"],
    "timeout_s": 1500,
}
RUN_SWARM = {
    "spes": {"num_shards": 2, "replication_target": 2},
    "spes_r1": {"num_shards": 4, "replication_target": 1},
    "spes_no_merge": {"num_shards": 2, "replication_target": 2, "merge_alpha0": 0.0},
    "diloco": {"num_shards": 1, "replication_target": 4},
}


def base_config(settings: dict) -> SpesConfig:
    return load_preset(settings["preset"]).replace(
        train={"total_steps": settings["steps"]},
        swarm={
            "sync_steps": settings["sync_steps"],
            "matchmaking_time": settings["matchmaking_time"],
            "heartbeat_s": settings["heartbeat_s"],
        },
    )


def run_config(settings: dict, name: str) -> SpesConfig:
    return base_config(settings).replace(swarm=RUN_SWARM[name])


def validation_set(cfg: SpesConfig, batches: int) -> list[torch.Tensor]:
    from spes_node.daemon.data import validation_batches
    from spes_node.model.tokenizer import load_tokenizer

    return validation_batches(
        cfg.data.source,
        load_tokenizer(cfg.data.tokenizer),
        cfg.train.seq_len,
        cfg.train.micro_batch_size,
        batches,
        val_fraction=cfg.data.val_fraction,
    )


@torch.no_grad()
def val_loss(model, batches: list[torch.Tensor]) -> float:
    """Token-weighted mean cross-entropy over the batches."""
    model.eval()
    total, tokens = 0.0, 0
    for batch in batches:
        out = model(batch[:, :-1], labels=batch[:, 1:])
        n = batch[:, 1:].numel()
        total += out.ce_loss.item() * n
        tokens += n
    return total / tokens


def swarm_model(cfg: SpesConfig, nodes: list[NodeRun]):
    """The swarm's model from its nodes' checkpoints: shared mean over nodes, each shard mean over its holders."""
    from spes_node.daemon.export import load_checkpoint_weights
    from spes_node.model.moe import MoEForCausalLM
    from spes_node.model.ownership import load_dense_state_dict

    loaded = [load_checkpoint_weights(n.directory) for n in nodes]
    S = cfg.swarm.num_shards
    merged: dict[str, torch.Tensor] = {}
    names = loaded[0][1].keys()
    for name in names:
        if ".mlp.shards." in name:
            shard = int(name.split(".mlp.shards.")[1].split(".")[0])
            sources = [w for _, w, prov in loaded if shard in prov["own_shards"]]
            if not sources:
                raise RuntimeError(f"no node held shard {shard}")
        else:
            sources = [w for _, w, _ in loaded]
        merged[name] = torch.stack([w[name] for w in sources]).mean(0)
    model = MoEForCausalLM(cfg.model, S)
    load_dense_state_dict(model, merged)
    own_views = []
    for _, weights, _ in loaded:
        view = MoEForCausalLM(cfg.model, S)
        load_dense_state_dict(view, weights)
        own_views.append(view)
    return model, own_views


class ConcatBatcher:
    """The nodes' batchers side by side: one centralized batch = every node's batch of the same step."""

    def __init__(self, batchers):
        self.batchers = batchers

    def next_batch(self) -> torch.Tensor:
        return torch.cat([b.next_batch() for b in self.batchers])


def train_centralized(cfg: SpesConfig, settings: dict) -> tuple:
    from spes_node.daemon.data import TokenBatcher
    from spes_node.daemon.trainer import Trainer
    from spes_node.model.moe import MoEForCausalLM
    from spes_node.model.ownership import apply_ownership
    from spes_node.model.tokenizer import load_tokenizer

    torch.set_num_threads(1)
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    n = settings["num_nodes"]
    batchers = [
        TokenBatcher(
            cfg.data.source,
            tokenizer,
            cfg.train.seq_len,
            cfg.train.micro_batch_size,
            part=i,
            num_parts=n,
            seed=cfg.train.seed,
            val_fraction=cfg.data.val_fraction,
        )
        for i in range(n)
    ]
    torch.manual_seed(cfg.train.seed)
    model = MoEForCausalLM(cfg.model, 1)
    apply_ownership(model, [0])
    trainer = Trainer(cfg, model, ConcatBatcher(batchers), torch.device("cpu"))
    losses, tokens = [], 0
    for _ in range(settings["steps"]):
        stats = trainer.train_step()
        losses.append(stats.ce_loss)
        tokens += stats.tokens
    return model, losses, tokens


def _curve(nodes: list[NodeRun], cfg: SpesConfig) -> dict:
    """Training loss per round (mean over nodes) against total tokens of the swarm."""
    histories = [n.summary["loss_history"] for n in nodes]
    rounds = min(len(h) for h in histories)
    tokens_per_round = cfg.swarm.sync_steps * cfg.train.micro_batch_size * cfg.train.seq_len * len(nodes)
    return {
        "tokens": [tokens_per_round * (k + 1) for k in range(rounds)],
        "loss": [sum(h[k] for h in histories) / len(histories) for k in range(rounds)],
    }


def plot(curves: dict[str, dict], final: dict[str, float], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, curve in curves.items():
        ax.plot(
            curve["tokens"],
            curve["loss"],
            marker="." if name != "centralized" else None,
            label=f"{name} (val {final[name]:.3f})",
        )
    ax.set_xlabel("total training tokens (all nodes)")
    ax.set_ylabel("training cross-entropy")
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(workdir: Path, settings: dict | None = None) -> dict:
    settings = {**SETTINGS, **(settings or {})}
    cfg = base_config(settings)
    rounds = settings["steps"] // settings["sync_steps"]
    val = validation_set(cfg, settings["val_batches"])
    runs, curves = {}, {}
    with LoadMonitor() as load:
        for name in settings["runs"]:
            run_cfg = run_config(settings, name)
            nodes = BenchSwarm(workdir / name, run_cfg, settings["num_nodes"], run_id=f"q_{name}").run(
                rounds, timeout=settings["timeout_s"]
            )
            model, views = swarm_model(run_cfg, nodes)
            runs[name] = {
                "val_loss": val_loss(model, val),
                "val_loss_node_views_mean": sum(val_loss(v, val) for v in views) / len(views),
                "total_tokens": sum(n.summary["tokens"] for n in nodes),
                "rounds": [n.summary["rounds_done"] for n in nodes],
                "failed_allreduces": sum(
                    len(r["report"].get("errors", [])) for n in nodes for r in n.timeline["rounds"]
                ),
                "data_parts_chosen_by_nodes": [n.timeline["data_part"].get("chosen") for n in nodes],
                "config": run_cfg.to_dict(),
            }
            curves[name] = _curve(nodes, run_cfg)
            emit(f"quality: {name} val loss {runs[name]['val_loss']:.4f}")
        model, losses, tokens = train_centralized(cfg, settings)
        H = settings["sync_steps"]
        runs["centralized"] = {
            "val_loss": val_loss(model, val),
            "total_tokens": tokens,
            "config": cfg.to_dict(),
        }
        per_step = tokens // settings["steps"]
        curves["centralized"] = {
            "tokens": [per_step * H * (k + 1) for k in range(len(losses) // H)],
            "loss": [sum(losses[k * H : (k + 1) * H]) / H for k in range(len(losses) // H)],
        }
    central = runs["centralized"]["val_loss"]
    ratios = {name: r["val_loss"] / central for name, r in runs.items() if name != "centralized"}
    results = {
        "val_loss_ratio_vs_centralized": ratios.get("spes"),
        "ratios": ratios,
        "runs": runs,
        "curves": curves,
        "validation": {"batches": len(val), "tokens": sum(b[:, 1:].numel() for b in val)},
    }
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    plot(
        curves,
        {name: r["val_loss"] for name, r in runs.items()},
        RESULTS_DIR / "loss_curves.png",
        f"{settings['preset']} preset, {settings['num_nodes']} nodes: SPES vs DiLoCo stand-in vs centralized",
    )
    emit(
        table(
            ["run", "val loss", "ratio vs centralized", "own-view val loss", "total tokens"],
            [
                [
                    name,
                    r["val_loss"],
                    r["val_loss"] / central,
                    r.get("val_loss_node_views_mean"),
                    r["total_tokens"],
                ]
                for name, r in runs.items()
            ],
            title=f"quality ({settings['preset']}, {settings['num_nodes']} nodes x {settings['steps']} steps, "
            f"H={settings['sync_steps']}, {len(val)} validation batches)",
        )
    )
    write_result("quality", settings, results, load.summary())
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="runs/benchmarks/quality")
    args = parser.parse_args()
    started = time.time()
    run(Path(args.workdir))
    emit(f"quality benchmark took {time.time() - started:.0f}s")


if __name__ == "__main__":
    main()
