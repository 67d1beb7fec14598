"""Checks for stage 04: the in-place KV cache, RoPE positions in step with it, the prefill/decode
loop, the bytes a decode step reads, and agreement with fp32."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from aie_lessons.checks.common import CheckFailed, call, expect_shape, fail, isolated, passed, random_model


# --- 4.1 the cache -------------------------------------------------------------------------------
def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors share memory: a view of the cache does, a copy does not."""
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _expect_refusal(cache, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> Exception | None:
    """The exception ``update`` raised for a write that must be refused, or None."""
    try:
        cache.update(layer, k, v, start)
    except NotImplementedError:
        raise
    except Exception as exc:  # the learner's code may raise anything: the caller judges it
        return exc
    return None


def _check_cache_in(cache_cls, config, dtype: torch.dtype, g: torch.Generator) -> None:
    """One cache in ``dtype``: a prefill, a decode step, a new request, then the bounds."""
    batch, max_len, prompt = 3, 12, 5
    hkv, d, layers = config.num_kv_heads, config.head_dim, config.num_layers
    layer = layers - 1  # the last layer, so that writing into layer 0 (or all) shows
    cache = cache_cls(config, batch_size=batch, max_len=max_len, dtype=dtype)
    # Hold the preallocated tensors: if the cache replaced them, their memory cannot be handed out
    # again at the same address and make a copy look like an in-place write.
    original_keys, original_values = cache.keys, cache.values
    keys_ptr = original_keys.data_ptr()

    def rand(seq: int) -> torch.Tensor:  # activations arrive in fp32, whatever the cache stores
        return torch.randn(batch, hkv, seq, d, generator=g)

    def as_stored(x: torch.Tensor) -> torch.Tensor:
        return x.to(dtype)

    k1, v1 = rand(prompt), rand(prompt)
    got_k, got_v = call("4.1", cache.update, layer, k1, v1, 0)
    expect_shape("4.1", "the keys returned after the prefill", got_k, (batch, hkv, prompt, d))
    expect_shape("4.1", "the values returned after the prefill", got_v, (batch, hkv, prompt, d))
    if torch.equal(got_k, as_stored(v1)) and torch.equal(got_v, as_stored(k1)):
        fail("4.1", "keys and values are swapped: store k in self.keys and v in self.values")
    if got_k.dtype != dtype:
        fail("4.1", f"the cache holds {dtype}, but the keys returned are {got_k.dtype}: store into the "
                    "preallocated tensors (assignment converts), and return views of them")
    if not (torch.equal(got_k, as_stored(k1)) and torch.equal(got_v, as_stored(v1))):
        fail("4.1", "after the first update the cache should return exactly the k and v it was given "
                    f"(converted to the cache's {dtype})")

    k2, v2 = rand(1), rand(1)
    got_k, got_v = call("4.1", cache.update, layer, k2, v2, prompt)
    if tuple(got_k.shape) == tuple(k2.shape):
        fail("4.1", "update returned only the new keys: return everything cached so far, "
                    "columns 0 … start + new − 1, so the new query can attend to the past")
    expect_shape("4.1", "the keys returned after one decode step", got_k, (batch, hkv, prompt + 1, d))
    expect_shape("4.1", "the values returned after one decode step", got_v, (batch, hkv, prompt + 1, d))
    if torch.equal(got_k[:, :, :1], as_stored(k2)):
        fail("4.1", "the new keys were written at column 0, over the prompt: write them at "
                    "columns start … start + new − 1")
    if not (torch.equal(got_k[:, :, :prompt], as_stored(k1)) and torch.equal(got_k[:, :, prompt:], as_stored(k2))
            and torch.equal(got_v[:, :, :prompt], as_stored(v1)) and torch.equal(got_v[:, :, prompt:], as_stored(v2))):
        fail("4.1", "the returned history should be the prompt's keys followed by the new ones")
    if cache.keys is not original_keys or cache.values is not original_values or cache.keys.data_ptr() != keys_ptr:
        fail("4.1", "the cache allocated new memory (torch.cat? clone?): write into the preallocated "
                    "tensors in place, and keep them")
    if not (_same_storage(got_k, cache.keys) and _same_storage(got_v, cache.values)):
        fail("4.1", "update returned a copy of the history: return views of the cache (slicing gives "
                    "views), or every decode step copies everything cached so far")
    if not torch.equal(cache.keys[layer, :, :, prompt:prompt + 1], as_stored(k2)):
        fail("4.1", "the new keys are not stored in this layer's columns start … start + new − 1 "
                    "of self.keys")
    others = [i for i in range(layers) if i != layer]
    if others and (cache.keys[others].abs().sum() > 0 or cache.values[others].abs().sum() > 0):
        fail("4.1", f"writing layer {layer} changed other layers: index self.keys[layer] only, "
                    "each layer keeps its own keys and values")
    if cache.keys[:, :, :, prompt + 1:].abs().sum() > 0:
        fail("4.1", "columns after start + new − 1 were written: only the new positions' columns change")
    cache.keys[layer, 0, 0, 0, 0] = 7.0  # the history returned must follow later writes: a view
    if got_k[0, 0, 0, 0].item() != 7.0:
        fail("4.1", "the history returned does not see later writes to the cache: return views, not copies")
    cache.keys[layer, 0, 0, 0, 0] = as_stored(k1)[0, 0, 0, 0]

    # A new request reuses the cache from column 0: the history returned must end at its last
    # write, whatever an earlier, longer request left behind.
    k3, v3 = rand(2), rand(2)
    got_k, got_v = call("4.1", cache.update, layer, k3, v3, 0)
    if tuple(got_k.shape) != (batch, hkv, 2, d) or not torch.equal(got_k, as_stored(k3)):
        fail("4.1", "a write at start=0 must return columns 0 … new − 1 only, whatever was written "
                    "before: use start, not a count of earlier writes")

    # The bounds: a write that exactly fills the cache is fine, one more column is refused.
    fill_start = max_len - 2
    try:
        got_k, _ = cache.update(layer, rand(2), rand(2), fill_start)
    except NotImplementedError:
        raise
    except Exception as exc:  # the learner's code may raise anything: name the likely cause
        fail("4.1", f"a write of 2 positions at column {fill_start} of a cache of max_len {max_len} "
                    f"raised {type(exc).__name__} ({exc}): it fits exactly, up to column {max_len - 1} "
                    "(compare the end column with max_len using >, not ≥)")
    expect_shape("4.1", "the keys returned by a write that exactly fills the cache", got_k, (batch, hkv, max_len, d))
    before_k, before_v = cache.keys.clone(), cache.values.clone()
    start, new = max_len - 1, 2
    error = _expect_refusal(cache, layer, rand(new), rand(new), start)
    if error is None:
        fail("4.1", f"a write of {new} positions at column {start} of a cache of {max_len} was accepted: "
                    "it must raise CacheFullError")
    if type(error).__name__ != "CacheFullError":
        fail("4.1", f"a write past the end of the cache raised {type(error).__name__} ({error}): check "
                    "the bounds yourself and raise CacheFullError, whose message can name the fix")
    message = str(error)
    if str(max_len) not in message or str(start + new) not in message or "max_len" not in message:
        fail("4.1", f"the CacheFullError says {message!r}: name the cache's size ({max_len}), the size "
                    f"this write needed ({start + new}) and the fix (a larger max_len)")
    if not (torch.equal(cache.keys, before_k) and torch.equal(cache.values, before_v)):
        fail("4.1", "a refused write changed the cache: check the bounds before writing anything")
    error = _expect_refusal(cache, layer, rand(1), rand(1), -1)
    if not isinstance(error, ValueError):
        fail("4.1", f"a write at start=-1 {'was accepted' if error is None else f'raised {type(error).__name__}'}: "
                    "raise a ValueError (columns start at 0; a negative slice would silently write "
                    "at the end of the cache)")


def check_kv_cache(cache_cls, config) -> None:
    """Exercise 4.1: ``cache_cls(config, batch_size, max_len, dtype)``'s ``update``, in fp32 and bf16."""
    g = torch.Generator().manual_seed(4)
    for dtype in (torch.float32, torch.bfloat16):
        _check_cache_in(cache_cls, config, dtype, g)
    passed("4.1", "bounds refused before writing; new keys and values written in place at `start`, "
                  "in the cache's dtype, one layer only; history returned as views (fp32 and bf16)")


# --- 4.2 next positions -----------------------------------------------------------------------------
def _left_padded_is_real(counts: list[int], width: int) -> torch.Tensor:
    """(B, width) booleans: row i's last ``counts[i]`` columns are real, the rest left padding."""
    columns = torch.arange(width)
    return columns[None, :] >= width - torch.tensor(counts)[:, None]


def check_next_positions(next_positions) -> None:
    """Exercise 4.2: the usual mistakes on a fixed example first, then random paddings."""
    is_real = torch.tensor([[True, True, True, True], [False, False, True, True]])
    got = call("4.2", next_positions, is_real)
    if isinstance(got, torch.Tensor) and tuple(got.shape) == (2,):
        fail("4.2", "got shape (B,): keep the column axis, (B, 1), so the positions line up with "
                    "the (B, 1) new tokens")
    if isinstance(got, torch.Tensor) and tuple(got.shape) == (1, 4):
        fail("4.2", "got shape (1, T): you counted over the batch axis; count each row's real "
                    "tokens, over the columns")
    expect_shape("4.2", "the next positions", got, (2, 1))
    if got.is_floating_point() or got.dtype == torch.bool:
        fail("4.2", f"positions are {got.dtype}: RoPE positions are integer counts")
    if got.tolist() == [[4], [4]]:
        fail("4.2", "you used the cache length (padding included) as the RoPE position: a padded "
                    "sequence's next token is at position = number of its real tokens")
    if got.tolist() == [[3], [1]]:
        fail("4.2", "off by one: positions start at 0, so after n real tokens the next is at n")
    if got.tolist() == [[0], [2]]:
        fail("4.2", "you counted the padding columns: count the real ones (True)")
    if got.tolist() != [[4], [2]]:
        fail("4.2", f"expected [[4], [2]], got {got.tolist()}")
    g = torch.Generator().manual_seed(42)
    for _ in range(5):  # several sequences, several paddings, some decoded columns appended
        batch, width = (int(x) for x in torch.randint(2, 7, (2,), generator=g))
        counts = torch.randint(1, width + 1, (batch,), generator=g).tolist()
        decoded = int(torch.randint(0, 4, (1,), generator=g))
        is_real = torch.cat([_left_padded_is_real(counts, width), torch.ones(batch, decoded, dtype=torch.bool)], 1)
        got = call("4.2", next_positions, is_real)
        expect_shape("4.2", "the next positions", got, (batch, 1))
        expected = [[c + decoded] for c in counts]
        if got.tolist() != expected:
            fail("4.2", f"for rows with {counts} real prompt tokens and {decoded} decoded, expected "
                        f"{expected}, got {got.tolist()}")
    passed("4.2", "RoPE positions count real tokens; cache columns count all")


# --- 4.3 prefill, then decode -------------------------------------------------------------------
@dataclass
class _Call:
    ids: torch.Tensor
    positions: torch.Tensor | None
    mask: torch.Tensor | None
    cache: object
    cache_start: object
    logits: torch.Tensor | None  # (B, vocab), the last position's, once the call has run


def _spy_class():
    from aie_lessons.model import LlamaModel

    class SpyModel(LlamaModel):
        """Judges every forward call the loop makes *before* running it (``inspect(index, call)``),
        so a wrong argument is named rather than crashing inside the model; ``uncached`` is the
        check's own reference."""

        calls: list[_Call]
        inspect: Callable[[int, _Call], None]

        def forward(self, input_ids, positions=None, attn=None):
            mask = getattr(attn, "mask", None)
            record = _Call(input_ids.clone(), None if positions is None else positions.clone(),
                           None if mask is None else mask.clone(), getattr(attn, "cache", None),
                           getattr(attn, "cache_start", None), None)
            self.inspect(len(self.calls), record)
            logits = super().forward(input_ids, positions, attn)
            record.logits = logits[:, -1].float().clone()
            self.calls.append(record)
            return logits

        def uncached(self, ids: list[int]) -> torch.Tensor:
            """The last position's logits of ``ids`` alone: no cache, no padding, no mask."""
            with torch.inference_mode():
                return super().forward(torch.tensor([ids]))[0, -1].float()

    return SpyModel


@dataclass
class _Allocations:
    caches: list = field(default_factory=list)


def _reference_cache_class(allocations: _Allocations):
    class ReferenceCache:
        """The check's own cache (so a mistake in 4.1 cannot fail 4.3), counting allocations."""

        def __init__(self, config, batch_size, max_len, dtype=torch.float32, device="cpu"):
            shape = (config.num_layers, batch_size, config.num_kv_heads, max_len, config.head_dim)
            self.keys = torch.zeros(shape, dtype=dtype, device=device)
            self.values = torch.zeros(shape, dtype=dtype, device=device)
            self.max_len, self.dtype = max_len, dtype
            allocations.caches.append(self)

        def update(self, layer, k, v, start):
            end = start + k.shape[2]
            if not 0 <= start <= end <= self.max_len:
                raise RuntimeError(f"the loop wrote cache columns {start} … {end - 1} of a cache of "
                                   f"{self.max_len}: allocate room for the padded prompt plus every new token")
            self.keys[layer, :, :, start:end] = k
            self.values[layer, :, :, start:end] = v
            return self.keys[layer, :, :, :end], self.values[layer, :, :, :end]

    return ReferenceCache


def _reference_left_pad(sequences, pad_id, device="cpu"):
    width = max(len(s) for s in sequences)
    is_real = _left_padded_is_real([len(s) for s in sequences], width)
    input_ids = torch.full(is_real.shape, pad_id, dtype=torch.long)
    for row, sequence in enumerate(sequences):
        input_ids[row, width - len(sequence):] = torch.tensor(sequence)
    positions = (is_real.long().cumsum(-1) - 1).clamp(min=0)
    return SimpleNamespace(input_ids=input_ids.to(device), is_real=is_real.to(device), positions=positions.to(device))


def _reference_attention_mask(is_real, q_len):
    kv_len = is_real.shape[1]
    causal = torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)
    itself = torch.arange(kv_len)[None, :] == (torch.arange(q_len) + kv_len - q_len)[:, None]
    return ((causal[None] & is_real[:, None, :]) | itself)[:, None]


def _reference_next_positions(is_real):
    return is_real.sum(-1, keepdim=True)


def _as_int(value) -> object:
    """A one-element tensor as an int (a learner may pass ``cache_start`` either way)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return int(value.item())
    return value


def _penalized_argmax(logits: torch.Tensor, history: list[int], penalty: float) -> int:
    """The greedy token after the repetition penalty over ``history``: what sample_next must pick."""
    if penalty != 1.0:
        seen = torch.tensor(sorted(set(history)))
        values = logits[seen]
        logits = logits.clone()
        logits[seen] = torch.where(values > 0, values / penalty, values * penalty)
    return int(logits.argmax())


def _check_prefill(first: _Call, batch, cache, padded: bool) -> None:
    """The first forward call: the whole padded batch, its positions and mask, cache column 0."""
    rows, width = batch.input_ids.shape
    if tuple(first.ids.shape) != (rows, width):
        fail("4.3", f"the first forward pass got ids of shape {tuple(first.ids.shape)}: prefill the "
                    f"whole left-padded batch at once, ({rows}, {width})")
    if first.cache is not cache:
        fail("4.3", "the prefill ran without the cache: pass it, so that the prompt's keys and values are kept")
    if _as_int(first.cache_start) != 0:
        fail("4.3", f"the prefill wrote the cache from column {first.cache_start}: a new request starts at column 0")
    if first.positions is None:
        fail("4.3", "the prefill got no positions: pass the padded batch's RoPE positions")
    real = batch.is_real
    if first.positions.shape[-1] != width or not torch.equal(first.positions.expand(rows, width)[real],
                                                             batch.positions[real]):
        if padded and torch.equal(first.positions.expand(rows, width)[real],
                                  torch.arange(width).expand(rows, width)[real]):
            fail("4.3", "the prefill's RoPE positions count the padding (0 … width − 1 in every row): "
                        "pass the padded batch's positions, 0 at each sequence's first real token")
        fail("4.3", "the prefill's RoPE positions are not the padded batch's positions")
    if first.mask is None and padded:
        fail("4.3", "the prefill ran without a mask on a padded batch: real tokens attended to the "
                    "padding. Pass stage 03's attention mask (causal, padding keys hidden)")
    if first.mask is not None:
        if first.mask.shape[-2:] != (width, width):
            fail("4.3", f"the prefill's mask is {tuple(first.mask.shape)}: it needs one row per query and "
                        f"one column per key, (…, {width}, {width})")
        mask = first.mask.expand(rows, 1, width, width)[:, 0]
        expected = _reference_attention_mask(real, width)[:, 0]
        queries = real[:, :, None].expand(rows, width, width)  # pad queries' rows do not matter
        if not torch.equal(mask[queries], expected[queries]):
            fail("4.3", "the prefill's mask is not causal with the padding hidden: build it from the "
                        "batch's is_real for all width queries")


def _check_decode(call_: _Call, step: int, tokens: list[int], batch, caches: list, counts: list[int],
                  padded: bool) -> None:
    """Decode call ``step``: the tokens just yielded, (B, 1), at their positions and the next column."""
    rows, width = batch.input_ids.shape
    column, cache = width + step, caches[0]
    if call_.ids.shape[-1] != 1:
        fail("4.3", f"decode step {step} fed {call_.ids.shape[-1]} tokens per sequence: with the cache, "
                    "feed only the newest token of each, ids of shape (B, 1)")
    if call_.ids.reshape(-1).tolist() != tokens:
        fail("4.3", f"decode step {step} fed ids {call_.ids.reshape(-1).tolist()}, not the tokens just "
                    f"yielded {tokens}")
    if call_.cache is None:
        fail("4.3", f"decode step {step} ran without the cache: the new token could not see the past")
    if len(caches) > 1:
        fail("4.3", f"the loop allocated {len(caches)} caches: allocate one per request, before the "
                    "prefill, and reuse it at every step")
    if call_.cache is not cache:
        fail("4.3", f"decode step {step} used another cache than the prefill: allocate one per "
                    "request, before the prefill, and pass it to every step")
    start = _as_int(call_.cache_start)
    if start != column:
        if start == width and step > 0:
            fail("4.3", f"the cache was not advanced: decode step {step} wrote column {width} again, "
                        f"over the previous token; it should write column width + step = {column}")
        if start == column - 1:
            fail("4.3", f"decode step {step} wrote cache column {start}, over the last token already "
                        f"cached: the next free column is {column}")
        if start == step:
            fail("4.3", f"decode step {step} wrote cache column {start}, over the prompt: decode columns "
                        f"come after the padded prompt's {width}")
        if isinstance(start, torch.Tensor):
            fail("4.3", "cache_start is one column for the whole batch, an int: the RoPE positions are "
                        "per sequence, the cache column is not")
        fail("4.3", f"decode step {step} wrote cache column {start}; the next free column is {column}")
    expected = [[c + step] for c in counts]
    if call_.positions is None:
        fail("4.3", f"decode step {step} got no positions: pass each sequence's RoPE position")
    got = call_.positions.expand(rows, 1).tolist() if call_.positions.numel() in (1, rows) else None
    if got != expected:
        if got == [[column]] * rows:
            fail("4.3", f"decode positions are off by the padding: step {step} gave every row the cache "
                        f"column {column} as its RoPE position; a padded row is at its own count of "
                        f"real tokens, {expected}")
        if got == [[e[0] - 1] for e in expected]:
            fail("4.3", f"decode step {step}'s positions are one short, {got}: after n tokens the next is at n")
        if got == [[e[0] + 1] for e in expected]:
            fail("4.3", f"decode step {step}'s positions are one too far, {got}: take them before marking "
                        "the new column real — n real tokens so far put the new one at position n")
        fail("4.3", f"decode step {step}'s RoPE positions should be {expected}, got "
                    f"{call_.positions.tolist()}")
    if call_.mask is None and padded:
        fail("4.3", f"decode step {step} ran without a mask: the new token attended to the padding. "
                    "Keep a mask that hides each row's padding columns")
    if call_.mask is not None:
        kv_len = column + 1
        if call_.mask.dim() != 4 or call_.mask.shape[-2] != 1:
            fail("4.3", f"decode step {step}'s mask is {tuple(call_.mask.shape)}: one new token per sequence "
                        f"is one query row, so the mask is (B, 1, 1, {kv_len}): one row, one column per key")
        if call_.mask.shape[-1] != kv_len:
            fail("4.3", f"decode step {step}'s mask covers {call_.mask.shape[-1]} key columns, but "
                        f"attention reads {kv_len}: add one real column per decoded token")
        real = torch.cat([batch.is_real, torch.ones(rows, step + 1, dtype=torch.bool)], 1)
        if not torch.equal(call_.mask.expand(rows, 1, 1, kv_len)[:, 0, 0], real):
            fail("4.3", f"decode step {step}'s mask should let the new token see every real column and "
                        "no padding column of its row")


def _run_case(cached_steps, prompts: list[list[int]], params: list, weight_dtype: torch.dtype, layers: int,
              seed: int) -> None:
    """Run the loop on one random model, judging each call as it comes, then every step's logits."""
    from aie_lessons.sampling import make_generator, sample_row

    model = random_model(layers, weight_dtype, tie=False, seed=seed, cls=_spy_class())
    allocations = _Allocations()
    references = {"KVCache": _reference_cache_class(allocations), "left_pad": _reference_left_pad,
                  "attention_mask": _reference_attention_mask, "next_positions": _reference_next_positions}
    steps = max(p.max_new_tokens for p in params)
    batch = _reference_left_pad(prompts, 0)
    rows, width = batch.input_ids.shape
    padded = not bool(batch.is_real.all())
    counts = [len(p) for p in prompts]
    what = f"{len(prompts)} prompts of {counts} tokens, {layers} layers, {weight_dtype}"
    yielded: list = []

    def inspect_call(index: int, call_: _Call) -> None:
        if index == 0:
            if len(allocations.caches) != 1:
                fail("4.3", f"the loop allocated {len(allocations.caches)} caches before the prefill: "
                            "allocate exactly one per request")
            cache = allocations.caches[0]
            if cache.dtype != weight_dtype:
                fail("4.3", f"the cache is {cache.dtype} for a model whose weights are {weight_dtype}: "
                            "allocate it in the weights' dtype (a bf16 cache halves the bytes each step reads)")
            if cache.max_len > width + steps:
                fail("4.3", f"the cache holds {cache.max_len} positions, but this request writes at most "
                            f"{width + steps} (the padded prompt's {width} plus {steps} new tokens): size it "
                            "for the request — a cache of the model's whole context per request wastes "
                            "memory that could hold other requests")
            _check_prefill(call_, batch, cache, padded)
        elif index >= steps:
            fail("4.3", "the loop ran the model once more after yielding the last tokens: return right "
                        "after the last step, its tokens need no forward pass")
        elif len(yielded) != index:
            fail("4.3", f"the model ran {index + 1} times before step {index}'s tokens were yielded: one "
                        "prefill, then one decode step after each yield but the last")
        else:
            _check_decode(call_, index - 1, yielded[index - 1], batch, allocations.caches, counts, padded)

    model.calls, model.inspect = [], inspect_call
    try:
        with isolated(inspect.unwrap(cached_steps), **references):
            for tokens in cached_steps(model, [list(p) for p in prompts], params):
                yielded.append(tokens)
                if len(yielded) > steps:
                    break
    except (CheckFailed, NotImplementedError):
        raise
    except Exception as exc:  # the learner's code may raise anything; we report it, not hide it
        raise CheckFailed(f"Exercise 4.3: your code raised {type(exc).__name__}: {exc} ({what})") from exc
    if len(yielded) != steps:
        fail("4.3", f"the loop yielded {len(yielded)} times for max_new_tokens={steps} ({what}): yield "
                    "once per step, every sequence's next token")
    if any(not isinstance(t, list) or len(t) != rows for t in yielded):
        fail("4.3", f"each step should yield a list of {rows} ints, one per prompt; got {yielded[0]!r}")
    if len(model.calls) != steps:
        fail("4.3", f"the model ran {len(model.calls)} times for {steps} new tokens: one prefill, then one "
                    "decode step per new token but the last")
    histories = [list(p) for p in prompts]
    # The check's own generators, made once per request as the loop must: a sampled row's token
    # at step n is the n-th draw of its seeded stream from the logits the loop computed.
    generators = [make_generator(p.seed) for p in params]
    tolerance = 1e-3 if weight_dtype == torch.float32 else 0.15  # a bf16 cache rounds k and v
    for step, (call_, tokens) in enumerate(zip(model.calls, yielded)):
        for row, history in enumerate(histories):
            reference = model.uncached(history)
            if not torch.allclose(call_.logits[row], reference, atol=tolerance, rtol=0.0):
                error = (call_.logits[row] - reference).abs().max().item()
                fail("4.3", f"step {step}: sequence {row}'s logits differ from recomputing it alone "
                            f"without a cache (max |Δ| {error:.3g}; {what})")
            if not params[row].greedy:
                expected = sample_row(call_.logits[row], params[row], generators[row], history)
                if tokens[row] == expected:
                    continue
                fresh = sample_row(call_.logits[row], params[row], make_generator(params[row].seed), history)
                if step > 0 and tokens[row] == fresh:
                    fail("4.3", f"step {step}: sequence {row} drew token {tokens[row]}, the first draw of a "
                                f"fresh generator, not the {step + 1}th draw of its stream ({expected}): you "
                                "re-created the generators every step; make them once per request, before "
                                "the loop, so that each step draws the next number")
                fail("4.3", f"step {step}: sequence {row}, sampled (temperature {params[row].temperature}, "
                            f"seed {params[row].seed}), got token {tokens[row]}, but drawing from its "
                            f"logits with its own generator gives {expected}: pass sample_next the "
                            "generators made once before the loop, and append every new token to sequences")
            expected = _penalized_argmax(call_.logits[row], history, params[row].repetition_penalty)
            if tokens[row] != expected:
                fail("4.3", f"step {step}: sequence {row} got token {tokens[row]}, but its logits (with "
                            f"the repetition penalty over its history) pick {expected}: append every "
                            "new token to sequences, which sample_next reads")
        for history, token in zip(histories, tokens):
            history.append(token)


def check_cached_steps(cached_steps) -> None:
    """Exercise 4.3: unpadded and padded batches, a repetition penalty, seeded sampling, fp32 and bf16."""
    from aie_lessons.sampling import SamplingParams

    greedy = SamplingParams(max_new_tokens=5, ignore_eos=True)
    penalised = SamplingParams(max_new_tokens=4, ignore_eos=True, repetition_penalty=1.8)
    sampled = [SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=t, seed=s)
               for t, s in ((1.5, 11), (2.0, 12))]
    cases = [
        ([[5, 9, 12, 7, 3, 30]], [greedy], torch.float32, 2),  # one prompt: no padding
        ([[5, 9, 12, 7, 3], [40, 41], [8, 6, 33, 2]], [greedy] * 3, torch.float32, 3),  # padded
        ([[11, 4, 9], [6, 50, 22, 13, 8, 17, 3]], [penalised, greedy], torch.float32, 2),
        ([[7, 7, 3, 19], [23], [4, 4, 4, 4, 4, 4]], [greedy] * 3, torch.bfloat16, 2),
        ([[3, 14, 15, 9], [26, 5]], sampled, torch.float32, 2),  # sampled, seeded: one draw per step
    ]
    for seed, (prompts, params, dtype, layers) in enumerate(cases):
        _run_case(cached_steps, prompts, params, dtype, layers, seed)
    passed("4.3", "one right-sized cache, one prefill of the padded batch, then one token per step at "
                  "each sequence's own position and the next cache column: the logits of a recomputation "
                  "without cache, and each seeded sequence's own draws, for padded batches, several "
                  "layers, fp32 and bf16")


# --- 4.4 bytes per token -----------------------------------------------------------------------
def check_decode_bytes(decode_bytes_per_token) -> None:
    """Exercise 4.4: tied and untied heads, fp32 and bf16 weights, caches of several lengths and dtypes."""
    for tie in (True, False):
        for weight_dtype in (torch.float32, torch.bfloat16):
            model = random_model(3, weight_dtype, tie=tie, seed=7)
            config = model.config
            size = torch.empty((), dtype=weight_dtype).element_size()
            table = config.vocab_size * config.hidden_size * size
            # Everything a step streams, counted module by module: each layer's seven matrices and
            # two norms, the final norm, and the output head (the embedding lookup reads one row).
            layer = sum(p.numel() for p in model.layers[0].parameters()) * size
            weights = config.num_layers * layer + config.hidden_size * size + table
            # No context of 1 or 2: there one position short would equal no cache, or keys only.
            for context, cache_dtype in ((3, torch.float32), (37, torch.bfloat16), (200, torch.float32)):
                cache_size = torch.empty((), dtype=cache_dtype).element_size()
                cache = 2 * config.num_layers * config.num_kv_heads * config.head_dim * context * cache_size
                expected = weights + cache
                what = (f"({'tied' if tie else 'untied'} head, {weight_dtype} weights, {context} cached "
                        f"positions in {cache_dtype})")
                got = call("4.4", decode_bytes_per_token, model, context, cache_dtype)
                if isinstance(got, torch.Tensor) or not isinstance(got, int):
                    fail("4.4", f"return a Python int (a count of bytes), got {type(got).__name__}")
                if got == expected:
                    continue
                norms = (2 * config.num_layers + 1) * config.hidden_size * size
                if got == expected - norms:
                    fail("4.4", f"you left out the norms' weights {what}: every RMSNorm reads its scale "
                                "vector too; count every parameter, not only the matrices")
                if got == expected + cache // context:
                    fail("4.4", f"you counted context + 1 cached positions {what}: context already "
                                "includes the new token's own position")
                if got == expected - cache // context:
                    fail("4.4", f"you counted context − 1 cached positions {what}: context already "
                                "includes the new token's own position, whose key and value are read too")
                if got == expected + config.hidden_size * size:
                    fail("4.4", f"you counted the embedding's one row {what}: beside the matrices it is "
                                "negligible, and this count leaves it out")
                if got == weights:
                    fail("4.4", f"you left out the cache {what}: attention reads every cached key and value, "
                                "and at long contexts that is a large share of the bytes")
                if got == weights + cache // 2:
                    fail("4.4", f"the cache counts keys and values: twice what you counted {what}")
                if cache_size != 4 and got == weights + cache * 4 // cache_size:
                    fail("4.4", f"count the cache in cache_dtype ({cache_dtype}), not fp32 {what}")
                if not tie and got == expected + table:
                    fail("4.4", f"you counted the embedding table {what}: a lookup reads one row; only a "
                                "head tied to the table reads it whole")
                if tie and got == expected - table:
                    fail("4.4", f"you left out the output head {what}: tied to the embedding table, it "
                                "reads the whole table at every step")
                if tie and got == expected + table:
                    fail("4.4", f"the tied table counted twice {what}: it is read once, as the output head")
                if size != 4 and got == (weights * 4 // size) + cache:
                    fail("4.4", f"count each weight in the dtype it is stored in ({weight_dtype}) {what}")
                if got == weights // size + cache:
                    fail("4.4", f"you counted the weights' numbers, not their bytes {what}: multiply by the "
                                "element size (nbytes does it)")
                fail("4.4", f"expected {expected} bytes {what}: {weights} of weights and {cache} of "
                            f"cache; got {got}")
    passed("4.4", "every weight once in its own dtype, the head (tied or not) once, no embedding table "
                  "or row, and the keys and values of every cached position")


# --- 4.5 agreement with fp32 ------------------------------------------------------------------
def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """KL(p ‖ q) per position, in float64, from logits (positions, vocab)."""
    log_p, log_q = p_logits.double().log_softmax(-1), q_logits.double().log_softmax(-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def check_agreement(agreement) -> None:
    """Exercise 4.5: a noisy copy of random logits, and a shifted one whose probabilities are equal."""
    g = torch.Generator().manual_seed(43)
    positions, vocab = 6, 50
    reference = torch.randn(positions, vocab, generator=g) * 3
    logits = reference + torch.randn(positions, vocab, generator=g)  # a noisy copy: some top-1 flips
    got = call("4.5", agreement, reference, logits)
    for name in ("top1", "mean_kl", "max_logit_error"):
        if not isinstance(getattr(got, name), float):
            fail("4.5", f"{name} is a {type(getattr(got, name)).__name__}: return Python floats "
                        "(.item()), which print, compare and average like numbers")
    if got.positions != positions:
        fail("4.5", f"positions should be {positions}, the number of rows compared, got {got.positions}")

    shifted = call("4.5", agreement, reference, reference + 3.0)
    if abs(shifted.mean_kl) > 1e-5:
        fail("4.5", f"adding 3 to every logit changes no probability, yet your KL is {shifted.mean_kl:.3g}: "
                    "compute it from log-probabilities (log_softmax), not from raw logits")
    if shifted.top1 < 1.0:
        fail("4.5", "adding 3 to every logit changes no ranking, yet top1 is below 1")

    same_best = (reference.argmax(-1) == logits.argmax(-1)).double()
    if got.top1 > 1:
        fail("4.5", f"top1 is {got.top1}: that is a count of positions; return the fraction (0 … 1)")
    if abs(got.top1 - same_best.mean().item()) > 1e-6:
        fail("4.5", f"top1 should be {same_best.mean().item():.4f}, got {got.top1:.4f}: compare each "
                    "position's best token (argmax over the vocabulary, the last axis)")

    kl = _kl(reference, logits)
    expected = kl.mean().item()
    if abs(got.mean_kl - _kl(logits, reference).mean().item()) < 1e-6 * max(1.0, expected):
        fail("4.5", "you computed KL(model ‖ reference): KL is not symmetric; weight by the "
                    "reference's probabilities, Σ p_ref · (log p_ref − log p_model)")
    if abs(got.mean_kl - kl.sum().item()) < 1e-6 * kl.sum().item():
        fail("4.5", "mean_kl is summed over positions: sum over the vocabulary, then average over positions")
    if abs(got.mean_kl - expected / vocab) < 1e-6 * expected:
        fail("4.5", "mean_kl is averaged over the vocabulary too: KL sums over the vocabulary "
                    "(one number per position), then average over positions")
    if abs(got.mean_kl - expected) > 1e-4 * expected:
        fail("4.5", f"mean_kl should be {expected:.5f}, got {got.mean_kl:.5f}")

    # Both orders: a signed maximum is right in one of them (the largest gap is positive one way,
    # negative the other), so only the two together show a missing absolute value.
    swapped = call("4.5", agreement, logits, reference)
    difference = (reference - logits).abs()
    largest = difference.max().item()
    log_gap = (reference.log_softmax(-1) - logits.log_softmax(-1)).abs().max().item()
    for result in (got, swapped):
        error = result.max_logit_error
        if abs(error - difference.mean().item()) < 1e-5:
            fail("4.5", "max_logit_error is the mean |logit difference|: take the largest one")
        if abs(error - largest) <= 1e-5:
            continue
        if abs(error - log_gap) < 1e-4:
            fail("4.5", f"max_logit_error should be {largest:.4f}, got {error:.4f}: you compared "
                        "log-probabilities; the largest |logit difference| is on the raw logits")
        if any(abs(error - signed) < 1e-5 for signed in ((reference - logits).max().item(),
                                                         (logits - reference).max().item())):
            fail("4.5", f"max_logit_error should be {largest:.4f}, got {error:.4f}: you took the largest "
                        "signed difference; a logit too low is as wrong as one too high, take the "
                        "largest absolute difference")
        fail("4.5", f"max_logit_error should be {largest:.4f}, the largest |logit − reference logit| "
                    f"anywhere, got {error:.4f}")
    passed("4.5", "top-1 agreement, mean KL(reference ‖ model) and the largest logit error are right")
