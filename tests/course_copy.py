"""A throwaway copy of the course, for tests of commands that write the package (commit, reset).

The copy holds the package, the stage sources, the notebooks and the README; Python code run in
it (``run_in``) imports the copy's ``aie_lessons``, whose paths point into the copy, so nothing
under the real checkout is ever written. The model is the real one, named by AIE_MODEL_DIR.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from aie_lessons.infra.paths import REPO_ROOT, default_model_dir


def copy_course(destination: Path) -> Path:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(REPO_ROOT / "aie_lessons", destination / "aie_lessons", ignore=ignore)
    shutil.copytree(REPO_ROOT / "notebooks", destination / "notebooks", ignore=ignore)
    shutil.copytree(REPO_ROOT / "solutions", destination / "solutions", ignore=ignore)
    shutil.copy(REPO_ROOT / "README.md", destination / "README.md")
    return destination


def course_env(course: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(course), "AIE_MODEL_DIR": str(default_model_dir())}


def run_in(course: Path, code: str) -> object:
    """Run ``code`` in a fresh Python inside the copy; it must print one JSON value last."""
    guard = (f"import aie_lessons\nassert aie_lessons.__file__.startswith({str(course)!r}), "
             "'the copy must be the package imported, or the test would write the real one'\n")
    out = subprocess.run([sys.executable, "-c", guard + code], cwd=course, env=course_env(course),
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])
