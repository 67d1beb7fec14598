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
# # Stage 02 — Attention by hand, every shape checked
#
# In stage 01 attention was one library call. Now you write it yourself, and because attention
# is a chain of reshapes where one wrong `transpose` still produces a tensor of plausible size
# (and a model that talks nonsense), every step checks its shape as it goes:
#
# ```
#  x (B, S, H·D)
#   ├─ q_proj ─► (B, S, Hq·D)  ─ split heads ─► q (B, Hq, S, D) ─ RoPE ─┐
#   ├─ k_proj ─► (B, S, Hkv·D) ─ split heads ─► k (B, Hkv, T, D) ─ RoPE ─┤
#   └─ v_proj ─► (B, S, Hkv·D) ─ split heads ─► v (B, Hkv, T, D) ────────┤  (no RoPE on v)
#                                                                        ▼
#        scores = q·kᵀ/√D (B, Hq, S, T) ─ mask ─ softmax ─ · v ─► (B, Hq, S, D)
#                                                                        │
#                                  merge heads ─► (B, S, Hq·D) ─ o_proj ─► (B, S, H·D)
# ```
#
# B is the batch, S the number of new positions (queries), T the number of positions attended
# to (keys; T = S until stage 04 adds a cache), Hq = 9 query heads, Hkv = 3 key/value heads,
# D = 64 the head size.

# %%
# Stages you committed with `aie commit` are imported below; this checks them first.
from aie_lessons.course.progress import verify_committed_stages

verify_committed_stages(before="02")

# %%
import math

import matplotlib.pyplot as plt
import torch

from aie_lessons import checks
from aie_lessons.model import (
    Attention,
    LlamaModel,
    apply_rope,
    rope_cos_sin,
    sdpa_attention,
)
from aie_lessons.infra.paths import default_model_dir

torch.manual_seed(0)
MODEL_DIR = default_model_dir()
model = LlamaModel.from_pretrained(MODEL_DIR)
config = model.config

# %% [markdown]
# ## 1. A shape checker
#
# Shapes are named with letters. The first time a letter is seen it is *bound* to that size;
# every later tensor must agree. A product such as `H*D` is checked too. A wrong shape stops the
# program with the tensor's name, the expected symbolic shape with its values, and what arrived.

# %%
# export: shapes
"""Runtime shape checks with named dimensions: ``dims.check("q", q, "B H S D")``."""

from __future__ import annotations

import math

import torch


class ShapeError(ValueError):
    """A tensor's shape differs from its symbolic shape; the message shows both."""


class Dims:
    """Named sizes, bound the first time they are seen and checked every time after.

    ``Dims(H=9, D=64)`` starts with two sizes known; ``check("q", q, "B H S D")`` binds B and S
    from q and verifies H and D. A symbol may be a product of others, such as ``H*D``.
    """

    def __init__(self, **known: int):
        self.sizes: dict[str, int] = dict(known)

    def _expected(self, symbol: str) -> int | None:
        if symbol.isdigit():
            return int(symbol)
        parts = symbol.split("*")
        if all(p in self.sizes for p in parts):
            return math.prod(self.sizes[p] for p in parts)
        return None

    def check(self, name: str, tensor: torch.Tensor, spec: str) -> torch.Tensor:
        symbols = spec.split()
        shape = tuple(tensor.shape)
        expected = [self._expected(s) for s in symbols]
        wrong_rank = len(shape) != len(symbols)
        if wrong_rank or any(e is not None and e != n for e, n in zip(expected, shape)):
            values = ", ".join("?" if e is None else str(e) for e in expected)
            raise ShapeError(
                f"{name}: expected ({', '.join(symbols)}) = ({values}), got {shape}"
            )
        for symbol, size in zip(symbols, shape):
            if "*" not in symbol and not symbol.isdigit():
                self.sizes.setdefault(symbol, size)
        return tensor


# %%
dims = Dims(Hq=config.num_heads, D=config.head_dim)
dims.check("q", torch.zeros(2, 9, 7, 64), "B Hq S D")
try:
    dims.check("q", torch.zeros(2, 7, 9, 64), "B Hq S D")
except ShapeError as error:
    print("ShapeError:", error)

# %% [markdown]
# ## 2. Splitting heads
#
# A projection produces one long vector per position: `(B, S, Hq·D)`. Attention needs each head
# on its own: `(B, Hq, S, D)`. The projection's outputs are laid out head after head, so the last
# axis holds `(H, D)`; only after it is split may the heads move in front of the positions.
# Reading the same numbers directly as `(B, H, S, D)` has the right size and the wrong meaning:
# it mixes positions into heads.

# %%
# export: attention
"""Attention written by hand: grouped-query, masked, with every reshape shape-checked."""

from __future__ import annotations

import torch

# A mask fills forbidden scores with float32's most negative number, not -inf: a row whose every
# key is masked then gives a uniform softmax instead of 0/0 = NaN. Only a float32 tensor can hold
# it (fp16 and bf16 overflow), so scores are masked after they are turned into float32.
MASKED = torch.finfo(torch.float32).min


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """(B, H, S, D) -> (B, S, H·D): the inverse of ``split_heads``, ready for ``o_proj``."""
    batch, heads, seq, head_dim = x.shape
    return x.transpose(1, 2).reshape(batch, seq, heads * head_dim)


# %% [markdown]
# ### Exercise 2.1 — split the heads
#
# `split_heads(x, num_heads)` takes `x` of shape `(B, S, H·D)` and returns `(B, H, S, D)`, where
# `result[b, h, s]` is head `h`'s slice of position `s`: `x[b, s, h·D:(h+1)·D]`. Return a view
# (no copy is needed). `merge_heads` above is its inverse.

# %%
# export: attention
def split_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(B, S, H·D) -> (B, H, S, D): one sequence of vectors per head."""
    batch, seq, width = x.shape
    # BEGIN EXERCISE 2.1: return x as (B, H, S, D), head h holding features h·D … h·D + D − 1 of every position
    # Hint 1: The last axis is H blocks of D features, one block per head; a head's positions must then form their own (S, D) matrix so that matmul can batch over heads.
    # Hint 2: Reshape the last axis into two axes (heads, then features) without copying, and swap the position axis with the new head axis.
    return x.view(batch, seq, num_heads, width // num_heads).transpose(1, 2)
    # END EXERCISE 2.1


# %%
# Check exercise 2.1
checks.stage02.check_split_heads(split_heads, merge_heads)

# %% [markdown]
# ## 3. RoPE, and why the converter permuted rows
#
# RoPE rotates pairs of coordinates of q and k by an angle proportional to the position. The
# model was trained with one particular pairing, and any pairing works *if the weights agree with
# it*. HuggingFace's code pairs coordinate `i` with `i + D/2` ("rotate half"); Meta's original
# code and llama.cpp pair neighbours `(0, 1), (2, 3), ...` ("interleaved").
#
# A pairing is only a choice of where each coordinate sits, so the two are the same computation
# with the rows of the q and k projections reordered. That is what llama.cpp's converter does
# when it writes GGUF, and what our converter undid. Let us verify it on layer 0: interleaved
# RoPE on GGUF-ordered weights gives exactly the attention scores of rotate-half RoPE on
# HuggingFace-ordered weights.

# %%
def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on adjacent pairs (x0, x1), (x2, x3), ...; cos/sin as built for rotate-half."""
    half = x.shape[-1] // 2
    c, s = cos[..., :half].unsqueeze(1), sin[..., :half].unsqueeze(1)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * c - odd * s, even * s + odd * c], dim=-1).flatten(-2)


def to_gguf_row_order(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Within each head, interleave the rows of the two halves: (0, D/2, 1, D/2 + 1, ...)."""
    rows, cols = weight.shape
    return weight.view(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)


attn0 = model.layers[0].self_attn
x = torch.randn(1, 6, config.hidden_size)
Hq, Hkv = config.num_heads, config.num_kv_heads


def rope_at(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's cos and sin tables for one sequence at the given integer positions."""
    return rope_cos_sin(positions[None], config.head_dim, config.rope_theta)


def scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Unscaled q·kᵀ per query head, each reading its kv head (a copy of k: fine for 6 tokens)."""
    return q @ k.repeat_interleave(Hq // Hkv, dim=1).transpose(-1, -2)


cos, sin = rope_at(torch.arange(6))
with torch.no_grad():
    q_hf = split_heads(x @ attn0.q_proj.weight.T, Hq)
    k_hf = split_heads(x @ attn0.k_proj.weight.T, Hkv)
    q_gguf = split_heads(x @ to_gguf_row_order(attn0.q_proj.weight, Hq).T, Hq)
    k_gguf = split_heads(x @ to_gguf_row_order(attn0.k_proj.weight, Hkv).T, Hkv)
    hf = scores(apply_rope(q_hf, cos, sin), apply_rope(k_hf, cos, sin))
    gguf = scores(rope_interleaved(q_gguf, cos, sin), rope_interleaved(k_gguf, cos, sin))
    mixed = scores(apply_rope(q_gguf, cos, sin), apply_rope(k_gguf, cos, sin))
# float32 rounding grows with the scores (up to a few thousand here): compare relative to the largest.
same_scores = (hf - gguf).abs().max().item() <= 1e-5 * hf.abs().max().item()
print("interleaved RoPE on GGUF rows == rotate-half on HF rows:", same_scores)
print("rotate-half on GGUF rows (no conversion) is far off:", (hf - mixed).abs().max().item() > 1)

# %% [markdown]
# Why rotate at all? A rotation by angle `mθ` of q and by `nθ` of k leaves their dot product
# depending on the *difference* of the angles only: the score of a query at position m and a key
# at position n depends on `m − n`, not on where the pair sits in the text. Check it on layer 0:
# move the same six tokens to positions 100 … 105, or 1000 … 1005, and every score stays the
# same up to float32 rounding (0.0000 of the largest score); move only the keys and the scores
# change by about as much as the largest score itself.

# %%
with torch.no_grad():
    base = scores(*(apply_rope(t, *rope_at(torch.arange(6))) for t in (q_hf, k_hf)))
    largest = base.abs().max().item()
    for shift in (100, 1000):
        moved = scores(*(apply_rope(t, *rope_at(torch.arange(6) + shift)) for t in (q_hf, k_hf)))
        print(f"q and k shifted by {shift:4}: max |Δscore| / max |score| = {(moved - base).abs().max().item() / largest:.4f}")
    keys_only = scores(apply_rope(q_hf, *rope_at(torch.arange(6))), apply_rope(k_hf, *rope_at(torch.arange(6) + 3)))
    print(f"only k shifted by 3:     max |Δscore| / max |score| = {(keys_only - base).abs().max().item() / largest:.2f}")

# %% [markdown]
# Only q and k are rotated: their dot product is where relative position matters. The values v
# are *what* gets mixed, not *where from*; rotating them would scramble the output by position.
#
# ## 4. Scores, their scale, and the softmax
#
# A score `q·k` is a sum of D products. For random vectors with unit-variance coordinates its
# spread grows like √D, and a softmax over large scores puts almost all the weight on one key.
# Measure both, for 16 keys, with and without dividing the scores by √D:

# %%
g = torch.Generator().manual_seed(0)
print("   D   std(q·k)    √D   mean largest weight: unscaled   scaled by 1/√D")
for d in (16, 64, 256):
    q_rand = torch.randn(2048, 1, d, generator=g)
    k_rand = torch.randn(2048, 16, d, generator=g)
    raw = (q_rand * k_rand).sum(-1)  # (2048 queries, 16 keys)
    top_raw = torch.softmax(raw, -1).max(-1).values.mean().item()
    top_scaled = torch.softmax(raw / d**0.5, -1).max(-1).values.mean().item()
    print(f"{d:4} {raw.std().item():10.1f} {d**0.5:5.0f} {top_raw:25.2f} {top_scaled:16.2f}")

# %% [markdown]
# The measured spread of `q·k` is 4.0, 8.0 and 15.9: √D. Without scaling, the largest of 16
# weights takes 0.68 of the total at D = 16 and 0.92 at D = 256: the softmax saturates, attends to one key
# and its gradient vanishes. Divided by √D, the scores have spread 1 at every D and the largest
# weight stays at 0.24–0.25. The scale is applied *before* the softmax, and so is the mask: a
# forbidden score is set to `MASKED`, so its weight is exactly 0.
#
# ### Exercise 2.2 — attention weights
#
# `attention_weights(q, k, mask)` takes q `(…, S, D)`, k `(…, T, D)` and a boolean mask that
# broadcasts to `(…, S, T)` (True = may attend; `None` = no restriction). It returns the
# `(…, S, T)` weights softmax(q·kᵀ/√D) over the keys, forbidden keys at weight 0, in q's dtype.
# The softmax runs in float32 whatever q's dtype, and the function must work for float32,
# bfloat16 and float16 inputs.

# %%
# export: attention
def attention_weights(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """softmax(q·kᵀ / √D) over keys, with forbidden (mask False) scores removed.

    q is (..., S, D), k is (..., T, D); mask broadcasts to (..., S, T). Returns (..., S, T).
    """
    # BEGIN EXERCISE 2.2: the (…, S, T) softmax weights of q·kᵀ/√D over the keys, forbidden keys at weight 0, in q's dtype
    # Hint 1: Scaled similarity first, then forbidden scores pushed so low that their exponential is 0, then a normalisation over keys; low precision cannot hold MASKED, float32 can.
    # Hint 2: Multiply the batched product of q and k-transposed by the inverse square root of the head size, convert to float32, fill the positions where the mask is False with MASKED, softmax over the last axis, convert back.
    scores = (q @ k.transpose(-1, -2)).float() * q.shape[-1] ** -0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, MASKED)
    return torch.softmax(scores, dim=-1).to(q.dtype)
    # END EXERCISE 2.2


# %%
# Check exercise 2.2
checks.stage02.check_attention_weights(attention_weights)

# %% [markdown]
# ## 5. Grouped-query attention, and what a copy costs
#
# SmolLM2 has 9 query heads but only 3 key/value heads: each k/v head serves a *group* of G = 3
# consecutive query heads (0–2 use kv head 0, 3–5 kv head 1, 6–8 kv head 2). That shrinks the
# KV cache 3× (stage 04). Copying k and v three times (`repeat_interleave`) would give that memory
# right back. The first step is to see the queries as `(B, Hkv, G, S, D)`: group `j` holds query
# heads `j·G … j·G + G − 1`.
#
# ### Exercise 2.3 — group the query heads
#
# `group_queries(q, num_kv_heads)` takes q `(B, Hq, S, D)` and returns `(B, Hkv, G, S, D)` with
# G = Hq / Hkv, where `result[b, j, g]` is query head `j·G + g`. Return a view of q, not a copy,
also for a q that is not contiguous: the model passes q as `split_heads` makes it, a transposed
`(B, S, Hq, D)`, and stage 05's kernel writes its output through this view.

# %%
# export: attention
def group_queries(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """(B, Hq, S, D) -> (B, Hkv, G, S, D), query head h landing in group h // G."""
    batch, heads, seq, head_dim = q.shape
    # BEGIN EXERCISE 2.3: q as (B, Hkv, G, S, D), group j holding query heads j·G … j·G + G − 1, without a copy
    # Hint 1: G consecutive query heads share one key/value head, so the head axis is really two axes: which kv head (outer), which member of its group (inner).
    # Hint 2: Split the head axis in place into two sizes, the number of kv heads first and the group size second, leaving the other axes alone.
    return q.view(batch, num_kv_heads, heads // num_kv_heads, seq, head_dim)
    # END EXERCISE 2.3


# %%
# Check exercise 2.3
checks.stage02.check_group_queries(group_queries)

# %% [markdown]
# With q grouped, it is tempting to give k a size-1 group axis, `k.unsqueeze(2)`, and let the
# matmul broadcast it over the G query heads. The result is right, but `torch.matmul` implements
# broadcasting by *expanding and copying* the broadcast operand. List the tensors each version
# creates for one decode step of the real model (1 query, 200 cached keys):

# %%
k_cache = torch.randn(1, Hkv, 200, config.head_dim)
q_step = torch.randn(1, Hq, 1, config.head_dim)
print("k:", tuple(k_cache.shape), k_cache.numel(), "numbers")
broadcast = checks.stage02.new_tensors(
    lambda q, k: group_queries(q, Hkv) @ k.unsqueeze(2).transpose(-1, -2), q_step, k_cache)
folded = checks.stage02.new_tensors(
    lambda q, k: q.reshape(1, Hkv, Hq // Hkv, config.head_dim) @ k.transpose(-1, -2), q_step, k_cache)
for name, created in (("broadcast over a group axis", broadcast), ("groups folded into rows", folded)):
    print(f"{name}: " + ", ".join(f"{op} {shape} = {math.prod(shape)} numbers" for op, shape in created))

# %% [markdown]
# The broadcast made a `clone` of k with G = 3 times its 38400 numbers (115200), at every layer
# of every step; the folded version creates nothing but its result.
# The copy-free way is to fold the group into the *query* axis: the G heads of group `j` all read
# the same keys, so their S queries each can be stacked as `G·S` rows of one matrix,
# `(B, Hkv, G·S, D)`, and multiplied by kv head `j`'s keys as they are. The scores come out as
# `(B, Hkv, G·S, T)`, which is a view of `(B, Hkv, G, S, T)`. A mask `(B, 1, S, T)` meets those
# scores once it has an axis for the group too, `(B, 1, 1, S, T)`: then it broadcasts over kv heads
# and groups without copying anything but itself. (Left 4-d, its batch axis would line up with the
# kv heads.)
#
# ## 6. The whole layer, checked end to end
#
# `attention_layer` runs the chain of the diagram at the top through the weights of one of the
# model's attention modules, checking every intermediate shape. The attention itself is
# `manual_attention`, exercise 2.5; until you write it, the check runs your layer with a
# reference attention.
#
# ### Exercise 2.4 — the attention layer
#
# `attention_layer(attn, x, cos, sin, mask=None)` takes x `(B, S, Hq·D)`, RoPE tables cos/sin
# `(B, S, D)` and an optional mask `(B|1, 1, S, S)`, and returns `(B, S, Hq·D)`: the output of
# `attn`'s attention, built from `attn.q_proj`, `attn.k_proj`, `attn.v_proj`, `attn.o_proj`,
# `split_heads`, `apply_rope`, `manual_attention` and `merge_heads`. RoPE goes only on the
# tensors whose dot product must depend on relative position. Check each intermediate with
# `dims` (q is `"B Hq S D"`, k and v `"B Hkv S D"`).

# %%
# export: attention
def attention_layer(
    attn: Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The diagram's chain for one layer: x (B, S, H·D) -> ... -> (B, S, H·D), every shape checked."""
    config = attn.config
    dims = Dims(Hq=config.num_heads, Hkv=config.num_kv_heads, D=config.head_dim)
    dims.check("x", x, "B S Hq*D")
    # BEGIN EXERCISE 2.4: attn's attention output for x, (B, S, Hq·D), every intermediate shape checked
    # Hint 1: Three projections give the queries, keys and values; positions enter only through the query·key match; attention mixes values per head; the heads are joined and projected back.
    # Hint 2: Project x three ways and split each into its number of heads (checking them), rotate the queries and keys only, call manual_attention with the mask, merge the heads, and finish with the output projection.
    q = dims.check("q", split_heads(attn.q_proj(x), dims.sizes["Hq"]), "B Hq S D")
    k = dims.check("k", split_heads(attn.k_proj(x), dims.sizes["Hkv"]), "B Hkv S D")
    v = dims.check("v", split_heads(attn.v_proj(x), dims.sizes["Hkv"]), "B Hkv S D")
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    out = dims.check("attention", manual_attention(q, k, v, mask), "B Hq S D")
    merged = dims.check("merged", merge_heads(out), "B S Hq*D")
    return dims.check("output", attn.o_proj(merged), "B S Hq*D")
    # END EXERCISE 2.4


# %%
# Check exercise 2.4
checks.stage02.check_attention_layer(attention_layer, model)

# %% [markdown]
# ## 7. The attention itself
#
# The heart of the stage. Kernels are called by the model as `fn(q, k, v, mask=...)` with
# q `(B, Hq, S, D)` and k, v `(B, Hkv, T, D)`; T ≥ S, because once stage 04 keeps a cache the S
# new queries are the *last* S of T positions (S = 1 when decoding one token).
#
# ### Exercise 2.5 — grouped-query attention without copies
#
# `manual_attention(q, k, v, mask=None)` returns `(B, Hq, S, D)` in q's dtype: for every query
# head h, softmax(q·kᵀ/√D) over the keys of kv head `h // G`, times that head's values.
#
# - Check the shapes of q, k and v with a `Dims()` first (`"B Hq S D"`, `"B Hkv T D"`), so that a
#   mismatch raises a `ShapeError` naming the tensor.
# - q arrives as the model makes it, `(B, S, Hq, D)` transposed to `(B, Hq, S, D)`: not
#   contiguous. k and v may come either that way or contiguous (from a cache, stage 04).
# - `mask` is boolean `(B|1, 1, S, T)`, True = may attend. To meet scores seen as
#   `(B, Hkv, G, S, T)` it needs a group axis, `(B|1, 1, 1, S, T)`; a 4-d mask's batch axis would
#   otherwise line up with the kv heads (silently wrong when B = Hkv). With no mask, attention is
#   causal: query i sits at position `T − S + i` and sees keys `0 … T − S + i`.
# - A query whose every key is masked gets finite weights (mask with `MASKED`, not −∞).
# - No copy of k or v, not even a hidden one: fold each group's query heads into rows (section 5).
# - Scores are masked and softmaxed in float32 whatever the input dtype (bf16 and fp16 included);
#   the weights go back to v's dtype before multiplying v.

# %%
# export: attention
def manual_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Attention by hand: q (B, Hq, S, D), k/v (B, Hkv, T, D), mask (B|1, 1, S, T) -> (B, Hq, S, D).

    Without a mask, query i may see keys up to its own position, counted from the end: with a
    cache the S new queries are the *last* S of the T positions. The G query heads that share a
    kv head are stacked as extra query rows, so k and v are read in place and never copied.
    """
    # BEGIN EXERCISE 2.5: every query head's attention over its kv head's keys and values, (B, Hq, S, D), shapes checked, no copy of k or v
    # Hint 1: The G query heads of a group read the same keys, so they are just more queries for that kv head: stacked as G·S rows, one plain matrix product per kv head does all of them, and the scores can be seen again as (B, Hkv, G, S, T) to meet the mask.
    # Hint 2: Work per kv head: its group's query heads become extra query rows, so one product against that head's keys scores them all and one product with its values mixes them; the rows are told apart again only where the mask (per query position) meets them, and at the end to give each query head its output.
    dims = Dims()
    dims.check("q", q, "B Hq S D")
    dims.check("k", k, "B Hkv T D")
    dims.check("v", v, "B Hkv T D")
    batch, heads, seq, head_dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    groups = heads // kv_heads
    if mask is None:
        mask = torch.ones(seq, kv_len, dtype=torch.bool, device=q.device).tril(kv_len - seq)
    elif mask.dim() == 4:
        mask = mask.unsqueeze(2)  # (B|1, 1, 1, S, T): broadcasts over kv heads and groups
    rows = q.reshape(batch, kv_heads, groups * seq, head_dim)  # copies q (small), never k
    scores = (rows @ k.transpose(-1, -2)).float() * head_dim ** -0.5  # (B, Hkv, G·S, T)
    scores = scores.view(batch, kv_heads, groups, seq, kv_len).masked_fill(~mask, MASKED)
    weights = torch.softmax(scores, dim=-1).to(v.dtype)
    out = weights.view(batch, kv_heads, groups * seq, kv_len) @ v  # (B, Hkv, G·S, D)
    return dims.check("out", out.view(batch, heads, seq, head_dim), "B Hq S D")
    # END EXERCISE 2.5


# %%
# Check exercise 2.5
checks.stage02.check_manual_attention(manual_attention)

# %% [markdown]
# ## 8. Your attention inside the model
#
# `manual_attention` is an attention kernel like PyTorch's: hand it to the model
# (`model.use_attention(manual_attention)`, or `attention=` when a model is built) and compare
# the logits with PyTorch's fused kernel on a real prompt, in float32 and in the two
# half-precision formats (the model computes in the dtype set by `model.activations`). float32
# may differ only by summation order, grown over 30 layers (allowed: 2e-5 of the largest logit);
# a half format is allowed 8 of its rounding steps (`eps`) at the size of the largest logit.
# A wrong attention is off by whole units.

# %%
from aie_lessons.tokenizer import Tokenizer

tokenizer = Tokenizer.from_pretrained(MODEL_DIR)
ids = torch.tensor([tokenizer.encode_chat("Why is the sky blue?")])
with torch.inference_mode():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        model.activations = dtype
        model.use_attention(sdpa_attention)
        reference = model(ids)
        model.use_attention(manual_attention)
        mine = model(ids)
        # fp32 differs by summation order only; a half format by a few of its rounding steps.
        bound = "2e-5·max|logit|" if dtype == torch.float32 else "8·eps·max|logit|"
        factor = 2e-5 if dtype == torch.float32 else 8 * torch.finfo(dtype).eps
        tolerance = factor * reference.abs().max().item()
        agree = (mine - reference).abs().max().item() <= tolerance
        print(f"{str(dtype):15} {ids.shape[1]} tokens: manual vs sdpa logits within {bound}: {agree}")
        if dtype == torch.float32:
            print("    same next token:", mine[0, -1].argmax().item() == reference[0, -1].argmax().item())
    model.activations = torch.float32

# %% [markdown]
# What the heads look at: the attention weights of layer 0 and a later layer for this prompt,
# one row per query token and one column per key token. Causal attention leaves the upper
# triangle empty. Layer 0 spreads its weight over many earlier tokens; layer 20 puts much of it
# on the very first token, whatever the query (an "attention sink").

# %%
@torch.inference_mode()
def layer_weights(layer_index: int) -> torch.Tensor:
    """Layer ``layer_index``'s attention weights (S, S) for ``ids``, head 0, from its input."""
    captured = {}
    attn = model.layers[layer_index].self_attn
    hook = attn.q_proj.register_forward_hook(lambda m, i, o: captured.setdefault("x", i[0]))
    model(ids)
    hook.remove()
    cos, sin = rope_at(torch.arange(ids.shape[1]))
    q = apply_rope(split_heads(attn.q_proj(captured["x"]), Hq), cos, sin)
    k = apply_rope(split_heads(attn.k_proj(captured["x"]), Hkv), cos, sin)
    causal = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool).tril()
    return attention_weights(q[:, :1], k[:, :1], causal)[0, 0]  # head 0 reads kv head 0


labels = [repr(tokenizer.decode([i]))[1:-1] for i in ids[0].tolist()]
fig, axes = plt.subplots(1, 2, figsize=(15, 7))
for ax, index in zip(axes, (0, 20)):
    image = ax.imshow(layer_weights(index) ** 0.5, cmap="viridis", vmin=0, vmax=1)
    ax.set_title(f"layer {index}, head 0")
    ax.set_xticks(range(len(labels)), labels, rotation=90, fontsize=6)
    ax.set_yticks(range(len(labels)), labels, fontsize=6)
    ax.set_xlabel("key token")
    ax.set_ylabel("query token")
    fig.colorbar(image, ax=ax, shrink=0.7, label="√(attention weight)")
plt.tight_layout()
plt.show()

# %% [markdown]
# ## Summary
#
# | piece | shape change | typical mistake the checks catch |
# |---|---|---|
# | `split_heads` | (B, S, H·D) → (B, H, S, D) | viewing as (B, H, S, D) without the transpose |
# | `attention_weights` | (…, S, D)·(…, T, D) → (…, S, T) | scaling by 1/D, or after the softmax |
# | `group_queries` | (B, Hq, S, D) → (B, Hkv, G, S, D) | pairing query heads with the wrong kv head |
# | `attention_layer` | (B, S, H·D) → (B, S, H·D) | rotating v |
# | `manual_attention` | (B, Hq, S, D), (B, Hkv, T, D) → (B, Hq, S, D) | copying k and v G times, masking bf16 scores |
#
# Next, stage 03: masks for batches of prompts of different lengths — run on this attention.
