"""`hearthnet chat --config` sends the call params a user gives it (the node's bus is faked:
what matters here is the call the command makes)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from hearthnet import cli
from hearthnet.commands import remote
from hearthnet.mesh import bus

DONE = {"type": "done", "finish_reason": "stop", "usage": {"completion_tokens": 0},
        "timings": {}, "pipeline": ["m:0-29@node-b"]}


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    calls: list[dict[str, Any]] = []

    async def fake_bus_call(uri: str, capability: str, args: dict[str, Any]
                            ) -> AsyncIterator[dict[str, Any]]:
        calls.append(args)
        yield DONE

    monkeypatch.setattr(remote, "node_uri", lambda config: "ws://127.0.0.1:9")
    monkeypatch.setattr(bus, "bus_call", fake_bus_call)
    return calls


def test_chat_sends_the_weights_policy_issue_12(sent, capsys):
    rc = cli.main(["chat", "--config", "node.toml", "--json", "--weights", "exact",
                   "--wire-dtype", "fp32", "hi"])
    assert rc == 0
    assert json.loads(capsys.readouterr().out) == DONE
    assert sent[0]["params"]["weights"] == "exact"
    assert sent[0]["params"]["wire_dtype"] == "fp32"
    assert sent[0]["request"]["messages"] == [{"role": "user", "content": "hi"}]


def test_without_the_option_the_node_default_applies(sent):
    assert cli.main(["chat", "--config", "node.toml", "--json", "hi"]) == 0
    assert "weights" not in sent[0]["params"] and "wire_dtype" not in sent[0]["params"]


def test_an_unknown_policy_is_a_usage_error_before_any_call(sent, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["chat", "--config", "node.toml", "--weights", "q4", "hi"])
    assert e.value.code == 2 and not sent
    assert "argument --weights: invalid choice: 'q4'" in capsys.readouterr().err


@pytest.mark.parametrize(("formats", "note"), [
    ({"head": "fp32", "stages": ["fp32", "fp32"], "wire": ["fp32", "fp32"],
      "policy": "lossless", "lossless": True}, "; layers fp32, head fp32, wire fp32: lossless]"),
    ({"head": "fp32", "stages": ["int8", "fp32"], "wire": ["fp16", "bf16"], "policy": "int8",
      "lossless": False},
     "; layers int8/fp32, head fp32, wire fp16/bf16: LOSSY (a compact format was asked for)]"),
])
def test_the_summary_line_says_what_served_the_answer(monkeypatch, capsys, formats, note):
    """A compact format's answer never reads like an exact one: the line a person sees
    after the answer names the formats and the wire and says whether all were lossless."""
    done = {**DONE, "formats": formats}

    async def fake_bus_call(uri: str, capability: str, args: dict[str, Any]
                            ) -> AsyncIterator[dict[str, Any]]:
        yield done

    monkeypatch.setattr(remote, "node_uri", lambda config: "ws://127.0.0.1:9")
    monkeypatch.setattr(bus, "bus_call", fake_bus_call)
    assert cli.main(["chat", "--config", "node.toml", "hi"]) == 0
    assert capsys.readouterr().err.strip().endswith(note)
