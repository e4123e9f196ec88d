"""Outer steps applied to a round's average, with and without overlap (pure tensors, no network)."""

import torch

from spes_node.daemon.anchors import apply_outer
from spes_node.devices import HOST
from spes_node.swarm.averaging import NesterovOuter, PlainAverage, shared_buffers


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


def test_an_overlapped_nesterov_step_lands_the_progress_made_meanwhile_on_the_new_global_weights():
    lr, mu = 0.7, 0.9
    start = torch.tensor([1.0, -1.0, 0.5])
    handed = torch.tensor([0.8, -0.7, 0.6])  # the weights handed to the all-reduce, H steps after `start`
    trained = torch.tensor([0.75, -0.6, 0.65])  # the live weights when the result lands
    average = torch.tensor([0.6, -0.4, 0.55])
    outer = NesterovOuter(lr, mu)
    outer.remember({"w": start})
    local = {"w": trained.clone()}
    apply_outer(outer, local, {"w": handed.clone()}, {"w": average})
    # the step acts on the global weights (`start`), not on what was trained since; the progress since the hand-over
    # (trained - handed) goes back on top
    grad = start - average
    new_global = start - lr * (grad + mu * grad)
    torch.testing.assert_close(local["w"], new_global + (trained - handed))
    torch.testing.assert_close(outer.previous["w"], new_global)
    # a round without a group: the weights handed over are the next round's start
    apply_outer(outer, local, {"w": handed.clone()}, None)
    torch.testing.assert_close(outer.previous["w"], handed)


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
    # the state is in host memory whatever the weights' device (devices.HOST)
    assert all(t.device == HOST for t in (*restored.previous.values(), *restored.velocity.values()))


def test_nesterov_state_is_an_fp32_copy_in_host_memory():
    """A copy, never a view of the weights it remembers, and fp32 whatever their dtype. (On a GPU node the weights
    are on the card and the state in host memory: the steps move each tensor across; no GPU ran this here.)"""
    weights = {"w": torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16)}
    outer = NesterovOuter(0.7, 0.9)
    outer.remember(weights)
    previous = outer.previous["w"]
    assert previous.device == HOST and previous.dtype == torch.float32
    weights["w"].add_(1.0)
    assert previous.tolist() == [1.0, 2.0, 3.0]
    # an fp16 average (as a wire might leave it) is taken in fp32 against the fp32 state
    apply_outer(outer, weights, None, {"w": torch.tensor([2.0, 2.0, 2.0], dtype=torch.float16)})
    assert outer.velocity["w"].dtype == torch.float32
    assert weights["w"].dtype == torch.bfloat16


def test_an_averagers_buffers_are_fp32_copies_in_shared_memory():
    weights = torch.nn.Linear(8, 4)
    live = {"weight": weights.weight, "bias": weights.bias.detach().to(torch.bfloat16)}
    buffers = shared_buffers(live)
    for buffer, tensor in zip(buffers, live.values()):
        assert buffer.is_shared() and buffer.dtype == torch.float32
        assert torch.equal(buffer, tensor.detach().float())
        assert buffer.untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr()
    buffers[0].add_(1.0)
    assert not torch.equal(buffers[0], live["weight"].detach())
