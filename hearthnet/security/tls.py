"""Mutual TLS between nodes, pinned to member public keys, with no certificate authority.

Links carry activations (M26 §5.8), so they are encrypted. Each node presents an X.509
certificate whose key *is* its Ed25519 node key, signed by that same key, naming the node id
(subject CN and a ``urn:hearthnet:node:<id>`` SAN). Peers are pinned by the member list.

How pinning works with Python's `ssl` (which has no verify callback): for every member,
a node builds locally a *pin anchor* — a self-issued CA certificate named after a hash of
the member's public key (``CN=hearthnet-key:<b64 sha256>``) and carrying that key — and
loads the anchors as its only trust roots. A node certificate names the anchor of its
own key as issuer, so OpenSSL chains ``node cert -> anchor`` and checks the node cert's
signature with the anchor's public key: that succeeds exactly when the certificate was
signed by a member's private key. The anchor's own signature is irrelevant (OpenSSL does
not check the self-signature of a trust root; RFC 5280 treats it as input), so a throwaway
key signs it. TLS 1.3's CertificateVerify then proves the peer holds the private key of
the certificate it sent. Node certificates are deliberately *not* self-issued: OpenSSL
refuses a self-signed leaf that merely shares a root's name ("self-signed mimic").

The handshake check is a first gate; the authority is `peer_node_id`, run after the
handshake against the live `MemberDirectory`: the leaf's own key must be a member's key
(a member could otherwise issue a certificate to a stranger's key), the certificate must
name that member, and, on the client, the server must be the node it meant to reach. The
server context follows config reloads: its SNI callback (which OpenSSL calls on every
ClientHello, with or without SNI) swaps in a context with the current anchors, so added
members are accepted and removed ones refused without restarting the listener.
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import hashlib
import os
import shutil
import ssl
import tempfile
import threading
from collections.abc import Awaitable, Callable, Iterable, Iterator
from http import HTTPStatus
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from hearthnet.errors import AuthError, ConfigError
from hearthnet.observability import get_logger
from hearthnet.security.auth import AuthReason, note_refusal, refuse
from hearthnet.security.keys import NodeKey, check_node_id, public_key_bytes
from hearthnet.security.members import MemberDirectory

_log = get_logger("security.tls")

SAN_PREFIX = "urn:hearthnet:node:"
_ORG = "HearthNet"
_ANCHOR_NOT_BEFORE = dt.datetime(2000, 1, 1, tzinfo=dt.UTC)
_ANCHOR_NOT_AFTER = dt.datetime(9999, 12, 31, tzinfo=dt.UTC)

INSECURE_PLAINTEXT_WARNING = (
    "INSECURE: insecure_plaintext = true — node links use plain ws:// without TLS. Anyone "
    "on this LAN can read activations (and so reconstruct prompts, M26 §5.9), forge "
    "traffic and impersonate nodes. Use only on an isolated test network.")


# --- certificates ------------------------------------------------------------------

def key_name(public_key: Ed25519PublicKey) -> x509.Name:
    """The X.509 name of a public key's pin anchor: a hash of the key, not a node id."""
    digest = hashlib.sha256(public_key_bytes(public_key)).digest()
    label = base64.urlsafe_b64encode(digest).decode("ascii").rstrip("=")
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, _ORG),
                      x509.NameAttribute(NameOID.COMMON_NAME, "hearthnet-key:" + label)])


def make_certificate(key: NodeKey, node_id: str, *, now: dt.datetime | None = None,
                     days: int = 3650) -> x509.Certificate:
    """The node's certificate: its own key, signed by itself, issued by its key's anchor."""
    check_node_id(node_id)
    now = now or dt.datetime.now(dt.UTC)
    pub = key.public_key
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, _ORG),
                                 x509.NameAttribute(NameOID.COMMON_NAME, node_id)]))
        .issuer_name(key_name(pub))
        .public_key(pub)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(days=1))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(cert_sign=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                              ExtendedKeyUsageOID.CLIENT_AUTH]),
                       critical=False)
        .add_extension(x509.SubjectAlternativeName(
            [x509.UniformResourceIdentifier(SAN_PREFIX + node_id)]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(pub),
                       critical=False)
        .sign(key.private_key, None)
    )


def pin_anchor(public_key: Ed25519PublicKey) -> x509.Certificate:
    """A local trust root that accepts certificates signed by `public_key` (see module doc)."""
    throwaway = Ed25519PrivateKey.generate()
    name = key_name(public_key)
    return (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(public_key)
        .serial_number(1)
        .not_valid_before(_ANCHOR_NOT_BEFORE)
        .not_valid_after(_ANCHOR_NOT_AFTER)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(cert_sign=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
        .sign(throwaway, None)
    )


def _key_usage(*, cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True, content_commitment=False, key_encipherment=False,
        data_encipherment=False, key_agreement=False, key_cert_sign=cert_sign,
        crl_sign=False, encipher_only=False, decipher_only=False)


def certificate_node_id(cert: x509.Certificate) -> str | None:
    """The node id a certificate claims (SAN ``urn:hearthnet:node:<id>``, else CN)."""
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        for uri in san.get_values_for_type(x509.UniformResourceIdentifier):
            if uri.startswith(SAN_PREFIX):
                return uri[len(SAN_PREFIX):]
    except x509.ExtensionNotFound:
        pass
    cns = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(cns[0].value) if cns else None


# --- SSL contexts --------------------------------------------------------------------

def _new_context(server: bool, key: NodeKey, node_id: str,
                 pinned: Iterable[Ed25519PublicKey]) -> ssl.SSLContext:
    """A TLS 1.3 context presenting our certificate and trusting the `pinned` keys' anchors.

    Raises:
        ConfigError: OpenSSL refused our key or certificate (``ssl.SSLError``, typed here).
    """
    try:
        return _build_context(server, key, node_id, pinned)
    except ssl.SSLError as e:
        raise ConfigError(f"cannot build a TLS context from the node key of {node_id}: "
                          f"{_ssl_reason(e)}", key="node key", reason="tls_context") from e


def _build_context(server: bool, key: NodeKey, node_id: str,
                   pinned: Iterable[Ed25519PublicKey]) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.check_hostname = False  # peers are pinned by key, not by name
    ctx.verify_mode = ssl.CERT_REQUIRED
    _load_identity(ctx, key, node_id)
    anchors = "".join(pin_anchor(p).public_bytes(serialization.Encoding.PEM).decode("ascii")
                      for p in pinned)
    if anchors:
        ctx.load_verify_locations(cadata=anchors)
    return ctx


def _load_identity(ctx: ssl.SSLContext, key: NodeKey, node_id: str) -> None:
    """Load cert + key; `ssl` reads only files, so they go to a private temporary folder.

    The folder is made next to the key file when there is one (same protection as the key),
    has mode 0700, and is removed before returning.
    """
    parent = key.path.parent if key.path is not None else None
    folder = Path(tempfile.mkdtemp(prefix=".tls-", dir=parent))
    try:
        cert_path, key_path = folder / "node.crt", folder / "node.key"
        cert_pem = make_certificate(key, node_id).public_bytes(serialization.Encoding.PEM)
        cert_path.write_bytes(cert_pem)
        fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(key.private_pem())
        ctx.load_cert_chain(cert_path, key_path)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def server_context(key: NodeKey, node_id: str, directory: MemberDirectory) -> ssl.SSLContext:
    """The listener's context: TLS 1.3, client certificate required, pinned to members.

    Pass it to ``websockets.asyncio.server.serve(..., ssl=ctx)`` and check each connection
    with `peer_node_id` (or `member_gate` as ``process_request``). It follows
    `directory.replace`: each handshake uses the anchors of the current member list.
    """
    lock = threading.Lock()
    state: dict[int, ssl.SSLContext] = {}

    def current() -> ssl.SSLContext:
        version = directory.version
        with lock:
            if version not in state:
                state.clear()
                state[version] = _new_context(True, key, node_id,
                                              (m.public_key for m in directory.members()))
            return state[version]

    outer = current()

    def swap_in_current(sslobj: Any, _server_name: str | None, _ctx: ssl.SSLContext) -> None:
        ctx = current()
        if ctx is not sslobj.context:
            sslobj.context = ctx

    outer.sni_callback = swap_in_current
    return outer


def client_context(key: NodeKey, node_id: str, directory: MemberDirectory, *,
                   expect: str | None = None) -> ssl.SSLContext:
    """A context for dialling a node: presents our certificate, pins the server's key.

    Args:
        expect: the node id we mean to reach; only its key is trusted. None trusts any
            member (then check `peer_node_id` for who answered).

    Raises:
        AuthError: ``unknown_member`` — `expect` is not in the member list.

    Build one per dial (cheap) so that it reflects the current member list; after
    connecting, call ``peer_node_id(ws, directory, expect=...)``.
    """
    if expect is None:
        pinned = [m.public_key for m in directory.members()]
    else:
        member = directory.get(expect)
        if member is None:
            raise refuse(AuthReason.UNKNOWN_MEMBER,
                         f"cannot dial {expect}: not in the member list", peer=expect)
        pinned = [member.public_key]
    return _new_context(False, key, node_id, pinned)


# --- the handshake --------------------------------------------------------------------

def handshake_refused(exc: ssl.SSLError, peer: str) -> AuthError:
    """The typed refusal for a TLS handshake with `peer` that OpenSSL failed.

    Its reason is ``tls_handshake``; ``ssl_reason`` carries OpenSSL's short reason
    (``CERTIFICATE_VERIFY_FAILED``: the peer's key is not one we pin;
    ``TLSV13_ALERT_CERTIFICATE_REQUIRED``: the peer wants a certificate we did not send).
    """
    why = getattr(exc, "verify_message", None) or _ssl_reason(exc)
    return AuthError(f"TLS handshake with {peer} failed: {why} (is it a member, and are we "
                     f"one of its members?)", reason=AuthReason.TLS_HANDSHAKE.value,
                     peer=peer, ssl_reason=_ssl_reason(exc))


def _ssl_reason(exc: ssl.SSLError) -> str:
    """OpenSSL's short reason; an SSLError built in Python may have none."""
    return str(getattr(exc, "reason", None) or type(exc).__name__)


@contextlib.contextmanager
def tls_refusals(peer: str) -> Iterator[None]:
    """Turn an ``ssl.SSLError`` raised inside (a dial and its handshake) into an `AuthError`.

    Use around a client dial: ``with tls_refusals(uri): ws = await connect(uri, ssl=ctx)``.
    """
    try:
        yield
    except ssl.SSLError as e:
        raise handshake_refused(e, peer) from e


# --- after the handshake -------------------------------------------------------------

def peer_certificate_der(conn: Any) -> bytes | None:
    """The DER certificate the peer presented, from a websockets connection, an asyncio
    transport, or an `ssl.SSLObject` / `ssl.SSLSocket`; None if not TLS or no cert."""
    if isinstance(conn, (ssl.SSLObject, ssl.SSLSocket)):
        sslobj: Any = conn
    else:
        transport = getattr(conn, "transport", conn)
        get_extra = getattr(transport, "get_extra_info", None)
        sslobj = get_extra("ssl_object") if get_extra is not None else None
    if sslobj is None:
        return None
    der = sslobj.getpeercert(binary_form=True)
    return bytes(der) if der else None


def peer_node_id(conn: Any, directory: MemberDirectory, *, expect: str | None = None) -> str:
    """The member at the other end of a TLS connection.

    Args:
        conn: a websockets connection (server or client side), an asyncio transport, or
            an ssl object.
        directory: the live member list.
        expect: on the dialling side, the node id we meant to reach.

    Raises:
        AuthError: reason no_peer_cert (plaintext or no certificate), unknown_member (the
            certificate's key is no member's), cert_mismatch (it names another node), or
            unexpected_peer (a member, but not `expect`). Close the connection.
    """
    der = peer_certificate_der(conn)
    if der is None:
        raise refuse(AuthReason.NO_PEER_CERT, "the peer presented no TLS certificate")
    try:
        cert = x509.load_der_x509_certificate(der)
        pub = cert.public_key()
    except ValueError as e:
        raise refuse(AuthReason.UNKNOWN_MEMBER, "unparsable peer certificate") from e
    member = (directory.by_public_key(public_key_bytes(pub))
              if isinstance(pub, Ed25519PublicKey) else None)
    if member is None:
        raise refuse(AuthReason.UNKNOWN_MEMBER, "the peer's key is not a member's key")
    claimed = certificate_node_id(cert)
    if claimed != member.node_id:
        raise refuse(AuthReason.CERT_MISMATCH, f"certificate of {member.node_id}'s key "
                     f"claims to be {claimed!r}", peer=member.node_id)
    if expect is not None and member.node_id != expect:
        raise refuse(AuthReason.UNEXPECTED_PEER,
                     f"dialled {expect} but {member.node_id} answered",
                     peer=member.node_id, expected=expect)
    return member.node_id


ProcessRequest = Callable[[Any, Any], Awaitable[Any]]


def member_gate(directory: MemberDirectory, *, metrics: Any = None) -> ProcessRequest:
    """A websockets ``process_request`` that answers 403 to any peer that is not a member.

    Use as ``serve(handler, host, port, ssl=server_context(...),
    process_request=member_gate(directory, metrics=m))``; in the handler,
    ``peer_node_id(ws, directory)`` then names the caller. Refusals are counted in
    ``auth_failures_total{reason}``.
    """
    async def process_request(connection: Any, _request: Any) -> Any:
        try:
            peer_node_id(connection, directory)
        except AuthError as e:
            note_refusal(metrics, e, remote=_remote(connection))
            return connection.respond(HTTPStatus.FORBIDDEN, "not a community member\n")
        return None
    return process_request


def _remote(connection: Any) -> str:
    addr = getattr(connection, "remote_address", None)
    return f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) and len(addr) >= 2 else "?"


def warn_insecure_plaintext(log: Any = None) -> None:
    """Log the loud start-up warning for ``insecure_plaintext = true``: activations unencrypted."""
    (log or _log).warning("insecure_plaintext", message=INSECURE_PLAINTEXT_WARNING)
