"""Stage 09's GPU section: its measurements run (in Triton's interpreter on a CPU, at small shapes,
which checks the harness and the kernels' numbers, not their speed) and say why they are skipped."""

from __future__ import annotations

import pytest
import torch

from aie_lessons.ceilings import best_seconds, copy_bandwidth, matmul_throughput
from aie_lessons.flash_attention import HAS_TRITON, interpreted
from aie_lessons.gpu_kernels import KernelTiming, flash_vs_sdpa, gpu_skip_reason, paged_vs_sdpa

needs_interpreter = pytest.mark.skipif(not (HAS_TRITON and interpreted()),
                                       reason="needs Triton's interpreter (TRITON_INTERPRET=1) on a CPU")
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CI has none)")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_without_a_gpu_the_section_says_why_it_is_skipped():
    assert gpu_skip_reason().startswith("skipped: no CUDA GPU")


@needs_interpreter
def test_the_flash_kernel_timing_runs_and_matches_sdpa():
    rows = flash_vs_sdpa((16, 40), batch=1, heads=4, kv_heads=2, head_dim=16, dtype=torch.float32, device="cpu")
    assert [r.shape for r in rows] == ["B=1 S=16", "B=1 S=40"]
    for row in rows:
        assert row.max_error < 1e-4 and row.ours_ms > 0 and row.torch_ms > 0
        assert row.bytes_read == (4 + 2 + 2) * int(row.shape.split("S=")[1]) * 16 * 4


@needs_interpreter
def test_the_paged_kernel_timing_runs_and_matches_the_gathered_reference():
    rows = paged_vs_sdpa((1, 3), context=20, block_size=8, heads=4, kv_heads=2, head_dim=16,
                         dtype=torch.float32, device="cpu")
    assert [r.shape for r in rows] == ["B=1 T=20", "B=3 T=20"]
    for row in rows:
        assert row.max_error < 1e-4
    assert rows[1].bytes_read == 2 * 3 * 20 * 2 * 16 * 4 + 3 * 4 * 16 * 4  # k and v of every row, and q


def test_a_timing_reads_its_speed_up_and_read_rate():
    row = KernelTiming("k", "s", ours_ms=2.0, torch_ms=3.0, bytes_read=4_000_000, max_error=0.0)
    assert row.speedup == 1.5 and row.read_rate(2.0) == 2e9


def test_the_ceilings_take_a_device():
    assert copy_bandwidth(8, 1, device="cpu") > 0
    assert matmul_throughput(torch.float32, 64, 1, device="cpu").per_second > 0
    assert best_seconds(lambda: None, 1, device="cpu") >= 0


@pytest.mark.gpu
@needs_gpu
def test_on_a_gpu_the_compiled_kernels_match_pytorch():
    for row in (flash_vs_sdpa((512,), 1, 9, 3, 64, torch.bfloat16, "cuda")
                + paged_vs_sdpa((4,), 300, 16, 9, 3, 64, torch.bfloat16, "cuda")):
        assert row.max_error < 0.05, row
