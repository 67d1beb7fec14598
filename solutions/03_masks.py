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
# # Stage 03 — Masks
#
# Attention lets every query look at every key. Three rules restrict that, and a *mask* encodes
# them as a boolean table: `True` where query `i` may look at key `j`.
#
# 1. **Causal**: a token may not see the future, or training would have been trivial.
# 2. **Padding**: in a batch of prompts of different lengths the short ones are padded, and no
#    real token may look at padding.
# 3. **Cache offset**: with a KV cache (stage 04) only the new tokens are queries, but they
#    attend to everything before them: the mask is `(q_len, kv_len)`, not square.
#
# The goal of this stage: greedy generation for a *batch* of prompts of different lengths that
# gives each prompt exactly the tokens it gets alone.

# %%
# Stages you committed with `aie commit` are imported below; this checks them first.
from aie_lessons.course.progress import verify_committed_stages

verify_committed_stages(before="03")

# %%
import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from matplotlib.colors import ListedColormap
from matplotlib.ticker import MaxNLocator

from aie_lessons import checks
from aie_lessons.attention import manual_attention  # your stage-02 kernel
from aie_lessons.generate import generate, run_batch
from aie_lessons.output import GenerationResult
from aie_lessons.sampling import SamplingParams, make_generator, sample_next
from aie_lessons.model import LAST_POSITION, AttentionMetadata, LlamaModel, sdpa_attention
from aie_lessons.infra.paths import default_model_dir
from aie_lessons.tokenizer import Tokenizer

torch.manual_seed(0)
MODEL_DIR = default_model_dir()
model = LlamaModel.from_pretrained(MODEL_DIR)
tokenizer = Tokenizer.from_pretrained(MODEL_DIR)


def show_masks(masks: dict[str, torch.Tensor]) -> None:
    """Boolean masks side by side, one colour for "may attend" and one for "masked"."""
    fig, axes = plt.subplots(1, len(masks), figsize=(3.2 * len(masks) + 1.2, 3.4), squeeze=False,
                             layout="constrained")
    for ax, (title, mask) in zip(axes[0], masks.items()):
        image = ax.imshow(mask.int(), cmap=ListedColormap(["#30123b", "#fde725"]), vmin=-0.5, vmax=1.5)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("key position")
        ax.set_ylabel("query")
        for axis, size in ((ax.xaxis, mask.shape[1]), (ax.yaxis, mask.shape[0])):
            if size <= 10:  # every position labelled
                axis.set_ticks(range(size))
            else:
                axis.set_major_locator(MaxNLocator(integer=True))
    bar = fig.colorbar(image, ax=axes[0].tolist(), ticks=[0, 1], shrink=0.8)
    bar.ax.set_yticklabels(["masked", "may attend"])
    plt.show()


# %% [markdown]
# ## 1. The causal mask, and its offset
#
# Without a cache, queries and keys are the same S positions and the mask is the lower triangle.
# With a cache, the S queries are the *last* S of T positions: query `i` sits at position
# `T − S + i` and sees keys `0 … T − S + i`. The diagonal slides to the bottom-right corner.
# (Aligning it to the top-left instead is the classic bug: the new token would see only the
# first few cached tokens.)

# %%
# export: masks
"""Attention masks: causal (with a cache offset), padding, and the two conventions."""

from __future__ import annotations

import torch


def to_additive(mask: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The other convention: 0 where attention is allowed, a huge negative number where not."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
        ~mask, torch.finfo(dtype).min
    )


# %% [markdown]
# ### Exercise 3.1 — causal mask for q_len queries over kv_len keys
#
# `causal_mask(q_len, kv_len, device=None)` returns a boolean `(q_len, kv_len)` tensor on
# `device`: entry `[i, j]` is True when query `i`, which sits at position `kv_len − q_len + i`,
# may see key `j` (its own position and earlier ones), False for keys in its future.

# %%
# export: masks
def causal_mask(q_len: int, kv_len: int, device: torch.device | str | None = None) -> torch.Tensor:
    """(q_len, kv_len) bool, True where query i (position kv_len - q_len + i) may see key j."""
    # BEGIN EXERCISE 3.1: the (q_len, kv_len) boolean mask, True where query i (at position kv_len − q_len + i) may see key j
    # Hint 1: A query sees itself and the past; because the queries are the last q_len positions, the boundary is a diagonal that ends in the bottom-right corner, not one that starts in the top-left.
    # Hint 2: Start from an all-True boolean matrix and keep its lower triangle, with the diagonal shifted right by the number of keys that come before the first query.
    return torch.ones(q_len, kv_len, dtype=torch.bool, device=device).tril(kv_len - q_len)
    # END EXERCISE 3.1


# %%
# Check exercise 3.1
checks.stage03.check_causal_mask(causal_mask)

# %%
show_masks({"no cache: 8 queries, 8 keys": causal_mask(8, 8),
            "with cache: 3 new queries, 8 keys": causal_mask(3, 8),
            "decode: 1 query, 8 keys": causal_mask(1, 8)})

# %% [markdown]
# ## 2. Left padding and positions
#
# Tensors are rectangles, prompts are not. We pad the short prompts on the **left**, so that
# every sequence ends in the same column: the next token of each is predicted at position `-1`,
# and new tokens are appended on the right for all of them at once.
#
# Padding must be invisible, which is the mask's job (section 3). The batch also carries the
# RoPE *positions* of its tokens, and we count them per sequence: each prompt's first real token
# is position 0, whatever padding precedes it. RoPE only sees distances, so for one forward pass
# this hardly matters; section 6 measures why it matters anyway — for the cache of stage 04, for
# models with absolute positions, and for exact agreement with a prompt run alone.

# %%
# export: padded_batch
"""A batch of token sequences of different lengths as rectangles, and generation on it."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch


@dataclass
class PaddedBatch:
    input_ids: torch.Tensor  # (B, T) token ids, padding on the left
    is_real: torch.Tensor  # (B, T) bool, False on padding
    positions: torch.Tensor  # (B, T) RoPE positions: 0 at each sequence's first real token


# %% [markdown]
# ### Exercise 3.2 — left-pad a batch
#
# `left_pad(sequences, pad_id, device="cpu")` takes lists of token ids of different lengths and
# returns a `PaddedBatch` of three `(B, T)` tensors, T the longest length: `input_ids` with each
# sequence in the *last* columns of its row and `pad_id` before it; `is_real`, True exactly on the
# sequence's tokens; `positions`, integers (`torch.long`) 0, 1, 2, … over each row's real tokens
# and 0 on its padding (never negative, never floats: positions index RoPE's tables). All three
# end up on `device` (the given last line does that).

# %%
# export: padded_batch
def left_pad(sequences: list[list[int]], pad_id: int, device: torch.device | str = "cpu") -> PaddedBatch:
    """Pad sequences on the left to the longest length; number real tokens from 0."""
    width = max(len(s) for s in sequences)
    input_ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    is_real = torch.zeros(len(sequences), width, dtype=torch.bool)
    # BEGIN EXERCISE 3.2: fill input_ids and is_real with each sequence at the right end of its row, and positions counting each row's real tokens from 0 (0 on padding)
    # Hint 1: Left padding lines up every sequence's last token in the last column, so one step predicts every row's next token; a position counts the real tokens before it, padding excluded.
    # Hint 2: Fill row by row, each sequence against the right edge; a token's position is the number of real tokens before it in its row, which one cumulative operation over the real flags gives for every row at once (padding then needs its own rule).
    for row, sequence in enumerate(sequences):
        input_ids[row, width - len(sequence):] = torch.tensor(sequence, dtype=torch.long)
        is_real[row, width - len(sequence):] = True
    positions = (is_real.long().cumsum(dim=-1) - 1).clamp(min=0)
    # END EXERCISE 3.2
    return PaddedBatch(input_ids.to(device), is_real.to(device), positions.to(device))


# %%
# Check exercise 3.2
checks.stage03.check_left_pad(left_pad)

# %%
prompts = [tokenizer.encode_chat(q) for q in (
    "What is the capital of France?",
    "Name three primary colours.",
    "Write a haiku about autumn leaves falling on a quiet river.",
    "2 + 2 = ?",
)]
batch = left_pad(prompts, pad_id=tokenizer.eos_token_id)
print("lengths:", [len(p) for p in prompts], "→ padded to", tuple(batch.input_ids.shape))
print("row 3, last 8 columns — ids:", batch.input_ids[3, -8:].tolist())
print("row 3, first 9 columns — real:", batch.is_real[3, :9].int().tolist(),
      " positions:", batch.positions[3, :9].tolist())

# %% [markdown]
# ## 3. One mask for the batch
#
# The batch's mask combines both rules: query `i` of sequence `b` may see key `j` if `j` is not
# in its future **and** key `j` of sequence `b` is real. Its shape is `(B, 1, S, T)`: the 1 lets
# it broadcast over heads.
#
# One trap: a *padding* query (row) whose every key is masked — padding at the start sees only
# padding. Its softmax would be 0/0. Its output is thrown away, but a NaN there would spread:
# later layers multiply it by a weight of exactly 0, and 0 × NaN is NaN. So we let every query
# see at least itself.
#
# ### Exercise 3.3 — the batch's attention mask
#
# `attention_mask(is_real, q_len)` takes `is_real` `(B, T)` (True on real tokens) and the number
# of queries `q_len ≤ T`, the last `q_len` of the T positions (T of them in a prefill, 1 when
# decoding with a cache). It returns a boolean `(B, 1, q_len, T)` mask: key `j` is visible to
# query `i` of row `b` when it is causal for that query *and* real in row `b`; besides, every
# query may always see its own position. Use `causal_mask` from exercise 3.1, and create the mask
# on `is_real`'s device (a GPU in later stages).

# %%
# export: masks
def attention_mask(is_real: torch.Tensor, q_len: int) -> torch.Tensor:
    """(B, 1, q_len, T) bool: causal, no padding keys, and every query may see itself.

    ``is_real`` (B, T) marks real keys; the q_len queries are the last q_len of the T positions.
    """
    kv_len = is_real.shape[1]
    # BEGIN EXERCISE 3.3: the (B, 1, q_len, T) mask: causal and real keys, and every query's own position
    # Hint 1: Visibility is an AND of two rules (not in the future, not padding), then an OR with "is my own position", so that no row of the softmax is empty.
    # Hint 2: Broadcast the causal mask (S, T) against the real flags of the keys (B, 1, T) with a logical and; compare a range of key columns with the queries' positions (offset by T − q_len) for the diagonal, or it in, and add the head axis.
    causal = causal_mask(q_len, kv_len, is_real.device)
    mask = causal[None] & is_real[:, None, :]  # (B, S, T)
    keys = torch.arange(kv_len, device=is_real.device)
    queries = torch.arange(q_len, device=is_real.device) + (kv_len - q_len)
    itself = keys[None, :] == queries[:, None]  # (S, T)
    return (mask | itself)[:, None]  # (B, 1, S, T)
    # END EXERCISE 3.3


# %%
# Check exercise 3.3
checks.stage03.check_attention_mask(attention_mask)

# %%
mask = attention_mask(batch.is_real, batch.input_ids.shape[1])
show_masks({f"prompt {b} ({len(p)} tokens)": mask[b, 0] for b, p in enumerate(prompts)})

# %% [markdown]
# The shorter prompts start with padding: dark columns on the left (no query looks at them),
# and in the top-left corner the padding queries see only themselves (the lit diagonal).
#
# ## 4. Two conventions, and what mixing them does
#
# Libraries accept a mask in one of two forms. A **boolean** mask says `True` = may attend. An
# **additive** (float) mask is *added* to the scores: 0 = may attend, −∞ (or the most negative
# float) = may not. PyTorch's `scaled_dot_product_attention` takes both, and tells them apart by
# dtype. Passing a 0/1 *float* "keep" mask — a boolean mask converted with `.float()` — is
# therefore not an error: it adds 1 to the allowed scores and 0 to the forbidden ones. The
# future keeps its weight — only slightly less of it — and nothing fails.

# %%
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 1, 4, 8, generator=g) for _ in range(3))
keep = causal_mask(4, 4)
right = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
additive = F.scaled_dot_product_attention(q, k, v, attn_mask=to_additive(keep))
mixed = F.scaled_dot_product_attention(q, k, v, attn_mask=keep.float())
print("boolean == additive:", torch.allclose(right, additive, atol=1e-6))
print("float 0/1 'keep' mask == boolean:", torch.allclose(right, mixed, atol=1e-6))
weights = torch.softmax(q @ k.transpose(-1, -2) / 8**0.5 + keep.float(), dim=-1)
print("with the float mask, every future key still gets weight:", bool((weights[0, 0][~keep] > 0.01).all()))

# %% [markdown]
# The second convention has its own trap: with `-inf` instead of the most negative float, a row
# with no allowed key becomes `softmax([-inf, -inf, …])` = NaN:

# %%
empty_row = torch.full((1, 4), float("-inf"))
print("softmax of an all -inf row:", torch.softmax(empty_row, dim=-1).tolist())
print("softmax of an all finfo.min row:", torch.softmax(torch.full((1, 4), torch.finfo(torch.float32).min), dim=-1).tolist())

# %% [markdown]
# ## 5. Generating for a batch
#
# Still without a cache: each step pads the sequences afresh, builds the mask and the positions,
# and runs the whole batch. The loop is stage 01's: a step iterator, here yielding one token per
# sequence, and the same `collect`, which stops streaming a sequence once it has finished (its
# row keeps computing until all are done — stage 06 removes finished requests from the batch).

# %%
# export: padded_batch
@torch.inference_mode()
def batch_steps(model: LlamaModel, prompts: list[list[int]], params: list[SamplingParams]) -> Iterator[list[int]]:
    """Next tokens of every sequence, recomputing the padded batch at every step (no cache)."""
    device = model.embed_tokens.weight.device
    generators = [make_generator(p.seed, device) for p in params]
    sequences = [list(p) for p in prompts]
    for _ in range(max(p.max_new_tokens for p in params)):
        batch = left_pad(sequences, pad_id=0, device=device)  # any id works: padding is masked out
        mask = attention_mask(batch.is_real, batch.input_ids.shape[1])
        logits = model(batch.input_ids, batch.positions, AttentionMetadata(mask=mask, logits_at=LAST_POSITION))
        tokens = sample_next(logits, params, generators, sequences)
        for sequence, token in zip(sequences, tokens):
            sequence.append(token)
        yield tokens


def generate_batch(
    model: LlamaModel,
    tokenizer: Tokenizer,
    prompts: list[list[int]],
    params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
    on_text: Callable[[int, str], None] | None = None,
) -> list[GenerationResult]:
    """Generation for several prompts at once: one ``SamplingParams`` for all, or one each.

    Each row draws from its own generator, so a seeded prompt gets the tokens it gets alone.
    ``on_text(i, text)`` streams prompt ``i``'s text as it is produced.
    """
    return run_batch(batch_steps, model, tokenizer, prompts, params, on_text)


# %%
params = SamplingParams(max_new_tokens=16)
together = generate_batch(model, tokenizer, prompts, params)
alone = [generate(model, tokenizer, p, params) for p in prompts]
for t, a in zip(together, alone):
    print(f"{t.token_ids == a.token_ids!s:5}  {t.text!r}")
print("every prompt gets exactly the tokens it gets alone:",
      all(t.token_ids == a.token_ids for t, a in zip(together, alone)))

# %% [markdown]
# ## 6. Why positions are counted per sequence
#
# Numbering the padded rows with `torch.arange(T)` instead — padding included, so a prompt
# behind p pads starts at position p — looks like it should break everything. For one forward
# pass it does not, and it is worth seeing why before seeing what it *does* break.
#
# **It does not change this model's answers.** RoPE makes a score depend on the distance
# between query and key only (stage 02), and shifting every real token of a row by the same p
# keeps every distance. Compare the last position's logits of each prompt under both numberings,
# and each with the prompt run alone:

# %%
T = batch.input_ids.shape[1]
counted_from_zero = torch.arange(T).expand_as(batch.input_ids)
with torch.inference_mode():
    per_sequence = model(batch.input_ids, batch.positions, AttentionMetadata(mask=mask))
    arange = model(batch.input_ids, counted_from_zero, AttentionMetadata(mask=mask))
    by_itself = [model(torch.tensor([p]))[0] for p in prompts]
numbering = (per_sequence[:, -1] - arange[:, -1]).abs().max().item()
print(f"last-position logits, per-sequence vs arange numbering: max |Δ| = {numbering:.3f}")
print("same greedy next token under both:", per_sequence[:, -1].argmax(-1).tolist() == arange[:, -1].argmax(-1).tolist())
for name, logits in (("per-sequence", per_sequence), ("arange", arange)):
    gap = max((logits[b, -len(p):] - by_itself[b]).abs().max().item() for b, p in enumerate(prompts))
    print(f"{name:12} numbering vs each prompt alone, every real position: max |Δ| = {gap:.3f}")

# %% [markdown]
# All three differences print as 0.000, the size of fp32 rounding, and the greedy tokens are
# the same. The angles differ, though: a prompt behind p pads is rotated by `p` more at every
# position. With per-sequence numbering its real tokens get *the very same* RoPE tables as when
# it runs alone, so what remains of the difference is the summation order of batched matrix
# products; with `arange` it computes a different rotation that happens to give nearly the same
# scores:

# %%
from aie_lessons.model import rope_cos_sin

config = model.config
for name, positions in (("per-sequence", batch.positions), ("arange", counted_from_zero)):
    cos_batch, _ = rope_cos_sin(positions, config.head_dim, config.rope_theta)
    same = all(torch.equal(cos_batch[b, -len(p):], rope_cos_sin(torch.arange(len(p))[None], config.head_dim, config.rope_theta)[0][0])
               for b, p in enumerate(prompts))
    print(f"{name:12} numbering: every prompt's RoPE angles equal those it gets alone: {same}")

# %% [markdown]
# **Prefill and decode must agree once there is a cache.** In stage 04 the prompt is run once
# (prefill) and its rotated keys are kept; each new token is then run alone, at the position that
# continues *its own* sequence: `len(prompt)`, `len(prompt) + 1`, … That is the only count that
# does not depend on which other prompts share the batch. If the prefill had numbered the prompt
# with `arange(T)`, the new token's distance to every cached key would be off by that row's
# padding. No cache is needed to see it: generate again, numbering the prompt columns with
# `arange(T)` and every new token by its own count, as such a cache would:

# %%
@torch.inference_mode()
def mixed_numbering_tokens(prompts: list[list[int]], steps: int) -> list[list[int]]:
    """Greedy tokens with the prompts numbered 0 … T−1 (padding counted) but each new token at
    its own sequence's count: what a cache prefilled with arange(T) would give in decode."""
    padded = left_pad(prompts, pad_id=0)
    width = padded.input_ids.shape[1]
    ids, real = padded.input_ids, padded.is_real
    prompt_positions = torch.arange(width).expand_as(ids)
    new_positions = torch.tensor([[len(p)] for p in prompts])
    for step in range(steps):
        positions = torch.cat([prompt_positions, new_positions + torch.arange(step)], dim=1)
        logits = model(ids, positions, AttentionMetadata(mask=attention_mask(real, ids.shape[1]),
                                                         logits_at=LAST_POSITION))
        ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        real = torch.cat([real, torch.ones(len(prompts), 1, dtype=torch.bool)], dim=1)
    return ids[:, width:].tolist()


mixed_tokens = mixed_numbering_tokens(prompts, params.max_new_tokens)
print("padding per prompt:", [T - len(p) for p in prompts])
for tokens, a in zip(mixed_tokens, alone):
    if tokenizer.eos_token_id in tokens:  # stop where generation would have stopped
        tokens = tokens[: tokens.index(tokenizer.eos_token_id)]
    differ = [step for step, (x, y) in enumerate(zip(tokens, a.token_ids)) if x != y]
    first = differ[0] if differ else None
    print(f"same as alone: {tokens == a.token_ids!s:5} (first different token: {first})  {tokenizer.decode(tokens)!r}")

# %% [markdown]
# The prompt with no padding (2) is untouched; the padded ones part from their answer alone at
# token 6, 5 and 3, because their new tokens are numbered as if the prompt started p positions
# later than it does: the distance to every prompt token is off by p.
#
# **Models with absolute positions would change at once.** GPT-2 and the original Transformer do
# not rotate q and k: they *add* a vector that depends on the position to each token's embedding.
# Then the numbers themselves matter, not only their differences, and shifting a prompt by its
# padding changes what the model sees. Give our model such a table (sinusoidal, scaled to the
# embeddings' size) and compare the two numberings again:

# %%
def absolute_positions(positions: torch.Tensor) -> torch.utils.hooks.RemovableHandle:
    """Make the model add a sinusoidal vector per position to every embedding, as GPT-2 adds a
    learned one; remove the returned handle to undo it."""
    width = config.hidden_size
    angles = positions[..., None] * 10000 ** (-torch.arange(0, width, 2) / width)
    table = torch.cat([angles.sin(), angles.cos()], dim=-1) * model.embed_tokens.weight.std()
    return model.embed_tokens.register_forward_hook(lambda module, inputs, out: out + table)


with torch.inference_mode():
    last = {}
    for name, positions in (("per-sequence", batch.positions), ("arange", counted_from_zero)):
        hook = absolute_positions(positions)
        last[name] = model(batch.input_ids, positions, AttentionMetadata(mask=mask))[:, -1]
        hook.remove()
shift = (last["per-sequence"] - last["arange"]).abs().max(-1).values
print("absolute positions, last-position logits, per-sequence vs arange, max |Δ| per prompt:",
      [round(x, 1) for x in shift.tolist()])

# %% [markdown]
# With absolute positions, every padded prompt's last logits move by 4.6 to 5.6; only the
# unpadded prompt (2) keeps its logits. Counting per sequence is what makes a prompt's
# computation independent of its neighbours for every kind of position encoding, and it is what
# the cache of stage 04 and the scheduler of stage 06 (which moves sequences between batches)
# rely on.
#
# ## 7. Your stage-02 attention runs the batch
#
# The model computes attention with the kernel it was given. Hand it `manual_attention`, the
# kernel you wrote in stage 02, with its grouped queries and its `(B, 1, S, T)` padding masks,
# and generate the same batch again:

# %%
model.use_attention(manual_attention)
with torch.inference_mode():
    manual_logits = model(batch.input_ids, batch.positions, AttentionMetadata(mask=mask))
yours = generate_batch(model, tokenizer, prompts, params)
model.use_attention(sdpa_attention)
print("batch logits, manual vs sdpa within 1e-3:", (manual_logits - per_sequence).abs().max().item() < 1e-3)
print("same tokens as with sdpa for every prompt:",
      all(m.token_ids == t.token_ids for m, t in zip(yours, together)))

# %% [markdown]
# ## Summary
#
# | mask | shape | rule |
# |---|---|---|
# | `causal_mask(S, T)` | (S, T) | query i sees keys ≤ T − S + i |
# | `attention_mask(is_real, S)` | (B, 1, S, T) | causal ∧ key is real, ∨ itself |
# | `to_additive(mask)` | same | 0 / most negative float, added to scores |
#
# Positions count each sequence's real tokens from 0, so that a prompt's computation is the one
# it gets alone, a cache can continue it, and the batch it sits in does not matter.
#
# Next, stage 04: keep the keys and values of past positions — the KV cache.
