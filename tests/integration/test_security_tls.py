"""Mutual TLS pinned to member keys over real wss:// on 127.0.0.1 (issue 7 item 5).

Python 3.11 `ssl` + this machine's OpenSSL + websockets 17, Ed25519 certificates, TLS 1.3.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import ssl
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import NameOID
from structlog.testing import capture_logs
from websockets.asyncio.client import connect
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import InvalidStatus, WebSocketException

from hearthnet.errors import AuthError, ConfigError
from hearthnet.mesh.bus import bus_call
from hearthnet.observability import Metrics
from hearthnet.security.auth import reason_of
from hearthnet.security.keys import NodeKey
from hearthnet.security.members import MemberDirectory
from hearthnet.security.tls import (
    INSECURE_PLAINTEXT_WARNING,
    client_context,
    key_name,
    make_certificate,
    member_gate,
    peer_node_id,
    server_context,
    warn_insecure_plaintext,
)
from hearthnet.transport.websocket import SHARD_PATH, ServerStream, TensorChannel
from hearthnet.transport.websocket import serve as serve_tensors

B, C, X = NodeKey.generate(), NodeKey.generate(), NodeKey.generate()


def row(node_id: str, key: NodeKey) -> dict[str, str]:
    return {"node_id": node_id, "public_key": key.public_key_b64, "trust": "trusted"}


class Node:
    """A TLS WebSocket server of node-a that greets members by their node id."""

    def __init__(self, key: NodeKey, directory: MemberDirectory) -> None:
        self.key, self.directory, self.metrics = key, directory, Metrics()
        self.seen: list[str] = []
        self.uri = ""

    async def handler(self, ws: ServerConnection) -> None:
        who = peer_node_id(ws, self.directory)
        self.seen.append(who)
        await ws.send(f"hello {who}")

    def refusals(self, reason: str) -> float:
        v = self.metrics.registry.get_sample_value("hearthnet_auth_failures_total",
                                                   {"reason": reason})
        return v or 0.0


@contextlib.asynccontextmanager
async def running(key: NodeKey, directory: MemberDirectory) -> AsyncIterator[Node]:
    node = Node(key, directory)
    async with serve(node.handler, "127.0.0.1", 0,
                     ssl=server_context(key, "node-a", directory),
                     process_request=member_gate(directory, metrics=node.metrics)) as server:
        port = server.sockets[0].getsockname()[1]
        node.uri = f"wss://127.0.0.1:{port}"
        yield node


@pytest.fixture
def a_key(tmp_path: Path) -> NodeKey:
    return NodeKey.load_or_create(tmp_path / "a")  # a key with a file, as in the daemon


@pytest.fixture
def directory(a_key: NodeKey) -> MemberDirectory:
    return MemberDirectory.from_dicts([row("node-a", a_key), row("node-b", B),
                                       row("node-c", C)])


async def greet(uri: str, ctx: ssl.SSLContext) -> tuple[str, Any]:
    async with connect(uri, ssl=ctx, open_timeout=5) as ws:
        return str(await ws.recv()), ws


async def refused(uri: str, ctx: ssl.SSLContext | None) -> BaseException:
    """Connect and expect the connection to fail — quickly, not by a timeout."""
    with pytest.raises((OSError, WebSocketException)) as e:  # ssl.SSLError is an OSError
        async with connect(uri, ssl=ctx, open_timeout=5) as ws:
            await ws.recv()
    assert not isinstance(e.value, TimeoutError), "refusal must not be a hang"
    return e.value


def context_with_cert(key: NodeKey, cert: x509.Certificate,
                      trust_server: NodeKey) -> ssl.SSLContext:
    """A client context presenting an arbitrary certificate (for attacks)."""
    ctx = client_context(trust_server, "node-a",
                         MemberDirectory.from_dicts([row("node-a", trust_server)]))
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "c.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (Path(d) / "k.pem").write_bytes(key.private_pem())
        ctx.load_cert_chain(Path(d) / "c.pem", Path(d) / "k.pem")
    return ctx


def cert_issued_by(issuer: NodeKey, subject_key: NodeKey, node_id: str) -> x509.Certificate:
    now = dt.datetime.now(dt.UTC)
    return (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node_id)]))
            .issuer_name(key_name(issuer.public_key))
            .public_key(subject_key.public_key)
            .serial_number(7)
            .not_valid_before(now - dt.timedelta(days=1))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.UniformResourceIdentifier(f"urn:hearthnet:node:{node_id}")]), False)
            .sign(issuer.private_key, None))


async def test_a_member_connects_over_mutual_tls_13(a_key: NodeKey,
                                                    directory: MemberDirectory) -> None:
    async with running(a_key, directory) as node:
        ctx = client_context(B, "node-b", directory, expect="node-a")
        async with connect(node.uri, ssl=ctx, open_timeout=5) as ws:
            assert await ws.recv() == "hello node-b"
            assert peer_node_id(ws, directory, expect="node-a") == "node-a"
            sslobj = ws.transport.get_extra_info("ssl_object")
            assert sslobj.version() == "TLSv1.3"
            cert = x509.load_der_x509_certificate(sslobj.getpeercert(binary_form=True))
            assert cert.public_key() == a_key.public_key  # the certificate key IS the node key
        assert node.seen == ["node-b"]


async def test_a_non_member_is_refused_and_the_node_keeps_serving(
        a_key: NodeKey, directory: MemberDirectory) -> None:
    async with running(a_key, directory) as node:
        await refused(node.uri, client_context(X, "node-x", directory, expect="node-a"))
        assert node.seen == []  # refused in the handshake, before HTTP
        assert (await greet(node.uri, client_context(C, "node-c", directory)))[0] == \
            "hello node-c"


async def test_a_certificate_forged_in_a_members_name_is_refused(
        a_key: NodeKey, directory: MemberDirectory) -> None:
    forged = cert_issued_by(X, X, "node-b")  # names node-b, signed by a stranger...
    forged = (x509.CertificateBuilder().subject_name(forged.subject)
              .issuer_name(key_name(B.public_key))  # ...claiming B's key as issuer
              .public_key(X.public_key).serial_number(8)
              .not_valid_before(forged.not_valid_before_utc)
              .not_valid_after(forged.not_valid_after_utc).sign(X.private_key, None))
    async with running(a_key, directory) as node:
        await refused(node.uri, context_with_cert(X, forged, a_key))
        assert node.seen == []
    # (B's genuine certificate is useless without B's private key: TLS 1.3's
    # CertificateVerify needs it, and `ssl` will not even load a mismatched pair.)


async def test_a_member_cannot_vouch_for_a_strangers_key(
        a_key: NodeKey, directory: MemberDirectory) -> None:
    delegated = cert_issued_by(B, X, "node-b")  # valid chain to B's anchor, stranger's key
    async with running(a_key, directory) as node:
        err = await refused(node.uri, context_with_cert(X, delegated, a_key))
        assert isinstance(err, InvalidStatus) and err.response.status_code == 403
        assert node.seen == [] and node.refusals("unknown_member") == 1


async def test_a_member_key_claiming_another_node_id_is_refused(
        a_key: NodeKey, directory: MemberDirectory) -> None:
    async with running(a_key, directory) as node:
        err = await refused(node.uri,
                            context_with_cert(B, make_certificate(B, "node-c"), a_key))
        assert isinstance(err, InvalidStatus) and err.response.status_code == 403
        assert node.refusals("cert_mismatch") == 1


async def test_a_client_without_a_certificate_is_refused(
        a_key: NodeKey, directory: MemberDirectory) -> None:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    async with running(a_key, directory) as node:
        await refused(node.uri, ctx)
        assert node.seen == []


async def test_a_plaintext_client_against_a_tls_node_fails(
        a_key: NodeKey, directory: MemberDirectory) -> None:
    async with running(a_key, directory) as node:
        await refused(node.uri.replace("wss://", "ws://"), None)
        assert node.seen == []
        assert (await greet(node.uri, client_context(B, "node-b", directory)))[0] == \
            "hello node-b"


async def test_a_client_pinning_another_key_refuses_the_server(
        a_key: NodeKey, directory: MemberDirectory) -> None:
    async with running(a_key, directory) as node:
        err = await refused(node.uri, client_context(B, "node-b", directory, expect="node-c"))
        assert isinstance(err, ssl.SSLCertVerificationError)
        # trusting every member, the post-connect check still names who answered
        ctx = client_context(B, "node-b", directory)
        async with connect(node.uri, ssl=ctx, open_timeout=5) as ws:
            with pytest.raises(AuthError) as e:
                peer_node_id(ws, directory, expect="node-c")
            assert reason_of(e.value) == "unexpected_peer"
    # a server whose key is no member's is refused by a client that trusts all members
    async with running(X, directory) as impostor:
        err = await refused(impostor.uri, client_context(B, "node-b", directory))
        assert isinstance(err, ssl.SSLCertVerificationError)


async def test_member_changes_apply_to_new_connections_without_restart(
        a_key: NodeKey, directory: MemberDirectory) -> None:
    async with running(a_key, directory) as node:
        old_b_ctx = client_context(B, "node-b", directory, expect="node-a")
        assert (await greet(node.uri, old_b_ctx))[0] == "hello node-b"
        d = NodeKey.generate()
        directory.replace([row("node-a", a_key), row("node-c", C), row("node-d", d)])
        await refused(node.uri, old_b_ctx)  # removed: refused in the handshake
        assert (await greet(node.uri, client_context(d, "node-d", directory)))[0] == \
            "hello node-d"  # added: accepted by the running listener
        assert node.seen == ["node-b", "node-d"]


async def test_peer_node_id_refuses_a_plaintext_connection(directory: MemberDirectory) -> None:
    errors: list[str] = []

    async def handler(ws: ServerConnection) -> None:
        try:
            peer_node_id(ws, directory)
        except AuthError as e:
            errors.append(reason_of(e))
        await ws.send("bye")

    async with serve(handler, "127.0.0.1", 0) as server:
        port = server.sockets[0].getsockname()[1]
        async with connect(f"ws://127.0.0.1:{port}", open_timeout=5) as ws:
            assert await ws.recv() == "bye"
    assert errors == ["no_peer_cert"]


def test_dialling_a_non_member_is_refused_before_connecting(
        directory: MemberDirectory) -> None:
    with pytest.raises(AuthError) as e:
        client_context(B, "node-b", directory, expect="node-x")
    assert reason_of(e.value) == "unknown_member"


def test_insecure_plaintext_logs_a_loud_warning() -> None:
    with capture_logs() as logs:
        warn_insecure_plaintext()
    assert logs[0]["log_level"] == "warning" and logs[0]["event"] == "insecure_plaintext"
    assert logs[0]["message"] == INSECURE_PLAINTEXT_WARNING
    assert "INSECURE" in INSECURE_PLAINTEXT_WARNING and "ws://" in INSECURE_PLAINTEXT_WARNING


async def test_a_failed_handshake_reaches_the_dialler_typed(
        a_key: NodeKey, directory: MemberDirectory) -> None:
    """``ssl.SSLError`` never escapes a dial: the tensor channel and the bus both raise an
    `AuthError` with reason ``tls_handshake`` naming the peer and OpenSSL's reason."""
    pinned_to_c = client_context(B, "node-b", directory, expect="node-c")

    async def nothing(_stream: ServerStream) -> None:
        return None

    tensor_server = await serve_tensors(nothing, ssl=server_context(a_key, "node-a", directory))
    async with tensor_server:
        port = tensor_server.sockets[0].getsockname()[1]
        with pytest.raises(AuthError) as e:
            await TensorChannel.connect(f"wss://127.0.0.1:{port}{SHARD_PATH}", {},
                                        ssl=pinned_to_c, deadline_s=10)
    assert reason_of(e.value) == "tls_handshake"
    assert e.value.details["ssl_reason"] == "CERTIFICATE_VERIFY_FAILED"
    assert isinstance(e.value.__cause__, ssl.SSLCertVerificationError)
    async with running(a_key, directory) as node:
        with pytest.raises(AuthError) as e:
            async for _frame in bus_call(node.uri, "status", {}, ssl=pinned_to_c):
                pass
    assert reason_of(e.value) == "tls_handshake" and node.uri in e.value.message


def test_an_unusable_key_is_a_config_error_not_an_ssl_error(
        monkeypatch: pytest.MonkeyPatch, directory: MemberDirectory) -> None:
    def openssl_refuses(*_a: Any, **_k: Any) -> None:
        raise ssl.SSLError(116, "[X509: KEY_VALUES_MISMATCH] key values mismatch")

    monkeypatch.setattr(ssl.SSLContext, "load_cert_chain", openssl_refuses)
    with pytest.raises(ConfigError) as e:
        client_context(B, "node-b", directory)
    assert e.value.reason == "tls_context" and "node-b" in e.value.message
