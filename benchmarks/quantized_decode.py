"""Decode speed of stage 08's quantized models against fp32 and bf16, at batch 1 and 16.

Every variant generates the same greedy continuation with stage 04's ``generate_cached``
(``ignore_eos``, so every run decodes the same number of steps); decode tokens/s is the batch
over the median decode step. The variants take turns within each round, and each ratio is
taken against the fp32 run of the same round, then the median over rounds is shown: the
machine's memory bandwidth drifts from second to second, and turns keep the comparison fair.

The quantized variants compute in bf16, where PyTorch's CPU integer kernels apply (at most
``KERNEL_MAX_ROWS`` rows per step); "int8, plain path" is the same model without them.

    .venv/bin/python benchmarks/quantized_decode.py [--tokens 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from aie_lessons.cached_generate import generate_cached
from aie_lessons.infra.paths import default_model_dir
from aie_lessons.model import LlamaModel
from aie_lessons.quantize import quantize_model
from aie_lessons.sampling import SamplingParams
from aie_lessons.tokenizer import Tokenizer

PROMPT = "Write a long story about a lighthouse keeper and the sea."
BATCHES = (1, 16)


def variants(model_dir) -> dict[str, LlamaModel]:
    bf16 = torch.bfloat16
    fresh = lambda: LlamaModel.from_pretrained(model_dir, activations=bf16)  # noqa: E731
    return {
        "fp32": LlamaModel.from_pretrained(model_dir),
        "bf16": LlamaModel.from_pretrained(model_dir, dtype=bf16, activations=bf16),
        "int8, plain path": quantize_model(fresh(), "int8", kernels=False),
        "int8": quantize_model(fresh(), "int8"),
        "int4-g32": quantize_model(fresh(), "int4-g32"),
    }


def decode_rate(model: LlamaModel, tokenizer: Tokenizer, batch: int, tokens: int) -> float:
    """Tokens per second of the decode steps: ``batch`` over the median step."""
    ids = tokenizer.encode(PROMPT)
    params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    result = generate_cached(model, tokenizer, [ids] * batch, params)[0]
    return batch / statistics.median(result.step_seconds[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per request")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    model_dir = default_model_dir()
    tokenizer = Tokenizer.from_pretrained(model_dir)
    models = variants(model_dir)
    rates: dict[tuple[str, int], list[float]] = {(name, b): [] for name in models for b in BATCHES}
    ratios: dict[tuple[str, int], list[float]] = {(name, b): [] for name in models for b in BATCHES}
    with torch.inference_mode():
        for name, model in models.items():  # warm-up: first calls make the kernels' weight layout
            decode_rate(model, tokenizer, 1, 2)
        for round_index in range(args.rounds):
            for batch in BATCHES:
                measured = {name: decode_rate(model, tokenizer, batch, args.tokens) for name, model in models.items()}
                for name, rate in measured.items():
                    rates[name, batch].append(rate)
                    ratios[name, batch].append(rate / measured["fp32"])
            print(f"round {round_index + 1} of {args.rounds} done", flush=True)
    print(f"\ndecode tokens/s (median of {args.rounds} rounds) and × fp32 (median of per-round ratios)")
    print(f"{'':<18}" + "".join(f"{f'batch {b}':>12}{'× fp32':>8}" for b in BATCHES))
    for name in models:
        print(f"{name:<18}" + "".join(f"{statistics.median(rates[name, b]):12.1f}"
                                      f"{statistics.median(ratios[name, b]):8.2f}" for b in BATCHES))


if __name__ == "__main__":
    main()
