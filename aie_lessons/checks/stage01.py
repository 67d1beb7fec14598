"""Checks for stage 01: the model's parts, the greedy step, streaming text, sampling, the loop."""

from __future__ import annotations

import codecs
import dataclasses
import inspect
from dataclasses import dataclass
from itertools import islice
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from aie_lessons.checks.common import CheckFailed, call, close, expect_shape, fail, isolated, passed

# Sizes chosen so that batch, heads, sequence and head_dim all differ: a wrong permute or a
# broadcast along the wrong axis then fails with a shape error instead of passing by luck.
BATCH, HEADS, SEQ, HEAD_DIM, HIDDEN = 2, 3, 5, 8, 12
EPS = 1e-5


def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


# --- 1.1 RMSNorm -------------------------------------------------------------------------------


def _rms_mistakes(x: torch.Tensor, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """What the usual wrong RMSNorms compute on ``x`` (fp32)."""

    def norm_over(dim):
        return x * torch.rsqrt(x.pow(2).mean(dim=dim, keepdim=True) + EPS)

    centered = x - x.mean(-1, keepdim=True)
    return {
        "you subtracted the mean: that is LayerNorm. RMSNorm divides by the root-mean-square "
        "of x itself, sqrt(mean(x²) + eps)": centered * torch.rsqrt(centered.pow(2).mean(-1, keepdim=True) + EPS) * weight,
        "you divided by mean(x²) + eps without the square root": x / (x.pow(2).mean(-1, keepdim=True) + EPS) * weight,
        "the result is not multiplied by `weight`": norm_over(-1),
        "you normalized over the wrong dimension: the mean of x² must be over the last "
        "(hidden) dimension, dim=-1": norm_over(1) * weight,
        "you took the mean over all dimensions: it must be per vector, over dim=-1 "
        "with keepdim=True": x * torch.rsqrt(x.pow(2).mean() + EPS) * weight,
        "eps was added outside the square root, sqrt(mean(x²)) + eps: on small vectors (mean(x²) "
        "near eps, as here) that differs from the formula the model was trained with, "
        "sqrt(mean(x²) + eps)": x / (x.pow(2).mean(-1, keepdim=True).sqrt() + EPS) * weight,
        "eps is missing: add eps inside the square root, sqrt(mean(x²) + eps) (on small vectors, "
        "as here, it matters)": x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)) * weight,
    }


# (what the case is, scale of x): vectors of ordinary size, and small ones whose mean(x²) is
# near eps, where the place of eps (inside or outside the root) changes the result.
RMS_NORM_CASES = (("x of ordinary size", 3.0), ("small x, mean(x²) near eps", 3e-3))


def check_rms_norm(rms_norm) -> None:
    g = _generator()
    weight = torch.rand(HIDDEN, generator=g) + 0.5
    hint = "rms_norm(x, weight, eps) normalizes over the last dimension"
    for case, scale in RMS_NORM_CASES:
        x = (torch.randn(BATCH, SEQ, HIDDEN, generator=g) + 1 / 3) * scale  # nonzero mean exposes LayerNorm
        got = call("1.1", rms_norm, x, weight, EPS, hint=hint)
        expect_shape("1.1", "the output", got, x.shape)
        expected = _reference_rms_norm(x, weight)
        if close(got, expected, atol=1e-4):
            continue
        for message, wrong in _rms_mistakes(x, weight).items():
            if close(got, wrong, atol=1e-4):
                fail("1.1", f"({case}) {message}")
        error = (got.float() - expected).abs().max().item()
        fail("1.1", f"({case}) output differs from x / sqrt(mean(x²) + eps) * weight by up to {error:.3g}")

    zeros = torch.zeros(1, 1, HIDDEN)
    got_zero = call("1.1", rms_norm, zeros, weight, EPS, hint=hint)
    if not torch.isfinite(got_zero).all():
        fail("1.1", "a vector of zeros gives NaN or inf: add eps *inside* the square root, "
                    "sqrt(mean(x²) + eps)")

    # Half precision: bf16 has fp32's range, so it tests the dtype that comes back; fp16 tops
    # out at 65504, so the squares of values of a few hundred overflow unless computed in fp32.
    for dtype, scale, atol in ((torch.bfloat16, 3.0, 3e-2), (torch.float16, 300.0, 1e-2)):
        x = torch.randn(BATCH, SEQ, HIDDEN, generator=g) * scale
        x[..., 0] = scale  # at least one square above 65504 in every vector (fp16)
        half = x.to(dtype)
        got16 = call("1.1", rms_norm, half, weight.to(dtype), EPS, hint=hint)
        expect_shape("1.1", f"the output for a {dtype} input", got16, x.shape)
        if got16.dtype != dtype:
            fail("1.1", f"a {dtype} input gave a {got16.dtype} output: compute in float32, then "
                        "cast the result back to x's dtype")
        reference16 = _reference_rms_norm(half.float(), weight.to(dtype).float())
        if close(got16, reference16, atol=atol):
            continue
        if dtype == torch.float16 and not (torch.isfinite(got16).all() and got16.abs().amax() > 0.1):
            fail("1.1", f"a float16 input with values near {scale:g} gave zeros, inf or NaN: their squares "
                        "(about 9e4) overflow float16, whose largest number is 65504. Compute in "
                        "float32 (convert x first) and cast the result back at the end")
        fail("1.1", f"in {dtype} the result is off by more than rounding: compute mean(x²) in "
                    "float32 and cast back at the end")
    passed("1.1", "RMSNorm matches x / sqrt(mean(x²) + eps) * weight, on ordinary and small vectors, "
                  "in fp32, bf16 and fp16 (squares beyond fp16's range)")


# --- 1.2 RoPE ---------------------------------------------------------------------------------


def _rope_tables(positions: torch.Tensor, head_dim: int, theta: float):
    """RoPE's cos/sin tables, (B, S, D), written from the formula (exercise 1.3's reference)."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = positions.float()[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def _rotate_interleaved(x, cos, sin):
    """RoPE with adjacent pairs (x0, x1), (x2, x3): the convention of Meta's and GGUF's code."""
    half = x.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = even * c - odd * s
    out[..., 1::2] = even * s + odd * c
    return out


def check_apply_rope(apply_rope) -> None:
    g = _generator()
    x = torch.randn(BATCH, HEADS, SEQ, HEAD_DIM, generator=g)
    positions = torch.arange(SEQ).expand(BATCH, SEQ) + torch.tensor([[0], [7]])
    cos, sin = _rope_tables(positions, HEAD_DIM, 10000.0)
    hint = "cos and sin are (B, S, D); x is (B, H, S, D): add the head axis with cos.unsqueeze(1)"
    got = call("1.2", apply_rope, x, cos, sin, hint=hint)
    expect_shape("1.2", "the rotated tensor", got, x.shape)

    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    expected = x * c + _rotate_half(x) * s
    if not close(got, expected):
        mistakes = {
            "the input came back unchanged: multiply by cos and add rotate_half(x) * sin": x,
            "you rotated the wrong way: the sin term is + rotate_half(x) * sin": x * c - _rotate_half(x) * s,
            "cos and sin are swapped: x * cos + rotate_half(x) * sin": x * s + _rotate_half(x) * c,
            "you paired adjacent coordinates (x0, x1), (x2, x3): that is the interleaved "
            "convention. This model pairs x[i] with x[i + D/2] (rotate_half)": _rotate_interleaved(x, c, s),
        }
        for message, wrong in mistakes.items():
            if close(got, wrong):
                fail("1.2", message)
        error = (got - expected).abs().max().item()
        fail("1.2", f"the result differs from x * cos + rotate_half(x) * sin by up to {error:.3g}")
    if not close(got.norm(dim=-1), x.norm(dim=-1), atol=1e-4):
        fail("1.2", "a rotation must keep each vector's length, and yours does not")
    # A bf16 model rotates bf16 q and k; the tables may come in fp32 (as rope_cos_sin returns
    # them) or already converted. Either way q and k must stay bf16: the attention that follows,
    # and stage 04's cache, expect the stream's dtype.
    half = x.to(torch.bfloat16)
    for tables in ("float32", "bfloat16"):
        c16, s16 = (cos, sin) if tables == "float32" else (cos.to(torch.bfloat16), sin.to(torch.bfloat16))
        got16 = call("1.2", apply_rope, half, c16, s16, hint=hint)
        expect_shape("1.2", "the rotated bfloat16 tensor", got16, x.shape)
        if got16.dtype != torch.bfloat16:
            fail("1.2", f"a bfloat16 x with {tables} cos/sin came back as {got16.dtype}: return the "
                        "result in x's dtype (bf16 times fp32 promotes to fp32)")
        reference16 = half.float() * c + _rotate_half(half.float()) * s
        if not close(got16, reference16, atol=5e-2):
            error = (got16.float() - reference16).abs().max().item()
            fail("1.2", f"for a bfloat16 x with {tables} cos/sin the result differs from the rotation "
                        f"by up to {error:.3g}, more than bf16 rounding")
    passed("1.2", "RoPE rotates each (i, i + D/2) pair by position × frequency, in fp32 and bf16")


# --- 1.3 the rotation angles ---------------------------------------------------------------


ROPE_TABLE_CASES = ((8, 10000.0), (64, 10000.0), (16, 500000.0))  # (head_dim, theta)


def check_rope_cos_sin(rope_cos_sin) -> None:
    g = _generator()
    hint = "rope_cos_sin(positions (B, S) integers, head_dim, theta) returns (cos, sin), each (B, S, D)"
    for head_dim, theta in ROPE_TABLE_CASES:
        # Positions that are not 0 … S−1 (a later chunk, another row further on) and one large one.
        positions = torch.randint(0, 2000, (2, 5), generator=g)
        positions[0] = torch.arange(5) + 3
        case = f"head_dim={head_dim}, theta={theta:g}"
        got = call("1.3", rope_cos_sin, positions, head_dim, theta, hint=hint)
        if not isinstance(got, (tuple, list)) or len(got) != 2:
            fail("1.3", f"({case}) return a pair (cos, sin), got {type(got).__name__}")
        cos, sin = got
        if isinstance(cos, torch.Tensor) and tuple(cos.shape) == (2, 5, head_dim // 2):
            fail("1.3", f"({case}) the tables have D/2 = {head_dim // 2} columns: both halves of the last "
                        "dimension hold the same D/2 angles, so repeat them to D columns")
        expect_shape("1.3", f"cos ({case})", cos, (2, 5, head_dim))
        expect_shape("1.3", f"sin ({case})", sin, (2, 5, head_dim))
        if cos.dtype != torch.float32 or sin.dtype != torch.float32:
            fail("1.3", f"({case}) the tables are {cos.dtype}/{sin.dtype}: return float32 (the model "
                        "converts them to its compute dtype itself)")
        expected_cos, expected_sin = _rope_tables(positions, head_dim, theta)
        if close(cos, expected_cos, atol=1e-3) and close(sin, expected_sin, atol=1e-3):
            continue
        _explain_rope_tables(cos, sin, positions, head_dim, theta, case)
    passed("1.3", "cos/sin tables: angle position · theta^(-2i/D) per pair, both halves alike, "
                  f"for {len(ROPE_TABLE_CASES)} head sizes and bases")


def _explain_rope_tables(cos, sin, positions, head_dim, theta, case) -> None:
    """Fail with the mistake that explains the tables ``cos``, ``sin``."""
    pairs = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim  # 2i/D
    p = positions.float()[..., None]

    def tables(angles):
        return angles.cos(), angles.sin()

    cases = {
        "the angles are those of positions 0 … S−1, not of the positions given":
            tables(torch.cat([torch.arange(positions.shape[1]).float()[None, :, None].expand(2, -1, -1)
                              * theta ** -pairs] * 2, -1)),
        "each angle appears twice in a row (interleaved): this model pairs coordinate i with i + D/2, "
        "so the D/2 angles go once in the first half and again in the second": tables((p * theta ** -pairs).repeat_interleave(2, -1)),
        "the frequencies are theta^(-i/D): the exponent is 2i/D, with i = 0 … D/2 − 1 "
        "(even numbers 0, 2, … D−2 divided by D)": tables(torch.cat([p * theta ** -(pairs / 2)] * 2, -1)),
        "the frequencies grow with i (theta^(+2i/D)): they must shrink, theta^(-2i/D)":
            tables(torch.cat([p * theta ** pairs] * 2, -1)),
        "every coordinate got its own frequency theta^(-j/D) for j = 0 … D−1: pair i (coordinates i "
        "and i + D/2) shares one angle": tables(p * theta ** -(torch.arange(head_dim).float() / head_dim)),
    }
    expected_cos, expected_sin = _rope_tables(positions, head_dim, theta)
    if close(cos, expected_sin, atol=1e-3) and close(sin, expected_cos, atol=1e-3):
        fail("1.3", f"({case}) cos and sin are swapped: return (cos, sin)")
    for message, (wrong_cos, wrong_sin) in cases.items():
        if close(cos, wrong_cos, atol=1e-3) and close(sin, wrong_sin, atol=1e-3):
            fail("1.3", f"({case}) {message}")
    error = (cos - expected_cos).abs().max().item()
    fail("1.3", f"({case}) cos differs from cos(position · theta^(-2i/D)) by up to {error:.3g}")


# --- shared by 1.4 – 1.6: a tiny random model and a reference written from its weights ----------


def _tiny_config(**changes) -> SimpleNamespace:
    """A model small enough to check in milliseconds, with every size different from the others.

    It has ModelConfig's fields (a plain namespace, so the checks import none of the package's
    modules, which may be the learner's own after ``aie commit``). Its RoPE base, 500, is no
    checkpoint's default, so a base written into the code instead of read from the config shows.
    """
    sizes = dict(vocab_size=50, hidden_size=24, intermediate_size=40, num_layers=3, num_heads=4,
                 num_kv_heads=2, head_dim=6, rms_norm_eps=EPS, rope_theta=500.0,
                 max_position_embeddings=64, tie_word_embeddings=False, eos_token_ids=(0,))
    sizes.update(changes)
    return SimpleNamespace(**sizes)


def _randomize(module: nn.Module, g: torch.Generator, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Random weights: norms' weights around 1 but all different (so swapping two norms shows),
    projections scaled by 1/√fan_in (so activations stay near 1 through every layer)."""
    with torch.no_grad():
        for name, param in module.named_parameters():
            if "norm" in name:
                param.copy_(torch.rand(param.shape, generator=g) + 0.5)
            else:
                param.copy_(torch.randn(param.shape, generator=g) * param.shape[-1] ** -0.5)
    return module.to(dtype)


def _linear(x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    return F.linear(x, layer.weight.to(x.dtype))


def _reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


class _ReferenceNorm(nn.Module):
    """RMSNorm written here, holding the same weight as the learner's module it replaces."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _reference_rms_norm(x, self.weight)


class _ReferenceMLP(nn.Module):
    """SwiGLU from the learner's MLP's weights; counts its calls."""

    def __init__(self, mlp: nn.Module):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return _linear(F.silu(_linear(x, self.gate_proj)) * _linear(x, self.up_proj), self.down_proj)


class _ReferenceAttention(nn.Module):
    """Grouped-query attention from the learner's Attention's weights, written with explicit
    scores; it records what it was called with, so a check can see what the caller passed on."""

    def __init__(self, attn: nn.Module, config: SimpleNamespace):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj
        self.config = config
        self.calls: list[dict] = []

    def forward(self, x, cos, sin, attn=None):
        self.calls.append({"attn": attn})
        return _reference_attention(self, x, cos, sin, getattr(attn, "mask", None))


def _reference_attention(attn, x, cos, sin, mask=None) -> torch.Tensor:
    config = attn.config
    batch, seq, _ = x.shape
    d, hq, hkv = config.head_dim, config.num_heads, config.num_kv_heads

    def heads(t, n):
        return t.view(batch, seq, n, d).transpose(1, 2).float()

    c, s = cos.float().unsqueeze(1), sin.float().unsqueeze(1)
    q = heads(_linear(x, attn.q_proj), hq)
    k = heads(_linear(x, attn.k_proj), hkv).repeat_interleave(hq // hkv, dim=1)
    v = heads(_linear(x, attn.v_proj), hkv).repeat_interleave(hq // hkv, dim=1)
    q, k = q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s
    scores = q @ k.transpose(-1, -2) / d ** 0.5
    allowed = torch.ones(seq, seq, dtype=torch.bool).tril() if mask is None else mask
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    out = (weights @ v).transpose(1, 2).reshape(batch, seq, hq * d).to(x.dtype)
    return _linear(out, attn.o_proj)


# --- 1.4 the SwiGLU MLP -----------------------------------------------------------------------

MLP_SHAPES = ((2, 5), (1, 1), (3, 7))  # (batch, sequence): a decode step's single token too


# (weights stored in, x and the arithmetic in, tolerance): the last is how the course runs a
# bf16 checkpoint, bf16 weights with fp32 activations, which only the Linear layers handle.
MLP_DTYPES = ((torch.float32, torch.float32, 1e-5), (torch.bfloat16, torch.bfloat16, 3e-2),
              (torch.bfloat16, torch.float32, 1e-5))


def check_mlp(mlp_cls) -> None:
    g = _generator()
    config = _tiny_config()
    for stored, dtype, atol in MLP_DTYPES:
        hint = "MLP(config).forward(x) takes x (..., hidden_size) and returns the same shape"
        if stored != dtype:
            hint += (f"; here the weights are stored in {stored} and x is {dtype}: call the projection "
                     "layers themselves (self.gate_proj(x), …), which compute in x's dtype whatever "
                     "their weights are stored in; F.linear on a raw weight does not")
        mlp = _randomize(call("1.4", mlp_cls, config, hint=hint), g, stored)
        for batch, seq in MLP_SHAPES:
            x = torch.randn(batch, seq, config.hidden_size, generator=g).to(dtype)
            got = call("1.4", mlp, x, hint=hint)
            if isinstance(got, torch.Tensor) and got.shape[-1] == config.intermediate_size:
                fail("1.4", f"the output has intermediate_size ({config.intermediate_size}) features: "
                            "project the gated product back to hidden_size with down_proj")
            expect_shape("1.4", "the MLP's output", got, x.shape)
            if got.dtype != dtype:
                fail("1.4", f"a {dtype} input gave a {got.dtype} output: let the projections compute "
                            "in the input's dtype")
            gate, up = _linear(x, mlp.gate_proj), _linear(x, mlp.up_proj)
            expected = _linear(F.silu(gate) * up, mlp.down_proj)
            if close(got, expected, atol=atol):
                continue
            mistakes = {
                "SiLU went on the up projection: the *gate* projection goes through SiLU and "
                "multiplies the up projection": F.silu(up) * gate,
                "no activation: the gate projection must go through SiLU before the product": gate * up,
                "you used sigmoid: SwiGLU's activation is SiLU, z·sigmoid(z) (F.silu)": torch.sigmoid(gate) * up,
                "you used ReLU: SwiGLU's activation is SiLU, z·sigmoid(z) (F.silu)": F.relu(gate) * up,
                "you used GELU: SwiGLU's activation is SiLU, z·sigmoid(z) (F.silu)": F.gelu(gate) * up,
                "SiLU was applied to the product: apply it to the gate projection, then multiply":
                    F.silu(gate * up),
                "the gate and up projections were added: the gate *multiplies* the up projection "
                "feature by feature": F.silu(gate) + up,
            }
            for message, wrong in mistakes.items():
                if close(got, _linear(wrong, mlp.down_proj), atol=atol):
                    fail("1.4", message)
            error = (got.float() - expected.float()).abs().max().item()
            fail("1.4", f"({dtype}, x of shape {tuple(x.shape)}) the output differs from "
                        f"down(silu(gate(x)) · up(x)) by up to {error:.3g}")
    passed("1.4", "SwiGLU matches down(silu(gate(x)) · up(x)) for several shapes, in fp32 and bf16, "
                  "and with bf16 weights under fp32 activations")


# --- 1.5 the pre-norm residual block ----------------------------------------------------------


def _block_with_reference_parts(layer_cls, config: SimpleNamespace, g: torch.Generator, dtype: torch.dtype):
    """The learner's block with its attention, MLP and norms replaced by the references above:
    exercises 1.1–1.4 cannot make this check fail, and the attention records its arguments."""
    layer = _randomize(call("1.5", layer_cls, config, 0,
                            hint="DecoderLayer(config, layer_index, kernel=sdpa_attention)"), g, dtype)
    layer.input_layernorm = _ReferenceNorm(layer.input_layernorm.weight)
    layer.post_attention_layernorm = _ReferenceNorm(layer.post_attention_layernorm.weight)
    layer.self_attn = _ReferenceAttention(layer.self_attn, config)
    layer.mlp = _ReferenceMLP(layer.mlp)
    return layer


def _block_mistakes(layer, x, cos, sin) -> dict[str, torch.Tensor]:
    """What the usual wrong wirings of a block compute, from the same parts."""
    n1, n2, mlp = layer.input_layernorm, layer.post_attention_layernorm, layer.mlp.forward

    def attn(h):
        return _reference_attention(layer.self_attn, h, cos, sin)

    h = x + attn(n1(x))
    post_h = n1(x + attn(x))
    return {
        "the attention half replaced the stream instead of adding to it: add its output to x "
        "(the residual connection)": attn(n1(x)) + mlp(n2(attn(n1(x)))),
        "the MLP half replaced the stream instead of adding to it: add its output to the stream "
        "(the residual connection)": mlp(n2(h)),
        "no residual connections at all: each half's output must be added to the stream":
            mlp(n2(attn(n1(x)))),
        "you normalized after adding (post-norm): pre-norm normalizes a copy of the stream going "
        "*into* each half and never the stream itself": n2(post_h + mlp(post_h)),
        "you normalized the halves' outputs: the norms go on their inputs": (x + n1(attn(x))) + n2(mlp(x + n1(attn(x)))),
        "the residual carried the normalized copy: add each half's output to the stream itself, "
        "not to its normalized copy": n2(n1(x) + attn(n1(x))) + mlp(n2(n1(x) + attn(n1(x)))),
        "the MLP read the block's input: it must read the stream after the attention half was "
        "added (the halves run one after the other, not in parallel)": x + attn(n1(x)) + mlp(n2(x)),
        "the norms are swapped: input_layernorm goes before attention, post_attention_layernorm "
        "before the MLP": (x + attn(n2(x))) + mlp(n1(x + attn(n2(x)))),
        "both halves used input_layernorm: the MLP reads post_attention_layernorm": h + mlp(n1(h)),
        "both halves used post_attention_layernorm: attention reads input_layernorm":
            (x + attn(n2(x))) + mlp(n2(x + attn(n2(x)))),
        "the MLP ran before attention: attention comes first": (x + mlp(n2(x))) + attn(n1(x + mlp(n2(x)))),
    }


class _FakeCache:
    """Stands for stage 04's KV cache: the block only has to pass it on."""


@dataclass(eq=False)
class _Metadata:
    """Stands for AttentionMetadata: the block passes it on unread, the model reads logits_at."""

    mask: torch.Tensor | None = None
    cache: object = None
    cache_start: object = None
    logits_at: object = None


METADATA_FIELDS = ("mask", "cache", "cache_start", "logits_at")


def _metadata_type(fn) -> type:
    """The stand-in the check passes to ``fn``: a subclass of the AttentionMetadata that ``fn``'s own
    module sees (the notebook's, in stage 01), so that code testing isinstance is not failed for it
    — engine steps subclass AttentionMetadata too."""
    base = inspect.unwrap(fn).__globals__.get("AttentionMetadata")
    if (isinstance(base, type) and dataclasses.is_dataclass(base)
            and set(METADATA_FIELDS) <= {f.name for f in dataclasses.fields(base)}):
        return dataclass(eq=False)(type("_Metadata", (base,), {"__doc__": _Metadata.__doc__}))
    return _Metadata


def _metadata_variants(metadata: type, mask: torch.Tensor) -> list:
    """What stages 03–07 hand on: a mask and a cache, a cache alone (a decode step), a mask alone."""
    return [metadata(mask=mask, cache=_FakeCache(), cache_start=7), metadata(cache=_FakeCache(), cache_start=3),
            metadata(mask=mask)]


def _contents(attn) -> tuple:
    return tuple(id(getattr(attn, name)) for name in METADATA_FIELDS)


def check_decoder_layer(layer_cls) -> None:
    g = _generator()
    config = _tiny_config()
    hint = "forward(x, cos, sin, attn) returns the new stream (attn: the pass's AttentionMetadata)"
    metadata = _metadata_type(layer_cls.forward)
    for dtype, atol in ((torch.float32, 1e-4), (torch.bfloat16, 6e-2)):
        for batch, seq in ((2, 5), (1, 1), (3, 4)):
            layer = _block_with_reference_parts(layer_cls, config, g, dtype)
            x = (torch.randn(batch, seq, config.hidden_size, generator=g) * 2).to(dtype)
            positions = torch.arange(seq).expand(batch, seq) + torch.arange(batch)[:, None] * 3
            cos, sin = (t.to(dtype) for t in _rope_tables(positions, config.head_dim, config.rope_theta))
            got = call("1.5", layer, x, cos, sin, metadata(), hint=hint)
            expect_shape("1.5", "the block's output", got, x.shape)
            if got.dtype != dtype:
                fail("1.5", f"a {dtype} stream came back as {got.dtype}")
            calls = len(layer.self_attn.calls), layer.mlp.calls
            if calls != (1, 1):
                fail("1.5", f"self_attn ran {calls[0]} times and mlp {calls[1]} times for one block: "
                            "each half runs exactly once")
            with torch.no_grad():
                h = x + _reference_attention(layer.self_attn, layer.input_layernorm(x), cos, sin)
                expected = h + layer.mlp(layer.post_attention_layernorm(h))
                if close(got, expected, atol=atol):
                    continue
                for message, wrong in _block_mistakes(layer, x, cos, sin).items():
                    if close(got, wrong, atol=atol):
                        fail("1.5", message)
            error = (got.float() - expected.float()).abs().max().item()
            fail("1.5", f"({dtype}, x of shape {tuple(x.shape)}) the output differs from "
                        f"x + attn(norm1(x)), then + mlp(norm2(·)), by up to {error:.3g}")
    _check_block_passes_mask_and_cache(layer_cls, config, g, hint, metadata)
    passed("1.5", "pre-norm block: x + attn(norm(x)), then + mlp(norm(·)), fp32 and bf16, "
                  "the pass's metadata handed on to attention")


def _check_block_passes_mask_and_cache(layer_cls, config: SimpleNamespace, g: torch.Generator, hint: str,
                                       metadata: type) -> None:
    """Stage 03's masks and stage 04's cache reach attention only through the block, as they were sent."""
    layer = _block_with_reference_parts(layer_cls, config, g, torch.float32)
    seq = 4
    x = torch.randn(1, seq, config.hidden_size, generator=g)
    cos, sin = _rope_tables(torch.arange(seq)[None], config.head_dim, config.rope_theta)
    mask = torch.ones(1, 1, seq, seq, dtype=torch.bool).tril()
    mask[..., 2, 0] = False  # a mask no causal default would produce
    for sent in _metadata_variants(metadata, mask):
        contents = _contents(sent)
        layer.self_attn.calls.clear()
        call("1.5", layer, x, cos, sin, sent, hint=hint)
        if not layer.self_attn.calls:
            fail("1.5", "self.self_attn never ran: call it on the normed stream, with cos, sin and attn")
        if layer.self_attn.calls[-1]["attn"] is not sent:
            fail("1.5", "self_attn did not receive the metadata (attn) the block was given: pass cos, sin "
                        "and attn on to it as they are, or stage 03's masks and stage 04's KV cache would "
                        "be silently ignored")
        if _contents(sent) != contents:
            fail("1.5", "the block changed the metadata it was given: hand it on untouched (it belongs to "
                        "the caller, and every layer must see the same)")


# --- 1.6 the forward pass ---------------------------------------------------------------------


class _SpyLayer(nn.Module):
    """A reference block (from the learner's block's weights) that records every call."""

    def __init__(self, layer: nn.Module, config: SimpleNamespace, index: int, log: list):
        super().__init__()
        self.input_layernorm = _ReferenceNorm(layer.input_layernorm.weight)
        self.post_attention_layernorm = _ReferenceNorm(layer.post_attention_layernorm.weight)
        self.self_attn = _ReferenceAttention(layer.self_attn, config)
        self.mlp = _ReferenceMLP(layer.mlp)
        self.index, self.log = index, log

    def forward(self, x, cos, sin, attn=None):
        self.log.append({"layer": self.index, "dtype": x.dtype, "cos": cos, "sin": sin, "attn": attn})
        h = x + _reference_attention(self.self_attn, self.input_layernorm(x), cos, sin, getattr(attn, "mask", None))
        return h + self.mlp(self.post_attention_layernorm(h))


class _SpyNorm(_ReferenceNorm):
    """The final norm, recording how many positions each call normalized."""

    def __init__(self, weight: torch.Tensor):
        super().__init__(weight)
        self.lengths: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.lengths.append(x.shape[1] if x.dim() == 3 else -1)
        return super().forward(x)


class _SpyHead(nn.Module):
    """The output head, holding the learner's head's weight; it records every input it is given,
    so the check sees how many positions the head ran over and in which dtype."""

    def __init__(self, head: nn.Module):
        super().__init__()
        self.weight = head.weight
        self.inputs: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.inputs.append(x.detach().clone())
        return F.linear(x, self.weight.to(x.dtype))


def _model_with_reference_parts(model_cls, config: SimpleNamespace, activations: torch.dtype, g: torch.Generator):
    model = _randomize(call("1.6", lambda: model_cls(config, activations=activations),
                            hint="LlamaModel(config, attention=kernel, activations=dtype)"), g)
    log: list[dict] = []
    for i, layer in enumerate(model.layers):
        model.layers[i] = _SpyLayer(layer, config, i, log)
    model.norm = _SpyNorm(model.norm.weight)
    model.lm_head = _SpyHead(model.lm_head)
    return model.eval(), log


def _check_head(model, logits: torch.Tensor, positions: int, seq: int, case: str) -> None:
    """The output head ran once, over ``positions`` of the ``seq`` positions, in fp32, and its result
    is the logits; so did the final norm."""
    inputs = model.lm_head.inputs
    if len(inputs) != 1:
        fail("1.6", f"({case}) self.lm_head ran {len(inputs)} times in one forward pass: project the "
                    "normed stream onto the vocabulary with it, once")
    head_input = inputs[0]
    model.lm_head.inputs = []
    if head_input.dim() == 3 and positions < seq and head_input.shape[1] == seq:
        fail("1.6", f"({case}) with logits_at set the output head still ran over all {seq} positions "
                    "and the wanted ones were kept afterwards: index the stream with logits_at *before* "
                    "the norm and the head — sparing the head the other positions is what logits_at is for")
    lengths, model.norm.lengths = model.norm.lengths, []
    if positions < seq and seq in lengths:
        fail("1.6", f"({case}) the final norm ran over all {seq} positions and the wanted ones were kept "
                    "afterwards: index the stream with logits_at before the norm, which then works on those "
                    "positions only")
    if head_input.dtype != torch.float32:
        fail("1.6", f"({case}) the output head computed in {head_input.dtype} and the logits were "
                    "converted to fp32 afterwards: convert the normed stream to float32 *before* "
                    f"self.lm_head, or the logits keep {head_input.dtype}'s rounding (near 25, bf16 "
                    "numbers are 0.125 apart, and close candidates tie)")
    if not close(logits, F.linear(head_input, model.lm_head.weight.float()), atol=1e-4):
        fail("1.6", f"({case}) the logits are not the output head's result: return self.lm_head's "
                    "output as it is")


def _reference_logits(model, ids, positions, activations, *, final_norm: bool = True) -> torch.Tensor:
    x = model.embed_tokens.weight[ids].to(activations)
    cos, sin = (t.to(activations) for t in _rope_tables(positions, model.config.head_dim, model.config.rope_theta))
    for layer in model.layers:
        h = x + _reference_attention(layer.self_attn, layer.input_layernorm(x), cos, sin)
        x = h + layer.mlp(layer.post_attention_layernorm(h))
    x = model.norm(x) if final_norm else x
    return F.linear(x.float(), model.lm_head.weight.float())


def check_llama_forward(model_cls) -> None:
    # The model's own parts are replaced by references (rope_cos_sin by the formula's), so only
    # the wiring of forward is judged here: a mistake in 1.1–1.5 fails its own check, not this one.
    with isolated(inspect.unwrap(model_cls.forward), rope_cos_sin=_rope_tables):
        _check_llama_forward(model_cls)
    passed("1.6", "embed → RoPE tables from the positions and the config's base → every layer in "
                  "order → norm → head computed in fp32, in fp32 and bf16, logits_at (a slice or "
                  "positions) sparing the head the other positions, the metadata handed to every layer")


def _check_llama_forward(model_cls) -> None:
    g = _generator()
    config = _tiny_config()
    batch, seq = 2, 6
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=g)
    positions = torch.arange(seq).expand(batch, seq) + torch.tensor([[0], [5]])  # row 1 starts at 5
    hint = "forward(input_ids (B, S), positions (B, S) or None, attn (AttentionMetadata) or None)"
    for activations, atol in ((torch.float32, 1e-4), (torch.bfloat16, 0.1)):
        model, log = _model_with_reference_parts(model_cls, config, activations, g)
        with torch.no_grad():
            got = call("1.6", model, ids, positions, hint=hint)
            expected = _reference_logits(model, ids, positions, activations)
        expect_shape("1.6", "the logits", got, (batch, seq, config.vocab_size))
        if got.dtype != torch.float32:
            fail("1.6", f"the logits are {got.dtype}: they must leave the model in fp32 (convert the "
                        "normed stream to float32 before the output head), whatever `activations` is")
        _check_layer_calls(log, config, positions, activations, "with positions given")
        _check_head(model, got, seq, seq, f"{activations} activations")
        if not close(got, expected, atol=atol):
            with torch.no_grad():
                unnormed = _reference_logits(model, ids, positions, activations, final_norm=False)
            if close(got, unnormed, atol=atol):
                fail("1.6", "the final norm is missing: apply self.norm to the stream before the output head")
            error = (got - expected).abs().max().item()
            fail("1.6", f"({activations} activations) the logits differ from embed → layers → norm → "
                        f"lm_head by up to {error:.3g}")
        _check_logits_at(model, ids, positions, expected, activations, atol, hint, log)
        log.clear()
        with torch.no_grad():
            call("1.6", model, ids, hint=hint)
        model.lm_head.inputs, model.norm.lengths = [], []
        _check_layer_calls(log, config, torch.arange(seq).expand(batch, seq), activations, "with no positions")
    _check_model_passes_mask_and_cache(model_cls, config, g, hint)


def _check_logits_at(model, ids, positions, expected, activations, atol, hint, log) -> None:
    """logits_at as a generation step passes it (the slice -1:) and as an engine step does (a
    tensor of positions, in any order, or one position): the logits of those positions, the norm
    and the head run on them only, the metadata handed to every layer."""
    batch, seq = ids.shape
    vocab = expected.shape[-1]
    metadata = _metadata_type(model.forward)
    for at, name in ((slice(-1, None), "the slice -1: (the last position)"),
                     (torch.tensor([4, 1]), "the positions tensor([4, 1])"), (torch.tensor([0]), "tensor([0])")):
        case = f"{activations} activations, logits_at={name}"
        sent = metadata(logits_at=at)
        log.clear()
        try:
            with torch.no_grad():
                got = model(ids, positions, sent)
        except Exception as exc:  # the learner's code may raise anything: named below, or by call()
            if isinstance(exc, RuntimeError) and "ambiguous" in str(exc):
                fail("1.6", f"({case}) the model asked a tensor of positions for its truth value: test "
                            "`attn.logits_at is not None` — positions have no truth value, and tensor([0]) "
                            "would read as false")
            got = call("1.6", model, ids, positions, sent, hint=hint)
        _check_handed_on(log, sent, case)
        kept = expected[:, at]
        if isinstance(got, torch.Tensor) and got.shape[1:] == (seq, vocab) and got.shape[0] != batch:
            fail("1.6", f"({case}) logits_at indexed the batch axis (logits of shape {tuple(got.shape)}): it "
                        "picks positions of the sequence axis, the same in every row")
        if isinstance(got, torch.Tensor) and tuple(got.shape) == (batch, seq, vocab):
            fail("1.6", f"({case}) logits_at was ignored: index the stream's sequence axis with it before "
                        "the norm and the head")
        if isinstance(at, torch.Tensor) and isinstance(got, torch.Tensor) and close(got, expected[:, -1:], atol=atol):
            fail("1.6", f"({case}) the model kept the last position whatever logits_at said: index the "
                        "stream with logits_at itself (stage 06 asks for one position per request)")
        expect_shape("1.6", f"the logits with logits_at={name}", got, tuple(kept.shape))
        _check_head(model, got, kept.shape[1], seq, case)
        if not close(got, kept, atol=atol):
            if isinstance(at, slice) and close(got, expected[:, :1], atol=atol):
                fail("1.6", f"({case}) the first position was kept: the next token is predicted by the last one")
            fail("1.6", f"({case}) the logits differ from those positions' logits")


def _check_handed_on(log: list[dict], sent, case: str) -> None:
    """Every layer received the very metadata the model was given."""
    for entry in log:
        if entry["attn"] is not None and entry["attn"] is sent.mask or entry["attn"] is None:
            fail("1.6", f"({case}) the layers received attn.mask instead of the metadata: hand them attn "
                        "itself, which also carries the cache, where to write it and more")
        if entry["attn"] is not sent:
            fail("1.6", f"({case}) layer {entry['layer']} did not receive the metadata (attn) the model was "
                        "given: hand it to every layer as it is (stages 03–07 put masks, caches and batches in it)")


def _check_layer_calls(log: list[dict], config: SimpleNamespace, positions: torch.Tensor,
                       activations: torch.dtype, case: str) -> None:
    order = [entry["layer"] for entry in log]
    if order != list(range(config.num_layers)):
        fail("1.6", f"({case}) the layers ran in the order {order}: every one of the "
                    f"{config.num_layers} layers runs once, in order, each on the stream the one "
                    "before returned")
    first = log[0]
    if first["dtype"] != activations:
        fail("1.6", f"({case}) the layers received a {first['dtype']} stream, but the model's "
                    f"activations are {activations}: convert the embeddings to self.activations")
    cos, sin = _rope_tables(positions, config.head_dim, config.rope_theta)
    got_cos, got_sin = first["cos"], first["sin"]
    if not isinstance(got_cos, torch.Tensor) or got_cos.shape != cos.shape:
        shape = tuple(got_cos.shape) if isinstance(got_cos, torch.Tensor) else type(got_cos).__name__
        if case == "with no positions" and isinstance(got_cos, torch.Tensor) and got_cos.shape[0] == 1:
            fail("1.6", f"({case}) the layers received cos of shape {shape}, expected {tuple(cos.shape)}: "
                        "the default positions must be (B, S), 0 … S−1 in every one of the B rows, like "
                        "positions given by a caller")
        fail("1.6", f"({case}) the layers received cos of shape {shape}, expected {tuple(cos.shape)}: "
                    "build the tables with rope_cos_sin(positions, head_dim, rope_theta)")
    if not (close(got_cos, cos, atol=1e-2) and close(got_sin, sin, atol=1e-2)):
        default = _rope_tables(torch.arange(positions.shape[1]).expand_as(positions), config.head_dim,
                               config.rope_theta)
        if close(got_cos, default[0], atol=1e-2) and not close(cos, default[0], atol=1e-2):
            fail("1.6", f"({case}) the RoPE tables are those of positions 0 … S−1, not of the "
                        "positions given: use the positions argument whenever it is given")
        for theta in (10000.0, 100000.0, 500000.0):  # bases of well-known checkpoints
            other = _rope_tables(positions, config.head_dim, theta)
            if close(got_cos, other[0], atol=1e-2) and close(got_sin, other[1], atol=1e-2):
                fail("1.6", f"({case}) the RoPE tables use the base {theta:g}, but this model's "
                            f"config.rope_theta is {config.rope_theta:g}: read the base from the config, "
                            "every checkpoint chooses its own")
        fail("1.6", f"({case}) the layers' cos and sin are not rope_cos_sin(positions, head_dim, "
                    "rope_theta) of the positions")
    if first["cos"].dtype != activations:
        fail("1.6", f"({case}) cos and sin reached the layers as {first['cos'].dtype}: convert them to "
                    "the stream's dtype")


def _check_model_passes_mask_and_cache(model_cls, config: SimpleNamespace, g: torch.Generator, hint: str) -> None:
    model, log = _model_with_reference_parts(model_cls, config, torch.float32, g)
    seq = 3
    ids = torch.randint(0, config.vocab_size, (1, seq), generator=g)
    mask = torch.ones(1, 1, seq, seq, dtype=torch.bool).tril()
    for sent in _metadata_variants(_metadata_type(model.forward), mask):
        contents = _contents(sent)
        log.clear()
        with torch.no_grad():
            call("1.6", model, ids, torch.arange(seq)[None] + 4, sent, hint=hint)
        _check_handed_on(log, sent, "with a mask or a cache")
        if _contents(sent) != contents:
            fail("1.6", "the model changed the metadata it was given: hand it on untouched")



# --- 1.7 greedy step --------------------------------------------------------------------------


def check_greedy_step(greedy_step) -> None:
    vocab = 10
    g = _generator()
    logits = torch.randn(BATCH, SEQ, vocab, generator=g)
    # Make the best token at the last position differ from every other position's best.
    logits[0, -1, 7], logits[1, -1, 2] = 10.0, 10.0
    logits[:, :-1, 7], logits[:, :-1, 2] = -10.0, -10.0
    got = call("1.7", greedy_step, logits,
               hint="logits are (B, S, vocab); return one token id per sequence, shape (B,)")
    if isinstance(got, torch.Tensor) and got.is_floating_point():
        fail("1.7", "you returned scores (floats), not token ids: use argmax, not max")
    if isinstance(got, torch.Tensor) and tuple(got.shape) == (BATCH, vocab):
        fail("1.7", f"expected shape ({BATCH},) but got {tuple(got.shape)}: you took the argmax "
                    "over the sequence axis; take it over the vocabulary axis (dim=-1)")
    expect_shape("1.7", "the next token ids", got, (BATCH,))
    expected = torch.tensor([7, 2])
    if torch.equal(got, expected):
        passed("1.7", "the next token is the argmax of the last position's logits")
        return
    if torch.equal(got, logits[:, 0].argmax(-1)):
        fail("1.7", "you used the first position's logits: the next token is predicted by the "
                    "last position, logits[:, -1]")
    if torch.equal(got, logits[:, -1].argmin(-1)):
        fail("1.7", "you picked the lowest-scoring token (argmin): greedy takes the argmax")
    fail("1.7", f"expected token ids {expected.tolist()}, got {got.tolist()}")


# --- 1.8 streaming detokenizer ----------------------------------------------------------------

# Chinese characters are 3 UTF-8 bytes and these emoji 4 (👍🏽 is two code points): byte-level
# BPE splits some of them across tokens, which is what the detokenizer must survive.
STREAM_TEXTS = (
    "Hello, world! The year 2024 had 366 days.",
    "中文测试：你好，世界。",
    "emoji 🤗🤗 and 👍🏽, café naïve",
)


def check_streaming_detokenizer(detokenizer_cls, tokenizer) -> None:
    split_characters = 0
    for text in STREAM_TEXTS:
        ids = tokenizer.encode(text)
        detok = detokenizer_cls(tokenizer)
        pieces = [call("1.8", detok.push, i) for i in ids]
        pieces.append(call("1.8", detok.flush))
        for i, piece in enumerate(pieces[:-1]):
            if not isinstance(piece, str):
                fail("1.8", f"push() returned {type(piece).__name__}, expected str")
            if "\ufffd" in piece:
                fail("1.8", f"token {i} of {text!r} produced U+FFFD (�): a character split across "
                            "tokens was decoded before its last byte arrived. Keep incomplete "
                            "bytes until the character is complete")
        streamed = "".join(pieces)
        if streamed != text:
            if len(streamed) > len(text) and streamed.startswith(text[:1]):
                fail("1.8", f"the stream repeats text ({streamed[:40]!r}...): push() must return "
                            "only the new text, not everything decoded so far")
            fail("1.8", f"streamed text {streamed!r} differs from the original {text!r}")
        split_characters += sum(
            1 for i in ids if not _is_complete_utf8(tokenizer.token_bytes(i))
        )
    if split_characters == 0:
        raise RuntimeError("the tokenizer given to check_streaming_detokenizer split no character "
                           "across tokens, so the check would prove nothing: it needs a byte-level "
                           "BPE tokenizer (SmolLM2's)")
    _check_bytes_that_never_complete(detokenizer_cls, tokenizer)
    passed("1.8", f"streamed text is exact, no U+FFFD ({split_characters} tokens held partial "
                  "characters); a byte that never completes shows as U+FFFD and the text after it "
                  "still comes, and flush() ends an unfinished character")


def _byte_token(tokenizer, byte: int) -> int:
    """The id of the token that stands for one raw byte (byte-level BPE has one for each)."""
    token = tokenizer.token_id(chr(byte))  # bytes 0xA1–0xFF (but 0xAD) are drawn as themselves
    if token is None or tokenizer.token_bytes(token) != bytes([byte]):
        raise RuntimeError(f"the tokenizer has no token for the single byte {byte:#x}: the check "
                           "needs a byte-level BPE tokenizer (SmolLM2's)")
    return token


def _reference_stream(tokenizer, ids: list[int]) -> str:
    """What an incremental UTF-8 decoder that shows bad bytes as U+FFFD makes of ``ids``."""
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
    return "".join(utf8.decode(tokenizer.token_bytes(i)) for i in ids) + utf8.decode(b"", final=True)


def _check_bytes_that_never_complete(detokenizer_cls, tokenizer) -> None:
    """A model can generate bytes that never form a character: a lead byte followed by text, or
    half a character when the answer ends. The text must neither stall nor silently drop them."""
    after = tokenizer.encode(" Hello, world")
    cases = (
        ("a lone byte 0xF0 (the start of a 4-byte character) followed by ' Hello, world'",
         [_byte_token(tokenizer, 0xF0), *after],
         "a byte that can never complete a character shows as U+FFFD (as tokenizer.decode shows it) "
         "and the text after it must keep coming, not wait forever behind it"),
        ("'ok' and then the first 2 of the 3 bytes of '中', then flush()",
         [*tokenizer.encode("ok"), _byte_token(tokenizer, 0xE4), _byte_token(tokenizer, 0xB8)],
         "at the end of the stream flush() must return an unfinished character as U+FFFD, not "
         "drop it (the answer was cut there)"),
    )
    for case, ids, rule in cases:
        detok = detokenizer_cls(tokenizer)
        pieces = [call("1.8", detok.push, i) for i in ids] + [call("1.8", detok.flush)]
        if not all(isinstance(piece, str) for piece in pieces):
            fail("1.8", f"({case}) push() and flush() must return str, got "
                        f"{sorted({type(p).__name__ for p in pieces})}")
        streamed, expected = "".join(pieces), _reference_stream(tokenizer, ids)
        if streamed != expected:
            fail("1.8", f"({case}) the stream gave {streamed!r}, expected {expected!r}: {rule}")


def _is_complete_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


# --- 1.9 repetition penalty -------------------------------------------------------------------


def _penalized(logits: torch.Tensor, history: list[int], penalty: float) -> torch.Tensor:
    """The rule written token by token: each distinct token in ``history`` once."""
    out = logits.clone()
    for token in set(history):
        value = out[token].item()
        out[token] = value / penalty if value > 0 else value * penalty
    return out


def check_repetition_penalty(apply_repetition_penalty) -> None:
    g = _generator()
    vocab, penalty = 30, 1.5
    logits = torch.randn(vocab, generator=g) * 3
    # Seen tokens of both signs, once and several times: 4 (+, ×3), 9 (−, ×2), 17 (+), 21 (−).
    logits[4], logits[9], logits[17], logits[21] = 2.0, -2.0, 3.0, -1.5
    history = [4, 9, 4, 4, 17, 9, 0, 21]
    original = logits.clone()
    hint = "apply_repetition_penalty(logits (vocab,), history (n,) ids, penalty) returns new logits"
    got = call("1.9", apply_repetition_penalty, logits, torch.tensor(history), penalty, hint=hint)
    expect_shape("1.9", "the penalized logits", got, (vocab,))
    if got.dtype != logits.dtype:
        fail("1.9", f"float32 logits came back as {got.dtype}: keep the logits' dtype (the sampler "
                    "after the penalty expects the model's fp32 logits)")
    if not torch.equal(logits, original):
        fail("1.9", "you changed the caller's logits in place: return a new tensor (scatter, "
                    "not scatter_, or clone first)")
    expected = _penalized(logits, history, penalty)
    if not close(got, expected):
        _explain_repetition_penalty(got.float(), logits, history, penalty)
    empty = call("1.9", apply_repetition_penalty, logits, torch.tensor([], dtype=torch.long), penalty, hint=hint)
    if not torch.equal(empty, logits):
        fail("1.9", "with an empty history nothing may change")
    passed("1.9", "tokens seen before move down once each: positive logits ÷ penalty, negative × penalty")


def _explain_repetition_penalty(got, logits, history, penalty) -> None:
    """Fail with the mistake that explains ``got``, judged token by token."""
    seen = sorted(set(history))
    unseen = [t for t in range(len(logits)) if t not in seen]
    moved = [t for t in unseen if not close(got[t:t + 1], logits[t:t + 1])]
    if moved:
        if len(moved) == len(unseen):
            fail("1.9", "every token was penalized, not only those in history")
        fail("1.9", f"tokens {moved} are not in history but changed: penalize only history's tokens")
    if close(got, logits):
        fail("1.9", f"no logit changed: the tokens in history ({seen}) must be penalized")

    def matches(tokens, rule):
        return all(close(got[t:t + 1], rule(logits[t:t + 1])) for t in tokens)

    once = [t for t in seen if history.count(t) == 1]
    positive, negative = [t for t in once if logits[t] > 0], [t for t in once if logits[t] < 0]
    divided, multiplied = (lambda v: v / penalty), (lambda v: v * penalty)
    if matches(positive, divided) and matches(negative, multiplied):
        fail("1.9", "a token that occurs several times was penalized several times (or its "
                    "changes added up): each distinct token counts once")
    if matches(once, lambda v: v - penalty):
        fail("1.9", "you subtracted the penalty: it scales the logit. Divide a positive logit "
                    "by the penalty, multiply a negative one")
    if matches(positive, multiplied) and matches(negative, divided):
        fail("1.9", "the rule is backwards: divide a positive logit by the penalty and multiply "
                    "a negative one, so that both move down")
    if matches(negative, divided):
        fail("1.9", "negative logits were divided by the penalty, which makes them *more* likely: "
                    "multiply a negative logit by the penalty")
    if matches(positive, multiplied):
        fail("1.9", "positive logits were multiplied by the penalty, which makes them more likely: "
                    "divide a positive logit by the penalty")
    wrong = [t for t in seen if not close(got[t:t + 1], _penalized(logits, history, penalty)[t:t + 1])]
    fail("1.9", f"tokens {wrong} have the wrong value: a seen token's logit is divided by "
                f"{penalty} if positive and multiplied by {penalty} if negative, once")


# --- 1.10 top-k and top-p ----------------------------------------------------------------------


def _kept(row: torch.Tensor, top_k: int, top_p: float, p_before_k: bool = False,
          p_includes_self: bool = False) -> set[int]:
    """The token ids one row keeps, by the rules written as plain loops over a ranking."""
    ranking = sorted(range(len(row)), key=lambda i: -row[i].item())

    def by_k(ids):
        if top_k <= 0 or top_k >= len(row):
            return set(ids)
        kth = row[ranking[top_k - 1]].item()
        return {i for i in ids if row[i].item() >= kth}

    def by_p(ids):
        if top_p >= 1:
            return set(ids)
        ids = [i for i in ranking if i in ids]
        weights = torch.softmax(row[ids].double(), dim=0).tolist()
        kept, above = set(), 0.0
        for i, w in zip(ids, weights):
            if (above + w if p_includes_self else above) < top_p or not kept:
                kept.add(i)
            above += w
        return kept

    everything = set(range(len(row)))
    return by_k(by_p(everything)) if p_before_k else by_p(by_k(everything))


def _kept_with_batch_kth(logits: torch.Tensor, row: int, top_k: int, top_p: float) -> set[int]:
    """The mistake of finding the k-th best over the whole (B, vocab) batch, not per row."""
    kth = logits.flatten().topk(min(top_k, logits.numel())).values[-1]
    masked = logits[row].masked_fill(logits[row] < kth, float("-inf"))
    finite = torch.isfinite(masked).nonzero().flatten().tolist()
    if not finite:
        return set()
    return _kept(masked, 0, top_p) & set(finite)


def _kept_in_token_order(row: torch.Tensor, ids: set[int], top_p: float) -> set[int]:
    """The mistake of a cumulative sum over token ids, not over the ranking."""
    ordered = sorted(ids)
    weights = torch.softmax(row[ordered].double(), dim=0).tolist()
    kept, above = set(), 0.0
    for i, w in zip(ordered, weights):
        if above < top_p:
            kept.add(i)
        above += w
    return kept


TOP_K_TOP_P_CASES = ((0, 1.0), (5, 1.0), (0, 0.6), (5, 0.6), (1, 1.0), (0, 0.02), (50, 1.0), (40, 0.9),
                     (7, 0.95))


def check_top_k_top_p(filter_top_k_top_p) -> None:
    g = _generator()
    batch, vocab = 3, 40
    logits = torch.randn(batch, vocab, generator=g) * 2
    logits[2, :6] = torch.tensor([5.0, 5.0, 4.0, 4.0, 4.0, 3.0])  # ties at the k-th best
    for top_k, top_p in TOP_K_TOP_P_CASES:
        original = logits.clone()
        case = f"top_k={top_k}, top_p={top_p}"
        hint = (f"filter_top_k_top_p(logits (B, vocab), top_k, top_p) returns logits of the same "
                f"shape; this call had {case}. top_k=0 means no top-k limit, top_p=1 no top-p "
                "limit, a top_k of at least the vocabulary size keeps all, and the k-th best of "
                "each row must stay a (B, 1) column so that it compares with its own row")
        got = call("1.10", filter_top_k_top_p, logits, top_k, top_p, hint=hint)
        expect_shape("1.10", f"the filtered logits ({case})", got, logits.shape)
        if not torch.equal(logits, original):
            fail("1.10", "you changed the caller's logits in place: use masked_fill, not masked_fill_")
        removed = ~torch.isfinite(got)
        if (got[~removed] != logits[~removed]).any() or (got[removed] != float("-inf")).any():
            if ((got == 0) & (logits != 0)).any():
                fail("1.10", f"({case}) removed tokens must get -inf, not 0: a logit of 0 still "
                            "has probability after the softmax")
            fail("1.10", f"({case}) kept tokens must keep their logits unchanged and removed ones "
                        "must be -inf: return logits, not probabilities")
        for row in range(batch):
            kept = set(torch.isfinite(got[row]).nonzero().flatten().tolist())
            expected = _kept(logits[row], top_k, top_p)
            if kept == expected:
                continue
            if top_k > 0 and kept == _kept_with_batch_kth(logits, row, top_k, top_p):
                fail("1.10", f"({case}) the k-th best was taken over the whole batch: find it per "
                            "row, along the vocabulary axis")
            if not kept:
                fail("1.10", f"({case}) row {row} kept no token at all: the best token always stays")
            if top_p < 1 and kept == _kept(logits[row], top_k, top_p, p_includes_self=True):
                fail("1.10", f"({case}) top-p dropped the token that crosses p: keep a token while "
                            "the tokens ranked *above* it hold less than p (exclusive cumulative sum)")
            if top_p < 1 and top_k > 0 and kept == _kept(logits[row], top_k, top_p, p_before_k=True):
                fail("1.10", f"({case}) top-p must use the softmax of the top-k-filtered logits "
                            "(renormalised over the tokens top-k kept), not the full distribution; "
                            "and top-k comes first")
            if top_k > 0 and top_p >= 1 and len(kept) in (top_k - 1, top_k + 1) and len(expected) == top_k:
                fail("1.10", f"({case}) kept {len(kept)} tokens instead of {top_k}: an off-by-one at "
                            "the k-th best")
            if top_k > 0 and len(kept) == top_k and len(expected) > top_k:
                fail("1.10", f"({case}) tokens tied with the k-th best were dropped: keep every token "
                            "whose logit is >= the k-th best (compare values, not ranks)")
            if top_p < 1 and kept == _kept(logits[row], top_k, 1.0):
                fail("1.10", f"({case}) top_p was ignored: when top_p < 1, drop the tokens whose "
                            "better-ranked tokens already hold top_p of the probability")
            if top_k > 0 and kept == _kept(logits[row], 0, top_p):
                fail("1.10", f"({case}) top_k was ignored: when top_k > 0, drop every token below "
                            "the k-th best")
            by_k = _kept(logits[row], top_k, 1.0)
            if top_p < 1 and kept == set(range(len(expected))) & by_k:
                fail("1.10", f"({case}) the top-p mask is still in sorted order: scatter it back to "
                            "token order, by the indices the sort returned, before masking")
            if top_p < 1 and kept == _kept_in_token_order(logits[row], by_k, top_p):
                fail("1.10", f"({case}) the probabilities were summed in token-id order: sort them "
                            "from the most likely down before the cumulative sum")
            fail("1.10", f"({case}) row {row} kept tokens {sorted(kept)}, expected {sorted(expected)}")
    _check_top_p_on_a_vocabulary_row(filter_top_k_top_p, g)
    passed("1.10", f"top-k (ties kept) then top-p keep exactly the right tokens in {len(TOP_K_TOP_P_CASES)} "
                  "cases and on vocabulary-sized rows")


def _top_p_kept_float64(row: torch.Tensor, top_p: float) -> torch.Tensor:
    """Which tokens of one row top-p keeps, computed in float64 (the exact rule)."""
    ranked, order = row.double().sort(descending=True)
    probs = ranked.softmax(-1)
    keep = (probs.cumsum(-1) - probs) < top_p
    keep[0] = True
    return torch.zeros_like(keep).scatter(0, order, keep)


def _check_top_p_on_a_vocabulary_row(filter_top_k_top_p, g: torch.Generator) -> None:
    """Rows as wide as SmolLM2's vocabulary, where a float32 running sum drifts by ~1e-5."""
    wide = torch.randn(2, 49152, generator=g) * 4
    for top_p in (0.99, 0.999):
        got = call("1.10", filter_top_k_top_p, wide, 0, top_p)
        for row in range(2):
            kept, expected = torch.isfinite(got[row]), _top_p_kept_float64(wide[row], top_p)
            if torch.equal(kept, expected):
                continue
            if not (kept & ~expected).any():
                fail("1.10", f"(top_k=0, top_p={top_p}, 49152 tokens) top-p dropped "
                            f"{int((expected & ~kept).sum())} tokens right at the boundary: sum the "
                            "probabilities in float64 (softmax(dim=-1, dtype=torch.float64)), a float32 "
                            "running sum over this many tokens drifts")
            fail("1.10", f"(top_k=0, top_p={top_p}, 49152 tokens) kept {int(kept.sum())} tokens, "
                        f"expected {int(expected.sum())}")


# --- 1.11 the stop rules ----------------------------------------------------------------------


class _ReferenceDetokenizer:
    """Exercise 1.8 written here, so that a mistake there cannot fail the stop rules' check."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._utf8.decode(self.tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


def _request(max_new_tokens: int, stop: tuple[str, ...] = ()) -> SimpleNamespace:
    """What OutputStream reads from SamplingParams."""
    return SimpleNamespace(max_new_tokens=max_new_tokens, stop=stop, ignore_eos=False)


def _feed(stream_cls, tokenizer, ids: list[int], params, stop_ids: set[int]):
    """Push ``ids`` one at a time; return the stream, what each push returned and the streamed text."""
    streamed: list[str] = []
    stream = call("1.11", stream_cls, tokenizer, [1, 2], params, stop_ids, streamed.append)
    returned = []
    for token in ids:
        returned.append(call("1.11", stream.push, token,
                             hint="push(token_id) adds one token and returns whether the sequence is finished"))
        if not isinstance(returned[-1], bool):
            fail("1.11", f"push returned {returned[-1]!r} ({type(returned[-1]).__name__}): return True or "
                         "False, whether the sequence is finished — every loop tests it")
        if returned[-1]:
            break
    return stream, returned, "".join(streamed)


STOP_RULES_TEXT = "Paris 🤗 is the capital. END of story!"


def check_output_stream(stream_cls, tokenizer) -> None:
    with isolated(inspect.unwrap(stream_cls.__init__), StreamingDetokenizer=_ReferenceDetokenizer):
        _check_stop_rules(stream_cls, tokenizer)
    passed("1.11", "a stop token ends the answer unseen, a stop string is cut, max_new_tokens is exact, "
                   "the text streams as it comes and what was held back is released at the end")


def _check_stop_rules(stream_cls, tokenizer) -> None:
    ids = tokenizer.encode(STOP_RULES_TEXT)
    eos = next(i for i in range(tokenizer.vocab_size) if i not in ids)
    # 1. the whole text, then a stop token
    stream, returned, streamed = _feed(stream_cls, tokenizer, [*ids, eos, *ids[:2]], _request(100), {eos})
    result = stream.result
    if eos in result.token_ids:
        fail("1.11", "the stop token was kept in token_ids: it ends the answer but is not part of it")
    if len(returned) <= len(ids) or not returned[len(ids)]:
        early = next((i for i, r in enumerate(returned) if r), None)
        if early is not None and early < len(ids):
            fail("1.11", f"push returned True after {early + 1} of {len(ids)} ordinary tokens: only a "
                         "stop token, a stop string or max_new_tokens finishes the sequence")
        fail("1.11", "push did not return True for a stop token: the sequence ends there (reason 'eos')")
    if result.finish_reason != "eos" or not stream.finished:
        fail("1.11", f"after a stop token the finish reason is {result.finish_reason!r} and finished is "
                     f"{stream.finished}: finish with self._finish('eos')")
    if result.token_ids != ids:
        fail("1.11", f"token_ids are {result.token_ids[:8]}..., expected the {len(ids)} pushed tokens "
                     "before the stop token")
    if "\ufffd" in result.text:
        fail("1.11", "the text has U+FFFD (�): pass each token through self.detokenizer, which holds "
                     "back the bytes of an unfinished character, instead of decoding it on its own")
    if result.text != STOP_RULES_TEXT:
        fail("1.11", f"the text is {result.text!r}, expected {STOP_RULES_TEXT!r}: every kept token's "
                     "text goes through the detokenizer, then the stop strings, then self._emit")
    if streamed != result.text:
        fail("1.11", "the text streamed to on_text differs from result.text: emit text with "
                     "self._emit, which does both")
    # 2. a stop token while text is held back (the start of a possible stop string): released
    n = len(ids) - 2
    # A stop string that starts with the last character shown makes the stream hold it back.
    held_back = tokenizer.decode(ids[:n])[-1] + "\x00"
    stream, returned, streamed = _feed(stream_cls, tokenizer, [*ids[:n], eos], _request(100, stop=(held_back,)),
                                       {eos})
    if stream.result.finish_reason != "eos" or not returned[-1]:
        fail("1.11", f"a stop token after {n} tokens gave finish reason {stream.result.finish_reason!r}: "
                     "it ends the sequence with 'eos'")
    if stream.result.text != tokenizer.decode(ids[:n]) or streamed != stream.result.text:
        fail("1.11", f"at a stop token, text held back (the start of a possible stop string) was lost: "
                     f"the text is {stream.result.text[-12:]!r} at its end, expected "
                     f"{tokenizer.decode(ids[:n])[-12:]!r}. Finish with self._finish('eos'), which releases it")
    # 3. max_new_tokens: finished exactly at the n-th token, text held back released
    stream, returned, streamed = _feed(stream_cls, tokenizer, ids, _request(n, stop=(held_back,)), set())
    finished_at = next((i + 1 for i, r in enumerate(returned) if r), None)
    if finished_at != n:
        said = f"after {finished_at} tokens" if finished_at else "never"
        fail("1.11", f"with max_new_tokens={n} push returned True {said}: the sequence finishes when it "
                     f"holds exactly {n} tokens (an off-by-one?)")
    if stream.result.finish_reason != "length" or len(stream.result.token_ids) != n:
        fail("1.11", f"at max_new_tokens the finish reason is {stream.result.finish_reason!r} with "
                     f"{len(stream.result.token_ids)} tokens: expected 'length' with {n}")
    if stream.result.text != tokenizer.decode(ids[:n]) or streamed != stream.result.text:
        fail("1.11", "at max_new_tokens, text held back (the start of a possible stop string) was "
                     "lost: finish with self._finish('length'), which releases it")
    # 4. a stop string: cut, and it wins over max_new_tokens on the same token
    stop = "END"
    for budget in (100, None):
        text_so_far, completes = "", None
        for count, token in enumerate(ids, start=1):
            text_so_far = tokenizer.decode(ids[:count])
            if stop in text_so_far:
                completes = count
                break
        limit = completes if budget is None else budget
        stream, returned, streamed = _feed(stream_cls, tokenizer, ids, _request(limit, stop=(stop,)), set())
        result = stream.result
        expected_text = STOP_RULES_TEXT[:STOP_RULES_TEXT.index(stop)]
        if stop in result.text:
            fail("1.11", "the stop string appeared in the text: pass each token's text through "
                         "self.stops, which cuts it at the first stop string")
        if result.finish_reason == "length" and budget is None:
            fail("1.11", "a token that both completes a stop string and reaches max_new_tokens gave "
                         "'length': check the stop string first, it wins ('stop')")
        if len(returned) != completes or not returned[-1] or result.finish_reason != "stop":
            fail("1.11", f"the stop string {stop!r} is complete after token {completes}, but push "
                         f"returned True after {len(returned)} (reason {result.finish_reason!r}): "
                         "finish with 'stop' on that token")
        if result.text != expected_text or streamed != expected_text:
            fail("1.11", f"the text before the stop string should be {expected_text!r}, got "
                         f"{result.text!r} (streamed {streamed!r})")


# --- 1.12 the generate loop -------------------------------------------------------------------


class _ScriptedConfig(SimpleNamespace):
    """The stand-in model's config: reading its end-of-sequence ids is a mistake the check names."""

    @property
    def eos_token_ids(self):
        fail("1.12", "the loop read model.config.eos_token_ids to stop by itself: stopping (at the "
                     "end-of-sequence token, a stop string or max_new_tokens) is the output streams' "
                     "job, exercise 1.11. The step iterator yields max_new_tokens tokens, and collect "
                     "closes it as soon as every stream has finished")


class _ScriptedModel(nn.Module):
    """A stand-in model: the logits at position t are a fixed function of the tokens 0..t and of t,
    so any change in what the loop feeds it changes its predictions. It records every call."""

    def __init__(self, vocab_size: int = 23):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, 2)  # only its device is read
        self.config = _ScriptedConfig(vocab_size=vocab_size)
        self.calls: list[dict] = []

    def prediction(self, prefix: list[int], position: int) -> torch.Tensor:
        seed = position * 1_000_003
        for i, token in enumerate(prefix):
            seed = (seed * 31 + token * 7919 + i) % (2**61 - 1)
        return torch.randn(self.config.vocab_size, generator=torch.Generator().manual_seed(seed)) * 3

    def forward(self, input_ids, positions=None, attn=None) -> torch.Tensor:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[0] != 1:
            shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
            fail("1.12", f"the model was given ids of shape {shape}: it takes a batch, a (1, S) tensor")
        ids = input_ids[0].tolist()
        if positions is not None and (not isinstance(positions, torch.Tensor)
                                      or tuple(positions.shape) != (1, len(ids))):
            shape = tuple(positions.shape) if isinstance(positions, torch.Tensor) else type(positions).__name__
            fail("1.12", f"the model was given positions of shape {shape} for ids of shape (1, {len(ids)}): "
                         "positions are shaped like the ids, (1, S), one row per sequence")
        given = None if positions is None else positions.reshape(-1).tolist()
        self.calls.append({"ids": ids, "positions": given, "cache": getattr(attn, "cache", None)})
        where = given if given is not None and len(given) == len(ids) else list(range(len(ids)))
        logits = torch.stack([self.prediction(ids[:t + 1], where[t]) for t in range(len(ids))])[None]
        at = getattr(attn, "logits_at", None)
        return logits if at is None else logits[:, at]


class _SamplerSpy:
    """Stands for sample_next while the check runs: it records what the loop passed and picks
    greedily or by a plain draw from the softmax."""

    def __init__(self):
        self.calls: list[dict] = []

    def __call__(self, logits, params, generators, histories):
        if not all(isinstance(a, (list, tuple)) for a in (params, generators, histories)):
            fail("1.12", "sample_next takes one entry per sequence, in lists: sample_next(logits, "
                         "[params], generators, [history])")
        self.calls.append({"last": logits[0, -1].detach().clone(), "generator": generators[0],
                           "history": list(histories[0])})
        return [_pick(logits[0, -1], params[0], generators[0])]


def _pick(last: torch.Tensor, params, generator: torch.Generator) -> int:
    if params.temperature == 0:
        return int(last.argmax())
    return int(torch.multinomial((last / params.temperature).softmax(-1), 1, generator=generator))


def _loop(model, prompt: list[int], params) -> list[int]:
    """The skeleton loop, written out: what the learner's step iterator must yield."""
    device = model.embed_tokens.weight.device
    generator = torch.Generator(device=device).manual_seed(params.seed if params.seed is not None else 0)
    ids = list(prompt)
    for _ in range(params.max_new_tokens):
        if isinstance(model, _ScriptedModel):
            last = model.prediction(ids, len(ids) - 1)
        else:
            with torch.inference_mode():
                positions = torch.arange(len(ids), device=device)[None]
                last = model(torch.tensor([ids], device=device), positions)[0, -1]
        ids.append(_pick(last, params, generator))
    return ids[len(prompt):]


def _steps_params(max_new_tokens: int, temperature: float = 0.0, seed: int | None = 11) -> SimpleNamespace:
    """A request with every field SamplingParams has, so the loop may read any of them."""
    return SimpleNamespace(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, top_k=0,
                           top_p=1.0, repetition_penalty=1.0, stop=(), ignore_eos=False,
                           greedy=temperature == 0, plain_greedy=temperature == 0)


def check_skeleton_steps(steps_fn, model=None) -> None:
    spy = _SamplerSpy()
    with isolated(inspect.unwrap(steps_fn), sample_next=spy):
        prompt = [3, 7, 1, 12, 5]
        for params in (_steps_params(6), _steps_params(5, temperature=1.0, seed=5), _steps_params(0)):
            _check_steps_on(steps_fn, _ScriptedModel(), prompt, params, spy)
        real = "" if model is None else _compare_on_the_real_model(steps_fn, model, prompt)
    passed("1.12", "the whole sequence goes through the model at every step, the last position's "
                   "prediction is sampled, exactly max_new_tokens new tokens are yielded" + real)


def _compare_on_the_real_model(steps_fn, model, prompt: list[int]) -> str:
    """The loop's greedy tokens on ``model`` against the reference loop's on the same model; the
    model may hold the learner's exercises 1.1–1.6, so a model that fails is skipped, not blamed
    on the loop (the stand-in model above has already proven the loop's wiring)."""
    params = _steps_params(6)
    try:
        expected = _loop(model, prompt, params)
    except Exception as exc:  # a stub's NotImplementedError too: that exercise's own check says so
        return (f" (real-model comparison skipped: the model raised {type(exc).__name__}, see "
                "exercises 1.1–1.6)")
    got = _run_steps(steps_fn, model, prompt, params)
    if got != expected:
        fail("1.12", f"on the real model the greedy tokens are {got}, expected {expected}")
    return " (and the real model's greedy tokens match)"


def _run_steps(steps_fn, model, prompt: list[int], params) -> list[int]:
    """Every token the iterator yields, up to a few past max_new_tokens (a loop that never ends
    must not hang the check)."""
    steps = call("1.12", steps_fn, model, list(prompt), params,
                 hint="skeleton_steps(model, prompt_ids, params) is a generator: it yields, not returns")
    if not inspect.isgenerator(steps) and not hasattr(steps, "__next__"):
        fail("1.12", f"skeleton_steps returned {type(steps).__name__}: it must yield each step's tokens "
                     "(a generator), so that collect can stop it as soon as the answer is finished")
    yielded, named = call("1.12", _drain, steps, params.max_new_tokens + 3)
    if named is not None:
        raise named
    tokens = []
    for item in yielded:
        if not isinstance(item, list) or len(item) != 1 or not isinstance(item[0], int):
            fail("1.12", f"a step yielded {item!r} ({type(item).__name__}): yield a list with one int "
                         "token id per sequence, e.g. [42] — collect matches each step's list with the "
                         "output streams")
        tokens.append(item[0])
    return tokens


def _drain(steps, limit: int) -> tuple[list | None, CheckFailed | None]:
    """Up to ``limit`` items of ``steps``; a mistake the stand-in model named while the learner's
    loop ran comes back as it is, not as a crash of the learner's code."""
    try:
        return list(islice(steps, limit)), None
    except CheckFailed as exc:
        return None, exc


def _check_steps_on(steps_fn, model: _ScriptedModel, prompt: list[int], params, spy: _SamplerSpy) -> None:
    spy.calls.clear()
    n = params.max_new_tokens
    case = f"max_new_tokens={n}" + (f", temperature {params.temperature}" if params.temperature else "")
    got = _run_steps(steps_fn, model, prompt, params)
    expected = _loop(model, prompt, params)
    if n and got[:len(prompt)] == prompt:
        fail("1.12", f"({case}) the first tokens yielded are the prompt: yield only the new tokens")
    if len(got) != n:
        more = " (or it never stops)" if len(got) == n + 3 else ""
        fail("1.12", f"({case}) yielded {len(got)} tokens{more}, expected exactly {n}: one per step, "
                     "max_new_tokens steps (an off-by-one?)")
    if n and not spy.calls:
        fail("1.12", f"({case}) sample_next was never called: pick each token with sample_next(logits, "
                     "[params], generators, [history]), which applies the request's sampling parameters")
    if len(model.calls) != n:
        fail("1.12", f"({case}) the model ran {len(model.calls)} times for {n} tokens: one forward pass "
                     "per new token")
    for step, call_ in enumerate(model.calls):
        sequence = prompt + got[:step]
        if call_["ids"] != sequence:
            if len(call_["ids"]) == 1 and step > 0:
                fail("1.12", f"({case}) at step {step} the model saw only the newest token: without a "
                             "KV cache (stage 04) it has no memory, so feed it the whole sequence")
            if call_["ids"] == prompt:
                fail("1.12", f"({case}) the model saw only the prompt at step {step}: add each new "
                             "token to the sequence before the next step")
            fail("1.12", f"({case}) at step {step} the model saw {call_['ids']}, expected the whole "
                         f"sequence so far {sequence}")
        if call_["positions"] is None:
            fail("1.12", f"({case}) the model was called without positions: pass them explicitly, "
                         "(1, S) with 0 … S−1 — every loop of the course says where its tokens are")
        if call_["positions"] != list(range(len(sequence))):
            fail("1.12", f"({case}) the positions given at step {step} were {call_['positions']}, "
                         f"expected 0 … {len(sequence) - 1}")
    for step, sampled in enumerate(spy.calls):
        sequence = prompt + got[:step]
        if not torch.equal(sampled["last"], model.prediction(sequence, len(sequence) - 1)):
            first = model.prediction(sequence[:1], 0)
            which = "the first position's" if torch.equal(sampled["last"], first) else "other"
            fail("1.12", f"({case}) sample_next was given {which} logits at step {step}: the next token "
                         "is predicted by the last position; pass the model's logits (B, S, vocab)")
        if sampled["history"] != sequence:
            fail("1.12", f"({case}) the history passed at step {step} was {sampled['history']}, expected "
                         f"the whole sequence so far {sequence} (the repetition penalty needs it)")
        if sampled["generator"] is not spy.calls[0]["generator"]:
            fail("1.12", f"({case}) a different random generator at step {step}: draw every step from "
                         "the same generators, or a seeded request restarts its random stream each step")
    if got != expected:
        fail("1.12", f"({case}) yielded {got}, expected {expected}")
