"""Checks for stage 03: the causal mask with offset, left padding, the batch mask.

Expected masks and batches are rebuilt here from their rules, one entry at a time where that
makes the rule obvious, over several shapes: square (prefill), fewer queries than keys (a chunk
after a cache), one query (decode), and batches of several sequences with random padding.
"""

from __future__ import annotations

import torch

from aie_lessons.checks.common import call, causal_reference, expect_shape, fail, isolated, passed

# (q_len, kv_len): prefill, chunks after cached keys, decode
CAUSAL_SHAPES = ((4, 4), (2, 5), (1, 6), (3, 9), (1, 1), (7, 7))
DEVICE_HINT = ("the check passed is_real on the 'meta' device (a GPU in later stages): create every "
               "tensor on is_real's device (torch.arange(..., device=is_real.device))")


def check_causal_mask(causal_mask) -> None:
    """3.1: the bottom-right-aligned triangle for 6 shapes (prefill, chunks, decode), boolean, on
    the device asked for; the inverted, diagonal-masked and top-left triangles are named."""
    for q_len, kv_len in CAUSAL_SHAPES:
        got = call("3.1", causal_mask, q_len, kv_len)
        expect_shape("3.1", f"causal_mask({q_len}, {kv_len})", got, (q_len, kv_len))
        if got.dtype != torch.bool:
            fail("3.1", f"the mask has dtype {got.dtype}: return a boolean mask (True = may attend)")
        expected = causal_reference(q_len, kv_len)
        if torch.equal(got, expected):
            continue
        masked_diagonal = causal_reference(q_len, kv_len, offset=kv_len - q_len - 1)
        if torch.equal(got, ~expected) or torch.equal(got, ~masked_diagonal):
            fail("3.1", "the mask is inverted: True must be on and below the diagonal (the past "
                        "and the present), False above it (the future)")
        if torch.equal(got, masked_diagonal):
            fail("3.1", "the diagonal is masked: a query must see its own position")
        if torch.equal(got, causal_reference(q_len, kv_len, offset=0)):
            fail("3.1", f"for {q_len} queries over {kv_len} keys the diagonal is aligned to the "
                        "top-left; the queries are the *last* positions, so query i sits at "
                        "position kv_len − q_len + i: align the diagonal to the bottom-right")
        fail("3.1", f"causal_mask({q_len}, {kv_len}) should be {expected.int().tolist()}, "
                    f"got {got.int().tolist()}")
    got = call("3.1", causal_mask, 2, 3, "meta")
    if got.device.type != "meta":
        fail("3.1", f"causal_mask(2, 3, device) returned a mask on {got.device}: create it on the "
                    "device asked for (the model's, a GPU in later stages)")
    passed("3.1", f"causal masks for {len(CAUSAL_SHAPES)} shapes: prefill, chunks after a cache, decode")


LEFT_PAD_PROMPTS = [[5, 6, 7], [8], [9, 10]]


def _random_sequences(g: torch.Generator) -> list[list[int]]:
    """4 prompts of random lengths 1–6 (seeded): shapes no hand-written case thought of."""
    lengths = torch.randint(1, 7, (4,), generator=g).tolist()
    return [torch.randint(1, 100, (n,), generator=g).tolist() for n in lengths]


def _expected_batch(sequences: list[list[int]], pad_id: int):
    """ids, real flags and positions as lists, written from the rules one row at a time."""
    width = max(map(len, sequences))
    ids = [[pad_id] * (width - len(s)) + s for s in sequences]
    real = [[False] * (width - len(s)) + [True] * len(s) for s in sequences]
    positions = [[0] * (width - len(s)) + list(range(len(s))) for s in sequences]
    return ids, real, positions


def check_left_pad(left_pad) -> None:
    """3.2: ids, real flags and positions of 4 batches (one given, two random, one unpadded), the
    positions as integers (they index RoPE's tables), and every tensor on the device asked for.
    Right padding, positions that count the padding, start at 1 or go negative are named."""
    g = torch.Generator().manual_seed(3)
    for sequences in (LEFT_PAD_PROMPTS, _random_sequences(g), _random_sequences(g), [[4, 4]]):
        width = max(map(len, sequences))
        batch = call("3.2", left_pad, sequences, 0)
        for name in ("input_ids", "is_real", "positions"):
            expect_shape("3.2", name, getattr(batch, name), (len(sequences), width))
        ids, real, positions = _expected_batch(sequences, 0)
        got_ids, got_positions = batch.input_ids.tolist(), batch.positions.tolist()
        if got_ids != ids:
            if got_ids == [s + [0] * (width - len(s)) for s in sequences]:
                fail("3.2", "you padded on the right: pad on the left so that every sequence ends in "
                            "the last column, where its next token is predicted")
            fail("3.2", f"input_ids for {sequences} should be {ids}, got {got_ids}")
        if batch.is_real.dtype != torch.bool or batch.is_real.tolist() != real:
            fail("3.2", f"is_real should be a bool tensor, True exactly on the real tokens: {real}, "
                        f"got {batch.is_real.tolist()}")
        if batch.positions.dtype != torch.long:
            fail("3.2", f"positions have dtype {batch.positions.dtype}: they are integers (torch.long), "
                        "the indices of RoPE's tables; count the real flags as integers")
        if got_positions == positions:
            continue
        if got_positions == [list(range(width))] * len(sequences) and width > min(map(len, sequences)):
            fail("3.2", "positions count the padding: the first *real* token of every prompt must "
                        "be position 0, so that it is numbered as when it runs alone")
        if min(min(row) for row in got_positions) < 0:
            fail("3.2", "padding has negative positions: floor them at 0 (they are masked anyway, "
                        "but RoPE tables are indexed by position)")
        fail("3.2", f"real tokens should be numbered 0, 1, 2, ... in each row: for {sequences} "
                    f"positions should be {positions}, got {got_positions}")
    batch = call("3.2", left_pad, LEFT_PAD_PROMPTS, 0, "meta")
    devices = {name: getattr(batch, name).device.type for name in ("input_ids", "is_real", "positions")}
    if set(devices.values()) != {"meta"}:
        fail("3.2", f"left_pad(..., device='meta') returned tensors on {devices}: put all three on "
                    "the device asked for (the model's)")
    passed("3.2", "left padding, real flags and integer per-sequence positions for 4 batches, on the "
                  "device asked for")


def _expected_mask(is_real: torch.Tensor, q_len: int) -> torch.Tensor:
    """(B, 1, S, T) from the rules, entry by entry."""
    batch, kv_len = is_real.shape
    offset = kv_len - q_len
    return torch.tensor([[[
        [(j <= i + offset and bool(is_real[b, j])) or j == i + offset for j in range(kv_len)]
        for i in range(q_len)]] for b in range(batch)])


def _mask_difference(got: torch.Tensor, expected: torch.Tensor) -> str:
    """Where two (B, 1, S, T) masks differ, in one short line: the first entry and the counts."""
    wrong = (got != expected)[:, 0]
    b, i, j = (int(x) for x in wrong.nonzero()[0])
    return (f"{int(wrong.sum())} of {wrong.numel()} entries differ, the first at row b={b}, query "
            f"i={i}, key j={j}: expected {bool(expected[b, 0, i, j])}, got {bool(got[b, 0, i, j])} "
            f"({int((got & ~expected).sum())} keys visible that should be masked, "
            f"{int((~got & expected).sum())} masked that should be visible)")


def check_attention_mask(attention_mask) -> None:
    """3.3: causal ∧ real keys ∨ the query's own position, for 4 batches (prefill, a chunk after
    cached keys, decode, random padding), boolean (B, 1, S, T), on is_real's device.

    3.1 is replaced by a reference while it runs, so that only 3.3's mistakes fail it.
    """
    g = torch.Generator().manual_seed(4)
    first_real = torch.tensor([0, 2, 5, 1])  # three of four rows padded, one mostly padding
    is_real = torch.arange(7)[None, :] >= first_real[:, None]
    cases = [(is_real, 7, "prefill"), (is_real, 3, "3 queries after 4 cached keys"),
             (is_real, 1, "decode: 1 query"),
             (torch.rand(3, 6, generator=g) > 0.3, 2, "random padding, 2 queries")]
    cases[-1][0][:, -2:] = True  # the queries' own tokens are real

    for real, q_len, where in cases:
        batch, kv_len = real.shape
        with isolated(attention_mask, causal_mask=causal_reference):
            got = call("3.3", attention_mask, real, q_len)
        expect_shape("3.3", f"the mask ({where})", got, (batch, 1, q_len, kv_len))
        if got.dtype != torch.bool:
            fail("3.3", f"the mask has dtype {got.dtype}: return a boolean mask (True = may attend)")
        expected = _expected_mask(real, q_len)
        if torch.equal(got, expected):
            continue
        causal = causal_reference(q_len, kv_len)
        without_self = (causal[None] & real[:, None, :])[:, None]
        if torch.equal(got, without_self):
            fail("3.3", "a padding query sees no key at all, so its softmax row is empty (NaN "
                        "that spreads to other positions). Let every query see itself")
        if torch.equal(got, causal[None, None].expand_as(got)):
            fail("3.3", "padding keys are visible: AND the causal mask with is_real over the keys")
        if torch.equal(got, (real[:, None, :] | torch.eye(kv_len, dtype=torch.bool)[-q_len:])[:, None]
                       .expand_as(got)):
            fail("3.3", f"future keys are visible ({where}): the mask must also be causal")
        top_left_self = torch.eye(q_len, kv_len, dtype=torch.bool)
        if torch.equal(got, (without_self | top_left_self)):
            fail("3.3", f"the query's own key is in the wrong column ({where}): the queries are "
                        "the last q_len positions, so query i's own key is column T − q_len + i")
        fail("3.3", f"for {where} the mask is wrong: {_mask_difference(got, expected)}")
    with isolated(attention_mask, causal_mask=causal_reference):
        got = call("3.3", attention_mask, is_real.to("meta"), 3, hint=DEVICE_HINT)
    if got.device.type != "meta":
        fail("3.3", f"for is_real on the 'meta' device the mask came back on {got.device}: "
                    "create it on is_real's device")
    passed("3.3", "causal ∧ real keys, every query sees itself, for 4 batches: prefill, a chunk "
                  "after cached keys, decode, random padding; on is_real's device")
