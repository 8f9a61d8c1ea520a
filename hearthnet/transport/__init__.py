"""X08 tensor transport: hidden states between an orchestrator and its shards.

The wire format is written down byte by byte in ``docs/protocol.md``.

* `codec` — tensor ⇄ data frames: the 48-byte header, chunking, reassembly (§4).
* `protocol` — the pure state machine: frames, session states, credit window, errors.
* `websocket` — the asyncio adapter over ``websockets``: `TensorChannel` (client),
  `ServerStream` (server side of an accepted connection), deadlines, `serve`
  (its loop: `hearthnet.loop.run`).
* `bench` — ``hearthnet bench transport``.

This package knows nothing of models; `distributed_inference` knows nothing of frames
beyond the channel API.

The package itself loads no torch: its defaults live in `hearthnet.constants`, so the
command line and the config read them cheaply.
"""

from hearthnet.constants import MAX_TENSOR_BYTES, TENSOR_CHUNK_BYTES, TENSOR_FLOW_CONTROL_WINDOW

__all__ = ["MAX_TENSOR_BYTES", "TENSOR_CHUNK_BYTES", "TENSOR_FLOW_CONTROL_WINDOW"]
