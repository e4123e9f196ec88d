"""`spes-node status` flags shards nobody holds and shards whose holders all take no inbound connections."""

import json

from spes_node.config import config_digest, load_preset
from spes_node.daemon.status import render, summarize
from spes_node.swarm.records import ConfigInfo, NodeInfo

NOW = 10_000.0
RELAY = "/ip4/10.0.0.1/tcp/4001/p2p/QmRelay"


def _config() -> ConfigInfo:
    text = load_preset("tiny").to_json()
    return ConfigInfo("r", config_digest(text), text, "0.1.0", NOW - 100, NOW + 3000)


def _node(peer_id: str, shards, **fields) -> NodeInfo:
    defaults = dict(state="training", updated_at=NOW - 1, expires_at=NOW + 2, tokens_per_s=100.0)
    return NodeInfo(peer_id=peer_id, shards=list(shards), **{**defaults, **fields})


def _swarm() -> dict[str, NodeInfo]:
    return {
        # shard 0: a public node and a client; shard 1: a client behind a relay only; shard 2: a client only;
        # shard 3: nobody
        "QmPublic01": _node("QmPublic01", [0], public_name="public"),
        "QmNat00002": _node("QmNat00002", [0, 2], client_mode=True, public_name="nat"),
        "QmRelayed3": _node(
            "QmRelayed3",
            [1],
            client_mode=True,
            maddrs=[f"{RELAY}/p2p-circuit/p2p/QmRelayed3"],
            public_name="relayed",
        ),
    }


def test_summary_lists_shards_without_holders_and_without_reachable_holders():
    summary = summarize("r", _config(), _swarm(), NOW)
    json.dumps(summary, allow_nan=False)
    assert summary["no_holder"] == [3]
    assert summary["unreachable_only"] == [1, 2]
    by_shard = {s["shard"]: s for s in summary["shards"]}
    assert [by_shard[s]["reachable_replicas"] for s in range(4)] == [1, 0, 0, 0]
    assert [by_shard[s]["replicas"] for s in range(4)] == [2, 1, 1, 0]
    reach = {n["public_name"]: n["reachable"] for n in summary["nodes"]}
    assert reach == {"public": "direct", "nat": "none", "relayed": "relay"}


def test_a_reachable_holder_clears_the_flag():
    nodes = _swarm()
    nodes["QmPublic04"] = _node("QmPublic04", [1, 2, 3])
    summary = summarize("r", _config(), nodes, NOW)
    assert summary["no_holder"] == [] and summary["unreachable_only"] == []


def test_table_flags_each_shard():
    text = render(summarize("r", _config(), _swarm(), NOW))
    lines = text.splitlines()
    shard_lines = {
        int(line.split()[0]): line for line in lines if line[:1].isdigit() and "-" in line.split()[1]
    }
    assert set(shard_lines) == {0, 1, 2, 3}
    assert "NO REACHABLE HOLDER" not in shard_lines[0] and "NO HOLDER" not in shard_lines[0]
    assert "NO REACHABLE HOLDER" in shard_lines[1] and "NO REACHABLE HOLDER" in shard_lines[2]
    assert "NO HOLDER (experts not trained)" in shard_lines[3]
    assert all("UNDER-REPLICATED (target 2)" in shard_lines[s] for s in (1, 2, 3))
    header = next(line for line in lines if line.startswith("PEER"))
    assert header.split()[-1] == "INBOUND"
    relayed = next(line for line in lines if "relayed" in line and "training" in line)
    assert relayed.split()[-1] == "relay"
