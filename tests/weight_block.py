"""Whether a quantized decoder's integers lie in its one block (``fast_decode.pack_quantized``)."""

from __future__ import annotations

from typing import Any

import torch

from aie_lessons.fast_decode import KernelMatrix


def assert_in_one_block(block: torch.Tensor, matrices: list[Any]) -> None:
    """Every course-kernel matrix of ``matrices`` (tuples of mixed schemes included) is a view of
    ``block`` starting on a cache line, and no two overlap."""
    kernels = [m for item in matrices for m in (item if isinstance(item, tuple) else (item,))
               if isinstance(m, KernelMatrix) and m.kernel == "aie"]
    assert kernels, "no matrix is read by the course's kernels"
    spans = sorted((m.weights.data_ptr(), m.weights.data_ptr() + m.weights.nbytes) for m in kernels)
    start, end = block.data_ptr(), block.data_ptr() + block.nbytes
    assert all(start <= a < b <= end and (a - start) % 64 == 0 for a, b in spans), "a matrix outside the block"
    assert all(b <= c for (_, b), (c, _) in zip(spans, spans[1:])), "two matrices overlap"
