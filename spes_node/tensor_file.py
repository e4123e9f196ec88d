"""safetensors files written and read one tensor at a time.

The format is safetensors' (an 8-byte little-endian header length, a JSON header naming each tensor's dtype,
shape and byte range, then the bytes), so the files load with safetensors' own reader. Its writer copies every
tensor to the host before it writes the first, and its loader returns every tensor at once: for a node's
checkpoint (23.3 GiB of training state at spes-7b) either is a second copy of the whole state in host memory.
`write_tensors` copies one tensor at a time to the host and hashes its bytes as they are written; `TensorFile`
reads a tensor when it is asked for, into a tensor of its own (no memory map), optionally straight on to a device.
"""

from __future__ import annotations

import concurrent.futures
import copy
import hashlib
import json
import math
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_DTYPES = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}
MAX_HEADER_BYTES = 100 << 20
"""safetensors' own limit on a header (100 MB)."""


class TensorFileError(ValueError):
    """A file is not a safetensors file this reader can trust; the message says why, in one line."""


def write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> dict:
    """Write `tensors` as a safetensors file (header, then each tensor's bytes in order), one tensor at a time,
    hashing the bytes as they are written; returns the file's size, sha256 and keys.

    A tensor on another device, or not contiguous, is copied to the host alone and let go before the next one.
    Tensors that share storage (tied weights) are written each in full, as safetensors needs."""
    header, offset = {}, 0
    for name, tensor in tensors.items():
        if tensor.dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"{name}: cannot checkpoint a tensor of dtype {tensor.dtype}")
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    digest = hashlib.sha256()
    # the hash of a tensor's bytes runs on a thread while they are written (both let go of the GIL): a write takes
    # the longer of the two instead of their sum (sha256 runs at about 1.5 GB/s on this project's CPU machine)
    with open(path, "wb") as f, concurrent.futures.ThreadPoolExecutor(1, "spes-checkpoint-hash") as hasher:

        def put(data) -> None:
            hashing = hasher.submit(digest.update, data)
            f.write(data)
            hashing.result()

        put(len(text).to_bytes(8, "little") + text)
        for tensor in tensors.values():
            if tensor.numel():
                host = tensor.detach().to("cpu").contiguous()
                put(memoryview(host.reshape(-1).view(torch.uint8).numpy()))
                del host
        f.flush()
        os.fsync(f.fileno())
    return {"sha256": digest.hexdigest(), "size": 8 + len(text) + offset, "keys": list(tensors)}


class TensorFile(Mapping[str, torch.Tensor]):
    """The tensors of a safetensors file, each read from the file when it is looked up: nothing is held between
    lookups, so going through them holds one at a time.

    The header is read and checked when it is opened: known dtypes, shapes whose bytes match their ranges, ranges
    inside the file that do not overlap. `keys` (default: the header's order) must name exactly the file's
    tensors; iteration follows it. `to(device)` gives the same file read on to a device."""

    def __init__(self, path: str | Path, keys: list[str] | None = None, device: torch.device | str = "cpu"):
        self.path, self.device = Path(path), torch.device(device)
        self._entries, self._start = _read_header(self.path)
        if keys is not None and (len(keys) != len(set(keys)) or set(keys) != set(self._entries)):
            raise TensorFileError(f"{self.path.name} holds other tensors than its metadata lists")
        self._keys = list(self._entries) if keys is None else list(keys)

    def to(self, device: torch.device | str) -> TensorFile:
        """The same tensors, each moved to `device` as it is read (the host holds one at a time)."""
        other = copy.copy(self)  # the header as read, shared
        other.device = torch.device(device)
        return other

    def __getitem__(self, key: str) -> torch.Tensor:
        dtype, shape, (begin, end) = self._entries[key]
        tensor = torch.empty(shape, dtype=dtype)
        if end > begin:
            with open(self.path, "rb") as f:
                f.seek(self._start + begin)
                view = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
                if f.readinto(view) != end - begin:
                    raise TensorFileError(f"{self.path.name}: {key} ends before its bytes do")
        return tensor if self.device.type == "cpu" else tensor.to(self.device)

    def __contains__(self, key: object) -> bool:
        # from the header: Mapping's own test looks the tensor up, which reads it from the file
        return key in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def dtype(self, key: str) -> torch.dtype:
        """A tensor's dtype, from the header alone."""
        return self._entries[key][0]

    def shape(self, key: str) -> torch.Size:
        """A tensor's shape, from the header alone."""
        return self._entries[key][1]


def _read_header(path: Path) -> tuple[dict[str, tuple[torch.dtype, torch.Size, tuple[int, int]]], int]:
    """Each tensor's dtype, shape and byte range (relative to the data's start), and where the data starts."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            length = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
            if not 0 < length <= min(MAX_HEADER_BYTES, size - 8):
                raise TensorFileError(f"{path.name} is not a safetensors file (header length {length})")
            header = json.loads(f.read(length))
    except FileNotFoundError:
        raise TensorFileError(f"{path.name} is missing") from None
    except OSError as e:
        raise TensorFileError(f"cannot read {path.name}: {e.strerror or e}") from None
    except ValueError as e:
        if isinstance(e, TensorFileError):
            raise
        raise TensorFileError(f"{path.name}: the header does not parse: {e}") from None
    if not isinstance(header, dict):
        raise TensorFileError(f"{path.name}: the header is not a JSON object")
    start, data = 8 + length, size - 8 - length
    entries, ranges = {}, []
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype = _DTYPES[entry["dtype"]]
            shape, (begin, end) = entry["shape"], entry["data_offsets"]
            if not all(type(n) is int and n >= 0 for n in (*shape, begin, end)):
                raise ValueError
        except (KeyError, TypeError, ValueError):
            raise TensorFileError(
                f"{path.name}: {key!r} has no valid dtype, shape and data offsets"
            ) from None
        nbytes = math.prod(shape) * dtype.itemsize
        if end - begin != nbytes or end > data:
            raise TensorFileError(f"{path.name}: the bytes of {key!r} do not match its shape or the file")
        entries[key] = (dtype, torch.Size(shape), (begin, end))
        ranges.append((begin, end))
    ranges.sort()
    if any(b[0] < a[1] for a, b in zip(ranges, ranges[1:], strict=False)):
        raise TensorFileError(f"{path.name}: tensors overlap")
    return entries, start
