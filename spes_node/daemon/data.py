"""Training data: a document source read through `datasets`, split into parts, packed into token sequences.

A data spec names the source:
  "default"                       the Python standard library's own .py files (present on every machine)
  "hf:NAME[:CONFIG][@SPLIT]"      a Hugging Face dataset, streamed
  "PATH"                          a local .parquet/.jsonl/.json/.txt file, a directory of them, or a glob
and "SPEC#COLUMN" picks the text column (default "text").

A source has F files (datasets' shards: the files of a local or hub dataset, the modules of the default corpus).
Document i of file f has the number g = i * F + f (files interleaved). Document 0 and a stable pseudo-random
`val_fraction` of the others are held out for validation; a training document belongs to part `g % num_parts`.
A part's documents lie only in the files f with f = part (mod gcd(F, num_parts)), and a node opens only those
files: with F a multiple of num_parts each node reads 1/num_parts of the dataset, never the whole stream (with F
and num_parts coprime, e.g. one file, it reads every file and keeps its documents). A part's documents are
shuffled within windows of `SHUFFLE_WINDOW` documents (seeded by seed, epoch and window), tokenized, each followed
by eos, concatenated across documents and epochs, and cut into sequences of seq_len + 1 tokens. The position in
that stream (file, the file's datasets state, documents read in it) is the loader state.
"""

import copy
import glob
import logging
import math
import os
import random
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import datasets
import numpy as np
import torch

from spes_node.model.tokenizer import is_byte_tokenizer

logger = logging.getLogger(__name__)

SHUFFLE_WINDOW = 256
"""Documents of one part shuffled together; a window is read from the source in one go."""
DEFAULT_CORPUS_FILES = 60
"""The default corpus's modules in this many files: a divisor of 1-6, 10, 12, 15, 20, 30 and 60 nodes' parts."""
ENCODE_CHUNK = 16
"""Documents tokenized in one call of a (non-byte) tokenizer."""
STATE_VERSION = 2
"""2: positions are (file, file state, index); 1 (one stream over all files) is not resumed."""

_FORMATS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".txt": "text"}
_EXCLUDED_STDLIB_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}
)
_MASK64 = (1 << 64) - 1

Encoder = Callable[[list[str]], list[np.ndarray]]


@dataclass(frozen=True)
class DataSpec:
    """A parsed data spec."""

    kind: str
    """"default", "hf" or "local"."""
    name: str = ""
    """Hub dataset id (hf) or path, directory or glob (local)."""
    config: str | None = None
    """Hub dataset config name (hf only)."""
    split: str = "train"
    """Hub dataset split (hf only)."""
    column: str = "text"
    """Column holding the document text."""

    @classmethod
    def parse(cls, spec: str) -> "DataSpec":
        text = spec.strip() if isinstance(spec, str) else ""
        if not text:
            raise ValueError("data: empty data spec")
        column = "text"
        if "#" in text:
            text, _, column = text.rpartition("#")
            if not column or not text:
                raise ValueError(f"data: bad spec '{spec}': expected SPEC#COLUMN")
        if text == "default":
            if column != "text":
                raise ValueError(f"data: bad spec '{spec}': the default corpus has only the 'text' column")
            return cls(kind="default")
        if text.startswith("hf:"):
            return cls._parse_hub(spec, text[3:], column)
        return cls(kind="local", name=text, column=column)

    @classmethod
    def _parse_hub(cls, spec: str, rest: str, column: str) -> "DataSpec":
        split = "train"
        if "@" in rest:
            rest, _, split = rest.rpartition("@")
            if not split:
                raise ValueError(f"data: bad spec '{spec}': empty split after '@'")
        name, _, config = rest.partition(":")
        if not name or any(c.isspace() for c in name) or ":" in config:
            raise ValueError(f"data: bad spec '{spec}': expected hf:NAME[:CONFIG][@SPLIT]")
        return cls(kind="hf", name=name, config=config or None, split=split, column=column)

    def describe(self) -> str:
        if self.kind == "default":
            return "the default corpus (Python standard library sources)"
        if self.kind == "hf":
            config = f":{self.config}" if self.config else ""
            return f"Hugging Face dataset '{self.name}{config}@{self.split}'"
        return f"'{self.name}'"


class TokenBatcher:
    """Endless training batches of one data part, resumable exactly through state_dict/load_state_dict."""

    def __init__(
        self,
        spec: str,
        tokenizer,
        seq_len: int,
        batch_size: int,
        part: int = 0,
        num_parts: int = 1,
        seed: int = 0,
        val_fraction: float = 0.02,
    ):
        if seq_len < 1:
            raise ValueError(f"seq_len must be at least 1, got {seq_len}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        _check_part(part, num_parts)
        _check_val_fraction(val_fraction)
        self.spec = spec
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = seed
        self.val_fraction = val_fraction
        self._eos = _eos_id(tokenizer)
        self._vocab_size = len(tokenizer)
        self._encode = make_encoder(tokenizer)
        self._source = _Source(DataSpec.parse(spec))
        self.part, self.num_parts = part, num_parts
        self.sequences = 0
        self._rewind(epoch=0)

    def next_batch(self) -> torch.LongTensor:
        """The next [batch_size, seq_len + 1] int64 batch; inputs are [:, :-1], labels [:, 1:]."""
        tokens = self._take(self.batch_size * (self.seq_len + 1))
        self.sequences += self.batch_size
        return torch.from_numpy(tokens.reshape(self.batch_size, self.seq_len + 1))

    @property
    def files_opened(self) -> set[int]:
        """The source's files (datasets' shards) this batcher has read from."""
        return set(self._source.files_opened)

    def state_dict(self) -> dict:
        """The stream position, JSON-serialisable; load_state_dict of it continues bit-identically."""
        return {
            "version": STATE_VERSION,
            "stream": self._identity(),
            "part": self.part,
            "num_parts": self.num_parts,
            "sequences": self.sequences,
            "epoch": self._epoch,
            "window": self._window,
            "file": self._window_start.file,
            "file_state": copy.deepcopy(self._window_start.file_state),
            "index": self._window_start.index,
            "doc": self._doc,
            "offset": self._offset,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from a state_dict; its part and num_parts replace the current ones."""
        if state.get("version") != STATE_VERSION or state.get("stream") != self._identity():
            logger.warning(
                "data: ignoring a loader state saved for another stream (%s); starting %s from the beginning",
                state.get("stream"),
                self._source.spec.describe(),
            )
            return
        _check_part(state["part"], state["num_parts"])
        self.part, self.num_parts = state["part"], state["num_parts"]
        self.sequences = state["sequences"]
        self._epoch = state["epoch"]
        self._window = state["window"]
        self._window_start = _Cursor(state["file"], copy.deepcopy(state["file_state"]), state["index"])
        self._docs = None
        self._rows = None
        self._doc = state["doc"]
        self._offset = state["offset"]

    def set_part(self, part: int, num_parts: int) -> None:
        """Read another part from now on.

        When one part's documents contain the other's (same part index, num_parts halved or doubled as nodes
        come and go, see `sharding.data_part`), the stream goes on from the next shuffle window: the rest of
        the current one, chosen by the old part, is left for this epoch. Otherwise it starts the new part at
        the start of the current epoch.
        """
        _check_part(part, num_parts)
        if (part, num_parts) == (self.part, self.num_parts):
            return
        logger.info("data: switching from part %d/%d to %d/%d", self.part, self.num_parts, part, num_parts)
        small, large = sorted((self.num_parts, num_parts))
        if large % small or part % small != self.part % small:
            self.part, self.num_parts = part, num_parts
            self._rewind(self._epoch)
            return
        if self._doc or self._offset:
            while self._docs is None:  # just restored: the window in progress is read again to find its end
                self._read_window()
            self._window += 1
            self._window_start = self._window_end
            self._doc = self._offset = 0
        self._docs = self._rows = None
        self.part, self.num_parts = part, num_parts

    def _identity(self) -> dict:
        return {
            "spec": self.spec,
            "seed": self.seed,
            "val_fraction": self.val_fraction,
            "window": SHUFFLE_WINDOW,
            "vocab_size": self._vocab_size,
            "eos": self._eos,
            "files": self._source.num_files,
        }

    def _rewind(self, epoch: int) -> None:
        self._epoch = epoch
        self._window = 0
        self._window_start = _Cursor(0, None, 0)
        self._docs: list[str] | None = None
        self._rows: list[np.ndarray | None] | None = None
        self._doc = 0
        self._offset = 0

    def _take(self, n: int) -> np.ndarray:
        pieces = []
        while n > 0:
            tokens = self._current_doc()
            piece = tokens[self._offset : self._offset + n]
            pieces.append(piece)
            n -= len(piece)
            self._offset += len(piece)
            if self._offset == len(tokens):
                self._next_doc()
        return np.concatenate(pieces)

    def _current_doc(self) -> np.ndarray:
        while self._docs is None:
            self._read_window()
        rows = self._rows
        if rows[self._doc] is None:
            stop = min(self._doc + ENCODE_CHUNK, len(self._docs))
            for i, ids in enumerate(self._encode(self._docs[self._doc : stop]), start=self._doc):
                rows[i] = np.append(ids, self._eos).astype(np.int64, copy=False)
        return rows[self._doc]

    def _next_doc(self) -> None:
        self._rows[self._doc] = None
        self._doc += 1
        self._offset = 0
        if self._doc == len(self._docs):
            self._window += 1
            self._window_start = self._window_end
            self._docs = None
            self._rows = None
            self._doc = 0

    def _read_window(self) -> None:
        cursor = self._window_start
        docs, self._window_end = self._source.read_part(
            cursor, SHUFFLE_WINDOW, self.part, self.num_parts, self.val_fraction
        )
        if not docs:
            if self._window == 0:
                raise ValueError(
                    f"data: part {self.part} of {self.num_parts} has no training documents in "
                    f"{self._source.spec.describe()}"
                )
            self._rewind(self._epoch + 1)
            return
        order = list(range(len(docs)))
        random.Random(_mix(self.seed, self._epoch, self._window, self.part, self.num_parts)).shuffle(order)
        self._docs = [docs[i] for i in order]
        self._rows = [None] * len(docs)


def validation_batches(
    spec: str, tokenizer, seq_len: int, batch_size: int, max_batches: int, val_fraction: float = 0.02
) -> list[torch.LongTensor]:
    """Up to max_batches batches of the held-out documents (files in order), the same for every part.

    Rows are full sequences of seq_len + 1 tokens; the last batch may have fewer rows.
    """
    if max_batches < 0:
        raise ValueError(f"max_batches must be >= 0, got {max_batches}")
    if seq_len < 1 or batch_size < 1:
        raise ValueError(f"seq_len and batch_size must be at least 1, got {seq_len} and {batch_size}")
    _check_val_fraction(val_fraction)
    if max_batches == 0:
        return []
    if val_fraction == 0:
        logger.warning("data: val_fraction is 0, there is no validation set")
        return []
    eos = _eos_id(tokenizer)
    encode = make_encoder(tokenizer)
    source = _Source(DataSpec.parse(spec))
    wanted = max_batches * batch_size * (seq_len + 1)
    chunks, have = [], 0
    texts = []
    for number, text in source.iter_all():
        if is_validation(number, val_fraction) and text:
            texts.append(text)
        if len(texts) == ENCODE_CHUNK:
            have += _append_encoded(chunks, encode(texts), eos)
            texts = []
        if have >= wanted:
            break
    if texts:
        have += _append_encoded(chunks, encode(texts), eos)
    rows = min(have, wanted) // (seq_len + 1)
    if rows == 0:
        logger.warning("data: the validation set of %s is shorter than one sequence", source.spec.describe())
        return []
    tokens = np.concatenate(chunks)[: rows * (seq_len + 1)].reshape(rows, seq_len + 1)
    return [torch.from_numpy(tokens[i : i + batch_size].copy()) for i in range(0, rows, batch_size)]


def is_validation(index: int, val_fraction: float) -> bool:
    """Whether document number `index` (see the module docstring) is held out: document 0 always, others with
    chance val_fraction."""
    if val_fraction <= 0:
        return False
    return index == 0 or _unit(index) < val_fraction


def make_encoder(tokenizer) -> Encoder:
    """Texts to token id arrays, without special tokens; plain UTF-8 bytes for the embedded byte tokenizer."""
    if is_byte_tokenizer(tokenizer):
        return _encode_bytes

    def encode(texts: list[str]) -> list[np.ndarray]:
        ids = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
        return [np.asarray(row, dtype=np.int64) for row in ids]

    return encode


def stdlib_files() -> tuple[Path, list[str]]:
    """The standard library directory and its .py files (relative, sorted): the default corpus."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in _EXCLUDED_STDLIB_DIRS]
        files.extend(os.path.relpath(os.path.join(directory, n), root) for n in names if n.endswith(".py"))
    return root, sorted(files)


@dataclass(frozen=True)
class _Cursor:
    """A position in the source: a file, that file's datasets state there (None: its start), and how many of the
    file's documents came before. File F (one past the last) is the end of the epoch."""

    file: int
    file_state: dict | None
    index: int


def part_files(num_files: int, part: int, num_parts: int) -> list[int]:
    """The files that hold documents of a part: f = part (mod gcd(num_files, num_parts))."""
    step = math.gcd(num_files, num_parts)
    return list(range(part % step, num_files, step))


class _Source:
    """The documents of one data spec as a streaming datasets.IterableDataset, checked when opened, read file by
    file (`IterableDataset.shard`), so that a part opens only its own files."""

    def __init__(self, spec: DataSpec):
        self.spec = spec
        self.dataset = _open(spec)
        self.num_files = max(1, self.dataset.n_shards)
        if spec.kind != "default":
            _check_first_document(self.dataset, spec)
        self.files_opened: set[int] = set()
        """Files this source has read from (what a node costs its storage or the hub)."""
        self._live: Iterator[tuple[int, str]] | None = None
        self._live_at: _Cursor | None = None
        self._live_file = None

    def _file(self, file: int) -> datasets.IterableDataset:
        if self.num_files == 1:
            return self.dataset
        return self.dataset.shard(num_shards=self.num_files, index=file, contiguous=True)

    def iter_file(self, file: int, state: dict | None, index: int) -> Iterator[tuple[int, str]]:
        """(index in the file, text) from a position; after each item, `self._live_file.state_dict()` is the
        position after it."""
        self.files_opened.add(file)
        dataset = self._live_file = self._file(file)
        if state is not None:
            dataset.load_state_dict(copy.deepcopy(state))
        for i, example in enumerate(dataset, start=index):
            yield i, example.get(self.spec.column) or ""

    def iter_all(self) -> Iterator[tuple[int, str]]:
        """(document number, text) of every document, file after file."""
        for file in range(self.num_files):
            for i, text in self.iter_file(file, None, 0):
                yield i * self.num_files + file, text

    def read_part(
        self, start: _Cursor, count: int, part: int, num_parts: int, val_fraction: float
    ) -> tuple[list[str], _Cursor]:
        """Up to `count` non-empty training documents of a part from `start`, and the cursor after them.

        Reading on from where the previous call ended continues the same iterator; any other start reopens the
        file at start.file_state. A start in a file without documents of the part moves to the part's next file.
        """
        files = [f for f in part_files(self.num_files, part, num_parts) if f >= start.file]
        docs: list[str] = []
        cursor = start
        for file in files:
            if file != cursor.file:
                cursor = _Cursor(file, None, 0)
            if self._live is None or self._live_at != cursor:
                self._live = self.iter_file(cursor.file, cursor.file_state, cursor.index)
            index = cursor.index
            for index, text in self._live:
                number = index * self.num_files + file
                if number % num_parts != part or is_validation(number, val_fraction) or not text:
                    continue
                docs.append(text)
                if len(docs) == count:
                    break
            else:  # the file is done
                cursor = _Cursor(file + 1, None, 0)
                self._live = self._live_at = None
                continue
            cursor = self._live_at = _Cursor(file, self._live_file.state_dict(), index + 1)
            return docs, cursor
        return docs, _Cursor(self.num_files, None, 0)


def _open(spec: DataSpec) -> datasets.IterableDataset:
    if spec.kind == "default":
        root, files = stdlib_files()
        if not files:
            raise ValueError(f"data: the default corpus is empty: no .py files under {root}")
        # DEFAULT_CORPUS_FILES groups of modules are the corpus's files (datasets' shards), so that a node reading
        # one part opens only its groups (see `part_files`)
        groups = min(DEFAULT_CORPUS_FILES, len(files))
        bounds = [len(files) * k // groups for k in range(groups + 1)]
        return datasets.IterableDataset.from_generator(
            _read_source_files,
            gen_kwargs={"root": str(root), "groups": [files[a:b] for a, b in zip(bounds, bounds[1:])]},
            features=datasets.Features({"text": datasets.Value("string")}),
        )
    if spec.kind == "hf":
        try:
            return datasets.load_dataset(spec.name, spec.config, split=spec.split, streaming=True)
        except Exception as exc:
            raise ValueError(f"data: cannot open {spec.describe()}: {_reason(exc)}") from exc
    builder, files = _local_files(spec.name)
    if builder == "text" and spec.column != "text":
        raise ValueError(
            f"data: column '{spec.column}' not found in {spec.describe()}: text files have 'text'"
        )
    options = {"sample_by": "document"} if builder == "text" else {}
    try:
        return datasets.load_dataset(builder, data_files=files, split="train", streaming=True, **options)
    except StopIteration as exc:
        raise ValueError(f"data: {spec.describe()} has no documents") from exc
    except Exception as exc:
        raise ValueError(f"data: cannot open {spec.describe()}: {_reason(exc)}") from exc


def _read_source_files(root: str, groups: list[list[str]]) -> Iterator[dict]:
    for path in (path for group in groups for path in group):
        try:
            with open(os.path.join(root, path), encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            logger.debug("data: skipping unreadable %s: %s", path, exc)
            continue
        yield {"text": text}


def _local_files(pattern: str) -> tuple[str, list[str]]:
    path = Path(pattern).expanduser()
    if glob.has_magic(pattern):
        files = sorted(f for f in glob.glob(str(path), recursive=True) if os.path.isfile(f))
        if not files:
            raise ValueError(f"data: no files match '{pattern}'")
    elif path.is_dir():
        files = sorted(str(f) for f in path.rglob("*") if f.is_file() and f.suffix in _FORMATS)
        if not files:
            raise ValueError(f"data: no {_format_list()} files in directory '{pattern}'")
    elif path.is_file():
        files = [str(path)]
    else:
        raise ValueError(f"data: no such file or directory: '{pattern}'")
    suffixes = {Path(f).suffix for f in files}
    unknown = sorted(suffixes - _FORMATS.keys())
    if unknown:
        raise ValueError(
            f"data: unsupported file type {unknown[0] or '(none)'} in '{pattern}'; expected {_format_list()}"
        )
    builders = {_FORMATS[s] for s in suffixes}
    if len(builders) > 1:
        raise ValueError(f"data: '{pattern}' mixes file types {', '.join(sorted(suffixes))}; use one type")
    for f in files:
        if not os.access(f, os.R_OK):
            raise ValueError(f"data: cannot read '{f}': permission denied")
    return builders.pop(), files


def _check_first_document(dataset: datasets.IterableDataset, spec: DataSpec) -> None:
    try:
        first = next(iter(dataset), None)
    except Exception as exc:
        raise ValueError(f"data: cannot read {spec.describe()}: {_reason(exc)}") from exc
    if first is None:
        raise ValueError(f"data: {spec.describe()} has no documents")
    if spec.column not in first:
        columns = ", ".join(sorted(first)) or "none"
        raise ValueError(f"data: column '{spec.column}' not found in {spec.describe()} (columns: {columns})")
    if first[spec.column] is not None and not isinstance(first[spec.column], str):
        kind = type(first[spec.column]).__name__
        raise ValueError(f"data: column '{spec.column}' in {spec.describe()} holds {kind}, not text")


def _append_encoded(chunks: list[np.ndarray], encoded: list[np.ndarray], eos: int) -> int:
    added = 0
    for ids in encoded:
        chunks.append(np.append(ids, eos).astype(np.int64, copy=False))
        added += len(ids) + 1
    return added


def _encode_bytes(texts: list[str]) -> list[np.ndarray]:
    return [
        np.frombuffer(t.encode("utf-8", errors="replace"), dtype=np.uint8).astype(np.int64) for t in texts
    ]


def _eos_id(tokenizer) -> int:
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise ValueError("tokenizer: has no eos token, which packing needs between documents")
    return int(eos)


def _check_part(part: int, num_parts: int) -> None:
    if num_parts < 1:
        raise ValueError(f"num_parts must be at least 1, got {num_parts}")
    if not 0 <= part < num_parts:
        raise ValueError(f"part must be in [0, {num_parts}), got {part}")


def _check_val_fraction(val_fraction: float) -> None:
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _unit(index: int) -> float:
    return _splitmix64(index) / 2.0**64


def _mix(*values: int) -> int:
    h = 0
    for v in values:
        h = _splitmix64(h ^ (v & _MASK64))
    return h


def _format_list() -> str:
    return ", ".join(_FORMATS)


def _reason(exc: Exception, limit: int = 300) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_data_spec(spec: str) -> DataSpec:
    """Parse a data spec and, for local files, check that they exist: a cheap check before a node starts."""
    parsed = DataSpec.parse(spec)
    if parsed.kind == "local":
        _local_files(parsed.name)
    return parsed
