"""Averaging pseudo-gradients with real hivemind averagers on 127.0.0.1: error feedback, identical results on
every member, the weights mode and fp16/fp32 unchanged, anchors and the outer step on updates."""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch

from spes_node.daemon.anchors import apply_difference
from spes_node.swarm.averaging import (
    GroupAverager,
    GroupResult,
    NesterovOuter,
    PlainAverage,
    next_anchor_id,
    valid_gather,
)

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(300)]

SHAPES = {"embed": (600, 1000), "flat": (700_000,), "norm": (128,)}
"""1.3 M values: three all-reduce chunks of the int8 codec in the large tensors, and a small one."""
MATCHMAKING = 2.0


_groups = iter(range(1000))


def averagers(dhts, n: int, **kwargs) -> list[GroupAverager]:
    prefix = f"test_updates_{next(_groups)}"
    zeros = {name: torch.zeros(shape) for name, shape in SHAPES.items()}
    options = dict(matchmaking_time=MATCHMAKING, allreduce_timeout=60.0, client_mode=False)
    return [GroupAverager(dht, prefix, zeros, **(options | kwargs)) for dht in dhts[:n]]


def shutdown(group: list[GroupAverager]) -> None:
    for averager in group:
        averager.shutdown()


class Lost(Exception):
    """A group of every member formed, but some parts of the vector were not averaged: a member lost part of the
    all-reduce (hivemind: "Averaging: received 94.2% results"), and each kept its local values there."""


def one_round(group, inputs, gathers=None, anchors=None, tries: int = 3):
    """Every member steps at once; returns their (result, averaged). A try in which no group formed is repeated
    (nothing was sent). A try in which some member was left out (on a loaded machine a follower can give up
    matchmaking just as its leader begins, whose all-reduce then misses that member's part) or parts failed is
    repeated too when the averagers carry nothing from round to round, and raises `Lost` when they keep an
    error-feedback residual, which that round has spoiled."""
    for _ in range(tries):
        handles = [
            averager.step(
                tensors,
                1.0,
                gathers[i] if gathers else (0, 0, 1),
                anchor=anchors[i] if anchors else None,
            )
            for i, (averager, tensors) in enumerate(zip(group, inputs))
        ]
        outcomes = [averager.finish(handle) for averager, handle in zip(group, handles)]
        if all(averaged is None and result.group_size == 1 for result, averaged in outcomes):
            continue
        whole = all(averaged is not None and result.group_size == len(group) for result, averaged in outcomes)
        if whole and not any(result.failed_reducers for result, _ in outcomes):
            return outcomes
        if any(averager.residual_bytes for averager in group):
            raise Lost([(result.group_size, result.failed_reducers, result.error) for result, _ in outcomes])
        print(
            f"\na member was left out or lost parts: {[(r.group_size, r.error) for r, _ in outcomes]}; once more"
        )
    pytest.fail(f"no group formed in {tries} tries")


def random_update(generator: torch.Generator, direction: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A persistent direction plus fresh noise, with per-row scales spread over two orders of magnitude.

    Members' directions share a common part, as honest members' updates do: the robust reducer rejects a part
    more than 4 times our own part's norm away from it (`robust.RobustPolicy`)."""
    out = {}
    for name, shape in SHAPES.items():
        noise = torch.randn(shape, generator=generator)
        scale = torch.logspace(-2, 0, shape[0])[:, None] if len(shape) == 2 else 0.1
        out[name] = (direction[name] + noise) * scale
    return out


def flat(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([tensors[name].reshape(-1) for name in SHAPES])


def run_updates(dhts, compression: str, error_feedback: bool, rounds: int):
    """Two members average `rounds` pseudo-gradients from a shared anchor (plain outer step); returns the
    relative error of the summed averaged updates against the exact sum, the averagers' residuals at the end
    (scaled as they are), and each round's results.

    Now and then a member loses part of an all-reduce, or is left out of a group on a loaded machine (`Lost`;
    one cause of lost parts, a reducer closing its stream of results first, is gone: `swarm/streams.py`; whether
    it was the only one is not known). The members' error-feedback residuals then hold that round's rounding, so
    the run starts over with new averagers, saying so, up to twice. Not on fresh DHTs: a check that started over
    on new ones lost a part of their first all-reduce there too."""
    for attempt in range(3):
        try:
            return _run_updates(dhts, compression, error_feedback, rounds)
        except Lost as e:
            if attempt == 2:
                raise
            print(f"\n{compression}: parts of a round were not averaged ({e}): new averagers, once more")
    raise AssertionError("unreachable")


def _run_updates(dhts, compression: str, error_feedback: bool, rounds: int):
    group = averagers(dhts, 2, compression=compression, average="updates", error_feedback=error_feedback)
    try:
        generator = torch.Generator().manual_seed(0)
        common = {n: torch.randn(s, generator=generator) for n, s in SHAPES.items()}
        directions = [
            {n: common[n] + torch.randn(s, generator=generator) for n, s in SHAPES.items()} for _ in group
        ]
        anchor = {name: torch.randn(shape, generator=generator) for name, shape in SHAPES.items()}
        applied = exact = torch.zeros(sum(torch.Size(s).numel() for s in SHAPES.values()))
        history = []
        for _ in range(rounds):
            updates = [random_update(generator, d) for d in directions]
            current = [{n: anchor[n] - u[n] for n in SHAPES} for u in updates]
            outcomes = one_round(group, current, anchors=[anchor, anchor])
            history.append(outcomes)
            (_, first), (_, second) = outcomes
            for name in SHAPES:
                assert torch.equal(first[name], second[name]), "members applied different updates"
            exact = exact + (flat(updates[0]) + flat(updates[1])) / 2
            applied = applied + flat(first)
            new = {n: torch.empty(s) for n, s in SHAPES.items()}
            PlainAverage().apply_update(new, anchor, first)
            anchor = new
        residuals = [
            flat(dict(zip(SHAPES, a.averager.residual))) if a.averager.residual is not None else None
            for a in group
        ]
        return float((applied - exact).norm() / exact.norm()), exact - applied, residuals, history
    finally:
        shutdown(group)


def test_error_feedback_keeps_the_sum_of_int8_updates_on_the_exact_average(dhts):
    rounds = 8
    with_feedback, gap, residuals, history = run_updates(dhts, "int8", error_feedback=True, rounds=rounds)
    without, _, no_residuals, _ = run_updates(dhts, "int8", error_feedback=False, rounds=rounds)
    assert no_residuals == [None, None]
    # the gap is exactly what the residuals still hold (each member's input carries its share of it)
    torch.testing.assert_close(gap, (residuals[0] + residuals[1]) / 2, rtol=0, atol=1e-5)
    # one round's rounding (the residual), against rounding that piles up round after round
    print(f"int8, {rounds} rounds: relative error {with_feedback:.2e} with feedback, {without:.2e} without")
    assert with_feedback < 0.55 * without  # 1 / sqrt(rounds) expected: 0.35
    assert 0 < with_feedback < 2e-3
    # the counted bytes are int8-sized: a little over 1 byte per value each way for two members
    result: GroupResult = history[-1][0][0]
    numel = gap.numel()
    assert numel <= result.bytes_sent <= 1.05 * numel and numel <= result.bytes_received <= 1.05 * numel


def test_fp32_updates_are_the_exact_average_and_fp16_feeds_back_its_rounding(dhts):
    error, _, residuals, _ = run_updates(dhts, "none", error_feedback=True, rounds=2)
    assert residuals == [None, None], "nothing is dropped without compression: no residual"
    assert error < 1e-6
    error16, gap, residuals16, _ = run_updates(dhts, "fp16", error_feedback=True, rounds=2)
    torch.testing.assert_close(gap, (residuals16[0] + residuals16[1]) / 2, rtol=0, atol=1e-5)
    assert 0 < error16 < 5e-4


def test_replicas_whose_updates_differ_part_by_part_keep_each_other(dhts):
    """Two honest replicas of a shard, each of whose updates is near zero where its experts saw none of its tokens
    (weight decay alone moved them): ours in "flat", theirs in "embed". A reducer compares a sender's part with its
    own, and a sender a reducer's result with its own part; against the part's norm alone each found the other
    hundreds of times too far, rejected it and banned it for an hour (a swarm of int8 updates did, in round 1).
    The member in client mode sends every part to the other, so both checks run on the skewed parts whatever the
    group's order."""
    prefix = f"test_updates_{next(_groups)}"
    zeros = {name: torch.zeros(shape) for name, shape in SHAPES.items()}
    options = dict(
        matchmaking_time=MATCHMAKING, allreduce_timeout=60.0, compression="int8", average="updates"
    )
    group = [
        GroupAverager(dhts[0], prefix, zeros, client_mode=False, **options),
        GroupAverager(dhts[1], prefix, zeros, client_mode=True, **options),
    ]
    try:
        generator = torch.Generator().manual_seed(4)
        common = {n: torch.randn(s, generator=generator) for n, s in SHAPES.items()}
        updates = [{n: 1e-3 * (common[n] + torch.randn(s, generator=generator)) for n, s in SHAPES.items()}]
        updates.append(
            {n: 1e-3 * (common[n] + torch.randn(s, generator=generator)) for n, s in SHAPES.items()}
        )
        updates[0]["flat"] = 4e-6 * torch.randn(SHAPES["flat"], generator=generator)
        updates[1]["embed"] = 4e-6 * torch.randn(SHAPES["embed"], generator=generator)
        anchor = {name: torch.randn(shape, generator=generator) for name, shape in SHAPES.items()}
        current = [{n: anchor[n] - u[n] for n in SHAPES} for u in updates]
        outcomes = one_round(group, current, anchors=[anchor, anchor])
        exact = (flat(updates[0]) + flat(updates[1])) / 2
        for result, averaged in outcomes:
            assert result.rejected == {} and result.group_size == 2 and result.failed_reducers == 0, result
            error = float((flat(averaged) - exact).norm() / exact.norm())
            assert error < 1e-2, error
        assert torch.equal(flat(outcomes[0][1]), flat(outcomes[1][1])), "members applied different updates"
    finally:
        shutdown(group)


def test_weights_mode_averages_weights_as_before(dhts):
    # two members: the robust reducer's result is the plain mean (with three, centered clipping pulls the farthest
    # member's part in, tests/test_faults.py)
    for compression, tolerance in (("none", 1e-6), ("fp16", 1e-3)):
        group = averagers(dhts, 2, compression=compression)
        try:
            generator = torch.Generator().manual_seed(1)
            weights = [{n: torch.randn(s, generator=generator) for n, s in SHAPES.items()} for _ in group]
            outcomes = one_round(group, weights)
            mean = {n: sum(w[n] for w in weights) / len(weights) for n in SHAPES}
            for result, averaged in outcomes:
                assert result.group_size == 2 and group[0].residual_bytes == 0
                # the result is read from the averager's buffers in shared memory, not copied out of them
                assert all(t.is_shared() for t in averaged.values())
                error = float((flat(averaged) - flat(mean)).norm() / flat(mean).norm())
                assert error < tolerance, (compression, error)
        finally:
            shutdown(group)


def test_differences_mode_returns_what_lands_the_average_on_the_weights_handed_over(dhts):
    # the plain average of weights as nodes run it: each member gets the average minus its own weights, which it
    # adds to its live weights, trained on since the hand-over or not (`anchors.apply_difference`)
    for compression, tolerance in (("none", 1e-6), ("fp16", 1e-3)):
        group = averagers(dhts, 2, compression=compression, average="differences")
        try:
            generator = torch.Generator().manual_seed(2)
            weights = [{n: torch.randn(s, generator=generator) for n, s in SHAPES.items()} for _ in group]
            progress = [
                {n: 0.01 * torch.randn(s, generator=generator) for n, s in SHAPES.items()} for _ in group
            ]
            live = [{n: w[n] + p[n] for n in SHAPES} for w, p in zip(weights, progress)]
            outcomes = one_round(group, weights)
            mean = {n: sum(w[n] for w in weights) / len(weights) for n in SHAPES}
            for (result, difference), own, trained, extra in zip(outcomes, weights, live, progress):
                assert result.group_size == 2
                error = float((flat(own) + flat(difference) - flat(mean)).norm() / flat(mean).norm())
                assert error < tolerance, (compression, error)
                apply_difference(trained, difference)
                landed = flat(trained) - flat(extra)
                assert float((landed - flat(mean)).norm() / flat(mean).norm()) < tolerance, compression
        finally:
            shutdown(group)


def test_members_report_their_anchors(dhts):
    group = averagers(dhts, 2, compression="int8", average="updates")
    try:
        assert group[0].residual_bytes == 4 * sum(torch.Size(s).numel() for s in SHAPES.values())
        zero = {n: torch.zeros(s) for n, s in SHAPES.items()}
        step = {n: torch.full(s, 0.5) for n, s in SHAPES.items()}
        outcomes = one_round(
            group, [step, step], gathers=[(3, 10, 5, "ab12"), (3, 10, 5, "ab12")], anchors=[zero] * 2
        )
        result = outcomes[0][0]
        assert set(result.anchors.values()) == {"ab12"} and result.shared_anchor == "ab12" and result.clean
        members = sorted(result.peers)
        assert next_anchor_id("ab12", members, 4) == next_anchor_id("ab12", members[::-1], 4)

        outcomes = one_round(
            group, [step, step], gathers=[(4, 20, 5, "ab12"), (4, 20, 5, "cd34")], anchors=[zero] * 2
        )
        result = outcomes[1][0]
        assert sorted(result.anchors.values()) == ["ab12", "cd34"]
        assert result.shared_anchor is None and not result.clean
    finally:
        shutdown(group)


def test_anchor_ids_in_round_info_are_validated():
    assert valid_gather((1, 2, 3)) and valid_gather((1, 2, 3, "0f" * 16)) and valid_gather([0, 0, 0, "a"])
    for bad in (
        (1, 2, 3, ""),
        (1, 2, 3, "0" * 33),
        (1, 2, 3, "xyz"),
        (1, 2, 3, "AB"),
        (1, 2, 3, 7),
        (1, 2, 3, "a", 1),
    ):
        assert not valid_gather(bad), bad
    members = ["QmB", "QmA"]
    assert next_anchor_id("00", members, 5) != next_anchor_id("00", members, 6)
    assert next_anchor_id("00", members, 5) != next_anchor_id("01", members, 5)
    assert next_anchor_id("00", members, 5) != next_anchor_id("00", ["QmA"], 5)
    assert valid_gather((5, 0, 0, next_anchor_id("00", members, 5)))


def test_outer_steps_on_an_averaged_update():
    anchor = {"w": torch.tensor([1.0, -1.0])}
    update = {"w": torch.tensor([0.5, -0.5])}
    local = {"w": torch.zeros(2)}
    PlainAverage().apply_update(local, anchor, update)
    assert torch.equal(local["w"], torch.tensor([0.5, -0.5]))

    # DiLoCo's outer step with the update as the outer gradient is the same as on the averaged weights
    lr, mu = 0.7, 0.9
    on_updates, on_weights = NesterovOuter(lr, mu), NesterovOuter(lr, mu)
    on_weights.remember(anchor)
    a, b = {"w": torch.zeros(2)}, {"w": anchor["w"].clone()}
    on_updates.apply_update(a, anchor, update)
    on_weights.apply(b, {"w": anchor["w"] - update["w"]})
    torch.testing.assert_close(a["w"], b["w"])
    second = {"w": torch.tensor([0.1, 0.2])}
    new_anchor = {"w": a["w"].clone()}
    on_updates.apply_update(a, new_anchor, second)
    on_weights.apply(b, {"w": b["w"] - second["w"]})
    torch.testing.assert_close(a["w"], b["w"])
    torch.testing.assert_close(on_updates.previous["w"], a["w"])


def test_a_step_of_an_unresponsive_averager_is_given_up_at_its_deadline(dhts):
    """An averager process that gives no outcome (here frozen with SIGSTOP after taking its step) no longer holds
    `finish` forever (a CI run's wire-bytes test waited 300 s on one): the step is given up at its deadline, with
    an error that says so."""
    [averager] = averagers(
        dhts, 1, compression="fp16", matchmaking_time=5.0, allreduce_timeout=2.0, step_grace=1.0
    )
    box = {}
    try:
        handle = averager.step({name: torch.ones(shape) for name, shape in SHAPES.items()}, 1.0, (0, 0, 1))
        os.kill(averager.averager.pid, signal.SIGSTOP)
        worker = threading.Thread(target=lambda: box.update(outcome=averager.finish(handle)), daemon=True)
        worker.start()
        worker.join(120)  # the deadline is 2 x 10 s of matchmaking + 2 s + 1 s after the step
        assert not worker.is_alive(), "finish still waits on an averager that will never answer"
    finally:
        os.kill(averager.averager.pid, signal.SIGCONT)
        averager.shutdown()
    result, averaged = box["outcome"]
    assert averaged is None and result.group_size == 1 and result.bytes_sent == 0
    assert "unresponsive" in (result.error or ""), result
    assert result.seconds >= handle.deadline - handle.started - 0.5, result
