"""Node identity: the Ed25519 key of a node and the node ids bound to public keys.

A node is named by a configured id string (``"node-a"``); the community's member list
binds that id to the base64 of the node's raw 32-byte Ed25519 public key (M26 §5.8).
The private key lives in ``<data_dir>/node.key`` as unencrypted PKCS#8 PEM with file mode
0600; a key file that group or others can read is refused rather than used.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import os
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from hearthnet.errors import ConfigError
from hearthnet.ids import NODE_ID_RULE, valid_node_id

KEY_FILE_NAME = "node.key"
PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64


def check_node_id(node_id: object) -> str:
    """Return `node_id` if legal, else raise `ConfigError` saying what a node id may be."""
    if not valid_node_id(node_id):
        raise ConfigError(
            f"invalid node id {node_id!r}: use {NODE_ID_RULE}", key="node.id",
            reason="invalid node id")
    assert isinstance(node_id, str)
    return node_id


def public_key_bytes(public_key: Ed25519PublicKey) -> bytes:
    """The raw 32 bytes of an Ed25519 public key."""
    return public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def encode_public_key(raw: bytes) -> str:
    """Base64 (standard alphabet, padded) of a raw public key, as written in member lists."""
    return base64.b64encode(raw).decode("ascii")


def decode_public_key(text: str) -> Ed25519PublicKey:
    """Parse a member list's base64 public key.

    Raises:
        ConfigError: not base64 of exactly 32 bytes.
    """
    try:
        raw = base64.b64decode(text.strip(), validate=True)
    except (binascii.Error, ValueError, AttributeError) as e:
        raise ConfigError(f"public key {text!r} is not valid base64", key="public_key",
                          reason="not base64") from e
    if len(raw) != PUBLIC_KEY_BYTES:
        raise ConfigError(f"public key must be {PUBLIC_KEY_BYTES} bytes, got {len(raw)}",
                          key="public_key", reason="wrong length")
    return Ed25519PublicKey.from_public_bytes(raw)


def fingerprint(raw_public_key: bytes) -> str:
    """A short display form of a public key, as OpenSSH shows one: ``SHA256:<base64>``."""
    digest = hashlib.sha256(raw_public_key).digest()
    return "SHA256:" + base64.b64encode(digest).decode("ascii").rstrip("=")


def verify_signature(public_key: Ed25519PublicKey, data: bytes, sig: bytes) -> bool:
    """Whether `sig` is `public_key`'s Ed25519 signature of `data`; never raises on bad input."""
    if not isinstance(sig, (bytes, bytearray)) or len(sig) != SIGNATURE_BYTES:
        return False
    if not isinstance(data, (bytes, bytearray, memoryview)):
        return False
    try:
        public_key.verify(bytes(sig), bytes(data))
    except InvalidSignature:
        return False
    return True


@dataclass(frozen=True)
class NodeKey:
    """A node's Ed25519 private key: its identity in the community.

    Attributes:
        private_key: the key itself. Never logged, never sent.
        path: the file it was loaded from or saved to, if any.
    """

    private_key: Ed25519PrivateKey = field(repr=False)
    path: Path | None = None

    @classmethod
    def generate(cls) -> NodeKey:
        """A fresh random key, not yet saved."""
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> NodeKey:
        """Load a key file written by `save` / `hearthnet keys init`.

        Raises:
            ConfigError: missing or unreadable file, group/world permissions, not an
                Ed25519 PKCS#8 PEM key.
        """
        p = Path(path)
        try:
            fd = os.open(p, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError as e:
            raise ConfigError(f"cannot open node key {p}: {e.strerror}; create one with "
                              "`hearthnet keys init`", file=str(p), reason="unreadable") from e
        with os.fdopen(fd, "rb") as f:
            _check_private_mode(p, os.fstat(f.fileno()).st_mode)
            pem = f.read()
        return cls(_parse_private_pem(p, pem), p)

    @classmethod
    def load_or_create(cls, data_dir: str | os.PathLike[str]) -> NodeKey:
        """Load ``<data_dir>/node.key``, creating it (mode 0600) if it does not exist.

        Creation is atomic: the key is written to a private temporary file and hard-linked
        into place, so two processes racing here end up with the same key.
        """
        d = Path(data_dir)
        d.mkdir(parents=True, exist_ok=True)
        path = d / KEY_FILE_NAME
        if not path.exists():
            key = cls.generate()
            with contextlib.suppress(FileExistsError):
                key.save(path)
        return cls.load(path)

    def save(self, path: str | os.PathLike[str]) -> NodeKey:
        """Write the key to `path` with mode 0600; never overwrites an existing file.

        Raises:
            FileExistsError: `path` already exists.
        """
        p = Path(path)
        fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=".node-key-")  # mode 0600
        try:
            with os.fdopen(fd, "wb") as f:
                os.fchmod(f.fileno(), 0o600)
                f.write(self.private_pem())
                f.flush()
                os.fsync(f.fileno())
            os.link(tmp, p)
        finally:
            os.unlink(tmp)
        return NodeKey(self.private_key, p)

    def private_pem(self) -> bytes:
        """The key as unencrypted PKCS#8 PEM (for the key file and the TLS loader only)."""
        return self.private_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption())

    @property
    def public_key(self) -> Ed25519PublicKey:
        return self.private_key.public_key()

    @property
    def public_key_raw(self) -> bytes:
        """The raw 32-byte public key."""
        return public_key_bytes(self.public_key)

    @property
    def public_key_b64(self) -> str:
        """The public key as written in a member list (base64 of the raw 32 bytes)."""
        return encode_public_key(self.public_key_raw)

    @property
    def fingerprint(self) -> str:
        """``SHA256:<base64>`` of the public key, for people to compare."""
        return fingerprint(self.public_key_raw)

    def sign(self, data: bytes) -> bytes:
        """The 64-byte Ed25519 signature of `data`."""
        return self.private_key.sign(bytes(data))


def _check_private_mode(path: Path, mode: int) -> None:
    if not stat.S_ISREG(mode):
        raise ConfigError(f"node key {path} is not a regular file", file=str(path),
                          reason="not a file")
    if mode & 0o077:
        raise ConfigError(
            f"node key {path} has mode {stat.S_IMODE(mode):04o}: group or others can read "
            f"it; run `chmod 600 {path}` (and consider the key exposed)",
            file=str(path), reason="insecure permissions")


def _parse_private_pem(path: Path, pem: bytes) -> Ed25519PrivateKey:
    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"node key {path} is not a PEM private key", file=str(path),
                          reason="unparsable") from e
    if not isinstance(key, Ed25519PrivateKey):
        raise ConfigError(f"node key {path} is not an Ed25519 key", file=str(path),
                          reason="wrong key type")
    return key
