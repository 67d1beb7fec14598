"""Paged decode attention on a GPU: stage 07's Triton kernel vs gathering the blocks and calling
PyTorch's SDPA (what the engine does without the kernel), at several batch sizes and contexts.

Both run in one process on the same pool, interleaved (CUDA events, one call of each per repeat),
so a clock or load change hits both alike. A decode kernel's work is reading the cache, so beside
the times it prints the bytes read per second as a share of the GPU's read ceiling (a sum over
1 GiB), and the largest difference from the fp32 reference.

    .venv/bin/python benchmarks/paged_attention.py [--dtype bfloat16] [--block-size 16]
"""

from __future__ import annotations

import argparse
import sys

import torch

from aie_lessons.gpu_kernels import gpu_read_bandwidth, gpu_skip_reason, paged_vs_sdpa


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=["float16", "bfloat16"], default="bfloat16")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--heads", type=int, default=9, help="query heads (SmolLM2-135M: 9)")
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    args = parser.parse_args()
    reason = gpu_skip_reason()
    if reason:
        print(reason)
        return 0
    read = gpu_read_bandwidth()
    print(f"{torch.cuda.get_device_name()}, {args.dtype}, Hq={args.heads}, Hkv={args.kv_heads}, D={args.head_dim}, "
          f"blocks of {args.block_size}; read ceiling {read / 1e9:.0f} GB/s")
    print(f"{'shape':<16} {'ours ms':>9} {'gather+SDPA ms':>15} {'speed-up':>9} {'ours % read':>12} {'max diff':>9}")
    for context in (512, 2048, 8192):
        for row in paged_vs_sdpa((1, 16, 64, 256), context, args.block_size, args.heads, args.kv_heads,
                                 args.head_dim, getattr(torch, args.dtype), "cuda"):
            print(f"{row.shape:<16} {row.ours_ms:>9.3f} {row.torch_ms:>15.3f} {row.speedup:>9.2f} "
                  f"{row.read_rate(row.ours_ms) / read:>12.0%} {row.max_error:>9.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
