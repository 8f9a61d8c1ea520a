"""`hearthnet chat`: stream an answer, locally (`--local`) or through the mesh (`--config`)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

from hearthnet.argtypes import positive
from hearthnet.commands import remote
from hearthnet.commands.remote import chat_via_node
from hearthnet.constants import CALL_WIRE_DTYPES
from hearthnet.distributed_inference.directory.formats import POLICIES
from hearthnet.distributed_inference.engine.sampling import SPECULATE_MODES, SamplingParams
from hearthnet.frames import (
    Done,
    ErrorFrame,
    OtherFrame,
    PipelineAborted,
    ShardFailover,
    ShardStatus,
    StreamFrame,
    TokenDelta,
    is_incident,
)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("chat", help="ask the model something and stream the answer")
    p.add_argument("prompt", nargs="?", default=None,
                   help="what to ask; without it, a conversation: one turn per line, "
                        "history kept (/help lists its commands)")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--local", action="store_true", help="run every layer in this process")
    where.add_argument("--config", help="node TOML: call that node's distributed chat")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--wire-dtype", choices=list(CALL_WIRE_DTYPES), default=None,
                   help="hidden-state wire dtype: auto (fp32, lossless), compact (fp16 where "
                        "it fits, lossy), fp16, bf16, fp32 (default: the node's "
                        "activation_dtype, auto)")
    p.add_argument("--weights", choices=list(POLICIES), default=None,
                   help="which shard formats the call accepts: lossless (formats that keep "
                        "the stored weights; the node's default), a minimum format (int8 and "
                        "int4 are lossy), or exact (only the node's own head format)")
    p.add_argument("--speculate", choices=list(SPECULATE_MODES), default=None,
                   help="proposals each pass verifies (greedy answers are unchanged): lookup "
                        "(prompt lookup, the default), draft (the model's draft model: the "
                        "node's draft_models, or --draft-model with --local) or off")
    p.add_argument("--draft-model", default=None,
                   help="with --local and --speculate draft: the draft model (same tokenizer)")
    p.add_argument("--json", action="store_true", help="one JSON object per frame")
    p.add_argument("--threads", type=positive, default=2, help="torch threads in this process")
    p.set_defaults(func=_run)


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                          stop=tuple(args.stop))


def emit(frame: StreamFrame | OtherFrame, as_json: bool) -> None:
    """Print one stream frame: its wire map as a JSON line, or text for a person (routine
    frames — a stage ``ok``, a widened wire — only in `--json`)."""
    if as_json:
        print(json.dumps(frame.to_wire()), flush=True)
        return
    if isinstance(frame, TokenDelta):
        sys.stdout.write(frame.text)
        sys.stdout.flush()
    elif isinstance(frame, Done):
        sys.stdout.write("\n")
        t, n = frame.timings, frame.text_tokens
        print(f"[{n} tokens, first token {t.get('first_token_ms', 0):.0f} ms, "
              f"{t.get('tokens_per_second', 0):.1f} tok/s{speculative_note(frame.speculative)}"
              f"{formats_note(frame.formats)}]",
              file=sys.stderr)
    elif is_incident(frame) or isinstance(frame, ErrorFrame):
        print("\n" + describe(frame), file=sys.stderr)


def speculative_note(spec: dict[str, Any] | None) -> str:
    """", 3.1 tokens/pass (lookup)" when proposals were verified (DESIGN.md decision 16)."""
    if not spec or not spec.get("proposed"):
        return ""
    return f", {spec.get('tokens_per_pass', 0):.1f} tokens/pass ({spec.get('mode')})"


def formats_note(formats: dict[str, Any] | None) -> str:
    """"; layers fp32, head fp32, wire fp32: lossless" — what served a call, so an answer
    from a compact format never reads like an exact one (M26 §5.3, DESIGN.md decision 10)."""
    if not formats or "lossless" not in formats:
        return ""
    layers = "/".join(dict.fromkeys(str(f) for f in formats.get("stages", ()))) or "?"
    out = f"; layers {layers}, head {formats.get('head', '?')}"
    if formats.get("wire"):
        out += ", wire " + "/".join(dict.fromkeys(str(w) for w in formats["wire"]))
    return out + (": lossless" if formats["lossless"] else
                  ": LOSSY (a compact format was asked for)")


def _short(shard_id: Any) -> str:
    return str(shard_id).rsplit(":", 1)[-1]  # "0-14@node-b"


def describe(frame: StreamFrame | OtherFrame) -> str:
    """A diagnostic frame as one line for a person; an error reads as the CLI's own."""
    from hearthnet.errors import one_line

    if isinstance(frame, ErrorFrame):
        return one_line(frame.code, frame.message)
    if isinstance(frame, PipelineAborted):
        then = "; continuing on the local engine" if frame.continuing == "local" else ""
        return f"[pipeline_aborted] {frame.reason}{then}"
    if isinstance(frame, ShardFailover):
        new = ", ".join(_short(s) for s in frame.replacement) or "?"
        return (f"[failover] {_short(frame.failed)} → {new} in {frame.ms} ms, "
                f"{frame.replayed_positions} positions replayed")
    if isinstance(frame, ShardStatus):
        return f"[{frame.status}] {_short(frame.shard_id)}: {frame.code}: {frame.message}"
    return f"[{frame.to_wire()['type']}]"


Messages = list[dict[str, str]]
Emit = Callable[[StreamFrame | OtherFrame, bool], None]
Ask = Callable[[argparse.Namespace, Messages, SamplingParams, Emit], int]

HELP = ("/reset forgets the conversation, /model [NAME] shows or switches the model, "
        "/quit (or Ctrl-D) ends; Ctrl-C stops an answer")


def _run(args: argparse.Namespace) -> int:
    """Exit 0 only for a call that ended with `done`, so a script sees a cut answer; every
    failure is an `error` frame in `--json` mode (a lost node included) and exit code 1.
    Without a prompt, a conversation (`_conversation`) until /quit or end of input."""
    from hearthnet.errors import ConfigError, HearthNetError

    try:
        params = sampling_from_args(args)
        ask: Ask = chat_via_node
        if args.local:  # the only path that runs the model in this process
            import torch

            torch.set_num_threads(args.threads)
            ask = _LocalChat()
        if args.prompt is None:
            if not args.local:  # a missing or broken config: exit 2 now, not at turn one
                remote.check_node_config(args.config)
            return _conversation(args, params, ask)
        return ask(args, [{"role": "user", "content": args.prompt}], params, emit)
    except ConfigError:
        raise  # exit code 2 (cli.main)
    except HearthNetError as e:
        emit(ErrorFrame.of(e), args.json)
        return 1


def _conversation(args: argparse.Namespace, params: SamplingParams, ask: Ask) -> int:
    """One turn per input line, each sent with the conversation so far; /commands between
    turns. Ctrl-C stops the answer being streamed (what arrived stays in the history), not
    the conversation; end of input (Ctrl-D) or /quit ends it with exit code 0."""
    from hearthnet.errors import ConfigError, HearthNetError

    person = sys.stdin.isatty()
    if person:
        print(f"chatting with {args.model}: {HELP}", file=sys.stderr)
    history: Messages = []
    while True:
        try:
            line = input("> " if person else "").strip()
        except EOFError:
            return 0
        except KeyboardInterrupt:
            print("\n(/quit or Ctrl-D ends the chat)", file=sys.stderr)
            continue
        if not line:
            continue
        if line.startswith("/"):
            if not _command(line, args, history):
                return 0
            continue
        said: list[str] = []
        messages = [*history, {"role": "user", "content": line}]
        try:
            ask(args, messages, params, _collecting(said))
        except KeyboardInterrupt:  # the call is cancelled: a node sees its caller leave
            print("\n[stopped]", file=sys.stderr)
        except ConfigError:
            raise
        except HearthNetError as e:  # this turn failed; the conversation goes on
            emit(ErrorFrame.of(e), args.json)
        if said:
            history += [messages[-1], {"role": "assistant", "content": "".join(said)}]


def _collecting(said: list[str]) -> Emit:
    """`emit`, also keeping the answer's text in `said`."""
    def out(frame: StreamFrame | OtherFrame, as_json: bool) -> None:
        if isinstance(frame, TokenDelta):
            said.append(frame.text)
        emit(frame, as_json)
    return out


def _command(line: str, args: argparse.Namespace, history: Messages) -> bool:
    """Run a conversation's /command; False ends the conversation."""
    name, _, rest = line.partition(" ")
    rest = rest.strip()
    if name in ("/quit", "/exit"):
        return False
    if name == "/reset":
        history.clear()
        print("(conversation forgotten)", file=sys.stderr)
    elif name == "/model" and rest:
        if args.local:
            from hearthnet.models import ModelStore

            try:
                ModelStore().get(rest)  # a name this store does not hold is refused now
            except Exception as e:
                print(f"hearthnet: {e}", file=sys.stderr)
                return True
        args.model = rest
        print(f"(model {rest}; the conversation goes on)", file=sys.stderr)
    elif name == "/model":
        print(f"(model {args.model})", file=sys.stderr)
    else:
        print(f"{'unknown command ' + name + ': ' if name != '/help' else ''}{HELP}",
              file=sys.stderr)
    return True


class _LocalChat:
    """`--local`'s calls: every layer in this process, each model loaded once."""

    def __init__(self) -> None:
        self._engines: dict[str, Any] = {}

    def __call__(self, args: argparse.Namespace, messages: Messages,
                 params: SamplingParams, out: Emit) -> int:
        return _run_local(args, messages, params, out, self._engines)


def _run_local(args: argparse.Namespace, messages: Messages, params: SamplingParams,
               out: Emit, engines: dict[str, Any]) -> int:
    from hearthnet.distributed_inference.directory.formats import (
        call_formats,
        default_held,
        lossless_of,
    )
    from hearthnet.distributed_inference.engine.local import LocalEngine, LocalTimings
    from hearthnet.distributed_inference.orchestrator.frames import done_frame, token_frame
    from hearthnet.errors import BadRequest
    from hearthnet.models import ModelStore

    store = ModelStore()
    entry = store.get(args.model)
    mode = args.speculate or "lookup"
    if mode == "draft" and not args.draft_model:
        raise BadRequest("--speculate draft with --local needs --draft-model MODEL")
    draft_entry = store.get(args.draft_model) if mode == "draft" else None
    engine = engines.get(entry.alias)
    if engine is None:  # held as a host would by default: a GGUF's Q4 blocks, else fp32
        engine = engines[entry.alias] = LocalEngine(
            entry, default_held("fp32", entry.q4_blocks), head_weights="fp32")
    timings = LocalTimings()
    t0 = time.perf_counter()
    gen = engine.new_generation(messages, params)
    spec = _local_speculator(mode, engine, draft_entry, gen)
    try:
        for ev in engine.run(gen, timings, spec):
            out(token_frame(ev), args.json)
    finally:
        if spec is not None:
            spec.close()
    # the node's fallback `done` (one builder): every path's done frame has the same keys
    out(done_frame(gen, t0=t0, first_ms=timings.first_token_ms,
                    tokens_per_s=timings.decode_tokens_per_s, pipeline=["local"],
                    formats=call_formats(engine.head.format, [engine.stack.format], [], None,
                                         lossless_of(engine.entry)),
                    speculative=spec.stats if spec is not None else None),
         args.json)
    return 0


def _local_speculator(mode: str, engine: Any, draft_entry: Any, gen: Any) -> Any:
    """`--local`'s proposer (DESIGN.md decision 16): None for off."""
    from hearthnet.distributed_inference.directory.formats import default_held
    from hearthnet.distributed_inference.engine.local import LocalEngine
    from hearthnet.distributed_inference.engine.speculation import (
        DraftProposer,
        LookupProposer,
        Speculator,
        check_draft_tokenizer,
    )

    if mode == "off":
        return None
    if draft_entry is None:
        return Speculator("lookup", LookupProposer())
    draft = LocalEngine(draft_entry, default_held("fp32", draft_entry.q4_blocks),
                        head_weights="fp32")
    check_draft_tokenizer(engine.head.tokenizer, draft.head.tokenizer, engine.entry.alias,
                          draft_entry.alias)
    max_len = len(gen.prompt_ids) + gen.params.max_tokens + 1
    return Speculator("draft", DraftProposer(draft, max_len), heavy=True)
