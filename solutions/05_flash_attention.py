# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Stage 05 — Flash attention in Triton
#
# Stage 02's attention builds the whole score matrix: `(B, H, S, S)` numbers, 4 bytes each. At
# 8k tokens that is 256 MiB *per head*. Flash attention never builds it. It walks over the keys
# in blocks and keeps, for every query, three running quantities:
#
# * `m` — the largest score seen so far (for a numerically safe softmax);
# * `l` — the sum of `exp(score − m)` so far (the softmax's denominator);
# * `acc` — the sum of `exp(score − m) · v` so far (the numerator).
#
# When a new block brings a larger maximum, the old `l` and `acc` were computed against the old
# `m`: both are multiplied by `exp(m_old − m_new)` before the new block is added. At the end,
# `acc / l` is exactly softmax(scores) · v. This is the *online softmax*. Memory is O(S) per head
# instead of O(S²) — and, on a GPU, it is also what makes attention *faster* (section 4).
#
# You write it first in PyTorch, then climb a short ladder of Triton kernels (a masked copy, a
# row softmax) up to the flash-attention kernel's inner loop, and plug it into the model.

# %%
# Stages you committed with `aie commit` are imported below; this checks them first.
from aie_lessons.course.progress import verify_committed_stages

verify_committed_stages(before="05")

# %% [markdown]
# Triton compiles kernels for GPUs. Without one, its *interpreter* runs the same kernel with
# NumPy, one program at a time — slow, but exact enough to develop and check a kernel on a
# laptop. The interpreter is chosen by the environment variable `TRITON_INTERPRET=1`, which must
# be set **before** `triton` is imported; `aie_lessons.flash_attention` does that when there is
# no GPU. Under the interpreter, bfloat16 is computed wrongly (NumPy has no bfloat16), so on a
# CPU we use float32 and float16. Triton does not exist for macOS: there this notebook runs the
# PyTorch version only, and the Triton checks say that they cannot run.

# %%
import math
import sys
import time

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F

from aie_lessons import checks

torch.manual_seed(0)

# %% [markdown]
# ## 1. The online-softmax update
#
# ### Exercise 5.1 — fold one block into the running softmax
#
# Write `online_softmax_update(m, l, acc, scores, v)`. The running state describes the keys seen
# so far: `m` `(..., M)` is each query row's largest score, `l` `(..., M)` the sum of
# `exp(score − m)`, `acc` `(..., M, D)` the sum of `exp(score − m) · v`. A new block brings
# `scores` `(..., M, N)` (masked keys are `-inf`) and their values `v` `(..., N, D)`. Return the
# new `(m, l, acc)`, describing all keys seen so far *including* this block. The very first call
# starts from `m = -inf`, `l = 0`, `acc = 0` and must not produce NaN. Everything is float32.

# %%
# export: flash_attention
"""Flash attention: tiled online softmax in PyTorch, and the same algorithm as a Triton kernel."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable

import torch

from aie_lessons.attention import group_queries

if not torch.cuda.is_available() and "triton" not in sys.modules:
    # The interpreter must be chosen before triton is imported; with no GPU it is the only option.
    os.environ.setdefault("TRITON_INTERPRET", "1")
HAS_TRITON = importlib.util.find_spec("triton") is not None
if HAS_TRITON:
    import triton
    import triton.language as tl


# %%
# export: flash_attention
def online_softmax_update(
    m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor, scores: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fold one block of scores (..., M, N) and values (..., N, D) into the running (m, l, acc).

    m, l are (..., M); acc is (..., M, D). Masked scores are -inf.
    """
    # BEGIN EXERCISE 5.1: return the running (max, sum of exps, weighted sum of values) after also seeing this block
    # Hint 1: The sums so far were taken against the old max; when the max grows, everything accumulated so far must be scaled down by exp(old max − new max) so that old and new terms are measured against the same max.
    # Hint 2: Take the new max as the larger of the old max and the block's row max; compute the correction factor from the old and new max; exponentiate the block's scores against the new max; scale the old sum and accumulator by the factor, then add the block's row sums and its exps times v.
    m_new = torch.maximum(m, scores.amax(dim=-1))
    alpha = torch.exp(m - m_new)
    p = torch.exp(scores - m_new[..., None])
    l_new = l * alpha + p.sum(dim=-1)
    acc_new = acc * alpha[..., None] + p @ v
    return m_new, l_new, acc_new
    # END EXERCISE 5.1


# %%
# Check exercise 5.1
checks.stage05.check_online_softmax_update(online_softmax_update)

# %% [markdown]
# ## 2. Tiled attention in PyTorch, with the causal block skip
#
# Query block `[start, start + M)` sits at absolute positions `offset + start …` where
# `offset = kv_len − q_len` (the queries are the last positions, as in stage 03). Under a causal
# mask its last query sees keys up to `offset + start + M − 1`: every key block after that is
# entirely masked and need not be visited at all — half the work of causal attention.
#
# ### Exercise 5.2 — where the keys end for a query block
#
# Write `causal_key_end(q_start, block_m, q_len, kv_len)`: one past the last key that any query
# of the block `[q_start, q_start + block_m)` may see under the causal mask, when the `q_len`
# queries are the last `q_len` of `kv_len` positions. It is never more than `kv_len`.

# %%
# export: flash_attention
def causal_key_end(q_start: int, block_m: int, q_len: int, kv_len: int) -> int:
    """One past the last key that query block [q_start, q_start + block_m) may see."""
    # BEGIN EXERCISE 5.2: the exclusive end of the keys that the block's queries may see, never past kv_len
    # Hint 1: Under a causal mask a block of queries sees no key beyond the position of its last query, and the queries' positions are shifted by the keys that came before them (the cache).
    # Hint 2: Find the absolute position of the block's last query (its index plus the number of cached keys), add one to make the end exclusive, and clamp the result to the number of keys.
    return min(kv_len, kv_len - q_len + q_start + block_m)
    # END EXERCISE 5.2


# %%
# Check exercise 5.2
checks.stage05.check_causal_key_end(causal_key_end)

# %% [markdown]
# `tiled_attention` puts the two together: query blocks, key blocks up to `causal_key_end`, the
# update of 5.1 per key block, one division at the end. Grouped-query attention reuses stage
# 02's `group_queries`: the `G` query heads that share a K/V head are one group, and the group
# is computed against its K/V head broadcast, never copied.

# %%
# export: flash_attention
def tiled_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
    block_m: int = 64, block_n: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention without the (S, T) score matrix: q (B, Hq, S, D), k/v (B, Hkv, T, D).

    Returns the output (B, Hq, S, D) and each row's log-sum-exp of scores (B, Hq, S).
    """
    batch, heads, q_len, head_dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    dtype = q.dtype
    q = group_queries(q, kv_heads).float() * head_dim**-0.5  # (B, Hkv, G, S, D)
    k, v = k[:, :, None].float(), v[:, :, None].float()  # (B, Hkv, 1, T, D): shared by the group
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    offset = kv_len - q_len
    for q_start in range(0, q_len, block_m):
        q_block = q[..., q_start:q_start + block_m, :]
        rows = q_block.shape[-2]
        m = torch.full(q_block.shape[:-1], float("-inf"), device=q.device)
        l = torch.zeros_like(m)
        acc = torch.zeros_like(q_block)
        end = causal_key_end(q_start, rows, q_len, kv_len) if causal else kv_len
        for k_start in range(0, end, block_n):
            scores = q_block @ k[..., k_start:k_start + block_n, :].transpose(-1, -2)
            if causal:
                q_pos = offset + q_start + torch.arange(rows, device=q.device)[:, None]
                k_pos = k_start + torch.arange(scores.shape[-1], device=q.device)[None, :]
                scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
            m, l, acc = online_softmax_update(m, l, acc, scores, v[..., k_start:k_start + block_n, :])
        out[..., q_start:q_start + rows, :] = acc / l[..., None]
        lse[..., q_start:q_start + rows] = m + torch.log(l)
    return out.view(batch, heads, q_len, head_dim).to(dtype), lse.view(batch, heads, q_len)


# %%
def sdpa(q, k, v, causal=True):
    """PyTorch's attention, with the causal mask of stage 03 (queries last): the yardstick."""
    q_len, kv_len = q.shape[-2], k.shape[-2]
    mask = torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len) if causal else None
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


q = torch.randn(2, 9, 100, 64)
k, v = torch.randn(2, 3, 100, 64), torch.randn(2, 3, 100, 64)
out, lse = tiled_attention(q, k, v, causal=True, block_m=32, block_n=32)
print("tiled == SDPA (causal, GQA 9/3, 100 = 3 blocks + a tail):",
      (out - sdpa(q, k, v)).abs().max().item() < 1e-5)

# %% [markdown]
# ## 3. Memory: O(S) instead of O(S²)
#
# Measured on this machine: the peak memory of one attention call, the naive way (scores
# materialised) against the tiled one, as the sequence grows. (Linux lets a process reset its
# peak-memory counter, which is what `peak_bytes_of` uses.)

# %%
# NBVAL_IGNORE_OUTPUT
from aie_lessons.instrument import peak_memory_bytes


def peak_bytes_of(fn) -> int:
    """Peak memory (RSS high-water mark) added while ``fn`` runs, measured by resetting it."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    base = peak_memory_bytes()
    fn()
    return peak_memory_bytes() - base


def naive(q, k, v):
    """Stage 02's way, on purpose: the whole (S, S) score matrix in memory."""
    scores = q @ k.repeat_interleave(q.shape[1] // k.shape[1], 1).transpose(-1, -2) / 8
    return torch.softmax(scores, -1) @ v.repeat_interleave(q.shape[1] // k.shape[1], 1)


lengths = [512, 1024, 2048, 4096]
if sys.platform.startswith("linux"):
    peaks = {"naive (scores materialised)": [], "tiled (online softmax)": []}
    for n in lengths:
        q, k, v = torch.randn(1, 4, n, 64), torch.randn(1, 4, n, 64), torch.randn(1, 4, n, 64)
        peaks["naive (scores materialised)"].append(peak_bytes_of(lambda: naive(q, k, v)))
        peaks["tiled (online softmax)"].append(
            peak_bytes_of(lambda: tiled_attention(q, k, v, causal=False, block_m=256, block_n=256)))
    plt.figure(figsize=(6, 3.5))
    for label, values in peaks.items():
        plt.plot(lengths, [b / 2**20 for b in values], marker="o", label=label)
    plt.xlabel("sequence length S (4 heads, head_dim 64)")
    plt.ylabel("peak extra memory (MiB)")
    plt.legend()
    plt.grid(alpha=0.3)
    plt.tight_layout()
    plt.show()
    for label, values in peaks.items():
        print(f"{label:28}", "  ".join(f"S={n}: {b / 2**20:6.1f} MiB" for n, b in zip(lengths, values)))
    naive_peaks = peaks["naive (scores materialised)"]
    print("naive growth per doubling of S:",
          ", ".join(f"{b / a:.1f}×" for a, b in zip(naive_peaks, naive_peaks[1:])))
else:
    print("peak-memory measurement needs Linux (/proc/self/clear_refs)")
print(f"the output at S = 4096 (4 heads, head_dim 64, float32): {4 * 4096 * 64 * 4 / 2**20:.0f} MiB")
print(f"the scores at S = 4096 (4 heads, float32): {4 * 4096 * 4096 * 4 / 2**20:.0f} MiB")

# %% [markdown]
# The naive curve grows about 4× each time S doubles (the growth is printed above): the S × S
# scores, 256 MiB at S = 4096. The tiled one stays within a few MiB at this scale — its extra
# memory is the output (S × D, 4 MiB at S = 4096) and one block of scores, which the allocator
# serves from memory it already holds.
#
# ## 4. Why flash attention is *faster*, not only smaller
#
# A GPU computes far faster than it reads its main memory (HBM). Attention written the naive way
# is a chain of kernels, and every link goes through HBM: one kernel writes the `S × T` scores,
# the softmax reads them and writes the `S × T` probabilities, the last matmul reads those again.
# That is four passes over `S × T` numbers per head, while the inputs and output are only
# `S × D` and `T × D` — and `T` is in the thousands where `D` is 64. Flash attention does all of
# it in **one** kernel: a block of scores lives in registers and shared memory (SRAM) on the chip,
# is turned into probabilities and multiplied with `V` there, and is gone. HBM sees Q, K and V
# read and O written: O(S·D + T·D) bytes instead of O(S·T). For one SmolLM2 layer (9 query heads
# sharing 3 K/V heads, head_dim 64) at 4096 tokens in bfloat16:

# %%
def attention_hbm_bytes(batch: int, q_heads: int, kv_heads: int, q_len: int, kv_len: int,
                        head_dim: int, bytes_per_number: int = 2, block_m: int = 64) -> dict[str, int]:
    """Bytes that attention moves between HBM and the chip, three ways of computing it."""
    q_and_o = 2 * batch * q_heads * q_len * head_dim * bytes_per_number  # read Q, write O
    k_and_v = 2 * batch * kv_heads * kv_len * head_dim * bytes_per_number  # read K and V once
    # Naive: write the scores, read them (softmax), write the probabilities, read them (P·V).
    scores = 4 * batch * q_heads * q_len * kv_len * bytes_per_number
    # A flash program reads all of its head's K and V; there is one program per query block.
    reread = 2 * batch * q_heads * math.ceil(q_len / block_m) * kv_len * head_dim * bytes_per_number
    return {"naive (scores through HBM)": q_and_o + k_and_v + scores,
            "flash, K/V tiles from L2 cache": q_and_o + k_and_v,
            "flash, every K/V tile from HBM": q_and_o + reread}


traffic = attention_hbm_bytes(batch=1, q_heads=9, kv_heads=3, q_len=4096, kv_len=4096, head_dim=64)
for name, count in traffic.items():
    print(f"{name:32} {count / 2**20:8.0f} MiB")
print(f"naive / flash: {traffic['naive (scores through HBM)'] / traffic['flash, K/V tiles from L2 cache']:.0f}×;"
      f"  one K/V head at 4096 tokens: {2 * 4096 * 64 * 2 / 2**20:.0f} MiB")
print(f"(the introduction's figure) one head's float32 scores at 8192 tokens: {8192**2 * 4 / 2**20:.0f} MiB")

# %% [markdown]
# The naive way moves about a hundred times more bytes, and attention at long context is limited
# by those bytes, not by arithmetic. The flash kernel below re-reads each K/V tile once per query
# block; if all those reads went to HBM it would still move half of what the naive way does, but
# the programs of one K/V head run side by side and its K and V (1 MiB here) stay in the GPU's L2
# cache, so HBM sees close to the small number. (The arithmetic is the same either way, apart from
# the causal block skip: the speed comes from the memory traffic saved, not from fewer FLOPs.)
#
# ## 5. Triton in three steps
#
# A Triton kernel is a Python function under `@triton.jit` that runs once per *program*; the
# *grid* says how many programs to launch, and `tl.program_id(axis)` tells a program which one it
# is. A program works on whole blocks: `tl.arange(0, BLOCK)` is a vector of `BLOCK` offsets (a
# power of two), `tl.load(pointer + offsets, mask=..., other=...)` reads a block, `tl.store`
# writes one. A tensor passed to a kernel arrives as a pointer to its first element, so a program
# computes its own addresses from offsets and strides. Lanes where `mask` is False are neither
# read (they get `other`) nor written: that is how a block hangs safely over the end of a tensor
# whose length is not a multiple of `BLOCK`.
#
# ### Exercise 5.3 — a masked load and store
#
# Write the body of `_scale_kernel(X, Y, n, factor, BLOCK)`: program `i` of the grid handles
# elements `[i · BLOCK, (i + 1) · BLOCK)` of the 1-D tensors `X` and `Y` (each `n` long, stride
# 1) and writes `Y = factor · X` there. The last program's block runs past `n`: nothing past `n`
# may be read or written (under the interpreter the check watches every address the kernel
# touches). The wrapper `scale_vector` (next cell) launches `ceil(n / BLOCK)`
# programs.

# %%
# export: flash_attention
if HAS_TRITON:

    @triton.jit
    def _scale_kernel(X, Y, n, factor, BLOCK: tl.constexpr):
        """Y[i] = factor · X[i], one block of BLOCK elements per program."""
        # BEGIN EXERCISE 5.3: write factor · X into Y for this program's block of elements, touching nothing at or past n
        # Hint 1: A program knows only its number in the grid; its elements are the BLOCK consecutive ones that start where the previous programs' blocks end, and a mask marks which of them exist.
        # Hint 2: Turn the program's number into the position of its first element, spread a range of BLOCK offsets from there, and derive from n which lanes are real; let that same condition guard both the read and the write.
        pid = tl.program_id(0)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        inside = offs < n
        x = tl.load(X + offs, mask=inside)
        tl.store(Y + offs, x * factor, mask=inside)
        # END EXERCISE 5.3


# %%
# export: flash_attention
def scale_vector(x: torch.Tensor, factor: float, out: torch.Tensor | None = None,
                 block: int = 128) -> torch.Tensor:
    """factor · x for a 1-D tensor, computed by ``_scale_kernel`` (into ``out`` when given)."""
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed (it has no macOS build)")
    if x.dim() != 1 or x.stride(0) != 1:
        raise ValueError(f"scale_vector takes a contiguous 1-D tensor, got shape {tuple(x.shape)}")
    out = torch.empty_like(x) if out is None else out
    _scale_kernel[(triton.cdiv(x.numel(), block),)](x, out, x.numel(), factor, BLOCK=block)
    return out


# %%
# Check exercise 5.3
checks.stage05.check_scale_vector(scale_vector, HAS_TRITON)

# %% [markdown]
# A reduction inside one program: `tl.max(x, axis)` and `tl.sum(x, axis)` reduce a block to a
# scalar (or a block of one dimension fewer). A whole row fits in one block when the block is the
# row length rounded up to a power of two; the lanes past the row's end must then not change the
# max or the sum. Mind also how early float32's `exp` overflows:

# %%
print("exp(88) and exp(100) in float32:", [f"{value:.3g}" for value in torch.exp(torch.tensor([88.0, 100.0])).tolist()])

# %% [markdown]
# ### Exercise 5.4 — a row softmax kernel
#
# Write the body of `_softmax_rows_kernel(X, Y, stride_x, stride_y, n_cols, BLOCK)`: program `r`
# computes the softmax of row `r` of the 2-D tensor `X` and writes it into row `r` of `Y`. Row
# `r` starts `r · stride_x` elements after `X` (`r · stride_y` after `Y`); its `n_cols` elements
# are consecutive; `BLOCK ≥ n_cols` is a power of two. Compute in float32 and stay finite for any
# finite input, however large (`exp(100)` overflows float32): `tl.exp` takes float32 (a GPU
# refuses to compile it on float16), so convert a float16 row after loading it. Nothing past
# `n_cols` in a row may be read or written. The wrapper `softmax_rows` launches one program per row.

# %%
# export: flash_attention
if HAS_TRITON:

    @triton.jit
    def _softmax_rows_kernel(X, Y, stride_x, stride_y, n_cols, BLOCK: tl.constexpr):
        """Softmax of one row of X into the same row of Y, one program per row."""
        # BEGIN EXERCISE 5.4: the softmax of this program's row of X, written to the same row of Y, finite for large inputs
        # Hint 1: softmax(x) = exp(x − max x) / sum(exp(x − max x)); the lanes past the row's end must take part in neither the max nor the sum, so they are loaded as a value that exp sends to 0.
        # Hint 2: Find the row from the program id and the row's start from the stride; mask the column offsets against n_cols; load with minus infinity in the masked lanes and convert to float32; subtract the row max, exponentiate, divide by the row sum, and store through the mask.
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        inside = cols < n_cols
        x = tl.load(X + row * stride_x + cols, mask=inside, other=float("-inf")).to(tl.float32)
        e = tl.exp(x - tl.max(x, 0))
        tl.store(Y + row * stride_y + cols, e / tl.sum(e, 0), mask=inside)
        # END EXERCISE 5.4


# %%
# export: flash_attention
def softmax_rows(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax over the last dimension of a 2-D tensor, by ``_softmax_rows_kernel``.

    Rows may be strided (a slice of a wider tensor); the elements within a row are contiguous.
    """
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed (it has no macOS build)")
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"softmax_rows takes a 2-D tensor with contiguous rows, got {tuple(x.shape)}")
    out = torch.empty_like(x) if out is None else out
    rows, n_cols = x.shape
    _softmax_rows_kernel[(rows,)](x, out, x.stride(0), out.stride(0), n_cols,
                                  BLOCK=triton.next_power_of_2(n_cols))
    return out


# %%
# Check exercise 5.4
checks.stage05.check_softmax_rows(softmax_rows, HAS_TRITON)

# %% [markdown]
# ## 6. The flash-attention kernel
#
# One program computes one block of `BLOCK_M` queries of one query head. The grid is
# `(query blocks, batch × K/V heads, G)`: the wrapper views `q` (and the output) through stage
# 02's `group_queries` as `(B, Hkv, G, S, D)`, so program `(i, b·Hkv + j, g)` takes query head
# `g` of group `j` and reads K/V head `j` — the head mapping of grouped-query attention comes from
# the tensor's layout, not from arithmetic in the kernel. The given part of the kernel finds this
# program's rows (`offs_m`), the feature offsets (`offs_d`), the pointers to its block of `Q` and
# `O`, where its K/V head starts (`k_base`, `v_base`) and where its log-sum-exp goes.
#
# `tl.dot(a, b)` multiplies two blocks (each side at least 16); `tl.trans` transposes one;
# `tl.where(cond, a, b)` chooses per element; `x[:, None]` and `x[None, :]` broadcast a vector
# along rows or columns.
#
# ### Exercise 5.5 — the kernel's inner loop
#
# Complete `_flash_forward`: load this program's queries (rows past `q_len` read as 0), start the
# running max, sum and accumulator, and walk the keys in tiles of `BLOCK_N`, from key 0 up to the
# end of the keys — with `CAUSAL`, only up to the end that exercise 5.2 computes for this query
# block (the queries are the last `q_len` of `kv_len` positions). For each tile: load the K and V
# tiles (rows `offs_n`, each `stride_ks` / `stride_vs` elements apart; rows at or past `kv_len`
# read as 0), compute the tile's scores `q · kᵀ · scale` with `input_precision=PRECISION`, give
# `-inf` to every key past `kv_len` and, when `CAUSAL`, to every key after the query's position,
# and fold the tile in with the online-softmax update of 5.1 (`P · V` with `tl.dot`, `P` cast to
# V's dtype, also with `input_precision=PRECISION`: without it a GPU multiplies float32 in TF32,
# with a 10-bit mantissa). After the loop, store the normalised output (in O's dtype) and each
# row's log-sum-exp `m + log(l)`, for rows below `q_len` only.
#
# A kernel runs only Triton operations and other `@triton.jit` functions: it cannot call the
# Python function `causal_key_end` of 5.2 (the interpreter would let it, a GPU's compiler does
# not). Write 5.2's arithmetic again inside the kernel, with `tl.minimum` for the clamp. The
# causal skip is required, not an optimisation you may leave out: the check gives the keys past
# each query block's causal end values that poison any block that reads them.

# %%
# export: flash_attention
if HAS_TRITON:

    @triton.jit
    def _flash_forward(
        Q, K, V, O, LSE,
        stride_qb, stride_qh, stride_qg, stride_qs, stride_kb, stride_kh, stride_ks,
        stride_vb, stride_vh, stride_vs, stride_ob, stride_oh, stride_og, stride_os,
        q_len, kv_len, kv_heads, groups, scale,
        CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        HEAD_DIM: tl.constexpr, PRECISION: tl.constexpr,
    ):
        """One block of BLOCK_M queries of one query head against all of its K/V head's keys."""
        block, batch_kv, g = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        b, kv_h = batch_kv // kv_heads, batch_kv % kv_heads
        offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        q_ptrs = (Q + b * stride_qb + kv_h * stride_qh + g * stride_qg
                  + offs_m[:, None] * stride_qs + offs_d[None, :])
        o_ptrs = (O + b * stride_ob + kv_h * stride_oh + g * stride_og
                  + offs_m[:, None] * stride_os + offs_d[None, :])
        lse_ptrs = LSE + (batch_kv * groups + g) * q_len + offs_m  # LSE is (B, Hkv·G, S), contiguous
        k_base = K + b * stride_kb + kv_h * stride_kh
        v_base = V + b * stride_vb + kv_h * stride_vh
        # BEGIN EXERCISE 5.5: the block's output (softmax of its masked, scaled scores times V) and its log-sum-exp, computed one key tile at a time
        # Hint 1: This is exercise 5.1 inside a loop over key tiles, with the masks of stage 03: the scores of a tile never leave the program, masked keys get -inf before the max is taken, and the division by the running sum happens once, after the last tile.
        # Hint 2: Load the query block through a row mask; start the max at minus infinity and the sum and accumulator at zero in float32; compute the loop's end as in 5.2 (Triton's minimum) when causal; for each tile build the key offsets, load K and V with a row mask, multiply the queries by the transposed keys and scale, keep scores whose key exists (and, if causal, is not after the query) and set the rest to minus infinity, then do 5.1's update with Triton's max, exp, sum and dot (given the precision too); after the loop divide, store the output and max plus log of sum through row masks.
        q = tl.load(q_ptrs, mask=offs_m[:, None] < q_len, other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        offset = kv_len - q_len
        end = kv_len
        if CAUSAL:
            end = tl.minimum(kv_len, offset + (block + 1) * BLOCK_M)
        for start in range(0, end, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            rows_exist = offs_n[:, None] < kv_len
            k = tl.load(k_base + offs_n[:, None] * stride_ks + offs_d[None, :], mask=rows_exist, other=0.0)
            v = tl.load(v_base + offs_n[:, None] * stride_vs + offs_d[None, :], mask=rows_exist, other=0.0)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            visible = offs_n[None, :] < kv_len
            if CAUSAL:
                visible = visible & (offs_n[None, :] <= offset + offs_m[:, None])
            scores = tl.where(visible, scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(scores - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=offs_m[:, None] < q_len)
        tl.store(lse_ptrs, m_i + tl.log(l_i), mask=offs_m < q_len)
        # END EXERCISE 5.5


# %%
# export: flash_attention
def interpreted() -> bool:
    """Whether kernels run in Triton's CPU interpreter: it reads CPU tensors and computes bfloat16
    wrongly, where compiled kernels read GPU memory only, so the callers choose by it."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
    block_m: int | None = None, block_n: int | None = None,
    out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel: q (B, Hq, S, D), k/v (B, Hkv, T, D) -> out (B, Hq, S, D), lse (B, Hq, S).

    ``out`` and ``lse`` (contiguous) may be given, as for ``scale_vector``: the checks pass views
    of larger guarded buffers, so that a store past the end lands where they can see it. The
    device is the tensors' own (from torch), never Triton's "active driver", which does not exist
    on a machine without a GPU.
    """
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed (it has no macOS build): use tiled_attention")
    if interpreted() and q.dtype == torch.bfloat16:
        raise TypeError("bfloat16 is computed wrongly by the Triton interpreter (NumPy has no "
                        "bfloat16): use float16 or float32 on a CPU")
    if not interpreted() and not all(t.is_cuda for t in (q, k, v)):
        raise ValueError(f"compiled Triton reads GPU memory only, and q, k, v are on {q.device}, "
                         f"{k.device}, {v.device}: move them to CUDA (or use tiled_attention)")
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"q must be (B, Hq, S, D) and k, v (B, Hkv, T, D) of one shape; got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    batch, heads, q_len, head_dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    if k.shape[0] != batch or k.shape[3] != head_dim or heads % kv_heads or (causal and q_len > kv_len):
        raise ValueError(f"q {tuple(q.shape)} does not fit k/v {tuple(k.shape)}: the batch and "
                         "head_dim must match, Hq be a multiple of Hkv, and (causal) S at most T")
    if head_dim not in (16, 32, 64, 128):
        raise ValueError(f"head_dim must be 16, 32, 64 or 128 (tl.dot needs ≥ 16), got {head_dim}")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    block_m = block_m or (16 if interpreted() else 64)
    block_n = block_n or (16 if interpreted() else 64)
    out = torch.empty_like(q) if out is None else out
    lse = torch.empty(batch, heads, q_len, dtype=torch.float32, device=q.device) if lse is None else lse
    if out.shape != q.shape or out.stride(-1) != 1 or lse.shape != (batch, heads, q_len) \
            or not lse.is_contiguous() or lse.dtype != torch.float32:
        raise ValueError(f"out must be {tuple(q.shape)} with contiguous rows and lse a contiguous "
                         f"float32 {(batch, heads, q_len)}; got {tuple(out.shape)}, {tuple(lse.shape)}")
    groups = heads // kv_heads
    q_grouped, out_grouped = group_queries(q, kv_heads), group_queries(out, kv_heads)  # (B, Hkv, G, S, D)
    if out_grouped.data_ptr() != out.data_ptr():
        raise ValueError("group_queries (exercise 2.3) returned a copy: the kernel writes the output "
                         "through its result, which must be a view of the tensor it was given")
    grid = (triton.cdiv(q_len, block_m), batch * kv_heads, groups)
    _flash_forward[grid](
        q_grouped, k, v, out_grouped, lse,
        *q_grouped.stride()[:4], *k.stride()[:3], *v.stride()[:3], *out_grouped.stride()[:4],
        q_len, kv_len, kv_heads, groups, head_dim**-0.5,
        CAUSAL=causal, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=head_dim,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    return out, lse


def flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """An attention kernel for the model (``attention=flash_attention``): the Triton kernel where it
    can run these tensors, else the tiled PyTorch version (no Triton; CPU tensors with a compiled
    Triton; bfloat16 under the interpreter, which computes it wrongly)."""
    if mask is not None:
        raise ValueError("the flash kernel computes causal attention without a padding mask; for padded "
                         "batches and engine steps use sdpa_attention or stage 02's manual_attention")
    kernel_runs = HAS_TRITON and (
        q.is_cuda or (interpreted() and q.dtype != torch.bfloat16))
    fn = triton_flash_attention if kernel_runs else tiled_attention
    return fn(q, k, v, causal=q.shape[-2] > 1)[0]


# %%
# Check exercise 5.5
checks.stage05.check_flash_kernel(triton_flash_attention, HAS_TRITON)

# %% [markdown]
# The kernel also stores each row's log-sum-exp `m + log(l)`. The backward pass of flash
# attention needs it: with it, the probabilities of any tile can be recomputed from the scores
# without storing them. It is a second output to compare, not a proof that the kernel tiled
# anything: the log-sum-exp of the full score matrix (computed below with the whole matrix in
# memory) gives the same numbers. Let us compare both outputs with PyTorch's, in the dtypes the
# interpreter handles.

# %%
device = "cuda" if torch.cuda.is_available() else "cpu"  # a compiled kernel reads GPU memory only
if HAS_TRITON:
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
        for causal in (True, False):
            q = torch.randn(1, 9, 37, 64).to(dtype)
            k, v = torch.randn(1, 3, 37, 64).to(dtype), torch.randn(1, 3, 37, 64).to(dtype)
            out, lse = (t.cpu() for t in triton_flash_attention(
                q.to(device), k.to(device), v.to(device), causal=causal))
            error = (out.float() - sdpa(q.float(), k.float(), v.float(), causal)).abs().max().item()
            mask = torch.ones(37, 37, dtype=torch.bool).tril() if causal else torch.ones(37, 37, dtype=torch.bool)
            scores = (q.float() @ k.float().repeat_interleave(3, 1).transpose(-1, -2)) / 8
            lse_ok = torch.allclose(lse, torch.logsumexp(scores.masked_fill(~mask, float("-inf")), -1), atol=1e-3)
            print(f"{str(dtype):14} causal={causal!s:5}  max error ≤ {tolerance}: {error <= tolerance}  lse ok: {lse_ok}")
else:
    print("triton is not available here: the tiled PyTorch version stands in for the kernel")

# %% [markdown]
# ## 7. Decoding: one query in a block of 64
#
# In decoding, `q_len = 1`: each program still holds a `BLOCK_M × D` block of queries and
# computes `BLOCK_M × BLOCK_N` scores per tile, of which one row is real. The grid has one
# program per query head and sequence, which is far too few to keep a GPU's many cores busy, and
# each program walks the whole cache alone:

# %%
BLOCK_M = 64  # the kernel's query block on a GPU
for q_len in (1, 16, 100):
    blocks = math.ceil(q_len / BLOCK_M)
    print(f"q_len {q_len:>3}: {blocks} query block(s), {1 - q_len / (blocks * BLOCK_M):.1%} of the "
          "query rows computed are padding")
print("programs for one decode step of one sequence (grid = 1 × Hkv × G):", 1 * 3 * 3)

# %% [markdown]
# 98.4% of the work of a decode step is thrown away, and nine programs leave most of the GPU idle.
# That is why decoding uses a different split: **split-KV** ("flash-decoding") gives each program
# a *slice of the keys* instead of a block of queries, and combines the slices' partial results
# with the same rescaling as 5.1 (each slice returns its `m`, `l` and `acc`). Stage 07's paged
# attention meets the same question again.
#
# ## 8. Speed on a GPU
#
# On a CUDA GPU the kernel compiles, and the cell below times it against PyTorch's SDPA (which
# calls a flash-attention kernel of its own) for a prefill and a decode step. Without a GPU there
# is nothing meaningful to time: the interpreter runs one program at a time in NumPy.

# %%
# export: flash_attention
def gpu_milliseconds(fns: list[Callable[[], object]], repeats: int = 20) -> list[float]:
    """Median milliseconds of each of ``fns`` on the GPU, timed in turn within every repeat.

    CUDA events around each call time the GPU's queue, not the host; one warm-up call each
    compiles the kernels; and alternating the functions inside each repeat gives none of them
    the quieter half of a shared machine's run.
    """
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, samples in zip(fns, times):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end))
    return [sorted(samples)[len(samples) // 2] for samples in times]


# %%
# NBVAL_IGNORE_OUTPUT
if HAS_TRITON and torch.cuda.is_available():
    print(torch.cuda.get_device_name(), "bfloat16, B=1, Hq=9, Hkv=3, D=64")
    for name, q_len, kv_len in (("prefill", 4096, 4096), ("decode", 1, 4096)):
        q = torch.randn(1, 9, q_len, 64, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(1, 3, kv_len, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        causal = q_len > 1
        ours, theirs = gpu_milliseconds([
            lambda: triton_flash_attention(q, k, v, causal=causal),
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)])
        print(f"{name:8} ours {ours:7.3f} ms   SDPA {theirs:7.3f} ms   SDPA / ours {theirs / ours:5.2f}")
else:
    print("speed comparison skipped:",
          "no triton here" if not HAS_TRITON else "no CUDA GPU here (the interpreter times NumPy, not a GPU)")

# %% [markdown]
# `benchmarks/flash_attention.py` measures the kernel's TFLOP/s against SDPA across sequence
# lengths.
#
# ## 9. Inside the model
#
# `flash_attention` has the model's kernel signature, like stage 02's. For decoding (`q_len = 1`
# against the KV cache) the same kernel runs with one query block; the causal offset makes the
# single query see every cached key. It runs the Triton kernel only where it can: on CUDA
# tensors, or on CPU tensors under the interpreter in float32 or float16; elsewhere (CPU tensors
# with a compiled Triton, bfloat16 under the interpreter, no Triton) it runs `tiled_attention`.
# The model goes where the kernel runs. A short greedy generation must give exactly the tokens of
# PyTorch's SDPA kernel:

# %%
from aie_lessons.cached_generate import generate_cached
from aie_lessons.sampling import SamplingParams
from aie_lessons.model import LlamaModel, sdpa_attention
from aie_lessons.infra.paths import default_model_dir
from aie_lessons.tokenizer import Tokenizer

model = LlamaModel.from_pretrained(default_model_dir(), device=device)  # the kernel's device
tokenizer = Tokenizer.from_pretrained(default_model_dir())
prompt = [tokenizer.encode_chat("What is the capital of France?")]
params = SamplingParams(max_new_tokens=4)
reference = generate_cached(model, tokenizer, prompt, params)[0]
model.use_attention(flash_attention)
start = time.perf_counter()
flash = generate_cached(model, tokenizer, prompt, params)[0]
elapsed = time.perf_counter() - start
model.use_attention(sdpa_attention)
print(repr(flash.text))
print("flash kernel gives the SDPA kernel's tokens:", flash.token_ids == reference.token_ids)

# %%
# NBVAL_IGNORE_OUTPUT
print(f"{len(flash.token_ids)} tokens in {elapsed:.1f} s "
      f"({'Triton interpreter' if HAS_TRITON and interpreted() else 'compiled' if HAS_TRITON else 'PyTorch tiles'})")

# %% [markdown]
# Under the interpreter that is slow — every program of every layer runs in NumPy.
#
# ## Summary
#
# | piece | what it does |
# |---|---|
# | `online_softmax_update` | running max, rescaled sum and accumulator |
# | `causal_key_end` | skips key blocks entirely in the future |
# | `tiled_attention` | the algorithm in PyTorch: O(S) memory |
# | `_scale_kernel`, `_softmax_rows_kernel` | Triton's blocks, masks and reductions |
# | `_flash_forward` | the kernel: scores stay on the chip; tail and causal masks, GQA, log-sum-exp |
# | `flash_attention` | a kernel for the model: `attention=flash_attention` |
