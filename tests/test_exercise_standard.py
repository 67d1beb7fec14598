"""The exercise standard (../shared/DESIGN.md, "How a stage teaches"), measured on every stage.

The learner builds the engine only if the stubs give nothing away, the hints wait until asked,
each exercise sits in its own cell under its heading, and every check is proven by wrong
implementations a learner might write.
"""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import pytest

from aie_lessons import checks
from aie_lessons.course import build, exercise_lines
from aie_lessons.course.source import BEGIN_RE, END_RE, SourceError, exercises_in, stub_exercises

from check_expect import MUTANTS

STAGES = build.load_stages()
EXERCISES = [(stage, e) for stage in STAGES for e in stage.exercises]
MIN_LEARNER_LINES = 150  # over stages 01–05, the target
MIN_MUTANTS = 3


def given_lines(stage) -> set[str]:
    """Stripped lines of the stage's source outside exercise regions: code the learner is given."""
    given, inside = set(), False
    for line in stage.source.read_text().splitlines():
        if BEGIN_RE.match(line):
            inside = True
        elif END_RE.match(line):
            inside = False
        elif not inside:
            given.add(line.strip())
    return given


def telling_lines(stage, exercise) -> list[str]:
    """Solution lines that would give the exercise away: code (not comments), long enough to
    carry an idea, and not also part of the code the stage gives."""
    given = given_lines(stage)
    return [
        stripped
        for stripped in (line.strip() for line in exercise.solution.splitlines())
        if len(stripped) >= 16 and not stripped.startswith("#") and stripped not in given
    ]


@pytest.mark.parametrize("stage, exercise", EXERCISES, ids=[e.id for _, e in EXERCISES])
def test_no_learner_notebook_contains_its_solution(stage, exercise):
    notebook = (build.ROOTS.notebooks / f"{stage.name}.ipynb").read_text()
    text = "\n".join("".join(c["source"]) for c in json.loads(notebook)["cells"])
    leaked = [line for line in telling_lines(stage, exercise) if line in text]
    assert not leaked, f"learner notebook {stage.name} shows solution lines of {exercise.id}: {leaked}"


@pytest.mark.parametrize("stage, exercise", EXERCISES, ids=[e.id for _, e in EXERCISES])
def test_hints_below_the_code_level_do_not_contain_the_code(stage, exercise):
    for level, text in enumerate(exercise.hints, start=1):
        assert len(text) >= 20, f"hint {level} of {exercise.id} is too short to help: {text!r}"
        leaked = [line for line in telling_lines(stage, exercise) if line in text]
        assert not leaked, f"hint {level} of {exercise.id} is the solution's code: {leaked}"


def test_hint_prints_each_level_and_refuses_bad_requests(capsys):
    exercise = EXERCISES[0][1]
    for level in (1, 2, 3):
        checks.hint(exercise.id, level=level)
        out = capsys.readouterr().out
        assert f"hint {level} of 3" in out
        assert (exercise.solution if level == 3 else exercise.hints[level - 1][:40]) in out
    with pytest.raises(ValueError, match="has no exercise 1.99"):
        checks.hint("1.99")
    with pytest.raises(ValueError, match="level should be 1"):
        checks.hint(exercise.id, level=4)
    with pytest.raises(ValueError, match="should look like"):
        checks.hint("two")
    with pytest.raises(TypeError, match="as a string"):
        checks.hint(1.10)
    checks.hint(f"0{exercise.id}")  # a leading zero names the same exercise
    assert "hint 1 of 3" in capsys.readouterr().out


@pytest.mark.parametrize("stage", STAGES, ids=[s.name for s in STAGES])
def test_each_exercise_has_its_own_cell_under_its_heading(stage):
    cells = stage.notebook.cells
    for index, cell in enumerate(cells):
        found = exercises_in(cell.source) if cell.cell_type == "code" else []
        if not found:
            continue
        assert len(found) == 1, f"{stage.name}: exercises {[e.id for e in found]} share one cell"
        before = next((c for c in reversed(cells[:index]) if c.cell_type == "markdown"), None)
        assert before is not None, f"{stage.name}: exercise {found[0].id} has no markdown cell before it"
        heading = re.compile(rf"^#+ .*Exercise {re.escape(found[0].id)}\b", re.MULTILINE)
        assert heading.search(before.source), (
            f"{stage.name}: exercise {found[0].id} has no `### Exercise {found[0].id} — …` "
            "heading in the markdown cell before it"
        )


def test_the_learner_writes_enough_of_the_engine():
    counted = {s.number: sum(n for _, n in exercise_lines.stage_exercises(s)) for s in STAGES}
    total = sum(n for number, n in counted.items() if "01" <= number <= "05")
    assert total >= MIN_LEARNER_LINES, f"learner lines over stages 01–05: {counted}, total {total}"


def test_every_exercise_is_proven_by_three_mutants():
    for path in sorted(Path(__file__).parent.glob("test_*.py")):
        importlib.import_module(path.stem)  # registers each module's mutants
    short = {e.id: len(set(MUTANTS[e.id])) for _, e in EXERCISES if len(set(MUTANTS[e.id])) < MIN_MUTANTS}
    assert not short, f"exercises with fewer than {MIN_MUTANTS} mutants (tests/check_expect.mutants): {short}"


REGION = "def f():\n    # BEGIN EXERCISE 9.1: t\n{hints}    return 1\n    # END EXERCISE 9.1\n"
GOOD_HINTS = "    # Hint 1: the idea, said plainly\n    # Hint 2: the approach, said plainly\n"


@pytest.mark.parametrize("text, message", [
    ("# Hint 1: outside any region\n" + REGION.format(hints=GOOD_HINTS), "outside any exercise region"),
    (REGION.format(hints=GOOD_HINTS + "    # Hint 1: again\n"), "two `# Hint 1:` lines"),
    (REGION.format(hints="    # Hint 1: the idea\n    #   continued here\n    # Hint 2: b\n"), "write each hint on one line"),
    (REGION.format(hints=GOOD_HINTS + "    # Hint 3: the code\n"), "is not `# Hint 1"),
    (REGION.format(hints="    # Hint 2: only the approach\n"), "needs two hint lines"),
])
def test_hint_lines_that_would_leak_or_be_lost_are_refused(text, message):
    with pytest.raises(SourceError, match=message):
        stub_exercises(text)


def test_a_stub_keeps_no_hint_and_no_code():
    stub = stub_exercises(REGION.format(hints=GOOD_HINTS))
    assert "said plainly" not in stub and "return 1" not in stub
    assert 'checks.hint("9.1")' in stub
