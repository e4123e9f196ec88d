import math

import pytest
import torch

from spes_node.model.merge import merge_alpha, merge_layer, merge_step_due


def _slow_merge(gate_up, down, alpha, k, update):
    num_experts, two_inter, _ = gate_up.shape
    inter = two_inter // 2
    gate_up, down = gate_up.double(), down.double()
    new_gate_up, new_down = gate_up.clone(), down.clone()
    num_neighbours = min(k, num_experts - 1)
    for i in update:
        gate_i = gate_up[i, :inter].flatten()
        scores = []
        for j in range(num_experts):
            if j != i:
                gate_j = gate_up[j, :inter].flatten()
                scores.append((float(gate_i @ gate_j / (gate_i.norm() * gate_j.norm())), j))
        neighbours = [j for _, j in sorted(scores, reverse=True)[:num_neighbours]]
        for old, new in ((gate_up, new_gate_up), (down, new_down)):
            delta = sum(old[j] - old[i] for j in neighbours) / len(neighbours)
            new[i] = old[i] + alpha * delta
    return new_gate_up, new_down


def _layer(num_experts=8, inter=3, hidden=5, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=generator).to(dtype)
    down = torch.randn(num_experts, hidden, inter, generator=generator).to(dtype)
    return gate_up, down


@pytest.mark.parametrize("k", [1, 2, 4])
def test_merge_matches_explicit_loop(k):
    gate_up, down = _layer(seed=k)
    update = [0, 3, 5, 7]
    got_gate_up, got_down = merge_layer(gate_up, down, alpha=0.3, k=k, update=update)
    want_gate_up, want_down = _slow_merge(gate_up, down, 0.3, k, update)
    torch.testing.assert_close(got_gate_up.double(), want_gate_up, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_down.double(), want_down, rtol=1e-5, atol=1e-5)
    assert not torch.equal(got_gate_up[0], gate_up[0])


def test_similarity_uses_gate_rows_only():
    gate_up, down = _layer(num_experts=3, inter=2, hidden=4)
    gate_up[1, :2] = gate_up[0, :2] * 2.0
    gate_up[1, 2:] = -gate_up[0, 2:] * 10.0
    gate_up[2, :2] = -gate_up[0, :2]
    gate_up[2, 2:] = gate_up[0, 2:] * 10.0
    new_gate_up, new_down = merge_layer(gate_up, down, alpha=1.0, k=1, update=[0])
    torch.testing.assert_close(new_gate_up[0], gate_up[1])
    torch.testing.assert_close(new_down[0], down[1])


def test_pre_merge_values_make_merge_order_independent():
    gate_up, down = _layer()
    forward = merge_layer(gate_up, down, alpha=0.5, k=3, update=[0, 1, 2, 3])
    backward = merge_layer(gate_up, down, alpha=0.5, k=3, update=[3, 2, 1, 0])
    for a, b in zip(forward, backward, strict=True):
        assert torch.equal(a, b)
    sequential_gate_up, sequential_down = gate_up, down
    for expert in [0, 1, 2, 3]:
        sequential_gate_up, sequential_down = merge_layer(
            sequential_gate_up, sequential_down, alpha=0.5, k=3, update=[expert]
        )
    assert not torch.allclose(sequential_gate_up, forward[0])


def test_experts_outside_update_unchanged_and_inputs_untouched():
    gate_up, down = _layer()
    gate_up_before, down_before = gate_up.clone(), down.clone()
    new_gate_up, new_down = merge_layer(gate_up, down, alpha=0.5, k=4, update=[2, 6])
    assert torch.equal(gate_up, gate_up_before) and torch.equal(down, down_before)
    for expert in range(8):
        unchanged = torch.equal(new_gate_up[expert], gate_up[expert])
        assert unchanged == torch.equal(new_down[expert], down[expert]) == (expert not in (2, 6))


def test_k_capped_at_other_experts():
    gate_up, down = _layer(num_experts=3)
    new_gate_up, new_down = merge_layer(gate_up, down, alpha=0.5, k=10, update=[0, 1, 2])
    want_gate_up, want_down = _slow_merge(gate_up, down, 0.5, 2, [0, 1, 2])
    torch.testing.assert_close(new_gate_up.double(), want_gate_up, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(new_down.double(), want_down, rtol=1e-5, atol=1e-5)
    expected_mean = gate_up.double().mean(0)
    torch.testing.assert_close(
        merge_layer(gate_up, down, alpha=2 / 3, k=2, update=[1])[0][1].double(), expected_mean
    )


def test_single_expert_is_left_alone():
    gate_up, down = _layer(num_experts=1)
    new_gate_up, new_down = merge_layer(gate_up, down, alpha=0.5, k=4, update=[0])
    assert torch.equal(new_gate_up, gate_up) and torch.equal(new_down, down)


def test_bf16_computed_in_fp32_returned_in_input_dtype():
    gate_up, down = _layer(dtype=torch.bfloat16)
    new_gate_up, new_down = merge_layer(gate_up, down, alpha=0.25, k=2, update=[1, 4])
    assert new_gate_up.dtype == torch.bfloat16 and new_down.dtype == torch.bfloat16
    want_gate_up, want_down = _slow_merge(gate_up, down, 0.25, 2, [1, 4])
    torch.testing.assert_close(new_gate_up, want_gate_up.to(torch.bfloat16))
    torch.testing.assert_close(new_down, want_down.to(torch.bfloat16))


def test_parameters_in_give_plain_tensors_out():
    gate_up, down = (torch.nn.Parameter(t) for t in _layer())
    new_gate_up, new_down = merge_layer(gate_up, down, alpha=0.1, k=2, update=[0])
    assert not new_gate_up.requires_grad and not new_down.requires_grad


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"k": 0}, "k"),
        ({"update": [8]}, "update"),
        ({"update": [-1]}, "update"),
        ({"down": torch.zeros(8, 5, 4)}, "down"),
    ],
)
def test_bad_arguments_name_the_field(kwargs, field):
    gate_up, down = _layer()
    arguments = {"gate_up": gate_up, "down": down, "alpha": 0.1, "k": 2, "update": [0]} | kwargs
    with pytest.raises(ValueError, match=field):
        merge_layer(**arguments)


def test_alpha_schedule():
    assert merge_alpha(0, 0.05, 10_000) == 0.05
    assert math.isclose(merge_alpha(2_500, 0.04, 10_000), 0.03)
    assert math.isclose(merge_alpha(5_000, 0.02, 20_000), 0.015)
    assert merge_alpha(10_000, 0.05, 10_000) == 0.0
    assert merge_alpha(30_000, 0.05, 10_000) == 0.0
    with pytest.raises(ValueError, match="horizon"):
        merge_alpha(1, 0.05, 0)


def test_merge_step_due():
    assert [step for step in range(0, 1600, 100) if merge_step_due(step, 500)] == [0, 500, 1000, 1500]
    with pytest.raises(ValueError, match="interval"):
        merge_step_due(10, 0)


def test_no_merge_and_no_premerge_download_once_the_warm_up_is_over():
    from spes_node.model.merge import merge_due

    # interval 500, alpha0 0.05, horizon 10000: merges at 500 ... 9500, none at 10000 and after (alpha = 0)
    assert merge_due(500, 500, 0.05, 10_000)
    assert merge_due(9_500, 500, 0.05, 10_000)
    assert not merge_due(10_000, 500, 0.05, 10_000)
    assert not merge_due(20_000, 500, 0.05, 10_000)
    assert not merge_due(750, 500, 0.05, 10_000), "not on the interval"
    assert not merge_due(500, 500, 0.0, 10_000), "warm-up switched off"
