import pytest
import torch
from transformers import OlmoeForCausalLM

from spes_node.config import ModelConfig, load_preset
from spes_node.model.hf_interop import from_hf_config, from_hf_state_dict, to_hf_config, to_hf_state_dict
from spes_node.model.moe import MoEForCausalLM, analytic_param_count, is_expert_name, num_params
from spes_node.model.ownership import (
    apply_ownership,
    dense_state_dict,
    load_dense_state_dict,
    owned_shards,
    shard_tensors,
    shared_parameters,
)

TINY = load_preset("tiny").model
GQA = ModelConfig(
    vocab_size=97,
    hidden_size=64,
    num_layers=2,
    num_heads=8,
    num_kv_heads=2,
    num_experts=8,
    top_k=3,
    expert_ffn=48,
    max_seq_len=64,
    rope_theta=500000.0,
    norm_topk_prob=True,
)
CONFIGS = {"tiny": TINY, "gqa-normtopk": GQA}


def _model(cfg: ModelConfig, num_shards: int = 4, seed: int = 0) -> MoEForCausalLM:
    torch.manual_seed(seed)
    return MoEForCausalLM(cfg, num_shards)


def _hf_model(cfg: ModelConfig) -> OlmoeForCausalLM:
    return OlmoeForCausalLM(to_hf_config(cfg)).eval()


def _ids(cfg: ModelConfig, batch: int = 2, seq: int = 37, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _router_logits(model: MoEForCausalLM, ids: torch.Tensor) -> list[torch.Tensor]:
    captured = []
    hooks = [
        layer.mlp.register_forward_hook(lambda _m, _i, out: captured.append(out[1]))
        for layer in model.model.layers
    ]
    try:
        model(ids)
    finally:
        for hook in hooks:
            hook.remove()
    return captured


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_parity_with_transformers_olmoe(name):
    cfg = CONFIGS[name]
    ours = _model(cfg).eval()
    theirs = _hf_model(cfg)
    theirs.load_state_dict(to_hf_state_dict(dense_state_dict(ours)), strict=True)
    ids = _ids(cfg)
    with torch.no_grad():
        expected = theirs(ids).logits
        got = ours(ids).logits
    assert got.shape == expected.shape == (*ids.shape, cfg.vocab_size)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_parity_holds_with_perturbed_norms_and_frozen_fp32_shards():
    ours = _model(GQA)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    apply_ownership(ours, [2], "fp32")
    theirs = _hf_model(GQA)
    theirs.load_state_dict(to_hf_state_dict(dense_state_dict(ours)), strict=True)
    ids = _ids(GQA, seq=20)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, theirs(ids).logits, atol=1e-5, rtol=1e-5)


def test_load_balancing_loss_matches_transformers_for_one_layer():
    cfg = ModelConfig(**{**GQA.__dict__, "num_layers": 1, "norm_topk_prob": False})
    ours = _model(cfg)
    theirs = _hf_model(cfg)
    theirs.load_state_dict(to_hf_state_dict(dense_state_dict(ours)), strict=True)
    ids = _ids(cfg, batch=1)
    with torch.no_grad():
        out = ours(ids, labels=ids)
        hf = theirs(ids, output_router_logits=True)
    torch.testing.assert_close(out.lb_loss, hf.aux_loss.float(), atol=1e-6, rtol=1e-5)


def test_hf_state_dict_round_trip_is_identical():
    model = _model(TINY)
    ours = dense_state_dict(model)
    hf = to_hf_state_dict(ours)
    assert hf["model.layers.1.mlp.experts.gate_up_proj"].shape == (8, 2 * 256, 128)
    assert hf["model.layers.1.mlp.experts.down_proj"].shape == (8, 128, 256)
    assert not any(".shards." in k for k in hf)
    back = from_hf_state_dict(hf, num_shards=4)
    assert sorted(back) == sorted(ours)
    for name, tensor in ours.items():
        assert torch.equal(back[name], tensor), name
    with pytest.raises(ValueError, match="gate_up_proj"):
        from_hf_state_dict(hf, num_shards=3)


def test_expert_order_follows_shards():
    model = _model(TINY)
    hf = to_hf_state_dict(dense_state_dict(model))
    fused = hf["model.layers.0.mlp.experts.gate_up_proj"]
    for shard in range(4):
        part = model.model.layers[0].mlp.shards[shard]
        assert torch.equal(fused[part.start : part.start + part.n], part.gate_up.detach())


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_hf_weights_load_into_ours_with_same_logits(name):
    cfg = CONFIGS[name]
    torch.manual_seed(5)
    theirs = _hf_model(cfg)
    assert from_hf_config(theirs.config) == ModelConfig(**{**cfg.__dict__, "z_loss": 1e-3, "lb_loss": 0.01})
    ours = _model(cfg, seed=6)
    apply_ownership(ours, [1], "fp32")
    load_dense_state_dict(ours, from_hf_state_dict(theirs.state_dict(), ours.num_shards))
    ids = _ids(cfg, seed=3)
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(ids).logits, theirs(ids).logits, atol=1e-5, rtol=1e-5)


def test_load_dense_state_dict_rejects_missing_tensors():
    model = _model(TINY)
    state = dense_state_dict(model)
    state.pop("model.layers.0.mlp.shards.2.down")
    with pytest.raises(ValueError, match="shards.2.down"):
        load_dense_state_dict(_model(TINY), state)


def test_analytic_param_count_matches_model():
    for cfg in (TINY, GQA):
        model = _model(cfg)
        counts = analytic_param_count(cfg)
        assert num_params(model) == counts["total"]
        assert sum(p.numel() for p in shared_parameters(model).values()) == counts["shared"]


@pytest.mark.parametrize("frozen_dtype", ["fp32", "bf16", "int8"])
def test_frozen_storage(frozen_dtype):
    model = _model(TINY)
    before = {k: v.clone() for k, v in dense_state_dict(model).items()}
    apply_ownership(model, [1], frozen_dtype)
    assert owned_shards(model) == [1]

    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    shared = {name for name in before if not is_expert_name(name)}
    owned = set(shard_tensors(model, 1))
    assert trainable == shared | owned
    assert {name for name, _ in model.named_parameters()} == trainable

    storage = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}[frozen_dtype]
    buffers = dict(model.named_buffers())
    for layer_index, layer in enumerate(model.model.layers):
        for index, shard in enumerate(layer.mlp.shards):
            for kind in ("gate_up", "down"):
                name = f"model.layers.{layer_index}.mlp.shards.{index}.{kind}"
                tensor = getattr(shard, kind)
                if index == 1:
                    assert isinstance(tensor, torch.nn.Parameter) and tensor.dtype == torch.float32
                    assert torch.equal(tensor.detach(), before[name])
                    continue
                assert name in buffers and not tensor.requires_grad and tensor.grad is None
                assert tensor.dtype == storage
                restored = shard.dense()[0 if kind == "gate_up" else 1]
                error = (restored - before[name]).abs()
                if frozen_dtype == "fp32":
                    assert torch.equal(restored, before[name])
                elif frozen_dtype == "bf16":
                    assert torch.all(error <= before[name].abs() * 2**-8)
                else:
                    row_max = before[name].abs().amax(dim=-1, keepdim=True)
                    assert torch.all(error <= row_max / 254 + 1e-7)
                    assert error.max() > 0

    ids = _ids(TINY)
    out = model(ids, labels=ids)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    for name, p in model.named_parameters():
        assert p.grad is not None, name


def test_ownership_changes_keep_values_and_reject_bad_shards():
    model = _model(TINY)
    before = dense_state_dict(model)
    before = {k: v.clone() for k, v in before.items()}
    apply_ownership(model, [0], "bf16")
    apply_ownership(model, [2, 3], "bf16")
    assert owned_shards(model) == [2, 3]
    for shard in (0, 3):
        for name, tensor in shard_tensors(model, shard).items():
            assert torch.equal(tensor, before[name].bfloat16().float()), name
    apply_ownership(model, [0, 1, 2, 3])
    assert len(list(model.buffers())) == 0
    with pytest.raises(ValueError, match="shard"):
        apply_ownership(model, [4])


def test_gradients_through_frozen_experts_equal_trainable_ones():
    ids = _ids(TINY, seq=24)
    grads = []
    for owned in ([0], [0, 1, 2, 3]):
        model = _model(TINY)
        apply_ownership(model, owned, "fp32")
        model(ids, labels=ids).loss.backward()
        grads.append({name: p.grad.clone() for name, p in shared_parameters(model).items()})
    assert sorted(grads[0]) == sorted(grads[1])
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-7, rtol=1e-5, msg=name)


def test_router_rows_of_frozen_experts_get_gradient():
    model = _model(TINY)
    apply_ownership(model, [0], "int8")
    ids = _ids(TINY, seq=24)
    model(ids, labels=ids).loss.backward()
    per_shard = TINY.num_experts // 4
    for layer in model.model.layers:
        grad = layer.mlp.gate.weight.grad
        frozen_rows = grad[per_shard:]
        assert torch.all(frozen_rows.abs().sum(dim=-1) > 0)
        assert layer.mlp.shards[1].gate_up.grad is None


def test_loss_terms_match_direct_formula():
    cfg = TINY
    model = _model(cfg)
    ids = _ids(cfg, seq=30)
    inputs, labels = ids[:, :-1], ids[:, 1:]
    with torch.no_grad():
        out = model(inputs, labels=labels)
        router = _router_logits(model, inputs)
    assert len(router) == cfg.num_layers
    z_terms, lb_terms = [], []
    for logits in router:
        assert logits.shape == (inputs.numel(), cfg.num_experts)
        z_terms.append(torch.logsumexp(logits.double(), dim=-1).pow(2).mean())
        probs = torch.softmax(logits.double(), dim=-1)
        chosen = probs.topk(cfg.top_k, dim=-1).indices
        routed = torch.zeros_like(probs).scatter_(1, chosen, 1.0)
        fraction = routed.mean(dim=0)
        lb_terms.append(cfg.num_experts * (fraction * probs.mean(dim=0)).sum())
    z = torch.stack(z_terms).mean()
    lb = torch.stack(lb_terms).mean()
    ce = torch.nn.functional.cross_entropy(out.logits.double().flatten(0, 1), labels.flatten())
    torch.testing.assert_close(out.z_loss.double(), z, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out.lb_loss.double(), lb, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out.ce_loss.double(), ce, atol=1e-6, rtol=1e-5)
    total = ce + cfg.z_loss * z + cfg.lb_loss * lb
    torch.testing.assert_close(out.loss.double(), total, atol=1e-6, rtol=1e-5)
    assert out.lb_loss > 0.5 and out.z_loss > 0


def test_loss_terms_at_a_uniform_router():
    cfg = TINY
    model = _model(cfg)
    for layer in model.model.layers:
        torch.nn.init.zeros_(layer.mlp.gate.weight)
    ids = _ids(cfg, seq=16)
    out = model(ids, labels=ids)
    torch.testing.assert_close(out.z_loss, torch.tensor(torch.log(torch.tensor(8.0)).item() ** 2))
    torch.testing.assert_close(out.lb_loss, torch.tensor(float(cfg.top_k)))


@pytest.mark.parametrize("frozen_dtype", ["fp32", "bf16", "int8"])
def test_frozen_experts_backward_matches_dense_weights(frozen_dtype, monkeypatch):
    """Gradients through frozen experts (rebuilt from their stored form in backward) equal those of a plain
    linear layer on the dequantized weights, and activation memory keeps no dense copy of them."""
    from spes_node.model.moe import ExpertShard

    model = _model(TINY)
    apply_ownership(model, [1], frozen_dtype)
    ids = torch.randint(0, TINY.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))

    def grads():
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    def saved_bytes() -> int:
        """Bytes of the distinct storages autograd saves for backward in one forward pass. Each saved tensor is kept
        alive until the pass ends, so a storage freed mid-pass cannot hand its address to another one."""
        storages, kept = {}, []

        def pack(t):
            kept.append(t)
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(ids, labels=ids)
        return sum(storages.values())

    ours, ours_saved = grads(), saved_bytes()

    original = ExpertShard.linear

    def dense_linear(self, x, name, local):
        if self.trainable:
            return original(self, x, name, local)
        weight = self.dense()[0 if name == "gate_up" else 1][local]
        return torch.nn.functional.linear(x, weight.to(x.dtype))

    monkeypatch.setattr(ExpertShard, "linear", dense_linear)
    reference, reference_saved = grads(), saved_bytes()
    if frozen_dtype == "fp32":
        # the same storages up to a few small index tensors, far less than a dense copy of even one frozen matrix
        one_matrix = min(
            t[0].nbytes for m in model.modules() if isinstance(m, ExpertShard) for t in m.dense()
        )
        assert abs(ours_saved - reference_saved) < one_matrix // 4, (ours_saved, reference_saved, one_matrix)
    else:
        assert ours_saved < reference_saved, (ours_saved, reference_saved)
    assert ours.keys() == reference.keys() and any(".mlp.gate." in n for n in ours)
    for name in ours:
        torch.testing.assert_close(ours[name], reference[name], rtol=1e-5, atol=1e-6, msg=name)


def test_activation_checkpointing_gives_the_same_gradients():
    model = _model(TINY)
    apply_ownership(model, [1], "bf16")
    ids = torch.randint(0, TINY.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))

    def grads(checkpointing: bool) -> dict[str, torch.Tensor]:
        model.activation_checkpointing = checkpointing
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain, recomputed = grads(False), grads(True)
    assert plain.keys() == recomputed.keys()
    for name in plain:
        torch.testing.assert_close(recomputed[name], plain[name], rtol=1e-5, atol=1e-6, msg=name)
