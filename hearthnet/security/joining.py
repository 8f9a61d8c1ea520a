"""Joining a community with a one-time code instead of pasted keys (M26 §5.8).

A member runs ``hearthnet invite``: its node issues an invite (`InviteBook.issue`), held
only in its memory, and prints a code such as ``7KQ2M-XD4RA@192.168.1.20:41234``: ten
Crockford base32 characters (50 random bits from `secrets`) and where the inviter listens
for joiners. Where the inviter announces its invites by mDNS
(`hearthnet.mesh.join_announce`), the short form ``7KQ2M-XD4RA`` is enough: the joiner
finds the address on the LAN. ``hearthnet join CODE`` on the new machine runs the exchange
below with it.

The exchange is SPAKE2 (Brian Warner's ``spake2``) over the whole code, so the code is a
password: a listener learns nothing from the messages, a man in the middle without the
code gets a session key that matches neither side, and each connection tests at most one
guess online (an invite is burnt after `MAX_TRIES` failed exchanges; an exchange that got
the inviter's first message and did not confirm counts as one). After the key exchange
both sides prove the key (HMAC over the transcript, compared in constant time), then
exchange their identities sealed with AES-GCM under keys derived from it:

====  ==================  ===========================================================
 #     direction           message (msgpack maps)
====  ==================  ===========================================================
 1     joiner → inviter    ``{"v": 1, "invite": <first 2 code chars>, "pake": msgB}``
 2     inviter → joiner    ``{"pake": msgA, "confirm": HMAC(k_inviter, transcript)}``
 3     joiner → inviter    ``{"confirm": HMAC(k_joiner, ...), "sealed": AEAD(card)}``
                           or ``{"error": "wrong_code"}`` when message 2 did not verify
 4     inviter → joiner    ``{"sealed": AEAD(welcome)}`` or ``{"error", "message"}``
====  ==================  ===========================================================

The card is the joiner's node id and public key; the welcome is the inviter's member list
(with the joiner added) and its listener port. Each side pins the other's key from what
it received under the session key, so nobody pastes keys and a wrong, overheard or reused
code admits nobody.

This module is the protocol core: no sockets, no clock of its own (callers pass
``now``). `serve_join` and `dial_join` drive it over any connection with ``send`` and
``recv`` (the node's WebSocket listener, the join command's client, an in-memory pipe in
the tests). Nothing here logs the code or a key.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import secrets
import socket
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from hashlib import sha256
from pathlib import Path
from typing import Any, Protocol

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from spake2 import SPAKE2_A, SPAKE2_B
from spake2.spake2 import SPAKEError

from hearthnet.config import MEMBERS_FILE
from hearthnet.errors import AuthError, BadRequest, ConfigError, PeerDataError
from hearthnet.safe_msgpack import packb, unpackb
from hearthnet.security.keys import PUBLIC_KEY_BYTES, check_node_id
from hearthnet.security.members import parse_members
from hearthnet.security.provision import load_toml, render_members, write_atomic

INVITE_CAPABILITY = "hearthnet.admin.invite"  # admin listener only: a local user's call
JOIN_PATH = "/join"
ALPHABET = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"  # Crockford base32: no I, L, O, U
CODE_CHARS = 10  # 50 bits, of which the ID_CHARS below are public: 40 secret bits,
# tested only online, MAX_TRIES per invite: an attacker's odds are ~2^-38
ID_CHARS = 2  # the first characters name the invite among those pending (not secret:
# message 1 sends them in clear, and the mDNS announcement carries them)
MAX_TRIES = 3
MAX_PENDING = 16
DEFAULT_TTL_S = 600.0
MAX_TTL_S = 24 * 3600.0
MAX_JOIN_MESSAGE_BYTES = 64 * 1024  # a welcome carries the member list: 256 members fit
STEP_TIMEOUT_S = 15.0  # a stalled joiner holds its invite no longer than this per message
_ID_A, _ID_B = b"hearthnet-join-inviter", b"hearthnet-join-joiner"
_CONFUSABLE = str.maketrans({"O": "0", "I": "1", "L": "1"})


class WrongCode(AuthError):
    """The two sides did not hold the same code: no key was learnt, nobody admitted."""


# ---- the code ---------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class JoinCode:
    """A parsed invite code: the secret characters and where the inviter listens (host
    ``""`` and port 0 for the short form: the joiner finds the inviter by mDNS)."""

    secret: str = field(repr=False)
    host: str = ""
    port: int = 0

    @property
    def invite_id(self) -> str:
        return self.secret[:ID_CHARS]

    @property
    def located(self) -> bool:
        """Whether the code says where the inviter listens (the long form)."""
        return bool(self.host and self.port)

    def at(self, host: str, port: int) -> JoinCode:
        """The same code with the inviter's address (found by mDNS)."""
        return JoinCode(self.secret, host, port)

    def short(self) -> str:
        """The code without an address: ``XXXXX-XXXXX``."""
        half = CODE_CHARS // 2
        return f"{self.secret[:half]}-{self.secret[half:]}"

    def text(self) -> str:
        """What a person types: ``XXXXX-XXXXX@host:port`` (IPv6 hosts in brackets), or
        the short form when no address is known."""
        if not self.located:
            return self.short()
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.short()}@{host}:{self.port}"


def new_secret() -> str:
    """`CODE_CHARS` characters from `ALPHABET`, from the OS's secure random source."""
    return "".join(secrets.choice(ALPHABET) for _ in range(CODE_CHARS))


def normalise_secret(text: str) -> str:
    """The secret as issued from what a person typed: case, dashes, spaces and the
    look-alikes O/I/L do not matter.

    Raises:
        BadRequest: not `CODE_CHARS` base32 characters.
    """
    s = "".join(text.split()).replace("-", "").upper().translate(_CONFUSABLE)
    if len(s) != CODE_CHARS or any(c not in ALPHABET for c in s):
        raise BadRequest(f"an invite code has {CODE_CHARS} letters and digits (like "
                         "7KQ2M-XD4RA@192.168.1.20:41234); check what `hearthnet invite` "
                         "printed")
    return s


def parse_code(text: str) -> JoinCode:
    """Parse ``XXXXX-XXXXX@host:port``, or the short ``XXXXX-XXXXX`` (no address: the
    joiner looks for the inviter by mDNS).

    Raises:
        BadRequest: malformed, saying what a code looks like.
    """
    if "@" not in text:
        return JoinCode(normalise_secret(text))
    secret, at, where = text.strip().rpartition("@")
    host, colon, port_text = where.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not (at and colon and host and port_text.isdigit() and 0 < int(port_text) < 65536):
        raise BadRequest("an invite code looks like 7KQ2M-XD4RA (the inviter found on the "
                         "LAN by mDNS) or 7KQ2M-XD4RA@192.168.1.20:41234 (code, then @ and "
                         "where the inviting node listens); copy it whole")
    return JoinCode(normalise_secret(secret), host, int(port_text))


def lan_address() -> str:
    """This machine's address on its default route (a UDP socket is connected, nothing is
    sent), else 127.0.0.1: where a joiner on the LAN can reach a wildcard listener."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: never routed anywhere for real
            return str(s.getsockname()[0])
        except OSError:
            return "127.0.0.1"


# ---- the invites a node holds -------------------------------------------------------

@dataclass(slots=True)
class Invite:
    secret: str = field(repr=False)
    expires_at: float
    tries: int = 0
    busy: bool = False  # one exchange at a time: parallel guesses cannot pass MAX_TRIES


class InviteBook:
    """The pending invites of one node: in memory only, expiring, single use."""

    def __init__(self) -> None:
        self._by_id: dict[str, Invite] = {}

    def issue(self, ttl_s: float, now: float) -> str:
        """A new invite's secret, valid `ttl_s` seconds from `now`.

        Raises:
            BadRequest: `ttl_s` outside (0, 24 h], or `MAX_PENDING` invites pending.
        """
        if not 0 < ttl_s <= MAX_TTL_S:
            raise BadRequest(f"an invite lasts between 1 s and {MAX_TTL_S / 3600:g} h")
        self.expire(now)
        if len(self._by_id) >= MAX_PENDING:
            raise BadRequest(f"{MAX_PENDING} invites are pending already; use one or let "
                             "them expire")
        while True:
            secret = new_secret()
            if secret[:ID_CHARS] not in self._by_id:
                break
        self._by_id[secret[:ID_CHARS]] = Invite(secret, now + ttl_s)
        return secret

    def take(self, invite_id: object, now: float) -> Invite:
        """The pending invite named `invite_id`, reserved for one exchange.

        Raises:
            AuthError: ``unknown_invite`` (never issued, used, burnt or expired) or
                ``invite_busy`` (another exchange holds it).
        """
        self.expire(now)
        inv = self._by_id.get(invite_id) if isinstance(invite_id, str) else None
        if inv is None:
            raise AuthError("this invite code is not valid: it was used already, expired, "
                            "or mistyped; ask for a new one with `hearthnet invite`",
                            reason="unknown_invite")
        if inv.busy:
            raise AuthError("another join is using this invite code right now; try again "
                            "in a moment", reason="invite_busy")
        inv.busy = True
        return inv

    def failed(self, inv: Invite) -> bool:
        """Count a failed exchange of `inv`; True if that burnt it."""
        inv.busy = False
        inv.tries += 1
        if inv.tries >= MAX_TRIES:
            self._drop(inv)
            return True
        return False

    def release(self, inv: Invite) -> None:
        """An exchange ended before it tested the code (no try spent)."""
        inv.busy = False

    def used(self, inv: Invite) -> None:
        """The invite admitted its joiner: it never works again."""
        self._drop(inv)

    def expire(self, now: float) -> None:
        for k, inv in list(self._by_id.items()):
            if inv.expires_at <= now and not inv.busy:
                del self._by_id[k]

    def pending_ids(self) -> set[str]:
        """The ids (`ID_CHARS` first characters) of the invites pending now, as the last
        `expire` left them: what the node announces by mDNS (public, see `ID_CHARS`)."""
        return set(self._by_id)

    def next_expiry(self) -> float | None:
        return min((i.expires_at for i in self._by_id.values()), default=None)

    def __len__(self) -> int:
        return len(self._by_id)

    def _drop(self, inv: Invite) -> None:
        self._by_id.pop(inv.secret[:ID_CHARS], None)


# ---- the exchange -------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class _Keys:
    confirm_inviter: bytes = field(repr=False)
    confirm_joiner: bytes = field(repr=False)
    seal_inviter: bytes = field(repr=False)
    seal_joiner: bytes = field(repr=False)

    @classmethod
    def derive(cls, session_key: bytes, transcript: bytes) -> _Keys:
        """Four independent keys from the SPAKE2 key, bound to the transcript."""
        out = HKDF(algorithm=hashes.SHA256(), length=128, salt=sha256(transcript).digest(),
                   info=b"hearthnet join v1").derive(session_key)
        return cls(out[:32], out[32:64], out[64:96], out[96:])


def _mac(key: bytes, label: bytes, transcript: bytes) -> bytes:
    return hmac.new(key, label + transcript, sha256).digest()


def _seal(key: bytes, obj: Mapping[str, Any], label: bytes) -> bytes:
    nonce = secrets.token_bytes(12)
    return nonce + AESGCM(key).encrypt(nonce, packb(dict(obj)), label)


def _open(key: bytes, sealed: object, label: bytes) -> dict[str, Any]:
    """Decrypt and parse a sealed map. Raises `WrongCode` (tampered or another key) or
    `PeerDataError` (well sealed but malformed)."""
    if not isinstance(sealed, bytes) or len(sealed) < 12 + 16:
        raise PeerDataError("join message: sealed part missing")
    try:
        plain = AESGCM(key).decrypt(sealed[:12], sealed[12:], label)
    except InvalidTag:
        raise WrongCode("the sealed join message does not open with this code's key",
                        reason="wrong_code") from None
    return _as_map(plain)


def _as_map(data: object) -> dict[str, Any]:
    if not isinstance(data, bytes) or len(data) > MAX_JOIN_MESSAGE_BYTES:
        raise PeerDataError("join message: not a bounded binary message")
    try:
        obj = unpackb(data)
    except (ValueError, TypeError) as e:
        raise PeerDataError(f"join message: not msgpack ({type(e).__name__})") from None
    if not isinstance(obj, dict):
        raise PeerDataError("join message: not a map")
    return obj


def _finish(pake: Any, inbound: object) -> bytes:
    if not isinstance(inbound, bytes):
        raise PeerDataError("join message: no key-exchange message")
    try:
        key: bytes = pake.finish(inbound)
    except (SPAKEError, ValueError, AssertionError) as e:
        raise PeerDataError(f"join message: bad key-exchange message "
                            f"({type(e).__name__})") from None
    return key


@dataclass(frozen=True, slots=True)
class Card:
    """Who the joiner is: its node id and raw Ed25519 public key."""

    node_id: str
    public_key: bytes

    def to_dict(self) -> dict[str, Any]:
        return {"node_id": self.node_id, "public_key": self.public_key}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Card:
        key = d.get("public_key")
        if not isinstance(key, bytes) or len(key) != PUBLIC_KEY_BYTES:
            raise PeerDataError("join card: public_key must be 32 bytes")
        try:
            node_id = check_node_id(d.get("node_id"))
        except ConfigError:
            raise PeerDataError("join card: invalid node id") from None
        return cls(node_id, key)


class InviterExchange:
    """The inviting node's side: `respond` to message 1, `admit` message 3, `welcome`."""

    def __init__(self, secret: str) -> None:
        self._pake = SPAKE2_A(secret.encode("ascii"), idA=_ID_A, idB=_ID_B)
        self._keys: _Keys | None = None
        self._transcript = b""

    def respond(self, hello: Mapping[str, Any]) -> bytes:
        """Message 2 for the joiner's message 1. Raises `PeerDataError` if malformed."""
        their = hello.get("pake")
        ours: bytes = self._pake.start()
        key = _finish(self._pake, their)
        assert isinstance(their, bytes)
        self._transcript = ours + their
        self._keys = _Keys.derive(key, self._transcript)
        return packb({"pake": ours,
                      "confirm": _mac(self._keys.confirm_inviter, b"inviter",
                                      self._transcript)})

    def admit(self, data: bytes) -> Card:
        """The joiner's card from message 3, once it proved the same key.

        Raises:
            WrongCode: the joiner's code differs (or it said so).
            PeerDataError: malformed.
        """
        keys = self._need_keys()
        msg = _as_map(data)
        if msg.get("error") == "wrong_code":
            raise WrongCode("the joiner's code does not match this invite",
                            reason="wrong_code")
        confirm = msg.get("confirm")
        want = _mac(keys.confirm_joiner, b"joiner", self._transcript)
        if not isinstance(confirm, bytes) or not hmac.compare_digest(confirm, want):
            raise WrongCode("the joiner's code does not match this invite",
                            reason="wrong_code")
        return Card.from_dict(_open(keys.seal_joiner, msg.get("sealed"), b"card"))

    def welcome(self, welcome: Mapping[str, Any]) -> bytes:
        """Message 4: `welcome` sealed for the joiner."""
        return packb({"sealed": _seal(self._need_keys().seal_inviter, welcome, b"welcome")})

    def _need_keys(self) -> _Keys:
        if self._keys is None:
            raise RuntimeError("respond() first")
        return self._keys


class JoinerExchange:
    """The new node's side: `hello` (message 1), `answer` message 2, `open_welcome`."""

    def __init__(self, code: JoinCode) -> None:
        self.code = code
        self._pake = SPAKE2_B(code.secret.encode("ascii"), idA=_ID_A, idB=_ID_B)
        self._ours = b""
        self._keys: _Keys | None = None
        self._transcript = b""

    def hello(self) -> bytes:
        self._ours = self._pake.start()
        return packb({"v": 1, "invite": self.code.invite_id, "pake": self._ours})

    def answer(self, data: bytes, card: Card) -> bytes:
        """Message 3 for the inviter's message 2: our card sealed, once the inviter proved
        the same key.

        Raises:
            WrongCode: the inviter holds another code (send `REFUSAL` before giving up).
            Refused: the inviter refused the invite (expired, used, busy).
            PeerDataError: malformed.
        """
        msg = _as_map(data)
        _raise_refusal(msg)
        theirs = msg.get("pake")
        key = _finish(self._pake, theirs)
        assert isinstance(theirs, bytes)
        self._transcript = theirs + self._ours
        self._keys = keys = _Keys.derive(key, self._transcript)
        confirm = msg.get("confirm")
        want = _mac(keys.confirm_inviter, b"inviter", self._transcript)
        if not isinstance(confirm, bytes) or not hmac.compare_digest(confirm, want):
            raise WrongCode("wrong invite code: the inviting node holds another one (check "
                            "for a typo, or ask for a new code)", reason="wrong_code")
        return packb({"confirm": _mac(keys.confirm_joiner, b"joiner", self._transcript),
                      "sealed": _seal(keys.seal_joiner, card.to_dict(), b"card")})

    def open_welcome(self, data: bytes) -> dict[str, Any]:
        """The inviter's welcome from message 4. Raises `Refused`, `WrongCode`,
        `PeerDataError`."""
        msg = _as_map(data)
        _raise_refusal(msg)
        if self._keys is None:
            raise RuntimeError("answer() first")
        return _open(self._keys.seal_inviter, msg.get("sealed"), b"welcome")


REFUSAL = packb({"error": "wrong_code"})


@dataclass(frozen=True, slots=True)
class Welcome:
    """What the joiner learnt: the inviter, the community's members, where to link."""

    inviter: str
    members: list[dict[str, Any]]
    port: int
    tls: bool


def welcome_map(inviter: str, members: list[dict[str, Any]], port: int, tls: bool
                ) -> dict[str, Any]:
    """The welcome an inviter seals: member rows as in a config (base64 keys)."""
    return {"node_id": inviter, "members": members, "port": port, "tls": tls}


def parse_welcome(d: Mapping[str, Any], card: Card) -> Welcome:
    """Check a welcome: a valid member list naming the inviter, and us with our own key.

    Raises:
        PeerDataError: anything else (the inviter misbehaved).
    """
    rows, inviter, port = d.get("members"), d.get("node_id"), d.get("port")
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise PeerDataError("welcome: no member list")
    if not isinstance(port, int) or not 0 < port < 65536:
        raise PeerDataError("welcome: no listener port")
    try:
        members = {m.node_id: m for m in parse_members(rows)}
    except ConfigError as e:
        raise PeerDataError(f"welcome: bad member list: {e.message}") from None
    me = members.get(card.node_id)
    if not isinstance(inviter, str) or inviter not in members or me is None \
            or me.public_key_raw != card.public_key:
        raise PeerDataError("welcome: the member list lacks the inviter or this node's key")
    return Welcome(inviter, [m.to_dict() for m in members.values()], port,
                   bool(d.get("tls", True)))


def refusal(e: AuthError) -> bytes:
    """The message that tells the other side why it was refused (no secrets in it)."""
    return packb({"error": str(e.details.get("reason", "refused")), "message": e.message})


def _raise_refusal(msg: Mapping[str, Any]) -> None:
    err = msg.get("error")
    if err is None:
        return
    text = str(msg.get("message", ""))[:300] or "the inviting node refused the join"
    if err == "wrong_code":
        raise WrongCode(text if msg.get("message") else
                        "wrong invite code: the inviting node holds another one",
                        reason="wrong_code")
    raise AuthError(text, reason=str(err)[:64])


def merge_member_file(data_dir: Path, rows: list[dict[str, Any]], note: str) -> Path:
    """Write `rows` into ``<data_dir>/members.toml`` (the file `hearthnet keys provision`
    writes and `load_config` merges), replacing entries of the same node ids and keeping
    the others, so the node's next start or reload enforces them.

    Raises:
        ConfigError: the merged list is invalid (nothing is written).
    """
    path = data_dir / MEMBERS_FILE
    old: list[dict[str, Any]] = []
    if path.is_file():
        got = load_toml(path).get("community", {}).get("members", [])
        old = [dict(r) for r in got if isinstance(r, dict)] if isinstance(got, list) else []
    new_ids = {r["node_id"] for r in rows}
    merged = [r for r in old if r.get("node_id") not in new_ids] + [dict(r) for r in rows]
    parse_members(merged)
    data_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(path, f"# {note}\n" + render_members(merged))
    return path


# ---- driving it over a connection ---------------------------------------------------

class Connection(Protocol):
    """What the exchange needs of a connection (a websockets connection has it)."""

    async def send(self, message: bytes) -> None: ...

    async def recv(self) -> str | bytes: ...


async def _recv(conn: Connection) -> bytes:
    async with asyncio.timeout(STEP_TIMEOUT_S):
        data = await conn.recv()
    if not isinstance(data, bytes):
        raise PeerDataError("join message: text frame")
    return data


Admit = Callable[[Card], Awaitable[Mapping[str, Any]]]


@dataclass(frozen=True, slots=True)
class Outcome:
    """How one incoming exchange ended (what the node logs: no secrets)."""

    result: str  # "joined", "wrong_code", "burnt", "refused", "aborted"
    node_id: str | None = None
    reason: str = ""


async def serve_join(conn: Connection, book: InviteBook, admit: Admit,
                     now: Callable[[], float]) -> Outcome:
    """The inviter's side of one join over `conn`.

    `admit(card)` adds the joiner to the community and returns the welcome (the member
    list and this node's port); an `AuthError` from it (the id is taken) is sent to the
    joiner. A failed exchange that tested the code spends one of the invite's tries.
    """
    try:
        hello = _as_map(await _recv(conn))
    except Exception as e:  # closed, timed out or garbage: nothing was tested
        return Outcome("aborted", reason=type(e).__name__)
    try:
        inv = book.take(hello.get("invite"), now())
    except AuthError as e:
        await conn.send(refusal(e))
        return Outcome("refused", reason=str(e.details.get("reason")))
    ex = InviterExchange(inv.secret)
    try:
        msg2 = ex.respond(hello)
    except PeerDataError as e:
        book.release(inv)  # the code was not tested: no answer carried a proof
        return Outcome("aborted", reason=e.message)
    try:
        await conn.send(msg2)
        card = ex.admit(await _recv(conn))
    except Exception as e:
        # the joiner holds message 2: it could test one guess with it, so whatever ended
        # the exchange (a wrong code, a closed connection, a timeout) spends a try
        burnt = book.failed(inv)
        if isinstance(e, WrongCode):
            with _quiet():
                await conn.send(refusal(WrongCode(
                    "wrong invite code" + ("; the invite is now burnt: ask for a new one"
                                           if burnt else ""), reason="wrong_code")))
        return Outcome("burnt" if burnt else "wrong_code",
                       reason=type(e).__name__)
    try:
        welcome = await admit(card)
    except AuthError as e:
        book.release(inv)  # the code was right: its owner may retry under another name
        await conn.send(refusal(e))
        return Outcome("refused", card.node_id, str(e.details.get("reason")))
    except BaseException:
        book.release(inv)  # never left reserved by a failure of our own
        raise
    book.used(inv)
    await conn.send(ex.welcome(welcome))
    return Outcome("joined", card.node_id)


async def dial_join(conn: Connection, code: JoinCode, card: Card) -> dict[str, Any]:
    """The joiner's side over `conn`: the inviter's welcome.

    Raises:
        WrongCode: the codes differ (the inviter is told too).
        Refused: the inviter refused (expired, used, busy, id taken).
        PeerDataError, TimeoutError: the inviter misbehaved or went quiet.
    """
    ex = JoinerExchange(code)
    await conn.send(ex.hello())
    try:
        msg3 = ex.answer(await _recv(conn), card)
    except WrongCode:
        with _quiet():
            await conn.send(REFUSAL)
        raise
    await conn.send(msg3)
    return ex.open_welcome(await _recv(conn))


def _quiet() -> contextlib.suppress:
    """Suppress a failed courtesy send: the peer may be gone already."""
    return contextlib.suppress(Exception)
