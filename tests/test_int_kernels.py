"""The course's integer kernels (``infra/int_kernels``) against what they compute, written plainly.

Each product is compared twice: with a plain PyTorch model of the kernel's own arithmetic (the
activations rounded to int8 per block of 32, the int4 scales in float16), which it must match to
float32 rounding — any slip of layout, nibble order, sign or offset shows there — and with the
exact float product of the dequantized weight, within the ~1 % the activations' rounding costs.
"""

from __future__ import annotations

import pytest
import torch

from aie_lessons.infra import int_kernels
from aie_lessons.quantize import dequantize_int4, dequantize_int8, quantize_int4, quantize_int8, unpack_int4



@pytest.fixture(autouse=True)
def _kernels_built() -> None:
    """Build (or load) the kernels at the first test rather than while pytest collects."""
    reason = int_kernels.unavailable()
    if reason:
        pytest.skip(reason)


def rounded_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x rounded as the kernels round it — int8 per block of 32, scale = block max / 127, each
    value times the scale's float32 reciprocal rounded half to even (as ``nearbyint``) — as
    float64, and each block's sum."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(scale > 0, 1 / torch.where(scale > 0, scale, 1), 0)
    levels = torch.round(blocks * inverse).clamp(-127, 127)
    return (levels.double() * scale.double()).reshape(x.shape), blocks.double().sum(-1)


def int4_model(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int) -> torch.Tensor:
    """The int4 kernel's arithmetic: level × scale against the rounded x, low × each group's exact sum."""
    _, scale_low = int_kernels.int4_layout(q, scale, zero)
    s, low = scale_low.double().permute(0, 3, 1, 2).reshape(q.shape[0], -1, 2).unbind(-1)  # tiles back to rows
    levels = (unpack_int4(q).double() + 8).reshape(q.shape[0], -1, group)
    rounded, sums = rounded_activations(x)
    group_sums = sums.reshape(x.shape[0], -1, group // 32).sum(-1)
    weight = (levels * s[..., None]).reshape(q.shape[0], -1)
    return (rounded @ weight.T + group_sums @ low.T).float()


@pytest.mark.parametrize("rows", [1, 3, 4, 9])
@pytest.mark.parametrize("out_features,in_features,group", [(40, 64, 32), (96, 256, 64), (36, 384, 128), (8, 512, 256)])
def test_int4_linear_computes_its_arithmetic_and_stays_near_the_float_product(rows, out_features, in_features, group):
    torch.manual_seed(rows * 1000 + out_features)
    weight = torch.randn(out_features, in_features) * 0.05
    x = torch.randn(rows, in_features)
    q, scale, zero = quantize_int4(weight, group)
    got = int_kernels.int4_linear(x, *int_kernels.int4_layout(q, scale, zero), group)
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    torch.testing.assert_close(got, int4_model(x, q, scale, zero, group), rtol=1e-4, atol=1e-4)
    # A loose sanity bound against the float product (the rounding costs ~0.7 % at most here)
    exact = x @ dequantize_int4(q, scale, zero, group).T
    assert (got - exact).abs().max() <= 0.03 * exact.abs().max()


@pytest.mark.parametrize("rows", [1, 4, 6])
@pytest.mark.parametrize("out_features,in_features", [(40, 64), (8, 576)])
def test_int8_linear_computes_its_arithmetic_and_stays_near_the_float_product(rows, out_features, in_features):
    torch.manual_seed(rows * 100 + out_features)
    weight = torch.randn(out_features, in_features) * 0.05
    x = torch.randn(rows, in_features) * 3
    x[0, :32] = 0  # a block of zeros: scale 0, no division by it
    q, scale = quantize_int8(weight)
    got = int_kernels.int8_linear(x, int_kernels.tiled(q), scale)
    rounded, _ = rounded_activations(x)
    torch.testing.assert_close(got, (rounded @ q.double().T * scale.double()).float(), rtol=1e-4, atol=1e-4)
    exact = x @ dequantize_int8(q, scale).T
    assert (got - exact).abs().max() <= 0.02 * exact.abs().max()


@pytest.mark.parametrize("bits", [4, 8])
def test_a_row_gets_the_same_bits_alone_or_in_any_batch(bits):
    """A request's outputs must not depend on the rows beside it (each row is its own sums over a
    tile, whatever the batch), or a batch's size would change its tokens: the next layer's int8
    rounding can turn a last-bit difference into a whole step."""
    torch.manual_seed(bits)
    weight = torch.randn(24, 128)
    x = torch.randn(9, 128)
    if bits == 4:
        layout = int_kernels.int4_layout(*quantize_int4(weight, 64))
        product = lambda rows: int_kernels.int4_linear(rows, *layout, 64)  # noqa: E731
    else:
        q, scale = quantize_int8(weight)
        product = lambda rows: int_kernels.int8_linear(rows, int_kernels.tiled(q), scale)  # noqa: E731
    alone = torch.cat([product(x[i:i + 1]) for i in range(9)])
    for rows in range(1, 10):
        assert torch.equal(product(x[:rows]), alone[:rows]), rows


def test_the_layouts_put_each_weight_where_the_kernels_read_it():
    """Row 4t + c, column 32b + i of a weight is byte (t, b, c, i) of its tiles; in int4, level i
    of blocks 2p and 2p + 1 share byte i of pair p (low nibble first), and a tile's group holds
    its rows' scales, then their lows (low = zero - 8 · scale: levels are stage 08's plus 8)."""
    torch.manual_seed(2)
    rows = torch.randint(-127, 128, (8, 96), dtype=torch.int8)
    tiles = int_kernels.tiled(rows)
    t, b, c, i = torch.meshgrid(*(torch.arange(n) for n in tiles.shape), indexing="ij")
    assert torch.equal(tiles, rows[4 * t + c, 32 * b + i])
    q, scale, zero = quantize_int4(torch.randn(8, 128), 32)
    levels, scale_low = int_kernels.int4_layout(q, scale, zero)
    expected = (unpack_int4(q) + 8).reshape(2, 4, 2, 2, 32).transpose(1, 2)  # (tile, pair, row, block of pair, i)
    assert torch.equal(levels & 0x0F, expected[:, :, :, 0].to(torch.uint8))
    assert torch.equal(levels >> 4, expected[:, :, :, 1].to(torch.uint8))
    assert torch.equal(scale_low[:, :, 0], scale.half().reshape(2, 4, 4).transpose(1, 2))
    assert torch.equal(scale_low[:, :, 1], (zero - 8 * scale).half().reshape(2, 4, 4).transpose(1, 2))
    with pytest.raises(ValueError, match=r"\(6, 128\) int4 weight does not split into tiles of 4 rows"):
        int_kernels.int4_layout(*quantize_int4(torch.randn(6, 128), 32))


def test_a_nan_input_gives_nan_outputs():
    """As a float product would: a NaN must not be rounded into some finite level."""
    q, scale = quantize_int8(torch.randn(4, 64))
    x = torch.randn(2, 64)
    x[1, 40] = float("nan")
    out = int_kernels.int8_linear(x, int_kernels.tiled(q), scale)
    assert out[0].isfinite().all() and out[1].isnan().all()
    q4, s4, z4 = quantize_int4(torch.randn(4, 64), 32)
    assert int_kernels.int4_linear(x, *int_kernels.int4_layout(q4, s4, z4), 32)[1].isnan().all()


def test_each_output_is_the_same_on_any_number_of_threads():
    """Each output is one thread's sum, so the thread count must not change a bit (a data race
    between the threads would)."""
    torch.manual_seed(0)
    q, scale, zero = quantize_int4(torch.randn(300, 256), 32)
    layout = int_kernels.int4_layout(q, scale, zero)
    x = torch.randn(5, 256)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = int_kernels.int4_linear(x, *layout, 32)
        torch.set_num_threads(2)
        two = int_kernels.int4_linear(x, *layout, 32)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_a_mismatched_input_is_refused_with_the_widths():
    q, scale = quantize_int8(torch.randn(8, 64))
    with pytest.raises(RuntimeError, match="x has 32 columns but the weight takes 64"):
        int_kernels.int8_linear(torch.randn(2, 32), int_kernels.tiled(q), scale)
    with pytest.raises(RuntimeError, match=r"q should be contiguous .*tiles.*Fix: make it with int_kernels.tiled"):
        int_kernels.int8_linear(torch.randn(2, 64), q, scale)  # stage 08's own (out, in) order
    q4, s4, z4 = quantize_int4(torch.randn(8, 64), 32)
    levels, pairs = int_kernels.int4_layout(q4, s4, z4)
    with pytest.raises(RuntimeError, match="scale_low should be contiguous float16"):
        torch.ops.aie.int4_linear(torch.randn(1, 64), levels, torch.stack([s4, z4], -1), 32)
    with pytest.raises(RuntimeError, match=r"of shape \(2, 2, 2, 4\).*Fix: make it with int_kernels.int4_layout"):
        rows = pairs.permute(0, 3, 1, 2).reshape(8, 2, 2).contiguous()  # a (scale, low) pair per row and group
        torch.ops.aie.int4_linear(torch.randn(1, 64), levels, rows, 32)
    for group in (0, 48):
        with pytest.raises(RuntimeError, match=f"groups of {group} do not tile 64 columns"):
            torch.ops.aie.int4_linear(torch.randn(1, 64), levels, pairs, group)


def test_a_weight_that_is_not_whole_tiles_is_left_to_pytorch():
    """The kernels take outputs in tiles of four rows: a layer of 33 does not fit them (and the
    decoder keeps PyTorch's kernel for it); the layouts refuse it, naming the check."""
    assert int_kernels.fits(8, 0, 64, 36) and not int_kernels.fits(8, 0, 64, 33)
    assert int_kernels.fits(4, 32, 64, 36) and not int_kernels.fits(4, 32, 64, 33)
    with pytest.raises(ValueError, match=r"\(33, 64\) weight does not split into tiles of 4 rows.*int_kernels.fits"):
        int_kernels.tiled(quantize_int8(torch.randn(33, 64))[0])


def test_the_kernels_compile_inside_a_traced_function():
    """The fake implementations give ``torch.compile`` the output's shape: the compiled function
    calls the same kernel, so the numbers are equal."""
    torch.manual_seed(1)
    q, scale, zero = quantize_int4(torch.randn(64, 128), 32)
    q4, scale_low = int_kernels.int4_layout(q, scale, zero)
    q8, scale8 = quantize_int8(torch.randn(16, 64))
    q8 = int_kernels.tiled(q8)

    def step(x: torch.Tensor) -> torch.Tensor:
        return int_kernels.int8_linear(torch.relu(int_kernels.int4_linear(x, q4, scale_low, 32)) + 1, q8, scale8)

    x = torch.randn(2, 128)
    torch.testing.assert_close(torch.compile(step, backend="aot_eager", fullgraph=True)(x), step(x))
