"""Access control for a private swarm: one shared secret, the swarm key, that every member holds.

Three layers, all keyed with HMAC-SHA256 on subkeys derived from the swarm key:

1. **DHT.** Every DHT request (ping, store, find) carries an HMAC over the whole request, a time and a random
   nonce; every reply carries an HMAC bound to the request's nonce (`SwarmKeyAuthorizer`, hivemind's authorizer
   interface). A keyed peer answers no request without a valid tag and drops every reply without one. So a peer
   without the key can neither read the swarm's records (config, node heartbeats, averaging group declarations)
   nor write one that a keyed peer stores: records are gated where they enter, which is why their values carry
   no tag of their own. A request replayed later than `MAX_CLOCK_SKEW_S` or with a nonce seen before is refused.
2. **Averaging.** Without the DHT a stranger cannot find the averaging groups, but one who learned a node's peer
   id could still call its averager directly. So every join request carries `join_tag(prefix, peer_id)`: a leader
   refuses a request without a valid tag, and every member checks every other member's tag in the group's
   gathered data before the all-reduce; a member without one gets weight 0 (see `robust.py`). The tag is bound to
   the peer id, which libp2p authenticates, so a copied tag is worthless to anyone else.
3. **State downloads.** A request for a node's weights (`transfer.py`: refresh, joiners, export) carries the
   same kind of tag, for the prefix "state.<run_id>"; a keyed node serves nothing to a request without one.

Limits, stated plainly:
- every key holder is trusted to join; there is no per-member revocation (a new key means a new swarm). Robust
  averaging (`robust.py`) is the defence against a key holder that misbehaves.
- libp2p itself still talks to strangers: a peer that knows an address can connect, learn the peer id and the
  protocol names (identify), and spend the node's resources; this is not a protection against denial of service.
- an eavesdropper on the path sees who talks to whom, when and how much; libp2p encrypts the streams, so not the
  records nor the tensors. The key itself never travels.
- a key passed with --swarm-key is visible in the process list; prefer --swarm-key-file or SPES_SWARM_KEY.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
from pathlib import Path

from hivemind.utils.auth import AuthorizedRequestBase, AuthorizedResponseBase, AuthorizerBase
from hivemind.utils.crypto import RSAPublicKey
from hivemind.utils.timed_storage import TimedStorage, get_dht_time

logger = logging.getLogger(__name__)

MIN_KEY_CHARS = 16
MAX_KEY_CHARS = 4096
MAX_CLOCK_SKEW_S = 60.0
NONCE_BYTES = 16


class SwarmKey:
    """The swarm's shared secret; only derived subkeys are ever used, and `repr` shows a fingerprint only."""

    def __init__(self, secret: bytes):
        if len(secret) < MIN_KEY_CHARS:
            raise ValueError(f"a swarm key must be at least {MIN_KEY_CHARS} characters")
        if len(secret) > MAX_KEY_CHARS:
            raise ValueError(f"a swarm key must be at most {MAX_KEY_CHARS} characters")
        self._dht_key = _derive(secret, b"dht")
        self._join_key = _derive(secret, b"join")
        self.fingerprint = _derive(secret, b"fingerprint").hex()[:12]
        """Safe to log and to compare between operators: it does not reveal the key."""

    @classmethod
    def from_text(cls, text: str) -> SwarmKey:
        return cls(text.strip().encode())

    @classmethod
    def from_file(cls, path: str | Path) -> SwarmKey:
        return cls.from_text(Path(path).read_text())

    @staticmethod
    def generate() -> str:
        """A new random key as text (256 bits)."""
        return secrets.token_hex(32)

    def join_tag(self, prefix: str, peer_id: bytes) -> bytes:
        """Proof that the holder of `peer_id` has the key, for one averaging group prefix."""
        return hmac.new(self._join_key, prefix.encode() + b"\x00" + peer_id, hashlib.sha256).digest()

    def check_join_tag(self, prefix: str, peer_id: bytes, tag: object) -> bool:
        return isinstance(tag, bytes) and hmac.compare_digest(tag, self.join_tag(prefix, peer_id))

    def authorizer(self) -> SwarmKeyAuthorizer:
        """For `hivemind.DHT(authorizer=...)`: all DHT peers of the swarm, bootstrap peers included, need one."""
        return SwarmKeyAuthorizer(self._dht_key)

    def __repr__(self) -> str:
        return f"SwarmKey(fingerprint={self.fingerprint})"


def load_swarm_key(key: str | None, key_file: str | None) -> SwarmKey | None:
    """The key given on the command line (`--swarm-key` or `--swarm-key-file`), or None for an open swarm."""
    if key and key_file:
        raise ValueError("pass either --swarm-key or --swarm-key-file, not both")
    if key_file:
        try:
            text = Path(key_file).read_text()
        except OSError as e:
            raise ValueError(f"--swarm-key-file: cannot read {key_file}: {e.strerror}") from None
        try:
            return SwarmKey.from_text(text)
        except ValueError as e:
            raise ValueError(f"--swarm-key-file: {e}") from None
    if key:
        try:
            return SwarmKey.from_text(key)
        except ValueError as e:
            raise ValueError(f"--swarm-key: {e}") from None
    return None


class SwarmKeyAuthorizer(AuthorizerBase):
    """Signs and checks every DHT request and reply with an HMAC of the swarm's DHT subkey."""

    def __init__(self, key: bytes):
        self._key = key
        self._recent_nonces = TimedStorage()

    def _tag(self, kind: bytes, message) -> bytes:
        return hmac.new(self._key, kind + message.SerializeToString(), hashlib.sha256).digest()

    async def sign_request(
        self, request: AuthorizedRequestBase, service_public_key: RSAPublicKey | None
    ) -> None:
        auth = request.auth
        auth.time = get_dht_time()
        auth.nonce = secrets.token_bytes(NONCE_BYTES)
        auth.signature = b""
        auth.signature = self._tag(b"request", request)

    async def validate_request(self, request: AuthorizedRequestBase) -> bool:
        auth = request.auth
        signature, auth.signature = auth.signature, b""
        if not hmac.compare_digest(signature, self._tag(b"request", request)):
            logger.debug("refusing a DHT request without a valid swarm key tag")
            return False
        now = get_dht_time()
        if abs(auth.time - now) > MAX_CLOCK_SKEW_S:
            logger.debug(
                "refusing a DHT request: its time is off by more than the allowed skew (or replayed)"
            )
            return False
        with self._recent_nonces.freeze():
            if auth.nonce in self._recent_nonces:
                logger.debug("refusing a replayed DHT request")
                return False
        self._recent_nonces.store(auth.nonce, None, now + 3 * MAX_CLOCK_SKEW_S)
        return True

    async def sign_response(self, response: AuthorizedResponseBase, request: AuthorizedRequestBase) -> None:
        auth = response.auth
        auth.nonce = request.auth.nonce
        auth.signature = b""
        auth.signature = self._tag(b"response", response)

    async def validate_response(
        self, response: AuthorizedResponseBase, request: AuthorizedRequestBase
    ) -> bool:
        auth = response.auth
        signature, auth.signature = auth.signature, b""
        if not hmac.compare_digest(signature, self._tag(b"response", response)):
            logger.debug("dropping a DHT reply without a valid swarm key tag")
            return False
        return hmac.compare_digest(auth.nonce, request.auth.nonce)


def _derive(secret: bytes, label: bytes) -> bytes:
    return hmac.new(secret, b"spes-node swarm key/" + label, hashlib.sha256).digest()
