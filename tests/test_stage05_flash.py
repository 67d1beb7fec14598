"""Stage 05: tiled online softmax and the Triton kernel (interpreter on CPU, compiled on GPU)."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

import aie_lessons.flash_attention as flash
from aie_lessons.checks import stage05 as checks
from aie_lessons.sampling import SamplingParams
from aie_lessons.cached_generate import generate_cached
from aie_lessons.model import LlamaModel
from aie_lessons.tokenizer import Tokenizer

from check_expect import names_the_mistake

needs_triton = pytest.mark.skipif(
    not flash.HAS_TRITON,
    reason="triton is not installed (no macOS build): the Triton kernel cannot be tested here",
)
needs_gpu = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU: compiled Triton kernels run only there"
)

# (batch, q heads, kv heads, q_len, kv_len, head_dim): GQA, ragged, cache offsets, decode.
SHAPES = [(1, 4, 2, 37, 37, 64), (2, 9, 3, 20, 20, 64), (1, 4, 1, 5, 29, 64),
          (2, 6, 3, 1, 33, 64), (1, 2, 2, 18, 18, 128)]


def reference(q, k, v, causal):
    q_len, kv_len = q.shape[-2], k.shape[-2]
    mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=q.device).tril(kv_len - q_len) if causal else None
    out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True)
    groups = q.shape[1] // k.shape[1]
    scores = q.float() @ k.float().repeat_interleave(groups, 1).transpose(-1, -2) * q.shape[-1] ** -0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return out, torch.logsumexp(scores, -1)


def inputs(shape, dtype=torch.float32, device="cpu", seed=0):
    b, hq, hkv, s, t, d = shape
    g = torch.Generator(device=device).manual_seed(seed)
    make = lambda *size: torch.randn(*size, generator=g, device=device).to(dtype)  # noqa: E731
    return make(b, hq, s, d), make(b, hkv, t, d), make(b, hkv, t, d)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [True, False])
def test_tiled_pytorch_matches_sdpa(shape, causal):
    q, k, v = inputs(shape)
    out, lse = flash.tiled_attention(q, k, v, causal=causal, block_m=16, block_n=16)
    expected, expected_lse = reference(q, k, v, causal)
    assert (out - expected).abs().max() <= 1e-5
    assert (lse - expected_lse).abs().max() <= 1e-4


@needs_triton
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
def test_triton_kernel_matches_sdpa(shape, causal, dtype, tolerance):
    q, k, v = inputs(shape, dtype)
    out, lse = flash.triton_flash_attention(q, k, v, causal=causal)
    expected, expected_lse = reference(q, k, v, causal)
    assert out.dtype == dtype
    assert (out.float() - expected).abs().max() <= tolerance
    assert (lse - expected_lse).abs().max() <= 1e-3  # the kernel really ran the online softmax


@needs_triton
def test_bf16_under_the_interpreter_is_refused():
    if not flash.interpreted():
        pytest.skip("only the interpreter computes bf16 wrongly")
    q, k, v = inputs(SHAPES[0], torch.bfloat16)
    with pytest.raises(TypeError, match="bfloat16 is computed wrongly"):
        flash.triton_flash_attention(q, k, v)


def test_flash_backend_refuses_padding_masks():
    q, k, v = inputs(SHAPES[0])
    with pytest.raises(ValueError, match="padded batches use the 'sdpa'"):
        flash.flash_attention(q, k, v, mask=torch.ones(1, 1, 37, 37, dtype=torch.bool))


def test_flash_backend_generates_the_sdpa_tokens(tiny_dir):
    model, tokenizer = LlamaModel.from_pretrained(tiny_dir), Tokenizer.from_pretrained(tiny_dir)
    prompt = [tokenizer.encode("The quick brown fox")]
    params = SamplingParams(max_new_tokens=6)
    expected = generate_cached(model, tokenizer, prompt, params)[0].token_ids
    model.set_attention_backend("flash")
    assert generate_cached(model, tokenizer, prompt, params)[0].token_ids == expected


def test_flash_backend_gives_the_sdpa_logits_through_a_cache(tiny_untied_dir):
    """Logits, not only tokens: a prefill and single-token decode steps, flash against sdpa."""
    from aie_lessons.kv_cache import KVCache

    from stepwise import prefill_then_decode

    model = LlamaModel.from_pretrained(tiny_untied_dir)
    ids = torch.randint(3, model.config.vocab_size, (1, 21), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        expected = prefill_then_decode(model, ids, KVCache(model.config, 1, 21), prefill=17)
        model.set_attention_backend("flash")
        got = prefill_then_decode(model, ids, KVCache(model.config, 1, 21), prefill=17)
    assert got.shape == expected.shape == (1, 21, model.config.vocab_size)
    assert (got - expected).abs().max().item() <= 1e-4


@needs_gpu
@needs_triton
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("seq", [128, 1000, 4096])
def test_compiled_kernel_on_gpu(dtype, seq):
    q, k, v = inputs((2, 9, 3, seq, seq, 64), dtype, "cuda")
    out, lse = flash.triton_flash_attention(q, k, v, causal=True)
    expected, expected_lse = reference(q, k, v, True)
    assert (out.float() - expected).abs().max() <= 2e-2
    assert (lse - expected_lse).abs().max() <= 1e-2


def wrong_update_no_rescale(m, l, acc, scores, v):
    m_new = torch.maximum(m, scores.amax(-1))
    alpha, p = torch.exp(m - m_new), torch.exp(scores - m_new[..., None])
    return m_new, l * alpha + p.sum(-1), acc + p @ v


def wrong_update_block_max(m, l, acc, scores, v):
    m_new = scores.amax(-1)
    alpha, p = torch.exp(m - m_new), torch.exp(scores - m_new[..., None])
    return m_new, l * alpha + p.sum(-1), acc * alpha[..., None] + p @ v


@pytest.mark.parametrize("wrong, message", [
    (wrong_update_no_rescale, "forgot to rescale the accumulator"),
    (wrong_update_block_max, "running max forgot the old blocks"),
])
def test_online_softmax_check_names_the_mistake(wrong, message):
    with names_the_mistake("5.1", message):
        checks.check_online_softmax_update(wrong)


@pytest.mark.parametrize("wrong, message", [
    (lambda s, m, q, kv: min(kv, kv - q + s), "off by one on the diagonal block"),
    (lambda s, m, q, kv: kv - q + s + m, "clamp it"),
    (lambda s, m, q, kv: min(kv, s + m), "cache offset"),
])
def test_causal_key_end_check_names_the_mistake(wrong, message):
    with names_the_mistake("5.2", message):
        checks.check_causal_key_end(wrong)


def flash_without_tail_mask(q, k, v, causal=True, block_m=16, block_n=16):
    """What a kernel that forgot the tail mask computes: zero keys past the end get weight."""
    pad = -k.shape[2] % block_n
    zeros = torch.zeros(*k.shape[:2], pad, k.shape[3])
    k2, v2 = torch.cat([k, zeros], 2), torch.cat([v, zeros], 2)
    out = F.scaled_dot_product_attention(q, k2, v2, enable_gqa=True)
    return out, torch.zeros(q.shape[:-1])


def flash_strict_diagonal(q, k, v, causal=True, block_m=16, block_n=16):
    out = checks._sdpa(q, k, v, causal, diagonal=-1) if causal else checks._sdpa(q, k, v, False)
    return torch.nan_to_num(out), torch.zeros(q.shape[:-1])


@pytest.mark.parametrize("wrong, message", [
    (flash_without_tail_mask, "keys past kv_len were not masked"),
    (flash_strict_diagonal, "the diagonal is masked"),
])
def test_flash_kernel_check_names_the_mistake(wrong, message):
    with names_the_mistake("5.3", message):
        checks.check_flash_kernel(wrong, True)


def test_reference_implementations_pass():
    checks.check_online_softmax_update(flash.online_softmax_update)
    checks.check_causal_key_end(flash.causal_key_end)
    if flash.HAS_TRITON:
        checks.check_flash_kernel(flash.triton_flash_attention, True)
