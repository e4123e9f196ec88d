"""A node's identity: one RSA key file that is both its libp2p identity (peer id) and its record-signing key."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey


def load_or_create_identity(path: str | os.PathLike) -> RSAPrivateKey:
    """Load this node's RSA key from ``path``, or create it there (atomically, mode 0600).

    The file uses hivemind's identity format (a libp2p private key), so the same file can be given
    to ``hivemind.DHT(identity_path=...)`` and the peer id then derives from the signing key.
    """
    path = Path(path)
    if path.exists():
        try:
            proto = crypto_pb2.PrivateKey.FromString(path.read_bytes())
            if proto.key_type != crypto_pb2.KeyType.RSA:
                raise ValueError("not an RSA key")
            private_key = serialization.load_der_private_key(proto.data, password=None)
        except Exception as e:
            raise ValueError(f"identity file {path} does not hold an RSA identity: {e}") from e
        if not isinstance(private_key, rsa.RSAPrivateKey):
            raise ValueError(f"identity file {path} does not hold an RSA identity")
        key = RSAPrivateKey.__new__(RSAPrivateKey)
        key.__setstate__({"_private_key": proto.data})
        return key

    key = RSAPrivateKey()
    data = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=key.to_bytes()).SerializeToString()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "wb") as tmp:
            tmp.write(data)
            tmp.flush()
            os.fsync(tmp.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    return key


def peer_id_of(path: str | Path) -> PeerID:
    """The libp2p peer id that a daemon started with this identity file has."""
    return PeerID.from_identity(Path(path).read_bytes())


def peer_id_of_public_key(ssh_public_key: bytes) -> str:
    """The base58 peer id of a libp2p peer whose identity is this RSA public key (OpenSSH form, as record owners
    are written by hivemind's RSASignatureValidator). Same derivation as `PeerID.from_identity`: sha2-256
    multihash of the protobuf-wrapped DER public key."""
    public_key = serialization.load_ssh_public_key(ssh_public_key)
    if not isinstance(public_key, rsa.RSAPublicKey):
        raise ValueError("not an RSA public key")
    der = public_key.public_bytes(
        encoding=serialization.Encoding.DER, format=serialization.PublicFormat.SubjectPublicKeyInfo
    )
    wrapped = crypto_pb2.PublicKey(key_type=crypto_pb2.KeyType.RSA, data=der).SerializeToString()
    return PeerID(_SHA2_256 + hashlib.sha256(wrapped).digest()).to_base58()


_SHA2_256 = bytes([0x12, 0x20])
"""Multihash prefix of a sha2-256 digest (code 0x12, 32 bytes)."""
