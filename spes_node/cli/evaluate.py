"""`spes-node eval` and `spes-node generate`: held-out loss and samples of an exported model."""

from __future__ import annotations

import json
from dataclasses import asdict

import click

from spes_node.cli.support import option, user_errors
from spes_node.model.evaluate import (
    check_sampling,
    evaluate,
    generate_text,
    load_model,
    quiet_transformers,
    swarm_config,
)


@click.command("eval")
@option("--model", required=True, type=click.Path(file_okay=False), help="Hugging Face model directory.")
@option("--data", help="Data spec (default: the swarm config's, for an export).")
@option("--batches", default=16, show_default=True, type=click.IntRange(1), help="Validation batches.")
@option("--batch-size", default=8, show_default=True, type=click.IntRange(1), help="Sequences per batch.")
@option(
    "--seq-len", type=click.IntRange(1), help="Tokens per sequence (default: the swarm config's, or 512)."
)
@option("--device", default="auto", show_default=True, help="auto, cpu or cuda.")
@option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@user_errors
def eval_(model, data, batches, batch_size, seq_len, device, as_json) -> None:
    """Validation loss and perplexity of a model on the held-out part of a data spec."""
    from spes_node.config import DataConfig
    from spes_node.daemon.data import validation_batches
    from spes_node.logs import setup_logging

    setup_logging("WARNING")
    quiet_transformers()
    cfg = swarm_config(model)
    data = data or (cfg.data.source if cfg else None)
    if not data:
        raise ValueError("--data: required for a model without spes-config.json")
    seq_len = seq_len or (cfg.train.seq_len if cfg else 512)
    val_fraction = cfg.data.val_fraction if cfg else DataConfig().val_fraction
    hf_model, tokenizer = load_model(model, device)
    limit = getattr(hf_model.config, "max_position_embeddings", None)
    if limit is not None and seq_len > limit:
        raise ValueError(f"--seq-len: {seq_len} is longer than the model's {limit} positions")
    held_out = validation_batches(data, tokenizer, seq_len, batch_size, batches, val_fraction=val_fraction)
    if not held_out:
        raise ValueError(
            f"--data: the validation split of {data} is shorter than one sequence of {seq_len + 1}"
        )
    result = evaluate(hf_model, held_out, progress=not as_json)
    if as_json:
        click.echo(json.dumps({"model": str(model), "data": data, "seq_len": seq_len, **asdict(result)}))
        return
    rows = [
        ("model", str(model)),
        ("data", f"{data} (validation)"),
        ("batches", f"{result.batches} x {batch_size} x {seq_len}"),
        ("tokens", str(result.tokens)),
        ("loss", f"{result.loss:.4f}"),
        ("perplexity", f"{result.perplexity:.2f}"),
    ]
    for name, value in rows:
        click.echo(f"{name:<12}{value}")


@click.command("generate")
@option("--model", required=True, type=click.Path(file_okay=False), help="Hugging Face model directory.")
@option("--prompt", required=True, help="Text to continue.")
@option("--max-new-tokens", default=64, show_default=True, type=int)
@option("--temperature", default=0.8, show_default=True, type=float, help="0: greedy.")
@option("--seed", default=0, show_default=True, type=int)
@option("--device", default="auto", show_default=True, help="auto, cpu or cuda.")
@user_errors
def generate(model, prompt, max_new_tokens, temperature, seed, device) -> None:
    """Continue a prompt with a model: a quick look at what it learned."""
    from spes_node.logs import setup_logging

    setup_logging("WARNING")
    quiet_transformers()
    check_sampling(max_new_tokens, temperature)
    hf_model, tokenizer = load_model(model, device)
    click.echo(prompt + generate_text(hf_model, tokenizer, prompt, max_new_tokens, temperature, seed))
