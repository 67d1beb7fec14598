"""Checks for stage 05: the online-softmax update, the causal block skip, two warm-up Triton
kernels (a masked scale, a row softmax) and the flash-attention kernel's inner loop.

Each check recomputes the expected result from the formula (in float64 where it helps), and
when the answer is wrong it recomputes what the usual mistakes would have produced, to say
which one it was. The Triton checks pass their kernels views of larger buffers: outputs (O and
the log-sum-exp included) padded with a sentinel, so that a store past the end shows up as a
changed sentinel instead of corrupting memory, and inputs padded with NaN. Under Triton's
interpreter they also watch every address the kernel loads and stores (``_Watch``): an unmasked
load changes no output, so only the addresses show it.
"""

from __future__ import annotations

import ast
import inspect
import math
import os
import textwrap
from collections.abc import Callable

import numpy as np
import torch

from aie_lessons.checks.common import call, causal_reference, close, expect_shape, fail, passed

NO_TRITON = "Exercise {} cannot run here: triton is not installed (it has no macOS build)."
SENTINEL = -7777.0  # exactly representable in float16 and float32


def _device() -> str:
    """Where the Triton checks put their tensors: a compiled kernel reads GPU memory only; the
    interpreter (no GPU) reads the CPU's."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def _same(a: torch.Tensor, b: torch.Tensor, atol: float) -> bool:
    """Equal within ``atol``, NaN where the other has NaN (a mistake's NaNs are part of its print)."""
    return a.shape == b.shape and torch.allclose(a.double(), b.double(), atol=atol, rtol=1e-4, equal_nan=True)


# ---------------------------------------------------------------- 5.1: the online-softmax update

def _update(m, l, acc, scores, v, mistake: str = ""):
    """The update, and (with ``mistake``) what each usual wrong version computes instead."""
    m_new = scores.amax(-1) if mistake == "block max" else torch.maximum(m, scores.amax(-1))
    alpha = torch.exp(m_new - m) if mistake == "inverted alpha" else torch.exp(m - m_new)
    p = torch.exp(scores - (m if mistake == "old max" else m_new)[..., None])
    l_new = (l if mistake == "l" else l * alpha) + p.sum(-1)
    acc_new = (acc if mistake == "acc" else acc * alpha[..., None]) + p @ v
    return m_new, l_new, acc_new


UPDATE_MISTAKES = {
    "acc": "you forgot to rescale the accumulator: acc must be multiplied by alpha = exp(m − m_new) "
           "before adding the new block",
    "l": "you forgot to rescale the running sum: l must be multiplied by alpha = exp(m − m_new) "
         "before adding the new block's sum",
    "block max": "the running max forgot the old blocks: the new max is the larger of the old max "
                 "and this block's row max, so it never decreases",
    "inverted alpha": "the correction factor is inverted: alpha = exp(m − m_new) is at most 1 "
                      "(old terms shrink when the max grows), not exp(m_new − m)",
    "old max": "the block's exps were taken against the old max: exponentiate the new scores "
               "against m_new, the max they will be divided by",
}


def check_online_softmax_update(update) -> None:
    """5.1 over three blocks whose max rises then falls, with a fully masked row: the running
    state must equal the whole row's max, sum of exps and softmax · v (a single block would not
    show a missing rescale)."""
    g = torch.Generator().manual_seed(5)
    # (leading dims, M rows, N keys per block, D): a plain case, two batch dims, a single row.
    for lead, rows, cols, dim in (((2,), 4, 8, 16), ((3, 2), 5, 7, 8), ((), 1, 3, 4)):
        # Three blocks: the max rises (+3), then a block of smaller scores (−3) must not lower it;
        # in that last block row 0 is wholly masked (-inf), as a causal tile past a query is.
        blocks = [torch.randn(*lead, rows, cols, generator=g) + shift for shift in (0.0, 3.0, -3.0)]
        blocks[2][..., 0, :] = float("-inf")
        values = [torch.randn(*lead, cols, dim, generator=g) for _ in blocks]
        empty = (torch.full((*lead, rows), float("-inf")), torch.zeros(*lead, rows), torch.zeros(*lead, rows, dim))
        got = empty
        for scores, v in zip(blocks, values):
            got = call("5.1", update, *got, scores, v)
            if not isinstance(got, tuple) or len(got) != 3:
                fail("5.1", "return the new (m, l, acc) as a tuple of three tensors")
            for name, tensor, like in zip("m l acc".split(), got, empty):
                expect_shape("5.1", name, tensor, like.shape)
        scores, v = torch.cat(blocks, -1), torch.cat(values, -2)
        expected = (scores.amax(-1), torch.exp(scores - scores.amax(-1, keepdim=True)).sum(-1))
        if (close(got[0], expected[0]) and close(got[1], expected[1], atol=1e-4)
                and close(got[2] / got[1][..., None], torch.softmax(scores, -1) @ v, atol=1e-5)):
            continue
        # Wrong: which mistake was it? Replay the blocks from a finite state (after block 0), where
        # each mistake leaves its own print (from the empty start several of them give NaN).
        start = _update(*empty, blocks[0], values[0])
        learner = start
        for scores, v in zip(blocks[1:], values[1:]):
            learner = call("5.1", update, *learner, scores, v)
        for mistake, message in UPDATE_MISTAKES.items():
            emulated = start
            for scores, v in zip(blocks[1:], values[1:]):
                emulated = _update(*emulated, scores, v, mistake)
            if all(_same(a, b, atol=1e-4) for a, b in zip(learner, emulated)):
                fail("5.1", message)
        if not all(torch.isfinite(t).all() for t in got[1:]):
            fail("5.1", "the result has NaN or inf: the empty start (m = -inf, l = 0, acc = 0) must "
                        "be wiped cleanly, by a correction factor exp(-inf) = 0")
        fail("5.1", f"after three blocks of shape {tuple(blocks[0].shape)}, (m, l, acc) are not the "
                    "running max, sum of exps and exp-weighted sum of v of all the keys seen")
    passed("5.1", "running max, rescaled sum and accumulator: acc / l is softmax · v")


# ---------------------------------------------------------------- 5.2: the causal block skip

def _visible_end(q_start: int, block_m: int, q_len: int, kv_len: int) -> int:
    """From the mask itself: one past the last key any query of the block may see."""
    offset = kv_len - q_len
    rows = torch.arange(q_start, q_start + block_m)[:, None]
    visible = torch.arange(kv_len)[None, :] <= offset + rows
    columns = visible.any(0).nonzero()
    return int(columns.max()) + 1 if len(columns) else 0


def check_causal_key_end(causal_key_end) -> None:
    """5.2 against the end read off the causal mask itself, for fixed edge cases (the diagonal
    block, a decode query, a chunk after a cache) and random blocks of random chunks."""
    g = torch.Generator().manual_seed(7)
    cases = [(0, 16, 40, 40), (32, 16, 40, 40), (0, 16, 1, 50), (16, 16, 40, 60)]
    for _ in range(20):  # random blocks of random prompts and chunks, the cache holding the rest
        block_m = (16, 32, 64)[int(torch.randint(3, (1,), generator=g))]
        kv_len = int(torch.randint(1, 200, (1,), generator=g))
        q_len = int(torch.randint(1, kv_len + 1, (1,), generator=g))
        q_start = block_m * int(torch.randint(math.ceil(q_len / block_m), (1,), generator=g))
        cases.append((q_start, block_m, q_len, kv_len))
    for q_start, block_m, q_len, kv_len in cases:
        expected = _visible_end(q_start, block_m, q_len, kv_len)
        got = call("5.2", causal_key_end, q_start, block_m, q_len, kv_len)
        if got == expected:
            continue
        offset = kv_len - q_len
        if got == min(kv_len, offset + q_start + block_m - 1):
            fail("5.2", "off by one on the diagonal block: the block's last query, at "
                        "offset + q_start + block_m − 1, sees its own key, so the (exclusive) end "
                        "is one past it")
        if got == offset + q_start + block_m and got > kv_len:
            fail("5.2", f"the end {got} runs past kv_len = {kv_len}: clamp it to the number of keys")
        if got == min(kv_len, q_start + block_m):
            fail("5.2", "you ignored the cache offset: the q_len queries are the *last* positions, "
                        "so each sits kv_len − q_len positions further than its index")
        fail("5.2", f"causal_key_end{(q_start, block_m, q_len, kv_len)} should be {expected}, got {got}")
    passed("5.2", "key blocks in the future of a whole query block are skipped")


# ---------------------------------------------------------------- watching a kernel's memory

def _addresses(t: torch.Tensor) -> np.ndarray:
    """The sorted byte address of every element of ``t`` (any strides): what a kernel may read."""
    index = torch.zeros((), dtype=torch.int64)
    for size, stride in zip(t.shape, t.stride()):
        index = index[..., None] + torch.arange(size) * stride
    return np.sort((t.data_ptr() + index.flatten() * t.element_size()).numpy().astype(np.uint64))


class _Watch:
    """Under Triton's interpreter: the address of every lane of each load and store.

    Why: an unmasked load past a tensor's end changes no output when its lanes are never stored,
    yet on a GPU it reads memory that belongs to something else (or to no one). The interpreter
    sends every load and store through one builder object, so wrapping two of its methods shows
    them. A lane outside the tensors it may read, or a store outside every buffer the check owns,
    is recorded and masked off: a wild store then cannot corrupt the process's memory. A compiled
    kernel cannot be watched (``active`` is False); the sentinels still see its stores.
    """

    def __init__(self, readable: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]):
        self._readable_tensors = list(readable.values())
        self.spans = {name: (b.data_ptr(), b.data_ptr() + b.numel() * b.element_size())
                      for name, b in buffers.items()}  # contiguous buffers: [first byte, end)
        self.bad_reads: set[str] = set()  # the buffers (or "elsewhere") that were read wrongly
        self.wild_stores = 0
        self.active = False

    def _where(self, address: int) -> str:
        return next((name for name, (lo, hi) in self.spans.items() if lo <= address < hi), "elsewhere")

    def _inside(self, addresses: np.ndarray, allowed: np.ndarray) -> np.ndarray:
        at = np.clip(np.searchsorted(allowed, addresses), 0, len(allowed) - 1)
        return allowed[at] == addresses

    def __enter__(self) -> _Watch:
        if os.environ.get("TRITON_INTERPRET") != "1":
            return self
        try:
            from triton.runtime.interpreter import TensorHandle, interpreter_builder
            import triton.language as tl
        except ImportError:  # another Triton layout: run unwatched, as compiled kernels do
            return self
        if any(t.device.type != "cpu" for t in self._readable_tensors):
            return self  # the interpreter copies GPU tensors to the host: other addresses
        builder, self.active = interpreter_builder, True
        self.readable = np.sort(np.concatenate([_addresses(t) for t in self._readable_tensors]))
        load, store = builder.create_masked_load, builder.create_masked_store
        span_bounds = list(self.spans.values())

        def watched_load(ptrs, mask, other, *rest):
            lanes = np.broadcast_to(mask.data, ptrs.data.shape)
            ok = self._inside(ptrs.data.astype(np.uint64), self.readable)
            for address in ptrs.data[lanes & ~ok][:1]:
                self.bad_reads.add(self._where(int(address)))
            return load(ptrs, TensorHandle(lanes & ok, tl.int1), other, *rest)

        def watched_store(ptrs, value, mask, *rest):
            lanes = np.broadcast_to(mask.data, ptrs.data.shape)
            addresses = ptrs.data.astype(np.uint64)
            ok = np.zeros(addresses.shape, dtype=bool)
            for lo, hi in span_bounds:
                ok |= (addresses >= lo) & (addresses < hi)
            self.wild_stores += int((lanes & ~ok).sum())
            return store(ptrs, value, TensorHandle(lanes & ok, tl.int1), *rest)

        builder.create_masked_load, builder.create_masked_store = watched_load, watched_store
        self._builder = builder
        return self

    def __exit__(self, *exc) -> None:
        if self.active:
            for name in ("create_masked_load", "create_masked_store"):
                vars(self._builder).pop(name, None)  # back to the class's own methods


def _kernel_source(wrapper: Callable, name: str) -> str | None:
    """The source of the kernel ``name`` that ``wrapper`` launches, from the wrapper's globals (the
    learner's notebook, or the module after ``aie commit``); None when it cannot be read. Some
    mistakes show in no output under the interpreter, only in the source."""
    fn = getattr(getattr(wrapper, "__globals__", {}).get(name), "fn", None)
    try:
        return textwrap.dedent(inspect.getsource(fn)) if fn is not None else None
    except (OSError, TypeError):
        return None


# ---------------------------------------------------------------- 5.3: a masked load and store

def _guarded(values: torch.Tensor, spare: int, fill: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(buffer, view): ``values`` at the start of a buffer ``spare`` elements longer, rest ``fill``."""
    buffer = torch.full((values.numel() + spare,), fill, dtype=values.dtype)
    buffer[:values.numel()] = values
    buffer = buffer.to(_device())
    return buffer, buffer[:values.numel()]


def check_scale_vector(scale_vector, has_triton: bool) -> None:
    """5.3 on lengths that are a multiple of BLOCK, not, shorter than it, 1, and in float16. X and
    Y are views of longer buffers (X's tail NaN, Y's the sentinel): a store past n changes the
    sentinel, and the interpreter's watch sees a read past n, which changes no output."""
    if not has_triton:
        print(NO_TRITON.format("5.3"))
        return
    g, block = torch.Generator().manual_seed(8), 16
    watched = True
    for n, dtype in ((37, torch.float32), (16, torch.float32), (5, torch.float32), (1, torch.float32),
                     (100, torch.float16)):
        x = torch.randn(n, generator=g).to(dtype)
        factor = float(torch.empty(()).uniform_(0.5, 3.0, generator=g))
        x_buffer, x_view = _guarded(x, 2 * block, float("nan"))
        out_buffer, out_view = _guarded(torch.full((n,), SENTINEL, dtype=dtype), 2 * block, SENTINEL)
        with _Watch({"X": x_view}, {"X": x_buffer, "Y": out_buffer}) as watch:
            got = call("5.3", scale_vector, x_view, factor, out_view, block)
        watched &= watch.active
        expect_shape("5.3", "the result", got, (n,))
        if watch.wild_stores:
            fail("5.3", f"{watch.wild_stores} elements were written outside Y: the store must be "
                        "masked to the offsets below n")
        out_buffer = out_buffer.cpu()
        out_view = out_buffer[:n]
        past = out_buffer[n:] != SENTINEL
        if past.any():
            if past[0] and not past[1:].any():
                fail("5.3", f"off by one: element n = {n} was written, one past the last; the mask "
                            "keeps offsets strictly below n")
            fail("5.3", f"{int(past.sum())} elements past the end (n = {n}, BLOCK = {block}) were "
                        "written: the store must be masked to the offsets below n")
        if watch.bad_reads:
            fail("5.3", f"X was read at or past n = {n}: the load must go through the same mask as "
                        "the store (the last block's lanes past n are not this tensor's memory)")
        expected = (x.float() * factor).to(dtype)
        if close(out_view, expected, atol=1e-3):
            continue
        written = out_view != SENTINEL
        if n > block and written[:block].all() and not written[block:].any():
            fail("5.3", "only the first BLOCK elements were written: every program handled the "
                        "first block; a program's offsets start at its program id times BLOCK")
        if n > 1 and written[:-1].all() and not written[-1]:
            fail("5.3", "the last element was not written: off by one in the mask, which keeps "
                        "every offset below n (n − 1 included)")
        if close(out_view, x, atol=1e-3):
            fail("5.3", "Y equals X: multiply by factor before storing")
        fail("5.3", f"Y should be factor · X for n = {n} ({dtype}); max error "
                    f"{(out_view.float() - expected.float()).abs().max():.3g}")
    passed("5.3", "masked blocks: every element scaled once, nothing past the end "
                  + ("read or written" if watched else "written (reads are watched only under the interpreter)"))


# ---------------------------------------------------------------- 5.4: a row softmax kernel

def _softmax_case(shape, dtype, wide_x: int, wide_out: int, g: torch.Generator):
    """x (rows, n) and out as views of wider, guarded buffers: x's extra columns (and one extra
    row) hold large values, out's hold the sentinel. Some rows are near 100: exp(100) overflows."""
    rows, n = shape
    x = torch.randn(rows, n, generator=g) * 4
    x[::2] += 100.0
    x_buffer = torch.full((rows + 1, n + wide_x), 1e4)
    x_buffer[:rows, :n] = x
    out_buffer = torch.full((rows + 1, n + wide_out), SENTINEL)
    x_buffer, out_buffer = x_buffer.to(_device(), dtype), out_buffer.to(_device(), dtype)
    return x_buffer, x_buffer[:rows, :n], out_buffer, out_buffer[:rows, :n]


ROW_STRIDE = ("right for contiguous rows, wrong for rows of a wider tensor: row r starts "
              "r · stride_x elements after X (r · stride_y after Y), not r · n_cols")


def check_softmax_rows(softmax_rows, has_triton: bool) -> None:
    """5.4 on ragged and power-of-two rows, rows near 100 (exp overflows without the max), strided
    rows of wider tensors and float16. The contiguous cases come first, so that a failure on a
    strided one means the strides; the interpreter's watch sees reads past a row and exp on
    float16, neither of which changes the output there."""
    if not has_triton:
        print(NO_TRITON.format("5.4"))
        return
    g = torch.Generator().manual_seed(9)
    # (rows, n_cols), dtype, extra columns of x's and out's buffers (0: contiguous rows)
    cases = [((3, 37), torch.float32, 0, 0), ((2, 16), torch.float32, 0, 0), ((4, 5), torch.float32, 0, 0),
             ((1, 100), torch.float32, 0, 0), ((3, 37), torch.float32, 3, 5), ((5, 20), torch.float16, 7, 2)]
    for shape, dtype, wide_x, wide_out in cases:
        x_buffer, x, out_buffer, out = _softmax_case(shape, dtype, wide_x, wide_out, g)
        rows, n = shape
        strided = wide_x or wide_out
        with _Watch({"X": x}, {"X": x_buffer, "Y": out_buffer}) as watch:
            got = call("5.4", softmax_rows, x, out)
        expect_shape("5.4", "the result", got, shape)
        if watch.bad_reads or watch.wild_stores:
            if strided:  # the contiguous cases passed: the rows went to the wrong places
                fail("5.4", ROW_STRIDE)
            fail("5.4", f"the lanes past n_cols = {n} were read (the next row's numbers, or past "
                        "X's end): load through the column mask, with -inf in the masked lanes")
        x, out_buffer = x.cpu(), out_buffer.cpu()
        out = out_buffer[:rows, :n]
        guard = torch.ones_like(out_buffer, dtype=torch.bool)
        guard[:rows, :n] = False
        if (out_buffer[guard] != SENTINEL).any():
            if strided:
                fail("5.4", ROW_STRIDE)
            fail("5.4", f"values were written past the end of a row (n_cols = {n}): the store must "
                        "be masked to the row's columns")
        expected = torch.softmax(x.double(), -1)
        tolerance = 1e-5 if dtype == torch.float32 else 1e-3
        if close(out, expected, atol=tolerance):
            continue
        block = 1 << (n - 1).bit_length()
        padded = torch.cat([x.double(), torch.zeros(rows, block - n, dtype=torch.float64)], -1)
        if block > n and _same(out, torch.softmax(padded, -1)[:, :n], atol=10 * tolerance):
            fail("5.4", "the lanes past n_cols were loaded as 0 and joined the max and the sum: "
                        "load them as -inf, which exp turns into 0")
        if block > n and not watch.active and not strided and _same(
                out, _unmasked_softmax(x_buffer.cpu(), rows, n, block), atol=10 * tolerance):
            fail("5.4", f"the lanes past n_cols = {n} were read (the next row's numbers): load "
                        "through the column mask, with -inf in the masked lanes")
        if not torch.isfinite(out[::2]).all() and torch.isfinite(out[1::2]).all():
            fail("5.4", "exp overflowed (inf/NaN) on the rows near 100: subtract the row's max "
                        "before exp, which leaves the softmax unchanged")
        if strided:
            fail("5.4", ROW_STRIDE)
        if not close(out.float().sum(-1), torch.ones(rows), atol=1e-3):
            fail("5.4", "the rows do not sum to 1: divide the exps by their row's sum")
        fail("5.4", f"softmax of a {shape} {dtype} tensor is wrong by up to "
                    f"{(out.double() - expected).abs().max():.3g}")
    source = _kernel_source(softmax_rows, "_softmax_rows_kernel")
    if source is not None and "float32" not in source and "fp32" not in source:
        fail("5.4", "the row is never converted to float32: float16 rows reach tl.exp, which takes "
                    "float32 only (a GPU refuses to compile it; the interpreter computes it in "
                    "float32 anyway, so no output shows it): convert right after the load")
    passed("5.4", "one program per row: masked tail, max subtracted, strided rows, float32 and float16")


def _unmasked_softmax(x_buffer: torch.Tensor, rows: int, n: int, block: int) -> torch.Tensor:
    """What a kernel with an unmasked load computes on contiguous rows: each row's BLOCK lanes run
    on into the next row (and the buffer's guard row), all of them in the max and the sum."""
    flat = x_buffer.double().flatten()
    lanes = torch.stack([flat[r * n:r * n + block] for r in range(rows)])
    return torch.softmax(lanes, -1)[:, :n]


# ---------------------------------------------------------------- 5.5: the flash kernel

def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool) -> torch.Tensor:
    """q·kᵀ/√D in float64, each query head against its group's K head, masked with -inf."""
    k = k.double().repeat_interleave(q.shape[1] // k.shape[1], 1)
    scores = q.double() @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        scores = scores.masked_fill(~causal_reference(*scores.shape[-2:]), float("-inf"))
    return scores


def _reference(q, k, v, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q·kᵀ/√D, masked)·v and the rows' log-sum-exp, from the formula, in float64."""
    scores = _scores(q, k, causal)
    v = v.double().repeat_interleave(q.shape[1] // v.shape[1], 1)
    return torch.softmax(scores, -1) @ v, torch.logsumexp(scores, -1)


def _kernel_mistake(q, k, v, causal: bool, block_m: int, block_n: int, mistake: str) -> torch.Tensor:
    """What a kernel with ``mistake`` outputs: tiles as the kernel walks them (float64), with the
    kernel's padding (keys past kv_len load as 0) and its causal block skip."""
    groups = q.shape[1] // k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(groups, 1), v.double().repeat_interleave(groups, 1)
    q_len, kv_len, head_dim = q.shape[-2], k.shape[-2], q.shape[-1]
    pad = block_n + -kv_len % block_n
    k = torch.cat([k, k.new_zeros(*k.shape[:2], pad, head_dim)], -2)
    v = torch.cat([v, v.new_zeros(*v.shape[:2], pad, head_dim)], -2)
    scale = 1.0 if mistake == "scale" else head_dim**-0.5
    offset = 0 if mistake == "offset" else kv_len - q_len
    out = torch.empty_like(q)
    for q_start in range(0, q_len, block_m):
        q_block = q[..., q_start:q_start + block_m, :]
        q_pos = offset + torch.arange(q_start, q_start + q_block.shape[-2])[:, None]
        m = torch.full(q_block.shape[:-1], float("-inf"), dtype=torch.float64)
        l, acc = torch.zeros_like(m), torch.zeros_like(q_block)
        end = min(kv_len, kv_len - q_len + q_start + (0 if mistake == "skip" else block_m)) if causal else kv_len
        for start in range(0, end, block_n):
            keys = torch.arange(start, start + block_n)[None, :]
            scores = q_block @ k[..., start:start + block_n, :].transpose(-1, -2) * scale
            visible = keys >= 0 if mistake == "tail" else keys < kv_len
            if causal:
                visible = visible & ((keys < q_pos) if mistake == "diagonal" else (keys <= q_pos))
            scores = scores.masked_fill(~visible, float("-inf"))
            m_new = torch.maximum(m, scores.amax(-1))
            alpha, p = torch.exp(m - m_new), torch.exp(scores - m_new[..., None])
            l = (l if mistake == "l" else l * alpha) + p.sum(-1)
            acc = (acc if mistake == "acc" else acc * alpha[..., None]) + p @ v[..., start:start + block_n, :]
            if mistake == "early":
                acc = acc / l[..., None]
            m = m_new
        normalised = mistake in ("early", "never")
        out[..., q_start:q_start + q_block.shape[-2], :] = acc if normalised else acc / l[..., None]
    return out


KERNEL_MISTAKES = {
    "acc": "you forgot to rescale acc: when a tile raises the max, the accumulator must be "
           "multiplied by alpha = exp(m_old − m_new) before the tile's P·V is added",
    "l": "you forgot to rescale the running sum l by alpha = exp(m_old − m_new) before adding the "
         "tile's row sums",
    "tail": "you forgot the tail mask: the last tile reads past kv_len (loaded as 0) and those "
            "scores must be -inf, not 0",
    "diagonal": "the causal mask is off by one: a query sees its own key (key position <= query "
                "position offset + offs_m), so the diagonal stays",
    "offset": "the causal mask forgot the offset kv_len − q_len: with a cache (decode, chunked "
              "prefill) the queries are the last q_len positions, not the first",
    "skip": "the key loop stops before the diagonal tile: with CAUSAL it must run up to the block's "
            "last query position + 1 (exercise 5.2), so that every query sees its own key",
    "early": "you normalised before the loop ends: divide acc by l once, after the last tile; a "
             "normalised acc is then rescaled as if it were a sum",
    "never": "the output is not normalised: divide acc by l after the loop",
    "scale": "the scores were not scaled: multiply q·kᵀ by scale = 1/√D",
}

# (batch, q heads, kv heads, q_len, kv_len, head_dim, causal, dtype, layout): the contiguous cases
# expose the arithmetic mistakes (a ragged tail, GQA, a chunk after a cache, one decoding query,
# then random shapes and float16); the last two, strided rows and a first tile of huge scores,
# come after all of them, so that a failure there is the layout or the max, nothing else.
KERNEL_CASES = [
    (1, 4, 2, 37, 37, 32, False, torch.float32, "contiguous"),
    (1, 4, 2, 37, 37, 32, True, torch.float32, "contiguous"),
    (2, 6, 3, 10, 45, 32, True, torch.float32, "contiguous"),
    (2, 2, 1, 1, 29, 32, True, torch.float32, "contiguous"),
]
LAYOUT_CASES = [
    (1, 6, 3, 20, 20, 16, True, torch.float32, "strided"),
    (1, 2, 1, 20, 40, 32, False, torch.float32, "huge first tile"),
]
CASE_NAMES = {"contiguous": "", "strided": ", K/V rows strided (a (B, T, H, D) tensor viewed as "
              "(B, H, T, D))", "huge first tile": ", the first key tile's scores near ±100"}


def _kernel_cases(g: torch.Generator) -> list[tuple]:
    """The fixed contiguous cases, random shapes in float32 and float16, then the layout cases."""
    cases = list(KERNEL_CASES)
    for dtype in (torch.float32, torch.float16):
        kv_len = int(torch.randint(17, 60, (1,), generator=g))
        q_len = int(torch.randint(1, kv_len + 1, (1,), generator=g))
        kv_heads, groups = int(torch.randint(1, 3, (1,), generator=g)), int(torch.randint(1, 4, (1,), generator=g))
        for causal in (True, False):
            cases.append((1, kv_heads * groups, kv_heads, q_len, kv_len, 64, causal, dtype, "contiguous"))
    cases.append((2, 4, 2, 1, 40, 64, True, torch.float16, "contiguous"))
    return cases + LAYOUT_CASES


def _kernel_inputs(case, g: torch.Generator):
    """q, k, v of the case on the CPU, (B, H, S, D); "strided" ones are (B, S, H, D) transposed."""
    batch, heads, kv_heads, q_len, kv_len, head_dim, _, dtype, layout = case
    q = torch.randn(batch, q_len, heads, head_dim, generator=g).transpose(1, 2)
    k = torch.randn(batch, kv_len, kv_heads, head_dim, generator=g).transpose(1, 2)
    v = torch.randn(batch, kv_len, kv_heads, head_dim, generator=g).transpose(1, 2)
    if layout != "strided":
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if layout == "huge first tile":
        k[..., :16, :] *= 100.0
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _padded(t: torch.Tensor, pad: int, fill: float, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(buffer, view): ``t`` (B, H, S, D) as the first S rows of a buffer ``pad`` rows longer per
    head, on the kernel's device, in ``t``'s layout; the extra rows hold ``fill``. A row past S that
    a kernel reads or writes then lands in the buffer, where the check sees it."""
    batch, heads, rows, dim = t.shape
    if layout == "strided":  # (B, S, H, D) in memory, viewed as (B, H, S, D)
        buffer = torch.full((batch, rows + pad, heads, dim), fill, dtype=t.dtype)
        buffer[:, :rows] = t.transpose(1, 2)
        buffer = buffer.to(_device())
        return buffer, buffer.transpose(1, 2)[:, :, :rows]
    buffer = torch.full((batch, heads, rows + pad, dim), fill, dtype=t.dtype)
    buffer[:, :, :rows] = t
    buffer = buffer.to(_device())
    return buffer, buffer[:, :, :rows]


def _run_kernel(flash: Callable, q, k, v, causal: bool, block: int, layout: str):
    """Run the learner's kernel on guarded views: Q, K, V padded with NaN rows, O with sentinel
    rows, the log-sum-exp followed by a sentinel block; watch it under the interpreter. Fails with
    the store or load that is not masked; else returns (out, lse) on the CPU, and whether the
    loads were watched."""
    q_buffer, q_view = _padded(q, block, float("nan"), layout)
    k_buffer, k_view = _padded(k, block, float("nan"), layout)
    v_buffer, v_view = _padded(v, block, float("nan"), layout)
    out_buffer, out_view = _padded(torch.full(q.shape, SENTINEL, dtype=q.dtype), block, SENTINEL, "contiguous")
    lse_buffer = torch.full((q.shape[:-1].numel() + block,), SENTINEL, device=_device())
    lse_view = lse_buffer[:q.shape[:-1].numel()].view(q.shape[:-1])
    buffers = {"Q": q_buffer, "K": k_buffer, "V": v_buffer, "O": out_buffer, "LSE": lse_buffer}
    with _Watch({"Q": q_view, "K": k_view, "V": v_view}, buffers) as watch:
        out, lse = call("5.5", lambda: flash(q_view, k_view, v_view, causal, block, block,
                                             out=out_view, lse=lse_view))
    expect_shape("5.5", "the output", out, q.shape)
    expect_shape("5.5", "the log-sum-exp", lse, q.shape[:-1])
    if "Q" in watch.bad_reads:
        fail("5.5", "the Q load must be masked to rows below q_len: the last query block read rows "
                    "past the end of Q")
    if watch.bad_reads & {"K", "V"}:
        fail("5.5", "the K and V loads must be masked to rows below kv_len: the last key tile read "
                    "rows past the end of K or V")
    if watch.bad_reads or watch.wild_stores:
        fail("5.5", "the kernel read or wrote outside Q, K, V, O and LSE: check the pointers "
                    "(batch, head and row strides)")
    out_buffer, lse_buffer = out_buffer.cpu(), lse_buffer.cpu()
    if (out_buffer[:, :, q.shape[2]:] != SENTINEL).any():
        fail("5.5", "the O store must be masked to rows below q_len: the last query block wrote "
                    "rows past the end of O")
    if (lse_buffer[q.shape[:-1].numel():] != SENTINEL).any():
        fail("5.5", "the LSE store must be masked to rows below q_len: the last query block wrote "
                    "past the end of the log-sum-exp")
    return out.cpu(), lse.cpu(), watch.active


def _describe(case) -> str:
    """The case in words, for a message: the learner must be able to rebuild it."""
    batch, heads, kv_heads, q_len, kv_len, head_dim, causal, dtype, layout = case
    return (f"{'causal' if causal else 'full'} attention, {str(dtype).removeprefix('torch.')}, "
            f"B={batch}, Hq={heads}, Hkv={kv_heads}, q_len={q_len}, kv_len={kv_len}, D={head_dim}"
            f"{CASE_NAMES[layout]}")


def _inspect_kernel_source(flash: Callable) -> None:
    """What no output shows, read from the kernel's source: a call to a plain Python function (the
    interpreter runs it, a GPU's compiler refuses it) and a ``tl.dot`` without
    ``input_precision`` (a GPU would multiply float32 in TF32). The kernel is the
    ``_flash_forward`` that the wrapper calls, found in the wrapper's globals."""
    source = _kernel_source(flash, "_flash_forward")
    if source is None:
        return
    fn = flash.__globals__["_flash_forward"].fn
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        if isinstance(node.func, ast.Name) and inspect.isfunction(fn.__globals__.get(node.func.id)):
            fail("5.5", f"the kernel calls the Python function {node.func.id}(): a @triton.jit kernel "
                        "can call only tl operations and other @triton.jit functions (the interpreter "
                        "runs it, a GPU's compiler refuses it); write 5.2's arithmetic inside the "
                        "kernel, with tl.minimum for the clamp")
        is_dot = isinstance(node.func, ast.Attribute) and node.func.attr == "dot" and \
            isinstance(node.func.value, ast.Name) and node.func.value.id == "tl"
        given = len(node.args) >= 4 or "input_precision" in {keyword.arg for keyword in node.keywords}
        if is_dot and not given:
            fail("5.5", f"{ast.get_source_segment(source, node)} has no input_precision=PRECISION: "
                        "on a GPU, float32 inputs would be multiplied in TF32 (a 10-bit mantissa); "
                        "both q·kᵀ and P·V take it")


def _check_causal_skip(flash: Callable, block: int) -> None:
    """The causal block skip is required: V's last key tile is NaN, which only the last query
    block may read. A query block that visits a tile entirely after its last query multiplies
    those NaN by P = 0 and turns NaN; a kernel that skips the tile stays exact."""
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, heads, 4 * block, 32, generator=g) for heads in (2, 1, 1))
    v[..., 3 * block:, :] = float("nan")
    out, _, _ = _run_kernel(flash, q, k, v, True, block, "contiguous")
    seen = 3 * block  # the first three query blocks see only the first three key tiles
    expected, _ = _reference(q[..., :seen, :], k[..., :seen, :], v[..., :seen, :], True)
    if not close(out[..., :seen, :], expected, atol=1e-5):
        fail("5.5", "with CAUSAL the loop must end at the query block's causal end (5.2's "
                    "arithmetic, with tl.minimum): a query block read a key tile entirely after "
                    "its last query (NaN here), which it must skip")


def check_flash_kernel(flash: Callable, has_triton: bool) -> None:
    """5.5 against softmax(q·kᵀ/√D)·v and its log-sum-exp computed in float64 from the formula:
    full and causal, GQA, ragged tails, a chunk after a cache, decode, float32 and float16, then
    strided K/V and a first tile of huge scores; every case through guarded buffers. Then the
    causal block skip, which no output shows without poisoned keys."""
    if not has_triton:
        print(NO_TRITON.format("5.5"))
        return
    _inspect_kernel_source(flash)
    g, block = torch.Generator().manual_seed(6), 16
    watched = True
    for case in _kernel_cases(g):
        causal, dtype = case[6], case[7]
        q, k, v = _kernel_inputs(case, g)
        out, lse, watched_here = _run_kernel(flash, q, k, v, causal, block, case[8])
        watched &= watched_here
        expected, expected_lse = _reference(q, k, v, causal)
        tolerance = 1e-5 if dtype == torch.float32 else 2e-3
        if not close(out, expected, atol=tolerance):
            _name_the_kernel_mistake(out, q, k, v, case, block)
        if not close(lse, expected_lse, atol=10 * tolerance):
            row_max = _scores(q, k, causal).amax(-1)
            if close(lse, row_max, atol=1e-3) or close(lse, expected_lse - row_max, atol=1e-3):
                fail("5.5", "the log-sum-exp is m + log(l): you stored only one of the two terms")
            fail("5.5", f"the log-sum-exp is wrong for {_describe(case)}: store m + log(l) per row")
    _check_causal_skip(flash, block)
    masks = "masked loads and stores" if watched else "masked K/V loads and stores (the Q load is " \
        "watched only under the interpreter)"
    passed("5.5", "tiles of keys with tail and causal masks and the causal block skip, GQA, decode "
                  f"and chunked queries, strided K/V, float32 and float16, {masks}: "
                  "the kernel matches softmax(q·kᵀ/√D)·v")


def _name_the_kernel_mistake(out, q, k, v, case, block: int) -> None:
    """Say which mistake gives ``out``. The layout cases come after every contiguous one, so a
    failure there is their layout (strides) or the max update: say so at once, without replaying
    the arithmetic mistakes (slow in float64, and already ruled out)."""
    causal, dtype, layout = case[6], case[7], case[8]
    if layout == "strided":
        fail("5.5", "right for contiguous tensors, wrong stride for strided ones: K/V row n is "
                    "n · stride_ks (stride_vs) elements after the head's start, which is not "
                    f"HEAD_DIM when the rows are strided ({_describe(case)})")
    if layout == "huge first tile":
        fail("5.5", "wrong max update: after a tile of huge scores, later tiles are much smaller; "
                    "the running max must be the larger of the old max and the tile's max (it never "
                    "decreases), or exp(m_old − m_new) overflows")
    tolerance = 1e-4 if dtype == torch.float32 else 5e-3
    for mistake, message in KERNEL_MISTAKES.items():
        if _same(out, _kernel_mistake(q, k, v, causal, block, block, mistake), atol=tolerance):
            fail("5.5", f"{message} (seen on {_describe(case)})")
    problem = "has NaN or inf" if not torch.isfinite(out).all() else (
        f"differs by up to {(out.double() - _reference(q, k, v, causal)[0]).abs().max():.3g}")
    fail("5.5", f"the output {problem} for {_describe(case)}")
