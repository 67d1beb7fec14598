"""Learner workflow: commit only when checks pass, reset, status, and the first-cell guard."""

from __future__ import annotations

import subprocess
import sys

import nbformat
import pytest

from aie_lessons.course import build, progress
from aie_lessons.course.progress import (
    LEARNER_MARK,
    CheckResult,
    ProgressError,
    commit,
    find_stage,
    is_committed,
    reset,
    status_table,
    verify_committed_stages,
)

from course_copy import copy_course, run_in
from test_course_build import SCHEDULER, fake_course

pytestmark = pytest.mark.oracle  # the checks run on the real model


@pytest.fixture
def course(tmp_path):
    """A copy of the course that commit and reset may write; the checkout stays untouched."""
    return copy_course(tmp_path / "course")


def solved_notebook(tmp_path, name="02_attention"):
    path = tmp_path / f"{name}.ipynb"
    path.write_text((build.SOLUTIONS_DIR / f"{name}.ipynb").read_text())
    return path


PRELUDE = """
import json
from aie_lessons.course import build
from aie_lessons.course.progress import LEARNER_MARK, ProgressError, commit, find_stage, is_committed, reset, status_table
attention = build.PACKAGE_DIR / "attention.py"
"""


def test_untouched_notebook_is_not_committed(course):
    result = run_in(course, PRELUDE + """
before = attention.read_text()
results = commit("02")
print(json.dumps({"passed": [r.passed for r in results], "first": results[0].message,
                  "unchanged": attention.read_text() == before}))
""")
    assert not any(result["passed"]) and result["unchanged"]
    assert "Exercise 2.1 is not implemented yet" in result["first"]


def test_commit_then_reset(tmp_path, course):
    result = run_in(course, PRELUDE + f"""
stage, _, _ = find_stage("02")
results = commit("02", __import__("pathlib").Path({str(solved_notebook(tmp_path))!r}))
committed = [all(r.passed for r in results), attention.read_text().startswith(LEARNER_MARK),
             is_committed(stage), "your code" in status_table(["02"])]
reset("02")
print(json.dumps({{"committed": committed, "after_reset": [is_committed(stage), build.build(check=True, run=False)]}}))
""")
    assert result["committed"] == [True, True, True, True]
    assert result["after_reset"] == [False, []]


def test_status_shows_the_modules_of_each_stage(monkeypatch):
    monkeypatch.setattr(progress, "run_checks_isolated", lambda number, threads=None: [])
    table, exports = status_table(), build.stage_module_table()
    for stage in progress.stages():
        if stage.exercises:
            assert all(file in table for file in exports[stage.name]), stage.name


def test_status_shows_the_learners_own_notebook_apart_from_the_package(monkeypatch):
    """A learner who has not started sees 0 written in every notebook, even though the package's
    reference code passes its checks: the two are separate columns."""
    monkeypatch.setattr(progress, "run_checks_isolated", lambda number, threads=None: [CheckResult("x", True)])
    table = status_table()
    for stage in progress.stages():
        if stage.exercises:
            n = len(stage.exercises)
            row = next(line for line in table.splitlines() if line.startswith(stage.name))
            assert f"written  0 / {n:<2} passing  0 / {n} " in row and "the reference" in row, row


def test_notebook_progress_counts_written_exercises_and_saved_passes(tmp_path):
    """Writing an exercise counts as written; its check's saved "passed" output counts as passing;
    a check that failed, or was never run, does not."""
    stage = find_stage("07")[0]
    learner = nbformat.read(progress.learner_notebook_path(stage), as_version=4)
    solved = nbformat.read(build.SOLUTIONS_DIR / f"{stage.name}.ipynb", as_version=4)
    path = tmp_path / "07.ipynb"
    nbformat.write(learner, path)
    assert progress.notebook_progress(stage, path) == progress.NotebookProgress(0, 0, 5)
    # Solve 7.2 and 7.3 by taking the solution's cells (same ids), but keep only 7.2's check output.
    by_id = {cell.id: cell for cell in solved.cells}
    for cell in learner.cells:
        if cell.cell_type == "code" and ("Exercise 7.2 is" in cell.source or "Exercise 7.3 is" in cell.source):
            cell.source = by_id[cell.id].source
        if cell.source.startswith("# Check exercise 7.2"):
            cell.outputs = by_id[cell.id].outputs
        if cell.source.startswith("# Check exercise 7.3"):
            cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="Exercise 7.3: wrong slot\n")]
    nbformat.write(learner, path)
    assert progress.notebook_progress(stage, path) == progress.NotebookProgress(2, 1, 5)
    assert progress.notebook_progress(stage, tmp_path / "missing.ipynb") is None


def test_commit_and_reset_write_modules_of_subpackages(tmp_path, monkeypatch):
    roots = fake_course(tmp_path, {"01_demo": [SCHEDULER]})
    build.build(run=False, roots=roots)
    monkeypatch.setattr(progress, "ROOTS", roots)
    path = roots.package / "engine" / "scheduler.py"
    nb = nbformat.read(roots.notebooks / "01_demo.ipynb", as_version=4)
    nb.cells[0].source = nb.cells[0].source.replace("return 1", "return 2")
    nbformat.write(nb, tmp_path / "01_demo.ipynb")
    monkeypatch.setattr(progress, "run_checks_isolated", lambda number: [CheckResult("1.1", True)])
    commit("01", tmp_path / "01_demo.ipynb")
    assert path.read_text().startswith(LEARNER_MARK) and "return 2" in path.read_text()
    assert is_committed(find_stage("01")[0])
    path.unlink()
    reset("01")
    assert path.read_text() == find_stage("01")[1]["engine.scheduler"]
    assert build.build(check=True, run=False, roots=roots) == ["solutions/01_demo.ipynb"]


def test_wrong_code_is_refused_and_the_package_left_alone(tmp_path, course):
    path = solved_notebook(tmp_path)
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.get("id") == "s02-ex-2-2":
            cell.source = cell.source.replace("* q.shape[-1] ** -0.5", "")
    nbformat.write(nb, path)
    result = run_in(course, PRELUDE + f"""
before = attention.read_text()
results = commit("02", __import__("pathlib").Path({str(path)!r}))
print(json.dumps({{"failed": [r.exercise for r in results if not r.passed], "unchanged": attention.read_text() == before}}))
""")
    assert result == {"failed": ["2.2"], "unchanged": True}


def test_missing_export_cell_is_a_clear_error(tmp_path):
    path = solved_notebook(tmp_path)
    nb = nbformat.read(path, as_version=4)
    nb.cells = [c for c in nb.cells if not c.source.startswith("# export: shapes")]
    nbformat.write(nb, path)
    with pytest.raises(ProgressError, match="no `# export: shapes` cell"):
        commit("02", path)  # refused before anything is written


def test_a_broken_committed_stage_is_named_by_later_notebooks(tmp_path, course):
    result = run_in(course, PRELUDE + f"""
from aie_lessons.course.progress import verify_committed_stages
assert all(r.passed for r in commit("02", __import__("pathlib").Path({str(solved_notebook(tmp_path))!r})))
attention.write_text(attention.read_text().replace("return q.view(batch, num_kv_heads",
                                                   "return q.clone().view(batch, num_kv_heads"))
try:
    verify_committed_stages(before="03")
    message = None
except ProgressError as error:
    message = str(error)
print(json.dumps(message))
""")
    assert result is not None
    assert "stage 02 holds your committed code" in result and "2.3" in result and "aie reset 02" in result


def test_reading_notebooks_skips_the_optional_iri_grammar():
    """``aie_lessons.course`` keeps jsonschema from building the optional ``rfc3987_syntax`` IRI
    grammar on import (2.4 s of every course tool's start on a Zen 3); nbformat still validates,
    and still rejects a malformed notebook."""
    probe = (
        "import sys, aie_lessons.course.progress, nbformat  # the course first, as in every course tool\n"
        "assert sys.modules['rfc3987_syntax'] is None, sys.modules['rfc3987_syntax']\n"
        "nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell('1')])\n"
        "nbformat.validate(nb)\n"
        "nb.cells[0]['cell_type'] = 'poem'\n"
        "try:\n    nbformat.validate(nb)\nexcept nbformat.ValidationError:\n    print('rejected')\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "rejected", out.stderr[-2000:]
