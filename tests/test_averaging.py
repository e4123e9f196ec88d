"""Outer steps applied to a round's average, with and without overlap (pure tensors, no network)."""

import torch

from spes_node.averaging import NesterovOuter, PlainAverage
from spes_node.rounds import apply_outer


def test_plain_average_replaces_weights():
    local = {"w": torch.tensor([1.0, 2.0])}
    apply_outer(PlainAverage(), local, None, {"w": torch.tensor([3.0, 4.0])})
    assert torch.equal(local["w"], torch.tensor([3.0, 4.0]))


def test_overlap_keeps_local_progress_on_top_of_the_average():
    sent = {"w": torch.tensor([1.0, 2.0])}
    local = {"w": torch.tensor([1.5, 1.0])}  # trained on after `sent` was handed to the all-reduce
    apply_outer(PlainAverage(), local, sent, {"w": torch.tensor([3.0, 4.0])})
    assert torch.allclose(local["w"], torch.tensor([3.5, 3.0]))


def test_no_group_leaves_weights_alone():
    local = {"w": torch.tensor([1.0, 2.0])}
    apply_outer(PlainAverage(), local, None, None)
    assert torch.equal(local["w"], torch.tensor([1.0, 2.0]))


def test_nesterov_outer_step_matches_formula():
    lr, mu = 0.7, 0.9
    outer = NesterovOuter(lr, mu)
    start = torch.tensor([1.0, -1.0])
    outer.remember({"w": start})
    avg1 = torch.tensor([0.5, -0.5])
    local = {"w": start.clone()}
    apply_outer(outer, local, None, {"w": avg1})
    g1 = start - avg1
    v1 = g1
    expected1 = start - lr * (g1 + mu * v1)
    assert torch.allclose(local["w"], expected1)

    avg2 = expected1 - torch.tensor([0.1, 0.2])
    apply_outer(outer, local, None, {"w": avg2})
    g2 = expected1 - avg2
    v2 = mu * v1 + g2
    assert torch.allclose(local["w"], expected1 - lr * (g2 + mu * v2))


def test_nesterov_with_lr_one_and_no_momentum_is_the_plain_average():
    outer = NesterovOuter(1.0, 0.0)
    outer.remember({"w": torch.tensor([2.0])})
    local = {"w": torch.tensor([5.0])}
    apply_outer(outer, local, None, {"w": torch.tensor([3.0])})
    assert torch.allclose(local["w"], torch.tensor([3.0]))
