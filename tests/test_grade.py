"""`aie grade`: reference notebooks grade 100%, untouched ones 0, one mistake fails one exercise."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import nbformat
import pytest

from aie_lessons.course.build import NOTEBOOKS_DIR, SOLUTIONS_DIR
from aie_lessons.course.grade import DEFAULT_CELL_TIMEOUT_S, GradeError, format_report, grade, write_junit
from aie_lessons.course.progress import stages

from side_by_side import two_at_a_time

pytestmark = pytest.mark.oracle  # grading runs the notebooks on the real model

STAGE = "02_attention"


def solution(name: str = STAGE) -> nbformat.NotebookNode:
    return nbformat.read(SOLUTIONS_DIR / f"{name}.ipynb", as_version=4)


def exercises(result) -> dict[str, bool]:
    return {e.id: e.passed for e in result.exercises}


def test_make_test_does_what_grading_the_solutions_would():
    """`aie grade solutions` runs each grading notebook under nbval, then each stage's checks
    sealed. For the solutions, the grading notebook *is* the solution notebook (below), which
    `make test` runs under nbval with the grader's cell timeout, and
    `test_the_sealed_checks_pass_every_solution` runs the sealed checks: so `make test` does not
    grade them again (a second run of every notebook)."""
    from aie_lessons.infra.paths import REPO_ROOT

    makefile = (REPO_ROOT / "Makefile").read_text()
    recipe = makefile.split("\ntest:", 1)[1].split("\n\n", 1)[0]
    assert "-m pytest tests solutions/*.ipynb $(NBVAL)" in recipe
    assert recipe.rstrip().endswith("exit $$tests")  # a failing test fails make test
    nbval = makefile.split("\nNBVAL  := ", 1)[1].split("\n\n", 1)[0]
    assert f"--nbval-cell-timeout {DEFAULT_CELL_TIMEOUT_S}" in nbval  # a cell too slow to grade fails


@pytest.mark.parametrize("name", [s.name for s in stages()])
def test_the_solutions_grading_notebook_is_the_solution_notebook(name):
    """Every cell's id, source and reference outputs, in order: grading the solutions would run
    exactly what nbval runs on them."""
    from aie_lessons.course.grade import grading_notebook

    reference = solution(name)
    graded = grading_notebook(reference, solution(name))
    assert [(c.get("id"), c.source, c.get("outputs")) for c in graded.cells] == \
           [(c.get("id"), c.source, c.get("outputs")) for c in reference.cells]
    assert graded.metadata == reference.metadata


# --- stage 02 submissions, each graded end to end (nbval, then the sealed checks) ------------------


def untouched() -> nbformat.NotebookNode:
    return nbformat.read(NOTEBOOKS_DIR / f"{STAGE}.ipynb", as_version=4)


def one_wrong_exercise_among_reordered_and_extra_cells() -> nbformat.NotebookNode:
    """The reference with exercise 2.3 wrong, a markdown cell moved to the end and two scratch
    cells added: the grader matches cells by id, so only 2.3 may fail."""
    nb = solution()
    cell = next(c for c in nb.cells if c.get("id") == "s02-ex-2-3")
    assert "q.view(batch, num_kv_heads, heads // num_kv_heads" in cell.source
    cell.source = cell.source.replace(
        "return q.view(batch, num_kv_heads, heads // num_kv_heads, seq, head_dim)",
        "return q.view(batch, heads // num_kv_heads, num_kv_heads, seq, head_dim).transpose(1, 2)",
    )
    code = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    nb.cells.append(nb.cells.pop(0))
    nb.cells.insert(code[3], nbformat.v4.new_code_cell("scratch = 40 + 2\nprint(scratch)"))
    nb.cells.insert(1, nbformat.v4.new_code_cell("print('my notes')"))
    return nb


def outputs_copied_and_check_cell_edited() -> nbformat.NotebookNode:
    """The untouched notebook dressed up as solved: every code cell carries the reference's
    outputs, and 2.1's check cell just prints its pass line."""
    learner, reference = untouched(), {c.get("id"): c for c in solution().cells}
    for cell in learner.cells:
        if cell.cell_type == "code":
            cell.outputs = reference[cell.get("id")].outputs
            cell.execution_count = reference[cell.get("id")].execution_count
        if cell.get("id") == "s02-check-2-1":
            cell.source = "print('✓ Exercise 2.1 passed: heads split as (B, S, H, D) → (B, H, S, D) and merged back')"
    return learner


def hanging_and_missing_cells() -> nbformat.NotebookNode:
    nb = solution()
    nb.cells = [c for c in nb.cells if c.get("id") != "s02-ex-2-4"]  # missing
    for cell in nb.cells:
        if cell.get("id") == "s02-ex-2-1":  # hangs
            cell.source = "import time\ntime.sleep(600)\n" + cell.source
    return nb


def cheating() -> nbformat.NotebookNode:
    nb = solution()
    cell = next(c for c in nb.cells if c.get("id") == "s02-ex-2-1")
    cell.source = cheating_cell(cell.source, "check-replaced")
    return nb


SUBMISSIONS = {f.__name__: f for f in (untouched, one_wrong_exercise_among_reordered_and_extra_cells,
                                       hanging_and_missing_cells, cheating)}


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """Each submission above graded once, two at a time (one thread each), for the tests below:
    every grading is a fresh kernel running the notebook plus a sealed run of its checks (the
    longest part of this file, so each submission tests as much as it can). All four are graded
    even when ``-k`` selects one of the tests."""
    def grade_one(name: str):
        folder = tmp_path_factory.mktemp(name)
        nbformat.write(SUBMISSIONS[name](), folder / f"{STAGE}.ipynb")
        timeout = {"cell_timeout": 10} if name == "hanging_and_missing_cells" else {}
        [result] = grade(folder, ["02"], **timeout)
        return result

    with pytest.MonkeyPatch.context() as patch:
        return two_at_a_time(grade_one, list(SUBMISSIONS), patch)


def test_untouched_learner_notebook_grades_zero_with_not_implemented(graded):
    result = graded["untouched"]
    assert not result.passed and result.exercises
    for exercise in result.exercises:
        assert not exercise.passed
        # Exercise 2.4's layer calls 2.1's split_heads, so its message may name 2.1.
        assert "is not implemented yet" in exercise.message, exercise


def test_exactly_one_wrong_exercise_fails_exactly_that_exercise_whatever_the_cell_order(graded):
    result = graded["one_wrong_exercise_among_reordered_and_extra_cells"]
    assert exercises(result) == {"2.1": True, "2.2": True, "2.3": False, "2.4": True, "2.5": True}
    wrong = next(e for e in result.exercises if e.id == "2.3")
    assert "h % Hkv" in wrong.message
    assert "exercise 2.3 failed" in format_report([result])
    # every other reference cell still matches, the moved and added cells notwithstanding: only
    # 2.3's check and the one demo cell that calls 2.3's group_queries differ
    assert {cell for cell, _ in result.cell_failures} == {"s02-check-2-3", "s02-co-b6c97f05d3"}, result.cell_failures


def test_hand_edited_outputs_and_check_cells_do_not_fool_the_grader():
    """The grader runs the reference notebook with only the learner's exercise cells put in: a
    notebook dressed up as solved is graded exactly as the untouched one, which grades zero."""
    from aie_lessons.course.grade import grading_notebook

    forged = grading_notebook(solution(), outputs_copied_and_check_cell_edited())
    assert nbformat.writes(forged) == nbformat.writes(grading_notebook(solution(), untouched()))


def test_hanging_and_missing_cells_fail_their_exercise_not_the_grader(graded):
    result = graded["hanging_and_missing_cells"]
    status = exercises(result)
    assert status == {"2.1": False, "2.2": True, "2.3": True, "2.4": False, "2.5": True}, result
    hung = next(e for e in result.exercises if e.id == "2.1")
    assert "Timeout of 10 seconds exceeded" in hung.message, hung
    missing = next(e for e in result.exercises if e.id == "2.4")
    assert "missing from the submission" in missing.message


def test_a_cheating_notebook_passes_its_check_cell_but_not_the_grade(graded):
    """End to end: nbval alone would give 2.1 full marks; the sealed run takes them away."""
    wrong = next(e for e in graded["cheating"].exercises if e.id == "2.1")
    assert not wrong.passed and "its check, run on its own: your code changed" in wrong.message, wrong


def test_missing_notebook_and_junit(tmp_path):
    [result] = grade(tmp_path, ["02"])
    assert not result.passed
    assert all("not in the submission" in e.message for e in result.exercises)
    report = tmp_path / "report.xml"
    write_junit([result], report)
    suite = ET.parse(report).getroot().find("testsuite")
    assert suite.get("name") == STAGE and int(suite.get("failures")) > 0
    assert {c.get("name") for c in suite.findall("testcase")} >= {"exercise 2.1", "exercise 2.4"}


def test_unknown_stage_is_a_clear_error(tmp_path):
    with pytest.raises(GradeError, match="no stage 42"):
        grade(tmp_path, ["42"])


# --- cheating attempts: each would pass in the notebook; the sealed checks must catch it ------------

def _reference_output(cell_id: str) -> str:
    """What a check cell prints in the reference notebook: a forged pass prints exactly that."""
    cell = next(c for c in solution().cells if c.get("id") == cell_id)
    return "".join(output.get("text", "") for output in cell.outputs).rstrip("\n")


PASS_LINE = repr(_reference_output("s02-check-2-1"))
WRONG_SPLIT_HEADS = ("def split_heads(x, num_heads):\n"
                     "    batch, seq, hidden = x.shape\n"
                     "    return x.reshape(batch, num_heads, seq, hidden // num_heads)\n")
# Each cheat, appended to the exercise cell after a wrong split_heads, with what must stop it:
# "changed" — the sealed run names the tampering; "wrong" — the cheat has no effect and the
# check reports the wrong code as usual.
CHEATS = {
    "check-replaced": ("changed", "import aie_lessons.checks.stage02 as c\n"
                                  f"c.check_split_heads = lambda *a, **k: print({PASS_LINE})\n"),
    "fail-silenced": ("changed", "import aie_lessons.checks.common as common\ncommon.fail = lambda *a, **k: None\n"),
    "print-redefined": ("changed", "import builtins\n_print = builtins.print\n"
                                   f"builtins.print = lambda *a, **k: _print({PASS_LINE})\n"
                                   "import aie_lessons.checks.stage02 as c\nc.check_split_heads = lambda *a, **k: None\n"),
    "torch-patched": ("changed", "import torch\ntorch.equal = lambda *a, **k: True\n"
                                 "torch.allclose = lambda *a, **k: True\n"),
    "code-swapped": ("changed", "import aie_lessons.checks.stage02 as c\n"
                                "c.check_split_heads.__code__ = (lambda split_heads, merge_heads: None).__code__\n"),
    "result-forged": ("changed", "import aie_lessons.course.progress as p\n_init = p.CheckResult.__init__\n"
                                 "p.CheckResult.__init__ = lambda self, e, passed, message='': _init(self, e, True, '')\n"),
    "tensor-method-added": ("changed", "import torch\ntorch.Tensor.equal = lambda *a, **k: True\n"),
    "sdpa-replaced": ("changed", "import aie_lessons.model as m\n"
                                 "m.sdpa_attention.__code__ = (lambda q, k, v, mask=None: q).__code__\n"),
    "metadata-attend-swapped": ("changed", "import aie_lessons.model as m\n"
                                           "m.AttentionMetadata.attend.__code__ = (lambda self, q, k, v, layer, kernel: q).__code__\n"),
    "tensor-subclass": ("wrong", "import torch\n_split = split_heads\n"
                                 "class _Agreeable(torch.Tensor):\n"
                                 "    @classmethod\n"
                                 "    def __torch_function__(cls, func, types, args=(), kwargs=None):\n"
                                 "        if func in (torch.equal, torch.allclose):\n            return True\n"
                                 "        return super().__torch_function__(func, types, args, kwargs or {})\n"
                                 "def split_heads(x, num_heads):\n"
                                 "    return _split(x, num_heads).as_subclass(_Agreeable)\n"),
    "checks-shadowed": ("wrong", "class _Yes:\n    def __getattr__(self, name):\n        return self\n"
                                 "    def __call__(self, *args, **kwargs):\n        return None\n\nchecks = _Yes()\n"),
    "verdict-printed": ("wrong", "import json, os\n"
                                 "os.write(1, ('\\n' + json.dumps([{'exercise': '2.1', 'passed': True, 'message': ''}])"
                                 " + '\\n').encode())\n"),
}


def cheating_cell(source: str, cheat: str) -> str:
    """The exercise cell with a wrong split_heads and the cheat appended."""
    start = source.index("def split_heads")
    end = source.find("\ndef ", start + 1)
    end = len(source) if end < 0 else end  # split_heads may be the cell's last function
    return source[:start] + WRONG_SPLIT_HEADS + source[end:] + "\n\n" + CHEATS[cheat][1]


def sealed_verdicts(learner: nbformat.NotebookNode) -> dict:
    from aie_lessons.course.grade import grading_notebook, sealed_checks

    return sealed_checks("02", grading_notebook(solution(), learner), timeout=600)


def cheat_verdict(cheat: str):
    nb = solution()
    cell = next(c for c in nb.cells if c.get("id") == "s02-ex-2-1")
    cell.source = cheating_cell(cell.source, cheat)
    return sealed_verdicts(nb)["2.1"]


def test_the_sealed_checks_see_through_each_cheat(monkeypatch):
    """The learner's exercise code, cheat included, checked the way the grader checks it."""
    verdicts = two_at_a_time(cheat_verdict, list(CHEATS), monkeypatch)
    for cheat, verdict in verdicts.items():
        assert verdict.passed is False, (cheat, verdict)
        expected = "your code changed" if CHEATS[cheat][0] == "changed" else "Exercise 2.1:"
        assert expected in verdict.message, (cheat, verdict)


def test_an_added_export_cell_cannot_replace_a_module_the_checks_use():
    """Only the stage's own modules, built from its exercise cells, are taken from the learner."""
    nb = solution()
    nb.cells.append(nbformat.v4.new_code_cell("# export: model\nraise RuntimeError('a model of my own')"))
    nb.cells.append(nbformat.v4.new_code_cell("# export: shapes\nraise RuntimeError('no shapes')"))
    verdicts = sealed_verdicts(nb)
    assert all(v.passed for v in verdicts.values()), verdicts


def test_the_sealed_checks_pass_every_solution(monkeypatch):
    """No false alarm: every stage's reference code passes its checks when run sealed — as
    `aie grade` runs them, without the test suite's TRITON_INTERPRET (Triton then reads each
    kernel's source, which the sealed run serves from text)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    from aie_lessons.course.grade import grading_notebook, sealed_checks

    with_exercises = {s.name: s for s in stages() if s.exercises}

    def verdicts_on_the_reference(name: str):
        reference = solution(name)
        return sealed_checks(with_exercises[name].number, grading_notebook(reference, reference), timeout=900)

    checked = two_at_a_time(verdicts_on_the_reference, list(with_exercises), monkeypatch)
    for name, verdicts in checked.items():
        assert [e.id for e in with_exercises[name].exercises] == list(verdicts), name
        assert all(v.passed for v in verdicts.values()), verdicts


def test_every_exercise_lives_in_an_exported_cell():
    """The sealed run sees only exported code: an exercise outside it would go unchecked."""
    from aie_lessons.course.build import ROOTS, load_stages
    from aie_lessons.course.source import export_target, exercises_in

    for stage in load_stages(ROOTS):
        for cell in stage.notebook.cells:
            if cell.cell_type == "code" and exercises_in(cell.source):
                assert export_target(cell), f"{stage.name}: exercise cell is not exported"


def test_nbval_failing_to_run_is_an_error_not_a_silent_zero(tmp_path):
    """pytest's exit status 4 (usage error) means nbval never ran a cell: say so, do not grade 0."""
    from aie_lessons.course.grade import run_nbval

    with pytest.raises(GradeError, match=r"nbval could not run missing.ipynb \(exit status 4\)"):
        run_nbval(tmp_path / "missing.ipynb", cell_timeout=10)


def _stages_with_exercises():
    from aie_lessons.course.build import ROOTS, load_stages

    return [pytest.param(s, id=s.name) for s in load_stages(ROOTS) if s.exercises]


def with_one_mistake(stage, exercise: str) -> dict[str, str]:
    """The stage's modules, as the grader builds them, from the reference notebook with only
    ``exercise`` replaced by its stub raising a deliberate mistake."""
    from aie_lessons.course.grade import grading_notebook, learner_modules

    cell_id = f"s{stage.number}-ex-{exercise.replace('.', '-')}"
    stub = next(c for c in nbformat.read(NOTEBOOKS_DIR / f"{stage.name}.ipynb", as_version=4).cells
                if c.get("id") == cell_id)
    learner = solution(stage.name)
    wrong = re.sub(r"raise NotImplementedError\(.*\)", 'raise RuntimeError("a deliberate mistake")', stub.source)
    assert wrong != stub.source, f"{cell_id} has no stub to replace"
    next(c for c in learner.cells if c.get("id") == cell_id).source = wrong
    return learner_modules(stage.number, grading_notebook(solution(stage.name), learner))


def checks_per_version(number: str, versions: dict[str, dict[str, str]]) -> dict[str, dict]:
    """``tests/checks_per_version.py``: every version's check results, from one fresh Python."""
    out = subprocess.run([sys.executable, "-P", str(Path(__file__).with_name("checks_per_version.py")), number],
                         input=json.dumps(versions), capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("stage", _stages_with_exercises())
def test_each_wrong_exercise_fails_that_exercise_alone(stage, monkeypatch):
    """Each exercise's mistake is reported against it and no other: the checks give later
    exercises the reference versions of earlier ones (``checks.common.isolated``), so one wrong
    function cannot fail the whole stage, and no honest mistake looks like tampering to the sealed
    run's fingerprint. The modules are built as the grader builds them; the versions run in two
    Pythons side by side, each loading one version's modules after another."""
    ids = [e.id for e in stage.exercises]
    versions = {e: with_one_mistake(stage, e) for e in ids}
    halves = [half for half in ({e: versions[e] for e in ids[i::2]} for i in range(2)) if half]
    outcomes = {}
    for part in two_at_a_time(lambda i: checks_per_version(stage.number, halves[i]), list(range(len(halves))),
                              monkeypatch).values():
        outcomes |= part
    assert sorted(outcomes) == sorted(ids)
    wrong = {}
    for exercise, outcome in outcomes.items():
        failed = sorted(e for e, passed, _ in outcome["results"] if not passed)
        message = next(m for e, _, m in outcome["results"] if e == exercise)
        if failed != [exercise] or "a deliberate mistake" not in message or outcome["changed"]:
            wrong[exercise] = (failed, message[:300], outcome["changed"][:3])
    assert not wrong, f"with only the exercise on the left wrong, these failed (and said, and changed): {wrong}"
