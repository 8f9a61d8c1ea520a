"""Constrained decoding (OpenAI ``response_format`` and forced tool calls) and tool calls.

Owns, without torch (the HTTP API and the bus door check a call with it before any work):

- `Constraint`: what a call's answer must match — any JSON object (``json_object``), a JSON
  schema (``json_schema``) or one tool call of the given functions (``tool_call``, for
  ``tool_choice`` ``"required"`` or a named function) — its wire map and its check;
- `check_tools` / `check_tool_choice`: OpenAI tool definitions and ``tool_choice``;
- `Conversation`: a chat's messages with the tools its template renders;
- `tool_format` / `template_has_tools`: how a chat template writes a tool call, and whether
  it renders tools at all (jinja2's own analysis, through transformers);
- `matcher`: a compiled grammar's fresh matcher for one answer, compiled once per
  (tokenizer, constraint) — the masking itself is `generation.Sampler`'s;
- `parse_tool_calls`: a model's text → OpenAI tool calls.

The grammar library is llguidance (measured against xgrammar with scripts/grammar_cost.py:
comparable mask cost per token, ~0.2 ms for SmolLM2's 49,152 tokens, faster compiles, and no
dependencies where xgrammar pulls triton): a JSON schema or a Lark grammar is compiled
against the tokenizer's vocabulary and gives, at each step, the bitmask of the tokens that
keep the answer matching.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Any

from hearthnet.errors import BadRequest

CONSTRAINT_KINDS = ("json_object", "json_schema", "tool_call")
MAX_SCHEMA_BYTES = 64 * 1024  # a schema's JSON text; larger ones are refused at the door
MAX_TOOLS = 128  # OpenAI's own bound on ``tools``
_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's function-name rule

# how a template's family writes a tool call (the formats this project's families use):
# Qwen2.5 / Qwen3 / Hermes wrap each call's JSON in <tool_call> tags; Mistral prefixes a
# JSON list with [TOOL_CALLS]; Llama-3.1/3.2 answer with the bare JSON object, its
# arguments under "parameters"
HERMES, MISTRAL, LLAMA_JSON = "hermes", "mistral", "llama_json"


@dataclass(frozen=True, slots=True)
class Constraint:
    """What the answer must match. `schema` is canonical JSON text (sorted keys): hashable,
    so equal constraints share one compiled grammar.

    ``json_object``: `schema` is ``{"type": "object"}``. ``json_schema``: the caller's
    schema. ``tool_call``: a JSON list of ``{"name", "parameters"}``, one call to one of
    them.
    """

    kind: str
    schema: str

    @classmethod
    def from_wire(cls, d: Any, param: str = "params.sampling.grammar") -> Constraint:
        """From its wire map (`to_wire`); raises `BadRequest` naming `param`."""
        if not isinstance(d, dict) or d.get("type") not in CONSTRAINT_KINDS:
            raise BadRequest(f"{param} must be a map with type in {list(CONSTRAINT_KINDS)}",
                             param=param)
        kind = str(d["type"])
        extra = sorted(str(k)[:64] for k in d if k not in ("type", "schema", "tools"))
        if extra:
            raise BadRequest(f"{param}: unknown keys {extra[:8]}", param=param)
        if kind == "json_object":
            return cls(kind, _canonical({"type": "object"}, param))
        if kind == "json_schema":
            return cls(kind, _canonical(check_schema(d.get("schema"), f"{param}.schema"),
                                        param))
        tools = d.get("tools")
        if not isinstance(tools, list) or not tools or len(tools) > MAX_TOOLS:
            raise BadRequest(f"{param}.tools must be 1..{MAX_TOOLS} functions", param=param)
        out = []
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or not isinstance(t.get("name"), str) \
                    or not _TOOL_NAME.fullmatch(t["name"]):
                raise BadRequest(f"{param}.tools[{i}] needs a function name", param=param)
            out.append({"name": t["name"], "parameters": check_schema(
                t.get("parameters", {"type": "object"}), f"{param}.tools[{i}].parameters")})
        return cls(kind, _canonical(out, param))

    def to_wire(self) -> dict[str, Any]:
        """The map that travels in ``params.sampling.grammar`` (msgpack, DESIGN.md decision 5)."""
        if self.kind == "tool_call":
            return {"type": self.kind, "tools": json.loads(self.schema)}
        if self.kind == "json_schema":
            return {"type": self.kind, "schema": json.loads(self.schema)}
        return {"type": self.kind}

    def grammar(self, fmt: str | None = None) -> str:
        """The llguidance grammar (a Lark grammar with the JSON schemas inlined); a tool
        call's in the chat template's `fmt` (`tool_format`)."""
        import llguidance

        if self.kind != "tool_call":
            return str(llguidance.LLMatcher.grammar_from_json_schema(self.schema))
        tools = json.loads(self.schema)
        key = "parameters" if fmt == LLAMA_JSON else "arguments"
        calls = [{"type": "object", "properties": {"name": {"const": t["name"]},
                                                   key: t["parameters"]},
                  "required": ["name", key], "additionalProperties": False}
                 for t in tools]
        # compact, as the templates write a call (``tojson``): no room for whitespace runs
        style = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
        call = json.dumps({**(calls[0] if len(calls) == 1 else {"anyOf": calls}),
                           "x-guidance": style})
        if fmt == HERMES:
            lark = f'start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: %json {call}'
        elif fmt == MISTRAL:
            lark = f'start: "[TOOL_CALLS][" call "]"\ncall: %json {call}'
        else:
            lark = f"start: call\ncall: %json {call}"
        return str(llguidance.LLMatcher.grammar_from_lark(lark))


def _canonical(v: Any, param: str) -> str:
    text = json.dumps(v, sort_keys=True, separators=(",", ":"))
    if len(text) > MAX_SCHEMA_BYTES:
        raise BadRequest(f"{param} is {len(text)} bytes of JSON; the limit is "
                         f"{MAX_SCHEMA_BYTES}", param=param)
    return text


def check_schema(schema: Any, param: str) -> dict[str, Any]:
    """`schema` if it is a JSON schema the grammar library compiles; else `BadRequest`
    naming `param`, with the library's reason (before any work: a schema is compiled
    without a tokenizer here, about a millisecond)."""
    import llguidance

    if not isinstance(schema, dict):
        raise BadRequest(f"{param} must be a JSON schema (an object)", param=param)
    _canonical(schema, param)
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
        why = llguidance.LLMatcher.validate_grammar(grammar)
    except (ValueError, TypeError, RuntimeError) as e:
        why = str(e) or type(e).__name__
    if why and not why.startswith("WARNING"):
        raise BadRequest(f"{param} is not a JSON schema this server can enforce: "
                         f"{why}"[:400], param=param)
    return schema


def check_tools(tools: Any, param: str = "tools") -> list[dict[str, Any]]:
    """OpenAI ``tools``: 1..128 ``{"type": "function", "function": {"name", "description"?,
    "parameters"?, "strict"?}}``, names unique; returns them as given (the chat template
    renders them). Raises `BadRequest` naming the field."""
    if not isinstance(tools, list) or not tools or len(tools) > MAX_TOOLS:
        raise BadRequest(f"{param} must be an array of 1..{MAX_TOOLS} tools", param=param)
    names: set[str] = set()
    for i, t in enumerate(tools):
        where = f"{param}[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" \
                or not isinstance(t.get("function"), dict) or set(t) - {"type", "function"}:
            raise BadRequest(f'{where} must be {{"type": "function", "function": {{...}}}} '
                             "(only function tools are supported)", param=where)
        f = t["function"]
        extra = sorted(str(k)[:64] for k in f if k not in ("name", "description",
                                                            "parameters", "strict"))
        if extra:
            raise BadRequest(f"{where}.function.{extra[0]} is not a field of a function",
                             param=f"{where}.function.{extra[0]}")
        name = f.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name) or name in names:
            raise BadRequest(f"{where}.function.name must be a unique name of 1..64 "
                             "letters, digits, _ or -", param=f"{where}.function.name")
        names.add(name)
        if f.get("description") is not None and not isinstance(f["description"], str):
            raise BadRequest(f"{where}.function.description must be a string",
                             param=f"{where}.function.description")
        if f.get("strict") is not None and not isinstance(f["strict"], bool):
            raise BadRequest(f"{where}.function.strict must be true or false",
                             param=f"{where}.function.strict")
        if f.get("parameters") is not None:
            check_schema(f["parameters"], f"{where}.function.parameters")
    return tools


def check_tool_choice(choice: Any, tools: list[dict[str, Any]] | None) -> str | None:
    """OpenAI ``tool_choice`` → ``"none"``, ``"auto"``, ``"required"`` or the forced
    function's name; None when absent (``"auto"`` with tools, ``"none"`` without, as
    OpenAI). Raises `BadRequest` naming ``tool_choice``."""
    if choice is None:
        return None
    if choice in ("none", "auto", "required"):
        if choice == "required" and not tools:
            raise BadRequest('tool_choice "required" must be sent with tools',
                             param="tool_choice")
        return str(choice)
    if not (isinstance(choice, dict) and choice.get("type") == "function"
            and isinstance(choice.get("function"), dict)
            and isinstance(choice["function"].get("name"), str)):
        raise BadRequest('tool_choice must be "none", "auto", "required" or {"type": '
                         '"function", "function": {"name": ...}}', param="tool_choice")
    name = choice["function"]["name"]
    if name not in {t["function"]["name"] for t in tools or ()}:
        raise BadRequest(f"tool_choice must be a function of tools; {name[:64]!r} is "
                         "not one", param="tool_choice")
    return str(name)


def tool_constraint(tools: list[dict[str, Any]], forced: str) -> Constraint:
    """The constraint of ``tool_choice`` `forced` (``"required"``: any of `tools`; else the
    named function)."""
    fns = [t["function"] for t in tools
           if forced == "required" or t["function"]["name"] == forced]
    return Constraint.from_wire({"type": "tool_call", "tools": [
        {"name": f["name"], "parameters": f.get("parameters") or {"type": "object"}}
        for f in fns]}, param="tool_choice")


class Conversation(list[dict[str, Any]]):
    """A chat's messages and the tools its template renders (`tools`, None: no tools): the
    messages of a `ChatRequest`, so that every path that renders them (`LayeredHead.
    chat_prompt_ids`, mesh and local) renders the tools too."""

    tools: list[dict[str, Any]] | None = None

    @classmethod
    def of(cls, messages: list[dict[str, Any]],
           tools: list[dict[str, Any]] | None) -> Conversation:
        out = cls(messages)
        out.tools = tools
        return out


def template_has_tools(template: str | None) -> bool:
    """Whether a chat template renders a ``tools`` variable: jinja2's own analysis
    (``meta.find_undeclared_variables``) through transformers, who parse it in the
    environment they render it in."""
    if not template:
        return False
    from transformers.utils.chat_template_utils import _get_template_variables

    return "tools" in _get_template_variables(template)


def tool_format(template: str | None) -> str:
    """How `template` writes a tool call: `HERMES`, `MISTRAL` or `LLAMA_JSON` (the
    markers its own text renders, since a template states its format only by example)."""
    text = template or ""
    if "<tool_call>" in text:
        return HERMES
    if "[TOOL_CALLS]" in text:
        return MISTRAL
    return LLAMA_JSON


@functools.lru_cache(maxsize=8)
def _ll_tokenizer(tokenizer: Any, eos: tuple[int, ...]) -> Any:
    """llguidance's view of a tokenizer (~0.5 s for 49k tokens): once per head."""
    import llguidance.hf

    return llguidance.hf.from_tokenizer(tokenizer, eos_token=list(eos))


@functools.lru_cache(maxsize=64)
def _compiled(tokenizer: Any, eos: tuple[int, ...], constraint: Constraint) -> Any:
    """A compiled grammar's matcher in its start state, per (tokenizer, constraint): a
    repeated schema is not compiled again; each answer takes a `deep_copy`."""
    import llguidance

    fmt = tool_format(getattr(tokenizer, "chat_template", None)) \
        if constraint.kind == "tool_call" else None
    m = llguidance.LLMatcher(_ll_tokenizer(tokenizer, eos), constraint.grammar(fmt),
                             log_level=0)
    if m.is_error():
        param = "tool_choice" if constraint.kind == "tool_call" else "response_format"
        raise BadRequest(f"the {constraint.kind} constraint cannot be compiled for this "
                         f"model: {m.get_error()}"[:400], param=param)
    return m


class GrammarState:
    """One answer's place in its grammar: the allowed-token bitmask of the next position
    (`fill`), and `consume` for each token taken."""

    def __init__(self, m: Any, vocab_size: int) -> None:
        self._m = m
        self.vocab_size = vocab_size  # the tokenizer's: bit i of the mask is token i
        self.words = (vocab_size + 31) // 32  # int32 words of the mask

    def fill(self, ptr: int, nbytes: int) -> None:
        """Write the mask into `nbytes` (``words * 4``) at `ptr` (a buffer the caller owns)."""
        self._m.unsafe_compute_mask_ptr(ptr, nbytes)

    def consume(self, token_id: int) -> None:
        """Advance past `token_id`, one the mask allowed (anything else is a bug: raised,
        never an answer that silently leaves its grammar)."""
        if not self._m.consume_token(token_id):
            raise RuntimeError(f"token {token_id} left the grammar: {self.error}")

    @property
    def stopped(self) -> bool:
        """Complete: the grammar allows no more text (or has failed: `error`)."""
        return bool(self._m.is_stopped())

    @property
    def error(self) -> str:
        return str(self._m.get_error())


def matcher(tokenizer: Any, eos_ids: set[int], constraint: Constraint) -> GrammarState:
    """A fresh state of `constraint`'s compiled grammar for one answer."""
    eos = tuple(sorted(eos_ids))
    return GrammarState(_compiled(tokenizer, eos, constraint).deep_copy(),
                        int(_ll_tokenizer(tokenizer, eos).vocab_size))


_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_tool_calls(text: str, names: frozenset[str] | set[str]
                     ) -> tuple[str, list[tuple[str, str]]] | None:
    """`text` as (the content besides the calls, [(function name, arguments JSON)]), in
    whichever of the formats above it is written; None when it holds no call to a function
    of `names` (then it is plain content)."""
    stripped = text.strip()
    found: list[Any] = []
    content = ""
    if "<tool_call>" in text:
        found = [_json(m) for m in _HERMES_CALL.findall(text)]
        content = _HERMES_CALL.sub("", text).strip()
    elif stripped.startswith("[TOOL_CALLS]"):
        v = _json(stripped[len("[TOOL_CALLS]"):])
        found = v if isinstance(v, list) else []
    elif stripped.startswith("{"):
        found = [_json(stripped)]
    calls = []
    for c in found:
        if not isinstance(c, dict) or c.get("name") not in names:
            return None
        args = c.get("arguments", c.get("parameters", {}))
        if isinstance(args, str):
            args = _json(args)
        if not isinstance(args, dict):
            return None
        calls.append((str(c["name"]), json.dumps(args, ensure_ascii=False)))
    return (content, calls) if calls else None


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


TOOL_CALL_STARTS = ("<tool_call>", "[TOOL_CALLS]", "{")  # how a call's text begins
