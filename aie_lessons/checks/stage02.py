"""Checks for stage 02: splitting heads, attention weights, GQA grouping, the whole layer."""

from __future__ import annotations

import torch

from aie_lessons.checks.common import call, close, expect_shape, fail, isolated, passed

MASKED = torch.finfo(torch.float32).min


def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(2)


def _split_heads(x, num_heads):
    batch, seq, width = x.shape
    return x.view(batch, seq, num_heads, width // num_heads).transpose(1, 2)


def _merge_heads(x):
    batch, heads, seq, head_dim = x.shape
    return x.transpose(1, 2).reshape(batch, seq, heads * head_dim)


def _attention(q, k, v, mask=None):
    seq, kv_len = q.shape[-2], k.shape[-2]
    if mask is None:
        mask = torch.ones(seq, kv_len, dtype=torch.bool).tril(kv_len - seq)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def check_split_heads(split_heads, merge_heads) -> None:
    batch, seq, heads, head_dim = 2, 5, 3, 4
    x = torch.arange(batch * seq * heads * head_dim, dtype=torch.float32).view(batch, seq, heads * head_dim)
    got = call("2.1", split_heads, x, heads)
    expect_shape("2.1", "split_heads(x)", got, (batch, heads, seq, head_dim))
    expected = _split_heads(x, heads)
    if not torch.equal(got, expected):
        if torch.equal(got, x.view(batch, heads, seq, head_dim)):
            fail("2.1", "you viewed (B, S, H·D) as (B, H, S, D) directly, which mixes positions "
                        "into heads. Split the last axis first, view(B, S, H, D), then transpose(1, 2)")
        if torch.equal(got, x.view(batch, seq, head_dim, heads).permute(0, 3, 1, 2)):
            fail("2.1", "you split the last axis as (D, H): a projection's outputs are head-major, "
                        "(H, D), so head h owns outputs h·D … h·D + D − 1")
        fail("2.1", "split_heads(x)[b, h, s] should be x[b, s, h·D:(h+1)·D]")
    back = call("2.1", merge_heads, got)
    if not torch.equal(back, x):
        fail("2.1", "merge_heads(split_heads(x)) does not give x back")
    passed("2.1", "heads split as (B, S, H, D) → (B, H, S, D) and merged back")


def _reference_weights(q, k, mask):
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    return torch.softmax(scores.masked_fill(~mask, MASKED), dim=-1)


def check_attention_weights(attention_weights) -> None:
    g = _generator()
    q = torch.randn(2, 3, 4, 8, generator=g) * 2
    k = torch.randn(2, 3, 6, 8, generator=g) * 2
    mask = torch.ones(4, 6, dtype=torch.bool).tril(2)
    got = call("2.2", attention_weights, q, k, mask)
    expect_shape("2.2", "the weights", got, (2, 3, 4, 6))
    expected = _reference_weights(q, k, mask)
    if not close(got, expected, atol=1e-5):
        raw = (q @ k.transpose(-1, -2)).masked_fill(~mask, MASKED)
        d = q.shape[-1]
        mistakes = {
            "scores were scaled after softmax: divide q·kᵀ by √D *before* the softmax "
            "(then each row of weights sums to 1)": torch.softmax(raw, -1) * d**-0.5,
            "the scores are not scaled: divide q·kᵀ by √D": torch.softmax(raw, -1),
            "you divided by D; the scale is 1/√D": torch.softmax(raw / d, -1),
            "masked keys got weight: fill the scores where mask is False with MASKED before "
            "the softmax": torch.softmax((q @ k.transpose(-1, -2)) * d**-0.5, -1),
            "the mask is inverted: True means the query *may* attend to that key":
                torch.softmax(((q @ k.transpose(-1, -2)) * d**-0.5).masked_fill(mask, MASKED), -1),
            "softmax over the wrong axis: normalize over the keys, dim=-1":
                torch.softmax(((q @ k.transpose(-1, -2)) * d**-0.5).masked_fill(~mask, MASKED), -2),
        }
        for message, wrong in mistakes.items():
            if close(got, wrong, atol=1e-5):
                fail("2.2", message)
        fail("2.2", f"weights differ from softmax(q·kᵀ/√D) by up to {(got - expected).abs().max():.3g}")
    empty = torch.zeros(4, 6, dtype=torch.bool)
    got_empty = call("2.2", attention_weights, q, k, empty)
    if not torch.isfinite(got_empty).all():
        fail("2.2", "a query whose every key is masked gave NaN: fill with MASKED (the most "
                    "negative float), not -inf, so the softmax stays finite")
    passed("2.2", "softmax(q·kᵀ/√D) with masked keys at weight 0, rows summing to 1")


def check_group_queries(group_queries) -> None:
    batch, heads, kv_heads, seq, head_dim = 1, 6, 2, 2, 4
    q = torch.arange(batch * heads * seq * head_dim, dtype=torch.float32).view(batch, heads, seq, head_dim)
    got = call("2.3", group_queries, q, kv_heads)
    groups = heads // kv_heads
    expect_shape("2.3", "grouped q", got, (batch, kv_heads, groups, seq, head_dim))
    expected = q.view(batch, kv_heads, groups, seq, head_dim)
    if not torch.equal(got, expected):
        strided = q.view(batch, groups, kv_heads, seq, head_dim).transpose(1, 2)
        if torch.equal(got, strided):
            fail("2.3", "query head h went to kv head h % Hkv. In this model consecutive query "
                        "heads share a kv head: group j holds heads j·G … j·G + G − 1")
        fail("2.3", "grouped[b, j, g] should be query head j·G + g")
    if got.untyped_storage().data_ptr() != q.untyped_storage().data_ptr():
        fail("2.3", "group_queries copied q: a view (q.view(...)) costs no memory")
    passed("2.3", "query heads j·G … j·G + G − 1 share kv head j, as a view of q")


def check_attention_layer(attention_layer, model) -> None:
    from aie_lessons.model import apply_rope, rope_cos_sin

    attn = model.layers[0].self_attn
    config = attn.config
    g = _generator()
    x = torch.randn(2, 5, config.hidden_size, generator=g)
    positions = torch.arange(5).expand(2, 5)
    cos, sin = rope_cos_sin(positions, config.head_dim, config.rope_theta)
    helpers = dict(split_heads=_split_heads, merge_heads=_merge_heads, manual_attention=_attention)
    with torch.no_grad(), isolated(attention_layer, **helpers):
        got = call("2.4", attention_layer, attn, x, cos, sin)
    expect_shape("2.4", "the layer output", got, x.shape)
    with torch.no_grad():
        backend, attn.backend = attn.backend, "sdpa"
        try:
            expected = attn(x, cos, sin)
        finally:
            attn.backend = backend
    if close(got, expected, atol=1e-4):
        passed("2.4", "the hand-written layer matches the model's attention (RoPE on q and k only)")
        return
    with torch.no_grad():
        q = _split_heads(attn.q_proj(x), config.num_heads)
        k = _split_heads(attn.k_proj(x), config.num_kv_heads)
        v = _split_heads(attn.v_proj(x), config.num_kv_heads)

        def layer(q, k, v):
            return attn.o_proj(_merge_heads(_attention(q, k, v)))

        rope = lambda t: apply_rope(t, cos, sin)  # noqa: E731
        mistakes = {
            "you rotated v too: RoPE goes on q and k only, v carries content": layer(rope(q), rope(k), rope(v)),
            "q and k are not rotated: apply RoPE to both": layer(q, k, v),
            "only q is rotated: k needs RoPE too, or q·k does not depend on the distance": layer(rope(q), k, v),
        }
    for message, wrong in mistakes.items():
        if close(got, wrong, atol=1e-4):
            fail("2.4", message)
    fail("2.4", f"the layer output differs from the model's attention by up to "
                f"{(got - expected).abs().max():.3g}")
