"""DHT records of a swarm: the signed swarm config and one signed heartbeat per node.

Keys live under the run id: ``<run_id>.config`` and ``<run_id>.nodes``. Values are serialized
protobuf messages (``spes_node.proto``). Every subkey carries its owner's RSA public key, so
hivemind's ``RSASignatureValidator`` lets only that owner write it:

- node records: subkey = ``peer_id.encode() + validator.local_public_key``;
- config records: subkey = ``validator.local_public_key``.

The DHT must be created with ``record_validators=record_validators(validator)`` for the same
private key that is passed to the functions here (readers too: without the signature validator,
hivemind cannot strip the signatures of what it reads). ``RecordSizeValidator`` among them makes
every honest peer refuse to store an oversized record, so that none lands in honest storage: a DHT
peer answers a read with all subkeys of a key in one message, and one that exceeds the transport's
message limit fails the read of every subkey of that peer. Everything read from the network is
validated again; a bad record is skipped with a warning and never raises, and a read that fails
says so (the ``problems`` list of the fetch functions collects what went wrong, for ``status``).

The swarm config is anchored, never elected: ``fetch_config`` with a ``config_hash`` (given by the
user, or known from a checkpoint) takes only that config; without one it takes the config only if
every published copy agrees, and raises ``ConfigConflict`` otherwise. Counting copies decides
nothing (anyone can publish many).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from hivemind import DHT
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import get_dht_time

from spes_node import __version__
from spes_node.config import CONFIG_HASH_RE, config_digest
from spes_node.proto import NodeRecord, SwarmConfigRecord
from spes_node.swarm.identity import peer_id_of_public_key

logger = logging.getLogger(__name__)

MAX_VALUE_BYTES = 64 * 1024
MAX_SIGNATURE_BYTES = 2048
"""What hivemind adds to a value it stores: its serialization header and an RSA signature (a few hundred bytes)."""
MAX_SUBKEY_BYTES = 4096
"""A serialized subkey: a peer id (or nothing) and an "[owner:ssh-rsa ...]" marker."""
MAX_SHARDS_PER_NODE = 1024
MAX_DATA_PARTS = 1 << 20
MAX_ROUND_STEPS = 1 << 20
MAX_LOSS_HISTORY = 64
MAX_MADDRS = 32
MAX_MADDR_CHARS = 512
MAX_PEER_ID_CHARS = 128
MAX_NAME_CHARS = 128
MAX_VERSION_CHARS = 64
MAX_RUN_ID_CHARS = 256
GET_TIMEOUT_S = 30.0
WITHDRAW_MARGIN_S = 1.0
_MAX_REMEMBERED_WARNINGS = 4096

STATES = ("joining", "training", "averaging", "leaving")
ACTIVE_STATES = frozenset({"training", "averaging"})
"""States in which a node trains, averages and serves its state."""
_STATE_TO_PROTO = {name: NodeRecord.State.Value(name.upper()) for name in STATES}
_PEER_ID_RE = re.compile(r"[1-9A-HJ-NP-Za-km-z]+")
_OWNER_RE = re.compile(rb"\[owner:.+?\]")


class RecordSizeValidator(RecordValidatorBase):
    """Refuses DHT records whose value or subkey is larger than any record of a swarm, when they are stored and
    when they are read.

    hivemind runs the validators of a DHT peer on every record another peer asks it to store, so with this one
    installed in every DHT the project opens, an oversized value never lands in honest storage. That matters
    beyond the record itself: a peer answers a read with all subkeys of a key in one message, and an answer over
    the transport's message limit (4 MiB) fails as a whole, hiding every good subkey along with the bad one.
    It runs before ``RSASignatureValidator`` (higher priority), so a huge value is refused before its signature
    is hashed; it sees the value as stored (serialized and signed), hence the allowance for the signature.
    """

    def __init__(
        self,
        max_value_bytes: int = MAX_VALUE_BYTES + MAX_SIGNATURE_BYTES,
        max_subkey_bytes: int = MAX_SUBKEY_BYTES,
    ):
        self.max_value_bytes, self.max_subkey_bytes = max_value_bytes, max_subkey_bytes

    def validate(self, record: DHTRecord) -> bool:
        return (
            len(record.value) <= self.max_value_bytes and len(record.subkey or b"") <= self.max_subkey_bytes
        )

    @property
    def priority(self) -> int:
        return 20  # validated before RSASignatureValidator (priority 10), which checks and strips signatures

    def merge_with(self, other: RecordValidatorBase) -> bool:
        if not isinstance(other, RecordSizeValidator):
            return False
        self.max_value_bytes = min(self.max_value_bytes, other.max_value_bytes)
        self.max_subkey_bytes = min(self.max_subkey_bytes, other.max_subkey_bytes)
        return True


def record_validators(validator: RSASignatureValidator | None = None) -> list[RecordValidatorBase]:
    """The record validators of every DHT the project opens: signatures (``validator``: the node's own key, or a
    throwaway one for a peer that only reads or stores for others) and sizes."""
    return [validator if validator is not None else RSASignatureValidator(), RecordSizeValidator()]


class ConfigConflict(ValueError):
    """The copies of the swarm config in the DHT disagree and nothing anchors one of them."""

    def __init__(self, run_id: str, hashes: list[str]):
        self.run_id, self.hashes = run_id, hashes
        shown = ", ".join(hashes[:4]) + (f" and {len(hashes) - 4} more" if len(hashes) > 4 else "")
        super().__init__(
            f"swarm '{run_id}' has {len(hashes)} different configs published ({shown}); pass --config-hash "
            f"with the hash the swarm's founder printed (peers can publish any number of copies, so their count "
            f"decides nothing)"
        )


@dataclass
class NodeInfo:
    """One node's heartbeat, as published and as read back."""

    peer_id: str
    shards: list[int]
    round: int = 0
    step: int = 0
    tokens: int = 0
    tokens_per_s: float = 0.0
    loss: float = 0.0
    state: str = "joining"
    version: str = __version__
    public_name: str = ""
    maddrs: list[str] = field(default_factory=list)
    client_mode: bool = False
    updated_at: float = 0.0
    """DHT time of the heartbeat; ``publish_node`` stamps the current time."""
    expires_at: float = 0.0
    """DHT expiration of the record; filled in by ``fetch_nodes``, ignored by ``publish_node``."""
    loss_history: list[float] = field(default_factory=list)
    bytes_sent: int = 0
    bytes_received: int = 0
    data_part: int | None = None
    """The data part the node reads (`sharding.data_part`), None until it has one."""
    sync_at: float = 0.0
    """DHT time at which the node expects to begin its sync in its round, while it trains; 0 if not announced
    (it then syncs at step (round + 1) x sync_steps, which a node that trains while waiting for peers passes)."""
    round_steps: int | None = None
    """Local steps trained in the current round, None if not announced."""


@dataclass(frozen=True)
class ConfigInfo:
    """The swarm config as read from the DHT."""

    run_id: str
    config_hash: str
    config_json: str
    software_version: str
    created_at: float
    expires_at: float


def node_key(run_id: str) -> str:
    return f"{run_id}.nodes"


def config_key(run_id: str) -> str:
    return f"{run_id}.config"


def _check_text(value: str, name: str, max_chars: int, *, allow_empty: bool = True) -> None:
    if not allow_empty and not value:
        raise ValueError(f"{name} is empty")
    if len(value) > max_chars:
        raise ValueError(f"{name} is longer than {max_chars} characters")
    if not value.isprintable():
        raise ValueError(f"{name} holds control characters")


def _check_finite(value: float, name: str, *, non_negative: bool = False) -> None:
    if not math.isfinite(value):
        raise ValueError(f"{name} is not finite")
    if non_negative and value < 0:
        raise ValueError(f"{name} is negative")


def _check_node_record(record: NodeRecord, num_shards: int | None) -> None:
    _check_text(record.peer_id, "peer_id", MAX_PEER_ID_CHARS, allow_empty=False)
    if not _PEER_ID_RE.fullmatch(record.peer_id):
        raise ValueError("peer_id is not base58")
    if len(record.shards) > MAX_SHARDS_PER_NODE:
        raise ValueError(f"shards has more than {MAX_SHARDS_PER_NODE} entries")
    if len(set(record.shards)) != len(record.shards):
        raise ValueError("shards has duplicates")
    if num_shards is not None and any(shard >= num_shards for shard in record.shards):
        raise ValueError(f"shards holds an id >= num_shards ({num_shards})")
    _check_finite(record.tokens_per_s, "tokens_per_s", non_negative=True)
    _check_finite(record.loss, "loss")
    _check_finite(record.updated_at, "updated_at", non_negative=True)
    if record.state not in _STATE_TO_PROTO.values():
        raise ValueError(f"state {record.state} is unknown")
    _check_text(record.version, "version", MAX_VERSION_CHARS)
    _check_text(record.public_name, "public_name", MAX_NAME_CHARS)
    if len(record.maddrs) > MAX_MADDRS:
        raise ValueError(f"maddrs has more than {MAX_MADDRS} entries")
    for maddr in record.maddrs:
        _check_text(maddr, "maddrs", MAX_MADDR_CHARS, allow_empty=False)
    if record.data_part > MAX_DATA_PARTS:
        raise ValueError(f"data_part is above {MAX_DATA_PARTS}")
    _check_finite(record.sync_at, "sync_at", non_negative=True)
    if record.round_steps > MAX_ROUND_STEPS:
        raise ValueError(f"round_steps is above {MAX_ROUND_STEPS}")
    if len(record.loss_history) > MAX_LOSS_HISTORY:
        raise ValueError(f"loss_history has more than {MAX_LOSS_HISTORY} entries")
    for loss in record.loss_history:
        _check_finite(loss, "loss_history")


def _check_config_record(record: SwarmConfigRecord) -> None:
    _check_text(record.run_id, "run_id", MAX_RUN_ID_CHARS, allow_empty=False)
    if not CONFIG_HASH_RE.fullmatch(record.config_hash):
        raise ValueError("config_hash is not a sha256 hex digest")
    if config_digest(record.config_json) != record.config_hash:
        raise ValueError("config_hash does not match config_json")
    try:
        config = json.loads(record.config_json)
    except ValueError as e:
        raise ValueError(f"config_json is not JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError("config_json is not a JSON object")
    _check_text(record.software_version, "software_version", MAX_VERSION_CHARS)
    _check_finite(record.created_at, "created_at", non_negative=True)


def _node_to_record(info: NodeInfo, updated_at: float) -> NodeRecord:
    if info.state not in _STATE_TO_PROTO:
        raise ValueError(f"state must be one of {STATES}, got {info.state!r}")
    try:
        return NodeRecord(
            peer_id=info.peer_id,
            shards=info.shards,
            round=info.round,
            step=info.step,
            tokens=info.tokens,
            tokens_per_s=info.tokens_per_s,
            loss=info.loss,
            state=_STATE_TO_PROTO[info.state],
            version=info.version,
            public_name=info.public_name,
            maddrs=info.maddrs,
            client_mode=info.client_mode,
            updated_at=updated_at,
            loss_history=info.loss_history[-MAX_LOSS_HISTORY:],
            bytes_sent=info.bytes_sent,
            bytes_received=info.bytes_received,
            data_part=0 if info.data_part is None else info.data_part + 1,
            sync_at=info.sync_at,
            round_steps=0 if info.round_steps is None else info.round_steps + 1,
        )
    except (TypeError, ValueError) as e:
        raise ValueError(f"node info does not fit the record: {e}") from None


def _record_to_node(record: NodeRecord, expires_at: float) -> NodeInfo:
    return NodeInfo(
        peer_id=record.peer_id,
        shards=list(record.shards),
        round=record.round,
        step=record.step,
        tokens=record.tokens,
        tokens_per_s=record.tokens_per_s,
        loss=record.loss,
        state=NodeRecord.State.Name(record.state).lower(),
        version=record.version,
        public_name=record.public_name,
        maddrs=list(record.maddrs),
        client_mode=record.client_mode,
        updated_at=record.updated_at,
        expires_at=expires_at,
        loss_history=list(record.loss_history),
        bytes_sent=record.bytes_sent,
        bytes_received=record.bytes_received,
        data_part=record.data_part - 1 if record.data_part else None,
        sync_at=record.sync_at,
        round_steps=record.round_steps - 1 if record.round_steps else None,
    )


def _parse(message_type: type, value: Any) -> Any:
    if not isinstance(value, bytes):
        raise ValueError(f"value is a {type(value).__name__}, not bytes")
    if len(value) > MAX_VALUE_BYTES:
        raise ValueError(f"value has {len(value)} bytes, more than {MAX_VALUE_BYTES}")
    try:
        return message_type.FromString(value)
    except Exception as e:
        raise ValueError(f"value is not a {message_type.__name__}: {e}") from None


def _owner_prefix(subkey: Any) -> bytes:
    """What precedes the owner's public key in a signed subkey; raises ValueError for an unsigned one."""
    if not isinstance(subkey, bytes):
        raise ValueError(f"subkey is a {type(subkey).__name__}, not bytes")
    owners = _OWNER_RE.findall(subkey)
    if len(owners) != 1 or not subkey.endswith(owners[0]):
        raise ValueError("subkey is not signed by its owner")
    return subkey[: -len(owners[0])]


def _owner_peer_id(marker: bytes) -> str:
    """The peer id of a record owner ("[owner:<ssh-rsa key>]"): a node's libp2p identity is its signing key
    (`identity.py`), so a node can only publish a heartbeat under its own peer id."""
    found = _owner_ids.get(marker)
    if found is None:
        try:
            found = peer_id_of_public_key(marker[len(b"[owner:") : -1])
        except Exception as e:
            raise ValueError(f"the owner key is not an RSA public key: {type(e).__name__}") from None
        if len(_owner_ids) >= _MAX_REMEMBERED_WARNINGS:
            _owner_ids.clear()
        _owner_ids[marker] = found
    return found


_owner_ids: dict[bytes, str] = {}
_warned: set[tuple] = set()


def _warn_bad_record(
    kind: str, run_id: str, subkey: Any, value: Any, reason: ValueError, problems: list[str] | None
) -> None:
    """Warn about a bad record once; the same bad record seen again by later fetches logs at debug level.
    ``problems`` (if given) gets the message every time."""
    text = repr(subkey)
    message = (
        f"Ignoring {kind} record {text if len(text) <= 64 else text[:61] + '...'} of run {run_id}: {reason}"
    )
    if problems is not None:
        problems.append(message)
    identity = (kind, run_id, repr(subkey), hashlib.sha256(repr(value).encode()).digest())
    if identity in _warned:
        logger.debug(message)
        return
    if len(_warned) >= _MAX_REMEMBERED_WARNINGS:
        _warned.clear()
    _warned.add(identity)
    logger.warning(message)


def _result(future, timeout: float, stop: threading.Event | None):
    """The DHT call's result within `timeout` seconds, or TimeoutError; sooner once `stop` is set: a stopping node
    does not wait on a DHT process that hangs (a stopped or overloaded one would hold its exit)."""
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or (stop is not None and stop.is_set()):
            future.cancel()
            raise TimeoutError(
                "the node is stopping" if remaining > 0 else f"no answer within {timeout:.0f}s"
            )
        try:
            return future.result(timeout=min(remaining, 0.2) if stop is not None else remaining)
        except TimeoutError:
            continue


class ReadFailed(str):
    """A line of ``problems`` that says the whole read failed (what it returned says nothing of the swarm)."""


def _get_entries(
    dht: DHT, key: str, problems: list[str] | None = None, stop: threading.Event | None = None
) -> dict:
    """Subkey -> ValueWithExpiration of ``key``, empty if absent or unreadable (a failed read is logged as a
    warning and added to ``problems``)."""
    future = dht.get(key, latest=True, return_future=True)
    message = None
    try:
        found = _result(future, GET_TIMEOUT_S, stop)
    except Exception as e:
        future.cancel()
        found, message = None, f"Could not read {key} from the DHT: {e!r}"
    if found is not None and not isinstance(found.value, dict):
        found, message = None, f"Ignoring {key}: expected subkeys, found a {type(found.value).__name__}"
    if message is not None:
        logger.warning(message)
        if problems is not None:
            problems.append(ReadFailed(message))
    return found.value if found is not None else {}


def publish_node(
    dht: DHT,
    run_id: str,
    info: NodeInfo,
    validator: RSASignatureValidator,
    expiration_s: float,
    stop: threading.Event | None = None,
) -> bool:
    """Store this node's heartbeat (stamped with the current DHT time); True if the DHT accepted it, False if it
    did not answer within `GET_TIMEOUT_S` (or before `stop` was set)."""
    now = get_dht_time()
    record = _node_to_record(info, updated_at=now)
    _check_node_record(record, num_shards=None)
    value = record.SerializeToString()
    if len(value) > MAX_VALUE_BYTES:
        raise ValueError(f"node record has {len(value)} bytes, more than {MAX_VALUE_BYTES}")
    subkey = info.peer_id.encode() + validator.local_public_key
    future = dht.store(
        node_key(run_id), value, expiration_time=now + expiration_s, subkey=subkey, return_future=True
    )
    try:
        return bool(_result(future, GET_TIMEOUT_S, stop))
    except TimeoutError as e:
        logger.warning(f"could not store the node record: {e}")
        return False


def withdraw_node(dht: DHT, run_id: str, peer_id: str, validator: RSASignatureValidator) -> bool:
    """Replace this node's heartbeat with a LEAVING tombstone, so that ``fetch_nodes`` drops it now.

    The DHT only accepts a newer expiration for a subkey, so the tombstone outlives the last
    heartbeat by a moment and then expires.
    """
    subkey = peer_id.encode() + validator.local_public_key
    previous = _get_entries(dht, node_key(run_id)).get(subkey)
    now = get_dht_time()
    expiration = max(now, previous.expiration_time if previous is not None else now) + WITHDRAW_MARGIN_S
    tombstone = NodeRecord(peer_id=peer_id, state=NodeRecord.LEAVING, updated_at=now, version=__version__)
    return bool(
        dht.store(node_key(run_id), tombstone.SerializeToString(), expiration_time=expiration, subkey=subkey)
    )


def fetch_nodes(
    dht: DHT,
    run_id: str,
    num_shards: int | None = None,
    problems: list[str] | None = None,
    stop: threading.Event | None = None,
    leaving: set[str] | None = None,
) -> dict[str, NodeInfo]:
    """Live, valid node records of the swarm by peer id (leaving nodes and bad records left out).

    With ``num_shards``, records naming a shard outside the swarm are bad records. If several
    records claim one peer id, the most recent heartbeat wins. ``problems`` collects a line for
    every bad record and failed read; ``stop``: give up on the read once it is set; ``leaving``
    collects the peer ids whose record says they are leaving (a node whose record expired is in
    neither: it stopped heartbeating, stalled or gone).
    """
    nodes: dict[str, NodeInfo] = {}
    now = get_dht_time()
    for subkey, entry in _get_entries(dht, node_key(run_id), problems, stop).items():
        try:
            prefix = _owner_prefix(subkey)
            record = _parse(NodeRecord, entry.value)
            _check_node_record(record, num_shards)
            if prefix != record.peer_id.encode():
                raise ValueError(f"peer_id {record.peer_id} differs from the peer id in the subkey")
            if _owner_peer_id(subkey[len(prefix) :]) != record.peer_id:
                raise ValueError(
                    f"peer_id {record.peer_id} is not the peer id of the key that signed the record"
                )
        except ValueError as e:
            _warn_bad_record("node", run_id, subkey, entry.value, e, problems)
            continue
        if entry.expiration_time < now:
            continue
        if record.state == NodeRecord.LEAVING:
            if leaving is not None:
                leaving.add(record.peer_id)
            continue
        known = nodes.get(record.peer_id)
        if known is None or record.updated_at > known.updated_at:
            nodes[record.peer_id] = _record_to_node(record, entry.expiration_time)
    return nodes


def wait_for_nodes(
    dht: DHT,
    run_id: str,
    pending: Callable[[dict[str, NodeInfo], set[str]], Collection[str]],
    timeout: float,
    num_shards: int | None = None,
    stop: threading.Event | None = None,
    poll_s: float = 0.5,
) -> Collection[str] | None:
    """Read the node records every `poll_s` until `pending(nodes, leaving)` (the peers still awaited, from the live
    records and the ids of leaving nodes) is empty, for at most `timeout` seconds or until `stop` is set. Returns
    what was still pending at the last read that did not fail (empty: none), or None if every read failed; a failed
    read (a timeout, a stop) never ends the wait early."""
    deadline = time.monotonic() + timeout
    waiting: Collection[str] | None = None
    while stop is None or not stop.is_set():
        problems: list[str] = []
        leaving: set[str] = set()
        nodes = fetch_nodes(dht, run_id, num_shards, problems, stop, leaving)
        if not any(isinstance(problem, ReadFailed) for problem in problems):
            waiting = pending(nodes, leaving)
            if not waiting:
                break
        if time.monotonic() >= deadline:
            break
        if stop is not None:
            stop.wait(poll_s)
        else:
            time.sleep(poll_s)
    return waiting


def publish_config(
    dht: DHT,
    run_id: str,
    config_json: str,
    config_hash: str,
    validator: RSASignatureValidator,
    expiration_s: float,
    *,
    created_at: float | None = None,
) -> bool:
    """Store the swarm config under this node's subkey; True if the DHT accepted it.

    ``created_at`` is the swarm's founding time (default: now); nodes that re-publish a config
    they joined with should pass the ``created_at`` they read.
    """
    now = get_dht_time()
    record = SwarmConfigRecord(
        run_id=run_id,
        config_hash=config_hash,
        config_json=config_json,
        software_version=__version__,
        created_at=now if created_at is None else created_at,
    )
    _check_config_record(record)
    value = record.SerializeToString()
    if len(value) > MAX_VALUE_BYTES:
        raise ValueError(f"config_json makes a record of {len(value)} bytes, more than {MAX_VALUE_BYTES}")
    return bool(
        dht.store(
            config_key(run_id), value, expiration_time=now + expiration_s, subkey=validator.local_public_key
        )
    )


def fetch_configs(dht: DHT, run_id: str, problems: list[str] | None = None) -> dict[str, ConfigInfo]:
    """Every valid config published for the run, by its hash (the sha256 of its JSON, recomputed here), each
    with its earliest ``created_at``; ``problems`` collects a line for every bad record and failed read."""
    found: dict[str, ConfigInfo] = {}
    for subkey, entry in _get_entries(dht, config_key(run_id), problems).items():
        try:
            prefix = _owner_prefix(subkey)
            if prefix:
                raise ValueError("subkey is not a bare owner key")
            record = _parse(SwarmConfigRecord, entry.value)
            _check_config_record(record)
            if record.run_id != run_id:
                raise ValueError(f"run_id {record.run_id!r} differs from the key's run id")
        except ValueError as e:
            _warn_bad_record("config", run_id, subkey, entry.value, e, problems)
            continue
        digest = config_digest(record.config_json)  # equal to record.config_hash (checked above)
        known = found.get(digest)
        if known is None or record.created_at < known.created_at:
            found[digest] = ConfigInfo(
                run_id=record.run_id,
                config_hash=digest,
                config_json=record.config_json,
                software_version=record.software_version,
                created_at=record.created_at,
                expires_at=entry.expiration_time,
            )
    return dict(sorted(found.items(), key=lambda item: (item[1].created_at, item[0])))


def fetch_config(
    dht: DHT, run_id: str, config_hash: str | None = None, problems: list[str] | None = None
) -> ConfigInfo | None:
    """The swarm config: with ``config_hash`` (the anchor), the config with that hash or None; without, the
    config if every published copy agrees, None if there is none, and ``ConfigConflict`` if they disagree."""
    configs = fetch_configs(dht, run_id, problems)
    if config_hash is not None:
        return configs.get(config_hash)
    if len(configs) > 1:
        raise ConfigConflict(run_id, list(configs))
    return next(iter(configs.values()), None)
