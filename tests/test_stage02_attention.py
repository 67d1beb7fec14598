"""Stage 02: shape checker, hand-written attention vs SDPA and transformers, its checks."""

from __future__ import annotations

import pytest
import torch

import aie_lessons.attention as attention
from aie_lessons.checks import stage02 as checks
from aie_lessons.model import LlamaModel, apply_rope, sdpa_attention
from aie_lessons.shapes import Dims, ShapeError

from check_expect import names_the_mistake


def test_shape_error_names_tensor_symbols_and_values():
    dims = Dims(H=9, D=64)
    dims.check("q", torch.zeros(2, 9, 7, 64), "B H S D")
    with pytest.raises(ShapeError, match=r"^q: expected \(B, H, S, D\) = \(2, 9, 7, 64\), got \(2, 7, 9, 64\)$"):
        dims.check("q", torch.zeros(2, 7, 9, 64), "B H S D")
    with pytest.raises(ShapeError, match=r"x: expected \(B, S, H\*D\) = \(\?, \?, 576\)"):
        Dims(H=9, D=64).check("x", torch.zeros(2, 3, 575), "B S H*D")


@pytest.mark.parametrize("seq, kv_len", [(5, 5), (1, 9), (3, 8)])
def test_manual_attention_matches_sdpa_with_gqa_and_offsets(seq, kv_len):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, seq, 16, generator=g)
    k, v = torch.randn(2, 2, kv_len, 16, generator=g), torch.randn(2, 2, kv_len, 16, generator=g)
    mask = torch.ones(seq, kv_len, dtype=torch.bool).tril(kv_len - seq)[None, None]
    expected = sdpa_attention(q, k, v, mask=mask)
    assert torch.allclose(attention.manual_attention(q, k, v), expected, atol=1e-5)
    assert torch.allclose(attention.manual_attention(q, k, v, mask), expected, atol=1e-5)


def test_manual_attention_refuses_mismatched_kv_shapes():
    q, k = torch.zeros(1, 6, 4, 16), torch.zeros(1, 2, 4, 16)
    with pytest.raises(ShapeError, match=r"v: expected \(B, Hkv, T, D\) = \(1, 2, 4, 16\)"):
        attention.manual_attention(q, k, torch.zeros(1, 2, 4, 8))


@pytest.mark.oracle
def test_manual_backend_logits_match_transformers(real_model_dir, gguf_reference):
    """Against transformers reading the GGUF. The bound is fp32 rounding grown over 30 layers,
    relative to the logits' size: 2e-5 × max |logit| (about 5e-4 here; measured 7e-5). A wrong
    attention is off by whole units."""
    from aie_lessons.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(real_model_dir)
    ours = LlamaModel.from_pretrained(real_model_dir, attention="manual")
    ids = torch.tensor([tokenizer.encode_chat("Why is the sky blue? Answer in detail.")])
    with torch.inference_mode():
        reference = gguf_reference(ids).logits
        assert (ours(ids) - reference).abs().max().item() <= 2e-5 * reference.abs().max().item()


def view_without_transpose(x, heads):
    b, s, w = x.shape
    return x.view(b, heads, s, w // heads)


def split_d_major(x, heads):
    b, s, w = x.shape
    return x.view(b, s, w // heads, heads).permute(0, 3, 1, 2)


@pytest.mark.parametrize("wrong, message", [
    (view_without_transpose, "viewed \\(B, S, H·D\\) as \\(B, H, S, D\\) directly"),
    (split_d_major, "\\(D, H\\)"),
    (lambda x, heads: x.view(x.shape[0], x.shape[1], heads, -1), "expected split_heads\\(x\\) of shape \\(2, 3, 5, 4\\), got \\(2, 5, 3, 4\\)"),
])
def test_split_heads_check_names_the_mistake(wrong, message):
    with names_the_mistake("2.1", message):
        checks.check_split_heads(wrong, attention.merge_heads)


def weights_scaled_after(q, k, mask):
    scores = (q @ k.transpose(-1, -2)).masked_fill(~mask, attention.MASKED)
    return torch.softmax(scores, -1) * q.shape[-1] ** -0.5


def weights_minus_inf(q, k, mask):
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), -1)


def weights_unmasked(q, k, mask):
    return torch.softmax((q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5, -1)


@pytest.mark.parametrize("wrong, message", [
    (weights_scaled_after, "scaled after softmax"),
    (weights_minus_inf, "NaN"),
    (weights_unmasked, "masked keys got weight"),
])
def test_attention_weights_check_names_the_mistake(wrong, message):
    with names_the_mistake("2.2", message):
        checks.check_attention_weights(wrong)


def group_strided(q, kv_heads):
    b, h, s, d = q.shape
    return q.view(b, h // kv_heads, kv_heads, s, d).transpose(1, 2)


def group_copy(q, kv_heads):
    b, h, s, d = q.shape
    return q.clone().view(b, kv_heads, h // kv_heads, s, d)


@pytest.mark.parametrize("wrong, message", [
    (group_strided, "h % Hkv"),
    (group_copy, "copied q"),
])
def test_group_queries_check_names_the_mistake(wrong, message):
    with names_the_mistake("2.3", message):
        checks.check_group_queries(wrong)


def layer_rotating_v(attn, x, cos, sin, mask=None):
    cfg = attn.config
    q = attention.split_heads(attn.q_proj(x), cfg.num_heads)
    k = attention.split_heads(attn.k_proj(x), cfg.num_kv_heads)
    v = attention.split_heads(attn.v_proj(x), cfg.num_kv_heads)
    q, k, v = (apply_rope(t, cos, sin) for t in (q, k, v))
    return attn.o_proj(attention.merge_heads(attention.manual_attention(q, k, v, mask)))


def test_attention_layer_check_names_rope_on_v(tiny_dir):
    model = LlamaModel.from_pretrained(tiny_dir)
    with names_the_mistake("2.4", "you rotated v too"):
        checks.check_attention_layer(layer_rotating_v, model)
    checks.check_attention_layer(attention.attention_layer, model)


def test_reference_implementations_pass():
    checks.check_split_heads(attention.split_heads, attention.merge_heads)
    checks.check_attention_weights(attention.attention_weights)
    checks.check_group_queries(attention.group_queries)
