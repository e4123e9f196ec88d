"""Tokenizers: the embedded byte-level tokenizer, or any tokenizer that transformers can load.

Training on the byte tokenizer needs nothing of transformers (`training_tokenizer`): the data pipeline encodes
UTF-8 bytes itself, so a node started on it does not import transformers (0.6-0.7 s of CPU at every start)."""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

BYTE_VOCAB_SIZE = 260
PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN = "<|pad|>", "<|bos|>", "<|eos|>", "<|unk|>"
BYTE_TOKENIZER_FILE = Path(__file__).parent.parent / "assets" / "byte_tokenizer.json"

# Characters that a normalizer, a prefix space or special-token matching would change.
_PROBE = "Aé e\u0301 ﬁ\x00\t\n  <|eos|>漢🤖"


def load_tokenizer(spec: str = "bytes") -> PreTrainedTokenizerFast:
    """The embedded byte tokenizer for "bytes", otherwise a local directory or hub id via AutoTokenizer."""
    from transformers import AutoTokenizer

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


def training_tokenizer(spec: str = "bytes") -> ByteTokenizer | PreTrainedTokenizerFast:
    """What the data pipeline needs of `spec`'s tokenizer: for "bytes", a `ByteTokenizer` (no transformers);
    otherwise `load_tokenizer(spec)`."""
    return ByteTokenizer() if spec == "bytes" else load_tokenizer(spec)


class ByteTokenizer:
    """The embedded byte tokenizer as the data pipeline uses it (length, vocabulary, special ids, encoding without
    special tokens, decoding), on the `tokenizers` library alone. Text that spells a special token stays text, as
    with `load_tokenizer("bytes")` (its `split_special_tokens`). For `save_pretrained` and the rest of
    transformers' API, `load_tokenizer("bytes")`."""

    pad_token, bos_token, eos_token, unk_token = PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN

    def __init__(self):
        self.backend_tokenizer = Tokenizer.from_file(str(BYTE_TOKENIZER_FILE))
        self.backend_tokenizer.encode_special_tokens = True
        ids = [self.backend_tokenizer.token_to_id(t) for t in (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)]
        self.pad_token_id, self.bos_token_id, self.eos_token_id, self.unk_token_id = ids

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def __call__(self, text: str | list[str], add_special_tokens: bool = False, **_) -> dict[str, list]:
        """{"input_ids": ids} of a text or ids of each of a list of texts; the byte tokenizer's post-processor
        adds no special tokens either way."""
        if isinstance(text, str):
            return {
                "input_ids": self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
            }
        encodings = self.backend_tokenizer.encode_batch(text, add_special_tokens=add_special_tokens)
        return {"input_ids": [e.ids for e in encodings]}

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


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
    from transformers import PreTrainedTokenizerFast

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
