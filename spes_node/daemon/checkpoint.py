"""Crash-safe checkpoints: model tensors, optimizer state and metadata as safetensors + JSON.

A checkpoint is the directory `DIR/step-00000123/` with `model.safetensors`, `optimizer.safetensors` (the
tensors of the nested optimizer state, see `flatten_state`) and `meta.json` (user metadata, the optimizer
structure with tensor placeholders, the sha256 and size of each file, the format version, and a checksum of
meta.json's own content). Nothing is pickled: checkpoint files may come from untrusted places.

Writes go to a temporary sibling directory that is renamed into place once every file is on disk, so a crash
leaves either the old set of checkpoints or the new one. Loading verifies every checksum and falls back to an
older checkpoint when the newest is damaged. A node writes from a `Snapshot` (CPU copies) on a background thread:
see `checkpoint_writer`.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import random
import re
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from spes_node.errors import SpesError
from spes_node.files import fsync_dir, replace_dir
from spes_node.tensor_file import TensorFile, TensorFileError, write_tensors

logger = logging.getLogger(__name__)

FORMAT = "spes-node-checkpoint"
FORMAT_VERSION = 1
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
META_FILE = "meta.json"

_STEP_DIR = re.compile(r"step-(\d{8,})")
_RETIRED_DIR = re.compile(r"\.old-step-(\d{8,})-[0-9a-f]+")
_TMP_PREFIX = ".tmp-"
_HASH_CHUNK = 1 << 22

_TENSOR = "__tensor__"
_TUPLE = "__tuple__"
_ITEMS = "__items__"


class CheckpointError(SpesError):
    """No checkpoint can be loaded although some exist, or the checkpoint directory cannot be used."""


class _Corrupt(Exception):
    """One checkpoint failed verification; the message says why, in one line."""


@dataclass
class Checkpoint:
    """A verified checkpoint. Its tensors are read from its files when they are looked up (`TensorFile`), so that
    a resume goes through them one at a time, on to the device that holds them."""

    step: int
    tensors: TensorFile
    """The model's tensors, by name."""
    meta: dict
    path: Path
    optimizer_structure: Any = None
    """`flatten_state`'s structure of the optimizer state; None without one."""
    optimizer_tensors: TensorFile | None = None

    @property
    def optimizer(self) -> dict | None:
        """The whole optimizer state on the CPU, read from the file at each access (`optimizer_part` reads one
        part of it, on to a device)."""
        if self.optimizer_structure is None:
            return None
        return unflatten_state(self.optimizer_structure, self.optimizer_tensors)

    def optimizer_part(self, key: str, device: torch.device | str = "cpu") -> Any:
        """Part `key` of the optimizer state (None when it has none), each tensor read on to `device` alone."""
        if not isinstance(self.optimizer_structure, dict) or key not in self.optimizer_structure:
            return None
        return unflatten_state(self.optimizer_structure[key], self.optimizer_tensors.to(device))


@dataclass
class Snapshot:
    """What one checkpoint will hold, taken off the live state: CPU tensors and JSON-safe metadata.

    Made by `take_snapshot` (copies, so that training may go on while it is written) and written by
    `CheckpointManager.write`, possibly on another thread."""

    step: int
    tensors: dict[str, torch.Tensor]
    meta: dict
    optimizer_structure: Any
    """`flatten_state`'s structure of the optimizer state; None without one."""
    optimizer_tensors: dict[str, torch.Tensor]
    nbytes: int
    """Bytes of the tensors (each copied storage counted once)."""
    seconds: float
    """What taking it cost the caller."""


def take_snapshot(
    step: int, tensors: dict[str, torch.Tensor], meta: dict, optimizer: dict | None = None, copy: bool = True
) -> Snapshot:
    """Copy what a checkpoint holds into new CPU tensors, each at its own dtype (fp32 weights and AdamW moments
    stay fp32, bf16 frozen experts stay bf16); a tensor named twice (tied weights) is copied once.

    This is all the training thread waits for; `CheckpointManager.write` does the rest. The copy lives until it is
    written. What it costs in host memory is the checkpoint's size: at spes-7b, a node holding 1 of 4 shards copies
    7.8 GiB of fp32 trainable weights and 15.5 GiB of fp32 AdamW moments (23.3 GiB), plus 9.0 GiB of bf16 frozen
    experts when those are saved (32.3 GiB; `plan.MemoryPlan.host_checkpoint`), plus the outer optimizer's state
    with `outer_optimizer = "nesterov"`.

    `copy=False`: the tensors themselves, wherever they are, for a caller that writes the snapshot before it
    changes them again (a node that writes in place: `CheckpointWriter.submit(in_place=True)`); the write copies a
    tensor on the training device to the host one at a time."""
    return _snapshot(step, tensors, meta, optimizer, copy=copy)


class CheckpointManager:
    """Saves checkpoints atomically into one directory, keeps the newest `keep`, loads the newest intact."""

    def __init__(self, directory: str | Path, keep: int = 3):
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep: expected an int >= 1, got {keep!r}")
        self.directory = Path(directory)
        self.keep = keep
        if self.directory.exists() and not self.directory.is_dir():
            raise CheckpointError(f"checkpoint directory {self.directory} exists and is not a directory")

    def save(
        self, step: int, tensors: dict[str, torch.Tensor], meta: dict, optimizer: dict | None = None
    ) -> Path:
        """Write checkpoint `step` (replacing one of the same step), prune beyond `keep`; returns its path.

        Reads the tensors as they are while it writes: a caller that goes on changing them writes a
        `take_snapshot` instead (`write`, or in the background with `CheckpointWriter`)."""
        return self.write(_snapshot(step, tensors, meta, optimizer, copy=False))

    def write(self, snapshot: Snapshot) -> Path:
        """Write a snapshot as checkpoint `snapshot.step`: serialisation, sha256, fsync, atomic rename, pruning."""
        step = snapshot.step
        self._ensure_directory()
        try:
            self._clean_leftovers()
        except OSError as e:
            raise CheckpointError(f"checkpoint directory {self.directory} is unusable: {os_reason(e)}") from e
        newer = [s for s in self._checkpoint_dirs() if s > step]
        if newer:
            logger.warning(
                "checkpoint step %d is written below newer step %d in %s; latest() prefers the newer one",
                step,
                max(newer),
                self.directory,
            )
        final = self.directory / _dir_name(step)
        tmp = self.directory / f"{_TMP_PREFIX}{final.name}-{uuid.uuid4().hex[:12]}"
        try:
            tmp.mkdir()
            files = {MODEL_FILE: write_tensors(tmp / MODEL_FILE, snapshot.tensors)}
            if snapshot.optimizer_structure is not None:
                files[OPTIMIZER_FILE] = write_tensors(tmp / OPTIMIZER_FILE, snapshot.optimizer_tensors)
            body = {
                "format": FORMAT,
                "version": FORMAT_VERSION,
                "step": step,
                "meta": snapshot.meta,
                "optimizer": snapshot.optimizer_structure,
                "files": files,
            }
            document = {**body, "checksum": _json_checksum(body)}
            _write_bytes(tmp / META_FILE, json.dumps(document, indent=1).encode())
            fsync_dir(tmp)
            replace_dir(tmp, final, durable=True)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            reason = e.strerror or str(e) or type(e).__name__
            raise CheckpointError(f"cannot write checkpoint {final}: {reason}") from e
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        logger.info("saved checkpoint step %d to %s", step, final)
        self._prune(final)
        return final

    def latest(self) -> Checkpoint | None:
        """The newest checkpoint that verifies; None if there is none at all.

        Damaged checkpoints are skipped with one warning each. Raises CheckpointError when checkpoints exist
        but none of them loads.
        """
        dirs = self._checkpoint_dirs()
        if not dirs:
            return None
        reasons = []
        for step, path in sorted(dirs.items(), reverse=True):
            try:
                return _load(path, step)
            except _Corrupt as e:
                logger.warning("skipping corrupt checkpoint %s: %s", path, e)
                reasons.append(f"{path.name}: {e}")
        raise CheckpointError(
            f"no loadable checkpoint in {self.directory}: all {len(dirs)} are corrupt (newest {reasons[0]})"
        )

    def list(self) -> list[Path]:
        """Checkpoints that were completely written (renamed into place), oldest first; not verified."""
        return [path for _, path in sorted(self._checkpoint_dirs().items())]

    def _checkpoint_dirs(self) -> dict[int, Path]:
        if not self.directory.exists():
            return {}
        if not self.directory.is_dir():
            raise CheckpointError(f"checkpoint directory {self.directory} exists and is not a directory")
        found: dict[int, Path] = {}
        retired: dict[int, Path] = {}
        try:
            entries = list(self.directory.iterdir())
        except OSError as e:
            raise CheckpointError(f"cannot read checkpoint directory {self.directory}: {e.strerror}") from e
        for entry in entries:
            if (match := _STEP_DIR.fullmatch(entry.name)) and entry.name == _dir_name(int(match[1])):
                if entry.is_dir():
                    found[int(match[1])] = entry
            elif (match := _RETIRED_DIR.fullmatch(entry.name)) and entry.is_dir():
                retired[int(match[1])] = entry
        return {**retired, **found}

    def _ensure_directory(self) -> None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CheckpointError(f"checkpoint directory {self.directory} is unusable: {os_reason(e)}") from e

    def _clean_leftovers(self) -> None:
        """Remove what a crashed writer left behind; put back a checkpoint that was being replaced."""
        for entry in sorted(self.directory.iterdir()):
            if entry.name.startswith(_TMP_PREFIX):
                logger.info("removing leftover temporary checkpoint directory %s", entry)
                shutil.rmtree(entry, ignore_errors=True)
            elif match := _RETIRED_DIR.fullmatch(entry.name):
                final = self.directory / _dir_name(int(match[1]))
                if final.exists():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    logger.warning("restoring checkpoint %s from interrupted replacement %s", final, entry)
                    os.replace(entry, final)
                    fsync_dir(self.directory)

    def _prune(self, written: Path) -> None:
        others = [path for path in self.list() if path != written]
        for path in others[: max(0, len(others) + 1 - self.keep)]:
            doomed = self.directory / f"{_TMP_PREFIX}pruned-{path.name}-{uuid.uuid4().hex[:12]}"
            try:
                os.replace(path, doomed)
            except OSError as e:
                logger.warning("could not prune checkpoint %s: %s", path, e.strerror or e)
                continue
            shutil.rmtree(doomed, ignore_errors=True)
            logger.debug("pruned checkpoint %s", path)


def os_reason(error: OSError) -> str:
    """A short reason for an OSError from making or writing a path, e.g. 'Read-only file system'."""
    if isinstance(error, FileExistsError):
        return "Not a directory"  # mkdir(exist_ok=True) fails so only when the path or a parent is a file
    return error.strerror or str(error) or type(error).__name__


def prepare_directory(directory: str | Path, replaced: tuple[str, ...] = ()) -> None:
    """Create `directory` if needed and check that files can be written in it and that the files named in
    `replaced`, where they exist, may be replaced; raises CheckpointError saying why not.

    A node calls this before it starts anything, so that a read-only or unusable directory is one clear error
    at startup rather than a traceback at the first write."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as e:
        raise CheckpointError(f"checkpoint directory {directory} is unusable: {os_reason(e)}") from None
    for name in replaced:
        path = directory / name
        if path.exists() and not os.access(path, os.W_OK):
            raise CheckpointError(f"{path} is read-only: the node rewrites it; make it writable or remove it")


def flatten_state(obj: Any) -> tuple[dict[str, torch.Tensor], Any]:
    """Split a nested state (e.g. `optimizer.state_dict()`) into its tensors and a JSON-safe structure.

    The structure holds `{"__tensor__": key}` placeholders; tuples and dicts whose keys are not plain strings
    are tagged so that `unflatten_state` restores them exactly (int keys stay ints).
    """
    tensors: dict[str, torch.Tensor] = {}

    def encode(value: Any, where: str) -> Any:
        if isinstance(value, torch.Tensor):
            key = f"t{len(tensors)}"
            tensors[key] = value
            return {_TENSOR: key}
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, list):
            return [encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
        if isinstance(value, tuple):
            return {_TUPLE: [encode(v, f"{where}[{i}]") for i, v in enumerate(value)]}
        if isinstance(value, dict):
            if all(isinstance(k, str) and not k.startswith("__") for k in value):
                return {k: encode(v, f"{where}.{k}") for k, v in value.items()}
            items = []
            for k, v in value.items():
                if not (k is None or isinstance(k, (bool, int, float, str))):
                    raise TypeError(f"{where}: cannot checkpoint a dict key of type {type(k).__name__}")
                items.append([k, encode(v, f"{where}[{k!r}]")])
            return {_ITEMS: items}
        raise TypeError(f"{where}: cannot checkpoint a value of type {type(value).__name__}")

    return tensors, encode(obj, "state")


def unflatten_state(structure: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of `flatten_state`; raises ValueError for a malformed structure or a missing tensor."""

    def decode(node: Any) -> Any:
        if isinstance(node, list):
            return [decode(v) for v in node]
        if not isinstance(node, dict):
            return node
        tagged = [k for k in node if isinstance(k, str) and k.startswith("__")]
        if not tagged:
            return {k: decode(v) for k, v in node.items()}
        if len(node) != 1 or tagged[0] not in (_TENSOR, _TUPLE, _ITEMS):
            raise ValueError(f"malformed state structure: unexpected keys {sorted(node)}")
        tag, payload = tagged[0], node[tagged[0]]
        if tag == _TENSOR:
            if not isinstance(payload, str) or payload not in tensors:
                raise ValueError(f"state structure refers to missing tensor {payload!r}")
            return tensors[payload]
        if not isinstance(payload, list):
            raise ValueError(f"malformed state structure: {tag} holds {type(payload).__name__}")
        if tag == _TUPLE:
            return tuple(decode(v) for v in payload)
        if not all(
            isinstance(item, list) and len(item) == 2 and not isinstance(item[0], (list, dict))
            for item in payload
        ):
            raise ValueError("malformed state structure: dict items must be [key, value] pairs")
        return {k: decode(v) for k, v in payload}

    return decode(structure)


def rng_state() -> dict:
    """The python, numpy, torch CPU and (when available) CUDA random states, as JSON-serialisable data."""
    version, internal, gauss = random.getstate()
    bit_generator, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    state = {
        "python": [version, list(internal), gauss],
        "numpy": [bit_generator, keys.tolist(), pos, has_gauss, cached_gaussian],
        "torch": _encode_bytes(torch.get_rng_state()),
    }
    if torch.cuda.is_available():
        state["cuda"] = [_encode_bytes(s) for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict) -> None:
    """Restore random states captured by `rng_state`."""
    for field in ("python", "numpy", "torch"):
        if field not in state:
            raise ValueError(f"rng state: missing field {field!r}")
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    bit_generator, keys, pos, has_gauss, cached_gaussian = state["numpy"]
    np.random.set_state((bit_generator, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached_gaussian))
    torch.set_rng_state(_decode_bytes(state["torch"]))
    cuda = state.get("cuda") or []
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if cuda and len(cuda) != available:
        logger.warning(
            "checkpoint holds CUDA RNG states for %d devices, this machine has %d; restoring %d",
            len(cuda),
            available,
            min(len(cuda), available),
        )
    for device, encoded in enumerate(cuda[:available]):
        torch.cuda.set_rng_state(_decode_bytes(encoded), device)


def _dir_name(step: int) -> str:
    return f"step-{step:08d}"


def _snapshot(step: int, tensors: dict, meta: dict, optimizer: dict | None, copy: bool) -> Snapshot:
    start = time.perf_counter()
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step: expected an int >= 0, got {step!r}")
    if not isinstance(meta, dict):
        raise ValueError(f"meta: expected a dict, got {type(meta).__name__}")
    try:
        meta = json.loads(json.dumps(meta))
    except (TypeError, ValueError) as e:
        raise ValueError(f"meta: not JSON-serialisable ({e})") from None
    copies: dict[tuple, torch.Tensor] = {}
    model_tensors = _prepare(tensors, "tensors", copies if copy else None)
    structure, optimizer_tensors = None, {}
    if optimizer is not None:
        flat, structure = flatten_state(optimizer)
        optimizer_tensors = _prepare(flat, "optimizer", copies if copy else None)
    unique = {
        t.untyped_storage().data_ptr(): t for t in (*model_tensors.values(), *optimizer_tensors.values())
    }
    nbytes = sum(t.untyped_storage().nbytes() for t in unique.values())
    return Snapshot(
        step, model_tensors, meta, structure, optimizer_tensors, nbytes, time.perf_counter() - start
    )


def _prepare(
    tensors: dict[str, torch.Tensor], field: str, copies: dict[tuple, torch.Tensor] | None
) -> dict[str, torch.Tensor]:
    """Detached tensors: new CPU copies when `copies` is given (one per distinct view, kept in `copies`), else the
    tensors themselves, wherever they are."""
    if not isinstance(tensors, dict):
        raise ValueError(f"{field}: expected a dict of tensors, got {type(tensors).__name__}")
    prepared: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if not isinstance(name, str):
            raise ValueError(f"{field}: tensor names must be str, got {name!r}")
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{field}[{name!r}]: expected a tensor, got {type(tensor).__name__}")
        tensor = tensor.detach()
        if copies is None:  # written as it is, where it is (`write_tensors` moves one tensor at a time)
            prepared[name] = tensor
            continue
        view = (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.dtype,
                tuple(tensor.shape), tensor.stride())  # fmt: skip
        if view not in copies:
            copies[view] = torch.empty(tensor.shape, dtype=tensor.dtype).copy_(tensor)
        prepared[name] = copies[view]
    return prepared


def _write_bytes(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _json_checksum(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _encode_bytes(tensor: torch.Tensor) -> str:
    return base64.b64encode(tensor.numpy().tobytes()).decode("ascii")


def _decode_bytes(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def _load(path: Path, step: int) -> Checkpoint:
    document = _read_meta(path / META_FILE)
    if document.get("step") != step:
        raise _Corrupt(f"meta.json names step {document.get('step')!r}, the directory step {step}")
    files = document.get("files")
    if not isinstance(files, dict) or MODEL_FILE not in files:
        raise _Corrupt("meta.json lists no model file")
    optimizer_structure = document.get("optimizer")
    if optimizer_structure is not None and OPTIMIZER_FILE not in files:
        raise _Corrupt("meta.json has an optimizer state but lists no optimizer file")
    for name, expected in files.items():
        if name not in (MODEL_FILE, OPTIMIZER_FILE):
            raise _Corrupt(f"meta.json lists unexpected file {name!r}")
        _verify_file(path / name, expected)
    meta = document.get("meta")
    if not isinstance(meta, dict):
        raise _Corrupt("meta.json holds no metadata dict")
    tensors = _open_tensors(path / MODEL_FILE, files[MODEL_FILE])
    optimizer_tensors = None
    if optimizer_structure is not None:
        optimizer_tensors = _open_tensors(path / OPTIMIZER_FILE, files[OPTIMIZER_FILE])
        try:  # the structure's placeholders checked against the file, without reading a tensor
            unflatten_state(optimizer_structure, dict.fromkeys(optimizer_tensors))
        except ValueError as e:
            raise _Corrupt(f"optimizer state: {e}") from None
    return Checkpoint(step, tensors, meta, path, optimizer_structure, optimizer_tensors)


def _read_meta(path: Path) -> dict:
    try:
        document = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise _Corrupt(f"{path.name} is missing") from None
    except OSError as e:
        raise _Corrupt(f"cannot read {path.name}: {e.strerror or e}") from None
    except ValueError as e:
        raise _Corrupt(f"{path.name} does not parse: {e}") from None
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise _Corrupt(f"{path.name} is not a {FORMAT} document")
    if document.get("version") != FORMAT_VERSION:
        raise _Corrupt(
            f"format version {document.get('version')!r} is not supported (this is {FORMAT_VERSION})"
        )
    body = {k: v for k, v in document.items() if k != "checksum"}
    if document.get("checksum") != _json_checksum(body):
        raise _Corrupt(f"{path.name} checksum mismatch")
    return document


def _verify_file(path: Path, expected: Any) -> None:
    if not isinstance(expected, dict) or not isinstance(expected.get("size"), int):
        raise _Corrupt(f"meta.json has no size and sha256 for {path.name}")
    try:
        size = path.stat().st_size
        if size != expected["size"]:
            raise _Corrupt(f"{path.name} has {size} bytes, expected {expected['size']}")
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(_HASH_CHUNK):
                digest.update(chunk)
    except FileNotFoundError:
        raise _Corrupt(f"{path.name} is missing") from None
    except OSError as e:
        raise _Corrupt(f"cannot read {path.name}: {e.strerror or e}") from None
    if digest.hexdigest() != expected.get("sha256"):
        raise _Corrupt(f"{path.name} sha256 mismatch")


def _open_tensors(path: Path, expected: dict) -> TensorFile:
    """The file's tensors, in the order they were saved in, read when they are looked up."""
    keys = expected.get("keys")
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise _Corrupt(f"meta.json lists no tensors for {path.name}")
    try:
        return TensorFile(path, keys)
    except TensorFileError as e:
        raise _Corrupt(str(e)) from None
