import logging
import math
import os
import signal
import stat
import tempfile
import threading
import time
import uuid
from functools import partial
from pathlib import Path

import hivemind
import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time

from spes_node.config import check_config_hash, config_digest
from spes_node.proto import NodeRecord, SwarmConfigRecord
from spes_node.swarm.identity import load_or_create_identity, peer_id_of, peer_id_of_public_key
from spes_node.swarm.records import (
    MAX_VALUE_BYTES,
    ConfigConflict,
    NodeInfo,
    RecordSizeValidator,
    config_key,
    fetch_config,
    fetch_configs,
    fetch_nodes,
    node_key,
    publish_config,
    publish_node,
    record_validators,
    wait_for_nodes,
    withdraw_node,
)

EXPIRATION_S = 60.0
CONFIG_X = '{"model": "tiny", "sync_steps": 10}'
CONFIG_Y = '{"model": "tiny", "sync_steps": 20}'


class Peer:
    """A DHT peer whose libp2p identity is its record-signing key, as a node's is (`identity.py`)."""

    def __init__(self, initial_peers=(), validators=None):
        """`validators`: what the peer checks records with (default: signatures only, as a stranger's or an older
        version's peer does; `record_validators` is what the project's own DHTs use)."""
        with tempfile.TemporaryDirectory(prefix="spes-peer-") as directory:
            # p2pd reads the key file as the DHT starts; nothing reads it afterwards.
            identity = Path(directory) / "identity.key"
            self.validator = RSASignatureValidator(load_or_create_identity(identity))
            self.dht = hivemind.DHT(
                host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                initial_peers=list(initial_peers),
                identity_path=str(identity),
                start=True,
                record_validators=(validators or (lambda v: [v]))(self.validator),
            )
        self.peer_id = self.dht.peer_id.to_base58()

    def subkey(self) -> bytes:
        return self.peer_id.encode() + self.validator.local_public_key


async def _store_zeros(_dht, node, *, key: str, subkey: bytes, size: int, expiration_time: float) -> bool:
    # Runs inside the DHT process: a value this large does not fit through the DHT's command pipe.
    return await node.store(key, b"\x00" * size, expiration_time, subkey=subkey)


@pytest.fixture(scope="module")
def peers():
    started = []
    try:
        started.append(Peer())
        maddrs = started[0].dht.get_visible_maddrs()
        started.append(Peer(maddrs))
        started.append(Peer(maddrs))
        yield started
    finally:
        for peer in started:
            peer.dht.shutdown()


@pytest.fixture
def run_id():
    return f"test-{uuid.uuid4().hex[:8]}"


def _info(peer_id: str, **overrides) -> NodeInfo:
    fields = dict(
        peer_id=peer_id,
        shards=[1, 3],
        round=7,
        step=700,
        tokens=123_456,
        tokens_per_s=512.5,
        loss=3.25,
        state="training",
        version="0.1.0",
        public_name="volunteer ü",
        maddrs=["/ip4/127.0.0.1/tcp/4000/p2p/" + peer_id],
        client_mode=True,
        loss_history=[4.0, 3.5, 3.25],
        bytes_sent=10**12,
        bytes_received=42,
        sync_at=1.7e9,
        round_steps=0,
    )
    return NodeInfo(**(fields | overrides))


def _without_times(info: NodeInfo) -> NodeInfo:
    return NodeInfo(**(vars(info) | {"updated_at": 0.0, "expires_at": 0.0}))


@pytest.mark.swarm
def test_node_round_trip_between_dhts(peers, run_id):
    a, b, _ = peers
    before = get_dht_time()
    assert publish_node(a.dht, run_id, _info(a.peer_id), a.validator, EXPIRATION_S)
    assert publish_node(
        b.dht,
        run_id,
        _info(b.peer_id, shards=[0], state="joining", round_steps=None),
        b.validator,
        EXPIRATION_S,
    )

    seen_by_b = fetch_nodes(b.dht, run_id, num_shards=4)
    assert set(seen_by_b) == {a.peer_id, b.peer_id}
    assert _without_times(seen_by_b[a.peer_id]) == _info(a.peer_id)
    assert _without_times(seen_by_b[b.peer_id]) == _info(
        b.peer_id, shards=[0], state="joining", round_steps=None
    )
    record = seen_by_b[a.peer_id]
    assert before <= record.updated_at <= get_dht_time()
    assert math.isclose(record.expires_at, record.updated_at + EXPIRATION_S, abs_tol=1e-3)
    assert fetch_nodes(a.dht, run_id) == seen_by_b
    assert fetch_nodes(a.dht, "other-run") == {}


@pytest.mark.swarm
def test_peer_cannot_overwrite_another_peers_subkey(peers, run_id):
    a, b, _ = peers
    assert publish_node(a.dht, run_id, _info(a.peer_id, step=1), a.validator, EXPIRATION_S)

    forged = _info(a.peer_id, step=999, shards=[0])
    assert not publish_node(b.dht, run_id, forged, a.validator, EXPIRATION_S * 2)
    raw = NodeRecord(peer_id=a.peer_id, step=999, updated_at=get_dht_time()).SerializeToString()
    assert not b.dht.store(node_key(run_id), raw, get_dht_time() + EXPIRATION_S * 2, subkey=a.subkey())

    for reader in (a, b):
        nodes = fetch_nodes(reader.dht, run_id)
        assert list(nodes) == [a.peer_id]
        assert nodes[a.peer_id].step == 1


@pytest.mark.swarm
def test_a_heartbeat_under_another_peers_id_is_ignored(peers, run_id):
    a, b, _ = peers
    assert publish_node(a.dht, run_id, _info(a.peer_id, step=1), a.validator, EXPIRATION_S)
    # b signs a newer heartbeat that claims a's peer id, under its own subkey "<a's id><b's key>"
    usurper = _info(a.peer_id, step=999, shards=[0])
    assert publish_node(b.dht, run_id, usurper, b.validator, EXPIRATION_S)
    for reader in (a, b):
        nodes = fetch_nodes(reader.dht, run_id)
        assert list(nodes) == [a.peer_id] and nodes[a.peer_id].step == 1


@pytest.mark.swarm
def test_a_wait_on_records_ends_once_the_awaited_peers_records_say_so(peers, run_id):
    a, b, c = peers
    assert publish_node(b.dht, run_id, _info(b.peer_id, round=2), b.validator, EXPIRATION_S)
    assert publish_node(c.dht, run_id, _info(c.peer_id, round=2), c.validator, EXPIRATION_S)
    behind_seen = threading.Event()

    def pending(nodes, leaving):
        # what a node leaving after round 3 waits for: its members' records at round 3, or leaving
        assert not leaving or leaving == {c.peer_id}, leaving
        waiting = {
            peer
            for peer in (b.peer_id, c.peer_id)
            if peer not in leaving and (peer not in nodes or nodes[peer].round < 3)
        }
        if waiting == {b.peer_id, c.peer_id}:
            behind_seen.set()
        return waiting

    result = []
    waiter = threading.Thread(
        target=lambda: result.append(wait_for_nodes(a.dht, run_id, pending, timeout=600, poll_s=0.1))
    )
    waiter.start()
    try:
        assert behind_seen.wait(60), "the wait never read both members behind"
        assert waiter.is_alive()
        # one member ends the round, the other leaves: the wait ends with nothing pending
        assert publish_node(b.dht, run_id, _info(b.peer_id, round=3), b.validator, EXPIRATION_S)
        assert withdraw_node(c.dht, run_id, c.peer_id, c.validator)
        waiter.join(60)
        assert not waiter.is_alive() and result == [set()]
    finally:
        waiter.join(60)

    # a member that never ends the round holds the wait for its timeout only, and is returned as still pending
    assert publish_node(b.dht, run_id, _info(b.peer_id, round=4), b.validator, EXPIRATION_S)
    stuck = lambda nodes, leaving: {peer for peer in nodes if nodes[peer].round < 5}  # noqa: E731
    assert wait_for_nodes(a.dht, run_id, stuck, timeout=0.5, poll_s=0.1) == {b.peer_id}
    # a stop ends it at once; with no read made, it knows of nobody pending or not
    stop = threading.Event()
    stop.set()
    assert wait_for_nodes(a.dht, run_id, stuck, timeout=600, stop=stop) is None


def test_owner_key_gives_the_libp2p_peer_id(tmp_path):
    path = tmp_path / "identity.key"
    key = load_or_create_identity(path)
    assert peer_id_of_public_key(key.get_public_key().to_bytes()) == peer_id_of(path).to_base58()


@pytest.mark.swarm
def test_bad_records_are_skipped_with_one_warning_each(peers, run_id, caplog):
    a, b, _ = peers
    assert publish_node(a.dht, run_id, _info(a.peer_id), a.validator, EXPIRATION_S)
    now = get_dht_time()
    owned = b.validator.local_public_key
    good_b = NodeRecord(peer_id=b.peer_id, shards=[0], state=NodeRecord.TRAINING, updated_at=now)
    bad_values = {
        b.peer_id.encode() + owned: b"\xff\xff not a protobuf",
        b"QmNotBytes" + owned: {"peer_id": "QmNotBytes"},
        b"QmImpostor" + owned: good_b.SerializeToString(),
        b"QmNaN" + owned: NodeRecord(peer_id="QmNaN", loss=math.nan).SerializeToString(),
        b"QmShard" + owned: NodeRecord(peer_id="QmShard", shards=[4]).SerializeToString(),
        b"QmEscape" + owned: NodeRecord(peer_id="QmEscape", public_name="\x1b[2J").SerializeToString(),
        b"QmAhead" + owned: NodeRecord(peer_id="QmAhead", round_steps=2**31).SerializeToString(),
        b"QmWhen" + owned: NodeRecord(peer_id="QmWhen", sync_at=-1.0).SerializeToString(),
        b"QmUnsigned": NodeRecord(peer_id="QmUnsigned").SerializeToString(),
    }
    for subkey, value in bad_values.items():
        assert b.dht.store(node_key(run_id), value, now + EXPIRATION_S, subkey=subkey), subkey
    oversized = partial(
        _store_zeros,
        key=node_key(run_id),
        subkey=b"QmOversized" + owned,
        size=MAX_VALUE_BYTES + 1,
        expiration_time=now + EXPIRATION_S,
    )
    assert b.dht.run_coroutine(oversized)

    caplog.clear()
    problems: list[str] = []
    with caplog.at_level(logging.WARNING, logger="spes_node.swarm.records"):
        nodes = fetch_nodes(a.dht, run_id, num_shards=4, problems=problems)
    assert list(nodes) == [a.peer_id]
    warnings = [
        r for r in caplog.records if r.name == "spes_node.swarm.records" and r.levelno == logging.WARNING
    ]
    assert len(warnings) == len(bad_values) + 1
    assert sorted(problems) == sorted(w.getMessage() for w in warnings)
    for needle in (
        "not a NodeRecord",
        "more than",
        "not bytes",
        "differs",
        "not finite",
        "num_shards",
        "control",
        "round_steps is above",
        "sync_at",
        "not signed",
    ):
        assert any(needle in w.getMessage() for w in warnings), needle

    caplog.clear()
    problems.clear()
    with caplog.at_level(logging.WARNING, logger="spes_node.swarm.records"):
        assert list(fetch_nodes(a.dht, run_id, num_shards=4, problems=problems)) == [a.peer_id]
    assert not caplog.records, "a bad record is logged once, not on every fetch"
    assert len(problems) == len(bad_values) + 1, "but every fetch reports it to its caller"

    later = now + EXPIRATION_S + 1
    assert b.dht.store(node_key(run_id), good_b.SerializeToString(), later, subkey=b.peer_id.encode() + owned)
    assert set(fetch_nodes(a.dht, run_id, num_shards=4)) == {a.peer_id, b.peer_id}


@pytest.mark.swarm
def test_withdraw_removes_node_now(peers, run_id):
    a, b, _ = peers
    assert publish_node(a.dht, run_id, _info(a.peer_id), a.validator, EXPIRATION_S)
    assert publish_node(b.dht, run_id, _info(b.peer_id), b.validator, EXPIRATION_S)
    assert set(fetch_nodes(b.dht, run_id)) == {a.peer_id, b.peer_id}

    assert withdraw_node(a.dht, run_id, a.peer_id, a.validator)
    for reader in (a, b):
        assert set(fetch_nodes(reader.dht, run_id)) == {b.peer_id}
    assert withdraw_node(b.dht, run_id, b.peer_id, b.validator)
    assert fetch_nodes(a.dht, run_id) == {}


@pytest.mark.swarm
def test_config_is_anchored_and_copies_are_never_counted(peers, run_id):
    a, b, c = peers
    assert fetch_config(a.dht, run_id) is None and fetch_configs(a.dht, run_id) == {}
    hash_x, hash_y = config_digest(CONFIG_X), config_digest(CONFIG_Y)

    assert publish_config(a.dht, run_id, CONFIG_X, hash_x, a.validator, EXPIRATION_S, created_at=200.0)
    only = fetch_config(c.dht, run_id)
    assert (only.run_id, only.config_hash, only.config_json, only.created_at) == (
        run_id,
        hash_x,
        CONFIG_X,
        200.0,
    )
    assert only.expires_at > get_dht_time()

    assert publish_config(b.dht, run_id, CONFIG_Y, hash_y, b.validator, EXPIRATION_S, created_at=100.0)
    assert publish_config(c.dht, run_id, CONFIG_X, hash_x, c.validator, EXPIRATION_S, created_at=300.0)
    with pytest.raises(ConfigConflict) as conflict:
        fetch_config(a.dht, run_id)  # two copies of X against one of Y decide nothing
    assert sorted(conflict.value.hashes) == sorted([hash_x, hash_y])
    assert (
        hash_x in str(conflict.value)
        and hash_y in str(conflict.value)
        and "--config-hash" in str(conflict.value)
    )

    anchored = fetch_config(b.dht, run_id, config_hash=hash_x)
    assert (anchored.config_json, anchored.created_at) == (CONFIG_X, 200.0), "the earliest copy of the anchor"
    assert fetch_config(b.dht, run_id, config_hash=hash_y).config_json == CONFIG_Y
    assert fetch_config(b.dht, run_id, config_hash="0" * 64) is None
    assert {h: info.config_json for h, info in fetch_configs(a.dht, run_id).items()} == {
        hash_x: CONFIG_X,
        hash_y: CONFIG_Y,
    }


def test_config_hash_flag_values():
    digest = config_digest(CONFIG_X)
    assert check_config_hash(digest) == digest
    assert check_config_hash(f" {digest.upper()}\n") == digest
    for bad in ("", digest[:12], digest + "0", "g" * 64):
        with pytest.raises(ValueError, match="--config-hash"):
            check_config_hash(bad)


def test_size_validator_refuses_oversized_values_and_subkeys_before_the_signature_check():
    signer = RSASignatureValidator()
    composite = CompositeValidator(record_validators(signer))
    assert [type(v) for v in composite._validators] == [RSASignatureValidator, RecordSizeValidator]
    subkey = b"QmPeer" + signer.local_public_key

    def signed(value: bytes, subkey: bytes = subkey) -> DHTRecord:
        record = DHTRecord(b"key", subkey, value, 1e10)
        return DHTRecord(b"key", subkey, composite.sign_value(record), 1e10)

    assert composite.validate(signed(b"x" * MAX_VALUE_BYTES))
    assert composite.strip_value(signed(b"payload")) == b"payload"
    assert not composite.validate(signed(b"x" * (MAX_VALUE_BYTES + 4096)))
    assert not composite.validate(signed(b"x", subkey=b"Q" * 5000 + signer.local_public_key))
    # the size check runs first: a huge value is refused even though its signature was never made
    assert not RecordSizeValidator().validate(DHTRecord(b"key", subkey, b"\x00" * (3 << 20), 1e10))


@pytest.mark.swarm
def test_honest_peers_refuse_oversized_values_at_store(peers, run_id):
    stranger = peers[2]  # signatures only: it stores whatever it signs
    honest = Peer([peers[0].dht.get_visible_maddrs()[0]], validators=record_validators)
    try:
        assert publish_node(honest.dht, run_id, _info(honest.peer_id), honest.validator, EXPIRATION_S)
        owned = stranger.validator.local_public_key
        for size in (MAX_VALUE_BYTES + 4096, 1 << 20):
            store = partial(
                _store_zeros,
                key=node_key(run_id),
                subkey=f"QmOversized{size}".encode() + owned,
                size=size,
                expiration_time=get_dht_time() + EXPIRATION_S,
            )
            stranger.dht.run_coroutine(store)
            held = honest.dht.run_coroutine(partial(_held_value_sizes, key=node_key(run_id)))
            assert held and max(held) < MAX_VALUE_BYTES, held
        problems: list[str] = []
        assert list(fetch_nodes(honest.dht, run_id, problems=problems)) == [honest.peer_id]
        assert not problems, (
            "the honest reader refuses the stranger's answer as a whole; nothing to warn about"
        )
    finally:
        honest.dht.shutdown()


async def _held_value_sizes(_dht, node, *, key: str) -> list[int]:
    item = node.protocol.storage.get(DHTID.generate(source=key))
    return [] if item is None else [len(entry.value) for _subkey, entry in item.value.items()]


@pytest.mark.swarm
def test_config_with_wrong_hash_is_ignored(peers, run_id, caplog):
    a, b, _ = peers
    forged = SwarmConfigRecord(run_id=run_id, config_hash=config_digest(CONFIG_X), config_json=CONFIG_Y)
    now = get_dht_time()
    assert b.dht.store(
        config_key(run_id), forged.SerializeToString(), now + 60, subkey=b.validator.local_public_key
    )
    with caplog.at_level(logging.WARNING, logger="spes_node.swarm.records"):
        assert fetch_config(a.dht, run_id) is None
    assert "does not match" in caplog.text

    assert publish_config(a.dht, run_id, CONFIG_X, config_digest(CONFIG_X), a.validator, EXPIRATION_S)
    assert fetch_config(b.dht, run_id).config_json == CONFIG_X
    with pytest.raises(ValueError, match="config_hash"):
        publish_config(a.dht, run_id, CONFIG_X, config_digest(CONFIG_Y), a.validator, EXPIRATION_S)


@pytest.mark.swarm
def test_publish_rejects_bad_info_naming_the_field(peers, run_id):
    a, _, _ = peers
    for overrides, field_name in [
        ({"state": "sleeping"}, "state"),
        ({"loss": math.inf}, "loss"),
        ({"tokens": -1}, "node info"),
        ({"loss_history": [1.0, math.nan]}, "loss_history"),
    ]:
        with pytest.raises(ValueError, match=field_name):
            publish_node(a.dht, run_id, _info(a.peer_id, **overrides), a.validator, EXPIRATION_S)
    assert fetch_nodes(a.dht, run_id) == {}


def test_rsa_key_persists_with_private_mode(tmp_path):
    path = tmp_path / "keys" / "node.key"
    key = load_or_create_identity(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again = load_or_create_identity(path)
    assert again.get_public_key().to_bytes() == key.get_public_key().to_bytes()
    assert RSASignatureValidator(again).local_public_key == RSASignatureValidator(key).local_public_key
    assert [p.name for p in path.parent.iterdir()] == ["node.key"]
    signature = again.sign(b"payload")
    assert key.get_public_key().verify(b"payload", signature)


def test_rsa_key_file_that_is_not_a_key_is_refused(tmp_path):
    path = tmp_path / "node.key"
    path.write_bytes(b"garbage")
    with pytest.raises(ValueError, match="node.key"):
        load_or_create_identity(path)


@pytest.mark.swarm
def test_rsa_key_file_is_a_hivemind_identity(tmp_path):
    path = tmp_path / "node.key"
    load_or_create_identity(path)
    dht = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], identity_path=str(path), start=True)
    try:
        assert dht.peer_id == PeerID.from_identity(path.read_bytes())
    finally:
        dht.shutdown()


def test_a_stopping_node_does_not_wait_on_a_dht_that_hangs(run_id):
    """A DHT process that hangs (stopped here with SIGSTOP) must not hold a node that is asked to stop: its reads
    and stores on the training thread give up once the stop event is set (a store used to wait forever)."""
    peer = Peer()
    stop = threading.Event()
    try:
        assert publish_node(peer.dht, run_id, _info(peer.peer_id), peer.validator, EXPIRATION_S, stop=stop)
        os.kill(peer.dht.pid, signal.SIGSTOP)
        threading.Timer(1.0, stop.set).start()
        problems: list[str] = []
        start = time.monotonic()
        assert fetch_nodes(peer.dht, run_id, problems=problems, stop=stop) == {}
        assert problems and "the node is stopping" in problems[0]
        assert not publish_node(
            peer.dht, run_id, _info(peer.peer_id), peer.validator, EXPIRATION_S, stop=stop
        )
        assert time.monotonic() - start < 10.0, "each call gave up once the node was stopping"
    finally:
        os.kill(peer.dht.pid, signal.SIGCONT)
        peer.dht.shutdown()
