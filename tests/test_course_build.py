"""One source per stage: derived files in sync, stubs, stable ids, exported modules."""

from __future__ import annotations

import ast

import nbformat
import pytest

from aie_lessons.course import build
from aie_lessons.course.source import (
    SourceError,
    export_modules,
    learner_notebook,
    load_stage,
    stub_exercises,
)

SOLUTION = '''def f(x):
    """Double it."""
    # BEGIN EXERCISE 9.1: return twice x | Hint: use *
    y = x * 2
    return y
    # END EXERCISE 9.1
'''


def test_derived_files_are_up_to_date():
    """Fails when someone edits solutions/*.py (or a generated file) without `make notebooks`."""
    assert build.build(check=True) == []


def test_stub_replaces_the_solution_with_a_clear_raise():
    stub = stub_exercises(SOLUTION)
    assert "x * 2" not in stub
    assert "    # Exercise 9.1: return twice x\n    # Hint: use *\n" in stub
    namespace: dict = {}
    exec(stub, namespace)
    with pytest.raises(NotImplementedError, match="Exercise 9.1 is not implemented yet"):
        namespace["f"](1)


@pytest.mark.parametrize("broken, message", [
    ("    # BEGIN EXERCISE 1.1: a\n", "no END EXERCISE"),
    ("    # END EXERCISE 1.1\n", "does not close"),
    ("# BEGIN EXERCISE 1.1: a\n# BEGIN EXERCISE 1.2: b\n", "begins inside"),
])
def test_broken_markers_are_reported(broken, message):
    with pytest.raises(SourceError, match=message):
        stub_exercises(broken)


def test_exported_modules_import_what_other_modules_of_the_stage_define():
    cells = [
        nbformat.v4.new_code_cell("# export: alpha\nimport math\n\nclass A:\n    pass"),
        nbformat.v4.new_code_cell("x = A()  # not exported"),
        nbformat.v4.new_code_cell("# export: beta\n\"\"\"Doc.\"\"\"\nimport os\n\ndef b() -> A:\n    return A()"),
    ]
    modules = export_modules(cells, "solutions/99_demo.py", "99")
    assert set(modules) == {"alpha", "beta"}
    beta = modules["beta"]
    assert beta.startswith("# Generated from solutions/99_demo.py")
    lines = beta.splitlines()
    assert lines.index("from aie_lessons.alpha import A") > lines.index("import os")
    assert "x = A()" not in modules["alpha"]
    ast.parse(beta)


@pytest.mark.parametrize("source", build.stage_sources(), ids=lambda p: p.stem)
def test_every_stage_has_unique_stable_ids_and_compiling_stubs(source):
    stage = load_stage(source)
    again = load_stage(source)
    ids = [c.id for c in stage.notebook.cells]
    assert ids == [c.id for c in again.notebook.cells] and len(set(ids)) == len(ids)
    learner = learner_notebook(stage)
    for cell in learner.cells:
        if cell.cell_type == "code":
            ast.parse(cell.source)
    stubs = sum(c.source.count("is not implemented yet") for c in learner.cells)
    assert stubs == len(stage.exercises)


def test_stage_01_has_four_checked_exercises():
    stage = load_stage(build.SOLUTIONS_DIR / "01_skeleton_loop.py")
    exercise_ids = [e.id for e in stage.exercises]
    assert exercise_ids == ["1.1", "1.2", "1.3", "1.4"]
    checked = [c.source.splitlines()[0] for c in stage.notebook.cells if c.source.startswith("# Check")]
    assert checked == [f"# Check exercise {i}" for i in exercise_ids]


@pytest.mark.oracle
@pytest.mark.parametrize("source", build.stage_sources(), ids=lambda p: p.stem)
def test_learner_notebook_runs_until_its_first_exercise(source):
    """A fresh kernel runs every learner notebook top to bottom up to its first unsolved exercise."""
    from nbclient.exceptions import CellExecutionError

    stage = load_stage(source)
    nb = nbformat.read(build.NOTEBOOKS_DIR / f"{stage.name}.ipynb", as_version=4)
    if not stage.exercises:
        build.execute(nb, build.NOTEBOOKS_DIR)
        return
    first = stage.exercises[0].id
    with pytest.raises(CellExecutionError) as failure:
        build.execute(nb, build.NOTEBOOKS_DIR)
    assert f"Exercise {first} is not implemented yet" in str(failure.value)
    ran = [c for c in nb.cells if c.cell_type == "code" and c.get("execution_count")]
    assert ran[-1].id == f"s{stage.number}-check-{first.replace('.', '-')}"
