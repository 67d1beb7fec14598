"""Inductor's on-disk cache: a process that lowers the vector instructions keeps its own code."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from aie_lessons.infra.compile_cache import CAPABILITY_ENV, INDUCTOR_CACHE_ENV, cache_folder, cpp_compiler

# A decoder layer's shape in miniature — norm, two matmuls, SwiGLU — compiled through
# use_compile_cache, as `aie generate` does. It prints how far the compiled result is from eager.
SCRIPT = """
import sys
from pathlib import Path
from aie_lessons.infra.compile_cache import use_compile_cache
use_compile_cache(Path(sys.argv[1]))
import torch
torch.manual_seed(0)
w1, w2, w3 = torch.randn(64, 64), torch.randn(256, 64), torch.randn(64, 128)
def layer(x):
    h = x + x @ w1.t()
    n = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)
    gate, up = (n @ w2.t()).chunk(2, -1)
    return h + (torch.nn.functional.silu(gate) * up) @ w3.t()
x = torch.randn(4, 64)
print(float((torch.compile(layer)(x) - layer(x)).abs().max()))
"""


def test_cache_folder_is_the_base_unless_the_instruction_set_is_lowered(monkeypatch, tmp_path):
    monkeypatch.delenv(CAPABILITY_ENV, raising=False)
    assert cache_folder(tmp_path) == tmp_path
    monkeypatch.setenv(CAPABILITY_ENV, "AVX2")
    assert cache_folder(tmp_path) == tmp_path / "capability-avx2"
    monkeypatch.setenv(CAPABILITY_ENV, "")
    assert cache_folder(tmp_path) == tmp_path


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="ATEN_CPU_CAPABILITY=avx2 is x86's")
def test_code_compiled_for_avx2_is_not_loaded_by_a_process_that_picks_the_cpus_best(tmp_path):
    """The regression behind a CI run that aborted: a test run emulating an AVX2-only CPU filled the
    machine's shared cache, and the next run, on the same AVX-512 CPU without the variable, loaded
    that code and crashed. Run both, one after the other, on one folder. (On a CPU whose best is
    AVX2 both pick the same code and this cannot tell; it fails on an AVX-512 one without the fix.)"""
    if cpp_compiler() is None:
        pytest.skip("no C++ compiler: torch.compile cannot build for the CPU here")
    folder = tmp_path / "inductor"
    env = {k: v for k, v in os.environ.items() if k not in (CAPABILITY_ENV, INDUCTOR_CACHE_ENV)}
    for capability in ("avx2", None):
        run_env = {**env, CAPABILITY_ENV: capability} if capability else env
        done = subprocess.run([sys.executable, "-c", SCRIPT, str(folder)], env=run_env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"ATEN_CPU_CAPABILITY={capability}: exit {done.returncode}\n{done.stderr[-2000:]}"
        assert float(done.stdout.strip().splitlines()[-1]) < 1e-3, done.stdout
    assert (folder / "capability-avx2").is_dir() and any(p.name != "capability-avx2" for p in folder.iterdir())
