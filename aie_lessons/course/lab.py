"""How the course starts JupyterLab, written once for `make lab`, `aie lab` and the browser test.

The test must open the same JupyterLab a learner gets, so the command line is built here and
nowhere else. Choices, and why:

* loopback only, and a fresh token passed in the environment (a command line is readable by
  every user of the machine through ``ps``): nothing else can reach the learner's kernel, which
  runs any code it is sent;
* the URL, token included, is printed by us before Jupyter starts, so the learner does not have
  to find it in Jupyter's own log; ``port_retries=0`` keeps that URL true (Jupyter would
  otherwise move to another port and the printed one would lead nowhere);
* Jupyter *replaces* this process (exec), so Ctrl-C, SIGTERM and the exit status are Jupyter's
  own: it asks before stopping, and shuts its kernels down cleanly;
* ``--allow-root`` only when running as root (containers): Jupyter refuses root without it;
* the course notebooks' ``language_info`` is made the kernel's own first: JupyterLab writes it
  into a notebook as the kernel starts, and a notebook whose copy differs (another Python
  version than the one that built the course) would open marked modified before any edit.
"""

from __future__ import annotations

import os
import secrets
import socket
import sys
import tempfile
from pathlib import Path
from typing import NoReturn

import nbformat

from aie_lessons.course.build import NOTEBOOKS_DIR, kernel_language_info

HOST = "127.0.0.1"
FIRST_PORT = 8888
TOKEN_ENV = "JUPYTER_TOKEN"


def free_port(start: int = FIRST_PORT, tries: int = 100) -> int:
    """The first port from ``start`` that nothing listens on at the loopback address."""
    for port in range(start, start + tries):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((HOST, port))
            except OSError:
                continue
            return port
    raise OSError(f"no free port in {start}–{start + tries - 1} on {HOST}. Fix: stop an old Jupyter "
                  "server (`jupyter server list` shows them) or pass --port")


def lab_url(port: int, token: str) -> str:
    return f"http://{HOST}:{port}/lab?token={token}"


def lab_command(root_dir: Path, port: int, open_browser: bool = True) -> list[str]:
    """The ``jupyter lab`` command line serving ``root_dir`` on loopback ``port``; the token goes
    in the environment (``TOKEN_ENV``), never here."""
    cmd = [sys.executable, "-m", "jupyterlab", f"--ServerApp.root_dir={root_dir}",
           f"--ServerApp.ip={HOST}", f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
           "--ServerApp.base_url=/"]
    if not open_browser:
        cmd.append("--no-browser")
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")
    return cmd


def course_notebooks(root_dir: Path) -> list[Path]:
    """The stage notebooks (``NN_name.ipynb``): the learner's other notebooks are not ours to edit."""
    return sorted(root_dir.glob("[0-9][0-9]_*.ipynb"))


def match_kernel_language(notebooks: list[Path]) -> tuple[list[Path], list[str]]:
    """Give each notebook the kernel's ``language_info``; return those changed, and problems.

    Only that metadata key changes, and the new file replaces the old in one step (a crash
    half-way cannot cost the learner their work). A notebook that cannot be read is left as it
    is and named, so JupyterLab still starts and the learner can open it there to mend it.
    """
    info, changed, problems = kernel_language_info(), [], []
    for path in notebooks:
        try:
            nb = nbformat.read(path, as_version=4)
        except (OSError, ValueError) as exc:  # unreadable, not JSON, not UTF-8: named, left alone
            problems.append(f"{path.name} is not a readable notebook ({type(exc).__name__}: {exc}); "
                            "left as it is. Fix: open it in JupyterLab or restore it with git")
            continue
        if nb.metadata.get("language_info") == info:
            continue
        nb.metadata["language_info"] = info
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".ipynb.tmp", delete=False,
                                         encoding="utf-8") as tmp:
            try:
                nbformat.write(nb, tmp)
            except BaseException:
                os.unlink(tmp.name)  # the learner's notebook is untouched; leave no half-written copy
                raise
        os.replace(tmp.name, path)
        changed.append(path)
    return changed, problems


def run_lab(root_dir: Path = NOTEBOOKS_DIR, port: int | None = None, open_browser: bool = True) -> NoReturn:
    """Print where to open the notebooks and how to stop, then become JupyterLab (never returns)."""
    port = port or free_port()
    token = secrets.token_hex(16)
    changed, problems = match_kernel_language(course_notebooks(root_dir))
    python = kernel_language_info()["version"]
    for problem in problems:
        print(f"aie lab: warning: {problem}", file=sys.stderr)
    if changed:
        print(f"{len(changed)} notebook(s) now name this kernel's Python {python} "
              "(so they do not open marked modified)")
    print(f"JupyterLab is starting on {root_dir}.\n"
          f"  Open: {lab_url(port, token)}\n"
          "  Stop: save your notebooks (Ctrl-S), then press Ctrl-C in this terminal and answer y.",
          flush=True)
    cmd = lab_command(root_dir, port, open_browser)
    os.execve(cmd[0], cmd, {**os.environ, TOKEN_ENV: token})
