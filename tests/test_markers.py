"""The suite's own promises: a broken dev install fails instead of skipping, and the fast tests
need no model."""

from __future__ import annotations

import os
import subprocess
import sys

from aie_lessons.infra.paths import REPO_ROOT


def test_a_broken_transformers_install_fails_the_comparisons_instead_of_skipping_them(tmp_path):
    """The comparisons with transformers are the suite's oracle: without it they must not pass quietly."""
    (tmp_path / "transformers").mkdir()
    (tmp_path / "transformers" / "__init__.py").write_text("raise ImportError('a broken install')\n")
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/test_tiny_models.py", "-q", "-p", "no:cacheprovider"],
        cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(tmp_path)}, capture_output=True, text=True, timeout=300,
    )
    summary = out.stdout.strip().splitlines()[-1]
    assert out.returncode != 0 and "a broken install" in out.stdout, out.stdout[-2000:]
    assert "skipped" not in summary, summary


def test_every_test_using_the_real_model_is_marked_oracle():
    """`make test-fast` deselects `oracle`: any test that needs the model must carry the mark."""
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "tests", "-q", "--collect-only", "-m", "not oracle", "-p", "no:cacheprovider",
         "--fixtures-per-test"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stdout[-2000:]
    for fixture in ("real_model_dir", "gguf_file", "real_model", "gguf_reference"):
        assert f"{fixture} --" not in out.stdout and f"{fixture} [session scope]" not in out.stdout, fixture
