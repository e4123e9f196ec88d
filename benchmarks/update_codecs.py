"""Which 8-bit codec carries pseudo-gradients best: error and speed on real updates of the tiny preset.

Two members train the same initial tiny model for H steps on different data parts (AdamW, the preset's schedule);
their pseudo-gradients (start - end) are what an update all-reduce sends. For each codec: the relative error of one
compressed copy, chunked as hivemind's all-reduce chunks it, and the time to compress and decompress. Then five
rounds of two-member averaging emulated in one process (the codec on both legs, as `robust.py` runs it, with and
without error feedback): the relative error of the summed averaged updates against the exact sum of the means.
The real all-reduce is measured in tests/test_averaging_updates.py; this only ranks the codecs.

    python -m benchmarks.update_codecs [--steps 10] [--rounds 5]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from hivemind.compression import (
    CompressionBase,
    CompressionInfo,
    Float16Compression,
    Quantile8BitQuantization,
    Uniform8BitQuantization,
)

from benchmarks.common import emit, table
from spes_node.config import load_preset
from spes_node.model.moe import MoEForCausalLM
from spes_node.model.tokenizer import load_tokenizer
from spes_node.swarm.codecs import BlockwiseInt8

CHUNK_VALUES = 2**19
"""Values per all-reduce chunk for an 8-bit codec on fp32 input (hivemind: 512 KiB after compression)."""


class _Readable:
    """hivemind's 8-bit `extract` reads its codebook size with `int()` of a one-element array, which numpy 2
    refuses; this reads it as numpy 2 allows, everything else is hivemind's."""

    def extract(self, serialized_tensor):
        buffer = serialized_tensor.buffer
        size = int(np.frombuffer(buffer, count=1, dtype=np.int64)[0])
        codebook = torch.as_tensor(np.frombuffer(buffer, offset=8, count=size, dtype=np.float32))
        indices = np.frombuffer(buffer, offset=8 + 4 * size, dtype=np.uint8)
        return codebook[torch.as_tensor(indices, dtype=torch.int64)].reshape(tuple(serialized_tensor.size))


class Uniform8(_Readable, Uniform8BitQuantization):
    pass


class Quantile8(_Readable, Quantile8BitQuantization):
    pass


CODECS: dict[str, CompressionBase] = {
    "fp16": Float16Compression(),
    "uniform8 (hivemind)": Uniform8(),
    "quantile8 (hivemind)": Quantile8(),
    "blockwise int8": BlockwiseInt8(),
}


def pseudo_gradients(steps: int, members: int, seed: int = 0) -> list[torch.Tensor]:
    """Each member's flat pseudo-gradient after `steps` AdamW steps from the same start, on its own data part."""
    from spes_node.daemon.data import TokenBatcher
    from spes_node.daemon.trainer import Trainer

    cfg = load_preset("tiny")
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    out = []
    for member in range(members):
        torch.manual_seed(seed)
        model = MoEForCausalLM(cfg.model, cfg.swarm.num_shards)
        start = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
        batcher = TokenBatcher(
            cfg.data.source, tokenizer, cfg.train.seq_len, cfg.train.micro_batch_size, member, members, seed
        )
        trainer = Trainer(cfg, model, batcher, torch.device("cpu"))
        trainer.step = 20  # past the warm-up, as in a running swarm
        for _ in range(steps):
            trainer.train_step()
        out.append(start - torch.cat([p.detach().flatten() for p in model.parameters()]))
    return out


def roundtrip(codec: CompressionBase, x: torch.Tensor) -> torch.Tensor:
    parts = [codec.extract(codec.compress(p, CompressionInfo.from_tensor(p))) for p in x.split(CHUNK_VALUES)]
    return torch.cat(parts).float()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def averaged_rounds(
    codec: CompressionBase, updates: list[torch.Tensor], rounds: int, feedback: bool
) -> float:
    """Relative error of the summed averaged updates (member 0 reduces nothing; the reducer is member 1)."""
    gen = torch.Generator().manual_seed(1)
    inputs = [torch.zeros_like(updates[0]) for _ in updates]
    residual = [torch.zeros_like(updates[0]) for _ in updates]
    applied = exact = torch.zeros_like(updates[0])
    for _ in range(rounds):
        # a new update each round: the members' updates with a fresh random direction mixed in
        noise = [u.std() * torch.randn(u.shape, generator=gen) for u in updates]
        xs = [u + n for u, n in zip(updates, noise)]
        exact = exact + sum(xs) / len(xs)
        inputs = [x + r for x, r in zip(xs, residual)] if feedback else xs
        sent = roundtrip(codec, inputs[0])  # member 0 sends to member 1, which reduces and sends back
        mean = (sent + inputs[1]) / 2
        broadcast = roundtrip(codec, mean)
        if feedback:
            residual[0] = inputs[0] - sent
            residual[1] = 2 * (
                mean - broadcast
            )  # the reducer's own input carries what the return leg dropped
        applied = applied + broadcast
    return rel(applied, exact)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    updates = pseudo_gradients(args.steps, 2)
    big = updates[0].repeat(max(1, 2**24 // updates[0].numel()))
    rows = []
    for name, codec in CODECS.items():
        one = rel(roundtrip(codec, updates[0]), updates[0])
        start = time.perf_counter()
        roundtrip(codec, big)
        seconds_per_million = (time.perf_counter() - start) / big.numel() * 1e6
        rows.append(
            [
                name,
                f"{one:.2e}",
                f"{averaged_rounds(codec, updates, args.rounds, feedback=False):.2e}",
                f"{averaged_rounds(codec, updates, args.rounds, feedback=True):.2e}",
                f"{seconds_per_million * 1e3:.1f}",
            ]
        )
    emit(
        table(
            [
                "codec",
                "one copy",
                f"{args.rounds} rounds",
                f"{args.rounds} rounds, feedback",
                "ms / M values",
            ],
            rows,
            title=f"relative error on pseudo-gradients of the tiny preset ({updates[0].numel()} values, "
            f"{args.steps} steps), speed on {big.numel()} values, one thread",
        )
    )


if __name__ == "__main__":
    main()
