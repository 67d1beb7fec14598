"""One source per stage: derived files in sync, stubs, stable ids, exported modules."""

from __future__ import annotations

import ast
import importlib.util

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
    # BEGIN EXERCISE 9.1: return twice x
    # Hint 1: doubling is multiplying by two
    # Hint 2: use *
    y = x * 2
    return y
    # END EXERCISE 9.1
'''


def test_derived_files_are_up_to_date():
    """Fails when someone edits solutions/*.py (or a generated file) without `make notebooks`."""
    assert build.build(check=True) == []


def test_top_level_modules_are_all_generated():
    """Hand-written code lives in infra/, course/, checks/ and cli.py, so every other top-level
    module is the build's: regenerated from a stage, and deleted once no stage exports it."""
    hand_written = [
        path.name
        for path in sorted(build.PACKAGE_DIR.glob("*.py"))
        if path.name not in {"cli.py", "__init__.py"} and not build.generated_from(path)
    ]
    assert hand_written == []


def test_stub_replaces_the_solution_with_a_clear_raise():
    stub = stub_exercises(SOLUTION)
    assert "x * 2" not in stub
    assert "Hint" not in stub and "multiplying" not in stub  # hints wait for checks.hint
    assert '    # Exercise 9.1: return twice x\n    # Stuck? checks.hint("9.1")' in stub
    namespace: dict = {}
    exec(stub, namespace)
    with pytest.raises(NotImplementedError, match="Exercise 9.1 is not implemented yet"):
        namespace["f"](1)


@pytest.mark.parametrize("broken, message", [
    ("    # BEGIN EXERCISE 1.1: a\n", "no END EXERCISE"),
    ("# BEGIN EXERCISE 1.1: a\n# Hint 1: the idea\nx = 1\n# END EXERCISE 1.1\n", "needs two hint lines"),
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


def test_stage_01_checks_every_exercise_in_order():
    stage = load_stage(build.SOLUTIONS_DIR / "01_skeleton_loop.py")
    exercise_ids = [e.id for e in stage.exercises]
    assert exercise_ids == [f"1.{n}" for n in range(1, 13)]
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


# --- the build on a tiny course of its own --------------------------------------------------------

SCHEDULER = "# export: engine.scheduler\ndef schedule():\n    return 1"
RUNNER = "# export: runner\ndef run():\n    return schedule()"


def write_stage(roots: build.Roots, name: str, cells: list[str]) -> None:
    """A stage source in jupytext's percent format, one code cell per string."""
    roots.solutions.mkdir(parents=True, exist_ok=True)
    text = "\n\n".join(f"# %%\n{cell}" for cell in cells) + "\n"
    (roots.solutions / f"{name}.py").write_text(text)


def fake_course(tmp_path, stages: dict[str, list[str]]) -> build.Roots:
    """A course in ``tmp_path``: the given stages, an empty package and a README with markers."""
    roots = build.Roots(tmp_path)
    roots.package.mkdir()
    roots.readme.write_text(f"# Demo\n\n{build.README_BEGIN}\n{build.README_END}\n")
    for name, cells in stages.items():
        write_stage(roots, name, cells)
    return roots


def package_files_stale(roots: build.Roots) -> list[str]:
    """What ``--check`` reports, less the solution notebooks (never executed in these tests)."""
    stale = build.build(check=True, run=False, roots=roots)
    return [entry for entry in stale if not entry.startswith("solutions/")]


def test_dotted_export_writes_a_subpackage_with_a_generated_init(tmp_path):
    second_cell = "# export: engine.scheduler\nLIMIT = 2"  # two cells, one module: allowed
    roots = fake_course(tmp_path, {"01_demo": [SCHEDULER, second_cell, RUNNER]})
    build.build(run=False, roots=roots)
    scheduler = (roots.package / "engine" / "scheduler.py").read_text()
    assert "def schedule" in scheduler and "LIMIT = 2" in scheduler
    init = roots.package / "engine" / "__init__.py"
    assert build.generated_from(init) == "solutions/01_demo.py"
    ast.parse(init.read_text())
    runner = (roots.package / "runner.py").read_text()
    assert "from aie_lessons.engine.scheduler import schedule" in runner
    assert package_files_stale(roots) == []


@pytest.mark.parametrize("package", ["infra", "course", "checks"])
def test_exports_into_hand_written_packages_are_refused(tmp_path, package):
    roots = fake_course(tmp_path, {"01_demo": [f"# export: {package}.tool\nX = 1"]})
    message = rf"01_demo.py: `# export: {package}.tool` .*hand-written"
    with pytest.raises(SourceError, match=message):
        build.build(check=True, run=False, roots=roots)


def test_orphans_are_reported_by_check_and_deleted_by_build(tmp_path):
    roots = fake_course(tmp_path, {"01_demo": [SCHEDULER, RUNNER]})
    build.build(run=False, roots=roots)
    hand_written = roots.package / "helper.py"
    hand_written.write_text("X = 1\n")
    write_stage(roots, "01_demo", ["# export: runner\ndef run():\n    return 2"])
    orphans = [entry for entry in package_files_stale(roots) if "orphan" in entry]
    assert [entry.split()[0] for entry in orphans] == [
        "aie_lessons/engine/__init__.py", "aie_lessons/engine/scheduler.py"
    ]
    assert all("its header says solutions/01_demo.py generated it" in e for e in orphans)
    assert (roots.package / "engine" / "scheduler.py").exists()  # --check writes nothing
    build.build(run=False, roots=roots)
    assert not (roots.package / "engine").exists()
    assert hand_written.exists() and (roots.package / "runner.py").exists()
    assert package_files_stale(roots) == []


def test_a_module_exported_by_two_stages_fails_naming_both(tmp_path):
    roots = fake_course(tmp_path, {
        "01_one": ["# export: shared\ndef f():\n    pass"],
        "02_two": ["# export: shared\ndef g():\n    pass"],
    })
    with pytest.raises(SourceError, match=r"solutions/01_one\.py and solutions/02_two\.py both "
                                          r"export `shared` \(aie_lessons/shared\.py\).*Fix:"):
        build.build(check=True, run=False, roots=roots)


@pytest.mark.parametrize("stages, message", [
    (
        {"01_one": ["# export: a\nLIMIT = 1"], "02_two": ["# export: engine.b\nLIMIT = 2"]},
        r"`LIMIT` is defined both in aie_lessons/a\.py \(solutions/01_one\.py\) and in "
        r"aie_lessons/engine/b\.py \(solutions/02_two\.py\).*Fix:",
    ),
    (
        {"01_one": ["# export: a\nclass Thing:\n    pass", "# export: b\ndef Thing():\n    pass"]},
        r"solutions/01_one\.py: `Thing` is defined both in aie_lessons/a\.py and in "
        r"aie_lessons/b\.py.*Fix:",
    ),
], ids=["across stages", "within a stage"])
def test_a_name_defined_by_two_modules_fails_naming_both(tmp_path, stages, message):
    roots = fake_course(tmp_path, stages)
    with pytest.raises(SourceError, match=message):
        build.build(check=True, run=False, roots=roots)


def test_names_used_only_in_annotations_are_imported_for_type_checking(tmp_path):
    types = "# export: engine.types\nclass Config:\n    pass\n\n\nclass Cache:\n    pass"
    annotated = (
        "# export: sizes\nfrom __future__ import annotations\n\n"
        "def size(config: Config, *, cache: Cache | None = None) -> int:\n"
        "    count: Config = config\n    return 1"
    )
    used = (
        "# export: maker\nfrom __future__ import annotations\n\n"
        "def make() -> Config:\n    return Config()"
    )
    evaluated = "# export: plain\ndef length(config: Config) -> int:\n    return 1"
    roots = fake_course(tmp_path, {"01_demo": [types, annotated, used, evaluated]})
    build.build(run=False, roots=roots)
    sizes = roots.package / "sizes.py"
    assert ("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
            "    from aie_lessons.engine.types import Cache, Config\n") in sizes.read_text()
    spec = importlib.util.spec_from_file_location("fake_course_sizes", sizes)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # no aie_lessons.engine exists: a run-time import would fail
    assert module.size(object()) == 1
    for name in ["maker", "plain"]:  # read at run time, or annotations evaluated: plain imports
        text = (roots.package / f"{name}.py").read_text()
        assert "\nfrom aie_lessons.engine.types import Config\n" in text
        assert "TYPE_CHECKING" not in text


def test_readme_stage_table_is_generated_and_checked(tmp_path):
    roots = fake_course(tmp_path, {"00_intro": ["x = 1"], "01_demo": [SCHEDULER, RUNNER]})
    assert build.stage_module_table(roots=roots) == {
        "00_intro": [], "01_demo": ["aie_lessons/engine/scheduler.py", "aie_lessons/runner.py"],
    }
    build.build(run=False, roots=roots)
    readme = roots.readme.read_text()
    assert "| 01_demo | `aie_lessons/engine/scheduler.py`, `aie_lessons/runner.py` |" in readme
    assert readme.startswith("# Demo\n") and package_files_stale(roots) == []
    roots.readme.write_text(readme.replace("`aie_lessons/runner.py`", "`aie_lessons/old.py`"))
    assert package_files_stale(roots) == ["README.md"]
    build.build(run=False, roots=roots)
    assert roots.readme.read_text() == readme
    roots.readme.write_text("# Demo without markers\n")
    with pytest.raises(SourceError, match="stage-modules:begin"):
        build.build(check=True, run=False, roots=roots)
