"""val_loss_ratio_vs_centralized: validation loss at equal total tokens, swarm methods versus one process.

Every setting spends the same tokens (the same steps, the same total batch per step split over its nodes) from the
same initial weights, three seeds each; the swarm settings are simulated in one process (`quality_sim.py`), so a
setting's seeds differ only by the seed. Settings:
- centralized: one model, each step on the whole batch (the streams of the 4-node settings side by side);
- diloco: 4 nodes, each the whole model, Nesterov outer optimiser, the same H;
- spes_4x1: SPES, 4 shards of the experts, 1 holder each (4 nodes; the reference layout, the headline);
- spes_4x2: SPES, 4 shards, 2 holders each (8 nodes, half the per-node batch);
- spes_4x1_no_merge: spes_4x1 without the expert-merging warm-up;
- spes_4x1_int8: spes_4x1 with every pseudo-gradient on an emulated int8 wire (with error feedback);
- spes_4x1_refresh2: spes_4x1 with the frozen experts refreshed every other round (`swarm.refresh_every` = 2);
- spes_4x1_overlap: spes_4x1 with `swarm.overlap`: training goes on during a round, whose result lands 5 steps (a
  quarter of H) into the next round and is applied with the progress made since;
- spes_4x1_overlap_shards (not in the default runs): spes_4x1_overlap with only the shards' all-reduces overlapped;
  the shared parameters' result is applied at once, as published;
- spes_4x1_overlap_shards_shared1 (not in the default runs): spes_4x1_overlap_shards with the shared parameters'
  result landing one local step into the next round (`swarm.shared_lag_steps` = 1);
- spes_4x1_16e: spes_4x1 on the model with twice the experts, whose all-experts node does not fit the per-node
  memory that diloco uses (equal per-node memory; measured from the tensors).
- spes_4x1_uneven (not in the default runs): spes_4x1 on unequal cards, whose faster nodes train while they wait
  for the slowest (`swarm.train_while_waiting`): 0, 5, 10 and 20 steps past H a round. It spends more tokens than
  the others, in the same rounds: it is compared with spes_4x1 at equal wall time, not at equal tokens.
The final global model of each run is exported as a Hugging Face checkpoint and evaluated by `spes-node eval` on
held-out text of another kind (the repository's README and docs, prose and tables, not Python source).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks import common
from benchmarks.common import NODE_ENV, REPO_ROOT, LoadMonitor, emit, table
from benchmarks.quality_sim import (
    Setting,
    all_experts_node_memory,
    setting_config,
    train_setting,
    val_loss,
)
from spes_node.config import SpesConfig, load_preset

logger = logging.getLogger(__name__)

FIGURE = REPO_ROOT / "docs" / "quality_curves.png"

SETTINGS = {
    "preset": "tiny",
    "model": {},
    "data": {},
    "steps": 300,
    "sync_steps": 20,
    "total_batch": 32,
    "data_parts": 4,
    "merge_interval": 40,
    "merge_horizon": 150,
    "seeds": [0, 1, 2],
    "val_batches": 32,
    "curve_val_batches": 8,
    "heldout_batches": 48,
    "heldout": True,
    "runs": [
        "centralized",
        "diloco",
        "spes_4x1",
        "spes_4x2",
        "spes_4x1_no_merge",
        "spes_4x1_int8",
        "spes_4x1_refresh2",
        "spes_4x1_overlap",
        "spes_4x1_16e",
    ],
    "headline": "spes_4x1",
    "equal_memory": {"spes": "spes_4x1_16e", "diloco": "diloco"},
}

SETUPS = {
    s.name: s
    for s in (
        Setting("centralized", replicas=0, merge=False, description="one model, the whole batch"),
        Setting(
            "diloco", 1, 4, outer="nesterov", merge=False, description="4 nodes x whole model, Nesterov outer"
        ),
        Setting("spes_4x1", 4, 1, description="4 shards x 1 holder (4 nodes)"),
        Setting("spes_4x2", 4, 2, description="4 shards x 2 holders (8 nodes, half batch each)"),
        Setting("spes_4x1_no_merge", 4, 1, merge=False, description="spes_4x1 without the merge warm-up"),
        Setting("spes_4x1_int8", 4, 1, wire="int8", description="spes_4x1, int8 pseudo-gradients + EF"),
        Setting(
            "spes_4x1_refresh2",
            4,
            1,
            refresh_every=2,
            description="spes_4x1, frozen experts refreshed every 2 rounds",
        ),
        Setting(
            "spes_4x1_overlap",
            4,
            1,
            overlap_steps=5,
            description="spes_4x1, overlap: a round lands 5 steps late",
        ),
        Setting(
            "spes_4x1_overlap_shards",
            4,
            1,
            overlap_steps=5,
            overlap_groups=("shard",),
            description="spes_4x1_overlap with only the shards' all-reduces overlapped (the shared parameters' "
            "result applied at once)",
        ),
        Setting(
            "spes_4x1_overlap_shards_shared1",
            4,
            1,
            overlap_steps=5,
            overlap_groups=("shard",),
            shared_lag_steps=1,
            description="spes_4x1_overlap_shards with the shared parameters' result landing 1 step late "
            "(`swarm.shared_lag_steps` = 1)",
        ),
        Setting(
            "spes_4x1_overlap_blend",
            4,
            1,
            overlap_steps=5,
            overlap_blend=0.5,
            description="spes_4x1_overlap, the landed round blended half and half with the local weights",
        ),
        Setting("spes_4x1_16e", 4, 1, num_experts=16, description="spes_4x1 with 2x the experts"),
        Setting(
            "spes_4x1_uneven",
            4,
            1,
            extra_steps=(0, 5, 10, 20),
            description="spes_4x1 on unequal cards (1, 1.25, 1.5 and 2x the slowest's speed): the faster nodes "
            "train while they wait, 5, 10 and 20 steps past H a round",
        ),
    )
}


def base_config(settings: dict) -> SpesConfig:
    cfg = load_preset(settings["preset"])
    return cfg.replace(
        model=settings["model"],
        data=settings["data"],
        train={"total_steps": settings["steps"]},
        swarm={
            "sync_steps": settings["sync_steps"],
            "merge_interval": settings["merge_interval"],
            "merge_horizon": settings["merge_horizon"],
        },
    )


def heldout_corpus(directory: Path) -> tuple[Path, dict]:
    """The README and docs/*.md as one document (document 0 of a source is always held out), snapshotted."""
    files = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
    text = "\n\n".join(f.read_text() for f in files)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "docs.jsonl"
    path.write_text(json.dumps({"text": text}) + "\n")
    return path, {
        "files": [str(f.relative_to(REPO_ROOT)) for f in files],
        "bytes": len(text.encode()),
        "sha256": hashlib.sha256(text.encode()).hexdigest(),
    }


def heldout_eval(
    cfg: SpesConfig, weights: dict, out: Path, data: Path, batches: int, provenance: dict
) -> dict:
    """Export the weights as a Hugging Face checkpoint and run `spes-node eval` on it."""
    from spes_node.model.hf_checkpoint import save_hf_checkpoint

    save_hf_checkpoint(cfg, weights, out, force=True, provenance=provenance)
    cmd = [sys.executable, "-m", "spes_node.cli", "eval", "--model", str(out), "--data", str(data)]
    cmd += ["--batches", str(batches), "--batch-size", "8", "--device", "cpu", "--json"]
    done = subprocess.run(
        cmd, cwd=REPO_ROOT, capture_output=True, text=True, env={**os.environ, **NODE_ENV}, timeout=600
    )
    if done.returncode != 0:
        raise RuntimeError(f"spes-node eval failed: {done.stderr.strip()[-500:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return {"loss": result["loss"], "tokens": result["tokens"], "batches": result["batches"]}


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    m = sum(values) / len(values)
    if len(values) < 2:
        return m, 0.0
    return m, math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))


def summarize(runs: dict[str, dict[int, dict]], settings: dict) -> dict:
    """Per setting: mean and std of the final validation loss, of its ratio to centralized (paired by seed), of
    the held-out loss; and how much the loss still fell over the last quarter of training."""
    central = runs.get("centralized", {})
    out = {}
    for name, by_seed in runs.items():
        seeds = sorted(by_seed)
        finals = [by_seed[s]["val_loss"] for s in seeds]
        entry = {"seeds": seeds}
        entry["val_loss_mean"], entry["val_loss_std"] = mean_std(finals)
        paired = [s for s in seeds if s in central]
        if paired and name != "centralized":
            ratios = [by_seed[s]["val_loss"] / central[s]["val_loss"] for s in paired]
            entry["ratio_mean"], entry["ratio_std"] = mean_std(ratios)
            entry["ratios"] = ratios
        held = [by_seed[s]["heldout"]["loss"] for s in seeds if by_seed[s].get("heldout")]
        if held:
            entry["heldout_loss_mean"], entry["heldout_loss_std"] = mean_std(held)
            held_central = [
                central[s]["heldout"]["loss"] for s in seeds if s in central and central[s].get("heldout")
            ]
            if name != "centralized" and len(held_central) == len(held):
                entry["heldout_ratio_mean"], entry["heldout_ratio_std"] = mean_std(
                    [h / c for h, c in zip(held, held_central)]
                )
        curves = [by_seed[s]["curve"]["val_loss"] for s in seeds]
        points = min(len(c) for c in curves)
        if points >= 4:
            q = points - 1 - points // 4
            entry["last_quarter_drop"] = mean_std([c[q] - c[points - 1] for c in curves])[0]
        out[name] = entry
    return out


def equal_memory(runs: dict[str, dict[int, dict]], settings: dict, all_experts: dict | None) -> dict | None:
    names = settings["equal_memory"]
    if names["spes"] not in runs or names["diloco"] not in runs:
        return None
    spes = next(iter(runs[names["spes"]].values()))["memory"]
    diloco = next(iter(runs[names["diloco"]].values()))["memory"]
    budget = diloco["weights"] + diloco["grads"] + diloco["optimizer"]
    return {
        "budget_bytes": budget,
        "budget_is": "the diloco node's weights + gradients + AdamW state (its Nesterov state not counted)",
        "spes_node_bytes": spes["total"],
        "spes_fits": spes["total"] <= budget,
        "all_experts_node_bytes": all_experts["train_state"] if all_experts else None,
        "all_experts_fits": all_experts["train_state"] <= budget if all_experts else None,
        "spes": names["spes"],
        "diloco": names["diloco"],
    }


def plot(runs: dict[str, dict[int, dict]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, rx) = plt.subplots(1, 2, figsize=(12, 4.8))
    central = runs.get("centralized", {})
    for name, by_seed in runs.items():
        seeds = sorted(by_seed)
        curves = [by_seed[s]["curve"] for s in seeds]
        points = min(len(c["val_loss"]) for c in curves)
        tokens = curves[0]["tokens"][:points]
        stats = [mean_std([c["val_loss"][k] for c in curves]) for k in range(points)]
        mean = [m for m, _ in stats]
        line = ax.plot(tokens, mean, label=f"{name} ({len(seeds)} seeds)")[0]
        ax.fill_between(
            tokens, [m - s for m, s in stats], [m + s for m, s in stats], color=line.get_color(), alpha=0.2
        )
        paired = [s for s in seeds if s in central]
        if name == "centralized" or not paired:
            continue
        ratio = [
            mean_std(
                [by_seed[s]["curve"]["val_loss"][k] / central[s]["curve"]["val_loss"][k] for s in paired]
            )
            for k in range(points)
        ]
        rx.plot(tokens, [m for m, _ in ratio], color=line.get_color(), label=name)
        rx.fill_between(
            tokens, [m - s for m, s in ratio], [m + s for m, s in ratio], color=line.get_color(), alpha=0.2
        )
    ax.set_xlabel("total training tokens (all nodes)")
    ax.set_ylabel("validation cross-entropy (nats/byte)")
    ax.set_title(title)
    ax.set_ylim(top=min(ax.get_ylim()[1], 3.0))
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    rx.axhline(1.0, color="black", lw=0.8)
    rx.axhline(1.02, color="gray", lw=0.8, ls="--")
    rx.set_xlabel("total training tokens (all nodes)")
    rx.set_ylabel("validation loss / centralized (same seed)")
    rx.set_title("ratio to centralized: mean and std over seeds")
    rx.legend(fontsize=8)
    rx.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def update_latest(results: dict) -> None:
    """Merge the quality headline into `latest.json`, keeping every other key."""
    keys = ("val_loss_ratio_vs_centralized", "val_loss_ratio_std")
    common.merge_latest({**{key: results[key] for key in keys}, "val_loss_ratios": results["ratios"]})


def run(
    workdir: Path,
    settings: dict | None = None,
    figure: Path = FIGURE,
    write_latest: bool = True,
    result: str = "quality",
) -> dict:
    """Train every setting of `settings["runs"]` for every seed; results in `benchmarks/results/<result>.json`."""
    from spes_node.daemon.data import validation_batches
    from spes_node.model.tokenizer import load_tokenizer

    settings = {**SETTINGS, **(settings or {})}
    torch.set_num_threads(1)
    base = base_config(settings)
    tokenizer = load_tokenizer(base.data.tokenizer)
    val = validation_batches(
        base.data.source, tokenizer, base.train.seq_len, 8, settings["val_batches"], base.data.val_fraction
    )
    curve_val = val[: settings["curve_val_batches"]]
    heldout_data, heldout_info = heldout_corpus(workdir / "heldout") if settings["heldout"] else (None, None)
    runs: dict[str, dict[int, dict]] = {}
    configs = {}
    started = time.time()
    with LoadMonitor(interval=15.0) as load:
        for seed in settings["seeds"]:
            for name in settings["runs"]:
                setting = SETUPS[name]
                cfg = setting_config(base, setting, settings["total_batch"])
                configs[name] = cfg
                t = time.time()
                weights, log, memory = train_setting(
                    cfg, setting, seed, settings["steps"], curve_val, tokenizer, settings["data_parts"]
                )
                from spes_node.model.moe import MoEForCausalLM
                from spes_node.model.ownership import load_dense_state_dict

                model = MoEForCausalLM(cfg.model, cfg.swarm.num_shards)
                load_dense_state_dict(model, weights)
                record = {
                    "val_loss": val_loss(model, val),
                    "train_seconds": round(time.time() - t, 1),
                    "tokens": log.tokens[-1],
                    "merges": log.merges,
                    "memory": memory,
                    "curve": {"tokens": log.tokens, "val_loss": log.val_loss, "train_loss": log.train_loss},
                }
                if log.int8_relative_error:
                    record["int8_relative_error_mean"] = sum(log.int8_relative_error) / len(
                        log.int8_relative_error
                    )
                if heldout_data is not None:
                    record["heldout"] = heldout_eval(
                        cfg,
                        weights,
                        workdir / "exports" / f"{name}_seed{seed}",
                        heldout_data,
                        settings["heldout_batches"],
                        {"source": "benchmarks.quality", "setting": name, "seed": seed},
                    )
                runs.setdefault(name, {})[seed] = record
                emit(
                    f"quality: seed {seed} {name}: val {record['val_loss']:.4f}"
                    + (f", held-out {record['heldout']['loss']:.4f}" if "heldout" in record else "")
                    + f" ({record['train_seconds']:.0f}s train, {time.time() - started:.0f}s so far)"
                )
                _write(
                    settings, runs, configs, heldout_info, None, load.summary(), partial=True, result=result
                )
    return finish(settings, runs, configs, heldout_info, load.summary(), val[0], figure, write_latest, result)


def finish(
    settings,
    runs,
    configs,
    heldout_info,
    load: dict,
    batch,
    figure: Path,
    write_latest: bool,
    result="quality",
) -> dict:
    """Summary, equal-memory check, final quality.json, curves, table and latest.json from finished runs."""
    all_experts = None
    spes_name = settings["equal_memory"]["spes"]
    if spes_name in configs:
        all_experts = all_experts_node_memory(configs[spes_name], batch)
    results = _write(settings, runs, configs, heldout_info, all_experts, load, partial=False, result=result)
    plot(
        runs,
        figure,
        f"{settings['preset']} preset, {settings['steps']} steps x {settings['total_batch']} seq, "
        f"H={settings['sync_steps']}",
    )
    _print(results, settings)
    if write_latest:
        update_latest(results)
    return results


def finish_from_file(figure: Path = FIGURE, write_latest: bool = True) -> dict:
    """`finish` over the runs that `quality.json` holds (for instance the seeds done when a run was stopped)."""
    from spes_node.daemon.data import validation_batches
    from spes_node.model.tokenizer import load_tokenizer

    document = json.loads((common.RESULTS_DIR / "quality.json").read_text())
    settings, saved = {**SETTINGS, **document["settings"]}, document["results"]
    runs = {name: {int(seed): r for seed, r in by_seed.items()} for name, by_seed in saved["runs"].items()}
    done = set.intersection(*(set(by_seed) for by_seed in runs.values()))
    runs = {name: {seed: r for seed, r in by_seed.items() if seed in done} for name, by_seed in runs.items()}
    settings["seeds"] = sorted(done)
    configs = {name: SpesConfig.from_dict(cfg) for name, cfg in saved["configs"].items()}
    base = base_config(settings)
    batch = validation_batches(
        base.data.source,
        load_tokenizer(base.data.tokenizer),
        base.train.seq_len,
        8,
        1,
        base.data.val_fraction,
    )[0]
    return finish(
        settings, runs, configs, saved["heldout_text"], document["load"], batch, figure, write_latest
    )


def _write(settings, runs, configs, heldout_info, all_experts, load, partial: bool, result="quality") -> dict:
    summary = summarize(runs, settings)
    headline = summary.get(settings["headline"], {})
    results = {
        "val_loss_ratio_vs_centralized": headline.get("ratio_mean"),
        "val_loss_ratio_std": headline.get("ratio_std"),
        "headline_setting": settings["headline"],
        "ratios": {name: s.get("ratio_mean") for name, s in summary.items() if name != "centralized"},
        "summary": summary,
        "equal_memory": equal_memory(runs, settings, all_experts),
        "all_experts_node_memory": all_experts,
        "heldout_text": heldout_info,
        "runs": {name: {str(seed): r for seed, r in by_seed.items()} for name, by_seed in runs.items()},
        "settings_described": {name: SETUPS[name].description for name in runs},
        "configs": {name: cfg.to_dict() for name, cfg in configs.items()},
        "method": "swarms simulated in one process (benchmarks/quality_sim.py); int8 wire emulated",
        "partial": partial,
    }
    common.write_result(result, settings, results, load)
    return results


def _print(results: dict, settings: dict) -> None:
    rows = []
    for name, s in results["summary"].items():
        rows.append(
            [
                name,
                f"{s['val_loss_mean']:.4f} ± {s['val_loss_std']:.4f}",
                f"{s['ratio_mean']:.4f} ± {s['ratio_std']:.4f}" if "ratio_mean" in s else "-",
                f"{s['heldout_loss_mean']:.4f} ± {s['heldout_loss_std']:.4f}"
                if "heldout_loss_mean" in s
                else "-",
                s.get("last_quarter_drop"),
                common.mib(next(iter(results["runs"][name].values()))["memory"]["total"]),
            ]
        )
    emit(
        table(
            [
                "setting",
                "val loss",
                "ratio vs centralized",
                "held-out docs loss",
                "drop, last 1/4",
                "node MiB",
            ],
            rows,
            title=f"quality ({settings['preset']}, {settings['steps']} steps, H={settings['sync_steps']}, "
            f"seeds {settings['seeds']})",
        )
    )
    eq = results["equal_memory"]
    if eq:
        emit(
            f"equal memory: budget {common.mib(eq['budget_bytes']):.2f} MiB; {eq['spes']} node "
            f"{common.mib(eq['spes_node_bytes']):.2f} MiB (fits: {eq['spes_fits']}); all-experts node of that model "
            f"{common.mib(eq['all_experts_node_bytes'] or 0):.2f} MiB (fits: {eq['all_experts_fits']})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="runs/benchmarks/quality")
    parser.add_argument("--seeds", type=int, nargs="*", help="seeds (default 0 1 2)")
    parser.add_argument("--runs", nargs="*", help=f"settings (default all: {', '.join(SETUPS)})")
    parser.add_argument(
        "--finish", action="store_true", help="summarize the seeds every setting finished in quality.json"
    )
    parser.add_argument(
        "--result",
        default="quality",
        help="results file name (benchmarks/results/<name>.json); another name than quality leaves latest.json "
        "and docs/quality_curves.png alone (a subset of the settings, say)",
    )
    args = parser.parse_args()
    if args.finish:
        finish_from_file()
        return
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    overrides = {}
    if args.seeds:
        overrides["seeds"] = args.seeds
    if args.runs:
        overrides["runs"] = args.runs
    started = time.time()
    if args.result == "quality":
        run(Path(args.workdir), overrides)
    else:
        workdir = Path(args.workdir)
        run(
            workdir,
            overrides,
            figure=workdir / f"{args.result}_curves.png",
            write_latest=False,
            result=args.result,
        )
    emit(f"quality benchmark took {time.time() - started:.0f}s")


if __name__ == "__main__":
    main()
