"""Tokenizers: the embedded byte-level tokenizer, or any tokenizer that transformers can load."""

import functools
import logging
from pathlib import Path

from tokenizers import Tokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

BYTE_VOCAB_SIZE = 260
PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN = "<|pad|>", "<|bos|>", "<|eos|>", "<|unk|>"
BYTE_TOKENIZER_FILE = Path(__file__).parent.parent / "assets" / "byte_tokenizer.json"

# Characters that a normalizer, a prefix space or special-token matching would change.
_PROBE = "Aé e\u0301 ﬁ\x00\t\n  <|eos|>漢🤖"


def load_tokenizer(spec: str = "bytes") -> PreTrainedTokenizerFast:
    """The embedded byte tokenizer for "bytes", otherwise a local directory or hub id via AutoTokenizer."""
    if spec == "bytes":
        return _load_byte_tokenizer()
    if not spec or not spec.strip():
        raise ValueError(f"tokenizer: cannot load '{spec}': empty spec")
    if spec.startswith(("/", ".", "~")) and not Path(spec).expanduser().is_dir():
        raise ValueError(f"tokenizer: cannot load '{spec}': no such directory")
    try:
        return AutoTokenizer.from_pretrained(str(Path(spec).expanduser()) if spec.startswith("~") else spec)
    except Exception as exc:
        raise ValueError(f"tokenizer: cannot load '{spec}': {_reason(exc)}") from exc


def is_byte_tokenizer(tokenizer) -> bool:
    """True if the tokenizer maps text to exactly its UTF-8 bytes (the embedded one, possibly reloaded)."""
    try:
        if len(tokenizer) != BYTE_VOCAB_SIZE or tokenizer.get_vocab() != _byte_vocab():
            return False
        ids = tokenizer(_PROBE, add_special_tokens=False)["input_ids"]
    except Exception:
        return False
    return list(ids) == list(_PROBE.encode("utf-8"))


def _load_byte_tokenizer() -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_file=str(BYTE_TOKENIZER_FILE),
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        split_special_tokens=True,
    )


@functools.cache
def _byte_vocab() -> dict[str, int]:
    return Tokenizer.from_file(str(BYTE_TOKENIZER_FILE)).get_vocab(with_added_tokens=True)


def _reason(exc: Exception, limit: int = 300) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."
