import importlib.util
import json
from pathlib import Path

import pytest
from tokenizers import normalizers
from transformers import AutoTokenizer

from spes_node.model.tokenizer import (
    BYTE_TOKENIZER_FILE,
    BYTE_VOCAB_SIZE,
    is_byte_tokenizer,
    load_tokenizer,
)

SAMPLES = [
    "",
    "hello world",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\n",
    "déjà vu, naïve façade, Ærøskøbing",
    "漢字かなカナ 한국어 العربية עברית",
    "emoji 🤖🚀 and a ZWJ family 👨‍👩‍👧",
    "control \x00\x01\x7f chars",
    "literal special tokens <|eos|><|bos|><|pad|><|unk|> stay text",
    "e\u0301 vs é, ﬁ ligature",
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("bytes")


def test_byte_vocabulary_and_special_tokens(tok):
    assert BYTE_VOCAB_SIZE == 260
    assert len(tok) == BYTE_VOCAB_SIZE
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (256, 257, 258, 259)
    assert (tok.pad_token, tok.bos_token, tok.eos_token, tok.unk_token) == (
        "<|pad|>",
        "<|bos|>",
        "<|eos|>",
        "<|unk|>",
    )
    assert sorted(tok.get_vocab().values()) == list(range(BYTE_VOCAB_SIZE))


@pytest.mark.parametrize("text", SAMPLES)
def test_byte_round_trip(tok, text):
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text


def test_default_call_adds_no_special_tokens(tok):
    assert tok("ab")["input_ids"] == [97, 98]


def test_save_pretrained_and_auto_tokenizer_reload(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    assert len(reloaded) == BYTE_VOCAB_SIZE
    assert (reloaded.pad_token_id, reloaded.bos_token_id, reloaded.eos_token_id) == (256, 257, 258)
    for text in SAMPLES:
        ids = reloaded(text, add_special_tokens=False)["input_ids"]
        assert ids == list(text.encode("utf-8"))
        assert reloaded.decode(ids) == text
    assert is_byte_tokenizer(reloaded)
    via_spec = load_tokenizer(str(tmp_path))
    assert via_spec("x ü")["input_ids"] == list("x ü".encode())


def test_is_byte_tokenizer_rejects_a_changed_pipeline(tok, tmp_path):
    assert is_byte_tokenizer(tok)
    changed = load_tokenizer("bytes")
    changed.backend_tokenizer.normalizer = normalizers.Lowercase()
    assert not is_byte_tokenizer(changed)


@pytest.mark.parametrize("spec", ["", "./no/such/tokenizer/dir", "/no/such/tokenizer/dir"])
def test_unloadable_spec_raises(spec):
    with pytest.raises(ValueError, match=r"^tokenizer: cannot load '.*': "):
        load_tokenizer(spec)


def test_directory_without_tokenizer_raises(tmp_path):
    with pytest.raises(ValueError, match=rf"^tokenizer: cannot load '{tmp_path}': \S"):
        load_tokenizer(str(tmp_path))


def test_committed_asset_matches_generator_script():
    script = Path(__file__).resolve().parent.parent / "scripts" / "make_byte_tokenizer.py"
    spec = importlib.util.spec_from_file_location("make_byte_tokenizer", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    generated = json.loads(module.build().to_str())
    assert generated == json.loads(BYTE_TOKENIZER_FILE.read_text())
