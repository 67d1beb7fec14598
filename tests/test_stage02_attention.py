"""Stage 02: shape checker, hand-written attention vs SDPA and transformers, its checks."""

from __future__ import annotations

import inspect
import textwrap

import pytest
import torch

import aie_lessons.attention as attention
from aie_lessons.checks import stage02 as checks
from aie_lessons.model import LlamaModel, apply_rope, sdpa_attention
from aie_lessons.shapes import Dims, ShapeError

from check_expect import mutants, names_the_mistake


def test_shape_error_names_tensor_symbols_and_values():
    dims = Dims(H=9, D=64)
    dims.check("q", torch.zeros(2, 9, 7, 64), "B H S D")
    with pytest.raises(ShapeError, match=r"^q: expected \(B, H, S, D\) = \(2, 9, 7, 64\), got \(2, 7, 9, 64\)$"):
        dims.check("q", torch.zeros(2, 7, 9, 64), "B H S D")
    with pytest.raises(ShapeError, match=r"x: expected \(B, S, H\*D\) = \(\?, \?, 576\)"):
        Dims(H=9, D=64).check("x", torch.zeros(2, 3, 575), "B S H*D")


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2), (torch.float16, 3e-3)])
@pytest.mark.parametrize("seq, kv_len", [(5, 5), (1, 9), (3, 8)])
def test_manual_attention_matches_sdpa_with_gqa_and_offsets(seq, kv_len, dtype, atol):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, seq, 16, generator=g).to(dtype)
    k, v = (torch.randn(2, 2, kv_len, 16, generator=g).to(dtype) for _ in "kv")
    mask = torch.ones(seq, kv_len, dtype=torch.bool).tril(kv_len - seq)[None, None]
    expected = sdpa_attention(q.float(), k.float(), v.float(), mask=mask)
    for got in (attention.manual_attention(q, k, v), attention.manual_attention(q, k, v, mask)):
        assert got.dtype == dtype
        assert torch.allclose(got.float(), expected, atol=atol)


def test_manual_attention_runs_inside_the_model_in_half_precision(tiny_dir):
    """The manual kernel once raised in bf16/fp16 (masked_fill of float32's minimum)."""
    model = LlamaModel.from_pretrained(tiny_dir, attention=attention.manual_attention)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.inference_mode():
        reference = model(ids)
        for dtype in (torch.bfloat16, torch.float16):
            model.activations = dtype
            assert (model(ids) - reference).abs().max().item() < 0.1


def test_manual_attention_refuses_mismatched_kv_shapes():
    q, k = torch.zeros(1, 6, 4, 16), torch.zeros(1, 2, 4, 16)
    with pytest.raises(ShapeError, match=r"v: expected \(B, Hkv, T, D\) = \(1, 2, 4, 16\)"):
        attention.manual_attention(q, k, torch.zeros(1, 2, 4, 8))


@pytest.mark.oracle
def test_manual_kernel_logits_match_transformers(real_model_dir, gguf_reference):
    """Against transformers reading the GGUF. The bound is fp32 rounding grown over 30 layers,
    relative to the logits' size: 2e-5 × max |logit| (about 5e-4 here; measured 7e-5). A wrong
    attention is off by whole units."""
    from aie_lessons.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(real_model_dir)
    ours = LlamaModel.from_pretrained(real_model_dir, attention=attention.manual_attention)
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


def split_without_transpose(x, heads):
    return x.view(x.shape[0], x.shape[1], heads, -1)


def split_then_contiguous(x, heads):
    """Right values, but a copy: the task asks for a view."""
    return attention.split_heads(x, heads).contiguous()


@mutants("2.1", [
    (view_without_transpose, "viewed \\(B, S, H·D\\) as \\(B, H, S, D\\) directly"),
    (split_d_major, "\\(D, H\\)"),
    (split_without_transpose, "expected split_heads\\(x\\) of shape \\(2, 3, 5, 4\\), got \\(2, 5, 3, 4\\)"),
    (split_then_contiguous, "split_heads copied x.*return a view"),
])
def test_split_heads_check_names_the_mistake(wrong, message):
    with names_the_mistake("2.1", message):
        checks.check_split_heads(wrong, attention.merge_heads)


def _scores(q, k, scale):
    return (q @ k.transpose(-1, -2)).float() * scale


def _masked(scores, mask, fill=attention.MASKED):
    return scores if mask is None else scores.masked_fill(~mask, fill)


def weights_scaled_after(q, k, mask):
    scores = _masked(_scores(q, k, 1.0), mask)
    return (torch.softmax(scores, -1) * q.shape[-1] ** -0.5).to(q.dtype)


def weights_minus_inf(q, k, mask):
    scores = _masked(_scores(q, k, q.shape[-1] ** -0.5), mask, float("-inf"))
    return torch.softmax(scores, -1).to(q.dtype)


def weights_unmasked(q, k, mask):
    return torch.softmax(_scores(q, k, q.shape[-1] ** -0.5), -1).to(q.dtype)


def weights_over_d(q, k, mask):
    scores = _masked(_scores(q, k, 1 / q.shape[-1]), mask)
    return torch.softmax(scores, -1).to(q.dtype)


def weights_over_queries(q, k, mask):
    scores = _masked(_scores(q, k, q.shape[-1] ** -0.5), mask)
    return torch.softmax(scores, -2).to(q.dtype)


def weights_masked_in_half(q, k, mask):
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    return torch.softmax(_masked(scores, mask).float(), -1).to(q.dtype)


def weights_in_float32(q, k, mask):
    scores = _masked(_scores(q, k, q.shape[-1] ** -0.5), mask)
    return torch.softmax(scores, -1)


def weights_mask_required(q, k, mask):
    """Masks unconditionally: ``~None`` raises when no mask is given."""
    scores = _scores(q, k, q.shape[-1] ** -0.5).masked_fill(~mask, attention.MASKED)
    return torch.softmax(scores, -1).to(q.dtype)


def weights_softmax_in_half(q, k, mask):
    """Masks in float32 but softmaxes in q's dtype: within half tolerances, wrong per the task."""
    scores = _masked(_scores(q, k, q.shape[-1] ** -0.5), mask)
    return torch.softmax(scores.to(q.dtype), -1)


@mutants("2.2", [
    (weights_scaled_after, "scaled after softmax"),
    (weights_minus_inf, "NaN"),
    (weights_unmasked, "masked keys got weight"),
    (weights_over_d, "scaled by 1/D; the scale is 1/√D"),
    (weights_over_queries, "softmax over the wrong axis"),
    (weights_masked_in_half, "raised RuntimeError.*cannot hold MASKED"),
    (weights_in_float32, "came back as torch.float32"),
    (weights_mask_required, "raised TypeError.*mask=None means that no key is forbidden"),
    (weights_softmax_in_half, "the softmax ran in bfloat16"),
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


def group_axes_swapped(q, kv_heads):
    b, h, s, d = q.shape
    return q.view(b, h // kv_heads, kv_heads, s, d)


def group_contiguous_first(q, kv_heads):
    """Copies q only when it is not contiguous: the model's q, and stage 05's output buffer."""
    b, h, s, d = q.shape
    return q.contiguous().view(b, kv_heads, h // kv_heads, s, d)


@mutants("2.3", [
    (group_strided, "h % Hkv"),
    (group_copy, "copied q"),
    (group_contiguous_first, "copied q.*do not make it contiguous first"),
    (group_axes_swapped, "expected grouped q of shape \\(1, 2, 3, 2, 4\\), got \\(1, 3, 2, 2, 4\\)"),
])
def test_group_queries_check_names_the_mistake(wrong, message):
    with names_the_mistake("2.3", message):
        checks.check_group_queries(wrong)


def _layer(rotate=("q", "k"), out_proj=True, pass_mask=True, check=True):
    def layer(attn, x, cos, sin, mask=None):
        cfg = attn.config
        dims = Dims(Hq=cfg.num_heads, Hkv=cfg.num_kv_heads, D=cfg.head_dim) if check else None
        tensors = {
            "q": attention.split_heads(attn.q_proj(x), cfg.num_heads),
            "k": attention.split_heads(attn.k_proj(x), cfg.num_kv_heads),
            "v": attention.split_heads(attn.v_proj(x), cfg.num_kv_heads),
        }
        if check:
            for name, spec in (("q", "B Hq S D"), ("k", "B Hkv S D"), ("v", "B Hkv S D")):
                dims.check(name, tensors[name], spec)
        q, k, v = (apply_rope(t, cos, sin) if name in rotate else t for name, t in tensors.items())
        out = attention.merge_heads(attention.manual_attention(q, k, v, mask if pass_mask else None))
        return attn.o_proj(out) if out_proj else out
    return layer


def layer_rotating_v(attn, x, cos, sin, mask=None):
    return _layer(rotate=("q", "k", "v"))(attn, x, cos, sin, mask)


def layer_without_rope(attn, x, cos, sin, mask=None):
    return _layer(rotate=())(attn, x, cos, sin, mask)


def layer_rotating_q_only(attn, x, cos, sin, mask=None):
    return _layer(rotate=("q",))(attn, x, cos, sin, mask)


def layer_without_o_proj(attn, x, cos, sin, mask=None):
    return _layer(out_proj=False)(attn, x, cos, sin, mask)


def layer_dropping_the_mask(attn, x, cos, sin, mask=None):
    return _layer(pass_mask=False)(attn, x, cos, sin, mask)


def layer_without_shape_checks(attn, x, cos, sin, mask=None):
    return _layer(check=False)(attn, x, cos, sin, mask)


@mutants("2.4", [
    (layer_rotating_v, "you rotated v too"),
    (layer_without_rope, "q and k are not rotated"),
    (layer_rotating_q_only, "only q is rotated"),
    (layer_without_o_proj, "o_proj is missing"),
    (layer_dropping_the_mask, "pass the mask on"),
    (layer_without_shape_checks, "did not check q, k and v with dims"),
])
def test_attention_layer_check_names_the_mistake(tiny_dir, wrong, message):
    model = LlamaModel.from_pretrained(tiny_dir)
    with names_the_mistake("2.4", message):
        checks.check_attention_layer(wrong, model)


def test_attention_layer_check_lends_manual_attention_before_it_is_written(tiny_dir):
    """In the notebook, exercise 2.4 comes before manual_attention (2.5) is defined."""
    namespace = {"Dims": Dims, "split_heads": attention.split_heads, "merge_heads": attention.merge_heads,
                 "apply_rope": apply_rope}
    source = inspect.getsource(attention.attention_layer).replace("attn: Attention", "attn")
    exec(textwrap.dedent(source), namespace)
    checks.check_attention_layer(namespace["attention_layer"], LlamaModel.from_pretrained(tiny_dir))
    assert "manual_attention" not in namespace


def _attention(
    interleaved=False, scale=None, softmax_dim=-1, use_mask=True, top_left=False, copy="",
    mask_in_half=False, softmax_in_half=False, check_shapes=True, fill=attention.MASKED,
    view=False, group_axis=True,
):
    """manual_attention with one mistake switched on."""
    def fn(q, k, v, mask=None):
        if check_shapes:
            dims = Dims()
            dims.check("q", q, "B Hq S D")
            dims.check("k", k, "B Hkv T D")
            dims.check("v", v, "B Hkv T D")
        batch, heads, seq, head_dim = q.shape
        kv_heads, kv_len = k.shape[1], k.shape[2]
        groups = heads // kv_heads
        if mask is None:
            mask = torch.ones(seq, kv_len, dtype=torch.bool).tril(0 if top_left else kv_len - seq)
        elif mask.dim() == 4 and group_axis:
            mask = mask.unsqueeze(2)
        if not use_mask:
            mask = torch.ones_like(mask)
        factor = head_dim ** -0.5 if scale is None else scale
        if interleaved:  # head h -> kv head h % Hkv: groups are strided, not consecutive
            q = q.view(batch, groups, kv_heads, seq, head_dim).transpose(1, 2)
        if copy == "repeat":
            k5 = k.repeat_interleave(groups, dim=1).view(batch, kv_heads, groups, kv_len, head_dim)
            v5 = v.repeat_interleave(groups, dim=1).view(batch, kv_heads, groups, kv_len, head_dim)
        else:
            k5, v5 = k.unsqueeze(2), v.unsqueeze(2)
        if copy:
            scores = q.reshape(batch, kv_heads, groups, seq, head_dim) @ k5.transpose(-1, -2)
        else:
            rows = (q.view if view else q.reshape)(batch, kv_heads, groups * seq, head_dim)
            scores = (rows @ k.transpose(-1, -2)).view(batch, kv_heads, groups, seq, kv_len)
        scores = scores if mask_in_half else scores.float()
        scores = (scores * factor).masked_fill(~mask, fill)
        if softmax_in_half:
            scores = scores.to(q.dtype)
        if softmax_dim == -1:
            weights = torch.softmax(scores, dim=-1).to(v.dtype)
        else:  # over the folded rows: every query of a group normalised together
            weights = torch.softmax(scores.flatten(2, 3), dim=-2).view_as(scores).to(v.dtype)
        if copy:
            out = weights @ v5
        else:
            out = (weights.view(batch, kv_heads, groups * seq, kv_len) @ v).view(batch, kv_heads, groups, seq, head_dim)
        if interleaved:
            return out.transpose(1, 2).reshape(batch, heads, seq, head_dim)
        return out.reshape(batch, heads, seq, head_dim)
    return fn


def attention_interleaved(q, k, v, mask=None):
    return _attention(interleaved=True)(q, k, v, mask)


def attention_over_d(q, k, v, mask=None):
    return _attention(scale=1 / q.shape[-1])(q, k, v, mask)


def attention_unscaled(q, k, v, mask=None):
    return _attention(scale=1.0)(q, k, v, mask)


def attention_softmax_over_rows(q, k, v, mask=None):
    return _attention(softmax_dim=-2)(q, k, v, mask)


def attention_ignoring_the_mask(q, k, v, mask=None):
    return _attention(use_mask=mask is None)(q, k, v, mask)


def attention_seeing_the_future(q, k, v, mask=None):
    return _attention(use_mask=mask is not None)(q, k, v, mask)


def attention_causal_top_left(q, k, v, mask=None):
    return _attention(top_left=True)(q, k, v, mask)


def attention_repeating_kv(q, k, v, mask=None):
    return _attention(copy="repeat")(q, k, v, mask)


def attention_broadcasting_kv(q, k, v, mask=None):
    return _attention(copy="broadcast")(q, k, v, mask)


def attention_masking_half_scores(q, k, v, mask=None):
    return _attention(mask_in_half=True)(q, k, v, mask)


def attention_softmax_in_half(q, k, v, mask=None):
    return _attention(softmax_in_half=True)(q, k, v, mask)


def attention_without_shape_checks(q, k, v, mask=None):
    return _attention(check_shapes=False)(q, k, v, mask)


def attention_viewing_q(q, k, v, mask=None):
    """Folds the groups with .view: fine on a contiguous q, a crash on the model's."""
    return _attention(view=True)(q, k, v, mask)


def attention_minus_inf(q, k, v, mask=None):
    return _attention(fill=float("-inf"))(q, k, v, mask)


def attention_mask_without_group_axis(q, k, v, mask=None):
    """Silently wrong when B == Hkv: row b's mask lands on kv head b."""
    return _attention(group_axis=False)(q, k, v, mask)


@mutants("2.5", [
    (attention_interleaved, "h % Hkv \\(interleaved groups\\)"),
    (attention_over_d, "scaled the scores by 1/D"),
    (attention_unscaled, "the scores are not scaled"),
    (attention_softmax_over_rows, "weights must sum to 1 over the keys"),
    (attention_ignoring_the_mask, "the mask was ignored"),
    (attention_seeing_the_future, "your queries saw future keys"),
    (attention_causal_top_left, "starts at the top-left corner"),
    (attention_repeating_kv, "copied K or V 3 times.*repeat_interleave, expand"),
    (attention_broadcasting_kv, "copied K or V 3 times \\(clone"),
    (attention_masking_half_scores, "raised RuntimeError.*cannot hold MASKED"),
    (attention_softmax_in_half, "the softmax ran in bfloat16"),
    (attention_without_shape_checks, "raised RuntimeError.*Check the shapes of q, k and v with Dims"),
    (attention_viewing_q, "view size is not compatible.*\\.view cannot merge.*Use \\.reshape"),
    (attention_minus_inf, "every key is masked gave NaN.*not -inf"),
    (attention_mask_without_group_axis, "row b's mask was applied to kv head b.*needs a group axis"),
])
def test_manual_attention_check_names_the_mistake(wrong, message):
    with names_the_mistake("2.5", message):
        checks.check_manual_attention(wrong)


def test_manual_attention_stub_is_reported_as_a_stub():
    """The shape probe catches the learner's exceptions; the stub's must still say "stub"."""
    def stub(q, k, v, mask=None):
        raise NotImplementedError("Exercise 2.5 is not implemented yet")

    with pytest.raises(NotImplementedError, match="Exercise 2.5 is not implemented yet"):
        checks.check_manual_attention(stub)


def test_a_broadcast_error_of_a_mask_without_group_axis_is_named():
    """When B != Hkv the missing group axis crashes instead of being silently wrong."""
    q = torch.randn(2, 5, 9, 16).transpose(1, 2)
    k, v = torch.randn(2, 3, 5, 16), torch.randn(2, 3, 5, 16)
    mask = torch.ones(2, 1, 5, 5, dtype=torch.bool)
    with names_the_mistake("2.5", "must match the size.*needs a group axis"):
        checks._call_attention(attention_mask_without_group_axis, q, k, v, mask, "B=2, Hkv=3")


def test_reference_implementations_pass(tiny_dir):
    checks.check_split_heads(attention.split_heads, attention.merge_heads)
    checks.check_attention_weights(attention.attention_weights)
    checks.check_group_queries(attention.group_queries)
    checks.check_attention_layer(attention.attention_layer, LlamaModel.from_pretrained(tiny_dir))
    checks.check_manual_attention(attention.manual_attention)
