import json
import re
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tokenizers import normalizers

from spes_node.daemon import data
from spes_node.daemon.data import DataSpec, TokenBatcher, is_validation, stdlib_files, validation_batches
from spes_node.daemon.placement import data_part
from spes_node.model.tokenizer import load_tokenizer
from spes_node.swarm.records import NodeInfo

EOS = 258
DOC_RE = re.compile(r"^doc-\d{4}( [a-z]+)*$")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("bytes")


def _doc_text(i: int) -> str:
    return f"doc-{i:04d}" + " abc" * (i % 7)


def _write_jsonl(path: Path, indices, column: str = "text") -> None:
    with open(path, "w") as f:
        for i in indices:
            f.write(json.dumps({column: _doc_text(i), "n": i}) + "\n")


@pytest.fixture
def corpus(tmp_path) -> Path:
    """60 unique documents in three jsonl files (three datasets shards)."""
    root = tmp_path / "corpus"
    root.mkdir()
    for k in range(3):
        _write_jsonl(root / f"part-{k}.jsonl", range(20 * k, 20 * k + 20))
    return root


def _number(n: int, files: int = 3, per_file: int = 20) -> int:
    """The document number (see `spes_node.daemon.data`) of doc n of the `corpus` fixture: files interleaved."""
    return (n % per_file) * files + n // per_file


def _segments(batches) -> list[str]:
    """Texts between eos tokens in a batch stream, dropping the unterminated tail."""
    flat = torch.cat([b.reshape(-1) for b in batches]).tolist()
    texts, current = [], []
    for t in flat:
        if t == EOS:
            texts.append(bytes(current).decode("utf-8"))
            current = []
        else:
            current.append(t)
    return texts


def _docs_seen(spec, tok, part, num_parts, batches=40, val_fraction=0.1) -> set[str]:
    b = TokenBatcher(
        spec, tok, seq_len=15, batch_size=4, part=part, num_parts=num_parts, val_fraction=val_fraction
    )
    return {s for s in _segments([b.next_batch() for _ in range(batches)]) if DOC_RE.match(s)}


# --- specs ---


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("default", DataSpec(kind="default")),
        ("hf:org/name", DataSpec(kind="hf", name="org/name")),
        ("hf:org/name:cfg@validation#body", DataSpec("hf", "org/name", "cfg", "validation", "body")),
        ("hf:name@test", DataSpec(kind="hf", name="name", split="test")),
        ("data/*.parquet#content", DataSpec(kind="local", name="data/*.parquet", column="content")),
        (" some/dir ", DataSpec(kind="local", name="some/dir")),
    ],
)
def test_parse_spec(spec, expected):
    assert DataSpec.parse(spec) == expected


@pytest.mark.parametrize(
    "spec, reason",
    [
        ("", "empty"),
        ("default#body", "only the 'text' column"),
        ("hf:", "hf:NAME"),
        ("hf:a:b:c", "hf:NAME"),
        ("hf:name@", "empty split"),
        ("#text", "SPEC#COLUMN"),
        ("file.jsonl#", "SPEC#COLUMN"),
    ],
)
def test_parse_bad_spec(spec, reason):
    with pytest.raises(ValueError, match=rf"^data: .*{re.escape(reason)}"):
        DataSpec.parse(spec)


# --- default corpus ---


def test_default_corpus_files():
    root, files = stdlib_files()
    assert len(files) > 100
    assert files == sorted(files)
    assert "os.py" in files and "json/decoder.py" in files
    parts = {p for f in files for p in Path(f).parts}
    assert not parts & {"site-packages", "test", "idlelib"}
    assert (root / files[0]).is_file()


def test_default_corpus_is_deterministic_and_real(tok):
    a = TokenBatcher("default", tok, seq_len=256, batch_size=8, part=1, num_parts=3, seed=5)
    b = TokenBatcher("default", tok, seq_len=256, batch_size=8, part=1, num_parts=3, seed=5)
    batches_a = [a.next_batch() for _ in range(20)]
    batches_b = [b.next_batch() for _ in range(20)]
    assert all(torch.equal(x, y) for x, y in zip(batches_a, batches_b, strict=True))
    root, files = stdlib_files()
    sources = {(root / f).read_text(encoding="utf-8") for f in files}
    complete = _segments(batches_a)[1:]
    assert complete and all(s in sources for s in complete)


def test_default_startup_is_fast(tok):
    start = time.perf_counter()
    b = TokenBatcher("default", tok, seq_len=128, batch_size=8)
    b.next_batch()
    assert time.perf_counter() - start < 2.0


def test_seed_changes_order(tok):
    first = [TokenBatcher("default", tok, 64, 4, seed=s).next_batch() for s in (0, 1)]
    assert not torch.equal(first[0], first[1])


# --- batches ---


def test_batch_shape_dtype_and_packing(tok, corpus):
    b = TokenBatcher(str(corpus), tok, seq_len=31, batch_size=3)
    x = b.next_batch()
    assert x.shape == (3, 32) and x.dtype == torch.int64
    assert int(x.min()) >= 0 and int(x.max()) <= EOS
    y = b.next_batch()
    stream = torch.cat([x.reshape(-1), y.reshape(-1)]).tolist()
    assert stream.count(EOS) >= 2
    assert all(DOC_RE.match(s) for s in _segments([x, y]))


def test_loops_forever_over_epochs(tok, tmp_path):
    _write_jsonl(tmp_path / "small.jsonl", range(5))
    b = TokenBatcher(str(tmp_path / "small.jsonl"), tok, seq_len=7, batch_size=2)
    seen = Counter(s for s in _segments([b.next_batch() for _ in range(60)]))
    train = {_doc_text(i) for i in range(5) if not is_validation(i, 0.02)}
    assert set(seen) == train
    assert min(seen.values()) >= 3


# --- parts and validation ---


def test_parts_are_disjoint_and_cover_train_docs(tok, corpus):
    num_parts = 3
    seen = [_docs_seen(str(corpus), tok, p, num_parts) for p in range(num_parts)]
    for i in range(num_parts):
        for j in range(i + 1, num_parts):
            assert not seen[i] & seen[j]
    train = [i for i in range(60) if not is_validation(_number(i), 0.1)]
    for p in range(num_parts):
        assert seen[p] == {_doc_text(i) for i in train if _number(i) % num_parts == p}
    assert 10 < len(train) < 60


def test_validation_is_held_out_and_shared(tok, corpus):
    val_batches = validation_batches(
        str(corpus), tok, seq_len=15, batch_size=4, max_batches=100, val_fraction=0.1
    )
    val_docs = set(_segments(val_batches))
    expected_val = {_doc_text(i) for i in range(60) if is_validation(_number(i), 0.1)}
    assert _doc_text(0) in expected_val
    assert val_docs <= expected_val and len(val_docs) >= len(expected_val) - 1
    for p in range(2):
        assert not _docs_seen(str(corpus), tok, p, 2) & expected_val
    again = validation_batches(str(corpus), tok, seq_len=15, batch_size=4, max_batches=100, val_fraction=0.1)
    assert all(torch.equal(a, b) for a, b in zip(val_batches, again, strict=True))


def test_validation_batches_shape_and_order(tok, corpus):
    batches = validation_batches(str(corpus), tok, seq_len=7, batch_size=2, max_batches=3, val_fraction=0.1)
    assert len(batches) == 3
    assert all(b.shape == (2, 8) and b.dtype == torch.int64 for b in batches)
    expected = []
    for i in range(60):  # files in order
        if is_validation(_number(i), 0.1):
            expected += list(_doc_text(i).encode()) + [EOS]
    assert torch.cat([b.reshape(-1) for b in batches]).tolist() == expected[:48]


def test_validation_batches_bad_and_zero_arguments(tok, corpus):
    assert validation_batches(str(corpus), tok, seq_len=7, batch_size=2, max_batches=0) == []
    assert (
        validation_batches(str(corpus), tok, seq_len=7, batch_size=2, max_batches=3, val_fraction=0.0) == []
    )
    with pytest.raises(ValueError, match="^max_batches must"):
        validation_batches(str(corpus), tok, seq_len=7, batch_size=2, max_batches=-1)
    with pytest.raises(ValueError, match=r"^data: no such file"):
        validation_batches(str(corpus / "missing"), tok, seq_len=7, batch_size=2, max_batches=1)


def test_validation_has_at_least_one_document(tok, tmp_path):
    _write_jsonl(tmp_path / "tiny.jsonl", range(3))
    batches = validation_batches(str(tmp_path / "tiny.jsonl"), tok, seq_len=4, batch_size=8, max_batches=5)
    assert _segments(batches) == [] and batches
    assert bytes(torch.cat([b.reshape(-1) for b in batches]).tolist()).startswith(_doc_text(0)[:5].encode())
    train = _docs_seen(str(tmp_path / "tiny.jsonl"), tok, 0, 1, batches=10, val_fraction=0.02)
    assert train == {_doc_text(1), _doc_text(2)}


def test_default_validation_disjoint_from_train(tok):
    root, files = stdlib_files()
    val = validation_batches("default", tok, seq_len=512, batch_size=4, max_batches=2)
    assert len(val) == 2 and val[0].shape == (4, 513)
    head = (root / files[0]).read_text(encoding="utf-8").encode()
    assert bytes(val[0][0].tolist()).startswith(head[:513])
    train_docs = set(_segments([TokenBatcher("default", tok, 512, 4).next_batch() for _ in range(30)]))
    val_docs = set(_segments(validation_batches("default", tok, 512, 4, max_batches=100)))
    assert train_docs and val_docs and not train_docs & val_docs


def test_empty_part_raises(tok, tmp_path):
    _write_jsonl(tmp_path / "tiny.jsonl", range(3))
    b = TokenBatcher(str(tmp_path / "tiny.jsonl"), tok, seq_len=4, batch_size=1, part=3, num_parts=4)
    with pytest.raises(ValueError, match=r"^data: part 3 of 4 has no training documents"):
        b.next_batch()


def test_set_part(tok, corpus):
    b = TokenBatcher(str(corpus), tok, seq_len=15, batch_size=4, part=0, num_parts=2)
    for _ in range(3):
        b.next_batch()
    b.set_part(1, 2)
    fresh = TokenBatcher(str(corpus), tok, seq_len=15, batch_size=4, part=1, num_parts=2)
    assert torch.equal(b.next_batch(), fresh.next_batch())
    assert b.state_dict()["part"] == 1
    with pytest.raises(ValueError, match="part must be in"):
        b.set_part(2, 2)


def _doc_numbers(batches) -> list[int]:
    return [int(s[4:8]) for s in _segments(batches) if DOC_RE.match(s)]


def test_four_replicas_of_one_shard_read_disjoint_batches(tok, tmp_path):
    """Four holders of one shard (replication target 2) that started together: once they have seen each other's
    records, the batches they read share no document, and together they read every training document."""
    _write_jsonl(tmp_path / "docs.jsonl", range(200))
    peers = ["QmA", "QmB", "QmC", "QmD"]
    started = {peer: data_part({}, peer) for peer in peers}  # nobody has announced a part yet
    records = {
        peer: NodeInfo(peer_id=peer, shards=[0], state="training", data_part=started[peer][0])
        for peer in peers
    }
    settled = {peer: data_part(records, peer, current=started[peer][0]) for peer in peers}
    seen = {}
    for peer, (part, num_parts) in settled.items():
        b = TokenBatcher(
            str(tmp_path / "docs.jsonl"), tok, seq_len=15, batch_size=4, part=part, num_parts=num_parts, seed=0,
            val_fraction=0.1,
        )  # fmt: skip
        batches = [b.next_batch() for _ in range(30)]  # more than an epoch of a part
        assert len({tuple(row.tolist()) for batch in batches for row in batch}) > 20
        seen[peer] = set(_doc_numbers(batches))
    for i, a in enumerate(peers):
        for b in peers[i + 1 :]:
            assert not seen[a] & seen[b], (a, b, settled, sorted(seen[a] & seen[b])[:5])
    train = {i for i in range(200) if not is_validation(i, 0.1)}
    assert set().union(*seen.values()) == train


def _narrowed(
    tok, spec: str, old: tuple[int, int], new: tuple[int, int], before: int, after: int, restore: bool
):
    """Doc numbers read in `before` batches of part `old`, then in `after` batches once switched to `new`
    (by a batcher restored from the state at the switch, as a restarted node, with `restore`)."""
    b = TokenBatcher(spec, tok, seq_len=15, batch_size=4, part=old[0], num_parts=old[1], val_fraction=0.0)
    first = [b.next_batch() for _ in range(before)]
    if restore:
        state = json.loads(json.dumps(b.state_dict()))
        b = TokenBatcher(spec, tok, seq_len=15, batch_size=4, part=new[0], num_parts=new[1], val_fraction=0.0)
        b.load_state_dict(state)
    b.set_part(*new)
    assert (b.part, b.num_parts) == new
    return _doc_numbers(first), [b.next_batch() for _ in range(after)]


@pytest.mark.parametrize("restore", [False, True])
@pytest.mark.parametrize("old, new", [((1, 2), (1, 4)), ((1, 4), (1, 2))])
def test_set_part_narrower_or_wider_goes_on_where_it_was(tok, tmp_path, monkeypatch, old, new, restore):
    """num_parts halved or doubled for the same part (nodes came or went): the stream goes on after the
    current shuffle window instead of starting the epoch again; a restored batcher does the same."""
    monkeypatch.setattr(data, "SHUFFLE_WINDOW", 4)
    _write_jsonl(tmp_path / "docs.jsonl", range(400))
    spec = str(tmp_path / "docs.jsonl")
    before, after = _narrowed(tok, spec, old, new, 6, 6, restore)
    later = _doc_numbers(after)
    assert before and len(later) >= 8
    assert all(t % old[1] == old[0] for t in before)
    assert all(t % new[1] == new[0] for t in later), later
    assert min(later) > max(before), (before, later)
    # the restored batcher reads what the running one reads
    _, running = _narrowed(tok, spec, old, new, 6, 6, False)
    assert all(torch.equal(x, y) for x, y in zip(after, running))


# --- exact resume ---


def _check_resume(make, points, ahead=4):
    reference = make()
    states, batches = {}, []
    for k in range(max(points) + ahead):
        if k in points:
            states[k] = json.loads(json.dumps(reference.state_dict()))
        batches.append(reference.next_batch())
    for k in points:
        restored = make(for_restore=True)
        restored.load_state_dict(states[k])
        for j in range(ahead):
            assert torch.equal(restored.next_batch(), batches[k + j]), (k, j)


def test_resume_default_corpus(tok):
    def make(for_restore=False):
        # the restored batcher starts on another part: the state's part wins
        return TokenBatcher(
            "default", tok, seq_len=128, batch_size=8, part=1 - for_restore, num_parts=2, seed=7
        )

    _check_resume(make, points=[0, 1, 5, 37])


def test_resume_across_windows_shards_and_epochs(tok, corpus, monkeypatch):
    monkeypatch.setattr(data, "SHUFFLE_WINDOW", 4)

    def make(for_restore=False):
        return TokenBatcher(
            str(corpus), tok, seq_len=9, batch_size=2, part=1, num_parts=2, seed=3, val_fraction=0.1
        )

    _check_resume(make, points=list(range(0, 40, 3)))


def test_resume_parquet(tok, tmp_path):
    for k in range(2):
        texts = [_doc_text(i) for i in range(30 * k, 30 * k + 30)]
        pq.write_table(pa.table({"body": texts}), tmp_path / f"f{k}.parquet", row_group_size=7)

    def make(for_restore=False):
        return TokenBatcher(f"{tmp_path}/*.parquet#body", tok, seq_len=11, batch_size=2, val_fraction=0.1)

    _check_resume(make, points=[0, 2, 9, 17, 30])


def test_resume_is_fast_deep_into_the_stream(tok):
    b = TokenBatcher("default", tok, seq_len=512, batch_size=16)
    while b.state_dict()["epoch"] < 1:
        for _ in range(100):
            b.next_batch()
    state = b.state_dict()
    expected = b.next_batch()
    start = time.perf_counter()
    restored = TokenBatcher("default", tok, seq_len=512, batch_size=16)
    restored.load_state_dict(state)
    assert torch.equal(restored.next_batch(), expected)
    assert time.perf_counter() - start < 2.0


def test_state_for_another_stream_is_ignored(tok, corpus, caplog):
    a = TokenBatcher(str(corpus), tok, seq_len=15, batch_size=2, seed=1)
    a.next_batch()
    b = TokenBatcher(str(corpus), tok, seq_len=15, batch_size=2, seed=2)
    first = TokenBatcher(str(corpus), tok, seq_len=15, batch_size=2, seed=2).next_batch()
    b.load_state_dict(a.state_dict())
    assert "ignoring a loader state" in caplog.text
    assert torch.equal(b.next_batch(), first)


# --- local formats ---


def test_txt_files_one_document_per_file(tok, tmp_path):
    for i in range(6):
        (tmp_path / f"{i}.txt").write_text(f"{_doc_text(i)}\nsecond line ü\n")
    b = TokenBatcher(f"{tmp_path}/*.txt", tok, seq_len=63, batch_size=2, val_fraction=0.0)
    seen = set(_segments([b.next_batch() for _ in range(6)]))
    assert seen == {f"{_doc_text(i)}\nsecond line ü\n" for i in range(6)}


def test_jsonl_column_override_and_json_file(tok, tmp_path):
    _write_jsonl(tmp_path / "c.jsonl", range(8), column="body")
    seen = _docs_seen(f"{tmp_path / 'c.jsonl'}#body", tok, 0, 1, batches=10, val_fraction=0.0)
    assert seen == {_doc_text(i) for i in range(8)}
    (tmp_path / "arr.json").write_text(json.dumps([{"text": _doc_text(i)} for i in range(4)]))
    seen = _docs_seen(str(tmp_path / "arr.json"), tok, 0, 1, batches=10, val_fraction=0.0)
    assert seen == {_doc_text(i) for i in range(4)}


def test_hf_spec_reads_through_load_dataset(tok, tmp_path):
    _write_jsonl(tmp_path / "train.jsonl", range(8))
    seen = _docs_seen(f"hf:{tmp_path}", tok, 0, 1, batches=10, val_fraction=0.0)
    assert seen == {_doc_text(i) for i in range(8)}


def test_generic_tokenizer_path(tmp_path):
    lower = load_tokenizer("bytes")
    lower.backend_tokenizer.normalizer = normalizers.Lowercase()
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": "Hello WORLD"}) + "\n")
    b = TokenBatcher(str(tmp_path / "d.jsonl"), lower, seq_len=11, batch_size=1, val_fraction=0.0)
    assert b.next_batch().tolist() == [list(b"hello world") + [EOS]]


# --- bad input ---


@pytest.mark.parametrize(
    "make_spec, pattern",
    [
        (lambda p: str(p / "missing.jsonl"), r"no such file or directory: '.*missing\.jsonl'"),
        (lambda p: str(p / "nothing-*.jsonl"), "no files match"),
        (lambda p: str(p / "empty_dir"), "no .parquet, .jsonl, .json, .txt files in directory"),
        (lambda p: str(p / "t.csv"), "unsupported file type .csv"),
        (lambda p: str(p / "mixed"), "mixes file types"),
        (lambda p: f"{p / 'c.jsonl'}#body", r"column 'body' not found in .* \(columns: n, text\)"),
        (lambda p: f"{p / 'c.parquet'}#body", r"column 'body' not found in .* \(columns: text\)"),
        (lambda p: f"{p / 'c.jsonl'}#n", "column 'n' in .* holds int, not text"),
        (lambda p: f"{p / 'a.txt'}#body", "column 'body' not found"),
        (lambda p: str(p / "empty.jsonl"), "has no documents"),
        (lambda p: f"hf:{p / 'no-such-dataset'}", "cannot open Hugging Face dataset"),
    ],
)
def test_bad_data_raises_when_built(tok, tmp_path, make_spec, pattern):
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "t.csv").write_text("text\nx\n")
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "a.txt").write_text("x")
    _write_jsonl(tmp_path / "mixed" / "b.jsonl", range(2))
    _write_jsonl(tmp_path / "c.jsonl", range(3))
    pq.write_table(pa.table({"text": ["a", "b"]}), tmp_path / "c.parquet")
    (tmp_path / "a.txt").write_text("x")
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match=rf"^data: .*{pattern}"):
        TokenBatcher(make_spec(tmp_path), tok, seq_len=8, batch_size=2)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"seq_len": 0}, "seq_len"),
        ({"batch_size": 0}, "batch_size"),
        ({"part": 2, "num_parts": 2}, "part"),
        ({"num_parts": 0}, "num_parts"),
        ({"val_fraction": 1.0}, "val_fraction"),
    ],
)
def test_bad_arguments_name_the_field(tok, kwargs, field):
    args = {"seq_len": 8, "batch_size": 2, **kwargs}
    with pytest.raises(ValueError, match=rf"^{field} must"):
        TokenBatcher("default", tok, **args)


def test_tokenizer_without_eos_is_rejected(tok):
    no_eos = load_tokenizer("bytes")
    no_eos.eos_token = None
    with pytest.raises(ValueError, match="eos"):
        TokenBatcher("default", no_eos, seq_len=8, batch_size=2)


def test_stream_ids_are_bytes(tok, tmp_path):
    text = "naïve 🤖 <|eos|>"
    (tmp_path / "u.jsonl").write_text(json.dumps({"text": text}) + "\n")
    b = TokenBatcher(
        str(tmp_path / "u.jsonl"), tok, seq_len=len(text.encode()), batch_size=1, val_fraction=0.0
    )
    row = b.next_batch()[0].numpy()
    assert np.array_equal(row, np.array(list(text.encode()) + [EOS]))
    assert tok(text, add_special_tokens=False)["input_ids"] == row[:-1].tolist()


# --- streaming by node ---


@pytest.mark.parametrize("num_parts, opened_per_part", [(4, 2), (2, 4), (8, 1), (3, 8)])
def test_a_part_opens_only_its_files(tok, tmp_path, num_parts, opened_per_part):
    """8 files: with num_parts dividing 8 a part opens 8 / num_parts files (a node never streams the whole
    dataset); with num_parts coprime to 8 it opens all of them and keeps its documents. Either way the parts
    are disjoint and cover the training documents."""
    root = tmp_path / "eight"
    root.mkdir()
    for k in range(8):
        _write_jsonl(root / f"f{k}.jsonl", range(10 * k, 10 * k + 10))
    seen = []
    for part in range(num_parts):
        b = TokenBatcher(
            str(root), tok, seq_len=15, batch_size=4, part=part, num_parts=num_parts, val_fraction=0.1
        )
        batches = [b.next_batch() for _ in range(60)]  # more than an epoch of a part
        assert b.files_opened == set(data.part_files(8, part, num_parts))
        assert len(b.files_opened) == opened_per_part
        seen.append({s for s in _segments(batches) if DOC_RE.match(s)})
    for i in range(num_parts):
        for j in range(i + 1, num_parts):
            assert not seen[i] & seen[j]
    number = {i: _number(i, files=8, per_file=10) for i in range(80)}
    train = {_doc_text(i) for i in range(80) if not is_validation(number[i], 0.1)}
    assert set().union(*seen) == train
    for part in range(num_parts):
        assert seen[part] == {
            _doc_text(i) for i in range(80) if _doc_text(i) in train and number[i] % num_parts == part
        }


def test_old_loader_state_starts_the_part_again(tok, corpus):
    """A loader state of the single-stream format (version 1) is not resumed: the part starts from its beginning."""
    b = TokenBatcher(str(corpus), tok, seq_len=15, batch_size=4, part=0, num_parts=2)
    first = b.next_batch()
    b.next_batch()
    old = {**b.state_dict(), "version": 1}
    restarted = TokenBatcher(str(corpus), tok, seq_len=15, batch_size=4, part=0, num_parts=2)
    restarted.load_state_dict(old)
    assert torch.equal(restarted.next_batch(), first)
