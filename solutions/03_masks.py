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

from aie_lessons import checks
from aie_lessons.generate import generate, run_batch
from aie_lessons.output import GenerationResult
from aie_lessons.sampling import SamplingParams, make_generator, sample_next
from aie_lessons.model import LlamaModel
from aie_lessons.infra.paths import default_model_dir
from aie_lessons.tokenizer import Tokenizer

torch.manual_seed(0)
MODEL_DIR = default_model_dir()
model = LlamaModel.from_pretrained(MODEL_DIR)
tokenizer = Tokenizer.from_pretrained(MODEL_DIR)


def show_masks(masks: dict[str, torch.Tensor]) -> None:
    """Heatmaps of boolean masks: yellow = may attend."""
    fig, axes = plt.subplots(1, len(masks), figsize=(3.2 * len(masks), 3.2))
    for ax, (title, mask) in zip(axes if len(masks) > 1 else [axes], masks.items()):
        ax.imshow(mask.int(), cmap="viridis", vmin=0, vmax=1)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("key position")
        ax.set_ylabel("query")
    plt.tight_layout()
    plt.show()


# %% [markdown]
# ## 1. The causal mask, and its offset
#
# Without a cache, queries and keys are the same S positions and the mask is the lower triangle.
# With a cache, the S queries are the *last* S of T positions: query `i` sits at position
# `T − S + i` and sees keys `0 … T − S + i`. The diagonal slides to the bottom-right corner.
# (Aligning it to the top-left instead is the classic bug: the new token would see only the
# first few cached tokens.)
#
# ### Exercise 3.1 — causal mask for q_len queries over kv_len keys

# %%
# export: masks
"""Attention masks: causal (with a cache offset), padding, and the two conventions."""

from __future__ import annotations

import torch


def causal_mask(q_len: int, kv_len: int, device: torch.device | str | None = None) -> torch.Tensor:
    """(q_len, kv_len) bool, True where query i (position kv_len - q_len + i) may see key j."""
    # BEGIN EXERCISE 3.1: True on and below the diagonal that ends in the bottom-right corner
    # Hint 1: A query may attend to itself and to earlier keys; when queries are the last q_len of kv_len positions, the triangle is anchored at the bottom-right corner.
    # Hint 2: torch.ones(q_len, kv_len, dtype=torch.bool).tril(diagonal) with diagonal = kv_len - q_len.
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
# Padding must be invisible. Two things would give it away: attention to pad keys (the mask's
# job), and *positions*: RoPE must number each prompt's real tokens 0, 1, 2, … whatever padding
# precedes them, or the same prompt would be encoded differently depending on its neighbours.
#
# ### Exercise 3.2 — left-pad a batch

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


def left_pad(sequences: list[list[int]], pad_id: int, device: torch.device | str = "cpu") -> PaddedBatch:
    """Pad sequences on the left to the longest length; number real tokens from 0."""
    width = max(len(s) for s in sequences)
    input_ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    is_real = torch.zeros(len(sequences), width, dtype=torch.bool)
    # BEGIN EXERCISE 3.2: put each sequence at the right end of its row, mark it real, and count positions over real tokens only
    # Hint 1: Left padding lines up every sequence's last token in the last column, so one step predicts every row's next token; pad tokens must not count as positions.
    # Hint 2: row b gets the sequence in columns width - len(seq) onwards; positions = is_real.cumsum(-1) - 1, clamped at 0.
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
print("row 3, first 6 columns — real:", batch.is_real[3, :6].tolist(),
      " positions:", batch.positions[3, :6].tolist())

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

# %%
# export: masks
def attention_mask(is_real: torch.Tensor, q_len: int) -> torch.Tensor:
    """(B, 1, q_len, T) bool: causal, no padding keys, and every query may see itself.

    ``is_real`` (B, T) marks real keys; the q_len queries are the last q_len of the T positions.
    """
    kv_len = is_real.shape[1]
    # BEGIN EXERCISE 3.3: combine causal_mask with is_real (keys), then let each query see its own position
    # Hint 1: A key is visible if it is causal for the query and real (not padding); a query that would see no key at all needs at least itself, or softmax divides by zero.
    # Hint 2: causal[None] & is_real[:, None, :] is (B, S, T); query i's own key is column kv_len - q_len + i; add the head axis at the end with [:, None].
    causal = causal_mask(q_len, kv_len, is_real.device)
    mask = causal[None] & is_real[:, None, :]  # (B, S, T)
    keys = torch.arange(kv_len, device=is_real.device)
    queries = torch.arange(q_len, device=is_real.device) + (kv_len - q_len)
    itself = keys[None, :] == queries[:, None]  # (S, T)
    return (mask | itself)[:, None]  # (B, 1, S, T)
    # END EXERCISE 3.3


def to_additive(mask: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The other convention: 0 where attention is allowed, a huge negative number where not."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
        ~mask, torch.finfo(dtype).min
    )


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
        logits = model(batch.input_ids, batch.positions, mask, last_position_only=True)
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
# Try it: set every entry of `batch.positions` to `torch.arange(T)` (ignoring padding), or drop
# `is_real` from the mask, and the padded prompts' answers change.
#
# ## Summary
#
# | mask | shape | rule |
# |---|---|---|
# | `causal_mask(S, T)` | (S, T) | query i sees keys ≤ T − S + i |
# | `attention_mask(is_real, S)` | (B, 1, S, T) | causal ∧ key is real, ∨ itself |
# | `to_additive(mask)` | same | 0 / most negative float, added to scores |
#
# Next, stage 04: keep the keys and values of past positions — the KV cache.
