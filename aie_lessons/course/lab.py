"""How the course starts JupyterLab, written once for `make lab`, `aie lab` and the browser test.

The test must open the same JupyterLab a learner gets, so the command line is built here and
nowhere else. Choices, and why:

* loopback only, a free port and a fresh token: nothing on the network can reach the learner's
  kernel, which runs any code it is sent;
* the URL, token included, is printed by us before Jupyter starts, so the learner does not have
  to find it in Jupyter's own log;
* ``--allow-root`` only when running as root (containers): Jupyter refuses root without it;
* the notebooks' ``language_info`` is made the kernel's own first: JupyterLab writes it into a
  notebook as the kernel starts, and a notebook whose copy differs (another Python version than
  the one that built the course) would open marked modified before the learner touched it.
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
from pathlib import Path

import nbformat

from aie_lessons.infra.paths import REPO_ROOT

HOST = "127.0.0.1"
NOTEBOOKS_DIR = REPO_ROOT / "notebooks"
FIRST_PORT = 8888


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


def lab_url(port: int, token: str, path: str = "lab") -> str:
    return f"http://{HOST}:{port}/{path}?token={token}"


def lab_command(root_dir: Path, port: int, token: str, open_browser: bool = True) -> list[str]:
    """The ``jupyter lab`` command line that serves ``root_dir`` on loopback ``port`` with ``token``."""
    cmd = [sys.executable, "-m", "jupyterlab", f"--ServerApp.root_dir={root_dir}",
           f"--ServerApp.ip={HOST}", f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
           f"--IdentityProvider.token={token}"]
    if not open_browser:
        cmd.append("--no-browser")
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")
    return cmd


def kernel_language_info() -> dict:
    """What this Python's kernel reports about its language (ipykernel's own dict, not a copy)."""
    from ipykernel.ipkernel import IPythonKernel

    return dict(IPythonKernel.language_info)


def match_kernel_language(notebooks: list[Path]) -> list[Path]:
    """Give each notebook the kernel's ``language_info``; return those that needed it.

    Only that metadata key changes: cells, outputs and the learner's work are left as they are.
    """
    info, changed = kernel_language_info(), []
    for path in notebooks:
        nb = nbformat.read(path, as_version=4)
        if nb.metadata.get("language_info") != info:
            nb.metadata["language_info"] = info
            nbformat.write(nb, path)
            changed.append(path)
    return changed


def run_lab(root_dir: Path = NOTEBOOKS_DIR, port: int | None = None, open_browser: bool = True) -> int:
    """Serve the notebooks until Ctrl-C; print where to open them and how to stop first."""
    port = port or free_port()
    changed = match_kernel_language(sorted(root_dir.glob("*.ipynb")))
    if changed:
        print(f"{len(changed)} notebook(s) now name this kernel's Python "
              f"{kernel_language_info()['version']} (so they do not open marked modified)")
    token = secrets.token_hex(16)
    print(f"JupyterLab is starting on {root_dir}.\n"
          f"  Open: {lab_url(port, token)}\n"
          "  Stop: save your notebooks (Ctrl-S), then press Ctrl-C twice in this terminal.",
          flush=True)
    try:
        return subprocess.call(lab_command(root_dir, port, token, open_browser))
    except KeyboardInterrupt:  # the second Ctrl-C reaches us too: Jupyter has stopped, so do we
        return 0
