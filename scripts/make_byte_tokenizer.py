"""Generate spes_node/assets/byte_tokenizer.json, the embedded byte-level tokenizer.

Ids 0..255 are the byte values; 256..259 are <|pad|>, <|bos|>, <|eos|>, <|unk|>. Tokens are spelled with
the GPT-2 byte-to-unicode alphabet so that the ByteLevel pre-tokenizer and decoder round-trip any UTF-8 text.

Usage: python scripts/make_byte_tokenizer.py [OUT]
"""

import sys
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

SPECIAL_TOKENS = ("<|pad|>", "<|bos|>", "<|eos|>", "<|unk|>")
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "spes_node" / "assets" / "byte_tokenizer.json"


def byte_alphabet() -> dict[int, str]:
    """The GPT-2 mapping from a byte to a printable unicode character (the ByteLevel pre-tokenizer's)."""
    printable = list(range(ord("!"), ord("~") + 1))
    printable += list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    mapping = {b: chr(b) for b in printable}
    shift = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shift)
            shift += 1
    return mapping


def build() -> Tokenizer:
    vocab = {char: byte for byte, char in byte_alphabet().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tokenizer


def check(tokenizer: Tokenizer) -> None:
    assert tokenizer.get_vocab_size(with_added_tokens=True) == 256 + len(SPECIAL_TOKENS)
    for i, token in enumerate(SPECIAL_TOKENS):
        assert tokenizer.token_to_id(token) == 256 + i, token
    sample = "Aé\x00 \n\tz ünïcødé 漢字 🤖 \x7f~"
    ids = tokenizer.encode(sample).ids
    assert ids == list(sample.encode("utf-8")), ids
    assert tokenizer.decode(ids) == sample


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_OUT
    tokenizer = build()
    check(tokenizer)
    out.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out), pretty=True)
    check(Tokenizer.from_file(str(out)))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
