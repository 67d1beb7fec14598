"""Where ``torch.compile`` keeps what it compiled, so that only a machine's first run pays for it.

Inductor caches the code it generates (and the compiled libraries) on disk, keyed by the graph,
the PyTorch version and the machine; dynamo still traces the Python in every process, which
takes seconds, but the C++ compiler — most of a first run's wait — does not run again. The
course keeps that cache in ``data/cache/inductor`` beside its other derived files (``make clean``
removes it) rather than in a temporary folder that a reboot may empty.

One thing the cache's key leaves out (PyTorch 2.13): inductor writes vector code for the
instruction set ``ATEN_CPU_CAPABILITY`` names, when it is set, instead of the CPU's best. Code
compiled under ``ATEN_CPU_CAPABILITY=avx2`` and then loaded by a process on the same AVX-512 CPU
without it corrupted memory and aborted the step ("malloc(): unaligned tcache chunk detected"). So
a process with that variable set keeps its compiled code in a subfolder of its own.
"""

from __future__ import annotations

import os
from pathlib import Path

from aie_lessons.infra.paths import CACHE_DIR

INDUCTOR_CACHE = CACHE_DIR / "inductor"
INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
CAPABILITY_ENV = "ATEN_CPU_CAPABILITY"


def cache_folder(base: Path) -> Path:
    """``base``, or its subfolder for the instruction set this process asked for with
    ``ATEN_CPU_CAPABILITY``: what inductor compiled for one must never be loaded for another."""
    capability = os.environ.get(CAPABILITY_ENV, "").strip().lower()
    return base / f"capability-{capability}" if capability else base


def use_compile_cache(path: Path | None = None) -> Path:
    """Point inductor's on-disk cache at ``path`` (default ``data/cache/inductor``; ``cache_folder``
    of it) unless the user chose a folder already, and return the folder in use. Call it before
    anything imports ``torch._inductor``: importing it settles the folder (its default is in /tmp)."""
    os.environ.setdefault(INDUCTOR_CACHE_ENV, str(cache_folder(path or INDUCTOR_CACHE)))
    folder = Path(os.environ[INDUCTOR_CACHE_ENV])
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def cpp_compiler() -> str | None:
    """The C++ compiler inductor would run on the CPU (``CXX`` or its defaults), or None where
    there is none: then the compiled decoder cannot be built, and the eager loop is the way."""
    from torch._inductor import cpp_builder, exc

    try:
        return cpp_builder.get_cpp_compiler()
    except exc.InvalidCxxCompiler:
        return None
