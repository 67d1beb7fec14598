# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Stage 08 — Quantization
#
# Stage 04 measured what limits decoding one token at a time: not arithmetic but bytes. Every
# step reads every weight once, so the fewer bytes a weight takes, the faster a step can be —
# and the more of the machine's memory is left for the KV cache. bf16 already halved the fp32
# bytes. This stage goes further: **8 bits** per weight, then **4**.
#
# ```
#  fp32   w = 0.01834 …            4 bytes
#  int8   w ≈ scale_row × q        1 byte  (q an integer in −127 … 127, one scale per output row)
#  int4   w ≈ scale_group × q + zero_group   ½ byte  (q in −8 … 7; a scale and a zero per group)
# ```
#
# An integer and a scale cannot hold every fp32 value: each weight moves to the nearest point
# of a grid. The question of this stage is what that costs the model, measured on real text.

# %%
# Stages you committed with `aie commit` are imported below; this checks them first.
from aie_lessons.course.progress import verify_committed_stages

verify_committed_stages(before="08")

# %%
import matplotlib.pyplot as plt
import torch
from tqdm.auto import tqdm

from aie_lessons import checks
from aie_lessons.infra.compile_cache import use_compile_cache
from aie_lessons.infra.paths import DATA_DIR, default_model_dir
from aie_lessons.model import LAST_POSITION, AttentionMetadata, LlamaModel
from aie_lessons.precision import agreement
from aie_lessons.tokenizer import Tokenizer

use_compile_cache()  # what torch.compile builds is kept in data/cache/inductor, a folder per instruction set
torch.manual_seed(0)
MODEL_DIR = default_model_dir()
model = LlamaModel.from_pretrained(MODEL_DIR)
tokenizer = Tokenizer.from_pretrained(MODEL_DIR)

# %% [markdown]
# ## 1. Where the bytes are
#
# Almost all of the model's bytes are the matrices of its linear layers and the embedding table
# (which, tied, is also the output head). The norms' weights are a rounding error:

# %%
linear_bytes = sum(m.weight.nbytes for name, m in model.named_modules()
                   if isinstance(m, torch.nn.Linear) and name != "lm_head")
embedding_bytes = model.embed_tokens.weight.nbytes
other_bytes = sum(p.nbytes for p in model.parameters()) - linear_bytes - embedding_bytes
print(f"linear layers (7 per block × {model.config.num_layers}): {linear_bytes / 2**20:6.1f} MiB")
print(f"embedding table = tied output head:      {embedding_bytes / 2**20:6.1f} MiB")
print(f"everything else (norms):                 {other_bytes / 2**20:6.1f} MiB")

# %% [markdown]
# ## 2. int8, one scale per output row
#
# Take one row of a weight matrix: the weights that make one output. Its largest magnitude
# `absmax` is mapped to 127 and everything else scaled alike, then rounded to the nearest
# integer:
#
# ```
#  scale = absmax(row) / 127        q = round(w / scale)  ∈ −127 … 127        w ≈ q × scale
# ```
#
# The scheme is *symmetric* (zero stays exactly zero) and *per output channel*: one scale per
# row, because an output `y_i = Σ_j w_ij x_j` is then `scale_i × Σ_j q_ij x_j` — the scale
# leaves the sum, and a kernel multiplies integers and scales once per output. Rounding to the
# nearest point errs by at most half a step, `scale / 2`; truncating towards zero errs by up to a
# whole step, always towards zero. A row of zeros has `absmax = 0`: its scale must not be zero,
# or `w / scale` is `0 / 0`.

# %%
# export: quantize
"""Weight-only quantization: int8 per output row, int4 per group, and layers that use them.

A weight is stored as small integers and a float scale per row (int8) or per group of a row
(int4); the layer turns them back into floats to multiply. Fewer bytes per weight is what a
memory-bound decode step needs; the price is a rounding error that stage 08 measures on text.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from aie_lessons.model import Linear, LlamaModel

INT8_MAX = 127
INT4_MIN, INT4_MAX = -8, 7


# %% [markdown]
# ### Exercise 8.1 — quantize a matrix to int8
#
# `quantize_int8(weight)` takes an `(out_features, in_features)` matrix in any float dtype and
# returns `(q, scale)`: `q` int8 of the same shape, `scale` float32 of shape `(out_features,)`.
# `dequantize_int8(q, scale)`, given below it, turns them back into the float32 matrix `q × scale`.

# %%
# export: quantize
def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: int8 ``q`` and one float32 scale per output row, ``weight ≈ q × scale``."""
    # BEGIN EXERCISE 8.1: one float32 scale per row (the row's largest magnitude / 127, never zero) and q = the weight divided by its row's scale, rounded to the nearest integer, as int8
    # Hint 1: Each row gets its own step size, chosen so that its largest weight lands exactly on ±127; every weight then moves to the nearest multiple of that step, and a row of zeros must still get a usable step.
    # Hint 2: Take the absolute maximum over the last dimension (the inputs), divide by 127, replace zeros by 1, divide the weight by that scale kept as a column, round (not truncate) and convert to int8.
    w = weight.float()
    scale = w.abs().amax(dim=1) / INT8_MAX
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)  # an all-zero row: any scale works
    q = torch.round(w / scale[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale
    # END EXERCISE 8.1


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 matrix ``q × scale``, each row by its own scale."""
    return q.float() * scale[:, None]


# %%
# Check exercise 8.1
checks.stage08.check_quantize_int8(quantize_int8, dequantize_int8)

# %% [markdown]
# What did it cost? For one projection of the first block, the error of each weight against
# half its row's step — the bound that rounding to nearest promises:

# %%
w = model.layers[0].mlp.down_proj.weight.detach()
q, scale = quantize_int8(w)
error = (dequantize_int8(q, scale) - w).abs()
print(f"down_proj of block 0: {tuple(w.shape)}, {w.nbytes / 2**20:.2f} MiB fp32 → "
      f"{(q.nbytes + scale.nbytes) / 2**20:.2f} MiB int8 with its scales")
print("every error ≤ half its row's step:", bool((error <= scale[:, None] / 2 + 1e-7).all()))
print(f"mean error / mean |w|: {error.mean() / w.abs().mean():.2%}")

# %% [markdown]
# ## 3. int4: two weights per byte, one scale per group
#
# With only 16 levels, one scale for a whole row of 576 or 1536 weights (the printed widths
# below) is too coarse: one large weight would stretch the step for all the others. So int4
# gives every **group** of consecutive weights of a row its own scale — 32, 64 or 192 here (the
# common 128 does not divide this model's 576). Each group of 32 weights (16 bytes) also carries
# its scale and the zero point below, two float32 (8 bytes): the price of fine groups.
#
# With 16 levels, every level counts. A grid symmetric around zero spans `−absmax … absmax`,
# but a group's weights reach that far on one side only: on the other, levels go unused. So int4
# maps each group's own range, `min … max`, onto the 16 levels (*asymmetric* quantization), and
# keeps a zero point beside the scale (the table after exercise 8.4 compares the two):
#
# ```
#  scale = (max − min) / 15       q = round((w − min) / scale) − 8  ∈ −8 … 7
#  zero  = min + 8 × scale        w ≈ q × scale + zero
# ```
#
# (`q + 8` is the level, 0 … 15, counted from the group's minimum. Storing it as `q` in −8 … 7
# gives symmetric and asymmetric int4 one signed format, and one packing below; `zero` absorbs
# the shift. Here `zero` is a float, the weight that `q = 0` stands for; libraries such as
# PyTorch's quantized tensors keep an integer zero point `z` instead, with `w = scale × (q − z)`:
# the same grid, written the other way round.) A group whose
# weights are all equal has `max − min = 0`: its scale must not be zero either.
#
# No tensor type holds 4 bits, so two weights share one `uint8`. A byte holds 0 … 255 and a
# nibble 0 … 15, so each `q` is stored with an offset of 8 (`q + 8` ∈ 0 … 15): the weight in
# an even column takes the low four bits, the one in the next (odd) column the high four.
#
# ```
#  q:      [ −3,   5,  7, −8 ]   →  q + 8:  [ 5, 13, 15, 0 ]
#  bytes:  [ 5 | 13 << 4,  15 | 0 << 4 ] = [ 213, 15 ]
# ```
#
# ### Exercise 8.2 — pack two nibbles per byte
#
# `pack_int4(q)` takes an int8 `(rows, columns)` tensor of values in −8 … 7 (an even number of
# columns) and returns the `(rows, columns / 2)` uint8 tensor above.

# %%
# export: quantize
def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 values in −8 … 7 → uint8, two per byte: the even column low, the odd column high."""
    if q.shape[-1] % 2:
        raise ValueError(f"pack_int4 needs an even number of columns, got {q.shape[-1]}")
    # BEGIN EXERCISE 8.2: shift every value by +8 into 0 … 15, then put each even column in the low four bits and the following odd column in the high four bits of one uint8
    # Hint 1: Two nibbles make a byte: one value becomes the byte's low half, the next its high half, and both must first be non-negative, which the offset of 8 does.
    # Hint 2: Add 8 and convert to uint8; take the even columns with [..., 0::2] and the odd ones with [..., 1::2]; the byte is the even value OR the odd value shifted left by four bits.
    u = (q.to(torch.int16) - INT4_MIN).to(torch.uint8)
    return u[..., 0::2] | (u[..., 1::2] << 4)
    # END EXERCISE 8.2


# %%
# Check exercise 8.2
checks.stage08.check_pack_int4(pack_int4)

# %% [markdown]
# ### Exercise 8.3 — unpack them
#
# `unpack_int4(packed)` is the inverse: uint8 `(rows, n)` to the int8 `(rows, 2n)` values in
# −8 … 7, in their original order.

# %%
# export: quantize
def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 (rows, n) → int8 (rows, 2n) in −8 … 7: the inverse of ``pack_int4``."""
    # BEGIN EXERCISE 8.3: split each byte into its low and high four bits, put them back as the even and odd columns, and remove the offset of 8, as int8
    # Hint 1: Undo the packing step by step: separate the two halves of each byte, interleave them again in column order, then shift the values back down.
    # Hint 2: The low nibble is packed & 15 and the high one packed >> 4; stack them on a new last dimension and flatten the last two dimensions to interleave, then convert to int8 and subtract 8.
    low, high = packed & 15, packed >> 4
    return torch.stack([low, high], dim=-1).flatten(-2).to(torch.int8) + INT4_MIN
    # END EXERCISE 8.3


# %%
# Check exercise 8.3
checks.stage08.check_unpack_int4(unpack_int4)

# %% [markdown]
# ### Exercise 8.4 — group-wise int4
#
# `quantize_int4(weight, group_size)` returns `(packed, scales, zeros)`: the `(out, in / 2)`
# uint8 tensor of exercise 8.2, and float32 scales and zeros of shape `(out, in / group_size)`,
# one each per group of `group_size` consecutive weights of a row. Use your `pack_int4`.
# `dequantize_int4`, given below it, turns them back into floats.

# %%
# export: quantize
def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(packed, scales, zeros)``: two weights per byte; per group of a row, ``w ≈ q × scale + zero``."""
    rows, columns = weight.shape
    if columns % group_size:
        raise ValueError(f"{columns} columns do not split into groups of {group_size}: "
                         "choose a group size that divides the layer's input width")
    groups = weight.float().reshape(rows, columns // group_size, group_size)
    # BEGIN EXERCISE 8.4: map each group's range min … max onto 16 levels as in the formulas above; return pack_int4 of the (rows, columns) int8 q, and the (rows, groups) float32 scales and zeros
    # Hint 1: Each group gets its own 16-level ruler that starts at its smallest weight and ends at its largest; every weight moves to the nearest mark, counted from the start and shifted down by 8 so that it fits exercise 8.2's packing.
    # Hint 2: Take amin and amax over the last dimension of groups, make the step (max − min) / 15 with zeros replaced by 1, subtract the minimum (kept as a trailing dimension) before dividing and rounding, subtract 8, clamp, reshape to (rows, columns) as int8 for pack_int4, and compute the zero point from the minimum and the step.
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scales = (high - low) / 15
    scales = torch.where(scales == 0, torch.ones_like(scales), scales)
    levels = torch.round((groups - low[..., None]) / scales[..., None])
    q = (levels + INT4_MIN).clamp(INT4_MIN, INT4_MAX).to(torch.int8)
    return pack_int4(q.reshape(rows, columns)), scales, low - INT4_MIN * scales
    # END EXERCISE 8.4


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    group_size: int) -> torch.Tensor:
    """The float32 matrix: each unpacked value times its group's scale, plus its group's zero."""
    q = unpack_int4(packed).float()
    rows, columns = q.shape
    grouped = q.reshape(rows, columns // group_size, group_size)
    return (grouped * scales[..., None] + zeros[..., None]).reshape(rows, columns)


# %%
# Check exercise 8.4
checks.stage08.check_quantize_int4(quantize_int4, dequantize_int4)

# %% [markdown]
# The same projection in int4, for three group sizes that divide every width of the model:
# smaller groups cost more scale bytes and err less.

# %%
widths = sorted({m.in_features for m in model.modules() if isinstance(m, torch.nn.Linear)})
print("input widths of the linear layers:", widths,
      "| 128 divides them all:", all(width % 128 == 0 for width in widths))
for group_size in (192, 64, 32):
    packed, scales, zeros = quantize_int4(w, group_size)
    error = (dequantize_int4(packed, scales, zeros, group_size) - w).abs()
    groups = w.reshape(w.shape[0], -1, group_size)  # the symmetric grid, for comparison
    step = groups.abs().amax(-1, keepdim=True) / 7
    symmetric = ((groups / step).round().clamp(-8, 7) * step - groups).abs()
    print(f"int4, groups of {group_size:>3}: {(packed.nbytes + scales.nbytes + zeros.nbytes) / 2**20:.3f} MiB, "
          f"mean error / mean |w| {error.mean() / w.abs().mean():.2%} (symmetric grid: "
          f"{symmetric.mean() / w.abs().mean():.2%}), largest error {error.max():.1e}")

# %% [markdown]
# Groups of 32 reproduce the weights *exactly*. That is not what int4 does in general: it is a
# fact about these weights. The course's model comes from a GGUF file whose name says
# `Q4_1` — llama.cpp's format with this arithmetic (groups of 32 weights, a scale and a minimum
# each; it stores them as fp16 and pairs weight j with weight j + 16 in a byte, where we pair
# neighbours). The "fp32" model of every stage so far was that 4-bit model turned back into
# floats: each weight is `minimum + level × scale`, with the minimum and the top level (15)
# present in every group. So each group's min and max give back its minimum and scale, and
# every weight lands on a level again, bit for bit. Groups of 64 or 192 do not line up with it, and int8's one scale per
# row (section 2) does not either — they pay the usual rounding price.

# %%
import json

source = json.loads((MODEL_DIR / "aie-source.json").read_text())
print("the model's weights came from:", source["file"])
projections = [m.weight.detach() for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not model.lm_head]
exact = sum(torch.equal(dequantize_int4(*quantize_int4(p, 32), 32), p) for p in projections)
print(f"block projections reproduced exactly by int4 in groups of 32: {exact} of {len(projections)}")

# %% [markdown]
# ## 4. Quantized layers in the model
#
# A `QuantizedLinear` keeps the integers and the scales as buffers and replaces an `nn.Linear`
# of the model. Its plain path multiplies by the integers turned back into floats — exact to the
# scheme, but it reads fewer bytes of weights only to make a float copy of them at every call.
# It makes that copy 1024 output rows at a time, each block multiplied while it is still in the
# CPU's cache (like stage 04's `Linear`), so the copy of a large matrix never goes out to memory.
# For int8 it takes the shortcut of section 2: the row's scale leaves the sum, so the layer
# multiplies by the integers as floats and scales the outputs, `y = (x · qᵀ) × scale`, and never
# builds the scaled matrix. int4's scales change along a row, every 32–192 inputs, so they cannot
# leave the sum: its plain path rebuilds the float weight.
#
# PyTorch also has CPU kernels that multiply by the integers directly, with bf16 inputs:
# `_weight_int8pack_mm` and `_weight_int4pack_mm_for_cpu` (the latter wants the weights in its
# own tiled layout, made once, and groups of 32, 64, 128 or 256: not 192). They are matrix–vector kernels, fast for a few rows at a time —
# section 6 measures where they stop paying — and they keep the scales in bf16, so they
# differ from the plain path in the last bits. The layer takes them when they apply: bf16
# inputs, on the CPU, at most `KERNEL_MAX_ROWS` rows.
#
# `quantize_model` swaps every linear layer of the blocks; the output head, which is the
# embedding table when the two are tied, stays in fp32 unless asked for, because every logit
# goes through it. `overrides` gives some layers another scheme (section 8 uses it).

# %%
# export: quantize
@dataclass(frozen=True)
class QuantScheme:
    """How weights are stored: ``bits`` 8 (one scale per row) or 4 (one per ``group_size``)."""

    name: str
    bits: int
    group_size: int | None = None

    def __post_init__(self) -> None:
        if self.bits == 8 and self.group_size is not None:
            raise ValueError(f"{self.name}: int8 has one scale per row, so no group_size (got {self.group_size})")
        if self.bits == 4 and not (isinstance(self.group_size, int) and self.group_size > 0):
            raise ValueError(f"{self.name}: int4 needs a positive group_size, got {self.group_size!r}")
        if self.bits not in (4, 8):
            raise ValueError(f"{self.name}: bits must be 8 or 4, got {self.bits}")


SCHEMES = {s.name: s for s in (QuantScheme("int8", 8), QuantScheme("int4-g192", 4, 192),
                               QuantScheme("int4-g64", 4, 64), QuantScheme("int4-g32", 4, 32))}


def scheme_named(scheme: QuantScheme | str) -> QuantScheme:
    """A scheme, or its name: an unknown name lists the ones there are."""
    if isinstance(scheme, QuantScheme):
        return scheme
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}: choose one of {', '.join(SCHEMES)}")
    return SCHEMES[scheme]


# Up to this many rows (tokens of a step), the CPU integer kernels beat rebuilding the weight;
# section 6 of stage 08 charts the crossover on the learner's machine.
KERNEL_MAX_ROWS = 16
INT4_KERNEL_GROUP_SIZES = (32, 64, 128, 256)  # the only ones _weight_int4pack_mm_for_cpu takes


def kernel_fits(scheme: QuantScheme, out_features: int) -> bool:
    """Whether PyTorch's CPU kernel takes a layer of this scheme and width: int8 always; int4
    in groups of 32, 64, 128 or 256, with a multiple of 16 outputs (its tiles)."""
    return scheme.bits == 8 or (scheme.group_size in INT4_KERNEL_GROUP_SIZES and out_features % 16 == 0)


@torch.no_grad()
def kernel_layout(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                  scheme: QuantScheme) -> tuple[torch.Tensor, torch.Tensor]:
    """A quantized weight (``QuantizedLinear``'s ``q``, ``scale``, ``zero``) as PyTorch's CPU
    kernels read it. int8: the integers as they are and bf16 scales. int4: levels 0 … 15 in the
    kernel's own tiles, and (groups, out, 2) pairs of scale and zero — our zero, ``min + 8 ×
    scale``, is the one its ``q × scale + zero`` over levels shifted by 8 wants."""
    if scheme.bits == 8:
        return q, scale.to(torch.bfloat16)
    levels = unpack_int4(q).to(torch.int32) - INT4_MIN
    tiled = torch.ops.aten._convert_weight_to_int4pack_for_cpu(levels, 1)
    pairs = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()
    return tiled, pairs.to(torch.bfloat16)


def kernel_matmul(flat: torch.Tensor, weights: torch.Tensor, scales: torch.Tensor,
                  scheme: QuantScheme) -> torch.Tensor:
    """bf16 rows (rows, in) times a weight in the layout of ``QuantizedLinear.kernel_weights``
    -> bf16 (rows, out), through PyTorch's CPU kernel for the scheme."""
    if scheme.bits == 8:
        return torch.ops.aten._weight_int8pack_mm(flat, weights, scales)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(flat, weights, scheme.group_size, scales)


class QuantizedLinear(nn.Module):
    """A linear layer (no bias) whose weight is held as integers, scales and (int4) zeros."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, scheme: QuantScheme,
                 kernels: bool = True) -> None:
        super().__init__()
        rows, stored = q.shape
        columns = stored * 2 if scheme.bits == 4 else stored  # int4: two per byte
        groups = 1 if scheme.bits == 8 else columns // scheme.group_size
        want = {"q": (torch.int8 if scheme.bits == 8 else torch.uint8, (rows, stored)),
                "scale": (torch.float32, (rows,) if scheme.bits == 8 else (rows, groups)),
                "zero": (torch.float32, (0,) if scheme.bits == 8 else (rows, groups))}
        for name, tensor in (("q", q), ("scale", scale), ("zero", zero)):
            dtype, shape = want[name]
            if tensor.dtype != dtype or tuple(tensor.shape) != shape:
                raise ValueError(f"{scheme.name}: {name} should be {dtype} of shape {shape}, got {tensor.dtype} "
                                 f"of shape {tuple(tensor.shape)}. Fix: make the layer with "
                                 "QuantizedLinear.quantize(weight, scheme)")
        self.scheme = scheme
        self.out_features, self.in_features = rows, columns
        self.register_buffer("q", q)
        self.register_buffer("scale", scale)
        self.register_buffer("zero", zero)  # int8 is symmetric: an empty zero, the same buffers
        self.kernels = kernels and kernel_fits(scheme, rows)
        self._kernel_weights: tuple[torch.Tensor, torch.Tensor] | None = None  # made on first use

    @classmethod
    def quantize(cls, weight: torch.Tensor, scheme: QuantScheme, kernels: bool = True) -> "QuantizedLinear":
        """The layer holding ``weight`` (out, in) quantized with ``scheme``."""
        if scheme.bits == 8:
            q, scale = quantize_int8(weight)
            return cls(q, scale, scale.new_zeros(0), scheme, kernels)
        return cls(*quantize_int4(weight, scheme.group_size), scheme, kernels)

    def _apply(self, fn, recurse: bool = True):
        self._kernel_weights = None  # .to() and friends change the buffers: make the layout again
        return super()._apply(fn, recurse)

    def _load_from_state_dict(self, *args, **kwargs) -> None:
        self._kernel_weights = None  # new integers and scales: make the layout again
        super()._load_from_state_dict(*args, **kwargs)

    def dequantized(self, rows: slice = slice(None)) -> torch.Tensor:
        """The float32 weight (or some of its output ``rows``): what the integers stand for."""
        if self.scheme.bits == 8:
            return dequantize_int8(self.q[rows], self.scale[rows])
        return dequantize_int4(self.q[rows], self.scale[rows], self.zero[rows], self.scheme.group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if (self.kernels and x.dtype == torch.bfloat16 and x.device.type == "cpu"
                and flat.shape[0] <= KERNEL_MAX_ROWS):
            out = self._kernel_forward(flat.contiguous())
        else:
            out = self._plain_forward(flat)
        return out.reshape(*x.shape[:-1], self.out_features)

    def _plain_forward(self, flat: torch.Tensor) -> torch.Tensor:
        """Rebuild the weight a block of output rows at a time (as many as stage 04's ``Linear``
        converts at once) and multiply each block while it is still in the CPU's cache:
        rebuilding the 49152-row head whole would write (and read back) a 113 MB float copy per
        call. int8 scales the outputs instead of the weight: the row's scale leaves the sum."""
        out = torch.empty(flat.shape[0], self.out_features, dtype=flat.dtype, device=flat.device)
        for start in range(0, self.out_features, Linear.UPCAST_ROWS):
            rows = slice(start, start + Linear.UPCAST_ROWS)
            if self.scheme.bits == 8:
                out[:, rows] = F.linear(flat, self.q[rows].to(flat.dtype)) * self.scale[rows].to(flat.dtype)
            else:
                out[:, rows] = F.linear(flat, self.dequantized(rows).to(flat.dtype))
        return out

    def _kernel_forward(self, flat: torch.Tensor) -> torch.Tensor:
        """PyTorch's CPU kernels: the integers are multiplied as they are, scales in bf16."""
        return kernel_matmul(flat, *self.kernel_weights(), self.scheme)

    def kernel_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The weights and scales as ``kernel_matmul`` reads them (``kernel_layout``): made on
        first use, then kept."""
        if self._kernel_weights is None:
            self._kernel_weights = kernel_layout(self.q, self.scale, self.zero, self.scheme)
        return self._kernel_weights

    def extra_repr(self) -> str:
        return f"{self.in_features} → {self.out_features}, {self.scheme.name}"


def block_linear_names(model: LlamaModel) -> list[str]:
    """The names of the blocks' linear layers, e.g. ``layers.3.mlp.down_proj``: 7 per block."""
    return [name for name, module in model.layers.named_modules(prefix="layers")
            if isinstance(module, (nn.Linear, QuantizedLinear))]


def layer_schemes_for(names: list[str], scheme: QuantScheme,
                      overrides: Mapping[str, QuantScheme | str] | None = None) -> dict[str, QuantScheme]:
    """The scheme of each layer: ``scheme``, unless an override names the layer or a prefix of
    it (``layers.3``); the longest matching override wins, whatever the order they came in."""
    resolved = {prefix: scheme_named(s) for prefix, s in (overrides or {}).items()}
    for prefix in resolved:
        if not any(name == prefix or name.startswith(prefix + ".") for name in names):
            raise ValueError(f"override {prefix!r} names no linear layer of the blocks "
                             f"(they are named like {names[0]!r} or 'layers.0')")
    chosen = {}
    for name in names:
        matching = [prefix for prefix in resolved if name == prefix or name.startswith(prefix + ".")]
        chosen[name] = resolved[max(matching, key=len)] if matching else scheme
    return chosen


def head_scheme(scheme: QuantScheme, head: bool | QuantScheme | str | None) -> QuantScheme | None:
    """The output head's scheme: none (False or None), the blocks' ``scheme`` (True) or one of
    its own. Its own, because the head is the largest single matrix (vocabulary × hidden) and
    the last: its rounding lands straight in the logits, which is why llama.cpp's 4-bit files
    keep it in 6 bits; int8 is the course's nearest."""
    if head is None or isinstance(head, bool):
        return scheme if head else None
    try:
        return scheme_named(head)
    except ValueError as exc:
        raise ValueError(f"head: {exc}. Fix: head=True (the blocks' scheme), False, or one of those") from None


def quantize_model(model: LlamaModel, scheme: QuantScheme | str, head: bool | QuantScheme | str | None = False,
                   overrides: Mapping[str, QuantScheme | str] | None = None,
                   kernels: bool = True) -> LlamaModel:
    """Replace the blocks' linear layers (and with ``head`` the output head: True for the blocks'
    scheme, or a scheme of its own) by quantized ones, in place. ``overrides`` maps layer names,
    or a prefix such as ``layers.3``, to another scheme. A tied head gets its own quantized copy;
    the embedding lookup keeps the table. Everything is checked before the first layer changes:
    an error leaves the model as it was."""
    scheme = scheme_named(scheme)
    plan = layer_schemes_for(block_linear_names(model), scheme, overrides)
    if (lm_head := head_scheme(scheme, head)) is not None:
        plan["lm_head"] = lm_head
    for name, layer_scheme in plan.items():
        layer = model.get_submodule(name)
        if not isinstance(layer, nn.Linear):
            raise ValueError(f"{name} is quantized already: quantize a model loaded afresh")
        if layer.bias is not None:
            raise ValueError(f"{name} has a bias: these quantized layers take none")
        if layer_scheme.bits == 4 and layer.in_features % layer_scheme.group_size:
            raise ValueError(f"{name}: {layer.in_features} inputs do not split into groups of "
                             f"{layer_scheme.group_size}. Fix: a group size that divides {layer.in_features}")
    for name, layer_scheme in plan.items():
        model.set_submodule(name, QuantizedLinear.quantize(model.get_submodule(name).weight.detach(),
                                                           layer_scheme, kernels))
    return model


def bytes_read_per_token(model: LlamaModel) -> int:
    """Bytes of weights one decode step reads: every parameter and buffer once, except the
    embedding table, of which a lookup reads one row — unless the table is also the (tied)
    output head, which reads it whole."""
    table = model.embed_tokens.weight
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers()) if t is not table}
    head_is_table = getattr(model.lm_head, "weight", None) is table
    return sum(t.nbytes for t in tensors.values()) + (table.nbytes if head_is_table else 0)


# %% [markdown]
# ## 5. What it costs, measured on real text
#
# The corpus is prose from the Python Language Reference as it ships with CPython
# (`pydoc_data/topics.py`; `data/prose/README.md` names the source and the licence). Each
# variant reads it in windows of 256 tokens, every position predicting the next real token
# (teacher forcing), and is compared with the fp32 model (the Q4_1 weights in floats, as in
# every stage) at every position:
#
# * **perplexity**: `exp(mean −log p(next token))` — how surprised the model is by the text;
# * **mean KL** to fp32's next-token distribution, and **top-1**: how often the best token is
#   fp32's (exercise 4.5's `agreement`, from your stage 04).
#
# A variant's window is scored right after the reference's, so only one window of logits is
# held at a time.

# %%
# export: text_quality
"""A model's quality on real text next to a reference model's: perplexity, KL and top-1."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from aie_lessons.model import LlamaModel
from aie_lessons.precision import agreement


@dataclass(frozen=True)
class TextQuality:
    """One model on one text, and how far its predictions are from the reference's."""

    positions: int
    perplexity: float
    mean_kl: float  # KL(reference ‖ model), nats per position
    top1: float  # fraction of positions whose best token is the reference's


@torch.inference_mode()
def text_quality(reference: LlamaModel, models: dict[str, LlamaModel], ids: list[int],
                 window: int = 256, progress: bool = True) -> dict[str, TextQuality]:
    """Score ``reference`` and each of ``models`` on ``ids`` cut into whole windows."""
    if len(ids) < window + 1:
        raise ValueError(f"{len(ids)} tokens do not fill one window of {window} (plus its next token): "
                         "use a longer text or a smaller window")
    if "reference" in models or any(m is reference for m in models.values()):
        raise ValueError("the models to compare must be other models than the reference, and none "
                         "may be named 'reference' (that is the reference's row)")
    starts = range(0, len(ids) - window, window)  # each window's targets are its ids shifted by one
    device = next(reference.parameters()).device
    everyone = {"reference": reference, **models}
    nll = {name: 0.0 for name in everyone}
    kl = {name: 0.0 for name in models}
    top1 = {name: 0.0 for name in models}
    for start in tqdm(starts, desc="windows", unit="window", disable=not progress, leave=False):
        inputs = torch.tensor([ids[start:start + window]], device=device)
        targets = torch.tensor(ids[start + 1:start + window + 1], device=device)
        reference_logits = reference(inputs)[0]
        for name, model in everyone.items():
            logits = reference_logits if model is reference else model(inputs)[0]
            nll[name] += torch.nn.functional.cross_entropy(logits.float(), targets, reduction="sum").item()
            if model is not reference:
                compared = agreement(reference_logits, logits)
                kl[name] += compared.mean_kl * window
                top1[name] += compared.top1 * window
    positions = len(starts) * window
    return {name: TextQuality(positions, math.exp(nll[name] / positions),
                              kl[name] / positions if name in models else 0.0,
                              top1[name] / positions if name in models else 1.0)
            for name in everyone}


@torch.inference_mode()
def perplexity(model: LlamaModel, ids: list[int], window: int = 256, progress: bool = True) -> float:
    """``model``'s perplexity on ``ids`` in whole windows: one model, no reference to compare."""
    return text_quality(model, {}, ids, window, progress)["reference"].perplexity


# %% [markdown]
# The variants: bf16 weights (stage 04), int8, int4 with three group sizes, and int8 with the
# output head quantized too. Each is a fresh copy of the model; 1,024 tokens here keep the cell
# short (the tests score the whole corpus).

# %%
# NBVAL_IGNORE_OUTPUT
# The package's quantize_model and text_quality: the reference code until `aie commit 08`
# puts yours there (the cells above defined yours in this notebook too).
from aie_lessons.quantize import bytes_read_per_token, quantize_model
from aie_lessons.text_quality import text_quality

corpus = (DATA_DIR / "prose" / "python_language_reference.txt").read_text()
corpus_ids = tokenizer.encode(corpus)
print(f"corpus: {len(corpus_ids):,} tokens; scored here: the first 1,024 + 1")
variants = {"bf16": LlamaModel.from_pretrained(MODEL_DIR, dtype=torch.bfloat16)}
for name, head in (("int8", False), ("int4-g192", False), ("int4-g64", False), ("int4-g32", False),
                   ("int8", True)):
    label = name + (" + head" if head else "")
    variants[label] = quantize_model(LlamaModel.from_pretrained(MODEL_DIR), name, head=head)
quality = text_quality(model, variants, corpus_ids[:1025])
sizes = {"reference": bytes_read_per_token(model), **{name: bytes_read_per_token(v) for name, v in variants.items()}}
print(f"{'':>14} {'MiB read':>8} {'perplexity':>11} {'vs fp32':>8} {'mean KL':>9} {'top-1':>7}")
for name, q in quality.items():
    label = "fp32" if name == "reference" else name
    print(f"{label:>14} {sizes[name] / 2**20:8.1f} {q.perplexity:11.3f} "
          f"{q.perplexity / quality['reference'].perplexity - 1:+8.2%} {q.mean_kl:9.1e} {q.top1:7.2%}")

# %%
# What the prose below rests on, with room for another CPU's rounding:
fp32_ppl = quality["reference"].perplexity
print("int8 within 1% of fp32's perplexity:", quality["int8"].perplexity / fp32_ppl - 1 < 0.01)
print("int4 in groups of 32 = the Q4_1 model (mean KL to fp32 below 1e-9):", quality["int4-g32"].mean_kl < 1e-9)
print("int4: larger groups cost more:",
      quality["int4-g32"].perplexity < quality["int4-g64"].perplexity < quality["int4-g192"].perplexity)

# %% [markdown]
# The same numbers as a picture: quality against the bytes of weights a decode step reads. In
# every int8 and int4 variant but the last, the output head is the fp32 embedding table, read
# whole (its MiB are in section 1): that is why they do not fall to a quarter and an eighth of
# fp32. (bf16's perplexity a hair below fp32's is noise, not a gain: its predictions differ
# from fp32's at a few positions, in both directions.)

# %%
fig, ax = plt.subplots(figsize=(6, 3.6))
for (name, q), marker in zip(quality.items(), "osD^vP*X"):
    label = "fp32" if name == "reference" else name
    ax.scatter(sizes[name] / 2**20, q.perplexity, s=40, marker=marker, label=label)
ax.legend(fontsize=8, ncol=2)
ax.set_xlabel("weights read per decode step (MiB)")
ax.set_ylabel("perplexity on the corpus (lower is better)")
ax.set_title("What each scheme keeps of the model, and what it costs")
ax.grid(alpha=0.3)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## 6. What it buys: time per decode step
#
# Fewer bytes only help if a layer reads the integers as they are. This section times the ways
# a layer can multiply by quantized weights, first on one matrix — block 0's `up_proj`, 1536 × 576 —
# with one row (one token, a batch-1 decode step) and 16 rows (a decode step of 16 requests):
#
# * the float baselines, fp32 and bf16 weights;
# * **dequantize, then multiply**: rebuild the float matrix, then an ordinary matmul;
# * the **plain path** of `QuantizedLinear` (section 4);
# * a **compiled dequantize-in-matmul**: the same Python, given to `torch.compile`, which may fuse
#   the rebuild into the multiplication;
# * PyTorch's **CPU kernels** for int8 and int4.
#
# Inputs are bf16 (the kernels need it) except for fp32 weights. The median of 30 calls, in µs.
# A matrix this small stays in the CPU's caches between calls, so these are times of the
# arithmetic and the rebuilding, not of memory; the whole model comes next.

# %%
# NBVAL_IGNORE_OUTPUT
import statistics
import time

import torch.nn.functional as F

from aie_lessons.quantize import KERNEL_MAX_ROWS, SCHEMES, QuantizedLinear


def median_seconds(call, repeats: int = 30) -> float:
    """The median time of ``call()`` after three warm-up calls: typical, not lucky."""
    with torch.inference_mode():
        for _ in range(3):
            call()
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            call()
            seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def dequantize_then_multiply(x: torch.Tensor, layer: QuantizedLinear) -> torch.Tensor:
    return F.linear(x, layer.dequantized().to(x.dtype))


up = model.layers[0].mlp.up_proj.weight.detach()
up_bf16 = up.bfloat16()
layers = {name: QuantizedLinear.quantize(up, SCHEMES[name]) for name in ("int8", "int4-g32")}
plain = {name: QuantizedLinear.quantize(up, SCHEMES[name], kernels=False) for name in layers}
compiled = torch.compile(dequantize_then_multiply, dynamic=False)
paths = {"fp32 weights (fp32 inputs)": lambda x: F.linear(x.float(), up),
         "bf16 weights": lambda x: F.linear(x, up_bf16)}
for name in layers:
    paths[f"{name}: dequantize, then multiply"] = lambda x, n=name: dequantize_then_multiply(x, plain[n])
    paths[f"{name}: plain path"] = lambda x, n=name: plain[n](x)
    paths[f"{name}: compiled dequantize-in-matmul"] = lambda x, n=name: compiled(x, plain[n])
    paths[f"{name}: CPU kernel"] = lambda x, n=name: layers[n](x)
matrix_us = {rows: {path: 1e6 * median_seconds(lambda: call(torch.randn(rows, up.shape[1]).bfloat16()))
                    for path, call in paths.items()} for rows in (1, 16)}
print(f"{'µs per call':<38} {'1 row':>8} {'16 rows':>8}")
for path in paths:
    print(f"{path:<38} {matrix_us[1][path]:8.0f} {matrix_us[16][path]:8.0f}")

# %% [markdown]
# At one row the kernels win: they read one byte (int8) or half a byte (int4) per weight and
# never make a float copy, while rebuilding the weight costs more than the multiplication it
# feeds. Giving the rebuild to `torch.compile` does not close that gap (the compiled rows): a
# compiler can only fuse what it has a fast loop for, and here the multiplication itself stays
# a library call that wants float weights.
#
# But the kernels are matrix–*vector* kernels: their time grows with every row, while a bf16
# matmul's barely moves at first on a CPU with bf16 instructions (AVX-512 BF16, AMX; without
# them, as on an AVX2-only CPU, it grows with every row too). Where do the lines cross? `QuantizedLinear` uses the kernels
# up to `KERNEL_MAX_ROWS` rows — the decode batches of stage 06's default engine (16 requests);
# longer steps, such as a prefill, take the plain path. The chart shows whether that suits your
# machine.

# %%
# NBVAL_IGNORE_OUTPUT
row_counts = [1, 2, 4, 8, 16, 32, 64]
crossover = {label: [1e6 * median_seconds(lambda: call(torch.randn(rows, up.shape[1]).bfloat16()), 10)
                     for rows in row_counts]
             for label, call in (("bf16 weights", paths["bf16 weights"]),
                                 ("int8 plain path", plain["int8"]), ("int8 CPU kernel", layers["int8"]),
                                 ("int4-g32 plain path", plain["int4-g32"]),
                                 ("int4-g32 CPU kernel", layers["int4-g32"]))}
fig, ax = plt.subplots(figsize=(6.5, 3.6))
for label, times in crossover.items():
    ax.plot(row_counts, times, marker="o", label=label, linestyle="--" if "kernel" in label else "-")
ax.axvline(KERNEL_MAX_ROWS, color="grey", linewidth=1)
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.annotate("KERNEL_MAX_ROWS", (KERNEL_MAX_ROWS, 0.03), xycoords=("data", "axes fraction"), xytext=(4, 0),
            textcoords="offset points", fontsize=8, color="grey")
ax.set_xlabel("rows (tokens in the step)")
ax.set_ylabel("µs per call, 1536 × 576")
ax.set_title("The integer kernels pay for a few rows at a time")
ax.legend(fontsize=8, loc="upper left")
ax.grid(alpha=0.3)
fig.tight_layout()
plt.show()
faster = [rows for rows, kernel, plain_us in zip(row_counts, crossover["int8 CPU kernel"],
                                                 crossover["int8 plain path"]) if kernel < plain_us]
print("rows at which the int8 kernel was faster than the plain path here:", faster)

# %% [markdown]
# Now the whole model, one decode step after a 64-token prompt, for one request and for 16. A
# step reads every weight once whatever the batch, so **GB/s** is the bytes of weights a step
# reads (`bytes_read_per_token`) over its time, and **tokens/s** is the batch over it. The
# roofline is the read bandwidth of stage 04's probe: the most any step could stream.
#
# The quantized variants compute the blocks in bf16, so that the kernels apply. The output head
# always computes in fp32 — logits leave the model in fp32, or close candidates would tie
# (stage 04) — and the kernels take only bf16: a quantized head reads a quarter of the bytes
# but takes the plain path.

# %%
# NBVAL_IGNORE_OUTPUT
from aie_lessons.kv_cache import KVCache
from aie_lessons.roofline import read_bandwidth

bf16 = torch.bfloat16
speed_variants = {
    "fp32": model,
    "bf16": LlamaModel.from_pretrained(MODEL_DIR, dtype=bf16, activations=bf16),
    "int8, plain path": quantize_model(LlamaModel.from_pretrained(MODEL_DIR, activations=bf16), "int8",
                                       kernels=False),
    "int8": quantize_model(LlamaModel.from_pretrained(MODEL_DIR, activations=bf16), "int8"),
    "int8 + head": quantize_model(LlamaModel.from_pretrained(MODEL_DIR, activations=bf16), "int8", head=True),
    "int4-g32": quantize_model(LlamaModel.from_pretrained(MODEL_DIR, activations=bf16), "int4-g32"),
    "int4-g32 + head": quantize_model(LlamaModel.from_pretrained(MODEL_DIR, activations=bf16), "int4-g32",
                                      head=True),
}
prompt = corpus_ids[:64]


def decode_step(variant: LlamaModel, batch: int, prefill: bool = True):
    """One decode step of ``batch`` requests after the same 64-token prompt, ready to call again
    (it rewrites the same cache column each time). Without ``prefill`` the cache holds zeros:
    attention over 65 positions costs the same whatever they hold, so timings need no prefill."""
    ids = torch.tensor([prompt + [prompt[0]]] * batch)
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    cache = KVCache(variant.config, batch, ids.shape[1], dtype=variant.activations)
    if prefill:
        with torch.inference_mode():
            variant(ids[:, :-1], positions[:, :-1], AttentionMetadata(cache=cache, cache_start=0, logits_at=LAST_POSITION))
    decode = AttentionMetadata(cache=cache, cache_start=len(prompt))
    return lambda: variant(ids[:, -1:], positions[:, -1:], decode)[:, -1]


def decode_step_seconds(variant: LlamaModel, batch: int) -> float:
    """The fastest of five decode steps (after a warm-up): the least disturbed by the machine."""
    step = decode_step(variant, batch, prefill=False)
    return min(median_seconds(step, 1) for _ in range(5))


bandwidth, _ = read_bandwidth()
step_seconds = {name: {batch: decode_step_seconds(v, batch) for batch in (1, 16)}
                for name, v in tqdm(speed_variants.items(), desc="variants")}
print(f"read roofline (stage 04's probe): {bandwidth / 1e9:.1f} GB/s")
print(f"{'':<24} {'MiB':>6} | {'batch 1: tok/s':>14} {'GB/s':>5} {'roofline':>8} | {'batch 16: tok/s':>15} {'GB/s':>5}")
for name, v in speed_variants.items():
    size, one, sixteen = bytes_read_per_token(v), step_seconds[name][1], step_seconds[name][16]
    print(f"{name:<24} {size / 2**20:6.1f} | {1 / one:14.1f} {size / one / 1e9:5.1f} "
          f"{size / one / bandwidth:8.0%} | {16 / sixteen:15.1f} {size / sixteen / 1e9:5.1f}")

# %% [markdown]
# Quality and speed side by side, for the schemes that have both: quality from section 5's table
# (fp32 arithmetic, the plain path), speed from the table above (bf16 arithmetic and the kernels,
# except fp32). The two ways of computing differ in the last bits — the kernels' cell at the end
# of this section shows how little.

# %%
# NBVAL_IGNORE_OUTPUT
print(f"{'':>9} {'MiB read':>8} {'perplexity':>11} {'vs fp32':>8} {'mean KL':>9} {'top-1':>7} "
      f"{'tok/s, 1':>9} {'tok/s, 16':>10}")
for name in ("fp32", "bf16", "int8", "int4-g32"):
    q = quality["reference" if name == "fp32" else name]
    print(f"{name:>9} {bytes_read_per_token(speed_variants[name]) / 2**20:8.1f} {q.perplexity:11.3f} "
          f"{q.perplexity / quality['reference'].perplexity - 1:+8.2%} {q.mean_kl:9.1e} {q.top1:7.2%} "
          f"{1 / step_seconds[name][1]:9.1f} {16 / step_seconds[name][16]:10.1f}")

# %% [markdown]
# The same tokens/s as a chart, with the roofline of each variant drawn: the tokens/s a step
# could reach if it did nothing but read its weights at the probe's speed. The axis is
# logarithmic, so the gap between a point and its roofline is a ratio.

# %%
fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=False)
names = list(speed_variants)
for ax, batch in zip(axes, (1, 16)):
    rates = [batch / step_seconds[name][batch] for name in names]
    ceilings = [batch * bandwidth / bytes_read_per_token(speed_variants[name]) for name in names]
    ax.scatter(range(len(names)), rates, marker="o", s=40, color="tab:blue", label="measured", zorder=3)
    ax.scatter(range(len(names)), ceilings, marker="_", s=400, color="tab:red", label="read roofline")
    ax.vlines(range(len(names)), rates, ceilings, color="tab:red", linewidth=0.5, alpha=0.5)
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("tokens/s (log scale)")
    ax.set_yscale("log")
    ax.set_title(f"decode, batch {batch}")
    ax.grid(alpha=0.3, axis="y")
axes[0].legend(fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# Read the table against the roofline.
#
# * At batch 1, `int8` against `int8, plain path` is the kernels' whole effect: the same bytes
#   and the same bf16 arithmetic, the integers read as they are or rebuilt as floats. `int4-g32`
#   reads fewer bytes still, through its own kernel.
# * bf16 weights read half of fp32's bytes, but whether that makes one row at a time faster
#   depends on the CPU (compare the two rows; stage 04 found it going both ways): a byte only
#   pays if the kernel that reads it runs at memory speed, and PyTorch's bf16 matrix–vector
#   product runs there only on some CPUs.
# * The quantized head reads far fewer bytes (the MiB column), but on the plain path it saves no
#   time.
# * Every variant stays far below its roofline, the quantized ones furthest: at one byte per
#   weight or less, the time goes to unpacking and scaling, not to reading memory.
# * At batch 16, one read of the weights serves 16 tokens, so tokens/s rises for every variant,
#   and the fastest is the one with the fastest matrix *multiplication*, not the fewest bytes —
#   compare the batch-16 column. Stage 09 draws this turn from memory-bound to compute-bound on
#   the roofline.
#
# The kernels round the scales and the inputs to bf16; here is how far that moves one decode
# step's logits from the plain path's:

# %%
# NBVAL_IGNORE_OUTPUT
def set_kernels(variant: LlamaModel, on: bool) -> None:
    for layer in variant.modules():
        if isinstance(layer, QuantizedLinear):
            layer.kernels = on


for name in ("int8 + head", "int4-g32 + head"):
    variant, step = speed_variants[name], decode_step(speed_variants[name], 1)
    with torch.inference_mode():
        with_kernels = step()[0]
        set_kernels(variant, False)
        plain_logits = step()[0]
        set_kernels(variant, True)
    print(f"{name}: largest logit difference, kernels vs plain path {(with_kernels - plain_logits).abs().max():.3f} "
          f"(logits span {plain_logits.max() - plain_logits.min():.0f}); same best token: "
          f"{with_kernels.argmax() == plain_logits.argmax()}")

# %% [markdown]
# ## 7. Which layers int4 hurts
#
# int4 in groups of 64 costs this model much of its perplexity (section 5's table). Is that
# loss spread evenly, or do a few layers carry it? The way to find out is an experiment per
# layer: quantize *only* that layer, measure, and put it back — and the same for each kind of
# projection (`q_proj` of every block, then `k_proj`, …).
#
# ```
#   baseline = score(model)
#   for each group of layers:   quantize just those  →  score  →  put the originals back
# ```
#
# Two things make or break such a loop. Each measurement must see *only* its group quantized:
# a layer not put back would be counted again in every later group. And the model must come
# out as it went in, even when a measurement fails halfway (an error, or you interrupting a
# long run): otherwise the next cell works on a half-quantized model without saying so.
#
# ### Exercise 8.5 — the sensitivity loop
#
# `sensitivity(model, groups, scheme, score)` takes a dict from a group's label to the names of
# its linear layers (as `model.get_submodule` takes them, e.g. `"layers.3.mlp.down_proj"`), a
# `QuantScheme`, and `score(model) -> float`. It returns, per label in the same order, how much
# the score changes when only that group is quantized: `score(with the group quantized) −
# score(model)`. Replace a layer with `QuantizedLinear.quantize(layer.weight.detach(), scheme)`
# and `model.set_submodule(name, ...)`; put back the very modules you took out. If `score`
# raises, the error must reach the caller — after the model is restored.

# %%
# export: sensitivity
"""Which layers quantization hurts: quantize one group at a time, score, restore."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from aie_lessons.model import LlamaModel
from aie_lessons.quantize import QuantizedLinear, QuantScheme, block_linear_names


def groups_by_layer(model: LlamaModel) -> dict[str, list[str]]:
    """``{"layer 0": [its 7 projections' names], …}``."""
    names = block_linear_names(model)
    return {f"layer {i}": [name for name in names if name.startswith(f"layers.{i}.")]
            for i in range(len(model.layers))}


def groups_by_kind(model: LlamaModel) -> dict[str, list[str]]:
    """``{"q_proj": [every block's q_proj], …}``, in the blocks' order of kinds."""
    groups: dict[str, list[str]] = {}
    for name in block_linear_names(model):
        groups.setdefault(name.rsplit(".", 1)[1], []).append(name)
    return groups


# %%
# export: sensitivity
def sensitivity(model: LlamaModel, groups: Mapping[str, Sequence[str]], scheme: QuantScheme,
                score: Callable[[LlamaModel], float]) -> dict[str, float]:
    """Per group: ``score`` with only that group's layers quantized, minus ``score(model)``.
    The model is left as it came, with the same modules, even if ``score`` raises."""
    baseline = score(model)
    changes: dict[str, float] = {}
    # BEGIN EXERCISE 8.5: for each group in order, swap its layers for quantized ones, record the change of the score against the baseline, and always put the original modules back
    # Hint 1: One experiment per group: change only that group, measure, undo. The undo must happen whatever the measurement does, so that no group sees another's layers and the model ends as it began.
    # Hint 2: Before swapping a group, remember its original modules by name; swap and score inside a try whose finally block puts every remembered module back, so that an error or an interrupt still restores them (and still reaches the caller).
    for label, names in groups.items():
        originals = {name: model.get_submodule(name) for name in names}
        try:
            for name, layer in originals.items():
                model.set_submodule(name, QuantizedLinear.quantize(layer.weight.detach(), scheme))
            changes[label] = score(model) - baseline
        finally:
            for name, layer in originals.items():
                model.set_submodule(name, layer)
    # END EXERCISE 8.5
    return changes


# %%
# Check exercise 8.5
checks.stage08.check_sensitivity(sensitivity)

# %% [markdown]
# The score: perplexity on the *last* 256 tokens of the corpus (two windows of 128) — short,
# because it runs once per group, and apart from the first 1,024 tokens on which section 8 judges the
# choice it leads to. Each group is quantized to int4 in groups of 64: groups of 32 would show
# nothing on this model, whose weights they reproduce exactly (section 3); 64 is what int4 costs
# a model that was not 4-bit to begin with.

# %%
# NBVAL_IGNORE_OUTPUT
from aie_lessons.quantize import block_linear_names
from aie_lessons.sensitivity import groups_by_kind, groups_by_layer
from aie_lessons.sensitivity import sensitivity as committed_sensitivity
from aie_lessons.text_quality import perplexity

score = lambda m: perplexity(m, corpus_ids[-257:], window=128, progress=False)
int4 = SCHEMES["int4-g64"]
by_layer = committed_sensitivity(model, groups_by_layer(model), int4, score)
by_kind = committed_sensitivity(model, groups_by_kind(model), int4, score)
print(f"fp32 perplexity on these 256 tokens: {score(model):.3f}")
top = sorted(by_layer.items(), key=lambda item: -item[1])[:4]
print("most sensitive blocks:", ", ".join(f"{label} (+{change:.2f})" for label, change in top))
print(f"the four of them: {sum(c for _, c in top):.2f} of the {sum(by_layer.values()):.2f} that the 30 blocks "
      f"add up to; blocks that seem to gain: {sum(c < 0 for c in by_layer.values())}")
print("by kind:", ", ".join(f"{label} +{change:.2f}" for label, change in by_kind.items()))
print("the model came back unquantized:",
      all(type(model.get_submodule(name)).__name__ == "Linear" for name in block_linear_names(model)))

# %%
fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.4), gridspec_kw={"width_ratios": [3, 1]})
left.bar(range(len(by_layer)), list(by_layer.values()), color="tab:blue")
left.set_xlabel("block (only its 7 projections in int4-g64)")
left.set_ylabel("perplexity change")
left.set_title("One block at a time")
right.bar(list(by_kind), list(by_kind.values()), color="tab:orange")
right.set_title("One kind of projection, in every block")
right.tick_params(axis="x", rotation=45)
for ax in (left, right):
    ax.grid(alpha=0.3, axis="y")
fig.tight_layout()
plt.show()

# %% [markdown]
# A block that seems to *gain* from int4 does not: on 256 tokens, small changes either way are
# noise — rounding moves a few predictions up or down. The large bars are not noise.
#
# ## 8. A mixed scheme
#
# The loss is not spread evenly: a few blocks and one or two kinds of projection carry much of
# it (the sums printed above). Keeping *those* in int8 should buy back a large part of int4's
# loss for a few MiB. What a group costs to keep in int8 depends on its size — `v_proj` is
# 192 × 576, `down_proj` 576 × 1536 — so the choice below ranks groups by perplexity recovered
# per extra MiB, goes down the ranking, and keeps each group that still fits in a budget of 10%
# of the int4 blocks' size.

# %%
# NBVAL_IGNORE_OUTPUT
def weight_bytes(names, scheme) -> int:
    """Bytes of these layers' weights in ``scheme``: the integers, and the scales and zeros."""
    total = 0
    for name in names:
        rows, columns = model.get_submodule(name).weight.shape
        if scheme.bits == 8:
            total += rows * columns + rows * 4  # a byte per weight, a float32 scale per row
        else:
            total += rows * columns // 2 + rows * (columns // scheme.group_size) * 8  # + scale, zero
    return total


groups = {**groups_by_layer(model), **groups_by_kind(model)}
changes = {**by_layer, **by_kind}
extra = lambda names: weight_bytes(names, SCHEMES["int8"]) - weight_bytes(names, int4)
budget = 0.10 * weight_bytes(block_linear_names(model), int4)
chosen: list[str] = []
for label in sorted(groups, key=lambda label: -changes[label] / extra(groups[label])):
    new = [name for name in groups[label] if name not in chosen]
    if new and changes[label] > 0 and extra(chosen + new) <= budget:
        chosen += new
        print(f"keep {label:>9} in int8: +{changes[label]:.2f} perplexity alone, "
              f"{extra(new) / 2**20:.2f} MiB more")
print(f"{len(chosen)} of {len(block_linear_names(model))} layers in int8, "
      f"{extra(chosen) / 2**20:.1f} MiB more than int4-g64 (budget {budget / 2**20:.1f} MiB)")

# %% [markdown]
# `quantize_model`'s `overrides` puts the chosen layers in int8 and everything else in
# int4-g64. Scored on the same 1,024 tokens as section 5's table:

# %%
# NBVAL_IGNORE_OUTPUT
mixed = quantize_model(LlamaModel.from_pretrained(MODEL_DIR), int4, overrides={name: "int8" for name in chosen})
mixed_quality = text_quality(model, {"mixed": mixed}, corpus_ids[:1025])["mixed"]
fp32_ppl, int4_ppl = quality["reference"].perplexity, quality["int4-g64"].perplexity
print(f"{'':>9} {'MiB read':>8} {'perplexity':>11} {'top-1':>7}")
for label, q, size in (("int4-g64", quality["int4-g64"], sizes["int4-g64"]),
                       ("mixed", mixed_quality, bytes_read_per_token(mixed)),
                       ("int8", quality["int8"], sizes["int8"])):
    print(f"{label:>9} {size / 2**20:8.1f} {q.perplexity:11.3f} {q.top1:7.2%}")
recovered = (int4_ppl - mixed_quality.perplexity) / (int4_ppl - fp32_ppl)
print(f"the mixed scheme recovers {recovered:.0%} of int4-g64's perplexity loss for "
      f"{(bytes_read_per_token(mixed) - sizes['int4-g64']) / 2**20:.1f} MiB more per token")

# %%
print("the mixed scheme is better than int4-g64 and no better than int8:",
      quality["int8"].perplexity <= mixed_quality.perplexity < int4_ppl)

# %% [markdown]
# ## 9. Quantize once: files, the engine and `aie generate`
#
# Quantizing takes seconds, and the result never changes for a given checkpoint and scheme, so
# the course keeps it: `save_quantized` writes the quantized layers' integers with their scales
# and zeros beside them to a safetensors file, with the scheme of every layer and a fingerprint
# of the checkpoint in the file's metadata; `load_quantized` puts them back into a model loaded
# from the checkpoint (whose other weights — embedding, norms — it keeps). `quantized_model`
# does both: it loads the file from the checkpoint's folder (`data/models/<name>/quantized/`)
# when it matches the checkpoint and the request, and otherwise quantizes and writes it. Nothing is parsed from file names: the
# scheme is an argument, and the file's metadata must agree with it. The file is always made
# from the fp32 weights, and its name changes with the checkpoint and with the code of
# `aie_lessons/quantize.py` (your `aie commit 08` replaces it), so a stale file is never read.

# %%
# export: quantized_checkpoint
"""Quantized weights on disk: quantize a checkpoint once, load it in a second afterwards."""

from __future__ import annotations

import hashlib
import inspect
import json
import sys
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

import aie_lessons.quantize
from aie_lessons.config import ModelConfig
from aie_lessons.model import LlamaModel
from aie_lessons.quantize import (QuantizedLinear, QuantScheme, block_linear_names, head_scheme, layer_schemes_for,
                                  quantize_model, scheme_named)

FORMAT = "aie-quantized-1"


def checkpoint_fingerprint(model_dir: str | Path) -> str:
    """Which checkpoint a quantized file came from: its config and its weight files' names,
    sizes and modification times (hashing 540 MB of weights would take longer than quantizing)."""
    model_dir = Path(model_dir)
    digest = hashlib.sha256((model_dir / "config.json").read_bytes())
    for path in sorted(model_dir.glob("*.safetensors")):
        stat = path.stat()
        digest.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:16]


def layer_schemes(model: LlamaModel) -> dict[str, QuantScheme]:
    """The scheme of every quantized layer of ``model``, by name (``lm_head`` included if it is)."""
    return {name: module.scheme for name, module in model.named_modules() if isinstance(module, QuantizedLinear)}


def _schemes_json(schemes: Mapping[str, QuantScheme]) -> str:
    return json.dumps({name: [s.name, s.bits, s.group_size] for name, s in schemes.items()}, sort_keys=True)


def save_quantized(model: LlamaModel, path: str | Path, model_dir: str | Path) -> Path:
    """Write the quantized layers of ``model`` (quantized from ``model_dir``) to ``path``."""
    schemes = layer_schemes(model)
    if not schemes:
        raise ValueError("the model has no quantized layer: quantize_model it first")
    tensors = {}
    for name in schemes:
        layer = model.get_submodule(name)
        for part in ("q", "scale", "zero"):
            tensors[f"{name}.{part}"] = getattr(layer, part).contiguous().cpu()
    metadata = {"format": FORMAT, "checkpoint": checkpoint_fingerprint(model_dir), "schemes": _schemes_json(schemes)}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")  # a file cut short by an interrupt is never read as whole
    save_file(tensors, str(partial), metadata=metadata)
    partial.replace(path)
    return path


def read_metadata(path: str | Path) -> dict[str, str]:
    """The file's metadata, checked to be this course's format: what ``load_quantized`` trusts."""
    with safe_open(str(path), framework="pt") as file:
        metadata = file.metadata() or {}
    if metadata.get("format") != FORMAT or not {"checkpoint", "schemes"} <= set(metadata):
        raise ValueError(f"{path} is not a quantized-weights file of this course (format "
                         f"{metadata.get('format')!r}, expected {FORMAT!r}). Fix: make it with "
                         "save_quantized, or let quantized_model make it")
    return metadata


def load_quantized(model_dir: str | Path, path: str | Path, dtype: torch.dtype = torch.float32,
                   device: str | torch.device = "cpu", activations: torch.dtype = torch.float32,
                   kernels: bool = True) -> LlamaModel:
    """The checkpoint's model (``dtype`` for the weights that stay float) with the quantized
    layers of ``path`` in place of its own."""
    metadata = read_metadata(path)
    if metadata["checkpoint"] != checkpoint_fingerprint(model_dir):
        raise ValueError(f"{path} was quantized from another checkpoint than {model_dir}. "
                         "Fix: quantize again (quantized_model does it) or pass the checkpoint it came from")
    model = LlamaModel.from_pretrained(model_dir, dtype=dtype, device=device, activations=activations)
    with safe_open(str(path), framework="pt", device=str(device)) as file:
        for name, (scheme_name, bits, group_size) in json.loads(metadata["schemes"]).items():
            scheme = QuantScheme(scheme_name, bits, group_size)
            layer = QuantizedLinear(*(file.get_tensor(f"{name}.{part}") for part in ("q", "scale", "zero")),
                                    scheme, kernels)
            replaced = model.get_submodule(name)
            if (layer.out_features, layer.in_features) != (replaced.out_features, replaced.in_features):
                raise ValueError(f"{path}: {name} is {layer.out_features} × {layer.in_features} in the file, "
                                 f"{replaced.out_features} × {replaced.in_features} in the model")
            model.set_submodule(name, layer)
    return model


def quantized_model(model_dir: str | Path, scheme: QuantScheme | str, head: bool | QuantScheme | str | None = False,
                    overrides: Mapping[str, QuantScheme | str] | None = None,
                    dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                    activations: torch.dtype = torch.float32, cache_dir: str | Path | None = None,
                    kernels: bool = True) -> LlamaModel:
    """The model quantized with ``scheme``, always from the fp32 weights: read from ``cache_dir``
    (by default the checkpoint's ``quantized/`` folder) if it was made before from this
    checkpoint, by this code, with these layer schemes; else made now and written there. Files
    of the same scheme made before (older weights or code) are removed. ``head`` as in
    ``quantize_model``."""
    model_dir, scheme = Path(model_dir), scheme_named(scheme)
    cache_dir = model_dir / "quantized" if cache_dir is None else Path(cache_dir)
    with torch.device("meta"):  # the layers' names, without reading any weight
        names = block_linear_names(LlamaModel(ModelConfig.from_json(model_dir)))
    lm_head = head_scheme(scheme, head)
    plan = layer_schemes_for(names, scheme, overrides) | ({"lm_head": lm_head} if lm_head is not None else {})
    code = inspect.getsource(aie_lessons.quantize)  # `aie commit 08` may have changed the arithmetic
    layers = hashlib.sha256(_schemes_json(plan).encode()).hexdigest()[:8]
    made = hashlib.sha256(f"{FORMAT}|{checkpoint_fingerprint(model_dir)}|{code}".encode()).hexdigest()[:8]
    # The head in the file's name and in what is said: "-head" in the blocks' scheme, else its own.
    head_name, told = (("", "") if lm_head is None else ("-head", " (head too)") if lm_head == scheme
                       else (f"-head-{lm_head.name}", f" (the head in {lm_head.name})"))
    stem = f"{model_dir.name}-{scheme.name}{head_name}-{layers}"
    path = cache_dir / f"{stem}-{made}.safetensors"
    if path.exists() and read_metadata(path)["schemes"] != _schemes_json(plan):
        raise ValueError(f"{path} holds other layer schemes than its name says. Fix: delete it, and it is "
                         "made again")
    if not path.exists():
        print(f"quantizing {model_dir.name} to {scheme.name}{told}, once: "
              f"it is kept in {path}", file=sys.stderr)
        model = quantize_model(LlamaModel.from_pretrained(model_dir), scheme, head=lm_head, overrides=overrides)
        save_quantized(model, path, model_dir)
        for old in cache_dir.glob(f"{stem}-*.safetensors"):
            if old != path:
                old.unlink()
    return load_quantized(model_dir, path, dtype, device, activations, kernels)


# %% [markdown]
# Saving and loading give back the same layers, bit for bit, and loading is quicker than
# quantizing:

# %%
# NBVAL_IGNORE_OUTPUT
import tempfile
from pathlib import Path

from aie_lessons.quantized_checkpoint import load_quantized, quantized_model

with tempfile.TemporaryDirectory() as scratch:
    start = time.perf_counter()
    first = quantized_model(MODEL_DIR, "int4-g32", head=True, cache_dir=scratch)
    quantize_seconds = time.perf_counter() - start
    start = time.perf_counter()
    again = quantized_model(MODEL_DIR, "int4-g32", head=True, cache_dir=scratch)
    load_seconds = time.perf_counter() - start
    files = list(Path(scratch).glob("*.safetensors"))
    print(f"{files[0].name}: {files[0].stat().st_size / 2**20:.1f} MiB")
print(f"quantize and save {quantize_seconds:.1f} s, load {load_seconds:.1f} s")

# %%
same = all(torch.equal(getattr(a, part), getattr(b, part))
           for a, b in zip(first.modules(), again.modules()) if isinstance(a, QuantizedLinear)
           for part in ("q", "scale", "zero"))
print("the loaded layers equal the saved ones, bit for bit:", same)

# %% [markdown]
# The engine of stages 06–07 takes the quantized model as it is: `QuantizedLinear` is a module
# like any other, so every request of a batch goes through the integer weights. Its greedy tokens
# must be those of stage 04's cached loop on the same quantized model (both in fp32 arithmetic,
# so exactly):

# %%
from aie_lessons.cached_generate import generate_cached
from aie_lessons.engine.paged_engine import paged_engine
from aie_lessons.sampling import SamplingParams

int8_model = quantize_model(LlamaModel.from_pretrained(MODEL_DIR), "int8")
params = SamplingParams(max_new_tokens=12)
prompts = ["The capital of France is", "A list in Python is", "Quantization means"]
engine = paged_engine(int8_model, tokenizer, max_seqs=3, kv_bytes=32 * 2**20)
engine_ids = [result.token_ids for result in engine.generate(prompts, params)]
loop_ids = [result.token_ids for result in
            generate_cached(int8_model, tokenizer, [tokenizer.encode(p) for p in prompts], params)]
print("engine = stage 04's loop, on the int8 model:", engine_ids == loop_ids)
print(repr(tokenizer.decode(engine_ids[0])))

# %% [markdown]
# From the command line, `--quant` picks the scheme, `--quant-head` quantizes the output head
# too (`--quant-head-scheme int8` in a scheme of its own), and the first run writes the file the
# next runs read:
#
# ```
# aie generate --quant int8 "The capital of France is"
# aie generate --quant int4-g32 --quant-head --activations bfloat16 "The capital of France is"
# aie generate --quant int4-g32 --quant-head-scheme int8 "The capital of France is"
# ```
#
# The head is the largest single matrix (vocabulary × hidden) and the last, its rounding lands
# straight in the logits: llama.cpp's 4-bit files keep it in 6 bits rather than 4, and int8 is
# the nearest of the schemes here.
#
# With `--activations bfloat16`, decode steps of up to `KERNEL_MAX_ROWS` requests take the CPU
# kernels of section 6.

# %% [markdown]
# ## 10. The KV cache in int8
#
# Weights are not the only bytes a decode step reads: it reads every cached key and value too
# (stage 04: 45 KiB per token in fp32), and at long contexts or many requests those bytes pass
# the weights'. They are also what stage 07's pool is made of. The same int8 idea applies: each
# cached key (and value) of one head at one position is a vector of `head_dim` numbers, stored
# as int8 with its own scale, `absmax / 127` — exercise 8.1 row by row, where a row is one
# head's key at one position. The scales are computed when a token is written, so a new token
# never changes an old one's.
#
# `Int8KVCache` has stage 04's interface: `update` stores the new keys and values and returns all
# of them so far, turned back into floats for attention. (This plain version rebuilds the floats
# at every step; an attention kernel that read the int8 directly would not — stage 05's kernel
# would take the scales as one more input.)

# %%
# export: int8_kv_cache
"""A KV cache that stores keys and values as int8, one scale per head and position."""

from __future__ import annotations

import torch

from aie_lessons.config import ModelConfig
from aie_lessons.kv_cache import CacheFullError, KVCache
from aie_lessons.quantize import quantize_int8


def int8_kv_bytes_per_token(config: ModelConfig) -> int:
    """Keys and values of one token in every layer: a byte per number and a float32 scale per
    head vector (against ``kv_cache_bytes(config, 1, 1, dtype)`` for a float cache)."""
    return 2 * config.num_layers * config.num_kv_heads * (config.head_dim + 4)


class Int8KVCache(KVCache):
    """Stage 04's ``KVCache`` with int8 keys and values and a float32 scale per (layer, row,
    head, position); ``update`` returns floats in the dtype of what it is given."""

    def __init__(self, config: ModelConfig, batch_size: int, max_len: int, device: torch.device | str = "cpu"):
        super().__init__(config, batch_size, max_len, torch.int8, device)
        self.key_scales = torch.ones(self.keys.shape[:-1], device=device)
        self.value_scales = torch.ones(self.values.shape[:-1], device=device)

    @property
    def nbytes(self) -> int:
        return super().nbytes + self.key_scales.nbytes + self.value_scales.nbytes

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, Hkv, S, D) at columns start … start+S-1; return columns 0 … start+S-1."""
        end = start + k.shape[2]
        if start < 0:
            raise ValueError(f"start={start}: cache columns start at 0")
        if end > self.max_len:
            raise CacheFullError(f"the int8 KV cache holds {self.max_len} positions; writing {k.shape[2]} at "
                                 f"column {start} needs {end}. Fix: allocate max_len ≥ prompt + "
                                 f"max_new_tokens (here {end})")
        for new, store, scales in ((k, self.keys, self.key_scales), (v, self.values, self.value_scales)):
            q, scale = quantize_int8(new.reshape(-1, new.shape[-1]))  # one row per head and position
            store[layer, :, :, start:end] = q.reshape(new.shape)
            scales[layer, :, :, start:end] = scale.reshape(new.shape[:-1])
        return tuple((store[layer, :, :, :end] * scales[layer, :, :, :end, None]).to(k.dtype)
                     for store, scales in ((self.keys, self.key_scales), (self.values, self.value_scales)))


# %% [markdown]
# What it costs in quality: the same teacher-forced score as section 5, with every window
# going through a fresh cache first — a prefill writes the window's keys and values and attends
# to what the cache gives back, which is exactly what later decode steps would read.

# %%
# export: text_quality
class ThroughCache(torch.nn.Module):
    """``model(ids)``, with every window prefilled through a fresh cache from
    ``make_cache(batch, length, device)``: attention then uses the keys and values the cache
    gives back (``update``, as stage 04's ``KVCache`` has it), as decode steps would."""

    def __init__(self, model: LlamaModel, make_cache: Callable[[int, int, torch.device], object]) -> None:
        super().__init__()
        self.model, self.make_cache = model, make_cache

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        cache = self.make_cache(ids.shape[0], ids.shape[1], ids.device)
        return self.model(ids, positions, AttentionMetadata(cache=cache, cache_start=0))


# %%
# NBVAL_IGNORE_OUTPUT
from aie_lessons.int8_kv_cache import Int8KVCache, int8_kv_bytes_per_token
from aie_lessons.kv_cache import KVCache, kv_cache_bytes
from aie_lessons.text_quality import ThroughCache

kv_variants = {
    "bf16 cache": ThroughCache(model, lambda batch, length, device: KVCache(model.config, batch, length,
                                                                             torch.bfloat16, device)),
    "int8 cache": ThroughCache(model, lambda batch, length, device: Int8KVCache(model.config, batch, length, device)),
}
kv_quality = text_quality(model, kv_variants, corpus_ids[:1025])
per_token = {"fp32 cache": kv_cache_bytes(model.config, 1, 1, torch.float32),
             "bf16 cache": kv_cache_bytes(model.config, 1, 1, torch.bfloat16),
             "int8 cache": int8_kv_bytes_per_token(model.config)}
print(f"{'':>11} {'KiB/token':>9} {'perplexity':>11} {'vs fp32':>8} {'mean KL':>9} {'top-1':>7}")
for name, q in kv_quality.items():
    label = "fp32 cache" if name == "reference" else name
    print(f"{label:>11} {per_token[label] / 1024:9.2f} {q.perplexity:11.3f} "
          f"{q.perplexity / kv_quality['reference'].perplexity - 1:+8.2%} {q.mean_kl:9.1e} {q.top1:7.2%}")

# %%
print("int8 cache within 1% of fp32's perplexity:",
      kv_quality["int8 cache"].perplexity / kv_quality["reference"].perplexity - 1 < 0.01)

# %% [markdown]
# And what it buys in stage 07's pool: blocks of 16 tokens in a fixed budget, and how many
# requests of 1,024 tokens (prompt and output) fit at once — the batch a continuous-batching
# engine can run, and so its throughput, once weights are small.

# %%
from aie_lessons.engine.block_manager import blocks_for
from aie_lessons.engine.paged_cache import blocks_for_budget

budget, block_size, request_tokens = 2 * 2**30, 16, 1024
print(f"a {budget / 2**30:.0f} GiB pool, blocks of {block_size} tokens, requests of {request_tokens} tokens:")
pool = {"fp32 cache": blocks_for_budget(model.config, budget, block_size, torch.float32),
        "bf16 cache": blocks_for_budget(model.config, budget, block_size, torch.bfloat16),
        "int8 cache": budget // (block_size * int8_kv_bytes_per_token(model.config))}
for label, blocks in pool.items():
    print(f"{label:>11}: {blocks:6,} blocks → {blocks // blocks_for(request_tokens, block_size):4} requests at once")
print(f"int8 holds {pool['int8 cache'] / pool['bf16 cache']:.2f}× the requests of bf16, "
      f"{pool['int8 cache'] / pool['fp32 cache']:.2f}× those of fp32")

# %% [markdown]
# ## Summary
#
# * int8 with one scale per output row: `scale = absmax / 127`, round to nearest; the error of a
#   weight is at most half a step.
# * int4 needs finer, asymmetric grids: a scale and a zero per group of 32–192 weights, two
#   values per byte. Groups of 32 reproduce this model exactly: it was a Q4_1 (4-bit, groups of
#   32) model all along.
# * Quantized layers replace `nn.Linear` in place; the tied embedding / output head stays in
#   fp32 unless asked for.
# * On real text, int8 costs little, and int4 in groups that do not line up with the model's own
#   grid costs much more: the table of section 5 gives the numbers.
# * Fewer bytes turn into speed only where a kernel multiplies by the integers as they are:
#   PyTorch's CPU kernels do, for bf16 inputs and a few rows at a time; rebuilding float weights
#   does not, compiled or not (section 6).
# * Sensitivity is uneven: quantizing one group at a time (your exercise 8.5) finds the layers
#   that carry int4's loss, and keeping those in int8 buys much of it back for a few MiB.
# * Quantized weights are kept in safetensors files with their scales, made once per checkpoint
#   and scheme; the engine and `aie generate --quant` use them.
# * The KV cache quantizes like the weights, a scale per head and position: fewer bytes per
#   token, more requests in stage 07's pool.
#
# Commit the stage with `aie commit 08`.
