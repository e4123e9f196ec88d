"""A look at an exported model: validation loss and perplexity on a data spec, and sampling from a prompt.

Both work on any Hugging Face causal LM directory (AutoModelForCausalLM + AutoTokenizer); for an export
(`spes-node export`) the swarm config beside the weights supplies the data spec, the sequence length and the
validation fraction of training, so that `eval` measures the same held-out documents the nodes do.
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:
    import torch

    from spes_node.config import SpesConfig

logger = logging.getLogger(__name__)


@dataclass
class EvalResult:
    loss: float
    """Mean next-token cross-entropy (nats per token)."""
    perplexity: float
    tokens: int
    batches: int


def load_model(model_dir: str | Path, device: str = "auto"):
    """(model in eval mode on the device, tokenizer) of a Hugging Face model directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from spes_node.devices import resolve_device
    from spes_node.errors import error_line

    path = Path(model_dir)
    if not path.is_dir():
        raise ValueError(f"--model: {path} is not a directory")
    target = resolve_device(device)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    except Exception as e:
        raise ValueError(f"--model: cannot load {path}: {error_line(e)}") from None
    return model.to(target).eval(), tokenizer


def swarm_config(model_dir: str | Path) -> SpesConfig | None:
    """The swarm config that an export or `spes-node init` writes beside the weights, if any."""
    from spes_node.config import load_config
    from spes_node.model.hf_checkpoint import SPES_CONFIG_FILE

    path = Path(model_dir) / SPES_CONFIG_FILE
    return load_config(path) if path.is_file() else None


def evaluate(model, batches: Iterable[torch.Tensor], progress: bool = True) -> EvalResult:
    """Token-weighted mean cross-entropy of predicting token t+1 from tokens 0..t over `batches` ([B, L+1])."""
    import torch
    import torch.nn.functional as F

    batches = list(batches)
    if not batches:
        raise ValueError("--data: no validation batches")
    device = next(model.parameters()).device
    total, tokens = 0.0, 0
    with torch.no_grad():
        for batch in _progress(batches, progress):
            batch = batch.to(device)
            logits = model(input_ids=batch[:, :-1]).logits.float()
            labels = batch[:, 1:]
            total += F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum"
            ).item()
            tokens += labels.numel()
    loss = total / tokens
    return EvalResult(loss=loss, perplexity=_exp(loss), tokens=tokens, batches=len(batches))


def _exp(x: float) -> float:
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


def _progress(items: list, enabled: bool) -> Iterator:
    if not enabled:
        yield from items
        return
    try:
        from tqdm.auto import tqdm
    except ImportError:
        for i, item in enumerate(items, 1):
            yield item
            click.echo(f"batch {i}/{len(items)}", err=True)
        return
    yield from tqdm(items, desc="eval", unit="batch", file=sys.stderr)


def generate_text(
    model, tokenizer, prompt: str, max_new_tokens: int = 64, temperature: float = 0.8, seed: int = 0
) -> str:
    """The continuation of `prompt` (without the prompt): sampled at `temperature`, greedy at 0."""
    import torch

    check_sampling(max_new_tokens, temperature)
    device = next(model.parameters()).device
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    if ids.shape[1] == 0:
        if tokenizer.bos_token_id is None:
            raise ValueError("--prompt: empty, and the tokenizer has no bos token to start from")
        ids = torch.tensor([[tokenizer.bos_token_id]])
    ids = ids.to(device)
    torch.manual_seed(seed)
    sampling = (
        {"do_sample": True, "temperature": temperature, "top_k": 0}
        if temperature > 0
        else {"do_sample": False}
    )
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.pad_token_id
            if tokenizer.pad_token_id is not None
            else tokenizer.eos_token_id,
            **sampling,
        )
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def check_sampling(max_new_tokens: int, temperature: float) -> None:
    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens: must be positive, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"--temperature: must be >= 0, got {temperature}")


def quiet_transformers() -> None:
    """No progress bars from transformers' loading: the CLI's output stays what the command prints."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
