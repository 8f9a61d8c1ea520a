"""Batched decode on a shard's stack (issue 16 §1): rows of different sessions in one forward.

Tiny random-weight models of every family (sliding windows, eager soft-capped attention,
dynamic rope): three sessions with prompts of different lengths decode together through
`LayeredStack.decode_batch`, and every row equals the same session's solo step; each row
attends over its own cache where it lies (no history copied).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hearthnet.distributed_inference.engine import attention
from hearthnet.distributed_inference.engine.kv_cache import SegmentsKV
from hearthnet.distributed_inference.engine.layers import LayeredStack
from hearthnet.errors import BadRequest
from tests.helpers.tiny_models import FAMILIES

PROMPTS = [9, 3, 14]  # positions per session: shorter and longer than the sliding windows
DECODE = 6


@pytest.fixture(scope="module")
def family_store(family_models):
    return family_models[1]


def _inputs(seed: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, n, 64, generator=g)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_batched_rows_equal_solo_steps(family, family_store):
    stack = LayeredStack(family_store[family], 1, 4)
    solo = [stack.open_session(1, 4, 32) for _ in PROMPTS]
    batch = [stack.open_session(1, 4, 32) for _ in PROMPTS]
    for i, n in enumerate(PROMPTS):
        x = _inputs(i, n)
        torch.testing.assert_close(solo[i].forward(x, 0), batch[i].forward(x, 0))
    for t in range(DECODE):
        xs = [_inputs(100 + 10 * t + i, 1) for i in range(len(PROMPTS))]
        starts = [n + t for n in PROMPTS]
        want = torch.cat([s.forward(x, p) for s, x, p in zip(solo, xs, starts, strict=True)])
        got = stack.decode_batch(batch, xs, starts)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert [s.length for s in batch] == [n + DECODE for n in PROMPTS]


@pytest.mark.parametrize("family", ["gemma3", "gemma2"])  # sdpa; eager soft-capping
def test_batched_rows_read_their_own_caches_in_place(family, family_store, monkeypatch):
    """No history is gathered, padded or copied: the keys every row attends over are a
    view of its own session's slot holding just the positions it may see (a sliding
    window is a shorter view of it)."""
    stack = LayeredStack(family_store[family], 0, 3)
    sessions = [stack.open_session(0, 3, 32) for _ in PROMPTS]
    for i, (s, n) in enumerate(zip(sessions, PROMPTS, strict=True)):
        s.forward(_inputs(i, n), 0)
    seen: list[tuple[int, int, int]] = []
    real = SegmentsKV.histories

    def spy(self: SegmentsKV, layer_idx: int) -> Any:
        got = real(self, layer_idx)
        seen.extend((layer_idx, k.untyped_storage().data_ptr(), int(k.shape[2]))
                    for k, _, _ in got)
        return got

    monkeypatch.setattr(SegmentsKV, "histories", spy)
    stack.decode_batch(sessions, [_inputs(50 + i, 1) for i in range(len(PROMPTS))], PROMPTS)
    window = stack.sliding_window
    assert window is not None and any(n + 1 > window for n in PROMPTS)
    assert seen == [(layer, s.slot.keys[layer].untyped_storage().data_ptr(),
                     min(n + 1, window) if kind == "sliding_attention" else n + 1)
                    for layer, kind in enumerate(stack.layer_types[:4])
                    for s, n in zip(sessions, PROMPTS, strict=True)]


def test_one_query_of_a_gqa_family_equals_transformers_sdpa(family_store):
    """A decode query's heads grouped under their key/value head (the CPU's faster path)
    give transformers' own sdpa result."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    stack = LayeredStack(family_store["llama"], 0, 0)
    module = stack.layers[0].self_attn
    assert module.num_key_value_groups == 2
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 1, 16, generator=g)
    k, v = (torch.randn(1, 2, 40, 16, generator=g)[:, :, :23] for _ in range(2))
    want, _ = sdpa_attention_forward(module, q, k, v, None, scaling=module.scaling)
    got, _ = attention.one_session(module, q, k, v, None, scaling=module.scaling)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_batch_redo_rewinds_each_row(family_store):
    """A row redone at an earlier position (failover replay) is cut back like a solo step."""
    stack = LayeredStack(family_store["llama"], 0, 2)
    a, b, ref = (stack.open_session(0, 2, 16) for _ in range(3))
    for s in (a, b, ref):
        s.forward(_inputs(1, 5), 0)
    stack.decode_batch([a, b], [_inputs(2, 1), _inputs(3, 1)], [5, 5])
    x = _inputs(4, 1)
    got = stack.decode_batch([a, b], [x, x], [5, 6])  # a redoes 5, b goes on to 6
    torch.testing.assert_close(got[0:1], ref.forward(x, 5), rtol=1e-5, atol=1e-5)
    assert (a.length, b.length) == (6, 7)


def test_batch_refuses_mixed_ranges_and_gaps(family_store):
    stack = LayeredStack(family_store["llama"], 0, 3)
    a, b = stack.open_session(0, 3, 16), stack.open_session(1, 3, 16)
    with pytest.raises(BadRequest):
        stack.decode_batch([a, b], [_inputs(0, 1)] * 2, [0, 0])
    with pytest.raises(BadRequest):  # position 3 of an empty session is a gap
        stack.decode_batch([a, stack.open_session(0, 3, 16)], [_inputs(0, 1)] * 2, [0, 3])


@pytest.mark.parametrize(("family", "weights"), [("llama", "fp32"), ("gemma2", "fp32"),
                                                 ("qwen3", "int8")])
def test_head_batch_equals_each_chats_own_logits(family, weights, family_store):
    """Issue 16 §3: several chats' norm + lm_head as one product, each row its own logits
    (Gemma-2's soft-capping, an untied lm_head, an int8 head)."""
    from hearthnet.distributed_inference.engine.head import LayeredHead

    head = LayeredHead(family_store[family], weights)
    hidden = [_inputs(1, 5), _inputs(2, 1), _inputs(3, 2)]  # a prefill's last position too
    got = head.logits_batch(hidden)
    assert len(got) == 3
    for g, h in zip(got, hidden, strict=True):
        torch.testing.assert_close(g, head.logits(h), rtol=1e-5, atol=1e-5)
        assert g.shape == (head.config.vocab_size,) and g.dtype == torch.float32


# mixed rounds (issue 16 §1): (history already held, positions of this step) per session —
# decode rows, a fresh prefill, and a prefill chunk continuing an existing history, around
# and beyond the sliding windows (4-7 positions in the tiny families)
PACKED = [(9, 1), (0, 6), (3, 5), (12, 1)]


def _slot_equal(a: Any, b: Any, n: int) -> None:
    for ka, kb, va, vb in zip(a.slot.keys, b.slot.keys, a.slot.values, b.slot.values,
                              strict=True):
        torch.testing.assert_close(ka[:, :, :n], kb[:, :, :n], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(va[:, :, :n], vb[:, :, :n], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_packed_rows_equal_solo_steps(family, family_store):
    """Decode rows and prefill chunks of four sessions as one packed forward: each
    session's output and cache equal its own solo steps."""
    stack = LayeredStack(family_store[family], 1, 4)
    solo = [stack.open_session(1, 4, 32) for _ in PACKED]
    packed = [stack.open_session(1, 4, 32) for _ in PACKED]
    for i, (held, _) in enumerate(PACKED):
        if held:
            x = _inputs(i, held)
            solo[i].forward(x, 0)
            packed[i].forward(x, 0)
    xs = [_inputs(50 + i, n) for i, (_, n) in enumerate(PACKED)]
    starts = [held for held, _ in PACKED]
    got = stack.forward_packed(packed, xs, starts)
    for i, (held, n) in enumerate(PACKED):
        want = solo[i].forward(xs[i], held)
        assert got[i].shape == (1, n, 64)
        torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-5)
        assert packed[i].length == held + n
        _slot_equal(packed[i], solo[i], held + n)
    # and the sessions go on decoding from their packed caches as from solo ones
    for i, (held, n) in enumerate(PACKED):
        x = _inputs(90 + i, 1)
        torch.testing.assert_close(packed[i].forward(x, held + n), solo[i].forward(x, held + n),
                                   rtol=1e-5, atol=1e-5)


def test_packed_forward_refuses_bad_rows(family_store):
    """A wrong shape, a gap, or one session twice is a `BadRequest` before any work."""
    stack = LayeredStack(family_store["llama"], 0, 3)
    a, b = stack.open_session(0, 3, 16), stack.open_session(0, 3, 16)
    a.forward(_inputs(0, 3), 0)
    for xs, starts, sessions in [([_inputs(1, 1), torch.zeros(1, 2, 65)], [3, 0], [a, b]),
                                 ([_inputs(1, 1), _inputs(2, 2)], [3, 1], [a, b]),
                                 ([_inputs(1, 1), _inputs(2, 2)], [3, 3], [a, a])]:
        with pytest.raises(BadRequest):
            stack.forward_packed(sessions, xs, starts)
    assert (a.length, b.length) == (3, 0)
