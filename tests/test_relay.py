"""Relay helpers (`spes_node.swarm.relay`); the relay itself is exercised in namespaces by tests/test_netns.py."""

from __future__ import annotations

import pytest
from hivemind.p2p import PeerID
from hivemind.utils.multiaddr import Multiaddr

from spes_node.swarm import relay
from spes_node.swarm.records import NodeInfo

RELAY_ID = "12D3KooWCnLmjc8oo1X4AgZxffePQrQuqwX7FTqfg3QTq4mSn26q"
NODE_ID = "QmUSj3pmNyBfBqLMBNrRpjSKYgzh8P3Cqgqk5tjMK8fnn9"
RELAY = f"/ip4/10.1.2.1/tcp/41793/p2p/{RELAY_ID}"


def test_circuit_addresses_lead_through_the_relay_to_the_node():
    assert relay.circuit_maddrs([RELAY], NODE_ID) == [f"{RELAY}/p2p-circuit/p2p/{NODE_ID}"]
    with pytest.raises(ValueError, match="peer id"):
        relay.circuit_maddrs(["/ip4/10.1.2.1/tcp/41793"], NODE_ID)


def test_only_circuits_to_the_record_owner_are_dialled():
    mine = f"{RELAY}/p2p-circuit/p2p/{NODE_ID}"
    other = f"{RELAY}/p2p-circuit/p2p/{RELAY_ID}"
    nested = f"{RELAY}/p2p-circuit/p2p/{RELAY_ID}/p2p-circuit/p2p/{NODE_ID}"
    direct = f"/ip4/10.1.2.3/tcp/4000/p2p/{NODE_ID}"
    assert relay.circuits_of(NODE_ID, [mine, other, nested, direct, "garbage"]) == [mine]


def test_a_client_mode_node_serves_state_only_with_a_relay():
    circuit = f"{RELAY}/p2p-circuit/p2p/{NODE_ID}"
    assert relay.serves_state(NodeInfo(peer_id=NODE_ID, shards=[0]))
    assert not relay.serves_state(NodeInfo(peer_id=NODE_ID, shards=[0], client_mode=True))
    assert relay.serves_state(NodeInfo(peer_id=NODE_ID, shards=[0], client_mode=True, maddrs=[circuit]))
    # a circuit to someone else does not make a client-mode node reachable
    foreign = f"{RELAY}/p2p-circuit/p2p/{RELAY_ID}"
    assert not relay.serves_state(NodeInfo(peer_id=NODE_ID, shards=[0], client_mode=True, maddrs=[foreign]))


def test_wire_form_uses_bare_multihashes_for_peer_ids():
    wire = relay._WireMaddr(f"{RELAY}/p2p-circuit").to_bytes()
    relay_mh = PeerID.from_base58(RELAY_ID).to_bytes()
    expected = (
        Multiaddr("/ip4/10.1.2.1/tcp/41793").to_bytes()
        + relay._uvarint(421)
        + relay._uvarint(len(relay_mh))
        + relay_mh
        + relay._uvarint(290)
    )
    assert wire == expected
    assert relay._uvarint(421) == bytes([0xA5, 0x03]) and relay._uvarint(290) == bytes([0xA2, 0x02])


def test_dht_options():
    assert relay.dht_kwargs(()) == {}
    assert relay.dht_kwargs((), "public") == {"force_reachability": "public"}
    relayed = relay.dht_kwargs([RELAY])
    assert relayed["use_auto_relay"] and relayed["trusted_relays"] == [RELAY]
    assert relayed["force_reachability"] == "private"
    with pytest.raises(ValueError):
        relay.dht_kwargs((), "sometimes")
