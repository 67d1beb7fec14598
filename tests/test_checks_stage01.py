"""Each stage-01 check, fed one typical wrong implementation, names that mistake."""

from __future__ import annotations


import codecs

import pytest
import torch
import torch.nn.functional as F

from aie_lessons.checks import stage01 as checks
from aie_lessons.generate import skeleton_steps
from aie_lessons.model import (MLP, AttentionMetadata, DecoderLayer, LlamaModel, apply_rope, rms_norm, rope_cos_sin,
                               rotate_half)
from aie_lessons.output import OutputStream
from aie_lessons.sampling import (apply_repetition_penalty, filter_top_k_top_p, greedy_step, make_generator,
                                  sample_next)
from aie_lessons.tokenizer import StreamingDetokenizer, Tokenizer

from check_expect import mutants, names_the_mistake


def rms_layernorm(x, w, eps):
    x = x - x.mean(-1, keepdim=True)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rms_no_sqrt(x, w, eps):
    return x / (x.pow(2).mean(-1, keepdim=True) + eps) * w


def rms_no_weight(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rms_wrong_dim(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + eps) * w


def rms_no_eps(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)) * w


def rms_float_output(x, w, eps):
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.float()


def rms_eps_outside_the_root(x, w, eps):
    x32 = x.float()
    return (x32 / (x32.pow(2).mean(-1, keepdim=True).sqrt() + eps) * w.float()).to(x.dtype)


def rms_in_the_input_dtype(x, w, eps):
    """No fp32 upcast: in bf16 torch's mean still accumulates in fp32, but fp16 squares overflow."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@mutants("1.1", [
    (rms_layernorm, "subtracted the mean: that is LayerNorm"),
    (rms_no_sqrt, "without the square root"),
    (rms_no_weight, "not multiplied by `weight`"),
    (rms_wrong_dim, "wrong dimension"),
    (rms_no_eps, "add eps"),
    (rms_float_output, "cast the result back"),
    (rms_eps_outside_the_root, "small x, mean\\(x²\\) near eps.*eps was added outside the square root"),
    (rms_in_the_input_dtype, "float16 input with values near 300 gave zeros.*overflow float16.*Compute in float32"),
])
def test_rms_norm_check_names_the_mistake(wrong, message):
    with names_the_mistake("1.1", message):
        checks.check_rms_norm(wrong)


def rope_interleaved(x, cos, sin):
    return checks._rotate_interleaved(x, cos.unsqueeze(1), sin.unsqueeze(1))


def rope_minus(x, cos, sin):
    return x * cos.unsqueeze(1) - rotate_half(x) * sin.unsqueeze(1)


def rope_no_head_axis(x, cos, sin):
    return x * cos + rotate_half(x) * sin


def rope_swapped(x, cos, sin):
    return x * sin.unsqueeze(1) + rotate_half(x) * cos.unsqueeze(1)


def rope_no_cast_back(x, cos, sin):
    """Right in fp32; a bf16 x times fp32 tables is promoted to fp32 and returned so."""
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


@mutants("1.2", [
    (rope_interleaved, "interleaved convention"),
    (rope_minus, "rotated the wrong way"),
    (rope_no_head_axis, "raised RuntimeError.*cos.unsqueeze\\(1\\)"),
    (rope_swapped, "cos and sin are swapped"),
    (rope_no_cast_back, "bfloat16 x with float32 cos/sin came back as torch.float32"),
    (lambda x, cos, sin: x, "unchanged"),
])
def test_apply_rope_check_names_the_mistake(wrong, message):
    with names_the_mistake("1.2", message):
        checks.check_apply_rope(wrong)


# --- 1.3 the rotation angles: wrong implementations --------------------------------------------


def rope_tables(positions, head_dim, theta, *, exponents=None, duplicate="cat", sign=-1.0):
    """rope_cos_sin with switches for the usual mistakes."""
    if exponents is None:
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
    angles = positions.float()[..., None] * theta ** (sign * exponents)
    if duplicate == "cat":
        angles = torch.cat([angles, angles], dim=-1)
    elif duplicate == "interleave":
        angles = angles.repeat_interleave(2, dim=-1)
    return angles.cos(), angles.sin()


def rope_interleaved_angles(positions, head_dim, theta):
    return rope_tables(positions, head_dim, theta, duplicate="interleave")


def rope_exponent_i_over_d(positions, head_dim, theta):
    return rope_tables(positions, head_dim, theta, exponents=torch.arange(head_dim // 2) / head_dim)


def rope_growing_frequencies(positions, head_dim, theta):
    return rope_tables(positions, head_dim, theta, sign=1.0)


def rope_no_duplicate(positions, head_dim, theta):
    return rope_tables(positions, head_dim, theta, duplicate="none")


def rope_one_frequency_per_coordinate(positions, head_dim, theta):
    return rope_tables(positions, head_dim, theta, exponents=torch.arange(head_dim) / head_dim, duplicate="none")


def rope_positions_ignored(positions, head_dim, theta):
    return rope_cos_sin(torch.arange(positions.shape[1]).expand_as(positions), head_dim, theta)


def rope_tables_swapped(positions, head_dim, theta):
    cos, sin = rope_cos_sin(positions, head_dim, theta)
    return sin, cos


def rope_float64(positions, head_dim, theta):
    return tuple(t.double() for t in rope_cos_sin(positions, head_dim, theta))


@mutants("1.3", [
    (rope_interleaved_angles, "each angle appears twice in a row \\(interleaved\\)"),
    (rope_exponent_i_over_d, "the frequencies are theta\\^\\(-i/D\\)"),
    (rope_growing_frequencies, "the frequencies grow with i"),
    (rope_no_duplicate, "the tables have D/2 = 4 columns"),
    (rope_one_frequency_per_coordinate, "every coordinate got its own frequency"),
    (rope_positions_ignored, "angles are those of positions 0 … S−1"),
    (rope_tables_swapped, "cos and sin are swapped: return \\(cos, sin\\)"),
    (rope_float64, "return float32"),
])
def test_rope_cos_sin_check_names_the_mistake(wrong, message):
    with names_the_mistake("1.3", message):
        checks.check_rope_cos_sin(wrong)


# --- 1.4 the SwiGLU MLP: wrong implementations -------------------------------------------------


def swiglu(mlp, x, activation=F.silu, combine=torch.mul, on_up=False, after=False):
    gate, up = mlp.gate_proj(x), mlp.up_proj(x)
    if after:
        return mlp.down_proj(activation(combine(gate, up)))
    return mlp.down_proj(combine(gate, activation(up)) if on_up else combine(activation(gate), up))


class MLPSiluOnUp(MLP):
    def forward(self, x):
        return swiglu(self, x, on_up=True)


class MLPNoActivation(MLP):
    def forward(self, x):
        return swiglu(self, x, activation=lambda t: t)


class MLPSigmoid(MLP):
    def forward(self, x):
        return swiglu(self, x, activation=torch.sigmoid)


class MLPGelu(MLP):
    def forward(self, x):
        return swiglu(self, x, activation=F.gelu)


class MLPSiluAfterProduct(MLP):
    def forward(self, x):
        return swiglu(self, x, after=True)


class MLPAdded(MLP):
    def forward(self, x):
        return swiglu(self, x, combine=torch.add)


class MLPNoDown(MLP):
    def forward(self, x):
        return F.silu(self.gate_proj(x)) * self.up_proj(x)


class MLPFloatOutput(MLP):
    def forward(self, x):
        return swiglu(self, x.float())


class MLPRawWeights(MLP):
    """Right while weights and x share a dtype; bypasses the Linear layers' dtype handling."""

    def forward(self, x):
        gate, up = F.linear(x, self.gate_proj.weight), F.linear(x, self.up_proj.weight)
        return F.linear(F.silu(gate) * up, self.down_proj.weight)


@mutants("1.4", [
    (MLPSiluOnUp, "SiLU went on the up projection"),
    (MLPNoActivation, "no activation"),
    (MLPSigmoid, "you used sigmoid"),
    (MLPGelu, "you used GELU"),
    (MLPSiluAfterProduct, "SiLU was applied to the product"),
    (MLPAdded, "were added"),
    (MLPNoDown, "project the gated product back to hidden_size with down_proj"),
    (MLPFloatOutput, "bfloat16 input gave a torch.float32 output"),
    (MLPRawWeights, "raised RuntimeError.*weights are stored in torch.bfloat16.*call the projection layers"),
])
def test_mlp_check_names_the_mistake(wrong, message):
    with names_the_mistake("1.4", message):
        checks.check_mlp(wrong)


# --- 1.5 the pre-norm residual block: wrong implementations ------------------------------------


class BlockNoAttentionResidual(DecoderLayer):
    def forward(self, x, cos, sin, attn):
        x = self.self_attn(self.input_layernorm(x), cos, sin, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class BlockNoMLPResidual(DecoderLayer):
    def forward(self, x, cos, sin, attn):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn)
        return self.mlp(self.post_attention_layernorm(x))


class BlockPostNorm(DecoderLayer):
    def forward(self, x, cos, sin, attn):
        x = self.input_layernorm(x + self.self_attn(x, cos, sin, attn))
        return self.post_attention_layernorm(x + self.mlp(x))


class BlockResidualFromNorm(DecoderLayer):
    def forward(self, x, cos, sin, attn):
        x = self.input_layernorm(x)
        x = x + self.self_attn(x, cos, sin, attn)
        h = self.post_attention_layernorm(x)
        return h + self.mlp(h)


class BlockParallel(DecoderLayer):
    def forward(self, x, cos, sin, attn):
        attn = self.self_attn(self.input_layernorm(x), cos, sin, attn)
        return x + attn + self.mlp(self.post_attention_layernorm(x))


class BlockSwappedNorms(DecoderLayer):
    def forward(self, x, cos, sin, attn):
        x = x + self.self_attn(self.post_attention_layernorm(x), cos, sin, attn)
        return x + self.mlp(self.input_layernorm(x))


class BlockOneNormTwice(DecoderLayer):
    def forward(self, x, cos, sin, attn):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn)
        return x + self.mlp(self.input_layernorm(x))


class BlockMLPFirst(DecoderLayer):
    def forward(self, x, cos, sin, attn):
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x + self.self_attn(self.input_layernorm(x), cos, sin, attn)


class BlockDropsMetadata(DecoderLayer):
    def forward(self, x, cos, sin, attn):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, AttentionMetadata())
        return x + self.mlp(self.post_attention_layernorm(x))


class BlockFreshMetadata(DecoderLayer):
    """Rebuilds the metadata from what the lessons' first stages put in it: a batch's slots are lost."""

    def forward(self, x, cos, sin, attn):
        rebuilt = AttentionMetadata(attn.mask, attn.cache, attn.cache_start)
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, rebuilt)
        return x + self.mlp(self.post_attention_layernorm(x))


class BlockFreshWithoutMask(DecoderLayer):
    """Hands on the metadata only when it has a mask: a decode step's cache is lost."""

    def forward(self, x, cos, sin, attn):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn if attn.mask is not None else AttentionMetadata())
        return x + self.mlp(self.post_attention_layernorm(x))


class BlockClearsTheMask(DecoderLayer):
    def forward(self, x, cos, sin, attn):
        attn.mask = None
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class BlockAttentionTwice(DecoderLayer):
    def forward(self, x, cos, sin, attn):
        normed = self.input_layernorm(x)
        self.self_attn(normed, cos, sin, attn)
        x = x + self.self_attn(normed, cos, sin, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


@mutants("1.5", [
    (BlockNoAttentionResidual, "attention half replaced the stream"),
    (BlockNoMLPResidual, "MLP half replaced the stream"),
    (BlockPostNorm, "normalized after adding \\(post-norm\\)"),
    (BlockResidualFromNorm, "residual carried the normalized copy"),
    (BlockParallel, "the MLP read the block's input"),
    (BlockSwappedNorms, "the norms are swapped"),
    (BlockOneNormTwice, "both halves used input_layernorm"),
    (BlockMLPFirst, "the MLP ran before attention"),
    (BlockDropsMetadata, "did not receive the metadata"),
    (BlockFreshMetadata, "did not receive the metadata"),
    (BlockFreshWithoutMask, "did not receive the metadata"),
    (BlockClearsTheMask, "changed the metadata it was given"),
    (BlockAttentionTwice, "self_attn ran 2 times"),
])
def test_decoder_layer_check_names_the_mistake(wrong, message):
    with names_the_mistake("1.5", message):
        checks.check_decoder_layer(wrong)


# --- 1.6 the forward pass: wrong implementations -----------------------------------------------


class ModelSketch(LlamaModel):
    """The forward pass with switches for the usual mistakes."""

    mistake = ""

    def forward(self, input_ids, positions=None, attn=None):
        wrong = self.mistake
        attn = AttentionMetadata() if attn is None else attn
        at = attn.logits_at if attn is not None else None
        if positions is None and wrong == "positions not expanded":
            positions = torch.arange(input_ids.shape[1])[None]
        if positions is None or wrong == "ignores positions":
            positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
        x = self.embed_tokens(input_ids)
        if wrong != "no cast":
            x = x.to(self.activations)
        theta = 10000.0 if wrong == "theta hard-coded" else self.config.rope_theta
        cos, sin = rope_cos_sin(positions, self.config.head_dim, theta)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        layers = self.layers[:1] if wrong == "one layer" else self.layers
        layers = reversed(layers) if wrong == "reversed" else layers
        for layer in layers:
            handed = {"drops metadata": AttentionMetadata(), "mask only": attn.mask}.get(wrong, attn)
            x = layer(x, cos, sin, handed)
        if wrong == "truth value" and attn.logits_at:
            x = x[:, attn.logits_at]
        elif wrong == "batch axis" and at is not None:
            x = x[at]
        elif at is not None and wrong not in ("ignores logits_at", "slices after the head", "norm before indexing"):
            x = {"first position": x[:, :1], "always the last": x[:, -1:]}.get(wrong, x[:, at])
        x = x if wrong == "no final norm" else self.norm(x)
        if wrong == "norm before indexing" and at is not None:
            x = x[:, at]
        if wrong == "head in the stream's dtype":
            return self.lm_head(x).float()
        logits = self.lm_head(x if wrong == "bf16 logits" else x.float())
        return logits[:, at] if at is not None and wrong == "slices after the head" else logits


def model_with(mistake: str) -> type:
    return type(f"Model_{mistake.replace(' ', '_')}", (ModelSketch,), {"mistake": mistake})


@mutants("1.6", [
    (model_with("no final norm"), "final norm is missing"),
    (model_with("bf16 logits"), "logits are torch.bfloat16: they must leave the model in fp32"),
    (model_with("ignores positions"), "positions 0 … S−1, not of the positions given"),
    (model_with("no cast"), "received a torch.float32 stream, but the model's activations are torch.bfloat16"),
    (model_with("ignores logits_at"), "logits_at was ignored"),
    (model_with("first position"), "the first position was kept"),
    (model_with("always the last"), "kept the last position whatever logits_at said"),
    (model_with("truth value"), "test `attn.logits_at is not None`"),
    (model_with("batch axis"), "indexed the batch axis"),
    (model_with("norm before indexing"), "the final norm ran over all 6 positions"),
    (model_with("mask only"), "received attn.mask instead of the metadata"),
    (model_with("one layer"), "the layers ran in the order \\[0\\]"),
    (model_with("reversed"), "ran in the order \\[2, 1, 0\\]"),
    (model_with("drops metadata"), "did not receive the metadata"),
    (model_with("theta hard-coded"), "use the base 10000, but this model's config.rope_theta is 500"),
    (model_with("head in the stream's dtype"), "output head computed in torch.bfloat16 and the logits "
                                               "were converted to fp32 afterwards"),
    (model_with("slices after the head"), "output head still ran over all 6 positions"),
    (model_with("positions not expanded"), "with no positions.*the default positions must be \\(B, S\\)"),
])
def test_llama_forward_check_names_the_mistake(wrong, message):
    with names_the_mistake("1.6", message):
        checks.check_llama_forward(wrong)


def test_model_sketch_without_mistakes_passes(capsys):
    checks.check_llama_forward(ModelSketch)
    assert "passed" in capsys.readouterr().out


class DecoratedModel(ModelSketch):
    """A forward wrapped by a decorator from another module: the check must still reach the
    forward's own module to give it the reference rope_cos_sin."""

    forward = torch.no_grad()(ModelSketch.forward)


def test_a_decorated_forward_still_gets_the_reference_rope_tables(monkeypatch, capsys):
    def broken_rope_cos_sin(positions, head_dim, theta):  # a wrong exercise 1.3 must not fail 1.6
        cos, sin = rope_cos_sin(positions, head_dim, theta)
        return sin, cos

    monkeypatch.setitem(ModelSketch.forward.__globals__, "rope_cos_sin", broken_rope_cos_sin)
    checks.check_llama_forward(DecoratedModel)
    assert "passed" in capsys.readouterr().out


# --- 1.7 the greedy step: wrong implementations ----------------------------------------------


@mutants("1.7", [
    (lambda logits: logits[:, 0].argmax(-1), "first position's logits"),
    (lambda logits: logits.argmax(1), "sequence axis"),
    (lambda logits: logits[:, -1].max(-1).values, "scores \\(floats\\), not token ids"),
    (lambda logits: logits[:, -1].argmin(-1), "argmin"),
])
def test_greedy_step_check_names_the_mistake(wrong, message):
    with names_the_mistake("1.7", message):
        checks.check_greedy_step(wrong)


# --- 1.8 the streaming detokenizer: wrong implementations ---------------------------------------


class TokenByTokenDetokenizer(StreamingDetokenizer):
    def push(self, token_id):
        return self.tokenizer.decode([token_id])


class RepeatingDetokenizer(StreamingDetokenizer):
    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.ids = []

    def push(self, token_id):
        self.ids.append(token_id)
        return self.tokenizer.decode(self.ids)


class BytesDetokenizer(StreamingDetokenizer):
    def push(self, token_id):
        return self.tokenizer.token_bytes(token_id)


class FreshDecoderDetokenizer(StreamingDetokenizer):
    """A new UTF-8 decoder for every token: the bytes an unfinished character left are lost."""

    def push(self, token_id):
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        return self._utf8.decode(self.tokenizer.token_bytes(token_id))


class AllOrNothingDetokenizer(StreamingDetokenizer):
    """Buffers bytes until they all decode: right for valid text, stalls forever on a bad byte."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.buffer = b""

    def push(self, token_id):
        self.buffer += self.tokenizer.token_bytes(token_id)
        try:
            text = self.buffer.decode("utf-8")
        except UnicodeDecodeError:
            return ""
        self.buffer = b""
        return text


class DropsTheUnfinishedEnd(StreamingDetokenizer):
    def flush(self):
        self._utf8.reset()
        return ""


@mutants("1.8", [
    (AllOrNothingDetokenizer, "lone byte 0xF0.*expected '\ufffd Hello, world'.*must keep coming"),
    (DropsTheUnfinishedEnd, "first 2 of the 3 bytes.*flush\\(\\) must return an unfinished character as U\\+FFFD"),
    (TokenByTokenDetokenizer, "U\\+FFFD"),
    (RepeatingDetokenizer, "repeats text"),
    (BytesDetokenizer, "returned bytes, expected str"),
    (FreshDecoderDetokenizer, "U\\+FFFD.*Keep incomplete bytes"),
])
def test_streaming_detokenizer_check_names_the_mistake(tiny_dir, wrong, message):
    tokenizer = Tokenizer.from_pretrained(tiny_dir)
    with names_the_mistake("1.8", message):
        checks.check_streaming_detokenizer(wrong, tokenizer)


# --- 1.9 repetition penalty: wrong implementations -------------------------------------------


def penalty_rule(seen, penalty):
    return torch.where(seen > 0, seen / penalty, seen * penalty)


def rp_once_per_occurrence(logits, history, penalty):
    out = logits.clone()
    for token in history.tolist():
        out[token] = penalty_rule(out[token], penalty)
    return out


def rp_changes_added_up(logits, history, penalty):
    seen = logits[history]
    return logits.index_put((history,), penalty_rule(seen, penalty) - seen, accumulate=True)


def rp_divide_all(logits, history, penalty):
    out = logits.clone()
    out[history] = logits[history] / penalty
    return out


def rp_multiply_all(logits, history, penalty):
    out = logits.clone()
    out[history] = logits[history] * penalty
    return out


def rp_backwards(logits, history, penalty):
    seen = logits[history]
    out = logits.clone()
    out[history] = torch.where(seen > 0, seen * penalty, seen / penalty)
    return out


def rp_in_place(logits, history, penalty):
    logits[history] = penalty_rule(logits[history], penalty)
    return logits


def rp_scatter_in_place(logits, history, penalty):
    return logits.scatter_(-1, history, penalty_rule(logits.gather(-1, history), penalty))


def rp_everything(logits, history, penalty):
    return penalty_rule(logits, penalty)


def rp_float64(logits, history, penalty):
    out = logits.double()
    for token in set(history.tolist()):
        out[token] = out[token] / penalty if out[token] > 0 else out[token] * penalty
    return out


def rp_subtract(logits, history, penalty):
    out = logits.clone()
    out[history] = logits[history] - penalty
    return out


@mutants("1.9", [
    (rp_once_per_occurrence, "penalized several times"),
    (rp_changes_added_up, "penalized several times"),
    (rp_divide_all, "negative logits were divided"),
    (rp_multiply_all, "positive logits were multiplied"),
    (rp_backwards, "the rule is backwards"),
    (rp_in_place, "changed the caller's logits in place"),
    (rp_scatter_in_place, "in place: return a new tensor"),
    (rp_everything, "every token was penalized"),
    (rp_subtract, "subtracted the penalty"),
    (rp_float64, "float32 logits came back as torch.float64"),
    (lambda logits, history, penalty: logits.clone(), "no logit changed"),
    (lambda logits, history, penalty: logits[None], "shape \\(30,\\)"),
])
def test_repetition_penalty_check_names_the_mistake(wrong, message):
    with names_the_mistake("1.9", message):
        checks.check_repetition_penalty(wrong)


# --- 1.10 top-k and top-p: wrong implementations ----------------------------------------------

NEG_INF = float("-inf")


def keep_top_k(logits, top_k, *, offset=0, strict=False):
    k = top_k + offset
    if 0 < top_k < logits.shape[-1] and k > 0:
        kth = logits.topk(k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits <= kth if strict else logits < kth, NEG_INF)
    return logits


def keep_top_p(logits, top_p, *, inclusive=False, scatter_back=True, sort=True, dtype=torch.float64):
    if top_p >= 1.0:
        return logits
    ranked, order = logits.sort(dim=-1, descending=True) if sort else (logits, None)
    probs = ranked.softmax(dim=-1, dtype=dtype)
    above = probs.cumsum(dim=-1) - (0 if inclusive else probs)
    drop = above >= top_p
    drop[..., 0] = False
    if sort and scatter_back:
        drop = drop.scatter(-1, order, drop)
    return logits.masked_fill(drop, NEG_INF)


def tkp_float32_sum(logits, top_k, top_p):
    return keep_top_p(keep_top_k(logits, top_k), top_p, dtype=torch.float32)


def tkp_inclusive_cumsum(logits, top_k, top_p):
    return keep_top_p(keep_top_k(logits, top_k), top_p, inclusive=True)


def tkp_top_p_before_top_k(logits, top_k, top_p):
    return keep_top_k(keep_top_p(logits, top_p), top_k)


def tkp_top_p_over_the_full_row(logits, top_k, top_p):
    nucleus = torch.isfinite(keep_top_p(logits, top_p))
    return keep_top_k(logits, top_k).masked_fill(~nucleus, NEG_INF)


def tkp_k_plus_one(logits, top_k, top_p):
    return keep_top_p(keep_top_k(logits, top_k, offset=1), top_p)


def tkp_k_minus_one(logits, top_k, top_p):
    return keep_top_p(keep_top_k(logits, top_k, offset=-1), top_p)


def tkp_strictly_above_kth(logits, top_k, top_p):
    return keep_top_p(keep_top_k(logits, top_k, strict=True), top_p)


def tkp_ties_dropped(logits, top_k, top_p):
    if 0 < top_k < logits.shape[-1]:
        keep = torch.zeros_like(logits, dtype=torch.bool).scatter(-1, logits.topk(top_k, dim=-1).indices, True)
        logits = logits.masked_fill(~keep, NEG_INF)
    return keep_top_p(logits, top_p)


def tkp_reference(logits, top_k, top_p):
    return keep_top_p(keep_top_k(logits, top_k), top_p)


def tkp_zeros(logits, top_k, top_p):
    kept = torch.isfinite(tkp_reference(logits, top_k, top_p))
    return logits.masked_fill(~kept, 0.0)


def tkp_probabilities(logits, top_k, top_p):
    return tkp_reference(logits, top_k, top_p).softmax(dim=-1)


def tkp_masked_fill_in_place(logits, top_k, top_p):
    kept = torch.isfinite(tkp_reference(logits, top_k, top_p))
    return logits.masked_fill_(~kept, NEG_INF)


def tkp_kth_over_the_batch(logits, top_k, top_p):
    if 0 < top_k < logits.shape[-1]:
        logits = logits.masked_fill(logits < logits.flatten().topk(top_k).values[-1], NEG_INF)
    return keep_top_p(logits, top_p)


def tkp_sorted_mask_not_scattered(logits, top_k, top_p):
    return keep_top_p(keep_top_k(logits, top_k), top_p, scatter_back=False)


def tkp_cumsum_in_token_order(logits, top_k, top_p):
    return keep_top_p(keep_top_k(logits, top_k), top_p, sort=False)


def tkp_top_k_zero_not_special(logits, top_k, top_p):
    kth = logits.topk(top_k, dim=-1).values[..., -1:]
    return keep_top_p(logits.masked_fill(logits < kth, NEG_INF), top_p)


def tkp_kth_without_keepdim(logits, top_k, top_p):
    if 0 < top_k < logits.shape[-1]:
        logits = logits.masked_fill(logits < logits.topk(top_k, dim=-1).values[..., -1], NEG_INF)
    return keep_top_p(logits, top_p)


@mutants("1.10", [
    (tkp_inclusive_cumsum, "top-p dropped the token that crosses p.*exclusive cumulative sum"),
    (tkp_top_p_before_top_k, "not the full distribution; and top-k comes first"),
    (tkp_top_p_over_the_full_row, "renormalised over the tokens top-k kept"),
    (tkp_k_plus_one, "kept 6 tokens instead of 5: an off-by-one"),
    (tkp_k_minus_one, "kept 4 tokens instead of 5: an off-by-one"),
    (tkp_strictly_above_kth, "off-by-one at the k-th best"),
    (tkp_ties_dropped, "tied with the k-th best were dropped"),
    (tkp_zeros, "-inf, not 0"),
    (tkp_probabilities, "return logits, not probabilities"),
    (tkp_masked_fill_in_place, "in place: use masked_fill, not masked_fill_"),
    (tkp_kth_over_the_batch, "k-th best was taken over the whole batch"),
    (lambda logits, top_k, top_p: keep_top_k(logits, top_k), "top_p was ignored"),
    (lambda logits, top_k, top_p: keep_top_p(logits, top_p), "top_k was ignored"),
    (tkp_sorted_mask_not_scattered, "still in sorted order: scatter it back"),
    (tkp_cumsum_in_token_order, "summed in token-id order"),
    (tkp_float32_sum, "right at the boundary: sum the probabilities in float64"),
    (tkp_top_k_zero_not_special, "raised RuntimeError.*top_k=0, top_p=1.0.*top_k=0 means no top-k limit"),
    (tkp_kth_without_keepdim, "raised RuntimeError.*\\(B, 1\\) column"),
])
def test_top_k_top_p_check_names_the_mistake(wrong, message):
    with names_the_mistake("1.10", message):
        checks.check_top_k_top_p(wrong)


def test_the_helpers_the_sampling_mutants_are_built_from_are_right(capsys):
    checks.check_top_k_top_p(tkp_reference)
    assert capsys.readouterr().out.count("passed") == 1


def test_not_implemented_passes_through_with_its_own_message():
    def stub(*args):
        raise NotImplementedError("Exercise 1.1 is not implemented yet")

    with pytest.raises(NotImplementedError, match="Exercise 1.1 is not implemented yet"):
        checks.check_rms_norm(stub)


def test_a_stub_wrapped_by_another_error_still_reads_not_implemented():
    """The Triton interpreter wraps errors raised inside kernels; the stub's message must survive."""
    from aie_lessons.checks.common import call

    def wrapped(*args):
        raise RuntimeError("InterpreterError: NotImplementedError('Exercise 5.3 is not implemented yet: replace')")

    with pytest.raises(NotImplementedError, match=r"^Exercise 5.3 is not implemented yet: replace$"):
        call("5.3", wrapped)


def test_a_tensor_subclass_is_refused_by_name():
    """A subclass can answer torch.equal however it likes, so shape checks insist on torch.Tensor."""

    class Agreeable(torch.Tensor):
        pass

    def rms_subclass(x, w, eps):
        return rms_norm(x, w, eps).as_subclass(Agreeable)

    with names_the_mistake("1.1", "plain torch.Tensor, got the subclass Agreeable"):
        checks.check_rms_norm(rms_subclass)


# --- 1.11 the stop rules: wrong implementations -------------------------------------------------


class StreamSketch(OutputStream):
    """OutputStream.push with switches for the usual mistakes."""

    mistake = ""

    def push(self, token_id):
        wrong = self.mistake
        if token_id in self.stop_ids and wrong == "eos without finish":
            self.result.finish_reason = "eos"
            self.finished = True
            return True
        if token_id in self.stop_ids and wrong != "keeps eos":
            self._finish("eos")
            return True
        self.result.token_ids.append(token_id)
        if token_id in self.stop_ids:
            self._finish("eos")
            return True
        piece = (self.detokenizer.tokenizer.decode([token_id]) if wrong == "decodes alone"
                 else self.detokenizer.push(token_id))
        text, stopped = (piece, False) if wrong == "no stop strings" else self.stops.push(piece)
        if wrong == "skips emit":
            self.result.text += text
        else:
            self._emit(text)
        count, limit = len(self.result.token_ids), self.max_new_tokens
        reached = count > limit if wrong == "off by one" else count >= limit
        if wrong == "length first" and reached:
            self._finish("length")
        elif stopped:
            self._finish("stop")
        elif reached:
            if wrong == "no finish":
                self.finished, self.result.finish_reason = True, "length"
            else:
                self._finish("length")
        return None if wrong == "returns None" and not self.finished else self.finished


def stream_with(mistake: str) -> type:
    return type(f"Stream_{mistake.replace(' ', '_')}", (StreamSketch,), {"mistake": mistake})


@mutants("1.11", [
    (stream_with("keeps eos"), "stop token was kept in token_ids"),
    (stream_with("decodes alone"), "U\\+FFFD"),
    (stream_with("no stop strings"), "stop string appeared in the text"),
    (stream_with("skips emit"), "streamed to on_text differs"),
    (stream_with("off by one"), "with max_new_tokens=\\d+ push returned True after \\d+ tokens.*off-by-one"),
    (stream_with("length first"), "the stop string first, it wins"),
    (stream_with("no finish"), "text held back .* was lost"),
    (stream_with("eos without finish"), "at a stop token, text held back .* was lost.*_finish\\('eos'\\)"),
    (stream_with("returns None"), "push returned None \\(NoneType\\): return True or False"),
])
def test_output_stream_check_names_the_mistake(tiny_dir, wrong, message):
    with names_the_mistake("1.11", message):
        checks.check_output_stream(wrong, Tokenizer.from_pretrained(tiny_dir))


# --- 1.12 the generate loop: wrong implementations ----------------------------------------------


def steps_sketch(model, prompt_ids, params, mistake=""):
    """skeleton_steps with switches for the usual mistakes (sample_next is the module's name, which
    the check replaces while it runs)."""
    generators = [make_generator(params.seed)]
    ids = list(prompt_ids)
    if mistake == "echoes the prompt":
        yield from ([token] for token in prompt_ids)
    steps = params.max_new_tokens + {"one short": -1, "one too many": 1}.get(mistake, 0)
    for _ in range(steps):
        seen = ids[-1:] if mistake == "only the new token" and len(ids) > len(prompt_ids) else ids
        start = 1 if mistake == "positions from 1" else 0
        positions = None if mistake == "no positions" else torch.arange(start, start + len(seen))[None]
        if mistake == "1-D positions":
            positions = positions[0]
        logits = model(torch.tensor([seen]), positions)
        if mistake == "first position":
            logits = logits[:, :1]
        if mistake == "new generator":
            generators = [make_generator(params.seed)]
        history = ids[len(prompt_ids):] if mistake == "history without the prompt" else ids
        if mistake == "argmax":
            token = [int(logits[0, -1].argmax())]
        else:
            token = sample_next(logits, [params], generators, [history])
        if mistake != "does not grow":
            ids = ids + token
        yield token[0] if mistake == "yields an int" else token
        if mistake == "stops at eos" and token[0] in model.config.eos_token_ids:
            return


def steps_with(mistake: str):
    def steps(model, prompt_ids, params):
        return steps_sketch(model, prompt_ids, params, mistake)

    steps.__name__ = f"steps_{mistake.replace(' ', '_')}"
    return steps


@mutants("1.12", [
    (steps_with("only the new token"), "saw only the newest token.*whole sequence"),
    (steps_with("does not grow"), "saw only the prompt at step 1"),
    (steps_with("echoes the prompt"), "first tokens yielded are the prompt"),
    (steps_with("one short"), "yielded 5 tokens.*expected exactly 6.*off-by-one"),
    (steps_with("one too many"), "yielded 7 tokens.*expected exactly 6"),
    (steps_with("yields an int"), "yield a list with one int token id"),
    (steps_with("argmax"), "sample_next was never called"),
    (steps_with("first position"), "given the first position's logits"),
    (steps_with("history without the prompt"), "the whole sequence so far.*repetition penalty"),
    (steps_with("new generator"), "different random generator"),
    (steps_with("no positions"), "without positions"),
    (steps_with("positions from 1"), "were \\[1, 2, 3, 4, 5\\], expected 0 … 4"),
    (steps_with("1-D positions"), "positions of shape \\(5,\\) for ids of shape \\(1, 5\\).*\\(1, S\\)"),
    (steps_with("stops at eos"), "read model.config.eos_token_ids.*the output streams' job, exercise 1.11"),
])
def test_skeleton_steps_check_names_the_mistake(wrong, message):
    with names_the_mistake("1.12", message):
        checks.check_skeleton_steps(wrong)


def test_skeleton_steps_sketch_without_mistakes_passes(capsys):
    checks.check_skeleton_steps(steps_with(""))
    assert "passed" in capsys.readouterr().out


def test_reference_implementations_pass_and_the_checks_restore_what_they_swap(tiny_dir, capsys):
    from aie_lessons import generate, model as model_module, output

    tokenizer = Tokenizer.from_pretrained(tiny_dir)
    checks.check_rms_norm(rms_norm)
    checks.check_apply_rope(apply_rope)
    checks.check_rope_cos_sin(rope_cos_sin)
    checks.check_mlp(MLP)
    checks.check_decoder_layer(DecoderLayer)
    checks.check_llama_forward(LlamaModel)
    checks.check_greedy_step(greedy_step)
    checks.check_streaming_detokenizer(StreamingDetokenizer, tokenizer)
    checks.check_repetition_penalty(apply_repetition_penalty)
    checks.check_top_k_top_p(filter_top_k_top_p)
    checks.check_output_stream(OutputStream, tokenizer)
    checks.check_skeleton_steps(skeleton_steps, LlamaModel.from_pretrained(tiny_dir))
    out = capsys.readouterr().out
    assert out.count("✓ Exercise") == 12, out
    assert "real model's greedy tokens match" in out
    assert generate.sample_next is sample_next, "the check must put the real sample_next back"
    assert model_module.rope_cos_sin is rope_cos_sin and output.StreamingDetokenizer is StreamingDetokenizer


class RaisingModel(LlamaModel):
    def forward(self, *args, **kwargs):
        raise RuntimeError("a deliberate mistake in exercise 1.1")


def test_the_loop_check_does_not_blame_the_loop_for_a_failing_model(tiny_dir, capsys):
    """Grading: a mistake in 1.1–1.6 fails its own exercise, not 1.12 as well."""
    checks.check_skeleton_steps(skeleton_steps, RaisingModel.from_pretrained(tiny_dir))
    assert "real-model comparison skipped: the model raised RuntimeError" in capsys.readouterr().out


def test_a_tokenizer_that_splits_no_character_is_an_environment_error_not_the_learners():
    class OneTokenPerCharacter:
        def encode(self, text):
            return [ord(c) for c in text]

        def token_bytes(self, token_id):
            return chr(token_id).encode("utf-8")

    with pytest.raises(RuntimeError, match="split no character"):
        checks.check_streaming_detokenizer(StreamingDetokenizer, OneTokenPerCharacter())
