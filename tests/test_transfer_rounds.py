"""The state server answers only with state of the round asked for (pure asyncio, no network)."""

import asyncio

import torch

from spes_node.swarm.transfer import Snapshot, StateServer


def _server() -> StateServer:
    server = StateServer(p2p=None, run_id="r", config_hash="h", compression=None)
    server._updated = asyncio.Condition()
    return server


def test_a_stale_snapshot_is_never_served_in_place_of_the_round_asked_for():
    async def scenario():
        server = _server()
        await server.publish("premerge:1", Snapshot(4, {"w": torch.zeros(2)}))
        assert await server._wait_for("premerge:1", min_round=5, timeout=0.2) is None
        assert (await server._wait_for("premerge:1", min_round=4, timeout=0.2)).round == 4

        # a snapshot of the asked round that arrives while the request waits is served
        waiting = asyncio.create_task(server._wait_for("shard:1", min_round=6, timeout=5.0))
        await server.publish("shard:1", Snapshot(5, {"w": torch.zeros(2)}))
        await server.publish("shard:1", Snapshot(6, {"w": torch.ones(2)}))
        served = await waiting
        assert served is not None and served.round == 6

        await server.withdraw("premerge:1")
        assert await server._wait_for("premerge:1", min_round=0, timeout=0.1) is None

    asyncio.run(scenario())
