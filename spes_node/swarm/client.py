"""A read-only client of a swarm's DHT: what `status` and `export --peers` open to read records and fetch state."""

from __future__ import annotations

import re
from collections.abc import Sequence

import hivemind

from spes_node.swarm.records import record_validators
from spes_node.swarm.swarm_key import SwarmKey

_GO_TIMESTAMP = re.compile(r"\d{4}/\d\d/\d\d \d\d:\d\d:\d\d ")


def open_client_dht(peers: Sequence[str], timeout: float, swarm_key: SwarmKey | None = None) -> hivemind.DHT:
    """A client-mode DHT peer (no inbound port) that validates records as the nodes do (signatures, sizes) and,
    with `swarm_key`, may enter a private swarm. ValueError with one line when the peers cannot be reached."""
    try:
        return hivemind.DHT(
            initial_peers=list(peers),
            client_mode=True,
            start=True,
            record_validators=record_validators(),
            authorizer=swarm_key.authorizer() if swarm_key else None,
            startup_timeout=timeout,
        )
    except Exception as e:
        text = str(e).strip()
        reason = _GO_TIMESTAMP.sub("", text.splitlines()[-1]) if text else type(e).__name__
        raise ValueError(f"cannot reach the swarm at {', '.join(peers)}: {reason}") from None
