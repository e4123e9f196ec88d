"""A node's identity: one RSA key file that is both its libp2p identity (peer id) and its record-signing key."""

from __future__ import annotations

import os
from pathlib import Path

from hivemind.p2p import P2P, PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey


def load_or_create_identity(path: str | Path) -> RSAPrivateKey:
    """Read the identity at `path`, creating it (mode 0400) if it does not exist."""
    path = Path(path)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
        P2P.generate_identity(str(tmp))
        os.replace(tmp, path)
    try:
        message = crypto_pb2.PrivateKey.FromString(path.read_bytes())
        if message.key_type != crypto_pb2.KeyType.RSA:
            raise ValueError("not an RSA key")
        key = RSAPrivateKey.__new__(RSAPrivateKey)
        key.__setstate__({"_private_key": message.data})
        return key
    except Exception as e:
        raise ValueError(f"identity: cannot read {path}: {e}") from None


def peer_id_of(path: str | Path) -> PeerID:
    """The libp2p peer id that a daemon started with this identity file has."""
    return PeerID.from_identity(Path(path).read_bytes())
