"""Code comments and docstrings say why (the M26 spec section, DESIGN.md or the reason),
never which tracker issue asked for something: a number tells a new reader nothing."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_ISSUE = re.compile(r"\bissues? [0-9]+", re.IGNORECASE)


def test_no_code_line_cites_an_issue_number() -> None:
    hits = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}"
            for p in sorted((ROOT / "hearthnet").rglob("*.py"))
            for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
            if _ISSUE.search(line)]
    assert not hits, "cite the spec section or give the reason:\n" + "\n".join(hits)
