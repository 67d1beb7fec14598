"""The course's integer kernels (``aie_lessons/infra/int_kernels.cpp``) against PyTorch's CPU
kernels and the memory roofline, on the real model's block matrices.

One pass multiplies one input row by every block matrix of a decode step in order (30 layers ×
qkv, o, gate_up, down: stage 09's fused groups), the weights quantized by stage 08 — the bytes
of a step's layers, far more than the CPU's caches hold, so each pass reads them from memory as
a decode step does. Per scheme, the two kernels' passes take turns for ``--rounds`` rounds; the
medians are kept and the ratio taken within the run (this machine is shared and its speed
drifts). The roofline is the pass's bytes over the read bandwidth measured in the same run
(``roofline.read_bandwidth``).

    .venv/bin/python benchmarks/int_kernels.py [--schemes int4-g32,int8] [--rows 1,4] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from aie_lessons.ceilings import best_seconds
from aie_lessons.fast_decode import decode_modules
from aie_lessons.infra import int_kernels
from aie_lessons.infra.paths import default_model_dir
from aie_lessons.model import LlamaModel
from aie_lessons.quantize import QuantizedLinear, kernel_layout, kernel_matmul, quantize_model, scheme_named
from aie_lessons.roofline import read_bandwidth


def block_groups(model: LlamaModel) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Each fused group of the blocks' quantized layers as stacked (q, scale, zero)."""
    groups = []
    for group in decode_modules(model):
        if all(isinstance(layer, QuantizedLinear) for layer in group):
            groups.append(tuple(torch.cat([getattr(layer, name) for layer in group]) for name in ("q", "scale", "zero")))
    return groups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schemes", default="int4-g32,int8")
    parser.add_argument("--rows", default="1,4")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    reason = int_kernels.unavailable()
    if reason:
        print(f"skipped: {reason}")
        return
    print(f"threads: {torch.get_num_threads()}, PyTorch's CPU capability: {torch.backends.cpu.get_cpu_capability()}")
    for name in args.schemes.split(","):
        scheme = scheme_named(name)
        groups = block_groups(quantize_model(LlamaModel.from_pretrained(default_model_dir(), dtype=torch.bfloat16), scheme))
        if scheme.bits == 8:
            ours = [(int_kernels.tiled(q), scale) for q, scale, _ in groups]
            aie = lambda xs: [int_kernels.int8_linear(x, q, s) for x, (q, s) in zip(xs, ours)]  # noqa: E731
        else:
            ours = [int_kernels.int4_layout(*group) for group in groups]
            aie = lambda xs: [int_kernels.int4_linear(x, q, sl, scheme.group_size)  # noqa: E731
                              for x, (q, sl) in zip(xs, ours)]
        theirs = [kernel_layout(*group, scheme) for group in groups]
        pytorch = lambda xs: [kernel_matmul(x.to(torch.bfloat16), w, s, scheme).float()  # noqa: E731
                              for x, (w, s) in zip(xs, theirs)]
        our_bytes = sum(t.nbytes for pair in ours for t in pair)
        their_bytes = sum(t.nbytes for pair in theirs for t in pair)
        for rows in map(int, args.rows.split(",")):
            x = [torch.randn(rows, q.shape[1] * (2 if scheme.bits == 4 else 1)) for q, _, _ in groups]  # each input
            times = {"aie": [], "pytorch": []}
            for _ in range(args.rounds):
                times["aie"].append(best_seconds(lambda: aie(x), 3))
                times["pytorch"].append(best_seconds(lambda: pytorch(x), 3))
            bandwidth = read_bandwidth()[0]
            ours_s, theirs_s = statistics.median(times["aie"]), statistics.median(times["pytorch"])
            print(f"{name}, {rows} row(s), {len(groups)} matrices: "
                  f"course {ours_s * 1e3:.2f} ms ({our_bytes / 1e6:.0f} MB, {our_bytes / ours_s / 1e9:.1f} GB/s, "
                  f"{our_bytes / bandwidth / ours_s:.0%} of the roofline), "
                  f"PyTorch {theirs_s * 1e3:.2f} ms ({their_bytes / 1e6:.0f} MB, {their_bytes / theirs_s / 1e9:.1f} GB/s, "
                  f"{their_bytes / bandwidth / theirs_s:.0%}); course / PyTorch speed {theirs_s / ours_s:.2f}x; "
                  f"read bandwidth {bandwidth / 1e9:.1f} GB/s", flush=True)


if __name__ == "__main__":
    main()
