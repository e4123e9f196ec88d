"""Serving and downloading parts of the model state over hivemind's P2P.

A node serves snapshots of what it holds authoritative copies of: the shared parameters and its own shards, as
they were after its last sync. Joiners download everything from live peers; nodes refresh their frozen experts
from the shards' holders. A request may name a subset of a part's tensors, so that one large part can come from
several holders at once (`split`). Tensors travel compressed with hivemind's codecs and are validated on arrival
(names, shapes, finite values) before anyone uses them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import weakref
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from dataclasses import dataclass

import torch
from hivemind.compression import CompressionBase, deserialize_torch_tensor, serialize_torch_tensor
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

from spes_node.proto.state_pb2 import StateRequest
from spes_node.swarm import relay, streams
from spes_node.swarm.swarm_key import SwarmKey

logger = logging.getLogger(__name__)

HANDLER_PREFIX = "spes_state"
MAX_METADATA_BYTES = 1 << 20


class TransferError(Exception):
    """A download failed or what arrived was not acceptable."""


class Deferred:
    """A served tensor read when it is asked for, from buffers that are never changed in place (a frozen shard's:
    new weights come in new buffers). While the buffers live, what it reads is what they held when it was
    published; once any of them is gone, it is stale and reads None. It holds only weak references, so serving
    a frozen shard costs no copy of it, and a replaced shard is not kept alive for it."""

    def __init__(self, buffers: Sequence[torch.Tensor], read: Callable[..., torch.Tensor]):
        self._refs = [weakref.ref(b) for b in buffers]
        self._read = read

    @property
    def stale(self) -> bool:
        return any(ref() is None for ref in self._refs)

    def __call__(self) -> torch.Tensor | None:
        buffers = [ref() for ref in self._refs]
        return None if any(b is None for b in buffers) else self._read(*buffers)


@dataclass
class Snapshot:
    round: int
    tensors: dict[str, torch.Tensor | runtime_pb2.Tensor | Deferred]
    """Tensors, serialized with the server's codec when asked for, already serialized (sent as they are), or
    read when asked for (`Deferred`)."""

    @property
    def stale(self) -> bool:
        return any(isinstance(t, Deferred) and t.stale for t in self.tensors.values())


@dataclass
class Download:
    round: int
    tensors: dict[str, torch.Tensor]
    nbytes: int
    seconds: float
    peers: tuple[str, ...] = ()
    """The peers it came from: one, or several for a download split across holders (the most bytes first)."""


class StateServer:
    """Answers `StateRequest`s from snapshots that the training loop publishes after each sync.

    Lives in the node's asyncio loop; `publish` may be called from any thread through `publish_threadsafe`.
    """

    def __init__(
        self,
        p2p: P2P,
        run_id: str,
        config_hash: str,
        compression: CompressionBase,
        swarm_key: SwarmKey | None = None,
    ):
        self.p2p, self.config_hash, self.compression = p2p, config_hash, compression
        self.handler_name = f"{HANDLER_PREFIX}.{run_id}"
        self.swarm_key, self.tag_prefix = swarm_key, state_tag_prefix(run_id)
        self.snapshots: dict[str, Snapshot] = {}
        self.bytes_sent = 0
        self._updated: asyncio.Condition | None = None

    async def start(self) -> None:
        self._updated = asyncio.Condition()
        await self.p2p.add_protobuf_handler(self.handler_name, self._handle, StateRequest, stream_output=True)

    async def stop(self) -> None:
        await self.p2p.remove_protobuf_handler(self.handler_name)

    async def publish(self, part: str, snapshot: Snapshot) -> None:
        async with self._updated:
            self.snapshots[part] = snapshot
            self._updated.notify_all()

    async def withdraw(self, part: str) -> None:
        async with self._updated:
            self.snapshots.pop(part, None)
            self._updated.notify_all()

    async def _handle(
        self, request: StateRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        if request.config_hash != self.config_hash:
            logger.warning(f"refusing state request from {context.remote_id}: config hash mismatch")
            return
        if self.swarm_key is not None and not self.swarm_key.check_join_tag(
            self.tag_prefix, context.remote_id.to_bytes(), request.tag
        ):
            logger.warning(f"refusing state request from {context.remote_id}: no valid swarm key tag")
            return
        snapshot = await self._wait_for(request.part, request.min_round, timeout=10.0)
        if snapshot is None:
            return
        if snapshot.stale:
            await self._withdraw_stale(request.part, snapshot)
            return
        try:
            names = served_names(request.names, snapshot.tensors)
        except ValueError as e:
            logger.warning(f"refusing state request from {context.remote_id}: {e}")
            return
        metadata = json.dumps({"round": snapshot.round, "names": names}).encode()
        first = True
        for name in names:
            serialized = snapshot.tensors[name]
            if isinstance(serialized, Deferred):
                serialized = await asyncio.get_running_loop().run_in_executor(None, serialized)
                if serialized is None:  # its buffers were replaced since: the rest would be of another round
                    await self._withdraw_stale(request.part, snapshot)
                    return
            if not isinstance(serialized, runtime_pb2.Tensor):
                serialized = serialize_torch_tensor(serialized, self.compression.compression_type)
            for chunk in split_for_streaming(serialized):
                self.bytes_sent += len(chunk.buffer)
                yield averaging_pb2.DownloadData(tensor_part=chunk, metadata=metadata if first else b"")
                first = False
        # everything is out: the receiver closes once it has read it (`streams`); the snapshot is not held meanwhile
        snapshot = serialized = None
        await streams.linger()

    async def _withdraw_stale(self, part: str, snapshot: Snapshot) -> None:
        """A snapshot read from buffers that were replaced since is withdrawn (until the next publish): it is no
        longer the state of its round."""
        async with self._updated:
            if self.snapshots.get(part) is snapshot:
                del self.snapshots[part]
                logger.info(
                    f"{part} of round {snapshot.round} is no longer served: its weights were replaced"
                )

    async def _wait_for(self, part: str, min_round: int, timeout: float) -> Snapshot | None:
        """The snapshot of `part` once it is of round `min_round` or later; None if it is not within `timeout`
        (an older snapshot is never served in its place), and at once while the node serves the same shard the
        other way (asked for "shard:<j>", it holds a frozen "copy:<j>", or the reverse): it moved to or from
        shard j, and a requester that read an older record of it would otherwise wait out the timeout for each
        part (a joiner lost 30 s to three of them)."""
        deadline = time.monotonic() + timeout
        kind, _, shard = part.partition(":")
        other = {"shard": f"copy:{shard}", "copy": f"shard:{shard}"}.get(kind)
        async with self._updated:
            while True:
                snapshot = self.snapshots.get(part)
                if snapshot is not None and snapshot.round >= min_round:
                    return snapshot
                if snapshot is None and other in self.snapshots:
                    return None
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                try:
                    await asyncio.wait_for(self._updated.wait(), remaining)
                except asyncio.TimeoutError:
                    snapshot = self.snapshots.get(part)
                    return snapshot if snapshot is not None and snapshot.round >= min_round else None


def served_names(requested: Sequence[str], available: Collection[str]) -> list[str]:
    """The tensors to serve, in order: those `requested` (every one of `available` when none is); ValueError when
    the request names more tensors than there are, one twice, or one the part does not have."""
    if not requested:
        return sorted(available)
    if len(requested) > len(available):
        raise ValueError(f"asks for {len(requested)} tensors of {len(available)}")
    if len(set(requested)) != len(requested):
        raise ValueError("asks for a tensor twice")
    unknown = [name for name in requested if name not in available]
    if unknown:
        raise ValueError(
            f"asks for {len(unknown)} tensors the part does not have, such as {unknown[0][:100]!r}"
        )
    return sorted(requested)


def state_tag_prefix(run_id: str) -> str:
    return f"state.{run_id}"


async def download_part(
    p2p: P2P,
    peer: PeerID,
    run_id: str,
    config_hash: str,
    part: str,
    expected: dict[str, torch.Size],
    min_round: int = 0,
    timeout: float = 60.0,
    circuits: Sequence[str] = (),
    swarm_key: SwarmKey | None = None,
    names: Sequence[str] | None = None,
    max_round: int | None = None,
) -> Download:
    """Download one part from one peer and validate it against the expected names and shapes.

    `circuits`: relay addresses of a peer that takes no direct connections (`relay.circuits_of` its record).
    `swarm_key`: in a private swarm, proves to the server that we hold the key.
    `names`: only these tensors of the part (a piece of a split download; not empty), validated against their
    entries in `expected`.
    `max_round`: refuse a snapshot of a later round. The round is checked when the stream's first message
    arrives (as `min_round` is), so a snapshot of the wrong round costs one chunk, not the whole part.
    """
    start = time.perf_counter()
    request = StateRequest(part=part, config_hash=config_hash, min_round=min_round)
    if names is not None:
        assert names, "a piece names at least one tensor"
        request.names.extend(names)
        expected = {name: expected[name] for name in names}
    if swarm_key is not None:
        request.tag = swarm_key.join_tag(state_tag_prefix(run_id), p2p.peer_id.to_bytes())
    handler = f"{HANDLER_PREFIX}.{run_id}"
    deadline = time.monotonic() + timeout
    nbytes, attempt = 0, 0
    while True:
        attempt += 1
        try:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise asyncio.TimeoutError()
            metadata, tensors, got = await asyncio.wait_for(
                _receive(p2p, peer, handler, request, expected, circuits, (min_round, max_round)), remaining
            )
            nbytes += got
            break
        except _Truncated as e:
            nbytes += e.nbytes
            # the stream closed before the end (hivemind reports a closed connection as the end of the stream);
            # the next attempt opens a new stream
            if attempt >= DOWNLOAD_ATTEMPTS:
                raise TransferError(f"{part} from {peer}: {e} ({attempt} attempts)") from None
            logger.info(f"{part} from {peer}: {e}; retrying")
        except TransferError as e:
            raise TransferError(f"{part} from {peer}: {e}") from None
        except Exception as e:
            raise TransferError(f"{part} from {peer}: {type(e).__name__}: {e}") from None
    if metadata is None:
        raise TransferError(f"{part} from {peer}: peer has no such state")
    return Download(
        round=_validate_round(metadata),
        tensors=validate_tensors(metadata.get("names"), tensors, expected, source=f"{part} from {peer}"),
        nbytes=nbytes,
        seconds=time.perf_counter() - start,
        peers=(peer.to_base58(),),
    )


KEPT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
"""Downloaded tensors of these types are kept at their precision (`validate_tensors`)."""

DOWNLOAD_ATTEMPTS = 3
"""Streams that end early are retried this many times in all (within the download's timeout)."""


class _Truncated(Exception):
    def __init__(self, message: str, nbytes: int):
        super().__init__(message)
        self.nbytes = nbytes


async def _receive(
    p2p: P2P,
    peer: PeerID,
    handler: str,
    request: StateRequest,
    expected,
    circuits,
    rounds: tuple[int, int | None],
):
    """One attempt: (metadata, tensors, bytes received); raises `_Truncated` if the stream ends too early, and
    TransferError as soon as the metadata names a round outside `rounds` (min, max or None)."""
    await relay.dial(p2p, peer, circuits)
    metadata: dict | None = None
    tensors: list[torch.Tensor] = []
    parts: list = []
    nbytes = 0

    def finish_tensor() -> None:
        if parts[0].chunks and len(parts) != parts[0].chunks:
            raise _Truncated(
                f"stream ended within a tensor ({len(parts)} of {parts[0].chunks} chunks)", nbytes
            )
        tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
        parts.clear()

    stream = await p2p.iterate_protobuf_handler(peer, handler, request, averaging_pb2.DownloadData)
    async for message in streams.take(stream, _TensorCount(len(expected))):
        if message.metadata and metadata is None:
            if len(message.metadata) > MAX_METADATA_BYTES:
                raise TransferError("metadata too large")
            metadata = json.loads(message.metadata)
            served = _validate_round(metadata)
            if served < rounds[0] or (rounds[1] is not None and served > rounds[1]):
                wanted = rounds[0] if rounds[0] == rounds[1] else f"{rounds[0]} to {rounds[1]}"
                raise TransferError(f"the peer serves round {served}, we asked for {wanted}")
        if message.tensor_part.dtype and parts:
            finish_tensor()
        nbytes += len(message.tensor_part.buffer)
        parts.append(message.tensor_part)
        if len(tensors) > len(expected):
            raise TransferError("more tensors than expected")
    if parts:
        finish_tensor()
    if metadata is not None and len(tensors) < len(expected):
        raise _Truncated(f"stream ended after {len(tensors)} of {len(expected)} tensors", nbytes)
    return metadata, tensors, nbytes


class _TensorCount:
    """`streams.take`'s test for a download: true at the last chunk of the last expected tensor. A tensor's first
    chunk carries its dtype and, when it was split, its number of chunks (`split_for_streaming`)."""

    def __init__(self, tensors: int):
        self.tensors, self.seen, self.chunks_left = tensors, 0, 0

    def __call__(self, message: averaging_pb2.DownloadData, count: int) -> bool:
        part = message.tensor_part
        if part.dtype:
            self.seen += 1
            self.chunks_left = max(part.chunks, 1) - 1
        else:
            self.chunks_left -= 1
        return self.seen >= self.tensors and self.chunks_left <= 0


def validate_tensors(
    names, tensors: list[torch.Tensor], expected: dict[str, torch.Size], source: str
) -> dict[str, torch.Tensor]:
    """Accept exactly the expected names, each with the expected shape and finite values, at the precision it
    travelled: fp16, bf16 and fp32 stay as they are (a refresh held until the next round applies it costs the
    wire's bytes, not fp32's: half, on fp16 links), another floating type becomes fp32, anything else is refused.
    Whoever loads them converts (`ExpertShard.load_dense`, `Tensor.copy_`)."""
    if not isinstance(names, list) or sorted(names) != sorted(expected) or len(names) != len(tensors):
        raise TransferError(f"{source}: unexpected tensor names")
    out = {}
    for name, tensor in zip(names, tensors):
        if tensor.shape != expected[name]:
            raise TransferError(
                f"{source}: {name} has shape {tuple(tensor.shape)}, expected {tuple(expected[name])}"
            )
        if not tensor.dtype.is_floating_point:
            raise TransferError(f"{source}: {name} is of type {tensor.dtype}, not floating point")
        if tensor.dtype not in KEPT_DTYPES:
            tensor = tensor.float()
        if not torch.isfinite(tensor).all():
            raise TransferError(f"{source}: {name} has non-finite values")
        out[name] = tensor
    return out


def _validate_round(metadata: dict) -> int:
    value = metadata.get("round")
    if not isinstance(value, int) or value < 0 or value > 1 << 40:
        raise TransferError("invalid round in metadata")
    return value
