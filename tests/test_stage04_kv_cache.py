"""Stage 04: KV cache memory formula, in-place writes, invariants, checks."""

from __future__ import annotations

import pytest
import torch

from aie_lessons.cached_generate import generate_cached, next_positions
from aie_lessons.checks import stage04 as checks
from aie_lessons.config import ModelConfig
from aie_lessons.generate import ContextLengthError, generate
from aie_lessons.kv_cache import CacheFullError, KVCache, kv_cache_bytes
from aie_lessons.model import LlamaModel
from aie_lessons.padded_batch import generate_batch
from aie_lessons.precision import Agreement, agreement
from aie_lessons.sampling import SamplingParams
from aie_lessons.tokenizer import Tokenizer

from check_expect import names_the_mistake
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
    with pytest.raises(CacheFullError, match=r"holds 4 positions; 6 were written at column 0.*max_len ≥"), \
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


@pytest.mark.parametrize("wrong, message", [
    (ConcatCache, "allocated new memory"),
    (NewOnlyCache, "returned only the new keys"),
    (AtZeroCache, "written at column 0"),
    (CountingCache, "use start, not a count"),
    (OneColumnShortCache, "shape"),
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


def test_a_cache_reading_backend_gets_the_new_keys_and_the_cache_itself(tiny_untied_dir):
    """The stage-07 hook: a backend registered with reads_cache=True stores and reads the cache."""
    from aie_lessons.model import ATTENTION_BACKENDS, CACHE_READING_BACKENDS, register_attention_backend, sdpa_attention

    calls = []

    @register_attention_backend("reads-cache-test", reads_cache=True)
    def reading(q, k, v, mask=None, *, cache, layer, start):
        calls.append((k.shape[2], layer, start))
        keys, values = cache.update(layer, k, v, start)  # a paged backend would read blocks here
        return sdpa_attention(q, keys, values, mask=mask)

    try:
        model = LlamaModel.from_pretrained(tiny_untied_dir)
        ids = torch.arange(3, 15)[None]
        with torch.inference_mode():
            expected = prefill_then_decode(model, ids, KVCache(model.config, 1, 12), prefill=5)
            model.set_attention_backend("reads-cache-test")
            got = prefill_then_decode(model, ids, KVCache(model.config, 1, 12), prefill=5)
    finally:
        ATTENTION_BACKENDS.pop("reads-cache-test")
        CACHE_READING_BACKENDS.discard("reads-cache-test")
    assert torch.allclose(got, expected, atol=1e-6)
    layers = model.config.num_layers
    assert calls[:layers] == [(5, i, 0) for i in range(layers)]  # the prefill: 5 new keys at column 0
    assert calls[layers:2 * layers] == [(1, i, 5) for i in range(layers)]  # then one at a time


def test_reregistering_a_backend_without_reads_cache_clears_the_flag():
    from aie_lessons.model import ATTENTION_BACKENDS, CACHE_READING_BACKENDS, register_attention_backend

    try:
        register_attention_backend("flag-test", reads_cache=True)(lambda q, k, v, mask=None, **_: q)
        register_attention_backend("flag-test")(lambda q, k, v, mask=None: q)
        assert "flag-test" not in CACHE_READING_BACKENDS
    finally:
        ATTENTION_BACKENDS.pop("flag-test", None)
        CACHE_READING_BACKENDS.discard("flag-test")


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
