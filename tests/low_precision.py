"""Comparing low-precision results with fp32 in a way that holds on every CPU CI may get.

bf16 results differ between CPU families (AMD Zen 4 rounds with AVX-512 BF16, Intel Xeon with
AMX, each in its own order), so no test may expect exact bf16 logits or tokens. Two rules,
used by every test that compares a low-precision model with an fp32 one:

* logits agree within ``logit_tolerance(dtype, scale)``;
* greedy tokens agree only while the reference's choice is *decisive*: up to the first step
  where fp32's best two logits are closer than ``margin_tolerance(dtype, scale)``. After that
  step the two paths may part, and nothing more is compared.

Both bounds are eps(dtype) × the largest |logit| at that position times a factor set from a
measurement: the course model in bf16 (bf16 weights, fp32 activations, the default) against
fp32 on the 1,792 positions of ``data/prose/lighthouses.txt``, teacher-forced without a KV
cache. Only the stored weights are rounded there, identically on every CPU family; a bf16 KV
cache rounds k and v as well, which the cached tests show stays within the same bounds.
"""

from __future__ import annotations

import torch

# fp32 results also differ, by summation order, between implementations and BLAS builds: 1e-4 is
# the bound our fp32 logits hold to against transformers' (tests/test_oracle_transformers.py).
FP32_ORDER_ERROR = 1e-4


def logit_tolerance(dtype: torch.dtype, scale: float) -> float:
    """The largest error accepted on any one logit, where the largest |logit| is ``scale``.

    Measured: at most 1.17 × eps × scale (99% of positions under 0.94); allowed: 2 ×.
    Never below ``FP32_ORDER_ERROR``: fp32 itself differs by summation order.
    """
    return max(2 * torch.finfo(dtype).eps * scale, FP32_ORDER_ERROR)


def margin_tolerance(dtype: torch.dtype, scale: float) -> float:
    """The largest change accepted in the gap between the two best logits.

    Much smaller than twice the per-logit error: rounding moves neighbouring logits together,
    and a shared shift changes no ranking. Measured: at most 0.44 × eps × scale; allowed: 1 ×.
    """
    return max(torch.finfo(dtype).eps * scale, 2 * FP32_ORDER_ERROR)


def decisive_steps(reference_logits: torch.Tensor, dtype: torch.dtype) -> int:
    """How many leading greedy steps of ``reference_logits`` (steps, vocab) ``dtype`` cannot flip:
    the index of the first step whose top-2 gap is within ``margin_tolerance``."""
    for step, logits in enumerate(reference_logits.float()):
        best, second = logits.topk(2).values.tolist()
        if best - second <= margin_tolerance(dtype, logits.abs().max().item()):
            return step
    return reference_logits.shape[0]


def assert_greedy_agrees(
    tokens: list[int], reference_tokens: list[int], reference_logits: torch.Tensor, dtype: torch.dtype
) -> int:
    """Assert ``tokens`` equal ``reference_tokens`` over the decisive steps; return how many.

    ``reference_logits`` (steps, vocab) are the fp32 logits each reference token was chosen
    from. The first non-decisive step is not compared: there a ``dtype`` model may legally
    pick the runner-up, and every later step then continues a different text.
    """
    steps = decisive_steps(reference_logits, dtype)
    ours, theirs = tokens[:steps], reference_tokens[:steps]
    if ours != theirs:
        first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
        raise AssertionError(
            f"{dtype} tokens differ from the fp32 reference at step {first} of {steps} decisive "
            f"steps: {ours[first:first + 5]} vs {theirs[first:first + 5]}"
        )
    return steps


def int8_input_tolerance(decoder, logits: torch.Tensor) -> float:
    """How far a compiled quantized decoder's logits may lie from the eager ones. The course's
    integer kernels (``KernelMatrix.kernel == "aie"``) round each input to int8 in steps of 1/127
    of its block's largest value: the compiled step's inputs, a float rounding away from the
    eager ones, can land on the next step, so the two agree within that rounding (3/127 of the
    largest logit), not to float precision (1e-4, PyTorch's kernels with bf16 inputs)."""
    return 3 / 127 * logits.abs().max().item() if decoder.layers[0].qkv.kernel == "aie" else 1e-4
