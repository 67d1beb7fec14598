"""Checks for stage 03: the causal mask with offset, left padding, the batch mask."""

from __future__ import annotations

import torch

from aie_lessons.checks.common import call, expect_shape, fail, isolated, passed


def _tril(q_len: int, kv_len: int, diagonal: int) -> torch.Tensor:
    return torch.ones(q_len, kv_len, dtype=torch.bool).tril(diagonal)


def check_causal_mask(causal_mask) -> None:
    for q_len, kv_len in ((4, 4), (2, 5), (1, 6)):
        got = call("3.1", causal_mask, q_len, kv_len)
        expect_shape("3.1", f"causal_mask({q_len}, {kv_len})", got, (q_len, kv_len))
        if got.dtype != torch.bool:
            fail("3.1", f"the mask has dtype {got.dtype}: return a boolean mask (True = may attend)")
        expected = _tril(q_len, kv_len, kv_len - q_len)
        if torch.equal(got, expected):
            continue
        if torch.equal(got, ~expected) or torch.equal(got, torch.ones_like(got).triu(kv_len - q_len + 1)):
            fail("3.1", "the mask is inverted: True must be on and below the diagonal (the past "
                        "and the present), False above it (the future)")
        if torch.equal(got, _tril(q_len, kv_len, kv_len - q_len - 1)):
            fail("3.1", "the diagonal is masked: a query must see its own position")
        if torch.equal(got, _tril(q_len, kv_len, 0)):
            fail("3.1", f"for {q_len} queries over {kv_len} keys the diagonal is aligned to the "
                        "top-left; the queries are the *last* positions, so align it to the "
                        "bottom-right: tril(kv_len - q_len)")
        fail("3.1", f"causal_mask({q_len}, {kv_len}) should be {expected.int().tolist()}, "
                    f"got {got.int().tolist()}")
    passed("3.1", "causal masks for square, offset and single-query (decode) shapes")


LEFT_PAD_PROMPTS = [[5, 6, 7], [8], [9, 10]]


def check_left_pad(left_pad) -> None:
    batch = call("3.2", left_pad, LEFT_PAD_PROMPTS, 0)
    for name in ("input_ids", "is_real", "positions"):
        expect_shape("3.2", name, getattr(batch, name), (3, 3))
    ids = batch.input_ids.tolist()
    if ids == [[5, 6, 7], [8, 0, 0], [9, 10, 0]]:
        fail("3.2", "you padded on the right: pad on the left so that every sequence ends in "
                    "the last column, where its next token is predicted")
    if ids != [[5, 6, 7], [0, 0, 8], [0, 9, 10]]:
        fail("3.2", f"input_ids should be [[5, 6, 7], [0, 0, 8], [0, 9, 10]], got {ids}")
    if batch.is_real.tolist() != [[True] * 3, [False, False, True], [False, True, True]]:
        fail("3.2", f"is_real should be True exactly on the real tokens, got {batch.is_real.tolist()}")
    positions = batch.positions.tolist()
    if positions == [[0, 1, 2]] * 3:
        fail("3.2", "positions count the padding: the first *real* token of every prompt must "
                    "be position 0 (cumulative sum of is_real, minus 1)")
    if positions[0] != [0, 1, 2] or positions[1][2] != 0 or positions[2][1:] != [0, 1]:
        fail("3.2", f"real tokens should be numbered 0, 1, 2, ... in each row, got {positions}")
    if min(min(row) for row in positions) < 0:
        fail("3.2", "padding has negative positions: clamp them at 0 (they are masked anyway, "
                    "but RoPE tables are indexed by position)")
    passed("3.2", "left padding with positions that ignore the padding")


def check_attention_mask(attention_mask) -> None:
    is_real = torch.tensor([[True, True, True, True], [False, False, True, True]])

    def reference_causal(q_len, kv_len, device=None):
        return _tril(q_len, kv_len, kv_len - q_len).to(device)

    with isolated(attention_mask, causal_mask=reference_causal):
        got = call("3.3", attention_mask, is_real, 4)
        decode = call("3.3", attention_mask, is_real, 1)
    expect_shape("3.3", "the mask", got, (2, 1, 4, 4))
    causal = _tril(4, 4, 0)
    expected = causal[None] & is_real[:, None, :]
    expected |= torch.eye(4, dtype=torch.bool)[None]
    expected = expected[:, None]
    if not torch.equal(got, expected):
        without_self = (causal[None] & is_real[:, None, :])[:, None]
        if torch.equal(got, without_self):
            fail("3.3", "a padding query sees no key at all, so its softmax row is empty (NaN "
                        "that spreads to other positions). Let every query see itself")
        if torch.equal(got, causal[None, None].expand(2, 1, 4, 4)):
            fail("3.3", "padding keys are visible: AND the causal mask with is_real over the keys")
        if torch.equal(got[1, 0, 2:], torch.tensor([[False, False, True, True]] * 2)):
            fail("3.3", "future keys are visible: the mask must also be causal")
        fail("3.3", f"mask of the padded row should be {expected[1, 0].int().tolist()}, "
                    f"got {got[1, 0].int().tolist()}")
    expect_shape("3.3", "the mask for one new query", decode, (2, 1, 1, 4))
    if not torch.equal(decode[:, 0, 0], is_real):
        fail("3.3", "with one new query (decoding with a cache) it may see every real key: "
                    "the causal part must be offset to the last position")
    passed("3.3", "causal ∧ real keys, every query sees itself, works for decode shapes")
