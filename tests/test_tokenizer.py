import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import normalizers
from transformers import AutoTokenizer

from spes_node.daemon.data import TokenBatcher
from spes_node.model.tokenizer import (
    BYTE_TOKENIZER_FILE,
    BYTE_VOCAB_SIZE,
    ByteTokenizer,
    is_byte_tokenizer,
    load_tokenizer,
    training_tokenizer,
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


def test_the_training_tokenizer_of_bytes_is_the_byte_tokenizer_without_transformers(tok):
    light = training_tokenizer("bytes")
    assert isinstance(light, ByteTokenizer) and is_byte_tokenizer(light)
    assert len(light) == len(tok) and light.get_vocab() == tok.get_vocab()
    special = ("pad_token_id", "bos_token_id", "eos_token_id", "unk_token_id")
    assert [getattr(light, a) for a in special] == [getattr(tok, a) for a in special]
    for text in SAMPLES:
        ids = light(text, add_special_tokens=False)["input_ids"]
        assert ids == tok(text, add_special_tokens=False)["input_ids"] and light.decode(ids) == text
    assert light(SAMPLES)["input_ids"] == tok(SAMPLES, add_special_tokens=False)["input_ids"]
    assert light.decode([258, 97], skip_special_tokens=True) == tok.decode(
        [258, 97], skip_special_tokens=True
    )

    # the same batches from the default corpus as with transformers' tokenizer
    a = TokenBatcher("default", light, seq_len=64, batch_size=4, part=1, num_parts=2, seed=3)
    b = TokenBatcher("default", tok, seq_len=64, batch_size=4, part=1, num_parts=2, seed=3)
    for _ in range(5):
        assert torch.equal(a.next_batch(), b.next_batch())


def test_a_node_on_the_byte_tokenizer_does_not_import_transformers():
    check = (
        "import sys; import spes_node.daemon.node; from spes_node.model.tokenizer import training_tokenizer; "
        "training_tokenizer('bytes'); print(sorted(m for m in ('transformers', 'torch') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", check], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "['torch']", out.stdout


def test_the_training_tokenizer_of_another_spec_is_transformers_one(tmp_path):
    load_tokenizer("bytes").save_pretrained(tmp_path)
    loaded = training_tokenizer(str(tmp_path))
    assert not isinstance(loaded, ByteTokenizer) and is_byte_tokenizer(loaded)
    with pytest.raises(ValueError, match=r"^tokenizer: cannot load '/no/such/dir': "):
        training_tokenizer("/no/such/dir")
