"""A stranger's fake node record, built from hivemind's public API and the project's public record schema: it
neither moves the honest nodes' round nor slows their refreshes. Real daemons on 127.0.0.1."""

from __future__ import annotations

import signal

import hivemind
import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.proto import crypto_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey
from swarm_utils import Swarm

from spes_node.proto import NodeRecord
from spes_node.swarm import records

pytestmark = pytest.mark.swarm


@pytest.fixture
def swarm(tmp_path):
    made = Swarm(tmp_path, num_shards=2, heartbeat_s=2.0)
    yield made
    made.close()


def _fake_node(swarm: Swarm, tmp_path) -> str:
    """Publish a validly signed record of a node that holds every shard at round 10^6, then vanish."""
    key = RSAPrivateKey()
    identity = tmp_path / "stranger.key"
    identity.write_bytes(
        crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=key.to_bytes()).SerializeToString()
    )
    validator = RSASignatureValidator(key)
    dht = hivemind.DHT(
        initial_peers=[swarm.maddr],
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        identity_path=str(identity),
        record_validators=[validator],
        start=True,
    )
    try:
        peer_id = dht.peer_id.to_base58()
        record = NodeRecord(
            peer_id=peer_id,
            shards=[0, 1],
            round=10**6,
            step=10**6 * swarm.cfg.swarm.sync_steps,
            state=NodeRecord.TRAINING,
            version="0.1.0",
            public_name="fake",
            maddrs=[str(m) for m in dht.get_visible_maddrs()],
            updated_at=get_dht_time(),
        )
        stored = dht.store(
            f"{swarm.run_id}.nodes",
            record.SerializeToString(),
            get_dht_time() + 60,
            subkey=peer_id.encode() + validator.local_public_key,
        )
        assert stored, "the fake record was refused: the attack did not take place"
    finally:
        dht.shutdown()  # the node behind the record does not exist
    return peer_id


def test_a_fake_node_claiming_a_huge_round_moves_and_slows_nobody(swarm, tmp_path):
    for name in ("a", "b"):
        swarm.start(name, "--wait-peers", "2")

    def rounds() -> dict[str, int]:
        return {n.public_name: n.round for n in swarm.nodes().values() if n.public_name in ("a", "b")}

    swarm.wait_for(lambda: len(rounds()) == 2 and min(rounds().values()) >= 1, 240, "two nodes training")
    fake = _fake_node(swarm, tmp_path)
    assert fake in records.fetch_nodes(swarm.bootstrap, swarm.run_id), (
        "the fake record is visible to everyone"
    )
    published = {name: len(swarm.log(name)) for name in ("a", "b")}
    start = rounds()
    swarm.wait_for(lambda: all(r >= start[n] + 4 for n, r in rounds().items()), 240, "four more rounds")
    # what the two logged while both ran: once one stops, the other's refresh from it may fail, as it should
    running = {name: len(swarm.log(name)) for name in ("a", "b")}
    for name in ("a", "b"):
        swarm.procs[name].send_signal(signal.SIGTERM)
    for name in ("a", "b"):
        assert swarm.wait_exit(name, 60) == 0, swarm.log(name)[-3000:]

    for name in ("a", "b"):
        summary, log = swarm.summary(name), swarm.log(name)[published[name] :]
        assert summary["round"] == summary["rounds_done"], "the round moves by one per round"
        assert fake not in log, f"{name} tried the fake node:\n{log[-3000:]}"
        both_running = swarm.log(name)[published[name] : running[name]]
        assert "download of" not in both_running, f"{name}: a refresh failed:\n{both_running[-3000:]}"
