"""Where ``torch.compile`` keeps what it compiled, so that only a machine's first run pays for it.

Inductor caches the code it generates (and the compiled libraries) on disk, keyed by the graph,
the PyTorch version and the machine; dynamo still traces the Python in every process, which
takes seconds, but the C++ compiler — most of a first run's wait — does not run again. The
course keeps that cache in ``data/cache/inductor`` beside its other derived files (``make clean``
removes it) rather than in a temporary folder that a reboot may empty.
"""

from __future__ import annotations

import os
from pathlib import Path

from aie_lessons.infra.paths import CACHE_DIR

INDUCTOR_CACHE = CACHE_DIR / "inductor"
INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def use_compile_cache(path: Path | None = None) -> Path:
    """Point inductor's on-disk cache at ``path`` (default ``data/cache/inductor``) unless the user
    chose a folder already, and return the folder in use. Call it before anything imports
    ``torch._inductor``: importing it settles the folder (its default is in /tmp)."""
    os.environ.setdefault(INDUCTOR_CACHE_ENV, str(path or INDUCTOR_CACHE))
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
