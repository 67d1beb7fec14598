"""Learner workflow: commit only when checks pass, reset, status, and the first-cell guard."""

from __future__ import annotations

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

from test_course_build import SCHEDULER, fake_course

pytestmark = pytest.mark.oracle  # the checks run on the real model


@pytest.fixture
def restore_package():
    """Whatever a test commits, the package is the reference again afterwards."""
    saved = {p: p.read_text() for p in build.PACKAGE_DIR.rglob("*.py") if build.generated_from(p)}
    yield
    for path, text in saved.items():
        path.write_text(text)
    assert build.build(check=True) == []


def solved_notebook(tmp_path, name="02_attention"):
    path = tmp_path / f"{name}.ipynb"
    path.write_text((build.SOLUTIONS_DIR / f"{name}.ipynb").read_text())
    return path


def test_untouched_notebook_is_not_committed(restore_package):
    before = (build.PACKAGE_DIR / "attention.py").read_text()
    results = commit("02")
    assert not any(r.passed for r in results)
    assert "Exercise 2.1 is not implemented yet" in results[0].message
    assert (build.PACKAGE_DIR / "attention.py").read_text() == before


def test_commit_then_reset(tmp_path, restore_package):
    stage, _, _ = find_stage("02")
    results = commit("02", solved_notebook(tmp_path))
    assert results and all(r.passed for r in results)
    assert (build.PACKAGE_DIR / "attention.py").read_text().startswith(LEARNER_MARK)
    assert is_committed(stage)
    assert "yours (committed)" in status_table()
    reset("02")
    assert not is_committed(stage)
    assert build.build(check=True) == []


def test_status_shows_the_modules_of_each_stage(monkeypatch):
    monkeypatch.setattr(progress, "run_checks_isolated", lambda number: [])
    table, exports = status_table(), build.stage_module_table()
    for stage in progress.stages():
        if stage.exercises:
            assert all(file in table for file in exports[stage.name]), stage.name


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


def test_wrong_code_is_refused_and_the_package_left_alone(tmp_path, restore_package):
    path = solved_notebook(tmp_path)
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.get("id") == "s02-ex-2-2":
            cell.source = cell.source.replace("* q.shape[-1] ** -0.5", "")
    nbformat.write(nb, path)
    before = (build.PACKAGE_DIR / "attention.py").read_text()
    results = commit("02", path)
    failed = [r.exercise for r in results if not r.passed]
    assert failed == ["2.2"]
    assert (build.PACKAGE_DIR / "attention.py").read_text() == before


def test_missing_export_cell_is_a_clear_error(tmp_path, restore_package):
    path = solved_notebook(tmp_path)
    nb = nbformat.read(path, as_version=4)
    nb.cells = [c for c in nb.cells if not c.source.startswith("# export: shapes")]
    nbformat.write(nb, path)
    with pytest.raises(ProgressError, match="no `# export: shapes` cell"):
        commit("02", path)


def test_a_broken_committed_stage_is_named_by_later_notebooks(tmp_path, restore_package):
    assert all(r.passed for r in commit("02", solved_notebook(tmp_path)))
    module = build.PACKAGE_DIR / "attention.py"
    module.write_text(module.read_text().replace("return q.view(batch, num_kv_heads",
                                                 "return q.clone().view(batch, num_kv_heads"))
    import importlib
    import sys

    sys.modules.pop("aie_lessons.attention", None)
    try:
        with pytest.raises(ProgressError, match=r"(?s)stage 02 holds your committed code.*2\.3.*aie reset 02"):
            verify_committed_stages(before="03")
    finally:
        sys.modules.pop("aie_lessons.attention", None)
        reset("02")
        importlib.import_module("aie_lessons.attention")
