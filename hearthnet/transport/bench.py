"""Transport benchmark: `hearthnet bench transport` (M26 §8.4).

An echo peer runs in another process on 127.0.0.1 (``python -m hearthnet.transport.bench
--echo``); the client times complete round trips — encode → send → receive → decode →
echo back → receive → decode — of decode-step hidden states (1×1×576 and 1×1×3072 fp16:
SmolLM2-135M and a 3B-class model) over at least 2,000 steps, and of 2,048-token
prefills. The goal on a laptop-class CPU is p95 ≤ 1 ms per decode round trip; the spec's
budget is 25 ms per hop. In a pipeline every hop follows an idle wait (the other stages'
compute), so the 1×1×576 round trip is also timed after an idle gap of ``idle_gap_ms``
between steps: what waking costs this machine beside the same code back to back (on a
VM whose idle vCPUs halt, two to three times as much; docs/benchmarks.md). Beside the
round trips it times the codec alone, in this process: encoding and decoding one decode
step's frame (1×1×hidden fp32, the lossless wire, for SmolLM2's 576 and a 1.5B model's
1536) — four of each are paid per pipeline hop.

Both processes run single-threaded torch on uvloop when it is installed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
import timeit
from collections.abc import Sequence
from typing import Any

import torch

from hearthnet.constants import (
    TENSOR_CHUNK_BYTES,
    TENSOR_FLOW_CONTROL_WINDOW,
    TRANSPORT_IDLE_GAP_MS,
)
from hearthnet.loop import run
from hearthnet.observability import configure_logging
from hearthnet.stats import percentile
from hearthnet.transport.codec import (
    OP_INPUT,
    EncodedTensor,
    TensorAssembler,
    WireDtype,
    chunk_count_for,
)
from hearthnet.transport.websocket import SHARD_PATH, ServerStream, TensorChannel, serve

GOAL_P95_MS = 1.0
DECODE_HIDDEN = (576, 3072)
IDLE_HIDDEN = 576
"""The decode step also timed after an idle gap (`run_transport_bench`'s `idle_gap_ms`)."""
PREFILL_TOKENS = 2048
CODEC_HIDDEN = (576, 1536)
"""Hidden widths whose decode-step frame is encoded and decoded alone (`codec_timings`)."""
_READY = "LISTENING"


# ---------------------------------------------------------------------------------------
# Echo peer (the other process)


async def _echo(stream: ServerStream) -> None:
    """Send every INPUT straight back as OUTPUT."""
    await stream.accept({"echo": True})
    while (inp := await stream.recv_step(deadline_s=3600.0)) is not None:
        await stream.send_step(inp.step, inp.start_pos, inp.tensor, compute_us=0)


async def serve_echo(host: str = "127.0.0.1", port: int = 0, *,
                     window: int = TENSOR_FLOW_CONTROL_WINDOW,
                     chunk_bytes: int = TENSOR_CHUNK_BYTES) -> None:
    """Run the echo peer until cancelled; print ``LISTENING <port>`` once it listens."""
    server = await serve(_echo, host, port, window=window, chunk_bytes=chunk_bytes,
                         deadline_s=3600.0)
    async with server:
        print(_READY, server.sockets[0].getsockname()[1], flush=True)
        await server.serve_forever()


def _exit_with_parent() -> None:
    """Stop the echo peer when its parent closes our stdin (or dies)."""
    def watch() -> None:
        sys.stdin.read()
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()


class EchoPeer:
    """The echo peer as a child process; use as a context manager."""

    def __init__(self, *, window: int = TENSOR_FLOW_CONTROL_WINDOW,
                 chunk_bytes: int = TENSOR_CHUNK_BYTES) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hearthnet.transport.bench", "--echo", "--port", "0",
             "--window", str(window), "--chunk-bytes", str(chunk_bytes)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().split()
        if len(line) != 2 or line[0] != _READY:
            self.close()
            raise RuntimeError(f"echo peer did not start (said {line!r})")
        self.port = int(line[1])
        self.uri = f"ws://127.0.0.1:{self.port}{SHARD_PATH}"

    def kill(self) -> None:
        """Kill the peer abruptly (SIGKILL), as a crashed host would go."""
        self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.kill()

    def __enter__(self) -> EchoPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------------------
# Client side


def _percentiles(samples_ns: list[int]) -> dict[str, float]:
    ms = [x / 1e6 for x in samples_ns]
    return {"p50_ms": round(percentile(ms, 50), 4), "p95_ms": round(percentile(ms, 95), 4),
            "p99_ms": round(percentile(ms, 99), 4), "mean_ms": round(statistics.fmean(ms), 4),
            "max_ms": round(max(ms), 4), "n": len(ms)}


async def _decode_round_trips(ch: TensorChannel, hidden: int, steps: int,
                              warmup: int, gap_s: float = 0.0) -> dict[str, Any]:
    """`steps` timed round trips of a 1×1×`hidden` step; with `gap_s`, each after that
    long idle (a pipeline's hop follows the other stages' compute)."""
    x = torch.randn(1, 1, hidden).to(torch.float16)  # (B, T, hidden)
    for i in range(warmup):
        await ch.step(i, i, x)
    samples: list[int] = []
    clock = time.perf_counter_ns
    for i in range(steps):
        if gap_s:
            await asyncio.sleep(gap_s)
        t0 = clock()
        out = await ch.step(i, i, x)
        samples.append(clock() - t0)
        if out.step != i or not torch.equal(out.tensor, x):
            raise RuntimeError(f"echo of step {i} came back wrong")
    result: dict[str, Any] = _percentiles(samples)
    result["bytes"] = x.numel() * x.element_size()
    return result


async def _prefill_round_trips(ch: TensorChannel, hidden: int, tokens: int,
                               reps: int) -> dict[str, Any]:
    x = torch.randn(1, tokens, hidden).to(torch.float16)
    nbytes = x.numel() * x.element_size()
    await ch.step(0, 0, x)  # warm-up
    samples: list[int] = []
    for i in range(reps):
        t0 = time.perf_counter_ns()
        out = await ch.step(i, 0, x)
        samples.append(time.perf_counter_ns() - t0)
        if not torch.equal(out.tensor, x):
            raise RuntimeError(f"echo of prefill {i} came back wrong")
    med_s = statistics.median(samples) / 1e9
    return {"ms": round(med_s * 1e3, 3), "p95_ms": _percentiles(samples)["p95_ms"],
            "MB_per_s": round(2 * nbytes / med_s / 1e6, 1), "bytes": nbytes,
            "chunks": chunk_count_for(nbytes, ch.chunk_bytes), "n": reps}


def codec_timings(hidden: int, *, number: int = 2000, repeat: int = 5) -> dict[str, Any]:
    """Microseconds to encode and to decode one decode step's frame (1×1×``hidden`` fp32)
    in this process: the best of ``repeat`` means over ``number`` calls each (the least
    disturbed by other work on the machine).

    Encode is the sender's whole job on a tensor (checks, header, the frame's bytes);
    decode the receiver's (header checks, the tensor over the received message).
    """
    x = torch.randn(1, 1, hidden)

    def encode() -> bytes:
        return EncodedTensor(x, opcode=OP_INPUT, stream_id=1, step=1, start_pos=1,
                             wire_dtype=WireDtype.FP32).frame(0)

    frame = encode()
    asm = TensorAssembler(expect_opcode=OP_INPUT, expect_dtype=WireDtype.FP32,
                          expect_stream_id=1)
    _, back = asm.feed(frame)
    if back is None or not torch.equal(back, x):
        raise RuntimeError(f"the codec's round trip of 1x1x{hidden} fp32 came back wrong")
    enc = min(timeit.repeat(encode, number=number, repeat=repeat)) / number
    dec = min(timeit.repeat(lambda: asm.feed(frame), number=number, repeat=repeat)) / number
    return {"encode_us": round(enc * 1e6, 2), "decode_us": round(dec * 1e6, 2),
            "frame_bytes": len(frame), "n": number * repeat}


async def _client(uri: str, *, steps: int, warmup: int, prefill_reps: int, window: int,
                  chunk_bytes: int, idle_gap_ms: float) -> dict[str, Any]:
    ch = await TensorChannel.connect(uri, {"wire_dtype": "fp16"}, window=window,
                                     chunk_bytes=chunk_bytes, deadline_s=60.0)
    try:
        out: dict[str, Any] = {}
        for hidden in DECODE_HIDDEN:
            out[f"decode_{hidden}"] = await _decode_round_trips(ch, hidden, steps, warmup)
        if idle_gap_ms > 0:  # a quarter of the steps: each waits the gap first
            idle = await _decode_round_trips(ch, IDLE_HIDDEN, max(1, steps // 4), 0,
                                             idle_gap_ms / 1000)
            out[f"decode_{IDLE_HIDDEN}_after_idle"] = {**idle, "idle_gap_ms": idle_gap_ms}
        for hidden in DECODE_HIDDEN:
            out[f"prefill_{PREFILL_TOKENS}x{hidden}"] = await _prefill_round_trips(
                ch, hidden, PREFILL_TOKENS, prefill_reps)
        out["_loop"] = type(asyncio.get_running_loop()).__module__.split(".")[0]
        return out
    finally:
        await ch.close()


def run_transport_bench(*, steps: int = 2000, warmup: int = 200, prefill_reps: int = 20,
                        window: int = TENSOR_FLOW_CONTROL_WINDOW,
                        chunk_bytes: int = TENSOR_CHUNK_BYTES,
                        idle_gap_ms: float = TRANSPORT_IDLE_GAP_MS) -> dict[str, Any]:
    """Run the whole benchmark against a fresh echo peer process; return the figures.

    Keys: ``decode_576`` and ``decode_3072`` ({p50_ms, p95_ms, p99_ms, mean_ms, max_ms,
    n, bytes}: one round trip each, back to back), ``decode_576_after_idle`` (the same,
    a quarter as many, each after `idle_gap_ms` idle, with ``idle_gap_ms`` and
    ``ratio_p50`` to the back-to-back p50; absent when the gap is 0), ``prefill_2048x576``
    and ``prefill_2048x3072`` ({ms: median round trip, MB_per_s: bytes moved both ways
    per second, p95_ms, bytes, chunks, n}), ``codec_fp32_576`` and ``codec_fp32_1536``
    ({encode_us, decode_us, frame_bytes, n}: `codec_timings`), ``goal`` and ``config``.
    """
    torch.set_num_threads(1)
    codec = {f"codec_fp32_{h}": codec_timings(h) for h in CODEC_HIDDEN}
    with EchoPeer(window=window, chunk_bytes=chunk_bytes) as peer:
        res = run(_client(peer.uri, steps=steps, warmup=warmup, prefill_reps=prefill_reps,
                          window=window, chunk_bytes=chunk_bytes, idle_gap_ms=idle_gap_ms))
    loop = res.pop("_loop")
    idle = res.get(f"decode_{IDLE_HIDDEN}_after_idle")
    if idle is not None:
        idle["ratio_p50"] = round(idle["p50_ms"] / res[f"decode_{IDLE_HIDDEN}"]["p50_ms"], 2)
    res.update(codec)
    from websockets.version import version as websockets_version

    res["goal"] = {"decode_p95_ms_max": GOAL_P95_MS,
                   "met": all(res[f"decode_{h}"]["p95_ms"] <= GOAL_P95_MS
                              for h in DECODE_HIDDEN)}
    res["config"] = {"steps": steps, "warmup": warmup, "idle_gap_ms": idle_gap_ms,
                     "window": window,
                     "chunk_bytes": chunk_bytes, "wire_dtype": "fp16", "event_loop": loop,
                     "host": "127.0.0.1", "echo_peer": "separate process",
                     "python": platform.python_version(), "torch": torch.__version__,
                     "websockets": websockets_version, "cpus": os.cpu_count()}
    return res


def format_report(res: dict[str, Any]) -> str:
    """The figures as a short human-readable table."""
    cfg = res["config"]
    lines = [f"tensor transport round trips, echo peer in another process on 127.0.0.1 "
             f"({cfg['event_loop']}, window {cfg['window']}, chunk {cfg['chunk_bytes']} B)"]
    for h in DECODE_HIDDEN:
        r = res[f"decode_{h}"]
        lines.append(f"  decode 1x1x{h:<5} fp16 ({r['bytes']:>5} B)  p50 {r['p50_ms']:.3f} ms  "
                     f"p95 {r['p95_ms']:.3f} ms  p99 {r['p99_ms']:.3f} ms  (n={r['n']})")
    idle = res.get(f"decode_{IDLE_HIDDEN}_after_idle")
    if idle is not None:
        lines.append(f"  decode 1x1x{IDLE_HIDDEN:<5} fp16, each after {idle['idle_gap_ms']:g} ms "
                     f"idle (as a pipeline's hop): p50 {idle['p50_ms']:.3f} ms  "
                     f"p95 {idle['p95_ms']:.3f} ms  (n={idle['n']}; {idle['ratio_p50']:.2f}x "
                     f"back to back: what waking costs this machine)")
    for h in DECODE_HIDDEN:
        r = res[f"prefill_{PREFILL_TOKENS}x{h}"]
        lines.append(f"  prefill {PREFILL_TOKENS}x{h:<5} fp16 ({r['bytes'] / 1e6:.1f} MB, "
                     f"{r['chunks']} chunks)  {r['ms']:.2f} ms per round trip  "
                     f"{r['MB_per_s']:.0f} MB/s  (n={r['n']})")
    for h in CODEC_HIDDEN:
        r = res[f"codec_fp32_{h}"]
        lines.append(f"  codec alone, a decode step's frame 1x1x{h:<5} fp32 "
                     f"({r['frame_bytes']} B): encode {r['encode_us']:.1f} us, "
                     f"decode {r['decode_us']:.1f} us")
    goal = res["goal"]
    lines.append(f"  goal p95 <= {goal['decode_p95_ms_max']} ms per decode round trip: "
                 f"{'met' if goal['met'] else 'NOT met'}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m hearthnet.transport.bench [--echo]``: the echo peer or the benchmark."""
    p = argparse.ArgumentParser(prog="python -m hearthnet.transport.bench")
    p.add_argument("--echo", action="store_true", help="run the echo peer")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--window", type=int, default=TENSOR_FLOW_CONTROL_WINDOW)
    p.add_argument("--chunk-bytes", type=int, default=TENSOR_CHUNK_BYTES)
    p.add_argument("--steps", type=int, default=2000)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    configure_logging("warning", json=False)  # stderr; stdout carries the port line
    if args.echo:
        _exit_with_parent()
        run(serve_echo(args.host, args.port, window=args.window,
                       chunk_bytes=args.chunk_bytes))
        return 0
    print(format_report(run_transport_bench(steps=args.steps, window=args.window,
                                            chunk_bytes=args.chunk_bytes)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
