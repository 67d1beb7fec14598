"""Stage 04: KV cache memory formula, in-place writes, invariants, the roofline, checks."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from aie_lessons.attention import manual_attention
from aie_lessons.cached_generate import cached_steps, generate_cached, next_positions
from aie_lessons.checks import stage04 as checks
from aie_lessons.config import ModelConfig
from aie_lessons.generate import ContextLengthError, generate
from aie_lessons.kv_cache import CacheFullError, KVCache, kv_cache_bytes
from aie_lessons.masks import attention_mask
from aie_lessons.model import LAST_POSITION, AttentionMetadata, LlamaModel, sdpa_attention
from aie_lessons.padded_batch import generate_batch, left_pad
from aie_lessons.precision import Agreement, agreement
from aie_lessons.roofline import decode_bytes_per_token, read_bandwidth
from aie_lessons.sampling import SamplingParams, make_generator, sample_next
from aie_lessons.tokenizer import Tokenizer

from check_expect import mutants, names_the_mistake
from stepwise import chunked_logits, prefill_then_decode


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return LlamaModel.from_pretrained(tiny_dir), Tokenizer.from_pretrained(tiny_dir)


def test_memory_formula_equals_allocated_bytes(tiny_dir):
    config = ModelConfig.from_json(tiny_dir)
    for dtype in (torch.float32, torch.bfloat16):
        cache = KVCache(config, batch_size=3, max_len=40, dtype=dtype)
        assert cache.nbytes == kv_cache_bytes(config, 40, 3, dtype)


@pytest.mark.oracle
def test_smollm2_cache_sizes_by_the_published_formula(real_model_dir):
    config = ModelConfig.from_json(real_model_dir)
    # 2 (k, v) × 30 layers × 3 kv heads × 64 dims × tokens × 4 bytes
    assert kv_cache_bytes(config, 2048, 1, torch.float32) == 2 * 30 * 3 * 64 * 2048 * 4 == 94_371_840
    assert kv_cache_bytes(config, 8192, 1, torch.bfloat16) == 188_743_680


def test_cache_on_equals_cache_off_single_and_batch(tiny):
    model, tokenizer = tiny
    prompts = [tokenizer.encode(t) for t in ("The quick brown", "中文", "a", "emoji 🤗 here")]
    params = SamplingParams(max_new_tokens=12)
    assert generate_cached(model, tokenizer, prompts[:1], params)[0].token_ids == \
        generate(model, tokenizer, prompts[0], params).token_ids
    cached = generate_cached(model, tokenizer, prompts, params)
    plain = generate_batch(model, tokenizer, prompts, params)
    assert [c.token_ids for c in cached] == [p.token_ids for p in plain]


def test_prefill_then_decode_equals_full_recompute(tiny):
    model, _ = tiny
    ids = torch.arange(3, 23)[None]
    with torch.inference_mode():
        full = model(ids)
        stepwise = prefill_then_decode(model, ids, KVCache(model.config, 1, 20), prefill=7)
    assert torch.allclose(stepwise, full, atol=1e-5)


def test_chunked_prefill_uses_the_bottom_right_causal_mask(tiny):
    """Two chunks of 5 through the cache must equal one pass of 10 (SDPA is_causal would not)."""
    model, _ = tiny
    ids = torch.arange(3, 13)[None]
    with torch.inference_mode():
        chunks = chunked_logits(model, ids, KVCache(model.config, 1, 10), [5, 10])
        assert torch.allclose(chunks, model(ids), atol=1e-5)


def test_cache_writes_in_place_and_a_new_request_starts_again_at_zero(tiny):
    model, _ = tiny
    cache = KVCache(model.config, 1, 16)
    pointer = cache.keys.data_ptr()
    first, second = torch.arange(3, 9)[None], torch.arange(20, 24)[None]
    with torch.inference_mode():
        chunked_logits(model, first, cache, [6])
        assert cache.keys.data_ptr() == pointer and cache.keys[:, :, :, 5].abs().sum() > 0
        reused = chunked_logits(model, second, cache, [2, 3, 4])  # the old entries are overwritten
        fresh = chunked_logits(model, second, KVCache(model.config, 1, 16), [2, 3, 4])
    assert cache.keys.data_ptr() == pointer and torch.equal(reused, fresh)


def test_full_cache_is_refused_with_the_numbers(tiny):
    model, _ = tiny
    cache = KVCache(model.config, 1, 4)
    with pytest.raises(CacheFullError, match=r"holds 4 positions; writing 6 at column 0 needs 6.*max_len ≥"), \
            torch.inference_mode():
        chunked_logits(model, torch.arange(3, 9)[None], cache, [6])


def test_too_long_request_is_refused_not_truncated(tiny):
    model, tokenizer = tiny
    with pytest.raises(ContextLengthError, match="context is 64 tokens"):
        generate_cached(model, tokenizer, [[5] * 60], SamplingParams(max_new_tokens=10))


def test_streaming_from_a_batch_reports_each_prompt(tiny):
    model, tokenizer = tiny
    prompts = [tokenizer.encode("The quick"), tokenizer.encode("中文")]
    pieces: dict[int, str] = {0: "", 1: ""}

    def on_text(index, text):
        pieces[index] += text

    results = generate_cached(model, tokenizer, prompts, SamplingParams(max_new_tokens=8), on_text)
    assert [pieces[0], pieces[1]] == [r.text for r in results]


@pytest.mark.oracle
def test_real_model_cached_batch_matches_plain_batch(real_model_dir):
    model, tokenizer = LlamaModel.from_pretrained(real_model_dir), Tokenizer.from_pretrained(real_model_dir)
    prompts = [tokenizer.encode_chat(q) for q in ("What is the capital of France?", "Name three primary colours.",
                                                 "Write a haiku about autumn leaves falling on a quiet river.",
                                                 "Give me one tip for learning to cook.")]
    params = SamplingParams(max_new_tokens=24)
    cached = generate_cached(model, tokenizer, prompts, params)
    plain = generate_batch(model, tokenizer, prompts, params)
    assert [c.token_ids for c in cached] == [p.token_ids for p in plain]


# --- 4.1: wrong caches ------------------------------------------------------------------------
class ConcatCache(KVCache):
    """Allocates a new tensor every step instead of writing in place."""

    def update(self, layer, k, v, start):
        end = start + k.shape[2]
        self.keys = self.keys.clone()
        self.keys[layer, :, :, start:end] = k
        self.values[layer, :, :, start:end] = v
        return self.keys[layer, :, :, :end], self.values[layer, :, :, :end]


class NewOnlyCache(KVCache):
    def update(self, layer, k, v, start):
        super().update(layer, k, v, start)
        return k, v


class AtZeroCache(KVCache):
    def update(self, layer, k, v, start):
        n = k.shape[2]
        self.keys[layer, :, :, :n] = k
        self.values[layer, :, :, :n] = v
        return self.keys[layer, :, :, : start + n], self.values[layer, :, :, : start + n]


class CountingCache(KVCache):
    """Ignores ``start`` and keeps its own count, as the cache did before progress moved out."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.count = 0

    def update(self, layer, k, v, start):
        end = self.count + k.shape[2]
        self.keys[layer, :, :, self.count:end] = k
        self.values[layer, :, :, self.count:end] = v
        self.count = end
        return self.keys[layer, :, :, :end], self.values[layer, :, :, :end]


class OneColumnShortCache(KVCache):
    def update(self, layer, k, v, start):
        end = start + k.shape[2]
        self.keys[layer, :, :, start:end] = k
        self.values[layer, :, :, start:end] = v
        return self.keys[layer, :, :, :end - 1], self.values[layer, :, :, :end - 1]


class CopyingCache(KVCache):
    """Hands back copies of the history: every decode step would copy the whole cache."""

    def update(self, layer, k, v, start):
        keys, values = super().update(layer, k, v, start)
        return keys.clone(), values.clone()


class EveryLayerCache(KVCache):
    """Forgets the layer index: the new keys are broadcast into every layer."""

    def update(self, layer, k, v, start):
        end = start + k.shape[2]
        self.keys[:, :, :, start:end] = k
        self.values[:, :, :, start:end] = v
        return self.keys[layer, :, :, :end], self.values[layer, :, :, :end]


class UncheckedCache(KVCache):
    """No bounds: a write past the end fails inside PyTorch, and a negative start is accepted."""

    def update(self, layer, k, v, start):
        end = start + k.shape[2]
        self.keys[layer, :, :, start:end] = k
        self.values[layer, :, :, start:end] = v
        return self.keys[layer, :, :, :end], self.values[layer, :, :, :end]


class FullAtTheLastColumnCache(KVCache):
    """Refuses a write that exactly fills the cache (≥ instead of >)."""

    def update(self, layer, k, v, start):
        if start + k.shape[2] >= self.max_len:
            raise CacheFullError("the cache is full")
        return super().update(layer, k, v, start)


class SilentFullCache(KVCache):
    """Refuses, but without the numbers or the fix."""

    def update(self, layer, k, v, start):
        if start + k.shape[2] > self.max_len:
            raise CacheFullError("the cache is full")
        return super().update(layer, k, v, start)


class NegativeStartCache(KVCache):
    """Checks the end but lets a negative start through (the slice then writes nothing, or the end)."""

    def update(self, layer, k, v, start):
        if start < 0:
            start = 0
        return super().update(layer, k, v, start)


@mutants("4.1", [
    (ConcatCache, "allocated new memory"),
    (NewOnlyCache, "returned only the new keys"),
    (AtZeroCache, "written at column 0"),
    (CountingCache, "use start, not a count"),
    (OneColumnShortCache, "shape"),
    (CopyingCache, "returned a copy"),
    (EveryLayerCache, "changed other layers"),
    (UncheckedCache, "raise CacheFullError"),
    (FullAtTheLastColumnCache, "fits exactly"),
    (SilentFullCache, r"name the cache's size \(12\)"),
    (NegativeStartCache, "start=-1"),
])
def test_kv_cache_check_names_the_mistake(tiny_dir, wrong, message):
    with names_the_mistake("4.1", message):
        checks.check_kv_cache(wrong, ModelConfig.from_json(tiny_dir))


def test_kv_cache_check_passes_with_the_real_models_shapes(real_model_dir):
    checks.check_kv_cache(KVCache, ModelConfig.from_json(real_model_dir))


# --- 4.2: wrong positions ---------------------------------------------------------------------
def cache_length(is_real):
    return torch.full((is_real.shape[0], 1), is_real.shape[1])


def last_real_index(is_real):
    return is_real.sum(-1, keepdim=True) - 1


def padding_count(is_real):
    return (~is_real).sum(-1, keepdim=True)


def flat_counts(is_real):
    return is_real.sum(-1)


def batch_axis_counts(is_real):
    return is_real.sum(0, keepdim=True)


def float_counts(is_real):
    return is_real.float().sum(-1, keepdim=True)


@mutants("4.2", [
    (cache_length, "cache length"),
    (last_real_index, "off by one"),
    (padding_count, "counted the padding"),
    (flat_counts, r"keep the column axis, \(B, 1\)"),
    (batch_axis_counts, "over the batch axis"),
    (float_counts, "integer counts"),
])
def test_next_positions_check_names_the_mistake(wrong, message):
    with names_the_mistake("4.2", message):
        checks.check_next_positions(wrong)


# --- 4.3: wrong loops -------------------------------------------------------------------------
def wrong_loop(name: str, **mistake):
    """``cached_steps`` with one mistake a learner might make, named by ``mistake``'s key."""

    @torch.inference_mode()
    def loop(model, prompts, params):
        device = model.embed_tokens.weight.device
        generators = [make_generator(p.seed, device) for p in params]
        sequences = [list(p) for p in prompts]
        steps = max(p.max_new_tokens for p in params)
        batch = left_pad(prompts, pad_id=0, device=device)
        rows, width = batch.input_ids.shape
        dtype = torch.float32 if mistake.get("fp32_cache") else model.embed_tokens.weight.dtype
        length = {"no_room_to_decode": width, "oversized_cache": model.config.max_position_embeddings}.get(
            next((m for m in ("no_room_to_decode", "oversized_cache") if mistake.get(m)), ""), width + steps)
        cache = KVCache(model.config, rows, length, dtype=dtype, device=device)
        is_real = batch.is_real
        positions = torch.arange(width).expand(rows, width) if mistake.get("prefill_positions") else batch.positions
        mask = None if mistake.get("no_prefill_mask") else attention_mask(is_real, width)
        logits = model(batch.input_ids, positions,
                       AttentionMetadata(mask=mask, cache=cache, cache_start=0, logits_at=LAST_POSITION))
        ids = batch.input_ids
        for step in range(steps):
            if mistake.get("generators_each_step"):
                generators = [make_generator(p.seed, device) for p in params]
            tokens = sample_next(logits, params, generators, sequences)
            if not mistake.get("no_append"):
                for sequence, token in zip(sequences, tokens):
                    sequence.append(token)
            yield tokens
            if step + 1 == steps and not mistake.get("extra_pass"):
                return
            if mistake.get("columns_as_positions"):
                positions = torch.full((rows, 1), width + step)
            elif not mistake.get("positions_after_append"):
                positions = next_positions(is_real)
            if not mistake.get("stale_mask"):
                is_real = torch.cat([is_real, torch.ones_like(is_real[:, :1])], dim=1)
            if mistake.get("positions_after_append"):
                positions = next_positions(is_real)
            mask = None if mistake.get("no_decode_mask") else attention_mask(is_real, 1)
            if mistake.get("square_decode_mask"):
                mask = attention_mask(is_real, is_real.shape[1])
            new_ids = torch.tensor(tokens)[:, None]
            if mistake.get("new_cache_each_step"):
                cache = KVCache(model.config, rows, width + steps, dtype=dtype, device=device)
            column = {"not_advanced": width, "previous_column": width + step - 1}.get(
                next((m for m in ("not_advanced", "previous_column") if mistake.get(m)), ""), width + step)
            if mistake.get("whole_sequence"):
                ids = torch.cat([ids, new_ids], dim=1)
                full_mask = attention_mask(is_real, ids.shape[1])
                full_positions = (is_real.long().cumsum(-1) - 1).clamp(min=0)
                logits = model(ids, full_positions, AttentionMetadata(mask=full_mask, cache=cache, cache_start=0,
                                                                      logits_at=LAST_POSITION))
            else:
                logits = model(new_ids, positions, AttentionMetadata(mask=mask, cache=cache, cache_start=column))

    loop.__name__ = name
    return loop


@mutants("4.3", [
    (wrong_loop("columns_as_positions", columns_as_positions=True), "off by the padding"),
    (wrong_loop("not_advanced", not_advanced=True), "cache was not advanced"),
    (wrong_loop("previous_column", previous_column=True), "over the last token already cached"),
    (wrong_loop("whole_sequence", whole_sequence=True), r"feed only the newest token.*\(B, 1\)"),
    (wrong_loop("no_prefill_mask", no_prefill_mask=True), "prefill ran without a mask"),
    (wrong_loop("no_decode_mask", no_decode_mask=True), "decode step 0 ran without a mask"),
    (wrong_loop("stale_mask", stale_mask=True), "mask covers"),
    (wrong_loop("prefill_positions", prefill_positions=True), "prefill's RoPE positions count the padding"),
    (wrong_loop("new_cache_each_step", new_cache_each_step=True), "allocated .* caches"),
    (wrong_loop("extra_pass", extra_pass=True), "once more after yielding the last tokens"),
    (wrong_loop("no_append", no_append=True), "append every new token"),
    (wrong_loop("fp32_cache", fp32_cache=True), "allocate it in the weights' dtype"),
    (wrong_loop("no_room_to_decode", no_room_to_decode=True), "room for the padded prompt plus every new token"),
    (wrong_loop("positions_after_append", positions_after_append=True), "positions are one too far"),
    (wrong_loop("square_decode_mask", square_decode_mask=True), r"mask is \(1, 1, 7, 7\).*one query row"),
    (wrong_loop("generators_each_step", generators_each_step=True), "re-created the generators every step"),
    (wrong_loop("oversized_cache", oversized_cache=True), r"the cache holds 64 positions.*size it for the request"),
])
def test_cached_steps_check_names_the_mistake(wrong, message):
    with names_the_mistake("4.3", message):
        checks.check_cached_steps(wrong)


def test_cached_steps_check_restores_the_loops_own_helpers():
    """The check runs the loop on its own cache, padding, mask and positions, then puts them back."""
    import aie_lessons.cached_generate as module

    before = {name: getattr(module, name) for name in ("KVCache", "left_pad", "attention_mask", "next_positions")}
    checks.check_cached_steps(cached_steps)
    assert {name: getattr(module, name) for name in before} == before


# --- 4.4: wrong byte counts -------------------------------------------------------------------
def bytes_without_cache(model, context, cache_dtype):
    return sum(p.nbytes for p in model.parameters())


def bytes_of_every_parameter(model, context, cache_dtype):
    return sum(p.nbytes for p in model.parameters()) + kv_cache_bytes(model.config, context, 1, cache_dtype)


def bytes_without_the_tied_head(model, context, cache_dtype):
    embedding = model.embed_tokens.weight
    weights = sum(p.nbytes for p in model.parameters() if p is not embedding)
    return weights + kv_cache_bytes(model.config, context, 1, cache_dtype)


def numbers_not_bytes(model, context, cache_dtype):
    return sum(p.numel() for p in model.parameters()) + kv_cache_bytes(model.config, context, 1, cache_dtype)


def keys_only(model, context, cache_dtype):
    return sum(p.nbytes for p in model.parameters()) + kv_cache_bytes(model.config, context, 1, cache_dtype) // 2


def cache_in_fp32(model, context, cache_dtype):
    return sum(p.nbytes for p in model.parameters()) + kv_cache_bytes(model.config, context, 1, torch.float32)


def weights_in_fp32(model, context, cache_dtype):
    return 4 * sum(p.numel() for p in model.parameters()) + kv_cache_bytes(model.config, context, 1, cache_dtype)


def matrices_only(model, context, cache_dtype):
    return sum(p.nbytes for p in model.parameters() if p.dim() == 2) + kv_cache_bytes(model.config, context, 1, cache_dtype)


def one_position_too_many(model, context, cache_dtype):
    return sum(p.nbytes for p in model.parameters()) + kv_cache_bytes(model.config, context + 1, 1, cache_dtype)


def one_position_short(model, context, cache_dtype):
    return (decode_bytes_per_token(model, context, cache_dtype)
            - kv_cache_bytes(model.config, 1, 1, cache_dtype))


def one_embedding_row(model, context, cache_dtype):
    """Adds the row the lookup reads: negligible, and left out by the exercise's count."""
    return decode_bytes_per_token(model, context, cache_dtype) + model.embed_tokens.weight[0].nbytes


def state_dict_bytes(model, context, cache_dtype):
    """``state_dict`` names a tied table twice, as the embedding and as the head."""
    return sum(t.nbytes for t in model.state_dict().values()) + kv_cache_bytes(model.config, context, 1, cache_dtype)


@mutants("4.4", [
    (bytes_without_cache, "left out the cache"),
    (bytes_of_every_parameter, "counted the embedding table"),
    (bytes_without_the_tied_head, "left out the output head"),
    (numbers_not_bytes, "numbers, not their bytes"),
    (keys_only, "keys and values: twice"),
    (cache_in_fp32, "count the cache in cache_dtype"),
    (weights_in_fp32, "dtype it is stored in"),
    (matrices_only, "left out the norms"),
    (one_position_too_many, r"context \+ 1 cached positions"),
    (state_dict_bytes, "tied table counted twice"),
    (one_position_short, r"context − 1 cached positions"),
    (one_embedding_row, "embedding's one row"),
])
def test_decode_bytes_check_names_the_mistake(wrong, message):
    with names_the_mistake("4.4", message):
        checks.check_decode_bytes(wrong)


@pytest.mark.oracle
def test_smollm2_decode_bytes_are_its_weights_plus_the_cache(real_model_dir):
    """134,515,008 parameters (the tied table read once, as the head) plus 2 × 30 × 3 × 64 per position."""
    model = LlamaModel.from_pretrained(real_model_dir)
    assert decode_bytes_per_token(model, 0, torch.float32) == 134_515_008 * 4
    assert decode_bytes_per_token(model, 8192, torch.float32) == 134_515_008 * 4 + 377_487_360
    bf16 = LlamaModel.from_pretrained(real_model_dir, dtype=torch.bfloat16)
    assert decode_bytes_per_token(bf16, 1000, torch.bfloat16) * 2 == decode_bytes_per_token(model, 1000, torch.float32)


def test_read_bandwidth_is_a_plausible_rate():
    best, median = read_bandwidth(megabytes=64, repeats=3)
    assert 1e8 < median <= best < 1e13


def fake_clock(read_seconds: list[float]):
    """A stand-in for ``time.perf_counter`` under which the n-th timed read lasts ``read_seconds[n]``."""
    now, ticks = 0.0, []
    for seconds in read_seconds:
        ticks += [now, now + seconds]
        now += seconds + 1.0
    return iter(ticks).__next__


def test_read_bandwidth_drops_the_first_pass_only_over_its_own_buffer(monkeypatch):
    """Each pass keeps its faster read; a fresh buffer's first pass (page faults) is not counted."""
    import aie_lessons.roofline as roofline

    # Passes of (sum, mv) reads: the first is slow (faulting), then 2 s and 4 s passes.
    reads = [8.0, 9.0, 2.0, 3.0, 5.0, 4.0]
    monkeypatch.setattr(roofline.time, "perf_counter", fake_clock(reads))
    nbytes = 4 * 2**20
    assert read_bandwidth(megabytes=4, repeats=2) == (nbytes / 2.0, nbytes / 3.0)
    buffer = torch.ones(2**20)  # already touched by the caller: every pass counts
    monkeypatch.setattr(roofline.time, "perf_counter", fake_clock(reads[:4]))
    assert read_bandwidth(repeats=2, buffer=buffer) == (nbytes / 2.0, nbytes / 5.0)


# --- 4.5: wrong agreements --------------------------------------------------------------------
def agreement_with(name, kl=None, top1=None, max_error=None, floats=True):
    """A wrong ``agreement``: the reference one with one quantity computed the wrong way."""

    def wrong(reference, logits):
        log_p, log_q = reference.log_softmax(-1), logits.log_softmax(-1)
        values = {
            "top1": (reference.argmax(-1) == logits.argmax(-1)).float().mean(),
            "mean_kl": (log_p.exp() * (log_p - log_q)).sum(-1).mean(),
            "max_logit_error": (reference - logits).abs().max(),
        }
        for field, fn in (("mean_kl", kl), ("top1", top1), ("max_logit_error", max_error)):
            if fn is not None:
                values[field] = fn(reference, logits, log_p, log_q)
        values = {k: v.item() if floats else v for k, v in values.items()}
        return Agreement(positions=reference.shape[0], **values)

    wrong.__name__ = name
    return wrong


@mutants("4.5", [
    (agreement_with("kl_reversed", kl=lambda r, l, log_p, log_q: (log_q.exp() * (log_q - log_p)).sum(-1).mean()),
     r"KL\(model ‖ reference\)"),
    (agreement_with("kl_summed", kl=lambda r, l, log_p, log_q: (log_p.exp() * (log_p - log_q)).sum()),
     "summed over positions"),
    (agreement_with("kl_mean_over_vocab", kl=lambda r, l, log_p, log_q: (log_p.exp() * (log_p - log_q)).mean()),
     "averaged over the vocabulary"),
    (agreement_with("kl_of_raw_logits", kl=lambda r, l, log_p, log_q: (r.softmax(-1) * (r - l)).sum(-1).mean()),
     "raw logits"),
    (agreement_with("top1_count", top1=lambda r, l, *_: (r.argmax(-1) == l.argmax(-1)).sum().float()),
     "count of positions"),
    (agreement_with("top1_wrong_axis", top1=lambda r, l, *_: (r.argmax(0) == l.argmax(0)).float().mean()),
     "last axis"),
    (agreement_with("mean_error", max_error=lambda r, l, *_: (r - l).abs().mean()), "mean |logit difference|"),
    (agreement_with("tensors", floats=False), "return Python floats"),
    (agreement_with("signed_max", max_error=lambda r, l, *_: (l - r).max()), "largest signed difference"),
    (agreement_with("signed_max_other_way", max_error=lambda r, l, *_: (r - l).max()), "largest signed difference"),
    (agreement_with("log_probability_gap", max_error=lambda r, l, log_p, log_q: (log_p - log_q).abs().max()),
     "you compared log-probabilities"),
])
def test_agreement_check_names_the_mistake(wrong, message):
    with names_the_mistake("4.5", message):
        checks.check_agreement(wrong)


def test_reference_implementations_pass(tiny_dir):
    checks.check_kv_cache(KVCache, ModelConfig.from_json(tiny_dir))
    checks.check_next_positions(next_positions)
    checks.check_cached_steps(cached_steps)
    checks.check_decode_bytes(decode_bytes_per_token)
    checks.check_agreement(agreement)


# --- stage 02's attention inside stage 04 -----------------------------------------------------
def test_manual_kernel_keeps_the_cache_invariants(tiny_untied_dir):
    """The learner's stage-02 attention (fp32): cached == uncached tokens, stepwise == full logits."""
    model, tokenizer = LlamaModel.from_pretrained(tiny_untied_dir), Tokenizer.from_pretrained(tiny_untied_dir)
    ids = torch.arange(3, 23)[None]
    with torch.inference_mode():
        expected = model(ids)
        model.use_attention(manual_attention)
        full = model(ids)
        stepwise = prefill_then_decode(model, ids, KVCache(model.config, 1, 20), prefill=7)
    assert torch.allclose(full, expected, atol=1e-5) and torch.allclose(stepwise, full, atol=1e-5)
    prompts = [tokenizer.encode(t) for t in ("The quick brown", "中文", "a", "emoji 🤗 here")]
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    cached = generate_cached(model, tokenizer, prompts, params)
    assert [c.token_ids for c in cached] == [p.token_ids for p in generate_batch(model, tokenizer, prompts, params)]
    assert cached[0].token_ids == generate(model, tokenizer, prompts[0], params).token_ids


def test_the_metadata_owns_attention_the_model_only_hands_it_q_k_v(tiny_untied_dir):
    """The step contract stages 06 and 07 build on: every layer calls the pass's metadata's attend
    with its own index, the new keys only and the model's kernel, and a subclass that stores and
    reads the cache its own way needs no change to the model."""
    calls = []

    @dataclass
    class Recording(AttentionMetadata):
        def attend(self, q, k, v, layer, kernel):
            calls.append((k.shape[2], layer, self.cache_start, kernel))
            return super().attend(q, k, v, layer, kernel)  # a paged cache would read blocks here

    model = LlamaModel.from_pretrained(tiny_untied_dir)
    ids, positions = torch.arange(3, 15)[None], torch.arange(12)[None]
    with torch.inference_mode():
        expected = prefill_then_decode(model, ids, KVCache(model.config, 1, 12), prefill=5)
        cache = KVCache(model.config, 1, 12)
        got = [model(ids[:, :5], positions[:, :5], Recording(cache=cache, cache_start=0))]
        got += [model(ids[:, t:t + 1], positions[:, t:t + 1], Recording(cache=cache, cache_start=t)) for t in range(5, 12)]
    assert torch.allclose(torch.cat(got, dim=1), expected, atol=1e-6)
    layers = model.config.num_layers
    assert calls[:layers] == [(5, i, 0, sdpa_attention) for i in range(layers)]  # the prefill: 5 new keys at column 0
    assert calls[layers:2 * layers] == [(1, i, 5, sdpa_attention) for i in range(layers)]  # then one at a time


def test_a_cache_without_a_start_column_and_a_mask_as_third_argument_are_refused(tiny_untied_dir):
    model = LlamaModel.from_pretrained(tiny_untied_dir)
    ids = torch.arange(3, 8)[None]
    with pytest.raises(ValueError, match="a cache needs cache_start"):
        model(ids, torch.arange(5)[None], AttentionMetadata(cache=KVCache(model.config, 1, 5)))
    with pytest.raises(TypeError, match="AttentionMetadata\\(mask=mask\\)"):
        model(ids, torch.arange(5)[None], torch.ones(1, 1, 5, 5, dtype=torch.bool))


def test_sampled_padded_batches_give_each_prompt_its_own_seeded_tokens(tiny_untied_dir):
    """Row i of a sampled batch, cached or not, equals prompt i sampled alone with its params."""
    model, tokenizer = LlamaModel.from_pretrained(tiny_untied_dir), Tokenizer.from_pretrained(tiny_untied_dir)
    prompts = [tokenizer.encode(t) for t in ("The quick brown fox", "a", "emoji 🤗 here")]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True, temperature=t, top_p=0.9, seed=s)
              for n, t, s in ((10, 1.2, 1), (6, 0.8, 2), (8, 1.5, 3))]
    alone = [generate(model, tokenizer, p, sp).token_ids for p, sp in zip(prompts, params)]
    assert all(len(set(a)) > 2 for a in alone), "the tiny model must sample varied tokens"
    assert [r.token_ids for r in generate_cached(model, tokenizer, prompts, params)] == alone
    assert [r.token_ids for r in generate_batch(model, tokenizer, prompts, params)] == alone
    shared = SamplingParams(max_new_tokens=6, temperature=1.2, seed=4)
    twins = generate_cached(model, tokenizer, [prompts[0], prompts[0]], shared)
    assert twins[0].token_ids == twins[1].token_ids  # one seed, one answer: the seed is per request
