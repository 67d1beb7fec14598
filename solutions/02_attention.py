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
import matplotlib.pyplot as plt
import torch

from aie_lessons import checks
from aie_lessons.model import (
    Attention,
    LlamaModel,
    apply_rope,
    register_attention_backend,
    rope_cos_sin,
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
# on its own: `(B, Hq, S, D)`. The `view` must split the *last* axis into `(H, D)` — that is how
# the projection's rows are laid out — and only then may heads move in front of positions.
# `view(B, H, S, D)` directly has the right size and the wrong meaning: it mixes positions into
# heads.
#
# ### Exercise 2.1 — split and merge heads

# %%
# export: attention
"""Attention written by hand: grouped-query, masked, with every reshape shape-checked."""

from __future__ import annotations

import torch

# A mask fills forbidden scores with the most negative float, not -inf: a row whose every
# key is masked then gives a uniform softmax instead of 0/0 = NaN.
MASKED = torch.finfo(torch.float32).min


def split_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(B, S, H·D) -> (B, H, S, D): one sequence of vectors per head."""
    batch, seq, width = x.shape
    # BEGIN EXERCISE 2.1: split the last axis into (H, D), then put heads before positions
    # Hint 1: Multi-head attention runs H independent attentions of width D = width / H side by side; the head axis must sit before the positions so that matmul batches over heads.
    # Hint 2: view(batch, seq, num_heads, width // num_heads), then transpose(1, 2).
    return x.view(batch, seq, num_heads, width // num_heads).transpose(1, 2)
    # END EXERCISE 2.1


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """(B, H, S, D) -> (B, S, H·D): the inverse of ``split_heads``."""
    batch, heads, seq, head_dim = x.shape
    return x.transpose(1, 2).reshape(batch, seq, heads * head_dim)


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
positions = torch.arange(6)[None]
cos, sin = rope_cos_sin(positions, config.head_dim, config.rope_theta)
Hq, Hkv = config.num_heads, config.num_kv_heads


def scores(q, k):
    return q @ k.repeat_interleave(Hq // Hkv, dim=1).transpose(-1, -2)


with torch.no_grad():
    q_hf = split_heads(x @ attn0.q_proj.weight.T, Hq)
    k_hf = split_heads(x @ attn0.k_proj.weight.T, Hkv)
    q_gguf = split_heads(x @ to_gguf_row_order(attn0.q_proj.weight, Hq).T, Hq)
    k_gguf = split_heads(x @ to_gguf_row_order(attn0.k_proj.weight, Hkv).T, Hkv)
    hf = scores(apply_rope(q_hf, cos, sin), apply_rope(k_hf, cos, sin))
    gguf = scores(rope_interleaved(q_gguf, cos, sin), rope_interleaved(k_gguf, cos, sin))
    mixed = scores(apply_rope(q_gguf, cos, sin), apply_rope(k_gguf, cos, sin))
print("interleaved RoPE on GGUF rows == rotate-half on HF rows:", torch.allclose(hf, gguf, atol=1e-4))
print("rotate-half on GGUF rows (no conversion) is far off:", (hf - mixed).abs().max().item() > 1)

# %% [markdown]
# Only q and k are rotated: their dot product is where relative position matters. The values v
# are *what* gets mixed, not *where from*; rotating them would scramble the output by position.
#
# ## 4. Scores and the softmax
#
# `q·kᵀ` grows with the head size D (a sum of D products), which would push the softmax into
# saturation, so scores are divided by √D *before* the softmax. The mask is applied to the
# scaled scores: a forbidden score is set to the most negative float, so its weight is exactly 0.
#
# ### Exercise 2.2 — attention weights

# %%
# export: attention
def attention_weights(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """softmax(q·kᵀ / √D) over keys, with forbidden (mask False) scores removed.

    q is (..., S, D), k is (..., T, D); mask broadcasts to (..., S, T). Returns (..., S, T).
    """
    # BEGIN EXERCISE 2.2: scale q·kᵀ by 1/√D, fill masked scores with MASKED, softmax over the keys
    # Hint 1: Attention is a softmax-weighted average of values; the weights come from query·key similarity, scaled so their spread does not grow with D, and masked keys must get zero weight.
    # Hint 2: scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5; scores.masked_fill(~mask, MASKED); softmax(dim=-1), in float32.
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, MASKED)
    return torch.softmax(scores.float(), dim=-1).to(q.dtype)
    # END EXERCISE 2.2


# %%
# Check exercise 2.2
checks.stage02.check_attention_weights(attention_weights)

# %% [markdown]
# ## 5. Grouped-query attention, without copying
#
# SmolLM2 has 9 query heads but only 3 key/value heads: each k/v head serves a *group* of 3
# consecutive query heads (0–2 use kv head 0, 3–5 kv head 1, 6–8 kv head 2). That shrinks the
# KV cache 3× (stage 04). Copying k and v three times (`repeat_interleave`) would give that memory
# right back. Instead, view the queries as `(B, Hkv, G, S, D)` — group `j` holds query heads
# `j·G … j·G + G − 1` — and give k and v a size-1 group axis: broadcasting in the matmul
# pairs each group with its kv head, and nothing is copied.
#
# ### Exercise 2.3 — group the query heads

# %%
# export: attention
def group_queries(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """(B, Hq, S, D) -> (B, Hkv, G, S, D), query head h landing in group h // G."""
    batch, heads, seq, head_dim = q.shape
    # BEGIN EXERCISE 2.3: view q so that consecutive query heads share a group
    # Hint 1: With grouped-query attention, G consecutive query heads share one key/value head; giving q a group axis lets one K/V head broadcast over its G query heads without copies.
    # Hint 2: heads = num_kv_heads × G with the kv index outermost: view(batch, num_kv_heads, heads // num_kv_heads, seq, head_dim).
    return q.view(batch, num_kv_heads, heads // num_kv_heads, seq, head_dim)
    # END EXERCISE 2.3


@register_attention_backend("manual")
def manual_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Attention by hand: q (B, Hq, S, D), k/v (B, Hkv, T, D), mask (B|1, 1, S, T) -> (B, Hq, S, D).

    Without a mask, query i may see keys up to its own position, counted from the end: with a
    cache the S new queries are the *last* S of the T positions.
    """
    dims = Dims()
    dims.check("q", q, "B Hq S D")
    dims.check("k", k, "B Hkv T D")
    dims.check("v", v, "B Hkv T D")
    seq, kv_len = dims.sizes["S"], dims.sizes["T"]
    if mask is None:
        mask = torch.ones(seq, kv_len, dtype=torch.bool, device=q.device).tril(kv_len - seq)
    groups = dims.sizes["Hq"] // dims.sizes["Hkv"]
    dims.sizes["G"] = groups
    q_grouped = dims.check("q grouped", group_queries(q, dims.sizes["Hkv"]), "B Hkv G S D")
    k_grouped, v_grouped = k.unsqueeze(2), v.unsqueeze(2)  # (B, Hkv, 1, T, D): a view, no copy
    mask = mask.unsqueeze(2) if mask.dim() == 4 else mask  # (B|1, 1, 1, S, T)
    weights = dims.check("weights", attention_weights(q_grouped, k_grouped, mask), "B Hkv G S T")
    out = dims.check("out grouped", weights @ v_grouped, "B Hkv G S D")
    return dims.check("out", out.flatten(1, 2), "B Hq S D")


# %%
# Check exercise 2.3
checks.stage02.check_group_queries(group_queries)

# %% [markdown]
# ## 6. The whole layer, checked end to end
#
# `attention_layer` runs the chain of the diagram through the weights of one of the model's
# attention modules, checking every intermediate shape.
#
# ### Exercise 2.4 — which tensors RoPE rotates

# %%
# export: attention
def attention_layer(
    attn: Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The seeds' chain for one layer: x (B, S, H·D) -> ... -> (B, S, H·D), every shape checked."""
    config = attn.config
    dims = Dims(Hq=config.num_heads, Hkv=config.num_kv_heads, D=config.head_dim)
    dims.check("x", x, "B S Hq*D")
    q = dims.check("q", split_heads(attn.q_proj(x), dims.sizes["Hq"]), "B Hq S D")
    k = dims.check("k", split_heads(attn.k_proj(x), dims.sizes["Hkv"]), "B Hkv S D")
    v = dims.check("v", split_heads(attn.v_proj(x), dims.sizes["Hkv"]), "B Hkv S D")
    # BEGIN EXERCISE 2.4: rotate the tensors whose dot product must depend on relative position
    # Hint 1: Rotating q and k by their positions makes q·k depend only on the distance between them; v is content, not a position-dependent match, so it is left alone.
    # Hint 2: apply_rope(tensor, cos, sin) for q and k; v carries content and stays as it is.
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    # END EXERCISE 2.4
    out = dims.check("attention", manual_attention(q, k, v, mask), "B Hq S D")
    merged = dims.check("merged", merge_heads(out), "B S Hq*D")
    return dims.check("output", attn.o_proj(merged), "B S Hq*D")


# %%
# Check exercise 2.4
checks.stage02.check_attention_layer(attention_layer, model)

# %% [markdown]
# ## 7. Your attention inside the model
#
# `manual_attention` registered itself as the backend `"manual"`. Switch the model to it and
# compare the logits with PyTorch's fused kernel on a real prompt:

# %%
from aie_lessons.tokenizer import Tokenizer

tokenizer = Tokenizer.from_pretrained(MODEL_DIR)
ids = torch.tensor([tokenizer.encode_chat("Why is the sky blue?")])
with torch.inference_mode():
    model.set_attention_backend("sdpa")
    reference = model(ids)
    model.set_attention_backend("manual")
    mine = model(ids)
error = (mine - reference).abs().max().item()
print(f"{ids.shape[1]} tokens; manual vs sdpa logits agree within 1e-4: {error < 1e-4}")
print("same next token:", mine[0, -1].argmax().item() == reference[0, -1].argmax().item())

# %% [markdown]
# What the heads look at: the attention weights of layer 0 and a later layer for this prompt.
# Each row is a query position; causal attention leaves the upper triangle empty. Early layers
# look at nearby tokens; later ones often put much of their weight on the first token (an
# "attention sink").

# %%
@torch.inference_mode()
def layer_weights(layer_index: int) -> torch.Tensor:
    """Layer ``layer_index``'s attention weights for ``ids``, recomputed from its input."""
    captured = {}
    attn = model.layers[layer_index].self_attn
    hook = attn.q_proj.register_forward_hook(lambda m, i, o: captured.setdefault("x", i[0]))
    model(ids)
    hook.remove()
    positions = torch.arange(ids.shape[1])[None]
    cos, sin = rope_cos_sin(positions, config.head_dim, config.rope_theta)
    q = apply_rope(split_heads(attn.q_proj(captured["x"]), Hq), cos, sin)
    k = apply_rope(split_heads(attn.k_proj(captured["x"]), Hkv), cos, sin)
    causal = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool).tril()
    return attention_weights(group_queries(q, Hkv), k.unsqueeze(2), causal)[0, 0, 0]


fig, axes = plt.subplots(1, 2, figsize=(9, 4))
for ax, index in zip(axes, (0, 20)):
    ax.imshow(layer_weights(index) ** 0.5, cmap="viridis")
    ax.set_title(f"layer {index}, head 0 (√weight)")
    ax.set_xlabel("key position")
    ax.set_ylabel("query position")
plt.tight_layout()
plt.show()

# %% [markdown]
# ## Summary
#
# | piece | shape change | typical mistake the checks catch |
# |---|---|---|
# | `split_heads` | (B, S, H·D) → (B, H, S, D) | `view(B, H, S, D)` without the transpose |
# | `attention_weights` | (…, S, D)·(…, T, D) → (…, S, T) | scaling after the softmax |
# | `group_queries` | (B, Hq, S, D) → (B, Hkv, G, S, D) | pairing query heads with the wrong kv head |
# | `attention_layer` | (B, S, H·D) → (B, S, H·D) | rotating v |
#
# Next, stage 03: masks for batches of prompts of different lengths.
