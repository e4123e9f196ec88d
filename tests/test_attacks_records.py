"""Attacks on the swarm's DHT records by strangers of an open swarm, built from hivemind's public API only.

Each attacker is a plain `hivemind.DHT` with its own `RSASignatureValidator` key that joins the bootstrap and
stores under its own signed subkeys, as anyone who knows the bootstrap address and the run id can.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import partial

import hivemind
import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey
from swarm_utils import NODE_ENV, Swarm, spes_cli

from spes_node.config import config_digest
from spes_node.proto import SwarmConfigRecord
from spes_node.swarm import records

MIB = 1024 * 1024
HEARTBEAT = {"heartbeat_s": 5.0}
"""Records live 3 heartbeats: 15 s. With 2 s (and 1 s before it), status never listed both nodes in one read within
120 s in 2 of 5 loaded suite runs; a record lapsing between heartbeats on a loaded machine is the suspect."""


class Stranger:
    """A plain hivemind DHT peer with its own signing key, joined to the swarm's bootstrap."""

    def __init__(self, swarm: Swarm):
        self.validator = RSASignatureValidator(RSAPrivateKey())
        self.dht = hivemind.DHT(
            initial_peers=[swarm.maddr],
            host_maddrs=["/ip4/127.0.0.1/tcp/0"],
            record_validators=[self.validator],
            start=True,
        )
        self.peer_id = self.dht.peer_id.to_base58()

    def store(self, key: str, prefix: bytes, value: bytes, expiration_s: float = 600.0) -> bool:
        """Store `value` under the signed subkey `prefix + own key` (as a node record's or a config's subkey)."""
        subkey = prefix + self.validator.local_public_key
        return bool(self.dht.store(key, value, get_dht_time() + expiration_s, subkey=subkey))

    def store_zeros(self, key: str, prefix: bytes, size: int) -> bool:
        """Like `store` for a value of `size` zero bytes, made inside the DHT process (the pipe between this
        process and its DHT process does not carry megabytes)."""
        store = partial(
            _store_zeros,
            key=key,
            subkey=prefix + self.validator.local_public_key,
            size=size,
            expiration_time=get_dht_time() + 600,
        )
        return bool(self.dht.run_coroutine(store))


async def _store_zeros(_dht, node, *, key: str, subkey: bytes, size: int, expiration_time: float) -> bool:
    return await node.store(key, b"\x00" * size, expiration_time, subkey=subkey)


async def _stored_value_sizes(_dht, node, *, key: str) -> list[int]:
    """The sizes of the values this peer holds under `key`, in its storage and in its cache."""
    sizes = []
    for storage in (node.protocol.storage, node.protocol.cache):
        item = storage.get(DHTID.generate(source=key))
        if item is None:
            continue
        if isinstance(item.value, DictionaryDHTValue):
            sizes += [len(entry.value) for _subkey, entry in item.value.items()]
        else:
            sizes.append(len(item.value))
    return sizes


def _largest_stored(dht: hivemind.DHT, key: str) -> int:
    return max(dht.run_coroutine(partial(_stored_value_sizes, key=key)), default=0)


def _by_name(swarm: Swarm) -> dict[str, records.NodeInfo]:
    return {n.public_name: n for n in swarm.nodes().values()}


def _status(swarm: Swarm, *args: str) -> subprocess.CompletedProcess:
    return spes_cli("status", "--peers", swarm.maddr, "--run-id", swarm.run_id, "--json", *args, timeout=180)


@pytest.fixture
def swarm(tmp_path):
    made = Swarm(tmp_path, run_id="attacked", num_shards=2, **HEARTBEAT)
    yield made
    made.close()


@pytest.mark.swarm
def test_oversized_values_are_refused_at_store_and_hide_no_node(swarm):
    key = records.node_key(swarm.run_id)
    vandal = Stranger(swarm)
    try:
        # before any node is up: the bootstrap is the only honest peer to store on
        for size in (1 * MIB, 3 * MIB):
            vandal.store_zeros(key, f"{vandal.peer_id}-{size}".encode(), size)
        assert _largest_stored(swarm.bootstrap, key) == 0, "the bootstrap stored an oversized value"

        # the nodes must see each other through the DHT to pass --wait-peers 2 and take a step
        for name in ("a", "b"):
            swarm.start(name, "--wait-peers", "2")
        swarm.wait_for(
            lambda: (
                {n.public_name for n in swarm.nodes().values() if n.state in ("training", "averaging")}
                == {"a", "b"}
            ),
            240,
            "a and b training",
        )

        # again, now that the nodes store records too: every honest peer refuses (what the store returns is not
        # checked: the vandal's own copy counts, and a peer too loaded to answer a 3 MiB request in time is no refusal)
        for i, size in enumerate(
            (1 * MIB, 3 * MIB, 3 * MIB)
        ):  # any two that landed would pass the 4 MiB limit
            vandal.store_zeros(key, f"{vandal.peer_id}-again-{i}".encode(), size)
        assert _largest_stored(swarm.bootstrap, key) <= records.MAX_VALUE_BYTES
        # the vandal's own storage holds them and answers reads with them: no reader is blinded by that
        assert _largest_stored(vandal.dht, key) >= 3 * MIB
        swarm.wait_for(
            lambda: sorted(n.public_name for n in swarm.nodes().values()) == ["a", "b"],
            60,
            "the bootstrap to read a's and b's records",
        )

        listed = []

        def status_lists_both():
            # polled: on a loaded machine a heartbeat can lapse between reads; a blinded reader never lists them
            status = _status(swarm)
            assert status.returncode == 0, status.stderr[-3000:]
            summary = json.loads(status.stdout)
            listed.append((sorted(n["public_name"] for n in summary["nodes"]), summary["warnings"]))
            return summary if listed[-1][0] == ["a", "b"] else None

        summary = swarm.wait_for(
            status_lists_both,
            120,
            "status --json to list a and b",
            seen=lambda: f"its last reads (names, warnings): {listed[-4:]}",
        )
        assert summary["config_hash"] == swarm.cfg.hash()
        assert not [w for w in summary["warnings"] if "Could not read" in w or "no live node" in w], summary

        at_attack = min(n.round for n in _by_name(swarm).values())
        swarm.wait_for(
            lambda: min(n.round for n in _by_name(swarm).values()) >= at_attack + 1,
            240,
            "a and b to finish another round",
        )
    finally:
        vandal.dht.shutdown()
    for name in ("a", "b"):
        assert "Traceback" not in swarm.log(name)


def _sybil_config(swarm: Swarm, sybil: Stranger, config_json: str) -> bool:
    record = SwarmConfigRecord(
        run_id=swarm.run_id,
        config_hash=config_digest(config_json),
        config_json=config_json,
        software_version="0.1.0",
        created_at=get_dht_time() - 3600,  # "older" than the founder's, for whatever that would be worth
    )
    return sybil.store(records.config_key(swarm.run_id), b"", record.SerializeToString())


def _one_line_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    lines = [line for line in result.stderr.strip().splitlines() if line.startswith("spes-node: error: ")]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    return lines[0]


@pytest.mark.swarm
def test_sybil_configs_do_not_outvote_the_anchored_config(swarm):
    honest = swarm.cfg.hash()
    swarm.start("a")
    swarm.wait_for(lambda: "a" in _by_name(swarm), 180, "the founder's record")

    # without an anchor, a joiner takes a config every copy agrees on, and says that it is not anchored
    swarm.start("b", configured=False)
    swarm.wait_for(lambda: (n := _by_name(swarm).get("b")) and n.state == "training", 240, "b training")
    assert "taken unanchored" in swarm.log("b") and f"--config-hash {honest}" in swarm.log("b")
    assert config_digest((swarm.tmp / "b" / "config.json").read_text()) == honest

    evil_json = swarm.cfg.replace(swarm={"sync_steps": 7}).to_json()
    evil = config_digest(evil_json)
    sybils = [Stranger(swarm) for _ in range(3)]
    try:
        for sybil in sybils:
            assert _sybil_config(swarm, sybil, evil_json)
        key = records.config_key(swarm.run_id)
        swarm.wait_for(
            lambda: (found := swarm.bootstrap.get(key, latest=True)) and len(found.value) >= 5,
            60,
            "3 sybil copies beside 2 honest ones",
        )

        # a joiner without the anchor refuses, naming both hashes, and picks nothing by count
        refused = spes_cli(
            "join", "--peers", swarm.maddr, "--run-id", swarm.run_id, "--checkpoint-dir", str(swarm.tmp / "lost"),
            "--device", "cpu", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", timeout=180,
        )  # fmt: skip
        line = _one_line_error(refused)
        assert honest in line and evil in line and "--config-hash" in line, line

        # a joiner with the anchor takes the honest config and trains with the honest nodes
        swarm.start("c", "--config-hash", honest, configured=False)
        swarm.wait_for(lambda: (n := _by_name(swarm).get("c")) and n.state == "training", 240, "c training")
        assert config_digest((swarm.tmp / "c" / "config.json").read_text()) == honest
        assert "unanchored" not in swarm.log("c")

        # status trusts the anchored config and reports the others; without an anchor it trusts none
        anchored = _status(swarm, "--config-hash", honest)
        assert anchored.returncode == 0, anchored.stderr[-3000:]
        summary = json.loads(anchored.stdout)
        assert summary["config_hash"] == honest and summary["model"] is not None
        assert sorted(summary["config_hashes"]) == sorted([honest, evil])
        assert any(evil in w and "ignored" in w for w in summary["warnings"]), summary["warnings"]
        assert {"a", "b", "c"} <= {n["public_name"] for n in summary["nodes"]}

        unanchored = _status(swarm)
        assert unanchored.returncode == 0, unanchored.stderr[-3000:]
        summary = json.loads(unanchored.stdout)
        assert summary["config_hash"] is None
        assert any(honest in w and evil in w and "--config-hash" in w for w in summary["warnings"]), summary
        table = spes_cli("status", "--peers", swarm.maddr, "--run-id", swarm.run_id, timeout=180)
        assert "config untrusted" in table.stdout and "WARNING: " in table.stdout, table.stdout
    finally:
        for sybil in sybils:
            sybil.dht.shutdown()
    for name in ("a", "b", "c"):
        assert "Traceback" not in swarm.log(name)


@pytest.mark.parametrize(
    "args, message",
    [
        (["join", "--config-hash", "abc"], "--config-hash: expected the 64 hex digits"),
        (["join", "--preset", "tiny", "--config-hash", "0" * 64], "is not the hash of the given --preset"),
        (["status", "--peers", "/ip4/127.0.0.1/tcp/1", "--config-hash", "xyz"], "--config-hash: expected"),
    ],
)
def test_config_hash_flag_is_checked_before_anything_starts(args, message):
    result = spes_cli(*args, timeout=60)
    assert message in _one_line_error(result)


def test_config_hash_reads_the_environment():
    result = subprocess.run(
        [sys.executable, "-m", "spes_node.cli", "join", "--preset", "tiny"],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, **NODE_ENV, SPES_CONFIG_HASH="f" * 64),
    )
    assert "is not the hash of the given --preset" in _one_line_error(result)


# ---------------------------------------------------------------------------------------------- the anchor, unit


def _published(*cfgs) -> dict[str, records.ConfigInfo]:
    return {
        cfg.hash(): records.ConfigInfo("r", cfg.hash(), cfg.to_json(), "0.1.0", 100.0 + i, 1e10)
        for i, cfg in enumerate(cfgs)
    }


@pytest.fixture
def agree(monkeypatch, tmp_path):
    """`Node._agree_on_config` against configs published in a fake DHT; returns (config, log) or raises."""
    from spes_node.daemon.node import Node, NodeOptions

    def run(published, cfg=None, peers=("/ip4/127.0.0.1/tcp/1",), **options):
        monkeypatch.setattr(records, "fetch_configs", lambda dht, run_id, problems=None: dict(published))
        monkeypatch.setattr(Node, "_publish_config", lambda self: None)
        opts = NodeOptions(
            peers=list(peers), run_id="r", checkpoint_dir=tmp_path, join_timeout=0.0, **options
        )
        node = Node(cfg, opts)
        node.dht = None
        return node._agree_on_config()

    return run


def test_the_anchor_picks_the_config_and_copies_are_not_counted(agree, caplog):
    from spes_node.config import load_preset
    from spes_node.daemon.node import NodeError

    honest, evil = load_preset("tiny"), load_preset("tiny").replace(swarm={"sync_steps": 7})
    both = _published(evil, honest)
    assert agree(both, config_hash=honest.hash()).hash() == honest.hash()
    assert agree(both, cfg=honest).hash() == honest.hash()
    with pytest.raises(NodeError, match="different configs published") as refused:
        agree(both)
    assert honest.hash() in str(refused.value) and evil.hash() in str(refused.value)
    with pytest.raises(NodeError, match="config mismatch"):
        agree(_published(evil), config_hash=honest.hash())
    with pytest.raises(NodeError, match="config mismatch"):
        agree(_published(evil), cfg=honest)
    with caplog.at_level("WARNING", logger="spes_node.daemon.node"):
        assert agree(_published(honest)).hash() == honest.hash()
    assert "taken unanchored" in caplog.text and f"--config-hash {honest.hash()}" in caplog.text
    # the founder (no peers, nothing published) founds with its own config
    assert agree({}, cfg=honest, peers=()).hash() == honest.hash()


def test_a_checkpoint_anchors_the_config_of_a_restarted_node(agree, tmp_path):
    import torch

    from spes_node.config import load_preset
    from spes_node.daemon.checkpoint import CheckpointManager
    from spes_node.daemon.node import NodeError

    honest, evil = load_preset("tiny"), load_preset("tiny").replace(swarm={"sync_steps": 7})
    CheckpointManager(tmp_path).save(5, {"w": torch.zeros(2)}, {"config_hash": honest.hash(), "round": 1})
    assert agree(_published(evil, honest)).hash() == honest.hash()
    with pytest.raises(NodeError, match="config mismatch"):
        agree(_published(evil))
    with pytest.raises(NodeError, match="is not the config of the checkpoint"):
        agree(_published(evil, honest), config_hash=evil.hash())
