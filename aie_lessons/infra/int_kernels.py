"""The course's integer matrix products for quantized decode on x86 CPUs (``int_kernels.cpp``).

Why the course has its own: PyTorch's CPU kernels for int8 and int4 weights turn every weight
into a float before multiplying, and without AVX-512 that conversion is the whole cost. Measured
on an AVX2-only AMD Zen 3, the 30 layers of an int4-g32 step took 11.5 ms in
``_weight_int4pack_mm_for_cpu`` for 66 MB of weights: 5.4 GB/s, compute-bound, while a plain bf16
head streamed at 18 GB/s. Integer arithmetic does not need the conversion: the activations are
rounded to int8 in blocks of 32 (one float scale a block, as llama.cpp's Q8_0 does), and one AVX2
instruction multiplies 32 weight bytes by 32 activation bytes. That rounding adds an error of
about 1 % of a product's largest output to the weights' own (tests bound it); in exchange the
products read their bytes 2.5–2.7 times as fast as PyTorch's at one input row on that Zen 3
(``benchmarks/int_kernels.py``, side by side), though still at half the read bandwidth or less.

The weights are regrouped once, when a decoder is built (``tiled``, ``int4_layout``): four
rows of a weight make a tile whose blocks of 32 columns are interleaved, so the kernel keeps four
independent sums going for each input row while it reads one run of bytes front to back (a row
at a time, each sum waited for the one before it; four rows read side by side in stage 08's
order ran slower still). Against the row-at-a-time kernels, side by side on the same Zen 3, a
pass over a step's weights took 1.11 (int8) and 1.55 (int4) times less time at one input row,
about 1.2 times less at 4 and 16.
A layer whose outputs are not whole tiles of four, or whose width is not whole blocks, does not
``fit`` and keeps PyTorch's kernel.

The products are C++ registered as PyTorch operators (``torch.ops.aie.int4_linear`` and
``int8_linear``), built with the machine's C++ compiler at first use and kept in
``data/cache/int_kernels``. Registered operators with a fake (shape-only) implementation go
through ``torch.compile``, ``torch.export`` and AOTInductor like PyTorch's own. Where they cannot
exist (no AVX2, not x86, no compiler), ``unavailable()`` says why and the callers keep PyTorch's
kernels.
"""

from __future__ import annotations

import os
import platform
import shutil
import threading
import time
from functools import cache
from pathlib import Path

import torch

from aie_lessons.infra.paths import CACHE_DIR
from aie_lessons.quantize import INT4_MIN, unpack_int4

SOURCE = Path(__file__).with_name("int_kernels.cpp")
BUILD_DIR = CACHE_DIR / "int_kernels"
BLOCK = 32  # the activations' int8 blocks: an input width must be a multiple of this
TILE = 4  # the weights' tiles of output rows: an output width must be a multiple of this
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]  # OpenMP: at::parallel_for's threads
STALE_LOCK_S = 600  # a build takes ~15 s: a lock file this old was left by a killed build
_lock = threading.Lock()


@cache
def unavailable() -> str | None:
    """Why the integer kernels cannot run in this process (None: they are loaded and ready).
    The first call on a machine compiles them (~15 s), later ones load the build."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the course's integer kernels are written for x86 AVX2, and this CPU is {platform.machine()}"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        return f"the course's integer kernels need AVX2, and PyTorch runs this CPU at {capability}"
    from aie_lessons.infra.compile_cache import cpp_compiler

    if cpp_compiler() is None:
        return "the course's integer kernels are built with a C++ compiler, and there is none (install g++)"
    with _lock:
        try:
            _build()
        except (OSError, RuntimeError, ImportError) as error:  # a failed build: PyTorch's kernels instead
            return f"building the course's integer kernels failed ({error}); PyTorch's kernels are used"
    return None


def _build() -> None:
    """Compile (or load the cached build of) ``int_kernels.cpp`` and register the operators' fake
    implementations: the shapes ``torch.compile`` and ``torch.export`` trace with."""
    from torch.utils.cpp_extension import load

    folder = BUILD_DIR / f"torch-{torch.__version__}"
    folder.mkdir(parents=True, exist_ok=True)
    # PyTorch's builder waits, without a word and without end, for the lock file of a build in
    # progress; a build killed outright (SIGKILL, out of memory) leaves the file behind.
    lock = folder / "lock"
    if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
        lock.unlink(missing_ok=True)
    if shutil.which("ninja") is None:  # the builder runs `ninja`: the PyPI package's, unless the venv is active
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    load(name="aie_int_kernels", sources=[str(SOURCE)], extra_cflags=FLAGS, extra_ldflags=["-fopenmp"],
         build_directory=str(folder), is_python_module=False)

    @torch.library.register_fake("aie::int4_linear")
    def _(x: torch.Tensor, q: torch.Tensor, scale_low: torch.Tensor, group: int) -> torch.Tensor:
        torch._check(x.shape[1] == q.shape[1] * 2 * BLOCK, lambda: "aie::int4_linear: x's width is not the weight's")
        return x.new_empty(x.shape[0], q.shape[0] * TILE, dtype=torch.float32)

    @torch.library.register_fake("aie::int8_linear")
    def _(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        torch._check(x.shape[1] == q.shape[1] * BLOCK, lambda: "aie::int8_linear: x's width is not the weight's")
        return x.new_empty(x.shape[0], q.shape[0] * TILE, dtype=torch.float32)


def fits(bits: int, group_size: int, in_features: int, out_features: int) -> bool:
    """Whether the kernels take a layer: its outputs in whole tiles of 4, its input width in
    whole blocks of 32 (int4: in whole pairs of blocks, as its layout stores them), and int4
    groups made of whole blocks."""
    if out_features % TILE:
        return False
    if bits == 8:
        return in_features % BLOCK == 0
    return in_features % (2 * BLOCK) == 0 and group_size % BLOCK == 0


def tiled(rows: torch.Tensor) -> torch.Tensor:
    """(out, in) bytes as the kernels read them, (out / 4, in / 32, 4, 32): the four rows of a
    tile interleaved block by block, so the kernel reads a tile of four outputs as one stream.
    Stage 08's int8 weight goes to ``int8_linear`` so (its per-row scales as they are);
    ``int4_layout`` tiles its packed bytes the same way."""
    out, width = rows.shape
    if out % TILE or width % BLOCK:
        raise ValueError(f"a ({out}, {width}) weight does not split into tiles of {TILE} rows and blocks of "
                         f"{BLOCK} columns: check int_kernels.fits before choosing these kernels")
    return rows.reshape(out // TILE, TILE, width // BLOCK, BLOCK).transpose(1, 2).contiguous()


def int4_layout(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 08's int4 weight (packed ``q``, per-group ``scale`` and ``zero``) as ``int4_linear``
    reads it. The levels 0 … 15 (stage 08's ``q`` shifted by 8) are packed anew in pairs of
    blocks: byte i of each 32 holds level i of one block of 32 columns in its low four bits and
    level i of the next block in its high four — so the kernel unpacks 64 weights with one
    shift and two masks, where stage 08's order (neighbouring columns share a byte) needs the
    activations reordered and twice the instructions — and the rows are ``tiled``. Per group a
    float16 (scale, low) pair gives ``w = level × scale + low``; a tile keeps its four rows'
    scales, then their four lows, so one instruction makes four floats of them.
    float16 keeps the pair at 4 bytes a group (PyTorch's layout stores bf16 pairs, the same
    size) with 3 more bits of precision than bf16; a model's weights lie far inside its range."""
    rows, columns = q.shape[0], q.shape[1] * 2
    if columns % (2 * BLOCK) or rows % TILE:
        raise ValueError(f"a ({rows}, {columns}) int4 weight does not split into tiles of {TILE} rows and pairs of "
                         f"blocks of {BLOCK} columns: check int_kernels.fits before choosing these kernels")
    levels = (unpack_int4(q) - INT4_MIN).to(torch.uint8).reshape(rows, columns // (2 * BLOCK), 2, BLOCK)
    paired = tiled((levels[:, :, 0] | (levels[:, :, 1] << 4)).reshape(rows, columns // 2))
    pairs = torch.stack([scale, zero - 8 * scale], dim=-1).to(torch.float16)  # (rows, groups, 2)
    return paired, pairs.reshape(rows // TILE, TILE, -1, 2).permute(0, 2, 3, 1).contiguous()


def int4_linear(x: torch.Tensor, q: torch.Tensor, scale_low: torch.Tensor, group_size: int) -> torch.Tensor:
    """x (rows, in) float32 times an ``int4_layout`` weight -> (rows, out) float32."""
    return torch.ops.aie.int4_linear(x.float().contiguous(), q, scale_low, group_size)


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (rows, in) float32 times a ``tiled`` int8 weight with a float32 ``scale`` per row -> float32."""
    return torch.ops.aie.int8_linear(x.float().contiguous(), q, scale.float().contiguous())
