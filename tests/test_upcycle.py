"""`spes-node init --upcycle-from`: tiny dense models built here (nothing downloaded) turned into OLMoE MoEs."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch
import transformers
from click.testing import CliRunner
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from spes_node.cli import main
from spes_node.config import load_config
from spes_node.model.hf_checkpoint import PROVENANCE_FILE, SPES_CONFIG_FILE, load_hf_weights
from spes_node.model.hf_interop import from_hf_config
from spes_node.model.moe import MoEForCausalLM
from spes_node.model.ownership import apply_ownership
from spes_node.model.tokenizer import load_tokenizer

DIMS = {
    "vocab_size": 260,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "initializer_range": 0.2,
    "bos_token_id": 257,
    "eos_token_id": 258,
    "pad_token_id": 256,
}
CONFIGS = {
    "llama": transformers.LlamaConfig,
    "qwen2": transformers.Qwen2Config,
    "qwen3": transformers.Qwen3Config,
    "olmo": transformers.OlmoConfig,
    "olmo2": transformers.Olmo2Config,
}


def make_dense(directory: Path, family: str, tokenizer: bool = True, seed: int = 0, **overrides) -> nn.Module:
    """A random dense model saved like a hub checkpoint; norms are random too, so that mapping them matters."""
    torch.manual_seed(seed)
    extra = {"head_dim": 16} if family == "qwen3" else {}
    config = CONFIGS[family](**{**DIMS, **extra, **overrides})
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(directory)
    if tokenizer:
        load_tokenizer("bytes").save_pretrained(directory)
    return model


def init(*args: str):
    return CliRunner().invoke(main, ["init", *args])


def upcycle(dense_dir: Path, out: Path, *args: str):
    result = init("--upcycle-from", str(dense_dir), "--out", str(out), *args)
    assert result.exit_code == 0, result.output
    return result


def identity_qk_norms(model: nn.Module) -> nn.Module:
    for layer in model.model.layers:
        layer.self_attn.q_norm, layer.self_attn.k_norm = nn.Identity(), nn.Identity()
    return model


def tokens(n: int = 40) -> torch.Tensor:
    return torch.randint(0, 260, (2, n), generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("router", ["normal", "zero", "orthogonal"])
def test_upcycled_model_is_the_dense_model_up_to_the_qk_norms(tmp_path, family, router):
    dense = make_dense(tmp_path / "dense", family)
    upcycle(
        tmp_path / "dense",
        tmp_path / "moe",
        "--experts",
        "4",
        "--top-k",
        "2",
        "--router",
        router,
        "--shards",
        "2",
    )

    moe, info = AutoModelForCausalLM.from_pretrained(tmp_path / "moe", output_loading_info=True)
    assert moe.config.model_type == "olmoe" and moe.config.num_experts == 4 and moe.config.norm_topk_prob
    assert not info["missing_keys"] and not info["unexpected_keys"]
    moe.eval()
    with torch.no_grad():
        real = moe(tokens()).logits
        exact = identity_qk_norms(moe)(tokens()).logits
        expected = dense(tokens()).logits
    torch.testing.assert_close(exact, expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(real, expected, atol=1e-2), "q/k norms of ones are not the identity"


@pytest.mark.parametrize("family", list(CONFIGS))
def test_every_family_maps_embeddings_attention_and_mlp(tmp_path, family):
    dense = make_dense(tmp_path / "dense", family)
    upcycle(tmp_path / "dense", tmp_path / "moe", "--experts", "4", "--top-k", "1")
    moe = AutoModelForCausalLM.from_pretrained(tmp_path / "moe").eval()
    notes = " ".join(json.loads((tmp_path / "moe" / PROVENANCE_FILE).read_text())["notes"])

    torch.testing.assert_close(moe.model.embed_tokens.weight, dense.model.embed_tokens.weight)
    torch.testing.assert_close(moe.lm_head.weight, dense.lm_head.weight)
    for ours, theirs in zip(moe.model.layers, dense.model.layers):
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            torch.testing.assert_close(
                getattr(ours.self_attn, proj).weight, getattr(theirs.self_attn, proj).weight
            )
        hidden = torch.randn(5, 3, DIMS["hidden_size"], generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            torch.testing.assert_close(ours.mlp(hidden), theirs.mlp(hidden), atol=1e-5, rtol=1e-4)
    attention = moe.model.layers[0].self_attn
    if family == "qwen3":
        dense_q = dense.model.layers[0].self_attn.q_norm.weight
        torch.testing.assert_close(attention.q_norm.weight, dense_q.repeat(4))
        assert "tiled" in notes
    elif family == "olmo2":
        torch.testing.assert_close(attention.q_norm.weight, dense.model.layers[0].self_attn.q_norm.weight)
        assert torch.equal(moe.model.layers[0].input_layernorm.weight, torch.ones(DIMS["hidden_size"]))
        assert "outputs" in notes
    else:
        assert torch.equal(attention.q_norm.weight, torch.ones(64)) and "set to ones" in notes
    if family in ("llama", "qwen2", "qwen3"):
        torch.testing.assert_close(
            moe.model.layers[1].input_layernorm.weight, dense.model.layers[1].input_layernorm.weight
        )
    with torch.no_grad():
        assert torch.isfinite(moe(tokens()).logits).all()


def test_noise_touches_the_requested_fraction_reproducibly(tmp_path):
    dense = make_dense(tmp_path / "dense", "llama")
    args = ["--experts", "4", "--top-k", "2", "--noise", "0.05", "--noise-fraction", "0.25", "--seed", "3"]
    upcycle(tmp_path / "dense", tmp_path / "a", *args)
    upcycle(tmp_path / "dense", tmp_path / "b", *args)
    a = AutoModelForCausalLM.from_pretrained(tmp_path / "a").model.layers[1].mlp.experts
    b = AutoModelForCausalLM.from_pretrained(tmp_path / "b").model.layers[1].mlp.experts
    assert torch.equal(a.gate_up_proj, b.gate_up_proj) and torch.equal(a.down_proj, b.down_proj)

    mlp = dense.model.layers[1].mlp
    gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach()
    changed = [(a.gate_up_proj[e] != gate_up).float().mean().item() for e in range(4)]
    assert all(0.2 < share < 0.3 for share in changed), changed
    assert not torch.equal(a.gate_up_proj[0], a.gate_up_proj[1])
    noise = (a.down_proj - mlp.down_proj.weight.detach()).flatten()
    assert 0.04 < noise[noise != 0].std().item() < 0.06


def test_router_initialisations(tmp_path):
    make_dense(tmp_path / "dense", "llama")
    upcycle(tmp_path / "dense", tmp_path / "zero", "--experts", "8", "--top-k", "2", "--router", "zero")
    upcycle(tmp_path / "dense", tmp_path / "orth", "--experts", "8", "--top-k", "2", "--router", "orthogonal")
    zero = AutoModelForCausalLM.from_pretrained(tmp_path / "zero").model.layers[0].mlp.gate.weight
    assert torch.equal(zero, torch.zeros(8, 64))
    orth = AutoModelForCausalLM.from_pretrained(tmp_path / "orth").model.layers[0].mlp.gate.weight
    gram = orth @ orth.T
    torch.testing.assert_close(gram, torch.eye(8) * gram[0, 0], atol=1e-5, rtol=1e-4)


def test_the_swarm_config_describes_the_checkpoint_and_a_node_can_start_from_it(tmp_path):
    make_dense(tmp_path / "dense", "qwen2", tie_word_embeddings=True)
    # transformers loads any tokenizer in a qwen2 directory as Qwen2Tokenizer, which normalises text
    args = ["--experts", "4", "--top-k", "2", "--shards", "2", "--preset", "tiny", "--tokenizer", "bytes"]
    upcycle(tmp_path / "dense", tmp_path / "moe", *args)

    cfg = load_config(tmp_path / "moe" / SPES_CONFIG_FILE)
    assert cfg.name == "upcycled-qwen2" and cfg.swarm.num_shards == 2 and cfg.data.tokenizer == "bytes"
    assert cfg.train.seq_len == 128 and cfg.swarm.sync_steps == 10
    assert cfg.model == from_hf_config(AutoConfig.from_pretrained(tmp_path / "moe"))
    provenance = json.loads((tmp_path / "moe" / PROVENANCE_FILE).read_text())
    assert provenance["source"] == "upcycle" and provenance["options"]["num_experts"] == 4

    model = MoEForCausalLM(cfg.model, cfg.swarm.num_shards)
    apply_ownership(model, [1], "fp32")
    load_hf_weights(model, tmp_path / "moe")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "moe").eval()
    with torch.no_grad():
        torch.testing.assert_close(model(tokens()).logits, hf(tokens()).logits, atol=1e-3, rtol=1e-3)

    apply_ownership(model, [0, 1])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batch = tokens(33)
    losses = []
    for _ in range(6):
        out = model(batch[:, :-1], labels=batch[:, 1:])
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
        losses.append(out.ce_loss.item())
    assert losses[-1] < losses[0] - 0.1, losses


def assert_one_line_error(result, fragment: str) -> None:
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("spes-node: error:") and fragment in lines[-1], result.stderr


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    make_dense(tmp_path / "dense", "llama")
    base = ["--upcycle-from", str(tmp_path / "dense"), "--out", str(tmp_path / "out")]
    assert_one_line_error(init(*base, "--experts", "4", "--top-k", "5"), "--top-k")
    assert_one_line_error(init(*base, "--experts", "6", "--top-k", "2"), "--shards")
    assert_one_line_error(
        init(*base, "--experts", "4", "--top-k", "2", "--noise-fraction", "2"), "--noise-fraction"
    )
    missing = ["--upcycle-from", str(tmp_path / "nowhere"), "--out", str(tmp_path / "out")]
    assert_one_line_error(init(*missing, "--experts", "4", "--top-k", "2"), "is not a directory")
    assert not (tmp_path / "out").exists()


def test_unsupported_architectures_are_refused(tmp_path):
    gpt2 = transformers.GPT2Config(vocab_size=260, n_embd=64, n_layer=1, n_head=4)
    AutoModelForCausalLM.from_config(gpt2).save_pretrained(tmp_path / "gpt2")
    result = init(
        "--upcycle-from",
        str(tmp_path / "gpt2"),
        "--experts",
        "4",
        "--top-k",
        "2",
        "--out",
        str(tmp_path / "o"),
    )
    assert_one_line_error(result, "'gpt2' models are not supported")

    make_dense(tmp_path / "wide", "qwen3", head_dim=32)
    result = init(
        "--upcycle-from",
        str(tmp_path / "wide"),
        "--experts",
        "4",
        "--top-k",
        "2",
        "--out",
        str(tmp_path / "o"),
    )
    assert_one_line_error(result, "head_dim 32")


def test_biases_are_dropped_with_a_warning(tmp_path):
    dense = make_dense(tmp_path / "dense", "qwen2")
    with torch.no_grad():
        dense.model.layers[0].self_attn.q_proj.bias.normal_()
    dense.save_pretrained(tmp_path / "dense")
    upcycle(tmp_path / "dense", tmp_path / "moe", "--experts", "4", "--top-k", "1")
    assert "biases dropped" in " ".join(json.loads((tmp_path / "moe" / PROVENANCE_FILE).read_text())["notes"])


def test_a_dense_model_without_tokenizer_needs_one_named(tmp_path):
    make_dense(tmp_path / "dense", "llama", tokenizer=False)
    base = [
        "--upcycle-from",
        str(tmp_path / "dense"),
        "--experts",
        "4",
        "--top-k",
        "2",
        "--out",
        str(tmp_path / "o"),
    ]
    assert_one_line_error(init(*base), "--tokenizer")
    upcycled = init(*base, "--tokenizer", "bytes")
    assert upcycled.exit_code == 0, upcycled.output
    assert load_config(tmp_path / "o" / SPES_CONFIG_FILE).data.tokenizer == "bytes"


@pytest.mark.swarm
def test_an_upcycled_model_founds_a_two_node_swarm_that_trains(tmp_path):
    """Issue 7's check: a tiny dense Llama, upcycled, founds a real 2-node swarm whose loss falls."""
    from swarm_utils import FAST, Swarm

    make_dense(tmp_path / "dense", "llama")
    args = ["--experts", "4", "--top-k", "2", "--shards", "2", "--preset", "tiny"]
    upcycle(tmp_path / "dense", tmp_path / "moe", *args)
    (tmp_path / "swarm").mkdir()
    swarm = Swarm(tmp_path / "swarm", run_id="upcycled")
    cfg = load_config(tmp_path / "moe" / SPES_CONFIG_FILE).replace(swarm={**FAST, "averaging_timeout": 20.0})
    config = tmp_path / "swarm-config.json"
    config.write_text(cfg.to_json())
    try:
        # the founder waits for the joiner: alone, it would train on at full speed for as long as the joiner takes
        # to start, and the joiner would join a model whose loss has little left to fall in three rounds
        swarm.start("founder", "--init-from", str(tmp_path / "moe"), "--wait-peers", "2", config=config)
        swarm.wait_for(lambda: any(n.state == "training" for n in swarm.nodes().values()), 120, "the founder")
        swarm.start("joiner", "--max-rounds", "3", "--wait-peers", "2", config=config)
        assert swarm.wait_exit("joiner", 240) == 0, swarm.log("joiner")[-3000:]
        swarm.procs["founder"].send_signal(signal.SIGTERM)
        assert swarm.wait_exit("founder", 60) == 0, swarm.log("founder")[-3000:]
    finally:
        swarm.close()
    assert "initial weights from" in swarm.log("founder")
    assert "downloaded the swarm state" in swarm.log("joiner")
    for name in ("founder", "joiner"):
        summary = swarm.summary(name)
        assert summary["last_loss"] < summary["first_loss"] - 0.5, (name, summary["loss_history"])
    assert any(r["shared_group"] == 2 for r in swarm.summary("joiner")["rounds"])
