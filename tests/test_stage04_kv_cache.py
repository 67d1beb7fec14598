"""Stage 04: KV cache memory formula, in-place writes, invariants, checks."""

from __future__ import annotations

import pytest
import torch

from aie_lessons.cached_generate import generate_cached, next_positions
from aie_lessons.checks import stage04 as checks
from aie_lessons.config import ModelConfig
from aie_lessons.generate import ContextLengthError, SamplingParams, generate
from aie_lessons.kv_cache import CacheFullError, KVCache, kv_cache_bytes
from aie_lessons.model import LlamaModel
from aie_lessons.padded_batch import generate_batch
from aie_lessons.precision import Agreement, agreement
from aie_lessons.tokenizer import Tokenizer

from check_expect import names_the_mistake


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
        cache = KVCache(model.config, 1, 20)
        parts = [model(ids[:, :7], cache=cache)]
        parts += [model(ids[:, i:i + 1], cache=cache) for i in range(7, 20)]
    assert torch.allclose(torch.cat(parts, dim=1), full, atol=1e-5)


def test_chunked_prefill_uses_the_bottom_right_causal_mask(tiny):
    """Two chunks of 5 through the cache must equal one pass of 10 (SDPA is_causal would not)."""
    model, _ = tiny
    ids = torch.arange(3, 13)[None]
    with torch.inference_mode():
        cache = KVCache(model.config, 1, 10)
        chunks = torch.cat([model(ids[:, :5], cache=cache), model(ids[:, 5:], cache=cache)], dim=1)
        assert torch.allclose(chunks, model(ids), atol=1e-5)


def test_cache_writes_in_place_and_resets(tiny):
    model, _ = tiny
    cache = KVCache(model.config, 1, 16)
    pointer = cache.keys.data_ptr()
    with torch.inference_mode():
        model(torch.arange(3, 9)[None], cache=cache)
        assert cache.length == 6 and cache.keys.data_ptr() == pointer
        cache.reset()
        model(torch.arange(3, 5)[None], cache=cache)
    assert cache.length == 2 and cache.keys.data_ptr() == pointer


def test_full_cache_is_refused_with_the_numbers(tiny):
    model, _ = tiny
    cache = KVCache(model.config, 1, 4)
    with pytest.raises(CacheFullError, match=r"holds 4 positions; 0 are used and 6 more.*max_len ≥"), \
            torch.inference_mode():
        model(torch.arange(3, 9)[None], cache=cache)


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


class ConcatCache(KVCache):
    """Allocates a new tensor every step instead of writing in place."""

    def update(self, layer, k, v):
        end = self.length + k.shape[2]
        self.keys = self.keys.clone()
        self.keys[layer, :, :, self.length:end] = k
        self.values[layer, :, :, self.length:end] = v
        return self.keys[layer, :, :, :end], self.values[layer, :, :, :end]


class NewOnlyCache(KVCache):
    def update(self, layer, k, v):
        super().update(layer, k, v)
        return k, v


class AtZeroCache(KVCache):
    def update(self, layer, k, v):
        n = k.shape[2]
        self.keys[layer, :, :, :n] = k
        self.values[layer, :, :, :n] = v
        return self.keys[layer, :, :, : self.length + n], self.values[layer, :, :, : self.length + n]


@pytest.mark.parametrize("wrong, message", [
    (ConcatCache, "allocated new memory"),
    (NewOnlyCache, "returned only the new keys"),
    (AtZeroCache, "written at position 0"),
])
def test_kv_cache_check_names_the_mistake(tiny_dir, wrong, message):
    with names_the_mistake("4.1", message):
        checks.check_kv_cache(wrong, ModelConfig.from_json(tiny_dir))


@pytest.mark.parametrize("wrong, message", [
    (lambda is_real: torch.full((is_real.shape[0], 1), is_real.shape[1]), "cache length"),
    (lambda is_real: is_real.sum(-1, keepdim=True) - 1, "off by one"),
])
def test_next_positions_check_names_the_mistake(wrong, message):
    with names_the_mistake("4.2", message):
        checks.check_next_positions(wrong)


def agreement_with(kl=None, top1=None, max_error=None, floats=True):
    """A wrong ``agreement``: the reference one with one quantity computed the wrong way."""

    def wrong(reference, logits):
        log_p, log_q = reference.log_softmax(-1), logits.log_softmax(-1)
        values = {
            "top1": (reference.argmax(-1) == logits.argmax(-1)).float().mean(),
            "mean_kl": (log_p.exp() * (log_p - log_q)).sum(-1).mean(),
            "max_logit_error": (reference - logits).abs().max(),
        }
        for name, fn in (("mean_kl", kl), ("top1", top1), ("max_logit_error", max_error)):
            if fn is not None:
                values[name] = fn(reference, logits, log_p, log_q)
        values = {k: v.item() if floats else v for k, v in values.items()}
        return Agreement(positions=reference.shape[0], **values)

    return wrong


@pytest.mark.parametrize("wrong, message", [
    (agreement_with(kl=lambda r, l, log_p, log_q: (log_q.exp() * (log_q - log_p)).sum(-1).mean()),
     r"KL\(model ‖ reference\)"),
    (agreement_with(kl=lambda r, l, log_p, log_q: (log_p.exp() * (log_p - log_q)).sum()), "summed over positions"),
    (agreement_with(kl=lambda r, l, log_p, log_q: (log_p.exp() * (log_p - log_q)).mean()), "averaged over the vocabulary"),
    (agreement_with(kl=lambda r, l, log_p, log_q: (r.softmax(-1) * (r - l)).sum(-1).mean()), "raw logits"),
    (agreement_with(top1=lambda r, l, *_: (r.argmax(-1) == l.argmax(-1)).sum().float()), "count of positions"),
    (agreement_with(top1=lambda r, l, *_: (r.argmax(0) == l.argmax(0)).float().mean()), "last axis"),
    (agreement_with(max_error=lambda r, l, *_: (r - l).abs().mean()), "mean |logit difference|"),
    (agreement_with(floats=False), "return Python floats"),
])
def test_agreement_check_names_the_mistake(wrong, message):
    with names_the_mistake("4.3", message):
        checks.check_agreement(wrong)


def test_reference_implementations_pass(tiny_dir):
    checks.check_kv_cache(KVCache, ModelConfig.from_json(tiny_dir))
    checks.check_next_positions(next_positions)
    checks.check_agreement(agreement)
