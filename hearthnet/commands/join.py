"""`hearthnet invite` and `hearthnet join CODE`: become a member without pasting keys.

``invite --config C`` asks the running node, over its loopback admin listener, for a
one-time code (expiring, single use, held only in that node's memory) and prints it.
``join CODE --config C`` (the new node's config from ``hearthnet init``) dials the
inviter at the code's ``host:port`` — or, for the short code without an address, at the
address the inviter announces for that invite by mDNS (`hearthnet.mesh.join_announce`:
an announcement is only an address, the exchange authenticates) — and runs the SPAKE2
exchange of `hearthnet.security.joining` with it: the inviter adds this node as
``trusted``, and this node writes the community's member list (the inviter's key pinned) to
``<data_dir>/members.toml`` and the inviter to ``[node] peers``. A wrong, reused or
expired code admits nobody and says so here and in the inviter's log.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import tomllib
from pathlib import Path
from typing import Any

from hearthnet.config import MEMBERS_FILE, load_config
from hearthnet.errors import AuthError, ConfigError, ConnectionLost
from hearthnet.security.joining import (
    DEFAULT_TTL_S,
    INVITE_CAPABILITY,
    JOIN_PATH,
    MAX_JOIN_MESSAGE_BYTES,
    Card,
    JoinCode,
    Welcome,
    WrongCode,
    dial_join,
    merge_member_file,
    parse_code,
    parse_welcome,
)
from hearthnet.security.keys import NodeKey
from hearthnet.security.provision import write_atomic

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}
_NODE_HEADER = re.compile(r"^\s*\[\s*node\s*\]\s*(#.*)?$")
_PEERS_LINE = re.compile(r"^\s*peers\s*=\s*\[[^\]]*\]\s*(#.*)?$")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    inv = sub.add_parser("invite", help="print a one-time code that lets a new node join")
    inv.add_argument("--config", required=True, help="this (running) member's node TOML")
    inv.add_argument("--ttl", type=duration, default=DEFAULT_TTL_S,
                     help="how long the code works: 30s, 10m, 1h (default 10m)")
    inv.add_argument("--json", action="store_true", help="print JSON")
    inv.set_defaults(func=_invite)
    join = sub.add_parser("join", help="join a community with a code from `hearthnet invite`")
    join.add_argument("code", help="the code: 7KQ2M-XD4RA (the inviter is found on the LAN "
                      "by mDNS) or 7KQ2M-XD4RA@192.168.1.20:41234")
    join.add_argument("--config", required=True, help="this new node's TOML (hearthnet init)")
    join.add_argument("--find-timeout", type=duration, default=None,
                      help="how long to look for the inviter by mDNS when the code has no "
                           "@host:port (default 10s)")
    join.add_argument("--json", action="store_true", help="print JSON")
    join.set_defaults(func=_join)


def duration(text: str) -> float:
    """argparse type: ``90``, ``30s``, ``10m``, ``1h`` as seconds (> 0)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", text.lower())
    if not m or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration like 30s, 10m or 1h")
    return float(m.group(1)) * _UNITS[m.group(2) or "s"]


# ---- invite ----

def _invite(args: argparse.Namespace) -> int:
    from hearthnet.errors import error_from_code
    from hearthnet.loop import run
    from hearthnet.mesh.bus import bus_call
    from hearthnet.node.admin import node_uri

    uri = node_uri(args.config)

    async def go() -> list[dict[str, Any]]:
        return [f async for f in bus_call(uri, INVITE_CAPABILITY, {"ttl_s": args.ttl})]

    frames = run(go())
    for f in frames:
        if f.get("type") == "error":
            raise error_from_code(str(f.get("code")), str(f.get("message")))
    got = next((f for f in frames if f.get("type") == "invite"), None)
    if got is None:
        raise ConnectionLost(f"the node at {uri} answered the invite without a code")
    if args.json:
        print(json.dumps(got))
        return 0
    ttl = float(got.get("expires_in_s", args.ttl))
    short = str(got.get("short") or "") if got.get("announced") else ""
    print(f"invite code for {got.get('node_id')}'s community (works once, for "
          f"{_human(ttl)}):\n\n    {short or got['code']}\n")
    if short:  # announced by mDNS: the joiner finds the address on the LAN
        print("on the new machine (it finds this node on the LAN by mDNS):\n"
              f"    hearthnet init\n    hearthnet join {short} --config <its node.toml>\n"
              "where mDNS does not reach (another subnet, a VPN), the long form names "
              f"the address:\n    hearthnet join {got['code']} --config <its node.toml>")
    else:
        print("on the new machine:\n    hearthnet init\n"
              f"    hearthnet join {got['code']} --config <its node.toml>")
    return 0


def _human(seconds: float) -> str:
    if seconds >= 3600 and seconds % 3600 == 0:
        return f"{seconds / 3600:g} h"
    return f"{seconds / 60:g} min" if seconds >= 60 else f"{seconds:g} s"


# ---- join ----

def _join(args: argparse.Namespace) -> int:
    from hearthnet.loop import run

    code = parse_code(args.code)
    cfg = load_config(args.config)
    data = cfg.effective_data_dir()
    key = NodeKey.load_or_create(data)
    card = Card(cfg.node.id, key.public_key_raw)
    if code.located:
        reply = run(_exchange(code, card))
    else:
        from hearthnet.mesh.join_announce import FIND_TIMEOUT_S
        code, reply = run(_find_and_exchange(code, card, args.find_timeout or FIND_TIMEOUT_S))
    welcome = parse_welcome(reply, card)
    members = merge_member_file(data, welcome.members,
                                f"the community {welcome.inviter} let {cfg.node.id} join "
                                "(`hearthnet join`)")
    peer = f"{'wss' if welcome.tls else 'ws'}://{_host(code.host)}:{welcome.port}"
    added = add_peer(Path(args.config), peer)
    _report(args, cfg.node.id, welcome, members, peer, added)
    return 0


async def _exchange(code: JoinCode, card: Card) -> dict[str, Any]:
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI

    where = f"{_host(code.host)}:{code.port}"
    try:
        async with connect(f"ws://{where}{JOIN_PATH}", open_timeout=10,
                           max_size=MAX_JOIN_MESSAGE_BYTES, compression=None) as ws:
            return await dial_join(ws, code, card)
    except ConnectionRefusedError:
        # the inviter listens for joiners only while an invite is pending
        raise AuthError(f"no invite is open at {where}: this code was used already, has "
                        "expired or was burnt by wrong tries (or the node stopped); ask for "
                        "a new one with `hearthnet invite`", reason="unknown_invite") from None
    except (OSError, InvalidHandshake, InvalidURI, TimeoutError) as e:
        raise ConnectionLost(f"cannot reach the inviting node at {where} ({e}): is it "
                             "running, and is the code from its latest `hearthnet "
                             "invite`?") from None
    except ConnectionClosed:
        raise ConnectionLost(f"the inviting node at {where} closed the join; its log "
                             "says why") from None


async def _find_and_exchange(code: JoinCode, card: Card, timeout_s: float
                             ) -> tuple[JoinCode, dict[str, Any]]:
    """Find the inviter of a short code by mDNS and run the exchange with it: the code
    with the address that worked, and the welcome.

    Each announcer of the code's invite id is dialled in turn (at most `MAX_CANDIDATES`:
    anyone can announce any id, and each dial lets the announcer test one guess), until
    one admits this node.

    Raises:
        AuthError: no announcer of the invite answered in `timeout_s` (``invite_not_found``),
            or the last one dialled refused (wrong code, used, ...).
        ConnectionLost: the last announcer dialled could not be reached.
    """
    from hearthnet.mesh.join_announce import JOIN_SERVICE_TYPE, MAX_CANDIDATES, InviterSearch

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    tried: list[str] = []
    last: AuthError | ConnectionLost | None = None
    async with InviterSearch(code.invite_id) as search:
        while len(tried) < MAX_CANDIDATES:
            # after a failed dial, only the announcers resolved by now are worth a try
            wait = deadline - loop.time() if last is None else min(1.0, deadline - loop.time())
            inviter = await search.next(max(0.0, wait))
            if inviter is None:
                break
            located = code.at(inviter.host, inviter.port)
            try:
                return located, await _exchange(located, card)
            except (AuthError, ConnectionLost) as e:
                tried.append(f"{inviter.node_id} at {_host(inviter.host)}:{inviter.port}")
                last = e
                if not isinstance(e, WrongCode | ConnectionLost) \
                        and e.details.get("reason") not in ("unknown_invite", "invite_busy"):
                    raise  # the inviter refused this node itself (its name is taken)
        seen = search.seen
    if last is not None:
        if len(tried) > 1:
            last.message = f"{last.message} (tried {len(tried)} announcers: {', '.join(tried)})"
        raise last
    others = f"; {seen} other invite(s) were announced" if seen else ""
    raise AuthError(f"no node announced invite {code.invite_id}… on this LAN within "
                    f"{timeout_s:g} s (mDNS {JOIN_SERVICE_TYPE}{others}): the code was used "
                    "already, expired, was burnt, or is mistyped — or mDNS does not reach "
                    "from here to the inviter; use the long form `hearthnet join "
                    "CODE@HOST:PORT` that `hearthnet invite` printed, or ask for a new code",
                    reason="invite_not_found")


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def add_peer(path: Path, uri: str) -> bool:
    """Add `uri` to ``[node] peers`` of the TOML at `path`, changing nothing else (the
    result is re-parsed and compared); False if it was there already.

    Raises:
        ConfigError: the file's peers are not a one-line array in ``[node]`` (add the
            peer by hand then).
    """
    text = path.read_text(encoding="utf-8")
    doc = tomllib.loads(text)
    peers = list(doc.get("node", {}).get("peers", []))
    if uri in peers:
        return False
    lines = text.splitlines(keepends=True)
    start = next((i for i, ln in enumerate(lines) if _NODE_HEADER.match(ln)), None)
    new_line = f"peers = {json.dumps([*peers, uri])}\n"
    if start is not None:
        end = next((i for i in range(start + 1, len(lines))
                    if lines[i].lstrip().startswith("[")), len(lines))
        at = next((i for i in range(start + 1, end) if _PEERS_LINE.match(lines[i])), None)
        if at is not None:
            lines[at] = new_line
        elif not any(ln.lstrip().startswith("peers") for ln in lines[start + 1:end]):
            lines.insert(start + 1, new_line)
    new = "".join(lines)
    want = dict(doc, node={**doc.get("node", {}), "peers": [*peers, uri]})
    if start is None or tomllib.loads(new) != want:
        raise ConfigError(f"cannot add the peer to {path} safely: add {uri!r} to "
                          "[node] peers by hand", file=str(path), key="node.peers",
                          reason="unsafe edit")
    write_atomic(path, new)
    return True


def _report(args: argparse.Namespace, node_id: str, welcome: Welcome, members: Path,
            peer: str, added: bool) -> None:
    if args.json:
        print(json.dumps({"joined": welcome.inviter, "node_id": node_id, "peer": peer,
                          "members": welcome.members, "members_file": str(members)}))
        return
    me = next((m for m in welcome.members if m["node_id"] == node_id), {})
    print(f"joined {welcome.inviter}'s community as {node_id} (trust "
          f"{me.get('trust', '?')}); keys pinned through the code:")
    for m in welcome.members:
        print(f"  {m['node_id']:<20} {m['trust']:<8} {m['public_key']}")
    print(f"members written to {members} ({MEMBERS_FILE}: read at start and reload)")
    print(f"peer {peer} {'added to' if added else 'already in'} {args.config}")
    print(f"\nnext: hearthnet node --config {args.config}   (restart it if it runs)")
