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
# # Stage 04 — The KV cache
#
# Stage 01 ended with a chart: the time per token grew with the length, because every step
# recomputed every position. Look at what a step really needs. The new token's query must meet
# the keys and values of *all* positions — but the keys and values of old positions do not change
# (a causal model never lets an old position see a new one). So compute them once and keep them:
#
# ```
#  prefill:  prompt (S tokens) ─► model ─► k, v of S positions ──► cache[:, :, 0:S]
#  decode:   1 new token       ─► model ─► k, v of 1 position  ──► cache[:, :, S]
#                                  query attends to cache[:, :, 0:S+1]
# ```
#
# Each decoding step then processes one token instead of the whole sequence.

# %%
# Stages you committed with `aie commit` are imported below; this checks them first.
from aie_lessons.course.progress import verify_committed_stages

verify_committed_stages(before="04")

# %%
import statistics
import time

import matplotlib.pyplot as plt
import torch

from aie_lessons import checks
from aie_lessons.config import ModelConfig
from aie_lessons.generate import generate, run_batch
from aie_lessons.output import GenerationResult
from aie_lessons.sampling import SamplingParams, greedy_step, make_generator, sample_next
from aie_lessons.masks import attention_mask
from aie_lessons.model import LAST_POSITION, AttentionMetadata, LlamaModel, sdpa_attention
from aie_lessons.padded_batch import generate_batch, left_pad
from aie_lessons.infra.environment import bf16_line, cpu_facts
from aie_lessons.infra.paths import default_model_dir
from aie_lessons.tokenizer import Tokenizer

torch.manual_seed(0)
MODEL_DIR = default_model_dir()
model = LlamaModel.from_pretrained(MODEL_DIR)
tokenizer = Tokenizer.from_pretrained(MODEL_DIR)
config = model.config

# %% [markdown]
# ## 1. How much memory?
#
# For every layer, every kv head and every position we keep a key and a value vector of
# `head_dim` numbers:
#
# **bytes = 2 (k and v) × layers × kv_heads × head_dim × tokens × batch × bytes per number**
#
# Grouped-query attention pays off here: the cache holds the kv heads only, so sharing each of
# them among several query heads (the group size is printed below) shrinks the cache as many
# times.

# %%
# export: kv_cache
"""A contiguous, preallocated KV cache written in place."""

from __future__ import annotations

import torch


class CacheFullError(ValueError):
    """A request needs more positions than the cache was allocated for."""


def kv_cache_bytes(config: ModelConfig, tokens: int, batch: int, dtype: torch.dtype) -> int:
    """2 × layers × kv_heads × head_dim × tokens × batch × bytes per element."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * tokens * batch * element


# %%
weights_bytes = sum(p.nbytes for p in model.parameters())
print(f"{config.num_heads} query heads share {config.num_kv_heads} kv heads: the cache is "
      f"{config.num_heads // config.num_kv_heads}x smaller than with one kv head per query head")
print(f"{'context':>8} {'batch':>6} {'fp32':>10} {'bf16':>10}")
for tokens in (2048, 8192):
    for batch in (1, 8):
        fp32 = kv_cache_bytes(config, tokens, batch, torch.float32)
        bf16 = kv_cache_bytes(config, tokens, batch, torch.bfloat16)
        print(f"{tokens:>8} {batch:>6} {fp32 / 2**20:>7.0f} MiB {bf16 / 2**20:>7.0f} MiB")
largest = kv_cache_bytes(config, 8192, 8, torch.float32)
print(f"8192 tokens x 8 sequences in fp32: {largest / 2**30:.1f} GiB, "
      f"{largest / weights_bytes:.1f}x the model's fp32 weights ({weights_bytes / 1e6:.0f} MB)")

# %% [markdown]
# At the full context, a batch of 8 needs several times the model's own weights (the last line
# above). Serving many long requests is limited by the cache, not the weights — the reason for
# stage 07's paged cache.
#
# ## 2. The cache
#
# One tensor for keys and one for values, allocated once at full size:
# `(layers, batch, kv_heads, max_len, head_dim)`. Each layer's attention calls
# `update(layer, k, v, start)` with the new positions' keys and values (stage 01's model makes
# that call); the cache writes them *in place* at columns `start …` and returns every column
# up to the last one written.
#
# The cache does not count how much it holds: the caller passes `start` (the model's
# metadata's `cache_start`), as it passes the RoPE positions. Only the loop knows how far each
# sequence is — stage 06 keeps many requests at different lengths in one cache, and a hidden
# counter inside the cache could not say where each of them is.
#
# ### Exercise 4.1 — write in place, return the history
#
# Complete `KVCache.update(layer, k, v, start)`. `k` and `v` are the new positions' keys and
# values, `(batch, kv_heads, new, head_dim)` each: the whole prompt in the prefill (`new` = its
# length), one token per decode step (`new` = 1). They may come in another float dtype than the
# cache's (fp32 activations, bf16 cache): the cache stores its own dtype. `update` must
#
# * refuse a write that does not fit, **before writing anything**: a negative `start` with a
#   `ValueError`; a write past column `max_len − 1` with a `CacheFullError` whose message gives
#   the cache's size, the column and number of positions asked for, and the fix (a larger
#   `max_len`, with the size this write needed);
# * store `k` and `v` in layer `layer`'s slice of `self.keys` and `self.values`, at columns
#   `start … start + new − 1`, leaving every other layer and column as it was;
# * return layer `layer`'s keys and values of columns `0 … start + new − 1`, each
#   `(batch, kv_heads, start + new, head_dim)`: *views* of the cache, not copies (a decode step
#   must not copy the whole history), and never a column past the last one written, whatever
#   an earlier, longer request left there.
#
# The keys returned are longer than the queries the model holds (all the past, for one new
# query): that is the point of the cache.

# %%
# export: kv_cache
class KVCache:
    """Keys and values of past positions: (layers, batch, kv_heads, max_len, head_dim) each."""

    def __init__(
        self,
        config: ModelConfig,
        batch_size: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        shape = (config.num_layers, batch_size, config.num_kv_heads, max_len, config.head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len

    @property
    def nbytes(self) -> int:
        """Bytes the cache holds, keys and values: equal to ``kv_cache_bytes`` of its shape."""
        return self.keys.nbytes + self.values.nbytes

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, Hkv, S, D) at columns start … start+S-1; return columns 0 … start+S-1.

        A new request reuses the memory by starting again at 0: old entries are overwritten.
        """
        # BEGIN EXERCISE 4.1: refuse writes that do not fit (negative start; past max_len, naming the fix); store k and v at this layer's columns start … start+new−1; return this layer's columns 0 … start+new−1 as views
        # Hint 1: The cache is allocated once at full size: a write lands in place at the caller's columns, the history handed back is a window onto the same memory, and a write that would overflow must fail loudly before it changes anything.
        # Hint 2: Compute the end column from start and the number of new positions; raise first if start is negative or the end exceeds max_len; then assign into a slice of the layer's keys and values over the column axis (assignment converts the dtype), and return slices from column 0 to the end, which PyTorch gives as views.
        new = k.shape[2]
        end = start + new
        if start < 0:
            raise ValueError(f"start={start}: cache columns start at 0")
        if end > self.max_len:
            raise CacheFullError(
                f"the KV cache holds {self.max_len} positions; writing {new} at column {start} needs "
                f"{end}. Fix: allocate max_len ≥ prompt + max_new_tokens (here {end})."
            )
        self.keys[layer, :, :, start:end] = k
        self.values[layer, :, :, start:end] = v
        return self.keys[layer, :, :, :end], self.values[layer, :, :, :end]
        # END EXERCISE 4.1


# %%
# Check exercise 4.1
checks.stage04.check_kv_cache(KVCache, config)

# %%
cache = KVCache(config, batch_size=1, max_len=2048)
print("allocated:", cache.nbytes, "bytes; formula:", kv_cache_bytes(config, 2048, 1, torch.float32),
      "bytes; equal:", cache.nbytes == kv_cache_bytes(config, 2048, 1, torch.float32))

# %% [markdown]
# ## 3. Generating with the cache
#
# A request is now two phases. **Prefill** runs the whole (left-padded) prompt once and fills the
# cache. **Decode** feeds one token per sequence per step. Two things must stay in step:
#
# * the *cache index*: where a token's key is stored — the same column for every sequence of the
#   batch, padding included;
# * the *RoPE position*: how far the token is from its own sequence's start — padding excluded.
#
# They differ by the amount of left padding. Mixing them up changes nothing for a single prompt
# and silently breaks every padded one.
#
# ### Exercise 4.2 — the position of the next token
#
# `next_positions(is_real)` takes the `(B, T)` boolean map of which cache columns hold a real
# token of each sequence (False on its left padding) and returns the `(B, 1)` integer RoPE
# positions of the tokens about to be appended: positions count from 0 at each sequence's
# first real token.

# %%
# export: cached_generate
"""Generation with a KV cache: prefill the prompts once, then decode one token per step."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch


def next_positions(is_real: torch.Tensor) -> torch.Tensor:
    """RoPE positions (B, 1) of the tokens about to be appended, given which cached columns are real."""
    # BEGIN EXERCISE 4.2: return each sequence's RoPE position for its next token, shape (B, 1)
    # Hint 1: With left padding the cache's column count includes pads; a sequence's position is how many of its own tokens came before, and positions start at 0.
    # Hint 2: Count the True entries of each row (over the column axis), keeping that axis so the result is a column of B integers; the tensor's width also counts padding, so it is the wrong number.
    return is_real.sum(dim=-1, keepdim=True)
    # END EXERCISE 4.2


# %%
# Check exercise 4.2
checks.stage04.check_next_positions(next_positions)

# %% [markdown]
# ### Exercise 4.3 — prefill once, then decode one token per step
#
# `cached_steps(model, prompts, params)` is the step iterator that `generate_cached` runs, with
# the contract of stage 03's `batch_steps`: each `next()` yields a list of B ints, the next
# token of every prompt, until the longest `max_new_tokens` is reached (`collect` applies the
# stop rules and ignores rows that have finished). Given: the device, one seeded generator per
# prompt, `sequences` (each prompt's tokens so far: sampling reads them for the repetition
# penalty, so append every new token) and `steps`. Write the rest:
#
# 1. left-pad the prompts (stage 03's `left_pad`) and allocate one `KVCache` for the batch, in
#    the model's weight dtype, long enough for the padded prompt and every new token — and no
#    longer: a cache is allocated per request, and one of the model's whole context would hold
#    memory that other requests need;
# 2. **prefill**: one forward pass over the padded batch with its RoPE positions and its
#    attention mask (stage 03's `attention_mask`: causal, padding hidden), writing the cache
#    from column 0; only the last position's logits are needed (the mask, the cache, its start
#    column and the positions whose logits are wanted travel in the pass's `AttentionMetadata`);
# 3. at every step pick the next tokens from the logits (`sample_next`), append them to
#    `sequences` and yield them; after the last step return at once: the last token needs no
#    forward pass of its own;
# 4. **decode**: feed only the B new tokens, `(B, 1)`, each at its own sequence's RoPE position
#    (exercise 4.2), writing their keys at the next free cache column (one column, the same for
#    every row), with a one-query mask that still hides every row's padding.
#
# When no prompt is padded (one prompt, or prompts of one length), the model's default causal
# mask is the right one and you may pass `None`. The check runs your loop on small random
# models — several layers, fp32 and bf16, prompts of different lengths, greedy and seeded
# sampling — and compares every step's logits with a recomputation of each sequence alone,
# without cache or padding, and every sampled token with its own generator's next draw.

# %%
# export: cached_generate
@torch.inference_mode()
def cached_steps(model: LlamaModel, prompts: list[list[int]], params: list[SamplingParams]) -> Iterator[list[int]]:
    """Next tokens of every sequence: one prefill of the padded prompts, then one decode step each."""
    device = model.embed_tokens.weight.device
    generators = [make_generator(p.seed, device) for p in params]
    sequences = [list(p) for p in prompts]
    steps = max(p.max_new_tokens for p in params)
    # BEGIN EXERCISE 4.3: yield each step's next token of every prompt: prefill the padded prompts once into a new cache, then decode one token per sequence per step
    # Hint 1: Every key and value the model has computed stays in the cache, so after one pass over the prompts each step only computes the newest token; its RoPE position counts its own sequence's real tokens, while its cache column, shared by the batch, counts padding too.
    # Hint 2: Allocate the cache for the padded width plus the steps; prefill with the batch's ids, positions and mask at cache column 0, keeping only the last position; then loop over the steps: sample, append, yield, return after the last, otherwise take the positions from exercise 4.2 first, then mark one more real column, build a one-query mask and run the model on the new ids as a column at cache column width + step.
    batch = left_pad(prompts, pad_id=0, device=device)  # any id works: padding is masked out
    width = batch.input_ids.shape[1]
    cache = KVCache(model.config, len(prompts), width + steps, dtype=model.embed_tokens.weight.dtype,
                    device=device)
    padded = not bool(batch.is_real.all())
    is_real = batch.is_real
    # Without padding, the default causal mask is the right one: no mask tensor to build.
    mask = attention_mask(is_real, width) if padded else None
    logits = model(batch.input_ids, batch.positions,
                   AttentionMetadata(mask=mask, cache=cache, cache_start=0, logits_at=LAST_POSITION))
    for step in range(steps):
        tokens = sample_next(logits, params, generators, sequences)
        for sequence, token in zip(sequences, tokens):
            sequence.append(token)
        yield tokens
        if step + 1 == steps:
            return  # the last token needs no forward pass of its own
        positions = next_positions(is_real)  # RoPE: each sequence's own count of real tokens
        is_real = torch.cat([is_real, torch.ones_like(is_real[:, :1])], dim=1)
        mask = attention_mask(is_real, 1) if padded else None
        new_ids = torch.tensor(tokens, device=device)[:, None]
        step_metadata = AttentionMetadata(mask=mask, cache=cache, cache_start=width + step)  # one column for all
        logits = model(new_ids, positions, step_metadata)
    # END EXERCISE 4.3


# %%
# export: cached_generate
def generate_cached(
    model: LlamaModel,
    tokenizer: Tokenizer,
    prompts: list[list[int]],
    params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
    on_text: Callable[[int, str], None] | None = None,
) -> list[GenerationResult]:
    """Generation for one or more prompts with a KV cache: one ``SamplingParams`` or one each.

    ``on_text(i, text)`` streams prompt ``i``'s text as it is produced.
    """
    return run_batch(cached_steps, model, tokenizer, prompts, params, on_text)


# %%
# Check exercise 4.3
checks.stage04.check_cached_steps(cached_steps)

# %% [markdown]
# ## 4. The invariants
#
# A cache is an optimisation: it must not change a single token. Three checks, on this machine:
#
# 1. cache on = cache off, for one prompt and for a padded batch;
# 2. prefill of N tokens then decoding the rest gives the same logits as recomputing everything;
# 3. a request that does not fit is refused with the numbers, by two guards: `run_batch`
#    (through `check_prompt`) refuses a prompt plus `max_new_tokens` longer than the model's
#    context before anything runs (`ContextLengthError`), and your cache from exercise 4.1
#    refuses any write past its `max_len` (`CacheFullError`) — the guard for a caller that
#    sizes a cache itself.
#
# The first two run twice: with PyTorch's attention, and with the attention you wrote in
# stage 02 (its `manual_attention` kernel).

# %%
from aie_lessons.attention import manual_attention

prompts = [tokenizer.encode_chat(q) for q in (
    "What is the capital of France?",
    "Name three primary colours.",
    "Write a haiku about autumn leaves falling on a quiet river.",
    "Give me one tip for learning to cook.",
)]
params = SamplingParams(max_new_tokens=12)
for backend, kernel in (("sdpa", sdpa_attention), ("manual", manual_attention)):
    model.use_attention(kernel)
    single_cached = generate_cached(model, tokenizer, prompts[:1], params)[0]
    single_plain = generate(model, tokenizer, prompts[0], params)
    print(f"{backend:>6}: one prompt, cache on == cache off:", single_cached.token_ids == single_plain.token_ids)
    batch_cached = generate_cached(model, tokenizer, prompts, params)
    batch_plain = generate_batch(model, tokenizer, prompts, params)
    print(f"{backend:>6}: four padded prompts, cache on == cache off:",
          [c.token_ids == p.token_ids for c, p in zip(batch_cached, batch_plain)])
model.use_attention(sdpa_attention)

# %%
ids = torch.tensor([tokenizer.encode("The lighthouse keeper climbed the stairs every night to")])
for backend, kernel in (("sdpa", sdpa_attention), ("manual", manual_attention)):
    model.use_attention(kernel)
    with torch.inference_mode():
        full = model(ids)
        cache = KVCache(config, 1, ids.shape[1])
        positions = torch.arange(ids.shape[1])[None]  # no padding: RoPE position = cache column
        prefill = model(ids[:, :8], positions[:, :8], AttentionMetadata(cache=cache, cache_start=0))
        decoded = [model(ids[:, i:i + 1], positions[:, i:i + 1], AttentionMetadata(cache=cache, cache_start=i))
                   for i in range(8, ids.shape[1])]
    stepwise = torch.cat([prefill, *decoded], dim=1)
    print(f"{backend:>6}: prefill 8 + decode the rest == full recompute (max diff < 1e-4):",
          (stepwise - full).abs().max().item() < 1e-4)
model.use_attention(sdpa_attention)

# %%
try:  # the first guard: the request is refused before the cache is allocated
    generate_cached(model, tokenizer, [[1] * 8000], SamplingParams(max_new_tokens=500))
except ValueError as error:
    print(type(error).__name__ + ":", error)

# %%
small = KVCache(config, batch_size=1, max_len=8)
new_keys = torch.zeros(1, config.num_kv_heads, 3, config.head_dim)
try:  # the second guard, your exercise 4.1: 3 positions from column 6 need 9 columns
    small.update(0, new_keys, new_keys, start=6)
except CacheFullError as error:
    print(type(error).__name__ + ":", error)
print("the refused write left the cache empty:", not small.keys.any().item())

# %% [markdown]
# ## 5. Time per token, with and without the cache
#
# Measured here: a step without the cache processes the whole sequence; with it, one token.
# %%
# NBVAL_IGNORE_OUTPUT
text_ids = tokenizer.encode("The history of computing is a story of people and machines. " * 60)


def best_of_3(step) -> float:
    """The fastest of three runs of ``step()``: the least disturbed by the rest of the machine."""
    best = float("inf")
    with torch.inference_mode():
        for _ in range(3):
            start = time.perf_counter()
            step()
            best = min(best, time.perf_counter() - start)
    return best


def plain_step_seconds(n_tokens: int) -> float:
    """One step of stage 01's loop at sequence length n: the whole sequence goes through."""
    ids = torch.tensor([text_ids[:n_tokens]])
    return best_of_3(lambda: greedy_step(model(ids)))


def cached_step_seconds(n_tokens: int) -> float:
    """One decode step at sequence length n: the cache holds the first n - 1 tokens (written
    by a prefill), and only the last token goes through."""
    ids, positions = torch.tensor([text_ids[:n_tokens]]), torch.arange(n_tokens)[None]
    cache = KVCache(config, 1, n_tokens)
    with torch.inference_mode():
        model(ids[:, :-1], positions[:, :-1], AttentionMetadata(cache=cache, cache_start=0, logits_at=LAST_POSITION))
    step = AttentionMetadata(cache=cache, cache_start=n_tokens - 1)
    return best_of_3(lambda: greedy_step(model(ids[:, -1:], positions[:, -1:], step)))


lengths = [16, 64, 128, 256, 384]
plain = [plain_step_seconds(n) for n in lengths]
cached = [cached_step_seconds(n) for n in lengths]
plt.figure(figsize=(6.5, 3.5))
plt.plot(lengths, [s * 1e3 for s in plain], marker="o", label="no cache (stage 01)")
plt.plot(lengths, [s * 1e3 for s in cached], marker="o", label="KV cache")
plt.xlabel("sequence length when the token is produced")
plt.ylabel("ms per generated token")
plt.yscale("log")
plt.legend()
plt.grid(alpha=0.3)
plt.title("Time per token: grows without the cache, flat with it", fontsize=10)
plt.tight_layout()
plt.show()
print(f"at {lengths[-1]} tokens: {plain[-1] * 1e3:.0f} ms without the cache, {cached[-1] * 1e3:.0f} ms with it "
      f"({plain[-1] / cached[-1]:.0f}x)")

# %% [markdown]
# With the cache the time per token is nearly flat. What sets its level? A decode step does
# almost no arithmetic per byte: every weight matrix is read once to multiply a single vector
# (two operations per number read), and every layer reads all of its cached keys and values.
# The processor computes far faster than memory delivers those numbers, so a step lasts about
# as long as reading its bytes takes: decoding is *memory-bound*. The bytes a step must read,
# divided by how fast this machine reads memory, give the **roofline**: the speed a batch-1
# decoder could reach if it did nothing but stream its bytes at that rate. As the context
# grows, the cache's share of the bytes grows with it, and the roofline comes down.
#
# First, the read speed. Stage 00 measured it with the same probe, `read_bandwidth`: it reads a
# buffer far larger than any CPU cache, several times, and keeps the best and the median speed
# (a shared machine's memory speed drifts from second to second).

# %%
# export: roofline
"""The memory roofline of batch-1 decoding: bytes read per token against read bandwidth."""

from __future__ import annotations

import statistics
import time

import torch


def read_bandwidth(
    megabytes: int = 512, repeats: int = 7, buffer: torch.Tensor | None = None
) -> tuple[float, float]:
    """This machine's memory read speed in bytes per second: (best, median) of ``repeats`` passes.

    A decode step reads weights and cache and writes almost nothing, so the probe only reads
    (a copy would also time the writes, and make the roofline look lower than it is). It reads a
    buffer far larger than any CPU cache in the two ways a decode step does: a sum, like stage
    09's compiled step's loops, and a matrix–vector product, like the eager model's BLAS calls.
    Each pass keeps the faster of the two, because neither reads at full speed on every CPU.

    Without ``buffer`` it allocates ``megabytes`` and does not count its first pass, which may
    fault the pages in. A caller that probes again and again (``benchmarks/decode.py``, between
    decode steps) passes its own fp32 buffer instead, already touched, whose size then sets the
    bytes read, and every pass counts.
    """
    fresh = buffer is None
    if buffer is None:
        buffer = torch.ones(megabytes * 2**20 // 4)
    matrix, vector = buffer.view(-1, 4096), torch.ones(4096, dtype=buffer.dtype)
    seconds = []
    for _ in range(repeats + fresh):
        fastest = float("inf")
        for read in (buffer.sum, lambda: torch.mv(matrix, vector)):
            start = time.perf_counter()
            read()
            fastest = min(fastest, time.perf_counter() - start)
        seconds.append(fastest)
    counted = seconds[fresh:]
    return buffer.nbytes / min(counted), buffer.nbytes / statistics.median(counted)


# %% [markdown]
# ### Exercise 4.4 — the bytes one decode step reads
#
# `decode_bytes_per_token(model, context, cache_dtype)` returns, as an `int`, the bytes a
# decode step of one sequence reads from memory when its new token attends to `context`
# positions (its own included):
#
# * every weight of the model once, in the dtype it is stored in (fp32 or bf16), norms
#   included; the output head is a matrix like the others;
# * but the embedding lookup reads a single row of its table: that row is negligible beside the
#   matrices and is **not counted**, and neither is the table as such. When the model *ties*
#   its output head to it (SmolLM2 does), the table is read whole anyway — as the head — and
#   counts once;
# * the cache: the keys and values of `context` positions in every layer and kv head, in
#   `cache_dtype` (`kv_cache_bytes` from section 1 gives it).

# %%
# export: roofline
def decode_bytes_per_token(model: LlamaModel, context: int, cache_dtype: torch.dtype) -> int:
    """Bytes one batch-1 decode step reads: the weights once, plus ``context`` cached positions."""
    # BEGIN EXERCISE 4.4: return the bytes a batch-1 decode step reads: each weight matrix read whole once (the embedding table only as a tied output head) plus the cache's keys and values of context positions in cache_dtype
    # Hint 1: A matrix–vector product reads every number of its matrix, whatever dtype it is stored in; a lookup reads one row; and attention reads every cached key and value of every layer.
    # Hint 2: Add up the byte sizes of the model's parameters except the embedding table (parameters() lists a tied head only once, under the embedding), add the head's bytes back if it is that same tensor, then add the cache's bytes for one sequence of context tokens from the section-1 formula.
    embedding, head = model.embed_tokens.weight, model.lm_head.weight
    weights = sum(p.nbytes for p in model.parameters() if p is not embedding)
    if head is embedding:  # tied: the whole table is read, as the output head
        weights += head.nbytes
    return weights + kv_cache_bytes(model.config, context, 1, cache_dtype)
    # END EXERCISE 4.4


# %%
# Check exercise 4.4
checks.stage04.check_decode_bytes(decode_bytes_per_token)

# %%
bf16_model = LlamaModel.from_pretrained(MODEL_DIR, dtype=torch.bfloat16)
contexts = [64, 1024, 2048, 4096, 6144, 8192]
decoders = {"fp32": (model, torch.float32), "bf16 weights and cache": (bf16_model, torch.bfloat16)}
print("MB read per decode step")
print(f"{'context':>8}" + "".join(f"{name:>25}" for name in decoders))
for context in (1, 2048, 8192):
    print(f"{context:>8}" + "".join(f"{decode_bytes_per_token(m, context, d) / 1e6:>25.1f}"
                                    for m, d in decoders.values()))
cache_8k = kv_cache_bytes(config, 8192, 1, torch.float32)
print(f"fp32 cache at 8192 tokens: {cache_8k / 1e6:.0f} MB, "
      f"{cache_8k / decode_bytes_per_token(model, 0, torch.float32):.0%} of the fp32 weights")

# %% [markdown]
# At a few thousand tokens the cache a step reads is no longer small beside the weights (the
# last line above). Now the measurements: the read bandwidth, then decode steps of both models
# at each context. A step's speed depends on how many cached positions it reads, not on what
# they hold, so the cache is filled with random keys and values rather than by prefilling
# thousands of tokens, and each step writes the same column `context − 1`.

# %%
# NBVAL_IGNORE_OUTPUT
def decode_tokens_per_s(decoder: LlamaModel, cache: KVCache, context: int, steps: int = 5) -> float:
    """Batch-1 decode speed (median of ``steps``) of a step whose token attends to ``context`` positions."""
    token, position = torch.tensor([[42]]), torch.tensor([[context - 1]])
    seconds = []
    with torch.inference_mode():
        for _ in range(steps + 1):  # the first step warms up
            start = time.perf_counter()
            decoder(token, position, AttentionMetadata(cache=cache, cache_start=context - 1))
            seconds.append(time.perf_counter() - start)
    return 1 / statistics.median(seconds[1:])


best_read, median_read = read_bandwidth()
print(f"read bandwidth: best {best_read / 1e9:.1f} GB/s, median {median_read / 1e9:.1f} GB/s")
measured: dict[str, list[float]] = {}
for name, (decoder, dtype) in decoders.items():
    cache = KVCache(config, 1, max(contexts), dtype=dtype)
    cache.keys.normal_(), cache.values.normal_()
    measured[name] = [decode_tokens_per_s(decoder, cache, context) for context in contexts]
    del cache
for name, (decoder, dtype) in decoders.items():
    for context, speed in zip(contexts, measured[name]):
        roof = best_read / decode_bytes_per_token(decoder, context, dtype)
        print(f"{name:>24} at {context:>5} tokens: {speed:5.1f} tokens/s, roofline {roof:5.1f}, "
              f"{speed / roof:.0%} of it")


# %%
# NBVAL_IGNORE_OUTPUT
def roofline_chart(points: dict[str, tuple[list[int], list[float]]], title: str) -> None:
    """Tokens/s against context length: each model's roofline as a line, measurements as points."""
    span = [*range(1, max(contexts), 64), max(contexts)]
    plt.figure(figsize=(7, 4))
    for (name, (decoder, dtype)), color in zip(decoders.items(), ("tab:blue", "tab:orange")):
        plt.plot(span, [best_read / decode_bytes_per_token(decoder, c, dtype) for c in span],
                 color=color, label=f"roofline, {name}")
    for (name, (xs, ys)), marker in zip(points.items(), "osD^"):
        plt.plot(xs, ys, marker, linestyle="none", label=name)
    plt.xlabel("context length (cached positions a step reads)")
    plt.ylabel("tokens per second, batch 1")
    plt.ylim(bottom=0)
    plt.grid(alpha=0.3)
    plt.legend(fontsize=8)
    plt.title(title, fontsize=10)
    plt.tight_layout()
    plt.show()


eager_points = {f"measured, {name}, eager": (contexts, measured[name]) for name in decoders}
roofline_chart(eager_points, "Decode speed against the memory roofline")

# %% [markdown]
# Both rooflines fall as the context grows: at 8192 tokens the cache adds a large fraction of
# the weights' bytes to every step (the line printed before the measurements), and bf16's
# roofline, with half the bytes of each, lies twice as high. Where the eager steps land is
# printed above, as a fraction of their roofline. The eager bf16 model does not turn its half
# of the bytes into speed: its `Linear` converts weight blocks to fp32 as it goes, and its
# attention converts the whole bf16 cache to fp32 at every step (stage 01's model, for fp32
# activations) — work that the roofline does not count. The next section finds out where an
# eager step's time goes; stage 09 how to read the bytes faster.
#
# ## 6. Where a decode step's time goes
#
# Before optimising, measure. PyTorch's profiler records every operator of one decode step:

# %%
# NBVAL_IGNORE_OUTPUT
from torch.profiler import ProfilerActivity, profile

story_prompt = tokenizer.encode_chat("Write a long story about a lighthouse keeper and the sea.")
n = len(story_prompt)
with torch.inference_mode():
    cache = KVCache(config, 1, n + 8)
    model(torch.tensor([story_prompt]), torch.arange(n)[None], AttentionMetadata(cache=cache, cache_start=0))
    step_ids = torch.tensor([[story_prompt[-1]]])
    for t in range(n, n + 3):  # warm up, then profile one step
        model(step_ids, torch.tensor([[t]]), AttentionMetadata(cache=cache, cache_start=t))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model(step_ids, torch.tensor([[n + 3]]), AttentionMetadata(cache=cache, cache_start=n + 3))
events = prof.key_averages()
total_us = sum(e.self_cpu_time_total for e in events)
products = [e for e in events if e.key in ("aten::mm", "aten::addmm")]
mm_us, mm_calls = sum(e.self_cpu_time_total for e in products), sum(e.count for e in products)
matrix_bytes = sum(p.nbytes for p in model.parameters() if p.dim() == 2)  # the head is the tied table
other_calls = sum(e.count for e in events) - mm_calls
print(f"matrix products: {mm_calls} calls ({config.num_layers} layers x 7 + the output head), "
      f"{mm_us / total_us:.0%} of the step's time, streaming {matrix_bytes / 1e6:.0f} MB of weights at "
      f"{matrix_bytes / (mm_us * 1e-6) / 1e9:.1f} GB/s (section 5's probe read {best_read / 1e9:.1f} GB/s)")
print(f"every other operator: {other_calls} calls (nested ones included), {1 - mm_us / total_us:.0%} of the "
      f"time, {(total_us - mm_us) / other_calls:.1f} µs per call on average")
print(events.table(sort_by="self_cpu_time_total", row_limit=8))

# %% [markdown]
# The two lines printed above the table say where this step's time went: the matrix products
# (`aten::mm`, one per weight matrix), the rate at which they streamed their weights — compare
# it with the read bandwidth that section 5 measured — and many small operator calls
# (norms, RoPE, views, the cache write), a few microseconds each for almost no arithmetic. (The
# profiler adds a little to every call, so the small ones look somewhat slower than they are.)
#
# Both are what stage 09 attacks. It measures this machine's ceilings, places every step on a
# roofline, and then climbs a ladder of decoders — a one-token step with static buffers, fused
# projections, a compiled step, bf16 weights read into fp32 arithmetic, weights packed in
# reading order, several layers per compiled call, int8 and int4 weights — measuring each rung
# against a roofline like section 5's. The cache you built here is what every rung reads.
#
# ## 7. bf16: what to store, and what to compute in
#
# bf16 keeps fp32's exponent but only the first bits of its significand (how many, and how far
# apart bf16 numbers near 25 are, is printed below).
# Storing the *weights* in bf16 halves the bytes every decode step reads. That leaves a
# choice for the arithmetic:
#
# - **bf16 activations**: every hidden state, every norm output and every product rounded to
#   bf16, layer after layer. CPUs with bf16 instructions (AVX-512 BF16, AMX) run the matrix
#   products of a prefill faster this way.
# - **fp32 activations**: the weights are rounded once, when stored; everything computed from
#   them stays fp32 (`Linear` upcasts a block of weight rows at a time). This is
#   `LlamaModel`'s default, and what stage 09's compiled decoder does.
#
# Either way the **logits leave the model in fp32**. Here is why, on the first answer token
# of stage 00's question:

# %%
with torch.inference_mode():
    first = model(torch.tensor([tokenizer.encode_chat("What is the capital of France?")]),
                  attn=AttentionMetadata(logits_at=LAST_POSITION))[0, -1]
best = first.topk(2)
print("best two first tokens:", [tokenizer.decode([i]) for i in best.indices.tolist()])
print(f"fp32 logits {best.values[0]:.1f} and {best.values[1]:.1f}: "
      f"{best.values[0] - best.values[1]:.2f} apart")
print("every bf16 number from 25 to 26:", sorted(set(torch.linspace(25, 26, 257).bfloat16().tolist())))
print("significand bits, the leading 1 included: bf16", int(1 / torch.finfo(torch.bfloat16).eps).bit_length(),
      "fp32", int(1 / torch.finfo(torch.float32).eps).bit_length())

# %% [markdown]
# The two candidates are closer than one bf16 step. Rounded to bf16 they can land on the same
# number — a tie, which argmax breaks toward the lower token id, whatever the model meant — and
# any error in the hidden states can swap them. So the output head takes fp32 input and
# returns fp32 logits, whatever the weights are stored in; sampling only ever sees fp32.
#
# How much each choice of activations changes the model is measured, not guessed: run fp32 and both
# bf16 variants over real text — the essay shipped in `data/prose/` — in windows of 256
# tokens, each position predicting the next (teacher forcing), and compare every position's
# distribution with fp32's: how often the best token is the same (top-1 agreement), the mean
# KL divergence, and the largest logit error.

# %%
# export: precision
"""How far a lower-precision model's next-token predictions are from the fp32 model's."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from aie_lessons.model import LlamaModel


@dataclass(frozen=True)
class Agreement:
    """A model's predictions compared with a reference's at the same positions."""

    positions: int
    top1: float  # fraction of positions where both rank the same token first
    mean_kl: float  # KL(reference ‖ model) in nats, averaged over positions
    max_logit_error: float  # largest |logit − reference logit| anywhere


@torch.inference_mode()
def teacher_forced_logits(model: LlamaModel, ids: list[int], window: int) -> torch.Tensor:
    """fp32 logits (positions, vocab) of ``ids`` cut into whole windows of ``window`` tokens.

    Each window runs from position 0, as a fresh prompt would, and every one of its positions
    predicts the next token of the real text (teacher forcing): a model's errors do not feed
    into its later inputs, so two models are compared on exactly the same contexts.
    """
    if len(ids) < window:
        raise ValueError(f"{len(ids)} tokens do not fill one window of {window}: use a longer text")
    device = model.embed_tokens.weight.device
    windows = [ids[i:i + window] for i in range(0, len(ids) - window + 1, window)]
    return torch.cat([model(torch.tensor([w], device=device))[0] for w in windows])


# %% [markdown]
# ### Exercise 4.5 — agreement with fp32
#
# Given two models' logits at the same positions, `(positions, vocab)` each, say how far apart
# their predictions are: how often they rank the same token first, the KL divergence from the
# reference's next-token distribution to the model's (one number per position, averaged), and
# the largest logit difference anywhere. Stage 08 will judge quantized weights with it too.

# %%
# export: precision
def agreement(reference: torch.Tensor, logits: torch.Tensor) -> Agreement:
    """Compare ``logits`` with ``reference`` logits, both (positions, vocab)."""
    if reference.shape != logits.shape:
        raise ValueError(f"shapes differ: reference {tuple(reference.shape)}, logits {tuple(logits.shape)}")
    # BEGIN EXERCISE 4.5: at every position compare the two next-token predictions; return an Agreement with the fraction of positions whose best token is the same, KL(reference ‖ model) averaged over positions, and the largest |logit difference|, as Python floats
    # Hint 1: Two models agree when they predict the same next tokens with similar probabilities: compare the argmax per position, the KL divergence of the distributions and the raw logit gap.
    # Hint 2: KL(p ‖ q) = Σ over the vocabulary of p · (log p − log q), with p the reference's probabilities; log-probabilities come stably from log_softmax, and a shift shared by all logits must not change them.
    log_p, log_q = reference.float().log_softmax(-1), logits.float().log_softmax(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    return Agreement(
        positions=reference.shape[0],
        top1=(reference.argmax(-1) == logits.argmax(-1)).float().mean().item(),
        mean_kl=kl.mean().item(),
        max_logit_error=(reference.float() - logits.float()).abs().max().item(),
    )
    # END EXERCISE 4.5


# %%
# Check exercise 4.5
checks.stage04.check_agreement(agreement)


# %%
# NBVAL_IGNORE_OUTPUT
from aie_lessons.infra.paths import DATA_DIR

text_ids = tokenizer.encode((DATA_DIR / "prose" / "lighthouses.txt").read_text())
reference_logits = teacher_forced_logits(model, text_ids, window=256)
bf16_variants = {
    "bf16 weights, bf16 activations": LlamaModel.from_pretrained(MODEL_DIR, dtype=torch.bfloat16,
                                                                 activations=torch.bfloat16),
    "bf16 weights, fp32 activations": bf16_model,  # section 5's
}
agreements = {name: agreement(reference_logits, teacher_forced_logits(variant, text_ids, window=256))
              for name, variant in bf16_variants.items()}
print(f"{reference_logits.shape[0]} positions of real text in windows of 256 tokens; largest fp32 logit "
      f"{reference_logits.abs().max().item():.1f}")
print(f"{'':32} {'top-1 = fp32':>12} {'mean KL':>10} {'max |Δlogit|':>13}")
for name, a in agreements.items():
    print(f"{name:32} {a.top1:>12.2%} {a.mean_kl:>10.1e} {a.max_logit_error:>13.2f}")
bf16_act, fp32_act = agreements.values()
print(f"fp32 activations: {(1 - bf16_act.top1) / (1 - fp32_act.top1):.1f}x fewer positions with "
      f"another best token, {bf16_act.mean_kl / fp32_act.mean_kl:.0f}x smaller mean KL")
del reference_logits

# %% [markdown]
# The figures depend a little on the processor (each CPU family rounds bf16 products in its
# own order), the verdict does not:

# %%
print("at least 1,000 positions compared:", fp32_act.positions >= 1000)
print("fp32 activations agree more often on the best token:", fp32_act.top1 > bf16_act.top1)
print("and their mean KL is at least 5x smaller:", 5 * fp32_act.mean_kl < bf16_act.mean_kl)

# %% [markdown]
# What the choice costs in speed, measured side by side: one prompt of real text, then a few
# decode steps with the cache, in several rounds, the median (the cell's first line says how
# many of each):

# %%
# NBVAL_IGNORE_OUTPUT
speed_models = {"fp32": model, **bf16_variants}
prompt_tokens, decode_tokens, max_rounds, budget_s = 256, 16, 3, 20.0
prefill_speed: dict[str, list[float]] = {name: [] for name in speed_models}
decode_speed: dict[str, list[float]] = {name: [] for name in speed_models}
prompt = torch.tensor([text_ids[:prompt_tokens]])
cell_start = time.perf_counter()
with torch.inference_mode():
    # Rounds until max_rounds or budget_s: without bf16 instructions a bf16 prefill is several
    # times slower than fp32's, and fewer rounds then say enough.
    while len(prefill_speed["fp32"]) < max_rounds and (not prefill_speed["fp32"] or
                                                       time.perf_counter() - cell_start < budget_s):
        for name, variant in speed_models.items():
            cache = KVCache(config, 1, prompt_tokens + decode_tokens, dtype=variant.embed_tokens.weight.dtype)
            start = time.perf_counter()
            prefill = AttentionMetadata(cache=cache, cache_start=0, logits_at=LAST_POSITION)
            logits = variant(prompt, torch.arange(prompt_tokens)[None], prefill)
            prefill_speed[name].append(prompt_tokens / (time.perf_counter() - start))
            start = time.perf_counter()
            for t in range(prompt_tokens, prompt_tokens + decode_tokens):
                logits = variant(logits.argmax(-1), torch.tensor([[t]]), AttentionMetadata(cache=cache, cache_start=t))
            decode_speed[name].append(decode_tokens / (time.perf_counter() - start))
rounds = len(prefill_speed["fp32"])
print(f"a prompt of {prompt_tokens} tokens, then {decode_tokens} decode steps; median of {rounds} "
      f"round{'s' * (rounds > 1)} ({time.perf_counter() - cell_start:.0f} s; at most {max_rounds}, "
      f"no new round after {budget_s:.0f} s)")
print(f"{'':32} {'prefill tok/s':>14} {'× fp32':>7} {'eager decode tok/s':>19} {'× fp32':>7}")
ratios = {}
for name in speed_models:
    prefill, decode = statistics.median(prefill_speed[name]), statistics.median(decode_speed[name])
    ratios[name] = (prefill / statistics.median(prefill_speed["fp32"]),
                    decode / statistics.median(decode_speed["fp32"]))
    print(f"{name:32} {prefill:>14.0f} {ratios[name][0]:>7.2f} {decode:>19.1f} {ratios[name][1]:>7.2f}")


def versus_fp32(ratio: float) -> str:
    """A ratio to fp32's speed in words; within 5% counts as the same (a shared CPU drifts that much)."""
    return "about as fast as" if abs(ratio - 1) < 0.05 else f"{ratio:.2f}× as fast as"


print(f"\non this CPU (bf16 instructions: {bf16_line(cpu_facts())}):")
print(f"- bf16 activations prefill {versus_fp32(ratios['bf16 weights, bf16 activations'][0])} fp32")
for name in bf16_variants:
    print(f"- {name}: the eager decode runs {versus_fp32(ratios[name][1])} fp32")
del bf16_variants, speed_models

# %% [markdown]
# The lines under the table say what bf16 did on *this* processor, and the instruction set
# decides it:
#
# - **Prefill with bf16 activations.** A CPU with bf16 matrix instructions (AMX, AVX-512 BF16:
#   recent Xeons, AMD Zen 4) runs it faster than fp32. A CPU without them (AVX2 only, such as
#   AMD Zen 3) multiplies bf16 in a fallback path, *slower* than fp32. fp32 activations pay fp32
#   arithmetic plus the conversion of every weight block.
# - **Eager decode with bf16 weights.** At one token each `F.linear` reads half the bytes, but
#   with fp32 activations it converts what it reads to fp32 first, and with bf16 activations it
#   multiplies in bf16, fast only with bf16 instructions. Whether the eager step turns the halved
#   bytes into speed therefore depends on the CPU — on the machines the course was tested on it
#   went both ways, from a quarter slower to two fifths faster than fp32, and even between two runs
#   on one machine — so the last lines above are this CPU's answer, not a rule. The bytes pay
#   off reliably in stage 09's compiled decoder, which reads bf16 and computes in fp32 in one
#   loop: its ladder measures what they buy.
#
# So the course keeps **fp32 activations** as the default: on real text they had several times
# fewer positions with a different best token than bf16 activations, and a far smaller KL
# (the ratios printed above; the cell after them checks the direction, and the KL ratio's
# floor), and the speed bf16 is for — decoding — comes from the bytes, not from bf16
# arithmetic. The price is the prefill's speed, and only on CPUs with bf16 instructions.
# `activations=torch.bfloat16` stays one argument away, for long prompts on such a CPU, or on
# a GPU, where bf16 arithmetic is the fast path.
#
# ## Summary
#
# | piece | what it does |
# |---|---|
# | `kv_cache_bytes` | 2 × layers × kv_heads × head_dim × tokens × batch × bytes |
# | `KVCache.update` | refuses writes that do not fit; writes new k/v in place, returns the history as views |
# | `next_positions` | RoPE positions count real tokens, cache columns count all |
# | `cached_steps`, `generate_cached` | prefill the padded prompts once, then one token per step |
# | `read_bandwidth`, `decode_bytes_per_token` | the roofline: bytes a step reads ÷ read bandwidth (`roofline`) |
# | `teacher_forced_logits`, `agreement` | a low-precision model against fp32 on real text (`precision`) |
