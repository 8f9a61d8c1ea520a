"""`hearthnet bench pipeline --netem DELAY`: the benchmark's node processes a household
network apart (M26 §8.2). ``--netem "2ms 0.5ms"`` makes every hop between two of them cost
2 ms ± 0.5 ms each way (a household Wi-Fi), so a round trip through a shard pays it twice.

Each node process runs in a network namespace of its own on a `Lan`
(`hearthnet.bench.lan`, the machinery of `bench household`): `LanMesh` starts the nodes
there, listening on their LAN addresses, and the benchmark reaches the orchestrating
node's loopback admin listener through `NsForward` (no shaped link between the client and
its node, as with `hearthnet chat` on the node's own machine). ``--shaper`` picks how the
links are shaped (`lan.pick_shaper`): ``netem`` (the kernel's qdisc), ``userspace`` (the
emulator `hearthnet.bench.linkem`, for kernels built without netem, as on this project's
VM and CI) or ``auto`` (netem where the kernel has it). Both shapers stand for the same
topology, so figures from a kernel with netem and from one without compare.

What a hop costs. A `Lan` shapes each node's link in both directions, and a packet between
two nodes crosses two links: the sender's uplink and the receiver's downlink. So each
node's link carries **half** the delay and half the jitter (`Netem.per_link`), and a hop
costs the delay asked for, once — as when the whole mesh stood on one loopback delayed by
netem, where a packet crossed one qdisc. Two uniform ±J/2 jitters add up to the same
±J around the same mean, but peaked in the middle (triangular: a standard deviation of
J/√6 instead of a uniform ±J's J/√3). A loss L is split the same way: each link loses
1 − √(1 − L), so a hop loses L. The user-space emulator adds its own wake-up to each
packet (~0.1 ms on the 2-core VM, `hearthnet.bench.linkem`), so a hop there costs a
little more than asked, never less (tests/netns/test_netem_pipeline.py measures it). The
emulator never reorders the packets of a link direction; netem without a rate may under
jitter (so did the old single-loopback netem of this benchmark), which TCP mostly absorbs.

DELAY is `tc netem`'s delay arguments, ``TIME [JITTER] [loss PCT%]`` (``delay`` in front
is allowed), each time with its unit (s, ms, us: tc reads a bare number as microseconds,
which nobody means by ``--netem 2``). Anything else (rate, distribution, correlation) is
refused before any work (`BadRequest`). Where no namespace can be made (not root, no
iproute2, neither netem nor ``/dev/net/tun``) the benchmark says why and measures on the
plain loopback; the figures' ``settings.netem`` says which (`Choice.settings`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from hearthnet.bench import lan as lanmod
from hearthnet.bench.linkem import Link
from hearthnet.errors import BadRequest

_TIME = re.compile(r"^(\d+(?:\.\d+)?)(s|secs?|ms|msecs?|us|usecs?)$")
_LOSS = re.compile(r"^(\d+(?:\.\d+)?)%$")
_TO_MS = {"s": 1000.0, "sec": 1000.0, "secs": 1000.0, "ms": 1.0, "msec": 1.0, "msecs": 1.0,
          "us": 1e-3, "usec": 1e-3, "usecs": 1e-3}
USAGE = ('--netem takes tc netem delay arguments "TIME [JITTER] [loss PCT%]" with units '
         '(s, ms, us), e.g. "2ms 0.5ms"')


@dataclass(frozen=True, slots=True)
class Netem:
    """A hop's cost between two node processes, as ``--netem`` states it."""

    text: str  # as given
    delay_ms: float
    jitter_ms: float = 0.0
    loss_pct: float = 0.0

    def per_link(self) -> Link:
        """Each node's link: half the delay and jitter, and the loss that, met on two
        links, loses `loss_pct` (see the module docstring)."""
        loss = 100.0 * (1.0 - math.sqrt(1.0 - self.loss_pct / 100.0))
        return Link("netem-half", self.delay_ms / 2, self.jitter_ms / 2, loss)


def _ms(word: str) -> float:
    m = _TIME.match(word)
    if m is None:
        raise BadRequest(f"{USAGE}; {word!r} is not a time with a unit")
    return float(m.group(1)) * _TO_MS[m.group(2)]


def parse(text: str) -> Netem:
    """``--netem``'s value.

    Raises:
        BadRequest: not ``TIME [JITTER] [loss PCT%]``, a jitter above the delay (it would
            deliver before the send) or a loss above 100 %.
    """
    words = text.split()
    if words[:1] == ["delay"]:
        words = words[1:]
    loss = 0.0
    if len(words) >= 2 and words[-2] == "loss":
        m = _LOSS.match(words[-1])
        if m is None:
            raise BadRequest(f"{USAGE}; the loss {words[-1]!r} is not a percentage")
        loss = float(m.group(1))
        words = words[:-2]
    if not 1 <= len(words) <= 2:
        raise BadRequest(f"{USAGE}, not {text!r}")
    delay = _ms(words[0])
    jitter = _ms(words[1]) if len(words) == 2 else 0.0
    if jitter > delay:
        raise BadRequest(f"--netem {text!r}: the jitter is above the delay (a packet would "
                         f"arrive before it was sent)")
    if loss > 100:
        raise BadRequest(f"--netem {text!r}: a loss above 100 %")
    return Netem(text, delay, jitter, loss)


@dataclass(frozen=True, slots=True)
class Choice:
    """``--netem`` parsed and the shaper chosen here (before any work)."""

    hop: Netem
    shaper: str | None  # "netem" or "userspace"; None: measured on the plain loopback
    note: str  # how the links are shaped, or why they cannot be
    requested: str  # --shaper

    @property
    def why_not(self) -> str | None:
        return None if self.shaper else self.note

    def lan(self, nodes: int, tag: str | None = None) -> lanmod.Lan | None:
        """A `Lan` (not yet up) of `nodes` nodes, each on `Netem.per_link` (`tag`: its
        names' prefix, `Lan`'s); None when the links cannot be shaped here."""
        if self.shaper is None:
            return None
        return lanmod.Lan([self.hop.per_link()] * nodes, tag=tag, shaper=self.requested)

    def settings(self) -> dict[str, Any]:
        """The figures' ``settings.netem``."""
        return {"delay": self.hop.text, "applied": self.shaper is not None,
                "shaper": self.shaper, "why_not": self.why_not,
                "shaper_note": self.note if self.shaper else None,
                "hop": {"delay_ms": self.hop.delay_ms, "jitter_ms": self.hop.jitter_ms,
                        "loss_pct": self.hop.loss_pct},
                "per_link": self.hop.per_link().to_dict(),
                "semantics": "each node in its own namespace; each node's link carries half "
                             "the delay and jitter both ways, so a packet between two nodes "
                             "(sender's uplink + receiver's downlink) pays the delay once"}


def choose(text: str, shaper: str = "auto") -> Choice:
    """Parse ``--netem`` and pick the shaper (`lan.pick_shaper`).

    Raises:
        BadRequest: a bad ``--netem`` (`parse`) or ``--shaper``.
    """
    hop = parse(text)
    try:
        picked = lanmod.pick_shaper(shaper)
    except ValueError as e:
        raise BadRequest(str(e)) from e
    return Choice(hop, picked.name, picked.note, shaper)


NOT_ASKED: dict[str, Any] = {"delay": None, "applied": False, "shaper": None,
                             "why_not": None}
"""``settings.netem`` of a run without ``--netem``."""


def describe(net: dict[str, Any]) -> str:
    """The network a run's figures were measured on, in a few words (its ``settings.netem``)."""
    if net.get("applied"):
        link = net["per_link"]
        return (f"one namespace per node, each hop delayed {net['delay']} (each node's link "
                f"{link['delay_ms']:g} ms ± {link['jitter_ms']:g} ms both ways; "
                f"{net['shaper_note']})")
    if net.get("delay"):
        return f"loopback (--netem {net['delay']} not applied: {net['why_not']})"
    return "loopback"
