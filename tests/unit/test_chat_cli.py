"""`hearthnet chat --config` sends the call params a user gives it (the node's bus is faked:
what matters here is the call the command makes)."""

from __future__ import annotations

import io
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


def _answering(monkeypatch: pytest.MonkeyPatch, answers: list[list[str]],
               interrupt_after: dict[int, int] | None = None) -> list[dict[str, Any]]:
    """A node whose n-th call streams `answers[n]` token by token, then `done`; with
    `interrupt_after = {n: k}` the person presses Ctrl-C after k tokens of call n."""
    calls: list[dict[str, Any]] = []

    async def fake_bus_call(uri: str, capability: str, args: dict[str, Any]
                            ) -> AsyncIterator[dict[str, Any]]:
        n = len(calls)
        calls.append(args)
        for i, text in enumerate(answers[n]):
            if (interrupt_after or {}).get(n) == i:
                raise KeyboardInterrupt
            yield {"type": "token_delta", "text": text, "token_id": i, "index": i}
        yield DONE

    monkeypatch.setattr(remote, "node_uri", lambda config: "ws://127.0.0.1:9")
    monkeypatch.setattr(bus, "bus_call", fake_bus_call)
    return calls


def _typed(monkeypatch: pytest.MonkeyPatch, *lines: str) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(line + "\n" for line in lines)))


def _user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def _assistant(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


def test_a_conversation_keeps_its_history_until_reset(monkeypatch, capsys):
    calls = _answering(monkeypatch, [["Hello", " Ada"], ["Ada"], ["Hi"], ["Yes"]])
    _typed(monkeypatch, "My name is Ada.", "What is my name?", "/reset", "Hi",
           "/model other", "", "Still there?")
    assert cli.main(["chat", "--config", "node.toml"]) == 0  # end of input ends it
    assert [c["request"]["messages"] for c in calls] == [
        [_user("My name is Ada.")],
        [_user("My name is Ada."), _assistant("Hello Ada"), _user("What is my name?")],
        [_user("Hi")],  # /reset forgot the first two turns
        [_user("Hi"), _assistant("Hi"), _user("Still there?")],  # a blank line is no turn
    ]
    assert [c["request"]["model"] for c in calls] == ["smollm2"] * 3 + ["other"]
    out = capsys.readouterr()
    assert out.out == "Hello Ada\nAda\nHi\nYes\n"
    assert "(conversation forgotten)" in out.err and "(model other" in out.err


def test_ctrl_c_stops_the_answer_and_the_conversation_goes_on(monkeypatch, capsys):
    calls = _answering(monkeypatch, [["One", " two", " three"], ["Four"]],
                       interrupt_after={0: 2})
    _typed(monkeypatch, "Count", "Go on", "/quit", "never sent")
    assert cli.main(["chat", "--config", "node.toml"]) == 0
    # what had arrived before Ctrl-C stays in the history; /quit ends before the last line
    assert [c["request"]["messages"] for c in calls] == [
        [_user("Count")], [_user("Count"), _assistant("One two"), _user("Go on")]]
    assert "[stopped]" in capsys.readouterr().err


def test_an_unknown_command_is_explained_and_sends_nothing(monkeypatch, capsys):
    calls = _answering(monkeypatch, [])
    _typed(monkeypatch, "/undo", "/help")
    assert cli.main(["chat", "--config", "node.toml"]) == 0 and calls == []
    err = capsys.readouterr().err
    assert "unknown command /undo: /reset forgets" in err and err.count("/quit") == 2


def test_a_conversation_refuses_a_missing_config_before_reading_a_line(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("never read\n"))
    assert cli.main(["chat", "--config", "/no/such/node.toml"]) == 2
    assert capsys.readouterr().err.strip() == (
        "hearthnet: config error: /no/such/node.toml: config file not found")
