"""Stream handlers that a helper process registered with the node's p2pd, released after the process died.

hivemind's averagers run in processes of their own and register their RPCs (joining a group, the all-reduce's
parts) with the p2pd daemon of the node's DHT, each from its own client socket. p2pd keeps a registration until the
client that made it removes it, naming its own socket: an averager killed outright (the OOM killer, SIGKILL) leaves
its handlers registered, and a new averager for the same group is refused ("handler for protocol ... already set").
So each averager notes, in memory its parent shares, where it registered them (`Registration`); once it is gone, the
parent removes them in its name (`release_stream_handlers`).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
from collections.abc import Iterable

from hivemind.p2p import P2P
from hivemind.p2p.p2p_daemon_bindings.p2pclient import Client
from hivemind.utils.multiaddr import Multiaddr

logger = logging.getLogger(__name__)

ADDRESS_BYTES = 1024


class Registration:
    """Where a process registered its handlers: the p2pd control socket and the process's own client socket, in
    shared memory (no lock: a lock held by a process that is killed stays held). Made before the fork."""

    def __init__(self):
        self._value = multiprocessing.RawArray("c", ADDRESS_BYTES)

    def record(self, p2p: P2P) -> None:
        """In the process that registers, before it does."""
        # hivemind keeps a replica's client socket in a private attribute; test_hivemind_internals checks it
        value = f"{p2p.daemon_listen_maddr}\n{p2p._client_listen_maddr}".encode()
        if len(value) >= ADDRESS_BYTES:
            raise ValueError(f"p2p socket addresses longer than {ADDRESS_BYTES} bytes")
        self._value.value = value

    def addresses(self) -> tuple[Multiaddr, Multiaddr] | None:
        """(p2pd's control socket, the process's client socket), or None if it registered nothing."""
        value = self._value.value.decode()
        if not value:
            return None
        daemon, client = value.split("\n")
        return Multiaddr(daemon), Multiaddr(client)


def release_stream_handlers(registration: Registration, names: Iterable[str], timeout: float = 10.0) -> int:
    """Remove the stream handlers `names` that the (dead) process of `registration` registered; returns how many
    were removed. A handler already removed (the process shut down cleanly) is skipped. Runs its own event loop:
    call it from a thread without one."""
    addresses = registration.addresses()
    if addresses is None:
        return 0
    return asyncio.run(asyncio.wait_for(_remove(*addresses, list(names)), timeout))


async def _remove(daemon: Multiaddr, client_socket: Multiaddr, names: list[str]) -> int:
    # a client of p2pd under the dead process's socket address (it never listens there): p2pd removes a handler
    # only for the socket it was registered from
    client = await Client.create(daemon, client_socket)
    removed = 0
    try:
        for name in names:
            client.control.handlers[name] = None  # the bindings drop their own entry once p2pd has removed it
            try:
                await client.control.remove_stream_handler(name)
                removed += 1
            except Exception as e:  # hivemind's ControlFailure: not registered (any more)
                client.control.handlers.pop(name, None)
                logger.debug(f"stream handler {name}: {e}")
    finally:
        client.close()
    return removed
