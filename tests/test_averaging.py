"""Outer steps applied to a round's average, with and without overlap (pure tensors, no network)."""

import torch

from spes_node.daemon.anchors import apply_outer
from spes_node.swarm.averaging import NesterovOuter, PlainAverage


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


def test_nesterov_state_survives_a_checkpoint_and_stays_on_the_weights_device():
    outer = NesterovOuter(0.7, 0.9)
    weights = {"w": torch.tensor([1.0, -1.0])}
    outer.remember(weights)
    apply_outer(outer, weights, None, {"w": torch.tensor([0.5, -0.5])})
    saved = outer.state_dict()
    assert set(saved) == {"previous.w", "velocity.w"}

    restored = NesterovOuter(0.7, 0.9)
    restored.load_state_dict(saved, like=weights)
    assert torch.equal(restored.previous["w"], outer.previous["w"])
    assert torch.equal(restored.velocity["w"], outer.velocity["w"])
    # the next outer step is the same from the restored state as from the live one
    a, b = {"w": weights["w"].clone()}, {"w": weights["w"].clone()}
    apply_outer(outer, a, None, {"w": torch.tensor([0.2, 0.1])})
    apply_outer(restored, b, None, {"w": torch.tensor([0.2, 0.1])})
    assert torch.equal(a["w"], b["w"])
    # state is kept where the weights live (a CUDA run used to fail on CPU state)
    assert all(t.device == weights["w"].device for t in restored.previous.values())


def test_nesterov_state_is_kept_on_the_device_of_the_weights():
    # the meta device stands in for CUDA: state copied to the CPU (as before) cannot be made from it
    outer = NesterovOuter(0.7, 0.9)
    outer.remember({"w": torch.empty(3, device="meta")})
    assert outer.previous["w"].device.type == "meta"
