"""`spes-node eval` and `spes-node generate` on an exported model."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from spes_node.cli import main
from spes_node.config import SpesConfig, load_preset
from spes_node.daemon.data import validation_batches
from spes_node.model.hf_checkpoint import SPES_CONFIG_FILE, save_hf_checkpoint
from spes_node.model.moe import MoEForCausalLM
from spes_node.model.ownership import dense_state_dict
from spes_node.model.tokenizer import load_tokenizer

DOCS = [f"document {i}: " + "the quick brown fox jumps over the lazy dog. " * (3 + i % 4) for i in range(40)]


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[Path, SpesConfig, MoEForCausalLM]:
    cfg = load_preset("tiny").replace(model={"init_std": 0.05})
    torch.manual_seed(0)
    model = MoEForCausalLM(cfg.model, cfg.swarm.num_shards).eval()
    out = tmp_path_factory.mktemp("export") / "model"
    save_hf_checkpoint(cfg, dense_state_dict(model), out)
    return out, cfg, model


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in DOCS))
    return path


def run(*args: str):
    return CliRunner().invoke(main, list(args))


def assert_one_line_error(result, fragment: str) -> None:
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("spes-node: error:") and fragment in lines[0], (
        result.stderr
    )


def test_eval_loss_is_the_models_own_validation_loss(exported, corpus):
    out, cfg, model = exported
    result = run("eval", "--model", str(out), "--data", str(corpus), "--batches", "2", "--batch-size", "2",
                 "--seq-len", "32", "--json")  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)

    batches = validation_batches(str(corpus), load_tokenizer("bytes"), 32, 2, 2, cfg.data.val_fraction)
    total = sum(model(b[:, :-1], labels=b[:, 1:]).ce_loss.item() * b[:, 1:].numel() for b in batches)
    tokens = sum(b[:, 1:].numel() for b in batches)
    assert report["tokens"] == tokens == 2 * 2 * 32 and report["batches"] == 2
    assert report["loss"] == pytest.approx(total / tokens, rel=1e-5)
    assert report["perplexity"] == pytest.approx(math.exp(report["loss"]), rel=1e-6)
    assert math.isfinite(report["loss"]) and report["loss"] > 0


def test_eval_takes_data_and_sequence_length_from_the_swarm_config(exported):
    out, cfg, _ = exported
    result = run("eval", "--model", str(out), "--batches", "1", "--batch-size", "1", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["data"] == cfg.data.source and report["seq_len"] == cfg.train.seq_len
    assert report["tokens"] == cfg.train.seq_len


def test_eval_prints_a_table(exported, corpus):
    out, _, _ = exported
    result = run("eval", "--model", str(out), "--data", str(corpus), "--batches", "1", "--seq-len", "16")
    assert result.exit_code == 0, result.output
    rows = dict(line.split(None, 1) for line in result.stdout.strip().splitlines())
    assert set(rows) == {"model", "data", "batches", "tokens", "loss", "perplexity"}
    assert math.isfinite(float(rows["loss"])) and rows["batches"].startswith("1 x")


def test_eval_bad_input_is_one_line_and_exit_2(exported, tmp_path, corpus):
    out, _, _ = exported
    assert_one_line_error(
        run("eval", "--model", str(tmp_path / "nowhere"), "--data", str(corpus)), "not a directory"
    )
    assert_one_line_error(
        run("eval", "--model", str(out), "--data", str(corpus), "--seq-len", "4096"), "--seq-len"
    )
    assert_one_line_error(
        run("eval", "--model", str(out), "--data", str(tmp_path / "none.txt")), "no such file"
    )
    bare = tmp_path / "bare"
    bare.mkdir()
    assert_one_line_error(run("eval", "--model", str(bare)), "--data: required")


def test_eval_of_a_too_short_validation_split_says_so(exported, tmp_path):
    out, _, _ = exported
    tiny = tmp_path / "tiny.jsonl"
    tiny.write_text(json.dumps({"text": "short"}) + "\n")
    assert_one_line_error(
        run("eval", "--model", str(out), "--data", str(tiny), "--seq-len", "64"), "shorter than"
    )


def test_generate_continues_the_prompt_reproducibly(exported):
    out, _, _ = exported
    args = ["generate", "--model", str(out), "--prompt", "def main(", "--max-new-tokens", "12"]
    greedy = run(*args, "--temperature", "0")
    assert greedy.exit_code == 0, greedy.output
    assert greedy.stdout.startswith("def main(") and len(greedy.stdout) > len("def main(\n")
    assert run(*args, "--temperature", "0", "--seed", "5").stdout == greedy.stdout

    sampled = [run(*args, "--temperature", "1.0", "--seed", str(seed)).stdout for seed in (1, 1, 2)]
    assert sampled[0] == sampled[1] != sampled[2]


def test_generate_bad_input_is_one_line_and_exit_2(exported, tmp_path):
    out, _, _ = exported
    assert_one_line_error(
        run("generate", "--model", str(out), "--prompt", "x", "--max-new-tokens", "0"), "--max-new"
    )
    assert_one_line_error(run("generate", "--model", str(tmp_path), "--prompt", "x"), "--model: cannot load")
    assert (out / SPES_CONFIG_FILE).is_file()
