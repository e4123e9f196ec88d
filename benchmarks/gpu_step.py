"""GPU step benchmark: bf16 step time and peak GPU memory of a spes-1b node holding 1 of S shards vs every expert.

For a machine with a CUDA GPU: `python -m benchmarks.gpu_step`. For each S in 4, 8, 16 the model is built with S
shards, shard 0 trainable and the rest frozen in bf16, and trained for a few optimiser steps (the preset's micro
batch and gradient accumulation, bf16 autocast as the node does); then once with every expert trainable. Reported:
median step time after warm-up, tokens/s and `torch.cuda.max_memory_allocated` (reset per configuration), with the
ratios to the all-experts node. Batches are random tokens (the step cost does not depend on the text).

`--tiny --device cpu` runs the same code on the tiny preset on a CPU, without memory numbers (benchmarks/memory.py
measures CPU memory properly, a fresh process per configuration): a check that the script works, nothing more.
"""

from __future__ import annotations

import argparse
import gc
import logging
import time

import torch

from benchmarks.common import emit, median, table, write_result

logger = logging.getLogger(__name__)


class RandomBatches:
    def __init__(self, batch: int, seq_len: int, vocab: int, device: torch.device):
        self.shape, self.vocab, self.device = (batch, seq_len + 1), vocab, device
        self.generator = torch.Generator(device="cpu").manual_seed(0)

    def next_batch(self) -> torch.Tensor:
        return torch.randint(0, self.vocab, self.shape, generator=self.generator)


def measure(cfg, num_shards: int, owned: list[int], device: torch.device, warmup: int, steps: int) -> dict:
    from spes_node.daemon.trainer import Trainer
    from spes_node.model.moe import MoEForCausalLM
    from spes_node.model.ownership import apply_ownership

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    else:
        base = 0
    torch.manual_seed(0)
    model = MoEForCausalLM(cfg.model, num_shards)
    apply_ownership(model, owned, "bf16")
    model.to(device)
    batches = RandomBatches(cfg.train.micro_batch_size, cfg.train.seq_len, cfg.model.vocab_size, device)
    trainer = Trainer(cfg, model, batches, device)
    times = []
    tokens = 0
    for i in range(warmup + steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        stats = trainer.train_step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - t)
            tokens = stats.tokens
    peak = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else None
    result = {
        "num_shards": num_shards,
        "owned": "all" if len(owned) == num_shards else f"1 of {num_shards}",
        "step_s_median": median(times),
        "step_s": times,
        "tokens_per_step": tokens,
        "tokens_per_s": tokens / median(times),
        "peak_memory_gib": peak / 2**30 if peak is not None else None,
        "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
    }
    del trainer, model
    return result


def run(preset: str, device_name: str, shard_counts: list[int], warmup: int, steps: int) -> dict:
    from spes_node.config import load_preset
    from spes_node.devices import resolve_device

    device = resolve_device(device_name)
    cfg = load_preset(preset)
    if device.type != "cuda":
        logger.warning("no CUDA device: this run checks the script, its numbers are not GPU numbers")
    if preset == "tiny":
        shard_counts = [
            s for s in shard_counts if cfg.model.num_experts % s == 0 and s <= cfg.model.num_experts
        ]
    rows = {"all": measure(cfg, 1, [0], device, warmup, steps)}
    for S in shard_counts:
        rows[f"1of{S}"] = measure(cfg, S, [0], device, warmup, steps)
    base = rows["all"]
    for r in rows.values():
        r["memory_ratio"] = r["peak_memory_gib"] / base["peak_memory_gib"] if device.type == "cuda" else None
        r["step_time_ratio"] = r["step_s_median"] / base["step_s_median"]
    emit(
        table(
            ["node", "step s", "tokens/s", "peak GiB", "memory ratio", "step-time ratio"],
            [
                [
                    r["owned"],
                    r["step_s_median"],
                    r["tokens_per_s"],
                    r["peak_memory_gib"],
                    r["memory_ratio"],
                    r["step_time_ratio"],
                ]
                for r in rows.values()
            ],
            title=f"{preset} on {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'} "
            f"(bf16 autocast on CUDA; frozen experts in bf16)",
        )
    )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny preset (a CPU check of the script)")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--shards", default="4,8,16", help="shard counts S to compare (comma-separated)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument(
        "--no-write", action="store_true", help="print only; do not write results/gpu_step.json"
    )
    args = parser.parse_args()
    preset = "tiny" if args.tiny else "spes-1b"
    shard_counts = [int(s) for s in args.shards.split(",")]
    rows = run(preset, args.device, shard_counts, args.warmup, args.steps)
    if not args.no_write:
        settings = {
            "preset": preset,
            "device": args.device,
            "shards": shard_counts,
            "warmup": args.warmup,
            "steps": args.steps,
        }
        write_result("gpu_step", settings, {"by_node": rows}, {})


if __name__ == "__main__":
    main()
