"""`aie lab`'s pieces: the command line, the port, and notebooks that open unmodified."""

from __future__ import annotations

import socket

import nbformat
import pytest

from aie_lessons.course.build import NOTEBOOKS_DIR, SOLUTIONS_DIR, kernel_language_info, language_info
from aie_lessons.course.lab import HOST, course_notebooks, free_port, lab_command, match_kernel_language


def test_lab_listens_on_loopback_only_and_keeps_the_token_off_the_command_line(tmp_path):
    cmd = lab_command(tmp_path, 8890, open_browser=False)
    assert f"--ServerApp.ip={HOST}" in cmd and HOST == "127.0.0.1"
    assert not any("token" in arg.lower() for arg in cmd)  # `ps` shows a command line to every user
    assert "--ServerApp.port=8890" in cmd and "--ServerApp.port_retries=0" in cmd  # the URL printed stays true
    assert f"--ServerApp.root_dir={tmp_path}" in cmd and "--no-browser" in cmd


def test_free_port_skips_a_port_in_use():
    with socket.socket() as taken:
        taken.bind((HOST, 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert free_port(port) > port


def test_each_learner_notebook_names_a_python_kernel():
    # JupyterLab writes the kernel's language_info as it opens a notebook: without one already
    # there, the notebook opens marked modified (the browser test watches the tab).
    expected = set(kernel_language_info())
    for learner in course_notebooks(NOTEBOOKS_DIR):
        info = nbformat.read(learner, as_version=4).metadata.get("language_info", {})
        assert set(info) == expected and info["name"] == "python", learner.name
        assert (SOLUTIONS_DIR / learner.name).exists()


def test_the_build_keeps_a_notebooks_language_info_else_takes_its_solutions(tmp_path):
    nb = nbformat.v4.new_notebook()
    mine, solution = tmp_path / "mine.ipynb", tmp_path / "solution.ipynb"
    nb.metadata["language_info"] = {"name": "python", "version": "3.12.1"}
    nbformat.write(nb, mine)
    nb.metadata["language_info"] = {"name": "python", "version": "3.11.7"}
    nbformat.write(nb, solution)
    assert language_info(mine, solution)["version"] == "3.12.1"  # the learner's machine, not stale
    assert language_info(tmp_path / "new.ipynb", solution)["version"] == "3.11.7"
    assert language_info(tmp_path / "new.ipynb", tmp_path / "none.ipynb") == kernel_language_info()


def notebook(path, version: str) -> None:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1", id="a"),
                                         nbformat.v4.new_markdown_cell("text", id="b")])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {**kernel_language_info(), "version": version}
    nbformat.write(nb, path)


def test_matching_the_kernel_changes_that_key_only_and_once(tmp_path):
    old, same = tmp_path / "01_old.ipynb", tmp_path / "02_same.ipynb"
    notebook(old, "3.9.0")
    notebook(same, kernel_language_info()["version"])
    before = same.read_text()

    assert match_kernel_language([old, same]) == ([old], [])
    assert old.read_text() == before  # byte for byte the notebook that already matched
    assert match_kernel_language([old, same]) == ([], [])
    assert [p.name for p in tmp_path.iterdir() if p.suffix != ".ipynb"] == []  # no temporary file left


def test_an_unreadable_notebook_is_named_and_left_alone(tmp_path):
    broken, fine = tmp_path / "01_broken.ipynb", tmp_path / "02_fine.ipynb"
    broken.write_text('{"cells": [\n<<<<<<< HEAD\n')
    notebook(fine, "3.9.0")
    changed, problems = match_kernel_language([broken, fine])
    assert changed == [fine] and broken.read_text() == '{"cells": [\n<<<<<<< HEAD\n'
    assert len(problems) == 1 and "01_broken.ipynb is not a readable notebook" in problems[0]
    assert "Fix:" in problems[0]


def test_only_the_course_notebooks_are_touched(tmp_path):
    for name in ("01_stage.ipynb", "my_r_notes.ipynb", "10_later.ipynb"):
        (tmp_path / name).write_text("{}")
    assert [p.name for p in course_notebooks(tmp_path)] == ["01_stage.ipynb", "10_later.ipynb"]


def test_a_failed_write_leaves_the_notebook_and_no_temporary_file(tmp_path, monkeypatch):
    import aie_lessons.course.lab as lab

    path = tmp_path / "01_stage.ipynb"
    notebook(path, "3.9.0")
    before = path.read_text()

    def disk_full(nb, fp):
        fp.write('{"cells": [')
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(lab.nbformat, "write", disk_full)
    with pytest.raises(OSError, match="No space left"):
        match_kernel_language([path])
    assert path.read_text() == before and [p.name for p in tmp_path.iterdir()] == ["01_stage.ipynb"]
