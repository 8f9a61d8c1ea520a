"""The attention function of a stack's layers: the family's own, or, in a forward over
several sessions, the family's own run on each session's cache where it lies.

transformers' decoder layers look their attention function up by the config's
``_attn_implementation`` in its `AttentionInterface` registry. A stack registers
`segments_attention` there and points its layers' config at it (`install`); each attention
module keeps the family's own function (sdpa, or the family's eager one, e.g. Gemma-2's
soft-capping). A single session's step passes straight through to it (`one_session`;
one CPU decode query of a grouped-query family runs as grouped sdpa, the same product),
so solo, compiled and graph-captured steps compute as the family's. A forward over several
sessions passes its `SegmentsKV` as the layer keyword ``hearthnet_segments``: each
segment's queries then attend over a view of its own session's slot, one call per segment
(DESIGN.md decision 12; the cost of a batched step grows with the new positions and the
cached length read, never with a copy of the caches).

A compiled decode round (one position of each of several sessions, `compiled.round_step`)
cannot trace that per-session work — the sessions, their slots and lengths change every
round — so its layers pass ``hearthnet_round`` instead, and their attention is one opaque
op, ``hearthnet::round_attention`` (`round_attention`): it writes each row's key/value into
its session's slot and attends as above, over the `SegmentsKV` of the round that is
running on this thread (`decode_round`). Everything else of the layers (norms, products,
rope) is traced for any number of rows.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from typing import Any

import torch

from hearthnet.distributed_inference.engine.kv_cache import SegmentsKV
from hearthnet.errors import ModelUnusable

SEGMENTS_ATTENTION = "hearthnet_segments"
SEGMENTS_KWARG = "hearthnet_segments"
_INNER = "_hearthnet_attention"  # the family's own function, on each attention module
_PLAIN_SDPA = "_hearthnet_sdpa"  # ...and whether it is transformers' sdpa


ROUND_KWARG = "hearthnet_round"
# what would change sdpa's product beyond the scale (sdpa's own arguments): a compiled
# round passes only the scale to its op, so a family that sets any of these stays eager
_ROUND_REFUSED = ("softcap", "position_bias", "s_aux", "sinks", "is_causal")
_ROUND = threading.local()


def segments_attention(module: Any, query: torch.Tensor, key: torch.Tensor,
                       value: torch.Tensor, attention_mask: torch.Tensor | None,
                       **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """The family's attention; per session segment when the forward carries segments; the
    opaque `round_attention` in a compiled decode round."""
    if kwargs.pop(ROUND_KWARG, False):
        other = [k for k in _ROUND_REFUSED if kwargs.get(k) is not None]
        if other or kwargs.get("dropout") or not getattr(module, _PLAIN_SDPA, False):
            # while tracing: the compilation fails, so rounds stay eager (their state names
            # dynamo's error; a family without plain sdpa is refused before, `_cannot`)
            raise ModelUnusable(f"{type(module).__name__}'s attention is not plain sdpa "
                                f"({', '.join(other) or 'its own function or dropout'}); "
                                "a compiled round does not take it")
        scaling = kwargs.get("scaling")
        scale = float(scaling) if scaling is not None else float(query.shape[-1]) ** -0.5
        return torch.ops.hearthnet.round_attention(query, key, value, int(module.layer_idx),
                                                   scale), None
    segments: SegmentsKV | None = kwargs.pop(SEGMENTS_KWARG, None)
    if segments is None:
        return one_session(module, query, key, value, attention_mask, **kwargs)
    rows = segments.histories(int(module.layer_idx))
    if _packable(module, query, kwargs) and all(
            t == 1 and m is None for t, (_, _, m) in zip(segments.counts, rows, strict=True)):
        return _decode_rows(module, query, rows, kwargs.get("scaling"))
    outs, off = [], 0
    for t, (k, v, mask) in zip(segments.counts, rows, strict=True):
        out, _ = one_session(module, query[:, :, off:off + t], k, v, mask, **kwargs)
        outs.append(out)
        off += t
    return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)), None


def _packable(module: Any, query: torch.Tensor, kwargs: dict[str, Any]) -> bool:
    """Whether a query of one position of `module` runs as grouped sdpa (`one_session`)."""
    return (int(getattr(module, "num_key_value_groups", 1)) > 1
            and query.device.type == "cpu" and getattr(module, _PLAIN_SDPA, False)
            and not kwargs.get("dropout"))


def _decode_rows(module: Any, query: torch.Tensor,
                 rows: list[tuple[torch.Tensor, torch.Tensor, Any]],
                 scaling: float | None) -> tuple[torch.Tensor, None]:
    """One decode row per session (`query` (1, heads, B, D)), each over its own history,
    as `one_session`'s grouped sdpa, with the per-row reshapes done once for all rows:
    (1, B, heads, D)."""
    _, heads, b, dim = query.shape
    groups = int(module.num_key_value_groups)
    q = query[0].transpose(0, 1).reshape(b, heads // groups, groups, dim)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    out = torch.cat([sdpa(q[r:r + 1], k, v, scale=scaling)
                     for r, (k, v, _) in enumerate(rows)])
    return out.reshape(1, b, heads, dim), None


def one_session(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """The family's attention function over one session's keys/values.

    One query of a grouped-query (GQA) family over a CPU cache, with no mask, runs as
    sdpa with the query's heads grouped under their key/value head (transformers'
    `pack_gqa`, which it uses only where a mask is given): the same product, without
    sdpa's ``enable_gqa`` path, which on the CPU costs about 3× as much at 2,000 cached
    positions (measured: 0.44 against 0.15 ms per layer, Qwen2.5-1.5B's 12/2 heads).
    """
    inner = getattr(module, _INNER)
    if (attention_mask is None and query.shape[0] == 1 and query.shape[2] == 1
            and _packable(module, query, kwargs)):
        return _decode_rows(module, query, [(key, value, None)], kwargs.get("scaling"))
    return inner(module, query, key, value, attention_mask, **kwargs)  # type: ignore[no-any-return]


@contextlib.contextmanager
def decode_round(segments: SegmentsKV, modules: dict[int, Any]) -> Iterator[None]:
    """The round `round_attention` serves on this thread while the context lasts: its
    `SegmentsKV` (one decode row per session) and each layer index's attention module."""
    _ROUND.state = (segments, modules)
    try:
        yield
    finally:
        _ROUND.state = None


@torch.library.custom_op("hearthnet::round_attention", mutates_args=())
def round_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int,
                    scaling: float) -> torch.Tensor:
    """A compiled round's attention at layer `layer`: the rows' new keys/values written into
    their sessions' slots and each row's query over its own session's history, as
    `segments_attention` does eagerly; (1, rows, heads, head_dim). It writes the slots of
    the round `decode_round` set on this thread (state the compiled graph does not see:
    its result is the only thing the layers read next, so the order holds)."""
    state = getattr(_ROUND, "state", None)
    if state is None:
        raise RuntimeError("hearthnet::round_attention ran outside a decode round")
    segments, modules = state
    segments.update(key, value, layer)
    out, _ = segments_attention(modules[layer], query, key, value, None,
                                **{SEGMENTS_KWARG: segments, "scaling": scaling,
                                   "dropout": 0.0})
    return out.contiguous()


@round_attention.register_fake
def _round_attention_shape(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           layer: int, scaling: float) -> torch.Tensor:
    b, heads, t, dim = query.shape
    return query.new_empty(b, t, heads, dim)


def install(config: Any, layers: Any) -> None:
    """Route `layers`' attention through `segments_attention` (their `config` is the one
    they read ``_attn_implementation`` from), keeping each module's own function."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if SEGMENTS_ATTENTION not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(SEGMENTS_ATTENTION, segments_attention)
    name = config._attn_implementation or "eager"
    if name == SEGMENTS_ATTENTION:  # installed already: the modules hold their functions
        return
    for layer in layers:
        attn = getattr(layer, "self_attn", None)
        if attn is None or not hasattr(attn, "layer_idx"):
            raise ModelUnusable(f"{type(layer).__name__} has no self_attn with a layer index; "
                                "its attention cannot be run per session")
        if name == "eager":
            inner = getattr(sys.modules[type(attn).__module__], "eager_attention_forward", None)
            if inner is None:
                raise ModelUnusable(f"{type(attn).__module__} has no eager_attention_forward")
        else:
            inner = ALL_ATTENTION_FUNCTIONS[name]
        setattr(attn, _INNER, inner)
        setattr(attn, _PLAIN_SDPA, name == "sdpa")
    config._attn_implementation = SEGMENTS_ATTENTION
