"""Stage 09: the decode-step cost check names each usual mistake; the ceilings' probes run."""

from __future__ import annotations

import pytest
import torch

from aie_lessons.ceilings import copy_bandwidth, matmul_throughput
from aie_lessons.checks import stage09 as checks
from aie_lessons.kv_cache import KVCache, kv_cache_bytes
from aie_lessons.step_cost import DecodeCost, decode_step_cost

from check_expect import mutants, names_the_mistake


def test_the_reference_solution_passes_its_check():
    checks.check_decode_step_cost(decode_step_cost)


def _cost(config, batch, context, weight_bytes, kv_dtype=torch.float32, *, multiply_add=2, attention=4,
          attention_heads=None, head=True, weights_per_request=False, kv=True, kv_heads=None, batch_power=1):
    """The reference count with one of the usual mistakes switched on."""
    hidden, d = config.hidden_size, config.head_dim
    block = (2 * hidden * config.num_heads * d + 2 * hidden * config.num_kv_heads * d
             + 3 * hidden * config.intermediate_size)
    weights = config.num_layers * block + (config.vocab_size * hidden if head else 0)
    heads = attention_heads(config) if attention_heads else config.num_heads
    flops = batch**batch_power * (multiply_add * weights + config.num_layers * attention * heads * d * context)
    cache = 0
    if kv:
        cache = kv_cache_bytes(config, context, batch, kv_dtype)
        if kv_heads:
            cache = cache // config.num_kv_heads * kv_heads(config)
    return DecodeCost(flops, weight_bytes * (batch if weights_per_request else 1) + cache)


@mutants("9.1", [
    (lambda *a: _cost(*a, multiply_add=1), "the weights' FLOPs are half"),
    (lambda *a: _cost(*a, attention=0), "attention's arithmetic is missing"),
    (lambda *a: _cost(*a, attention=2), "attention counted once"),
    (lambda *a: _cost(*a, attention_heads=lambda c: c.num_kv_heads), "counted per key-value head"),
    (lambda *a: _cost(*a, head=False), "the output head is missing"),
    (lambda *a: _cost(*a, batch_power=0), "that is one request's arithmetic"),
    (lambda *a: _cost(*a, batch_power=2), "the batch was multiplied in twice"),
    (lambda *a: _cost(*a, weights_per_request=True), "counted once per request"),
    (lambda *a: _cost(*a, kv=False), "the cached keys and values are missing"),
    (lambda *a: _cost(*a, kv_heads=lambda c: c.num_heads), "counted per query head"),
    (lambda config, batch, context, weight_bytes, kv_dtype: _cost(config, batch, context, weight_bytes),
     "in float32 whatever its dtype"),
    (lambda config, batch, context, weight_bytes, kv_dtype: DecodeCost(
        _cost(config, batch, context, weight_bytes).flops,
        weight_bytes + kv_cache_bytes(config, context, 1, kv_dtype)), "one request's cache was counted"),
    (lambda *a: DecodeCost(float(_cost(*a).flops), _cost(*a).bytes), "flops should be an int"),
])
def test_decode_cost_mistakes_are_named(wrong, message):
    with names_the_mistake("9.1", message):
        checks.check_decode_step_cost(wrong)


def test_the_first_shape_tells_every_mistake_apart():
    """The check reports the first shape's diagnosis: there, no two mistakes may give one number
    (on other shapes some do, and the check keeps the first meaning)."""
    config = checks._config(*checks.SHAPES[0])
    for batch, context in ((1, 1), (3, 17)):
        want = checks._counted_flops(config, batch, context)
        parts = checks._parts(config, batch, context)
        candidates = [want // 2, want - (parts["blocks"] + parts["head"]) // 2, want - parts["attention"],
                      want - parts["attention"] + parts["attention_kv"], want - parts["head"],
                      want - parts["attention"] // 2]
        assert len(set(candidates)) == len(candidates) and want not in candidates
        assert len(checks.flops_diagnoses(want, parts)) == len(candidates)


def test_the_count_equals_flop_counter_on_the_real_model(real_model):
    """The formula against PyTorch's own tally of one decode step of SmolLM2 (manual attention)."""
    from aie_lessons.quantize import bytes_read_per_token

    assert (decode_step_cost(real_model.config, 2, 10, bytes_read_per_token(real_model)).flops
            == checks._counted_flops(real_model.config, 2, 10))


def test_the_probes_measure_something():
    assert copy_bandwidth(megabytes=8, repeats=2) > 1e8  # bytes per second: any machine moves more
    for dtype in (torch.float32, torch.bfloat16, torch.int8):
        peak = matmul_throughput(dtype, size=128, repeats=2)
        assert peak.size == 128 and peak.per_second > 1e6


def test_the_real_probe_stays_short_whatever_the_cpu():
    """Unmocked: bf16 (the slowest path on a CPU without bf16 instructions) sized to 20 ms."""
    import time

    start = time.perf_counter()
    peak = matmul_throughput(torch.bfloat16, seconds=0.02, repeats=1)
    assert 64 <= peak.size <= 2048 and peak.per_second > 0
    assert time.perf_counter() - start < 10, "the probe did not stop growing at its time"


def test_the_matmul_probe_sizes_itself_to_the_time_it_is_given(monkeypatch):
    """It grows the matrices until one product takes ``seconds`` (a slow path stops small, so the
    probe stays short on a CPU without bf16 instructions), and stops at ``max_size``."""
    from aie_lessons import ceilings

    product_seconds = {}  # side -> the seconds one product takes, as the fake clock tells it

    def timed(call, repeats, device="cpu"):
        return product_seconds[call.size]

    def square(dtype, size, device="cpu"):
        call = lambda: None  # noqa: E731
        call.size = size
        return call

    monkeypatch.setattr(ceilings, "best_seconds", timed)
    monkeypatch.setattr(ceilings, "square_product", square)
    fast = {n: 2 * n**3 / 100e9 for n in (64, 128, 256, 512, 1024, 2048, 4096)}  # 100 GFLOP/s
    slow = {n: 2 * n**3 / 1.2e9 for n in fast}  # 1.2 GFLOP/s: bf16 on an AVX2-only CPU
    product_seconds.update(fast)
    assert matmul_throughput(torch.float32, seconds=0.1) == (pytest.approx(100e9), 2048)
    assert matmul_throughput(torch.float32, seconds=0.01) == (pytest.approx(100e9), 1024)
    product_seconds.update(slow)
    assert matmul_throughput(torch.bfloat16, seconds=0.1) == (pytest.approx(1.2e9), 512)
    assert matmul_throughput(torch.bfloat16, seconds=0.1, max_size=256).size == 256


@pytest.mark.parametrize("batch", [1, 16])
def test_intensity_grows_with_the_batch_and_is_flops_per_byte(real_model, batch):
    cost = decode_step_cost(real_model.config, batch, 128, 500_000_000)
    assert cost.intensity == cost.flops / cost.bytes
    assert decode_step_cost(real_model.config, 2 * batch, 128, 500_000_000).intensity > cost.intensity


def test_the_reference_decode_attention_passes_its_check():
    from aie_lessons.fast_decode import decode_attention

    checks.check_decode_attention(decode_attention)


def _attend(q, keys, values, *, scale=True, grouping="adjacent", normalize=True, stable=True, dtype=torch.float32,
            axis=-1, compute=torch.float32):
    """Decode attention with one of the usual mistakes switched on."""
    num_kv_heads, _, head_dim = keys.shape
    group = q.shape[0] // num_kv_heads
    if compute != torch.float32:  # the arithmetic in the cache's dtype, converted at the end
        keys, values, q = keys.to(compute), values.to(compute), q.to(compute)
    else:
        keys, values = keys.float(), values.float()
    if grouping == "adjacent":
        k, v = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)
    else:
        k, v = keys.repeat(group, 1, 1), values.repeat(group, 1, 1)
    scores = (q[:, None, :] * k).sum(-1) * (head_dim**-0.5 if scale else 1.0)  # (Hq, T)
    if stable:
        scores = scores - scores.amax(axis, keepdim=True)
    weights = scores.exp()
    if normalize:
        weights = weights / weights.sum(axis, keepdim=True)
    out = (weights[..., None] * v).sum(-2)
    return out.to(dtype) if dtype != torch.float32 else out.float()


@mutants("9.2", [
    (lambda q, k, v: _attend(q, k, v, scale=False), "not scaled by 1/√head_dim"),
    (lambda q, k, v: _attend(q, k, v, grouping="round-robin"), "h % num_kv_heads"),
    (lambda q, k, v: _attend(q, k, v, normalize=False), "do not sum to 1"),
    (lambda q, k, v: _attend(q, k, v, stable=False), "subtract each row's own largest score"),
    (lambda q, k, v: _attend(q, k, v, dtype=torch.bfloat16), "should be float32"),
    (lambda q, k, v: _attend(q, k, v, axis=0), "the softmax was taken over the heads"),
    (lambda q, k, v: _attend(q, k.float().mul_(1.0) if k.dtype != torch.float32 else k.mul_(1.5), v),
     "changed keys in place"),
    (lambda q, k, v: _attend(q, k.view(-1, k.shape[-1]).view(k.shape), v), "not contiguous in memory"),
    (lambda q, k, v: _attend(q, k, v, compute=k.dtype), "about bf16's rounding"),
    (lambda q, k, v: _attend(q, v, v), "differs from softmax"),
    (lambda q, k, v: _attend(q, k, v)[None], "should be \\(query heads, head_dim\\)"),
])
def test_decode_attention_mistakes_are_named(wrong, message):
    with names_the_mistake("9.2", message):
        checks.check_decode_attention(wrong)


def test_op_costs_count_products_by_flop_counter_and_bytes_by_the_tensors():
    from aie_lessons.step_cost import op_costs

    a, b = torch.randn(4, 8), torch.randn(8, 16)
    table = torch.randn(50, 8)
    ids = torch.tensor([[3, 7]])
    costs = op_costs(lambda: (a @ b, a.view(8, 4), a.t(), torch.nn.functional.embedding(ids, table),
                              a.clone().add_(1.0), b.sum()))
    by_name = {cost.name: cost for cost in costs}
    assert "view" not in by_name and "t" not in by_name  # views move no data
    mm = by_name["mm"]
    assert (mm.flops, mm.bytes, mm.elements) == (2 * 4 * 8 * 16, (32 + 128 + 64) * 4, 128)
    assert mm.intensity == mm.flops / mm.bytes
    lookup = by_name["embedding"]
    assert lookup.bytes == 2 * 2 * 8 * 4 and lookup.flops == 0  # two rows read and written, not the table
    added = by_name["add_"]  # in place: it writes, so it counts
    assert added.flops == 0 and added.elements == 32 and added.intensity == 32 / added.bytes
    reduced = by_name["sum"]  # a reduction: one operation per element read
    assert reduced.elements == 128 and reduced.bytes == 128 * 4 + 4


def test_op_costs_flops_of_a_decode_step_equal_flop_counter_modes(tiny_untied_dir):
    from torch.utils.flop_counter import FlopCounterMode

    from aie_lessons.attention import manual_attention  # its products are counted
    from aie_lessons.model import AttentionMetadata, LlamaModel
    from aie_lessons.step_cost import op_costs

    model = LlamaModel.from_pretrained(tiny_untied_dir, attention=manual_attention)
    cache = KVCache(model.config, 2, 9)
    ids, positions = torch.randint(0, model.config.vocab_size, (2, 1)), torch.full((2, 1), 8)
    step = AttentionMetadata(cache=cache, cache_start=8)
    with torch.inference_mode():
        model(torch.zeros(2, 8, dtype=torch.long), torch.arange(8).expand(2, 8), AttentionMetadata(cache=cache, cache_start=0))
        with FlopCounterMode(display=False) as counter:
            model(ids, positions, step)
        costs = op_costs(lambda: model(ids, positions, step))
    assert sum(cost.flops for cost in costs) == counter.get_total_flops() > 0


def test_op_costs_count_the_integer_kernels_like_mm():
    from aie_lessons.quantize import QuantizedLinear, SCHEMES
    from aie_lessons.step_cost import op_costs

    x = torch.randn(3, 64, dtype=torch.bfloat16)
    for scheme in ("int8", "int4-g32"):
        layer = QuantizedLinear.quantize(torch.randn(32, 64), SCHEMES[scheme])
        layer(x)  # the kernel's layout is made on first use
        kernels = [c for c in op_costs(lambda: layer(x)) if c.name.startswith("_weight_int")]
        assert len(kernels) == 1 and kernels[0].flops == 2 * 3 * 64 * 32, scheme


# --- 9.3: padding an engine step to its bucket ------------------------------------------------------


def test_the_reference_pad_rows_passes_its_check():
    from aie_lessons.engine.compiled_runner import pad_rows

    checks.check_pad_rows(pad_rows)


def _pad(rows, bucket, scratch, *, slot=None, id_=0, seen=1, first=False, rows_out=None, width=0,
         visible_dtype=None, in_place=False):
    """pad_rows with one of the usual mistakes switched on."""
    from aie_lessons.engine.compiled_runner import DecodeRows

    pad = (bucket if rows_out is None else rows_out) - len(rows.ids)
    if in_place:
        rows.visible[:, -1] = True  # meant for the padded copy
    if pad <= 0:
        return rows

    def extend(tensor, value, columns=0):
        padding = tensor.new_full((pad, *tensor.shape[1:]), value)
        if columns:
            padding = tensor.new_full((pad, tensor.shape[1] + columns), value)
            tensor = torch.cat([tensor, tensor.new_full((len(tensor), columns), value)], 1)
        return torch.cat([padding, tensor] if first else [tensor, padding])

    visible = extend(rows.visible, False, width)
    padded = slice(0, pad) if first else slice(len(rows.ids), None)
    visible[padded, :seen] = True
    if visible_dtype is not None:
        visible = visible.to(visible_dtype)
    return DecodeRows(extend(rows.ids, id_), extend(rows.positions, 0), extend(rows.slots, scratch if slot is None else slot),
                      extend(rows.columns, scratch, width), visible)


@mutants("9.3", [
    (lambda r, b, s: _pad(r, b, s, slot=0), "slot 0, which a request may own"),
    (lambda r, b, s: _pad(r, b, s, seen=0), "sees no column"),
    (lambda r, b, s: _pad(r, b, s, first=True), "should be the step's rows, unchanged and in order"),
    (lambda r, b, s: _pad(r, b, s, rows_out=b + 1), "should have \\d+ rows"),
    (lambda r, b, s: _pad(r, b, s, width=1), "keep the columns' width"),
    (lambda r, b, s: _pad(r, b, s, visible_dtype=torch.long), "should stay torch.bool"),
    (lambda r, b, s: _pad(r, b, s, id_=-1), "padding token id -1"),
    (lambda r, b, s: _pad(r, b, s, in_place=True), "changed rows.visible in place"),
    (lambda r, b, s: setattr(r, "ids", r.ids.clone()) or r, "a DecodeRows is frozen: leave the input alone"),
])
def test_pad_rows_mistakes_are_named(wrong, message):
    with names_the_mistake("9.3", message):
        checks.check_pad_rows(wrong)
