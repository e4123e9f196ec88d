"""Faults and untrusted peers on 127.0.0.1: robust aggregation, bans, swarm keys, bad records, bad peers."""

from __future__ import annotations

import asyncio

import pytest
import torch

from spes_node.averaging import valid_gather
from spes_node.robust import (
    FAULT_ENV,
    BanList,
    RobustPartReducer,
    RobustPolicy,
    check_result,
    inject_fault,
    robust_mean,
)
from spes_node.swarm_key import SwarmKey, load_swarm_key

SHAPE = torch.Size([64, 8])


def _honest(n: int, seed: int = 0, spread: float = 0.01) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    base = torch.randn(SHAPE, generator=generator)
    return [base + spread * torch.randn(SHAPE, generator=generator) for _ in range(n)]


def _mean(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(parts).mean(0)


# ---------------------------------------------------------------------------------------------- robust_mean


def test_honest_groups_get_the_plain_mean():
    for n in (2, 3, 4):
        parts = _honest(n)
        aggregate = robust_mean(parts, [1.0] * n, SHAPE, own=0)
        assert not aggregate.rejected
        # centered clipping only touches peers farther than the median distance; with equal spreads the mean
        # moves by a small fraction of the honest spread at most
        assert (aggregate.result - _mean(parts)).norm() < 0.25 * (parts[1] - parts[0]).norm()
    parts = _honest(2)
    torch.testing.assert_close(robust_mean(parts, [1.0, 1.0], SHAPE, own=0).result, _mean(parts))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_part_is_dropped(value):
    parts = _honest(3)
    bad = parts[2].clone()
    bad[3, 3] = value
    aggregate = robust_mean([parts[0], parts[1], bad], [1.0] * 3, SHAPE, own=0)
    assert aggregate.rejected == {2: "non-finite values"}
    torch.testing.assert_close(aggregate.result, _mean(parts[:2]))


def test_huge_part_is_dropped_even_in_a_group_of_two():
    parts = _honest(2)
    aggregate = robust_mean([parts[0], parts[1] * 1e4], [1.0, 1.0], SHAPE, own=0)
    assert list(aggregate.rejected) == [1] and "away from ours" in aggregate.rejected[1]
    torch.testing.assert_close(aggregate.result, parts[0])


def test_wrong_shape_dtype_or_weight_is_dropped():
    parts = _honest(4)
    candidates = [parts[0], parts[1][:-1], parts[2].to(torch.int64), parts[3]]
    aggregate = robust_mean(candidates, [1.0, 1.0, 1.0, float("nan")], SHAPE, own=0)
    assert set(aggregate.rejected) == {1, 2, 3}
    assert (
        "shape" in aggregate.rejected[1]
        and "dtype" in aggregate.rejected[2]
        and "weight" in aggregate.rejected[3]
    )
    torch.testing.assert_close(aggregate.result, parts[0])


@pytest.mark.parametrize("n", [3, 4, 5])
def test_one_subtle_attacker_moves_the_result_by_at_most_the_honest_spread(n):
    honest = _honest(n - 1)
    spread = max(float((p - honest[0]).norm()) for p in honest)
    # inside the validation bound, pulling as hard as it can, and claiming a huge weight
    direction = torch.randn(SHAPE, generator=torch.Generator().manual_seed(7))
    attacker = honest[0] + 3.9 * honest[0].norm() * direction / direction.norm()
    aggregate = robust_mean([*honest, attacker], [1.0] * (n - 1) + [1e9], SHAPE, own=0)
    assert not aggregate.rejected
    assert (aggregate.result - _mean(honest)).norm() < spread
    plain = torch.stack([*honest, attacker]).mean(0)
    assert (plain - _mean(honest)).norm() > 50 * spread, "the plain mean would have been dragged far"


def test_median_center_when_our_own_part_is_unusable():
    parts = _honest(3)
    own = torch.full(SHAPE, float("nan"))
    aggregate = robust_mean([own, *parts], [1.0] * 4, SHAPE, own=0)
    assert list(aggregate.rejected) == [0]
    assert torch.isfinite(aggregate.result).all()
    assert (aggregate.result - _mean(parts)).norm() < (parts[1] - parts[0]).norm()


def test_result_check_bounds_what_a_reducer_may_return():
    local = _honest(1)[0]
    assert check_result(0.01 * torch.randn(SHAPE), local) is None
    assert check_result(torch.full(SHAPE, float("nan")), local) == "non-finite values"
    assert "moves our part" in check_result(1e4 * local, local)
    assert "shape" in check_result(torch.zeros(3), local)


def test_reducer_aggregates_robustly_and_reports_the_bad_sender():
    async def scenario():
        rejected = []
        shapes = [torch.Size([16]), torch.Size([4])]
        reducer = RobustPartReducer(
            shapes, 3, local_sender=0, policy=RobustPolicy(), on_reject=lambda s, r: rejected.append((s, r))
        )
        inputs = {
            0: [torch.ones(16), torch.ones(4)],
            1: [torch.ones(16) * 1.02, torch.ones(4) * 1.02],
            2: [torch.full((16,), float("nan")), torch.ones(4) * 1e6],
        }

        async def send(sender):
            return [await reducer.accumulate_part(sender, i, part) for i, part in enumerate(inputs[sender])]

        first, second, _ = await asyncio.gather(send(0), send(1), send(2))
        return first, second, rejected

    first, second, rejected = asyncio.run(scenario())
    assert all(torch.equal(a, b) for a, b in zip(first, second)), "every sender gets the same result"
    torch.testing.assert_close(first[0], torch.full((16,), 1.01))
    torch.testing.assert_close(first[1], torch.full((4,), 1.01))
    assert rejected[0] == (2, "non-finite values")


# ---------------------------------------------------------------------------------------------- small parts


def test_ban_list_expires_and_stays_bounded(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr("spes_node.robust.time.monotonic", lambda: clock[0])
    bans = BanList(seconds=10, max_peers=2)
    assert bans.ban("a", "nan") and not bans.ban("a", "nan again")
    clock[0] += 1
    bans.ban("b", "huge")
    clock[0] += 1
    bans.ban("c", "huge")
    assert bans.active() == {"b": "huge", "c": "huge"}, "the ban closest to expiry makes room"
    clock[0] += 9
    assert set(bans.active()) == {"c"}
    clock[0] += 1
    assert bans.active() == {} and "c" not in bans


@pytest.mark.parametrize("fault", ["nan", "inf", "huge"])
def test_fault_injection_corrupts_contributions(monkeypatch, fault):
    tensors = [torch.ones(10), torch.zeros(3)]
    inject_fault(tensors)
    assert all(torch.equal(t, e) for t, e in zip(tensors, [torch.ones(10), torch.zeros(3)]))
    monkeypatch.setenv(FAULT_ENV, fault)
    inject_fault(tensors)
    if fault == "huge":
        assert all(torch.isfinite(t).all() and t.norm() > 1e3 for t in tensors)
    else:
        assert not any(torch.isfinite(t).any() for t in tensors)
    monkeypatch.setenv(FAULT_ENV, "bogus")
    with pytest.raises(ValueError, match=FAULT_ENV):
        inject_fault(tensors)


def test_gathered_round_info_is_validated():
    assert valid_gather((3, 150, 5120)) and valid_gather([0, 0, 0])
    for bad in [
        None,
        (1, 2),
        (1, 2, 3, 4),
        (1, -2, 3),
        (1.5, 2, 3),
        (True, 2, 3),
        ("1", 2, 3),
        (1 << 70, 2, 3),
    ]:
        assert not valid_gather(bad), bad


def test_swarm_key_tags_and_flags(tmp_path):
    key, other = SwarmKey.from_text("k" * 32), SwarmKey.from_text("x" * 32)
    tag = key.join_tag("run_shared", b"peer-a")
    assert key.check_join_tag("run_shared", b"peer-a", tag)
    assert not key.check_join_tag("run_shared", b"peer-b", tag), "a tag is bound to its peer id"
    assert not key.check_join_tag("run_shard0", b"peer-a", tag), "and to its group"
    assert not other.check_join_tag("run_shared", b"peer-a", tag)
    assert not key.check_join_tag("run_shared", b"peer-a", None)
    assert "k" * 16 not in repr(key) and key.fingerprint in repr(key)
    assert len(SwarmKey.generate()) == 64
    path = tmp_path / "key"
    path.write_text("k" * 32 + "\n")
    assert load_swarm_key(None, str(path)).fingerprint == key.fingerprint
    assert load_swarm_key(None, None) is None
    with pytest.raises(ValueError, match="--swarm-key: a swarm key must be at least 16"):
        load_swarm_key("short", None)
    with pytest.raises(ValueError, match="not both"):
        load_swarm_key("k" * 32, str(path))
    with pytest.raises(ValueError, match="--swarm-key-file: cannot read"):
        load_swarm_key(None, str(tmp_path / "missing"))
