"""`spes-node export`: a node's checkpoint or a live swarm as a Hugging Face OLMoE checkpoint, same logits."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from live_bytes import LiveBytes
from swarm_utils import run_captured
from transformers import AutoModelForCausalLM, AutoTokenizer

from spes_node.cli import main
from spes_node.config import SpesConfig, load_preset
from spes_node.daemon.checkpoint import CheckpointManager
from spes_node.daemon.export import load_checkpoint_weights, plan_downloads
from spes_node.model.hf_checkpoint import PROVENANCE_FILE, SPES_CONFIG_FILE, load_hf_weights
from spes_node.model.moe import MoEForCausalLM
from spes_node.model.ownership import apply_ownership, dense_state_dict, shard_tensors, shared_parameters
from spes_node.model.tokenizer import is_byte_tokenizer
from spes_node.swarm.records import NodeInfo

OWN_SHARD = 1


def tiny_config(frozen_dtype: str = "fp32", **model) -> SpesConfig:
    """The tiny preset with weights large enough that every tensor visibly moves the logits."""
    return load_preset("tiny").replace(model={"init_std": 0.1, **model}, swarm={"frozen_dtype": frozen_dtype})


def write_node_checkpoint(directory: Path, cfg: SpesConfig, seed: int = 0) -> MoEForCausalLM:
    """What a node leaves behind: its config.json and a checkpoint of `model.state_dict()`."""
    torch.manual_seed(seed)
    model = MoEForCausalLM(cfg.model, cfg.swarm.num_shards)
    apply_ownership(model, [OWN_SHARD], cfg.swarm.frozen_dtype)
    tensors = {k: v.detach().clone() for k, v in model.state_dict().items()}
    meta = {"config_hash": cfg.hash(), "shards": [OWN_SHARD], "round": 2, "step": 20, "peer_id": "QmTest"}
    CheckpointManager(directory).save(20, tensors, meta)
    (directory / "config.json").write_text(cfg.to_json())
    return model.eval()


def export(*args: str):
    return CliRunner().invoke(main, ["export", *args])


def assert_one_line_error(result, *fragments: str) -> None:
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("spes-node: error:"), result.stderr
    for fragment in fragments:
        assert fragment in lines[0]


@pytest.mark.parametrize("frozen_dtype", ["fp32", "bf16", "int8"])
def test_export_from_checkpoint_loads_in_transformers_with_the_same_logits(tmp_path, frozen_dtype):
    cfg = tiny_config(frozen_dtype)
    model = write_node_checkpoint(tmp_path / "node", cfg)
    if frozen_dtype != "fp32":
        assert model.model.layers[0].mlp.shards[0].gate_up.dtype != torch.float32
    out = tmp_path / "export"

    result = export("--checkpoint-dir", str(tmp_path / "node"), "--out", str(out))

    assert result.exit_code == 0, result.output
    hf, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert hf.config.model_type == "olmoe"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(tokens).logits, hf.eval()(tokens).logits
    assert ours.abs().max() > 1.0
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=1e-4)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert is_byte_tokenizer(tokenizer)
    assert hf.config.eos_token_id == tokenizer.eos_token_id == 258
    assert SpesConfig.from_dict(json.loads((out / SPES_CONFIG_FILE).read_text())).hash() == cfg.hash()
    provenance = json.loads((out / PROVENANCE_FILE).read_text())
    assert provenance["step"] == 20 and provenance["own_shards"] == [OWN_SHARD]


def test_export_of_tied_embeddings_and_grouped_query_attention(tmp_path):
    cfg = tiny_config("int8", tie_embeddings=True, num_kv_heads=2)
    model = write_node_checkpoint(tmp_path / "node", cfg, seed=3)
    result = export("--checkpoint-dir", str(tmp_path / "node"), "--out", str(tmp_path / "out"))
    assert result.exit_code == 0, result.output
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert hf.config.tie_word_embeddings and hf.config.num_key_value_heads == 2
    tokens = torch.randint(0, cfg.model.vocab_size, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, model(tokens).logits, atol=1e-4, rtol=1e-4)


def test_large_models_are_split_into_several_safetensors_files(tmp_path, monkeypatch):
    monkeypatch.setattr("spes_node.model.hf_checkpoint.MAX_SHARD_SIZE", "1MB")
    cfg = tiny_config("bf16")
    model = write_node_checkpoint(tmp_path / "node", cfg)
    assert export("--checkpoint-dir", str(tmp_path / "node"), "--out", str(tmp_path / "out")).exit_code == 0
    files = sorted(p.name for p in (tmp_path / "out").glob("model*.safetensors"))
    assert len(files) > 2 and (tmp_path / "out" / "model.safetensors.index.json").is_file()
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    tokens = torch.randint(0, cfg.model.vocab_size, (1, 24), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, model(tokens).logits, atol=1e-4, rtol=1e-4)


def test_load_hf_weights_restores_the_model_in_any_ownership(tmp_path):
    cfg = tiny_config("fp32")
    original = write_node_checkpoint(tmp_path / "node", cfg)
    assert export("--checkpoint-dir", str(tmp_path / "node"), "--out", str(tmp_path / "out")).exit_code == 0
    torch.manual_seed(123)
    restored = MoEForCausalLM(cfg.model, cfg.swarm.num_shards)
    apply_ownership(restored, [3], "fp32")
    load_hf_weights(restored, tmp_path / "out")
    for name, tensor in dense_state_dict(original).items():
        torch.testing.assert_close(dense_state_dict(restored)[name], tensor, atol=0, rtol=0)


def test_load_hf_weights_refuses_another_architecture(tmp_path):
    cfg = tiny_config()
    write_node_checkpoint(tmp_path / "node", cfg)
    assert export("--checkpoint-dir", str(tmp_path / "node"), "--out", str(tmp_path / "out")).exit_code == 0
    other = tiny_config(num_experts=16).model
    with pytest.raises(ValueError, match="model.num_experts"):
        load_hf_weights(MoEForCausalLM(other, 4), tmp_path / "out")


def test_export_refuses_a_non_empty_out_unless_forced_and_leaves_no_temporary_files(tmp_path):
    cfg = tiny_config()
    write_node_checkpoint(tmp_path / "node", cfg)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")

    refused = export("--checkpoint-dir", str(tmp_path / "node"), "--out", str(out))
    assert_one_line_error(refused, "--force")
    assert (out / "keep.txt").read_text() == "precious"

    forced = export("--checkpoint-dir", str(tmp_path / "node"), "--out", str(out), "--force")
    assert forced.exit_code == 0, forced.output
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["node", "out"]


def test_export_refuses_a_config_that_is_not_the_checkpoints(tmp_path):
    write_node_checkpoint(tmp_path / "node", tiny_config())
    (tmp_path / "node" / "config.json").write_text(tiny_config(num_layers=3).to_json())
    result = export("--checkpoint-dir", str(tmp_path / "node"), "--out", str(tmp_path / "out"))
    assert_one_line_error(result, "was written with config")
    assert not (tmp_path / "out").exists()


def test_export_takes_the_config_from_a_flag_when_the_checkpoint_dir_has_none(tmp_path):
    cfg = tiny_config("bf16")
    write_node_checkpoint(tmp_path / "node", cfg)
    (tmp_path / "node" / "config.json").rename(tmp_path / "swarm.json")

    missing = export("--checkpoint-dir", str(tmp_path / "node"), "--out", str(tmp_path / "out"))
    assert_one_line_error(missing, "config.json not found", "--config")

    config_flag = ["--config", str(tmp_path / "swarm.json")]
    given = export("--checkpoint-dir", str(tmp_path / "node"), *config_flag, "--out", str(tmp_path / "out"))
    assert given.exit_code == 0, given.output


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--checkpoint-dir", "{tmp}/nowhere"], "is not a directory"),
        (["--checkpoint-dir", "{tmp}"], "config.json not found"),
        ([], "either --checkpoint-dir or --peers"),
        (
            ["--checkpoint-dir", "{tmp}", "--peers", "/ip4/127.0.0.1/tcp/1"],
            "either --checkpoint-dir or --peers",
        ),
    ],
)
def test_export_bad_input_is_one_line_and_exit_2(tmp_path, args, fragment):
    result = export(*[a.format(tmp=tmp_path) for a in args], "--out", str(tmp_path / "out"))
    assert_one_line_error(result, fragment)


def test_export_of_an_empty_checkpoint_dir_says_so(tmp_path):
    (tmp_path / "config.json").write_text(tiny_config().to_json())
    result = export("--checkpoint-dir", str(tmp_path), "--out", str(tmp_path / "out"))
    assert_one_line_error(result, "no checkpoint in")


def test_checkpoint_weights_are_the_dequantized_frozen_experts(tmp_path):
    cfg = tiny_config("int8")
    model = write_node_checkpoint(tmp_path / "node", cfg)
    _, weights, _ = load_checkpoint_weights(tmp_path / "node")
    frozen = model.model.layers[1].mlp.shards[0]
    expected = frozen.gate_up.float() * frozen.gate_up_scale
    assert torch.equal(weights["model.layers.1.mlp.shards.0.gate_up"], expected)
    assert torch.equal(
        weights[f"model.layers.1.mlp.shards.{OWN_SHARD}.down"], model.model.layers[1].mlp.shards[1].down
    )


# ---------------------------------------------------------------------------------------------- live swarm


def node_info(peer: str, shards: list[int], round_: int = 3, state: str = "training", client: bool = False):
    return NodeInfo(peer_id=peer, shards=shards, round=round_, state=state, client_mode=client)


def test_plan_takes_each_shard_from_its_holders_most_advanced_first():
    nodes = {
        "A": node_info("A", [0], round_=3),
        "B": node_info("B", [1], round_=5),
        "C": node_info("C", [0], round_=4),
        "D": node_info("D", [1], state="joining"),
        "E": node_info("E", [1], client=True),
        # a fake record: no honest holder is that far ahead of the others
        "F": node_info("F", [1], round_=10**6),
    }
    plan = plan_downloads(nodes, num_shards=2)
    assert plan == {
        "shared": [("B", "shared"), ("C", "shared"), ("A", "shared")],
        "shard:0": [("C", "shard:0"), ("A", "shard:0")],
        "shard:1": [("B", "shard:1")],
    }


def test_plan_without_a_live_holder_fails_with_one_clear_line_or_takes_copies():
    nodes = {"A": node_info("A", [0]), "B": node_info("B", [2], state="leaving")}
    with pytest.raises(ValueError, match=r"^shards 1, 2, 3 of 4 have no live holder; pass --allow-copies"):
        plan_downloads(nodes, num_shards=4)
    plan = plan_downloads(nodes, num_shards=4, allow_copies=True)
    assert plan["shard:0"] == [("A", "shard:0")]
    assert plan["shard:2"] == [("A", "copy:2")]
    with pytest.raises(ValueError, match="no live node"):
        plan_downloads({"B": nodes["B"]}, num_shards=4)


def start_node(tmp_path: Path, name: str, cfg: SpesConfig, shard: int, peers: list[str] | None = None):
    from spes_node.daemon.node import Node, NodeOptions

    opts = NodeOptions(
        peers=peers or [],
        run_id="export",
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        shard=shard,
        checkpoint_dir=tmp_path / name,
        device="cpu",
    )
    node = Node(cfg, opts)
    try:
        node.startup()
    except BaseException:
        node.shutdown()
        raise
    return node


def shared_and_shard(model: MoEForCausalLM, shard: int) -> dict[str, torch.Tensor]:
    return {**shared_parameters(model), **shard_tensors(model, shard)}


@pytest.mark.swarm
@pytest.mark.timeout(120)
def test_export_from_a_single_live_node_needs_holders_or_copies(tmp_path):
    cfg = load_preset("tiny").replace(swarm={"wire_compression": "none"})
    node = start_node(tmp_path, "node0", cfg, shard=0)
    try:
        peers = ["--peers", node.visible_maddrs[0], "--run-id", "export"]
        refused = export(*peers, "--out", str(tmp_path / "out"))
        assert_one_line_error(refused, "shards 1, 2, 3 of 4 have no live holder")
        unknown = export(
            "--peers", node.visible_maddrs[0], "--run-id", "other", "--out", str(tmp_path / "out")
        )
        assert_one_line_error(unknown, "no swarm 'other'")
        assert not (tmp_path / "out").exists()

        copied = export(*peers, "--allow-copies", "--out", str(tmp_path / "out"))
        assert copied.exit_code == 0, copied.output
        hf = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
        tokens = torch.randint(0, cfg.model.vocab_size, (1, 32), generator=torch.Generator().manual_seed(4))
        with torch.no_grad():
            torch.testing.assert_close(
                hf(tokens).logits, node.model.eval()(tokens).logits, atol=1e-4, rtol=1e-4
            )
        parts = json.loads((tmp_path / "out" / PROVENANCE_FILE).read_text())["parts"]
        assert parts["shard:0"]["part"] == "shard:0" and parts["shard:3"]["part"] == "copy:3"
    finally:
        node.shutdown()


@pytest.mark.swarm
@pytest.mark.timeout(150)
def test_export_from_a_swarm_takes_each_shard_from_its_holder(tmp_path):
    cfg = load_preset("tiny").replace(swarm={"num_shards": 2, "wire_compression": "none"})
    nodes = [start_node(tmp_path, "node0", cfg, shard=0)]
    try:
        nodes.append(start_node(tmp_path, "node1", cfg, shard=1, peers=nodes[0].visible_maddrs))
        for index, node in enumerate(nodes):
            with torch.no_grad():
                for tensor in shared_and_shard(node.model, index).values():
                    tensor.add_(0.01 * (index + 1))
            node.sync.publish_snapshots(node.status.round)

        result = export(
            "--peers", nodes[0].visible_maddrs[0], "--run-id", "export", "--out", str(tmp_path / "out")
        )

        assert result.exit_code == 0, result.output
        parts = json.loads((tmp_path / "out" / PROVENANCE_FILE).read_text())["parts"]
        by_peer = {node.peer_id: node for node in nodes}
        expected = dense_state_dict(by_peer[parts["shared"]["peer_id"]].model)
        for shard, node in enumerate(nodes):
            assert parts[f"shard:{shard}"] == {"peer_id": node.peer_id, "part": f"shard:{shard}", "round": 0}
            expected.update(shard_tensors(node.model, shard))
        restored = MoEForCausalLM(cfg.model, cfg.swarm.num_shards)
        load_hf_weights(restored, tmp_path / "out")
        for name, tensor in dense_state_dict(restored).items():
            torch.testing.assert_close(tensor, expected[name], atol=0, rtol=0)
    finally:
        for node in reversed(nodes):
            node.shutdown()


@pytest.mark.swarm
@pytest.mark.timeout(180)
def test_a_one_round_node_run_exports_to_a_model_with_the_nodes_logits(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    join = [sys.executable, "-m", "spes_node.cli", "join", "--preset", "tiny", "--max-rounds", "1", "--device", "cpu",
            "--checkpoint-dir", str(tmp_path / "node"), "--host-maddrs", "/ip4/127.0.0.1/tcp/0"]  # fmt: skip
    node = run_captured(join, timeout=150, env=env)
    assert node.returncode == 0, node.stderr[-2000:]

    result = export("--checkpoint-dir", str(tmp_path / "node"), "--out", str(tmp_path / "out"))

    assert result.exit_code == 0, result.output
    checkpoint = CheckpointManager(tmp_path / "node").latest()
    cfg = load_preset("tiny")
    model = MoEForCausalLM(cfg.model, cfg.swarm.num_shards)
    apply_ownership(model, checkpoint.meta["shards"], cfg.swarm.frozen_dtype)
    model.load_state_dict(checkpoint.tensors)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 64), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, model.eval()(tokens).logits, atol=1e-4, rtol=1e-4)
    assert json.loads((tmp_path / "out" / PROVENANCE_FILE).read_text())["round"] == 1
    generated = CliRunner().invoke(
        main, ["generate", "--model", str(tmp_path / "out"), "--prompt", "import "]
    )
    assert generated.exit_code == 0 and len(generated.stdout) > len("import \n"), generated.output


def test_load_hf_weights_holds_one_layers_shard_at_a_time(tmp_path):
    """Read one tensor at a time from the files and loaded one layer's shard at a time: the host holds that shard's
    gate/up and down in fp32 with the pieces they are put together from, not the model (transformers'
    `from_pretrained` built the whole model in fp32 first)."""
    cfg = tiny_config("bf16")
    original = write_node_checkpoint(tmp_path / "node", cfg)
    assert export("--checkpoint-dir", str(tmp_path / "node"), "--out", str(tmp_path / "out")).exit_code == 0
    restored = MoEForCausalLM(cfg.model, cfg.swarm.num_shards)
    apply_ownership(restored, [0], "bf16")
    m = cfg.model
    layer_shard = 4 * (m.num_experts // cfg.swarm.num_shards) * 3 * m.expert_ffn * m.hidden_size
    # a frozen shard's old buffers go as its new ones come: the model's tensors count until they are freed
    with LiveBytes(restored.state_dict().values(), count_known=True) as live:
        load_hf_weights(restored, tmp_path / "out")
    whole = 4 * sum(t.numel() for t in dense_state_dict(original).values())
    beyond = live.peak - live.start
    assert beyond <= 2 * layer_shard < whole / 4, f"{beyond} bytes beyond the model ({layer_shard} a shard)"
    for name, tensor in dense_state_dict(original).items():
        expected = (
            tensor.to(torch.bfloat16).float()
            if ".mlp.shards." in name and ".shards.0." not in name
            else tensor
        )
        torch.testing.assert_close(dense_state_dict(restored)[name], expected, atol=0, rtol=0)


def test_load_hf_weights_reads_the_checkpoints_transformers_writes(tmp_path):
    """transformers' own `save_pretrained` (its layout of the experts, sharded files with an index) loads with the
    same logits."""
    from spes_node.model.hf_interop import to_hf_config

    cfg = tiny_config()
    torch.manual_seed(3)
    hf_model = AutoModelForCausalLM.from_config(to_hf_config(cfg.model)).eval()
    hf_model.save_pretrained(tmp_path / "hf", max_shard_size="200KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    model = MoEForCausalLM(cfg.model, cfg.swarm.num_shards)
    apply_ownership(model, [2], "fp32")
    load_hf_weights(model, tmp_path / "hf")
    tokens = torch.randint(0, cfg.model.vocab_size, (1, 24), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        torch.testing.assert_close(hf_model(tokens).logits, model.eval()(tokens).logits, atol=1e-4, rtol=1e-4)


def test_load_hf_weights_refuses_pickles_and_strays_in_one_line(tmp_path):
    from safetensors.torch import load_file, save_file

    cfg = tiny_config()
    write_node_checkpoint(tmp_path / "node", cfg)
    out = tmp_path / "out"
    assert export("--checkpoint-dir", str(tmp_path / "node"), "--out", str(out)).exit_code == 0
    model = MoEForCausalLM(cfg.model, cfg.swarm.num_shards)
    tensors = load_file(out / "model.safetensors")
    save_file({**tensors, "stray.weight": torch.zeros(2)}, out / "model.safetensors")
    with pytest.raises(ValueError, match="holds stray.weight, which the model has no place for") as failure:
        load_hf_weights(model, out)
    assert "\n" not in str(failure.value)
    del tensors["model.norm.weight"]
    save_file(tensors, out / "model.safetensors")
    with pytest.raises(ValueError, match="lacks model.norm.weight"):
        load_hf_weights(model, out)
    (out / "model.safetensors").rename(out / "pytorch_model.bin")
    with pytest.raises(ValueError, match="pickled weights are not read"):
        load_hf_weights(model, out)


@pytest.mark.parametrize("frozen_dtype", ["bf16", "int8"])
def test_a_model_made_without_drawing_takes_every_weight_from_the_checkpoint(tmp_path, frozen_dtype):
    """`--init-from` makes the model without drawing its weights: loading the checkpoint writes every one of them,
    so the model is the checkpoint's exactly (frozen shards at their storage precision)."""
    from spes_node.model.hf_checkpoint import save_hf_checkpoint
    from spes_node.model.initial import initial_model

    cfg = tiny_config(frozen_dtype)
    source = MoEForCausalLM(cfg.model, cfg.swarm.num_shards, seed=1)
    save_hf_checkpoint(cfg, dense_state_dict(source), tmp_path / "hf")
    apply_ownership(source, [1], frozen_dtype)
    made = initial_model(cfg.model, cfg.swarm.num_shards, 9, owned=[1], frozen_dtype=frozen_dtype, draw=False)
    load_hf_weights(made, tmp_path / "hf")
    theirs = source.state_dict()
    for name, tensor in made.state_dict().items():
        assert tensor.dtype == theirs[name].dtype and torch.equal(tensor, theirs[name]), name


def test_load_hf_weights_reads_experts_stored_fused(tmp_path):
    """A file of transformers' in-memory state dict (each layer's experts in one fused tensor, as
    `save_file(model.state_dict())` writes it) loads with the same logits, a layer's experts at a time."""
    from safetensors.torch import save_file

    from spes_node.model.hf_interop import to_hf_config

    cfg = tiny_config()
    torch.manual_seed(4)
    hf_model = AutoModelForCausalLM.from_config(to_hf_config(cfg.model)).eval()
    hf_model.config.save_pretrained(tmp_path / "hf")
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, tmp_path / "hf" / "model.safetensors")
    model = MoEForCausalLM(cfg.model, cfg.swarm.num_shards)
    apply_ownership(model, [1], "bf16")
    load_hf_weights(model, tmp_path / "hf")
    tokens = torch.randint(0, cfg.model.vocab_size, (1, 24), generator=torch.Generator().manual_seed(6))
    reference = MoEForCausalLM(cfg.model, cfg.swarm.num_shards)
    load_hf_weights(reference, tmp_path / "hf")
    with torch.no_grad():
        torch.testing.assert_close(
            hf_model(tokens).logits, reference.eval()(tokens).logits, atol=1e-4, rtol=1e-4
        )
    for name, tensor in dense_state_dict(reference).items():
        frozen = ".mlp.shards." in name and ".shards.1." not in name
        expected = tensor.to(torch.bfloat16).float() if frozen else tensor
        assert torch.equal(dense_state_dict(model)[name], expected), name
