"""bf16 weights: logits leave the model in fp32, activations are a separate choice, and the
measure of agreement with fp32 (stage 04, section 7) is right."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from aie_lessons.model import Linear, LlamaModel
from aie_lessons.infra.paths import DATA_DIR
from aie_lessons.precision import agreement, teacher_forced_logits
from aie_lessons.tokenizer import Tokenizer

from stepwise import prefill_then_decode
from low_precision import decisive_steps, logit_tolerance, margin_tolerance


@pytest.mark.parametrize("bias", [False, True])
def test_linear_upcasts_a_low_precision_weight_in_blocks_and_computes_in_the_input_dtype(bias):
    g = torch.Generator().manual_seed(0)
    rows = 2 * Linear.UPCAST_ROWS + 37  # three blocks, the last one partial
    linear = Linear(24, rows, bias=bias).to(torch.bfloat16)
    x = torch.randn(2, 3, 24, generator=g)  # (B, S, in): fp32 activations
    out = linear(x)
    expected = F.linear(x, linear.weight.float(), None if linear.bias is None else linear.bias.float())
    assert out.dtype == torch.float32 and out.shape == (2, 3, rows)
    assert torch.allclose(out, expected, atol=1e-5)
    same = linear(x.bfloat16())  # weights and activations in one dtype: the plain product
    assert same.dtype == torch.bfloat16
    assert torch.equal(same, F.linear(x.bfloat16(), linear.weight, linear.bias))


def projection_input_dtypes(model: LlamaModel) -> set[torch.dtype]:
    """Record the dtype each q projection is fed, via forward hooks (removed by the caller's exit)."""
    seen: set[torch.dtype] = set()
    for layer in model.layers:
        layer.self_attn.q_proj.register_forward_hook(lambda _m, inputs, _out: seen.add(inputs[0].dtype))
    return seen


def test_bf16_model_returns_fp32_logits_and_computes_in_the_chosen_dtype(tiny_untied_dir):
    fp32 = LlamaModel.from_pretrained(tiny_untied_dir)
    ids = torch.randint(0, fp32.config.vocab_size, (2, 19), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        reference = fp32(ids)
    scale = reference.abs().amax(-1, keepdim=True)
    errors = {}
    for activations in (torch.float32, torch.bfloat16):
        bf16 = LlamaModel.from_pretrained(tiny_untied_dir, dtype=torch.bfloat16, activations=activations)
        seen = projection_input_dtypes(bf16)
        with torch.inference_mode():
            logits = bf16(ids)
        assert seen == {activations}  # the hidden states really are in the chosen dtype
        assert logits.dtype == torch.float32
        # Not bf16 values in fp32 clothing: bf16-rounded logits would tie where fp32 ones do not.
        assert not torch.equal(logits, logits.bfloat16().float())
        errors[activations] = (logits - reference).abs() / scale
    assert errors[torch.float32].max() <= logit_tolerance(torch.bfloat16, 1.0)  # the measured bound
    # Rounding only what is stored is closer. Means, not maxima: the mean of 19 × 2 × vocab errors
    # barely depends on how a CPU rounds (here 0.13 eps against 0.21 eps with bf16 activations).
    assert errors[torch.float32].mean() < errors[torch.bfloat16].mean()


def test_activations_must_be_a_float_dtype(tiny_dir):
    with pytest.raises(ValueError, match="activations must be torch.float32"):
        LlamaModel.from_pretrained(tiny_dir, activations="bfloat16")


def test_fast_decoder_refuses_bf16_activations(tiny_dir):
    from aie_lessons.fast_decode import FastDecoder

    model = LlamaModel.from_pretrained(tiny_dir, dtype=torch.bfloat16, activations=torch.bfloat16)
    with pytest.raises(ValueError, match="activations=torch.float32"):
        FastDecoder(model, compile=False)


def test_cached_bf16_generation_keeps_a_bf16_cache_and_fp32_arithmetic(tiny_untied_dir):
    from aie_lessons.kv_cache import KVCache

    model = LlamaModel.from_pretrained(tiny_untied_dir, dtype=torch.bfloat16)
    seen = projection_input_dtypes(model)
    ids = torch.arange(3, 15)[None]
    with torch.inference_mode():
        stepwise = prefill_then_decode(model, ids, KVCache(model.config, 1, 12, dtype=torch.bfloat16), prefill=5)
        full = model(ids)
    assert seen == {torch.float32}
    # The cache rounds k and v to bf16 where the full pass keeps them fp32: close, not equal.
    scale = full.abs().max().item()
    assert (stepwise - full).abs().max().item() <= logit_tolerance(torch.bfloat16, scale)


def test_agreement_of_identical_logits_is_perfect_and_kl_is_the_textbook_value():
    reference = torch.tensor([[2.0, 0.0, -1.0], [0.0, 1.0, 0.0]])
    same = agreement(reference, reference.clone())
    assert (same.positions, same.top1, same.mean_kl, same.max_logit_error) == (2, 1.0, 0.0, 0.0)
    shifted = agreement(reference, reference + 3.0)  # a shared shift changes no probability
    assert shifted.top1 == 1.0 and abs(shifted.mean_kl) < 1e-6 and shifted.max_logit_error == 3.0
    swapped = reference.clone()
    swapped[0] = torch.tensor([0.0, 2.0, -1.0])  # first position now prefers token 1
    result = agreement(reference, swapped)
    p = reference[0].softmax(-1)
    q = swapped[0].softmax(-1)
    expected_kl = (p * (p / q).log()).sum().item() / 2  # the second position contributes 0
    assert result.top1 == 0.5 and math.isclose(result.mean_kl, expected_kl, rel_tol=1e-5)


def test_agreement_refuses_different_shapes():
    with pytest.raises(ValueError, match="shapes differ"):
        agreement(torch.zeros(3, 5), torch.zeros(3, 4))


def test_teacher_forced_logits_run_whole_windows_from_position_zero(tiny_dir):
    model = LlamaModel.from_pretrained(tiny_dir)
    ids = list(range(5, 16))  # 11 tokens: two whole windows of 4, the tail of 3 left out
    logits = teacher_forced_logits(model, ids, window=4)
    assert logits.shape == (8, model.config.vocab_size) and logits.dtype == torch.float32
    with torch.inference_mode():
        second = model(torch.tensor([ids[4:8]]))[0]
    assert torch.allclose(logits[4:], second, atol=1e-6)
    with pytest.raises(ValueError, match="do not fill one window"):
        teacher_forced_logits(model, ids[:3], window=4)


def test_decisive_steps_stop_at_the_first_near_tie():
    logits = torch.tensor([[25.0, 20.0, 0.0], [25.0, 24.0, 0.0], [25.33, 25.24, 0.0], [30.0, 1.0, 0.0]])
    assert margin_tolerance(torch.bfloat16, 25.33) > 0.09  # the France question's first token: 0.08
    assert decisive_steps(logits, torch.bfloat16) == 2
    assert decisive_steps(logits, torch.float32) == 4  # fp32 resolves a 0.09 gap


@pytest.mark.oracle
def test_real_model_bf16_agrees_with_fp32_on_real_text(real_model_dir):
    """The default bf16 model (fp32 activations) within the measured bound on shipped prose."""
    tokenizer = Tokenizer.from_pretrained(real_model_dir)
    ids = tokenizer.encode((DATA_DIR / "prose" / "lighthouses.txt").read_text())[:512]
    reference = teacher_forced_logits(LlamaModel.from_pretrained(real_model_dir), ids, window=256)
    logits = teacher_forced_logits(LlamaModel.from_pretrained(real_model_dir, dtype=torch.bfloat16), ids, window=256)
    relative = ((logits - reference).abs().amax(-1) / reference.abs().amax(-1)).max().item()
    assert relative <= logit_tolerance(torch.bfloat16, 1.0), relative
    result = agreement(reference, logits)
    # Measured on these 512 positions: top-1 99.0%, mean KL 5.5e-5 (whole essay: 99.3%, 5.5e-5;
    # bf16 activations on the whole essay: 97.8%, 5.8e-4).
    assert result.top1 >= 0.98 and result.mean_kl < 2e-4, result
