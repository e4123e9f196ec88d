"""Averaging updates: anchors, their ids, and who takes whose weights (pure functions of `daemon.round`)."""

from __future__ import annotations

import torch

from spes_node.daemon.anchors import (
    apply_update,
    initial_anchor_id,
    resync_acceptable,
    settle_anchor,
    update_norm,
)
from spes_node.swarm.averaging import NesterovOuter, PlainAverage, next_anchor_id


def test_fresh_nodes_share_the_initial_id_of_their_config():
    assert initial_anchor_id("a" * 64) == initial_anchor_id("a" * 64)
    assert initial_anchor_id("a" * 64) != initial_anchor_id("b" * 64)


def test_members_of_a_clean_round_agree_on_the_next_id():
    anchors = {"p1": "aa", "p2": "aa", "p3": "aa"}
    ids = {settle_anchor("aa", anchors, all_averaged=True, round_=7).new_id for _ in anchors}
    assert len(ids) == 1 and ids != {"aa"}
    assert ids == {next_anchor_id("aa", ["p3", "p1", "p2"], 7)}  # whatever the order
    assert not settle_anchor("aa", anchors, all_averaged=True, round_=7).take_from


def test_no_group_or_a_failed_part_gives_an_id_of_our_own():
    assert settle_anchor("aa", {}, all_averaged=False, round_=3).new_id is None
    decision = settle_anchor("aa", {"p1": "aa", "p2": "aa"}, all_averaged=False, round_=3)
    assert decision.new_id is None and not decision.take_from


def test_the_odd_member_takes_the_majority_anchor():
    anchors = {"p1": "aa", "p2": "aa", "late": "bb"}
    late = settle_anchor("bb", anchors, all_averaged=True, round_=5)
    majority = settle_anchor("aa", anchors, all_averaged=True, round_=5)
    assert late.take_from == ["p1", "p2"]
    # after taking their weights, it holds their next anchor, under their next id
    assert late.take_id == majority.new_id == next_anchor_id("aa", ["p1", "p2"], 5)
    assert not majority.take_from


def test_a_tie_is_broken_by_the_smaller_id_the_same_way_on_both_sides():
    anchors = {"p1": "aa", "p2": "bb"}
    a = settle_anchor("aa", anchors, all_averaged=True, round_=1)
    b = settle_anchor("bb", anchors, all_averaged=True, round_=1)
    assert not a.take_from and b.take_from == ["p1"] and b.take_id == a.new_id


def test_members_without_an_anchor_id_are_never_followed():
    anchors = {"p1": None, "p2": None, "me": "aa"}
    decision = settle_anchor("aa", anchors, all_averaged=True, round_=1)
    assert not decision.take_from and decision.new_id == next_anchor_id("aa", ["me"], 1)


def _weights(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((4,), value)}


def test_plain_update_moves_anchor_and_weights_together():
    anchor, local = _weights(1.0), _weights(0.5)  # trained from 1.0 to 0.5: pseudo-gradient 0.5
    apply_update(PlainAverage(), local, None, anchor, {"w": torch.full((4,), 0.25)})  # the group's average
    assert torch.equal(local["w"], torch.full((4,), 0.75)) and torch.equal(anchor["w"], local["w"])
    assert anchor["w"].data_ptr() != local["w"].data_ptr()


def test_without_a_group_the_trained_weights_become_the_anchor():
    anchor, local = _weights(1.0), _weights(0.5)
    apply_update(PlainAverage(), local, None, anchor, None)
    assert torch.equal(local["w"], torch.full((4,), 0.5)) and torch.equal(anchor["w"], local["w"])


def test_overlap_adds_the_progress_made_meanwhile():
    anchor, sent, local = _weights(1.0), _weights(0.5), _weights(0.4)  # 0.1 more progress since sending
    apply_update(PlainAverage(), local, sent, anchor, {"w": torch.full((4,), 0.25)})
    torch.testing.assert_close(local["w"], torch.full((4,), 0.65))
    torch.testing.assert_close(anchor["w"], torch.full((4,), 0.75))


def test_an_overlapped_nesterov_update_lands_the_progress_made_meanwhile():
    outer = NesterovOuter(lr=0.7, momentum=0.9)
    outer.remember(_weights(1.0))
    sent, local = _weights(0.5), _weights(0.4)
    apply_update(outer, local, sent, outer.previous, {"w": torch.full((4,), 0.5)})
    new_global = 1.0 - 0.7 * (0.5 + 0.9 * 0.5)
    torch.testing.assert_close(outer.previous["w"], torch.full((4,), new_global))
    torch.testing.assert_close(local["w"], torch.full((4,), new_global - 0.1))
    # without a group, the weights handed over become the anchor, and the live ones stay
    apply_update(outer, local, _weights(0.3), outer.previous, None)
    torch.testing.assert_close(outer.previous["w"], torch.full((4,), 0.3))
    torch.testing.assert_close(local["w"], torch.full((4,), new_global - 0.1))


def test_nesterov_update_keeps_its_anchor_as_previous():
    outer = NesterovOuter(lr=0.7, momentum=0.9)
    local = _weights(0.5)
    outer.remember(_weights(1.0))
    apply_update(outer, local, None, outer.previous, {"w": torch.full((4,), 0.5)})
    # v = 0.5; new = 1.0 - 0.7 * (0.5 + 0.9 * 0.5)
    torch.testing.assert_close(local["w"], torch.full((4,), 1.0 - 0.7 * 0.95))
    torch.testing.assert_close(outer.previous["w"], local["w"])


def test_a_groups_weights_are_taken_only_near_ours():
    ours = {"w": torch.ones(100)}
    update = {"w": torch.full((100,), 0.01)}  # norm 0.1
    norm = update_norm(update)
    assert abs(norm - 0.1) < 1e-6
    near = {"w": ours["w"] + 0.05}  # 0.5 away: five updates
    assert resync_acceptable(near, ours, norm) is None
    far = {"w": ours["w"] + 1.0}  # 10 away: a hundred updates (a poisoned or unrelated model)
    assert "more than" in resync_acceptable(far, ours, norm)
    poisoned = {"w": torch.full((100,), float("nan"))}
    assert "not finite" in resync_acceptable(poisoned, ours, norm)
    # fp16 rounding of a snapshot alone is always acceptable, even after a round without updates
    assert resync_acceptable({"w": ours["w"].half().float() + 1e-4}, ours, 0.0) is None
