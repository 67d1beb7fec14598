"""Flash attention TFLOP/s: our Triton kernel vs PyTorch's SDPA across sequence lengths (GPU).

Both run in the same process on the same inputs, interleaved (one call of each per repeat, each
timed by CUDA events), so that a clock or load change on a busy machine hits both alike and the
ratio stays meaningful. Causal attention does half the work of full attention: FLOPs = 2 · 2·B·H·S²·D / 2.

    .venv/bin/python benchmarks/flash_attention.py [--dtype bfloat16] [--head-dim 64]
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=["float16", "bfloat16"], default="bfloat16")
    parser.add_argument("--head-dim", type=int, default=64, choices=[64, 128])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("skipped: this benchmark needs a CUDA GPU (compiled Triton); on a CPU the kernel "
              "runs only in Triton's interpreter, which is for correctness, not speed")
        return 0
    from aie_lessons.flash_attention import HAS_TRITON, gpu_milliseconds, triton_flash_attention

    if not HAS_TRITON:
        print("skipped: triton is not installed")
        return 0
    dtype = getattr(torch, args.dtype)
    print(f"{torch.cuda.get_device_name()}, {args.dtype}, B={args.batch}, Hq={args.heads}, "
          f"Hkv={args.kv_heads}, D={args.head_dim}, causal")
    print(f"{'seq':>6} {'ours TFLOP/s':>13} {'SDPA TFLOP/s':>13} {'ours / SDPA':>12}")
    for seq in (512, 1024, 2048, 4096, 8192, 16384):
        shape_q = (args.batch, args.heads, seq, args.head_dim)
        shape_kv = (args.batch, args.kv_heads, seq, args.head_dim)
        q = torch.randn(shape_q, device="cuda", dtype=dtype)
        k, v = torch.randn(shape_kv, device="cuda", dtype=dtype), torch.randn(shape_kv, device="cuda", dtype=dtype)
        flops = 2 * 2 * args.batch * args.heads * seq * seq * args.head_dim / 2
        ours, sdpa = gpu_milliseconds([
            lambda: triton_flash_attention(q, k, v, causal=True),
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)])
        print(f"{seq:>6} {flops / ours / 1e9:>13.1f} {flops / sdpa / 1e9:>13.1f} {sdpa / ours:>12.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
