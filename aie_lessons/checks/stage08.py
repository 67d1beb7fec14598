"""Checks for stage 08: int8 per-row quantization, int4 nibble packing, group-wise int4.

Expected integers and scales are rebuilt here from the published rules (symmetric absmax
scaling, round half to even as ``torch.round`` does, an offset of 8 for nibbles, the even column
in the low bits) on random matrices of several shapes and dtypes, with an all-zero row and an
all-zero group among them. When a result is wrong the checks try the usual wrong answers
(a scale per column, truncation towards zero, a forgotten offset, swapped nibbles) to name it.
"""

from __future__ import annotations

import torch

from aie_lessons.checks.common import CheckFailed, call, expect_shape, fail, isolated, passed, random_model

SHAPES = ((4, 8), (7, 16), (3, 64), (16, 32))
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _weights(g: torch.Generator, rows: int, columns: int, dtype: torch.dtype) -> torch.Tensor:
    """Random weights with rows of very different ranges, and row 1 all zeros."""
    w = torch.randn(rows, columns, generator=g) * torch.logspace(-2, 0, rows)[:, None]
    w[1] = 0
    return w.to(dtype)


def _int8_reference(w: torch.Tensor, *, trunc: bool = False):
    w = w.float()
    scale = w.abs().amax(dim=1) / 127
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    ratio = w / scale[:, None]
    q = (torch.trunc(ratio) if trunc else torch.round(ratio)).clamp(-127, 127).to(torch.int8)
    return q, scale


def check_quantize_int8(quantize_int8, dequantize_int8) -> None:
    """8.1: q and scales against the rule for 4 shapes × 3 dtypes, with a zero row; the error of
    every weight at most half its row's step."""
    g = torch.Generator().manual_seed(8)
    for rows, columns in SHAPES:
        for dtype in DTYPES:
            w = _weights(g, rows, columns, dtype)
            got = call("8.1", quantize_int8, w)
            if not (isinstance(got, tuple) and len(got) == 2):
                fail("8.1", f"quantize_int8 returned {type(got).__name__}: return the pair (q, scale)")
            q, scale = got
            expect_shape("8.1", "q", q, (rows, columns))
            if q.dtype != torch.int8:
                fail("8.1", f"q has dtype {q.dtype}: store it as torch.int8 (one byte per weight)")
            if isinstance(scale, torch.Tensor) and tuple(scale.shape) == (columns,) and rows != columns:
                fail("8.1", f"scale has shape ({columns},), one per column (input): each output row "
                            f"needs its own scale, shape ({rows},) — take the maximum over dim 1")
            expect_shape("8.1", "scale", scale, (rows,))
            if scale.dtype != torch.float32:
                fail("8.1", f"scale has dtype {scale.dtype}: keep scales in float32")
            if not torch.isfinite(scale).all() or (scale == 0).any():
                fail("8.1", "an all-zero row got a zero (or non-finite) scale, so w / scale is 0 / 0: "
                            "give such a row any non-zero scale, e.g. 1")
            want_q, want_scale = _int8_reference(w)
            varied = w.float().abs().amax(dim=1) > 0  # an all-zero row may take any non-zero scale
            if not torch.allclose(scale[varied], want_scale[varied], rtol=1e-6, atol=0):
                row = int((~torch.isclose(scale, want_scale, rtol=1e-6, atol=0) & varied).nonzero()[0])
                low_precision = (w.abs().amax(dim=1) / 127).float()
                if dtype != torch.float32 and torch.allclose(scale[varied], low_precision[varied], rtol=1e-6, atol=0):
                    fail("8.1", f"the scales were computed in {dtype}, which rounds them: convert the weight "
                                "with .float() first, then compute the scale")
                fail("8.1", f"for a {dtype} matrix {rows}×{columns}, row {row}'s scale is {scale[row].item():.6g}, "
                            f"expected {want_scale[row].item():.6g}: scale = the row's largest |w| / 127")
            # Nearest means within half a step; at an exact half either neighbour is nearest.
            ratio = w.float() / scale[:, None]
            off = (q.float() - ratio).abs() > 0.5 + 1e-4
            if off.any():
                if torch.equal(q, _int8_reference(w, trunc=True)[0]):
                    fail("8.1", "q is truncated towards zero (.to(torch.int8) cuts off the fraction): "
                                "round to the nearest integer first, with torch.round")
                r, c = (int(i) for i in off.nonzero()[0])
                fail("8.1", f"q[{r}, {c}] is {q[r, c].item()}, but w / scale there is {ratio[r, c].item():.3f}: "
                            "q must be the nearest integer to w / (its row's scale)")
            back = call("8.1", dequantize_int8, q, scale)
            if (back - w.float()).abs().gt(scale[:, None] / 2 + 1e-6).any():
                fail("8.1", "dequantize_int8(q, scale) is further from w than half a step somewhere")
    passed("8.1", f"q and one scale per row for {len(SHAPES)} shapes in fp32, bf16 and fp16, an all-zero "
                  "row included; every weight within half a step")


def _pack_reference(q: torch.Tensor, *, offset: int = 8, even_low: bool = True) -> torch.Tensor:
    u = (q.to(torch.int16) + offset).to(torch.uint8)
    low, high = (u[..., 0::2], u[..., 1::2]) if even_low else (u[..., 1::2], u[..., 0::2])
    return low | (high << 4)


def _unpack_reference(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2).to(torch.int8) - 8


def _nibbles(g: torch.Generator, rows: int, columns: int) -> torch.Tensor:
    """Random values −8 … 7; with 16 or more entries, every value appears."""
    q = torch.randint(-8, 8, (rows, columns), generator=g, dtype=torch.int8)
    n = min(16, q.numel())
    q.view(-1)[:n] = torch.arange(-8, -8 + n, dtype=torch.int8)
    return q


def check_pack_int4(pack_int4) -> None:
    """8.2: the bytes of the worked example, then random values of 3 shapes, byte for byte."""
    example = torch.tensor([[-3, 5, 7, -8]], dtype=torch.int8)
    got = call("8.2", pack_int4, example)
    expect_shape("8.2", "pack_int4 of a (1, 4) tensor", got, (1, 2))
    if got.dtype != torch.uint8:
        fail("8.2", f"the packed tensor has dtype {got.dtype}: return torch.uint8 (0 … 255, two nibbles)")
    g = torch.Generator().manual_seed(9)
    for rows, columns in ((1, 4), (4, 16), (3, 32)):
        q = example if columns == 4 else _nibbles(g, rows, columns)
        got = call("8.2", pack_int4, q)
        expect_shape("8.2", f"pack_int4 of a ({rows}, {columns}) tensor", got, (rows, columns // 2))
        want = _pack_reference(q)
        if torch.equal(got, want):
            continue
        if torch.equal(got, _pack_reference(q, even_low=False)):
            fail("8.2", "the nibbles are swapped: the even column goes in the low four bits, the odd "
                        "column in the high four (byte = even | odd << 4)")
        if torch.equal(got, _pack_reference(q, offset=0)):
            fail("8.2", "the offset of 8 is missing: a negative value's bits spill into the other "
                        "nibble; add 8 to every value first, so each lies in 0 … 15")
        fail("8.2", f"pack_int4({q[:1, :4].tolist()}…) gave {got[:1, :2].tolist()}…, expected "
                    f"{want[:1, :2].tolist()}…")
    passed("8.2", "two values per byte, offset by 8, the even column in the low nibble; [−3, 5, 7, −8] "
                  "→ [213, 15]")


def check_unpack_int4(unpack_int4) -> None:
    """8.3: the inverse of the reference packing, for every value and 3 shapes."""
    g = torch.Generator().manual_seed(10)
    for rows, columns in ((1, 4), (4, 16), (3, 32)):
        q = _nibbles(g, rows, columns)
        got = call("8.3", unpack_int4, _pack_reference(q))
        expect_shape("8.3", f"unpack_int4 of a ({rows}, {columns // 2}) tensor", got, (rows, columns))
        if got.dtype != torch.int8:
            fail("8.3", f"the values have dtype {got.dtype}: return torch.int8")
        if torch.equal(got, q):
            continue
        if torch.equal(got.to(torch.int16), q.to(torch.int16) + 8):
            fail("8.3", "the values are still offset by 8 (0 … 15): subtract 8 to get −8 … 7 back")
        swapped = q.view(rows, -1, 2).flip(-1).reshape(rows, columns)
        if torch.equal(got, swapped):
            fail("8.3", "each pair comes back swapped: the low nibble is the even column, the high "
                        "nibble the odd one")
        packed = _pack_reference(q)
        if torch.equal(got.to(torch.int16), torch.cat([packed & 15, packed >> 4], dim=-1).to(torch.int16) - 8):
            fail("8.3", "the low nibbles come back as the first half of each row and the high ones as the "
                        "second: interleave them instead (low, high, low, high, …), e.g. stack on a new last "
                        "dimension, then flatten")
        r, c = (int(i) for i in (got != q).nonzero()[0])
        hint = (" (an int8 byte ≥ 128 is negative, and >> then shifts in ones: shift the uint8 bytes "
                "before converting)" if c % 2 and got[r, c].item() < -8 else "")
        fail("8.3", f"value [{r}, {c}] came back as {got[r, c].item()}, expected {q[r, c].item()}{hint}")
    passed("8.3", "every value −8 … 7 comes back in its column")


def _int4_reference(w: torch.Tensor, group_size: int, *, trunc: bool = False, levels: int = 15):
    """(q, scales, zeros) by the rule: per group, the range min … max onto the levels."""
    rows, columns = w.shape
    groups = w.float().reshape(rows, columns // group_size, group_size)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scales = (high - low) / levels
    scales = torch.where(scales == 0, torch.ones_like(scales), scales)
    ratio = (groups - low[..., None]) / scales[..., None]
    q = ((torch.trunc(ratio) if trunc else torch.round(ratio)) - 8).clamp(-8, 7).to(torch.int8)
    return q.reshape(rows, columns), scales, low + 8 * scales


def check_quantize_int4(quantize_int4, dequantize_int4) -> None:
    """8.4: packed values, scales and zeros for group sizes 8, 16 and 32 and 3 dtypes, with a
    group of equal weights; dequantized, every weight within half a step of its group. The
    learner's pack_int4 and unpack_int4 are swapped for the reference (8.2 and 8.3 check them)."""
    g = torch.Generator().manual_seed(11)
    with isolated(quantize_int4, pack_int4=_pack_reference), isolated(dequantize_int4, unpack_int4=_unpack_reference):
        for group_size in (8, 16, 32):
            for dtype in DTYPES:
                w = _weights(g, 5, 64, dtype)
                w[2, group_size:2 * group_size] = 0.25  # a group of equal weights in a non-zero row
                got = call("8.4", quantize_int4, w, group_size)
                if not (isinstance(got, tuple) and len(got) == 3):
                    fail("8.4", f"quantize_int4 returned {type(got).__name__} of {len(got) if isinstance(got, tuple) else 1}: "
                                "return (packed, scales, zeros)")
                packed, scales, zeros = got
                groups = 64 // group_size
                if isinstance(scales, torch.Tensor) and tuple(scales.shape) in ((5,), (5, 1)):
                    fail("8.4", "one scale per row: int4 needs one per group of group_size weights, "
                                f"scales of shape (rows, columns / group_size) = (5, {groups})")
                expect_shape("8.4", "scales", scales, (5, groups))
                expect_shape("8.4", "zeros", zeros, (5, groups))
                expect_shape("8.4", "packed", packed, (5, 32))
                for name, value in (("scales", scales), ("zeros", zeros)):
                    if value.dtype != torch.float32:
                        fail("8.4", f"{name} have dtype {value.dtype}: compute and keep them in float32 "
                                    "(convert the weight with .float() first)")
                if not torch.isfinite(scales).all() or (scales == 0).any():
                    fail("8.4", "a group of equal weights (max − min = 0) got a zero (or non-finite) "
                                "scale: give it any non-zero scale, e.g. 1")
                want_q, want_scales, want_zeros = _int4_reference(w, group_size)
                grouped = w.float().reshape(5, groups, group_size)
                low = grouped.amin(dim=-1)
                varied = grouped.amax(dim=-1) > low  # a group of equal weights may take any non-zero scale
                differs = ~torch.isclose(scales.float(), want_scales, rtol=1e-5, atol=0) & varied
                if differs.any():
                    if torch.allclose(scales.float()[varied], _int4_reference(w, group_size, levels=16)[1][varied],
                                      rtol=1e-5, atol=0):
                        fail("8.4", "the scale divides the range by 16: 16 levels are 15 steps apart, "
                                    "so scale = (max − min) / 15")
                    absmax = grouped.abs().amax(dim=-1)
                    if any(torch.allclose(scales.float()[varied], (absmax / d)[varied], rtol=1e-5, atol=0)
                           for d in (7, 7.5, 8)):
                        fail("8.4", "the scale comes from the group's largest magnitude: that is the "
                                    "symmetric grid. Map the group's own range min … max onto the 16 levels: "
                                    "scale = (max − min) / 15")
                    r, k = (int(i) for i in differs.nonzero()[0])
                    fail("8.4", f"groups of {group_size}: group {k} of row {r} has scale {scales[r, k].item():.6g}, "
                                f"expected {want_scales[r, k].item():.6g} = (the group's max − its min) / 15")
                differs = ~torch.isclose(zeros.float(), want_zeros, rtol=1e-5, atol=1e-6) & varied
                if differs.any():
                    r, k = (int(i) for i in differs.nonzero()[0])
                    fail("8.4", f"groups of {group_size}: group {k} of row {r} has zero {zeros[r, k].item():.6g}, "
                                f"expected {want_zeros[r, k].item():.6g} = min + 8 × scale (a float: the weight "
                                "that q = 0 stands for), so that w ≈ q × scale + zero with q in −8 … 7")
                q = _unpack_reference(packed).float().reshape(5, groups, group_size)
                levels = (grouped - low[..., None]) / scales.float()[..., None]
                off = ((q + 8 - levels).abs() > 0.5 + 1e-4) & varied[..., None]
                if off.any():
                    if torch.equal(packed, _pack_reference(_int4_reference(w, group_size, trunc=True)[0])):
                        fail("8.4", "the values are truncated towards zero: round to the nearest level")
                    if torch.equal(packed, _pack_reference(want_q + 8)):  # the levels 0 … 15, offset again
                        fail("8.4", "the levels 0 … 15 were packed as they are: subtract 8 first, so that "
                                    "q is in −8 … 7 as pack_int4 expects")
                    r, k, j = (int(i) for i in off.nonzero()[0])
                    fail("8.4", f"groups of {group_size} ({dtype}): weight {k * group_size + j} of row {r} was "
                                f"stored as q = {int(q[r, k, j])}, but (w − min) / scale − 8 there is "
                                f"{levels[r, k, j].item() - 8:.3f}: q must be the nearest level, minus 8")
                back = (q * scales.float()[..., None] + zeros.float()[..., None]).reshape(5, 64)
                too_far = (back - w.float()).abs() > scales.float().repeat_interleave(group_size, 1) / 2 + 1e-5
                if too_far.any():
                    r, c = (int(i) for i in too_far.nonzero()[0])
                    constant = not varied[r, c // group_size]
                    fail("8.4", f"weight {c} of row {r} ({w[r, c].item():.4g}) comes back as {back[r, c].item():.4g}"
                                + (": in a group of equal weights, compute the zero point after replacing the zero "
                                   "scale" if constant else ", more than half a step away"))
                got_back = call("8.4", dequantize_int4, packed, scales, zeros, group_size)
                if not torch.allclose(got_back, back, atol=1e-6):
                    fail("8.4", "dequantize_int4 does not give q × scale + zero")
    passed("8.4", "a scale and a zero per group (8, 16 and 32 wide) in fp32, bf16 and fp16, a group "
                  "of equal weights included; every weight within half a step")


# --- 8.5 the sensitivity loop ---------------------------------------------------------------------
class _ScoreFailed(BaseException):
    """The check's score raises this on purpose, to see that the model is restored anyway. A
    BaseException, like the KeyboardInterrupt of a learner stopping a long run: ``except
    Exception`` does not catch it, ``finally`` does."""


class _StandIn(torch.nn.Module):
    """What the learner's ``QuantizedLinear`` becomes while 8.5 is checked: a layer that only
    remembers its scheme. The real one runs the code of 8.1–8.4, and a mistake there must not
    fail 8.5."""

    def __init__(self, scheme) -> None:
        super().__init__()
        self.scheme = scheme

    @classmethod
    def quantize(cls, weight: torch.Tensor, scheme, kernels: bool = True) -> "_StandIn":
        return cls(scheme)


def check_sensitivity(sensitivity) -> None:
    """8.5: on a 3-block random model, with a score that records which layers are quantized at
    each call: every group alone, the change against the baseline, the original modules back
    (also when the score raises), the scheme passed in."""
    if "QuantizedLinear" not in getattr(sensitivity, "__globals__", {}):
        fail("8.5", "QuantizedLinear is not a name where sensitivity is defined: the check replaces it there "
                    "with a stand-in (so that 8.1–8.4 cannot fail 8.5). Fix: call QuantizedLinear.quantize(...) "
                    "by that name, as defined or imported next to your function")
    with isolated(sensitivity, QuantizedLinear=_StandIn):
        _check_sensitivity(sensitivity)


def _check_sensitivity(sensitivity) -> None:
    from aie_lessons.quantize import QuantScheme, block_linear_names

    model = random_model(3, torch.float32, tie=True, seed=85)
    names = block_linear_names(model)
    originals = {name: model.get_submodule(name) for name in names}
    scheme = QuantScheme("int4-g16", 4, 16)  # not one of SCHEMES: the loop must use the one given
    groups = {"block 2 attention": [n for n in names if n.startswith("layers.2.self_attn.")],
              "down_proj": [n for n in names if n.endswith("down_proj")],
              "block 0": [n for n in names if n.startswith("layers.0.")]}
    seen: list[set[str]] = []

    def score(m) -> float:
        quantized = {n for n in names if isinstance(m.get_submodule(n), _StandIn)}
        wrong = {n for n in quantized if m.get_submodule(n).scheme != scheme}
        if wrong:
            fail("8.5", f"{sorted(wrong)[0]} was quantized with {m.get_submodule(sorted(wrong)[0]).scheme.name}, "
                        f"not the scheme passed in ({scheme.name})")
        seen.append(quantized)
        return 10.0 + len(quantized)  # a score that grows with every quantized layer

    try:
        changes = call("8.5", sensitivity, model, groups, scheme, score)
    except CheckFailed as exc:
        if isinstance(exc.__cause__, CheckFailed):  # the score found the mistake: say it plainly
            raise exc.__cause__ from None
        if isinstance(exc.__cause__, AttributeError) and "weight" in str(exc.__cause__):
            fail("8.5", f"{exc.__cause__}: a layer was still quantized when a later group (they overlap "
                        "here) came to it, and quantizing it again failed: put each group's original "
                        "modules back before the next group")
        raise
    if not seen or seen[0]:
        fail("8.5", "the first score must be the baseline: score(model) before anything is quantized")
    for label, names_in_group in groups.items():
        matching = [s for s in seen[1:] if s == set(names_in_group)]
        if not matching:
            extra = [s - set(names_in_group) for s in seen[1:] if s >= set(names_in_group)]
            if extra:
                fail("8.5", f"while group {label!r} was scored, {sorted(extra[0])[0]} was quantized too: "
                            "put each group's original modules back before the next group")
            fail("8.5", f"no score saw exactly group {label!r}'s {len(names_in_group)} layers quantized "
                        f"(scores saw {[len(s) for s in seen[1:]]} quantized layers)")
    if not isinstance(changes, dict) or list(changes) != list(groups):
        fail("8.5", f"return a dict with one entry per group, in the groups' order {list(groups)}; "
                    f"got {list(changes) if isinstance(changes, dict) else type(changes).__name__}")
    for label, names_in_group in groups.items():
        want = float(len(names_in_group))
        if abs(changes[label] - want) > 1e-9:
            extra = (" (that is the score itself: subtract the baseline)" if abs(changes[label] - want - 10) < 1e-9
                     else " (the sign is flipped: the score with the group quantized, minus the baseline)"
                     if abs(changes[label] + want) < 1e-9 else "")
            fail("8.5", f"group {label!r}: the change should be score − baseline = {want:g}, got "
                        f"{changes[label]!r}{extra}")
    for name, layer in originals.items():
        if model.get_submodule(name) is not layer:
            fail("8.5", f"after the loop, {name} is a new {type(model.get_submodule(name)).__name__} object, "
                        "not the module that was there: put back the very modules you took out")

    calls = []

    def failing_score(m) -> float:
        calls.append(1)
        if len(calls) == 2:  # the first group's measurement fails
            raise _ScoreFailed("a measurement failed on purpose")
        return 1.0

    raised = None
    try:
        sensitivity(model, groups, scheme, failing_score)
    except _ScoreFailed as exc:  # what should happen: the score's error reaches the caller
        raised = exc
    except Exception as exc:  # the learner's code may raise anything; we report it
        fail("8.5", f"when score raised, your code raised {type(exc).__name__}: {exc} instead of letting "
                    "the score's error through")
    if raised is None:
        fail("8.5", "score raised an error, and sensitivity returned normally: let the error through "
                    "(after putting the modules back)")
    left = [name for name, layer in originals.items() if model.get_submodule(name) is not layer]
    if left:
        fail("8.5", f"when a score raised an error, {left[0]} stayed quantized: put the modules back in a "
                    "finally block, so that an error (or an interrupt) leaves the model as it was")
    passed("8.5", "each group quantized alone with the scheme given, changes against the baseline, "
                  "the original modules back after the loop and after a failed score")
