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
# instead of O(S²).
#
# You write it first in PyTorch, then as a Triton kernel, and plug it into the model.

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
# PyTorch version only.

# %%
import time

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F

from aie_lessons import checks
from aie_lessons.model import register_attention_backend

torch.manual_seed(0)

# %% [markdown]
# ## 1. The online-softmax update
#
# ### Exercise 5.1

# %%
# export: flash_attention
"""Flash attention: tiled online softmax in PyTorch, and the same algorithm as a Triton kernel."""

from __future__ import annotations

import importlib.util
import os
import sys

import torch

if not torch.cuda.is_available() and "triton" not in sys.modules:
    # The interpreter must be chosen before triton is imported; with no GPU it is the only option.
    os.environ.setdefault("TRITON_INTERPRET", "1")
HAS_TRITON = importlib.util.find_spec("triton") is not None
if HAS_TRITON:
    import triton
    import triton.language as tl


def online_softmax_update(
    m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor, scores: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fold one block of scores (..., M, N) and values (..., N, D) into the running (m, l, acc).

    m, l are (..., M); acc is (..., M, D). Masked scores are -inf.
    """
    # BEGIN EXERCISE 5.1: new max, rescale the old l and acc by exp(m − m_new), add the block
    # Hint 1: The online softmax keeps a running max m, a running sum l and an unnormalised output; when the max grows, what was accumulated so far is rescaled by exp(m_old − m_new).
    # Hint 2: m_new = max(m, rowmax(scores)); p = exp(scores − m_new[..., None]); l_new = l·alpha + p.sum(-1); acc_new = acc·alpha[..., None] + p @ v, with alpha = exp(m − m_new).
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

# %%
# export: flash_attention
def causal_key_end(q_start: int, block_m: int, q_len: int, kv_len: int) -> int:
    """One past the last key that query block [q_start, q_start + block_m) may see."""
    # BEGIN EXERCISE 5.2: the block's last query is at position (kv_len − q_len) + q_start + block_m − 1; keys up to it are visible; never past kv_len
    # Hint 1: Under a causal mask, a block of queries sees no key beyond the position of its last query, so the key loop can stop there.
    # Hint 2: min(kv_len, kv_len − q_len + q_start + block_m).
    return min(kv_len, kv_len - q_len + q_start + block_m)
    # END EXERCISE 5.2


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
    q = q.view(batch, kv_heads, heads // kv_heads, q_len, head_dim).float() * head_dim**-0.5
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
# Check exercise 5.2
checks.stage05.check_causal_key_end(causal_key_end)

# %%
def sdpa(q, k, v, causal=True):
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
else:
    print("peak-memory measurement needs Linux (/proc/self/clear_refs)")

# %% [markdown]
# The naive curve grows 4× each time S doubles: the S × S scores. The tiled one stays near zero
# at this scale — its extra memory is the output (S × D, 4 MiB at S = 4096) and one block of
# scores, which the allocator serves from memory it already holds.
#
# ## 4. The same algorithm as a Triton kernel
#
# A Triton *program* handles one block of `BLOCK_M` queries of one head. The grid launches one
# program per (query block, batch × head). Inside, `tl.load` reads a block of a tensor through
# pointers; `mask=` makes loads past the end of the tensor safe. The last key block usually runs
# past `kv_len` (100 keys in blocks of 32 leave a tail of 4): those scores must be masked out, or
# the padding — loaded as zeros — gets softmax weight.
#
# ### Exercise 5.3 — the tail mask

# %%
# export: flash_attention
if HAS_TRITON:

    @triton.jit
    def _flash_forward(
        Q, K, V, O, LSE,
        stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
        stride_vb, stride_vh, stride_vs, stride_ob, stride_oh, stride_os,
        q_len, kv_len, num_heads, groups, scale,
        CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        HEAD_DIM: tl.constexpr, PRECISION: tl.constexpr,
    ):
        block = tl.program_id(0)
        batch_head = tl.program_id(1)
        b, h = batch_head // num_heads, batch_head % num_heads
        kv_h = h // groups  # grouped-query attention: G consecutive heads share a kv head
        offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        q_ptrs = Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :]
        q = tl.load(q_ptrs, mask=offs_m[:, None] < q_len, other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        offset = kv_len - q_len
        end = kv_len
        if CAUSAL:  # the causal block skip of exercise 5.2
            end = tl.minimum(kv_len, offset + (block + 1) * BLOCK_M)
        k_base = K + b * stride_kb + kv_h * stride_kh
        v_base = V + b * stride_vb + kv_h * stride_vh
        for start in range(0, end, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            k = tl.load(k_base + offs_n[:, None] * stride_ks + offs_d[None, :],
                        mask=offs_n[:, None] < kv_len, other=0.0)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # (BLOCK_M, BLOCK_N)
            # BEGIN EXERCISE 5.3: keep only real keys (offs_n < kv_len) and, if CAUSAL, keys at or before each query's position offset + offs_m
            # Hint 1: A score must be dropped when its key is past the end of the sequence (a partial last tile) or, with CAUSAL, after the query's own position.
            # Hint 2: valid = offs_n[None, :] < kv_len; valid &= offs_n[None, :] <= offset + offs_m[:, None]; scores = tl.where(valid, scores, float("-inf")).
            valid = offs_n[None, :] < kv_len
            if CAUSAL:
                valid = valid & (offs_n[None, :] <= offset + offs_m[:, None])
            scores = tl.where(valid, scores, float("-inf"))
            # END EXERCISE 5.3
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(scores - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_base + offs_n[:, None] * stride_vs + offs_d[None, :],
                        mask=offs_n[:, None] < kv_len, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        acc = acc / l_i[:, None]
        o_ptrs = O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :]
        tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=offs_m[:, None] < q_len)
        tl.store(LSE + batch_head * q_len + offs_m, m_i + tl.log(l_i), mask=offs_m < q_len)


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
    block_m: int | None = None, block_n: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel: q (B, Hq, S, D), k/v (B, Hkv, T, D) -> out (B, Hq, S, D), lse (B, Hq, S).

    The device is the tensors' own (from torch), never Triton's "active driver", which does not
    exist on a machine without a GPU.
    """
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed (it has no macOS build): use tiled_attention")
    if interpreted() and q.dtype == torch.bfloat16:
        raise TypeError("bfloat16 is computed wrongly by the Triton interpreter (NumPy has no "
                        "bfloat16): use float16 or float32 on a CPU")
    batch, heads, q_len, head_dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    if head_dim not in (16, 32, 64, 128) or heads % kv_heads or k.shape != v.shape:
        raise ValueError(f"unsupported shapes q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}: head_dim must be 16/32/64/128 and Hq a multiple of Hkv")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    block_m = block_m or (16 if interpreted() else 64)
    block_n = block_n or (16 if interpreted() else 64)
    out = torch.empty_like(q)
    lse = torch.empty(batch, heads, q_len, dtype=torch.float32, device=q.device)
    grid = (triton.cdiv(q_len, block_m), batch * heads)
    _flash_forward[grid](
        q, k, v, out, lse,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        q_len, kv_len, heads, heads // kv_heads, head_dim**-0.5,
        CAUSAL=causal, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=head_dim,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    return out, lse


@register_attention_backend("flash")
def flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """The model's "flash" backend: Triton where it exists, the tiled PyTorch version elsewhere."""
    if mask is not None:
        raise ValueError("the flash backend computes causal attention without a padding mask; "
                         "for padded batches use the 'sdpa' or 'manual' backend")
    fn = triton_flash_attention if HAS_TRITON else tiled_attention
    return fn(q, k, v, causal=q.shape[-2] > 1)[0]


# %%
# Check exercise 5.3
checks.stage05.check_flash_kernel(triton_flash_attention, HAS_TRITON)

# %% [markdown]
# The kernel also stores each row's log-sum-exp `m + log(l)`. The backward pass of flash
# attention needs it, and it proves the kernel ran the online softmax: no other way of computing
# the output produces it. Let us compare everything with PyTorch's attention, in the dtypes the
# interpreter handles.

# %%
if HAS_TRITON:
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
        for causal in (True, False):
            q = torch.randn(1, 9, 37, 64).to(dtype)
            k, v = torch.randn(1, 3, 37, 64).to(dtype), torch.randn(1, 3, 37, 64).to(dtype)
            out, lse = triton_flash_attention(q, k, v, causal=causal)
            error = (out.float() - sdpa(q.float(), k.float(), v.float(), causal)).abs().max().item()
            mask = torch.ones(37, 37, dtype=torch.bool).tril() if causal else torch.ones(37, 37, dtype=torch.bool)
            scores = (q.float() @ k.float().repeat_interleave(3, 1).transpose(-1, -2)) / 8
            lse_ok = torch.allclose(lse, torch.logsumexp(scores.masked_fill(~mask, float("-inf")), -1), atol=1e-3)
            print(f"{str(dtype):14} causal={causal!s:5}  max error ≤ {tolerance}: {error <= tolerance}  lse ok: {lse_ok}")
else:
    print("triton is not available here: the tiled PyTorch version stands in for the kernel")

# %% [markdown]
# ## 5. Inside the model
#
# `flash_attention` registered itself as the backend `"flash"`. For decoding (`q_len = 1`
# against the KV cache) the same kernel runs with one query block; the causal offset makes the
# single query see every cached key. A short greedy generation must give exactly the tokens of
# PyTorch's SDPA backend:

# %%
from aie_lessons.cached_generate import generate_cached
from aie_lessons.sampling import SamplingParams
from aie_lessons.model import LlamaModel
from aie_lessons.infra.paths import default_model_dir
from aie_lessons.tokenizer import Tokenizer

model = LlamaModel.from_pretrained(default_model_dir())
tokenizer = Tokenizer.from_pretrained(default_model_dir())
prompt = [tokenizer.encode_chat("What is the capital of France?")]
params = SamplingParams(max_new_tokens=6)
model.set_attention_backend("sdpa")
reference = generate_cached(model, tokenizer, prompt, params)[0]
model.set_attention_backend("flash")
start = time.perf_counter()
flash = generate_cached(model, tokenizer, prompt, params)[0]
elapsed = time.perf_counter() - start
model.set_attention_backend("sdpa")
print(repr(flash.text))
print("flash backend gives the SDPA backend's tokens:", flash.token_ids == reference.token_ids)

# %%
# NBVAL_IGNORE_OUTPUT
print(f"{len(flash.token_ids)} tokens in {elapsed:.1f} s "
      f"({'Triton interpreter' if HAS_TRITON and interpreted() else 'compiled' if HAS_TRITON else 'PyTorch tiles'})")

# %% [markdown]
# Under the interpreter that is slow — every program of every layer runs in NumPy. On a GPU the
# same kernel compiles; `benchmarks/flash_attention.py` measures its TFLOP/s against PyTorch's
# SDPA across sequence lengths.
#
# ## Summary
#
# | piece | what it does |
# |---|---|
# | `online_softmax_update` | running max, rescaled sum and accumulator |
# | `causal_key_end` | skips key blocks entirely in the future |
# | `tiled_attention` | the algorithm in PyTorch: O(S) memory |
# | `_flash_forward` | the Triton kernel: tail and causal masks, GQA, log-sum-exp |
# | `flash_attention` | the model's `"flash"` backend |
