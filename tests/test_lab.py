"""`aie lab`'s pieces: the command line, the port, and notebooks that open unmodified."""

from __future__ import annotations

import socket

import nbformat

from aie_lessons.course.build import NOTEBOOKS_DIR, SOLUTIONS_DIR
from aie_lessons.course.lab import HOST, free_port, kernel_language_info, lab_command, match_kernel_language


def test_lab_listens_on_loopback_only_with_a_token(tmp_path):
    cmd = lab_command(tmp_path, 8890, "secret", open_browser=False)
    assert f"--ServerApp.ip={HOST}" in cmd and HOST == "127.0.0.1"
    assert "--IdentityProvider.token=secret" in cmd
    assert "--ServerApp.port=8890" in cmd and "--ServerApp.port_retries=0" in cmd  # the port printed is the one used
    assert f"--ServerApp.root_dir={tmp_path}" in cmd and "--no-browser" in cmd


def test_free_port_skips_a_port_in_use():
    with socket.socket() as taken:
        taken.bind((HOST, 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert free_port(port) > port


def test_each_learner_notebook_names_the_kernel_its_solution_ran_on():
    # JupyterLab writes the kernel's language_info as it opens a notebook: without the same one
    # already there, the notebook opens marked modified (the browser test sees the tab).
    for learner in sorted(NOTEBOOKS_DIR.glob("[0-9][0-9]_*.ipynb")):
        solution = nbformat.read(SOLUTIONS_DIR / learner.name, as_version=4)
        info = nbformat.read(learner, as_version=4).metadata.get("language_info")
        assert info and info == solution.metadata["language_info"], learner.name


def test_matching_the_kernel_changes_that_key_only_and_once(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1", id="a"),
                                         nbformat.v4.new_markdown_cell("text", id="b")])
    nb.metadata["language_info"] = {**kernel_language_info(), "version": "3.9.0"}
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    other = tmp_path / "other.ipynb"
    nbformat.write(nb, tmp_path / "old.ipynb")
    nb.metadata["language_info"] = kernel_language_info()
    nbformat.write(nb, other)
    before = other.read_text()

    assert match_kernel_language([tmp_path / "old.ipynb", other]) == [tmp_path / "old.ipynb"]
    assert (tmp_path / "old.ipynb").read_text() == before  # now the same file as the matching one
    assert match_kernel_language([tmp_path / "old.ipynb", other]) == []
