"""Update averaging with real averagers on 127.0.0.1: error, bytes and time per step by wire compression.

Two members of the tiny preset train H steps from a shared anchor on their own data parts, average their
pseudo-gradients with `GroupAverager(average="updates")` and take the plain outer step, for a few rounds. For each
wire compression, with and without error feedback: the relative error of each round's averaged update against the
exact mean of the two pseudo-gradients, and of the summed updates over all rounds; the bytes each member counted
on the wire; the seconds from step to result (the matchmaking window included). Then the seconds of one step on a
larger vector, weights and updates, to show what compression and the residual cost.

    python -m benchmarks.update_averaging [--rounds 5] [--steps 10] [--numel 16000000]
"""

from __future__ import annotations

import argparse
import statistics
import time

import hivemind
import torch

from benchmarks.common import emit, table
from spes_node.config import load_preset
from spes_node.daemon.data import TokenBatcher
from spes_node.daemon.trainer import Trainer
from spes_node.model.moe import MoEForCausalLM
from spes_node.model.tokenizer import load_tokenizer
from spes_node.swarm.averaging import GroupAverager, PlainAverage

MATCHMAKING = 1.0
_prefixes = iter(range(10_000))


def start_dhts(n: int) -> list[hivemind.DHT]:
    first = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    return [first] + [
        hivemind.DHT(
            start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=first.get_visible_maddrs()
        )
        for _ in range(n - 1)
    ]


def group_of(dhts, tensors: dict[str, torch.Tensor], **kwargs) -> list[GroupAverager]:
    prefix = f"bench_updates_{next(_prefixes)}"
    options = dict(matchmaking_time=MATCHMAKING, allreduce_timeout=120.0, client_mode=False) | kwargs
    return [GroupAverager(dht, prefix, tensors, **options) for dht in dhts]


def average_once(group, inputs, anchors=None):
    """One step of every member at once, repeated until a group of all forms; [(result, averaged)]."""
    for _ in range(5):
        handles = [
            a.step(x, 1.0, (0, 0, 1), anchor=anchors[i] if anchors else None)
            for i, (a, x) in enumerate(zip(group, inputs))
        ]
        outcomes = [a.finish(h) for a, h in zip(group, handles)]
        if all(result.group_size == len(group) for result, _ in outcomes):
            return outcomes
    raise RuntimeError("no group of every member formed in 5 tries")


def flat(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors.values()])


def training_run(dhts, compression: str, feedback: bool, rounds: int, steps: int) -> dict:
    cfg = load_preset("tiny")
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    torch.manual_seed(0)
    models = [MoEForCausalLM(cfg.model, 1) for _ in dhts]
    for model in models[1:]:
        model.load_state_dict(models[0].state_dict())
    trainers = []
    for i, model in enumerate(models):
        batcher = TokenBatcher(
            cfg.data.source, tokenizer, cfg.train.seq_len, cfg.train.micro_batch_size, i, 2
        )
        trainers.append(Trainer(cfg, model, batcher, torch.device("cpu")))
        trainers[-1].step = 20  # past the warm-up
    anchor = {n: p.detach().clone() for n, p in models[0].named_parameters()}
    group = group_of(dhts, anchor, compression=compression, average="updates", error_feedback=feedback)
    errors, summed_applied, summed_exact, seconds = [], 0.0, 0.0, []
    try:
        for _ in range(rounds):
            for trainer in trainers:
                for _ in range(steps):
                    trainer.train_step()
            current = [{n: p.detach() for n, p in m.named_parameters()} for m in models]
            outcomes = average_once(group, current, anchors=[anchor] * len(models))
            exact = sum(flat(anchor) - flat(c) for c in current) / len(current)
            update = outcomes[0][1]
            errors.append(float((flat(update) - exact).norm() / exact.norm()))
            summed_applied = summed_applied + flat(update)
            summed_exact = summed_exact + exact
            seconds += [result.seconds for result, _ in outcomes]
            new_anchor = {n: torch.empty_like(t) for n, t in anchor.items()}
            PlainAverage().apply_update(new_anchor, anchor, update)
            anchor = new_anchor
            for model in models:
                with torch.no_grad():
                    for n, p in model.named_parameters():
                        p.copy_(anchor[n])
        numel = flat(anchor).numel()
        return {
            "per_round": statistics.mean(errors),
            "summed": float((summed_applied - summed_exact).norm() / summed_exact.norm()),
            "bytes_per_value": outcomes[0][0].bytes_sent / numel,
            "seconds": statistics.median(seconds),
            "residual_bytes_per_value": group[0].residual_bytes / numel,
        }
    finally:
        for averager in group:
            averager.shutdown()


def step_seconds(dhts, numel: int, compression: str, average: str) -> tuple[float, float]:
    """(median seconds from step to result, seconds of it beyond the matchmaking window) for `numel` values."""
    tensors = {"w": torch.zeros(numel)}
    group = group_of(dhts, tensors, compression=compression, average=average)
    try:
        generator = torch.Generator().manual_seed(0)
        times = []
        for _ in range(2):
            inputs = [{"w": torch.randn(numel, generator=generator)} for _ in group]
            anchors = [{"w": torch.zeros(numel)} for _ in group] if average == "updates" else None
            start = time.perf_counter()
            average_once(group, inputs, anchors)
            times.append(time.perf_counter() - start)
        best = statistics.median(times)
        return best, best - MATCHMAKING
    finally:
        for averager in group:
            averager.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--numel", type=int, default=16_000_000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dhts = start_dhts(2)
    try:
        rows = []
        for compression, feedback in (
            ("none", True),
            ("fp16", False),
            ("fp16", True),
            ("int8", False),
            ("int8", True),
        ):
            r = training_run(dhts, compression, feedback, args.rounds, args.steps)
            rows.append(
                [
                    compression,
                    "on" if feedback else "off",
                    f"{r['per_round']:.2e}",
                    f"{r['summed']:.2e}",
                    f"{r['bytes_per_value']:.3f}",
                    f"{r['residual_bytes_per_value']:.0f}",
                    f"{r['seconds']:.2f}",
                ]
            )
        emit(
            table(
                [
                    "wire",
                    "feedback",
                    "error/round",
                    f"error of sum ({args.rounds})",
                    "B/value sent",
                    "residual B/value",
                    "s/step",
                ],  # fmt: skip
                rows,
                title=f"two tiny-preset members, {args.steps} steps per round, plain outer step "
                f"(s/step includes the {MATCHMAKING:.0f} s matchmaking window)",
            )
        )
        rows = []
        for compression in ("none", "fp16", "int8"):
            for average in ("weights", "updates"):
                total, beyond = step_seconds(dhts, args.numel, compression, average)
                rows.append([compression, average, f"{total:.2f}", f"{beyond:.2f}"])
        emit(
            table(
                ["wire", "average", "s/step", "s beyond matchmaking"],
                rows,
                title=f"{args.numel} values, 2 members",
            )
        )
    finally:
        for dht in dhts:
            dht.shutdown()


if __name__ == "__main__":
    main()
