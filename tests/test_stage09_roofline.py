"""Stage 09: the decode-step cost check names each usual mistake; the ceilings' probes run."""

from __future__ import annotations

import pytest
import torch

from aie_lessons.ceilings import copy_bandwidth, matmul_throughput
from aie_lessons.checks import stage09 as checks
from aie_lessons.kv_cache import kv_cache_bytes
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
        assert matmul_throughput(dtype, size=128, repeats=2) > 1e6


@pytest.mark.parametrize("batch", [1, 16])
def test_intensity_grows_with_the_batch_and_is_flops_per_byte(real_model, batch):
    cost = decode_step_cost(real_model.config, batch, 128, 500_000_000)
    assert cost.intensity == cost.flops / cost.bytes
    assert decode_step_cost(real_model.config, 2 * batch, 128, 500_000_000).intensity > cost.intensity
