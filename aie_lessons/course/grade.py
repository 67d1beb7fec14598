"""``aie grade``: grade a folder of a learner's notebooks against the reference solutions.

A learner's saved outputs are their own, so the grader trusts none of them. For each stage it
builds a *grading notebook* from the executed solution notebook, cell by cell (paired by id):

* an exercise cell gets the learner's code (a missing one becomes a cell that fails);
* every other cell — checks included — keeps the reference code, so editing a check cannot pass it;
* every cell keeps the reference outputs, which nbval compares against a fresh run;
* cells the learner added run after the cell they followed, with their output not compared.

nbval runs it in a fresh kernel. Because an exercise cell shares that kernel with its check, it
could patch the check; so every check runs a second time in a sealed process
(:mod:`aie_lessons.course.sealed`) on the learner's exported code. An exercise passes when its
cell and its check cell pass in the notebook *and* its check passes sealed.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

from aie_lessons.course.build import SOLUTIONS_DIR, stage_sources
from aie_lessons.course.nbval_plugin import REPORT_ENV
from aie_lessons.course.progress import CheckResult, find_stage
from aie_lessons.course.source import SourceError, checked_exercise, export_modules, load_stage

SANITIZE_FILE = SOLUTIONS_DIR / "sanitize.cfg"
DEFAULT_CELL_TIMEOUT_S = 300
MESSAGE_LINES = 4


class GradeError(ValueError):
    """The grading request itself is wrong (an unknown stage); the message says which."""


@dataclass
class ExerciseResult:
    id: str
    passed: bool
    message: str = ""


@dataclass
class StageResult:
    stage: str
    name: str
    exercises: list[ExerciseResult] = field(default_factory=list)
    cells_matched: int = 0
    cells_total: int = 0
    cell_failures: list[tuple[str, str]] = field(default_factory=list)  # (cell id, message)

    @property
    def passed(self) -> bool:
        return all(e.passed for e in self.exercises) and self.cells_matched == self.cells_total


def _summary(message: str) -> str:
    """The first lines worth reading of an nbval report: the output difference, or the error."""
    lines = [line.rstrip() for line in message.splitlines() if line.strip()]
    for marker in (" mismatch '", "dissimilar number of outputs"):  # nbval's output comparison
        hit = next((i for i, line in enumerate(lines) if marker in line), None)
        if hit is not None:
            return "\n".join(lines[hit:hit + MESSAGE_LINES])
    errors = [i for i, line in enumerate(lines) if re.search(r"(Error|Exception|Exercise \d)", line)]
    start = errors[-1] if errors else 0
    return "\n".join(lines[start:start + MESSAGE_LINES])


def grading_notebook(reference: nbformat.NotebookNode, learner: nbformat.NotebookNode | None):
    """Reference cells and outputs, with the learner's exercise cells and added cells in place."""
    learner_cells = list(learner.cells) if learner is not None else []
    by_id = {c.get("id"): c for c in learner_cells}
    reference_ids = {c.get("id") for c in reference.cells}
    # Extra learner cells go after the paired cell they followed in the learner's notebook.
    extras_after: dict[str | None, list] = {}
    previous = None
    for cell in learner_cells:
        if cell.get("id") in reference_ids:
            previous = cell.get("id")
        elif cell.cell_type == "code":
            extra = nbformat.v4.new_code_cell(cell.source)
            extra.metadata["tags"] = ["nbval-ignore-output"]
            extra.id = f"extra-{len(extras_after.get(previous, []))}-{cell.get('id') or 'x'}"[:64]
            extras_after.setdefault(previous, []).append(extra)

    cells = list(extras_after.get(None, []))
    for ref in reference.cells:
        cell = nbformat.from_dict(ref)
        if ref.cell_type == "code" and exercises_in_cell_id(ref.get("id")):
            mine = by_id.get(ref.get("id"))
            cell.source = mine.source if mine is not None else (
                f'raise RuntimeError("cell {ref.get("id")} (an exercise cell) is missing from '
                'the submission: restore it from the learner notebook")'
            )
        cells.append(cell)
        cells.extend(extras_after.get(ref.get("id"), []))
    nb = nbformat.from_dict(reference)
    nb.cells = cells
    return nb


def exercises_in_cell_id(cell_id: str | None) -> list[str]:
    """Exercise ids of an exercise cell, from its stable id (s01-ex-1-1_1-2 -> [1.1, 1.2])."""
    match = re.fullmatch(r"s\d\d-ex-([\d_-]+)", cell_id or "")
    return [part.replace("-", ".", 1) for part in match.group(1).split("_")] if match else []


def sealed_checks(number: str, graded: nbformat.NotebookNode, timeout: int) -> dict[str, CheckResult]:
    """The stage's checks on the learner's exercise code, in a process the learner's code cannot
    reach before the checks are in place; keyed by exercise.

    ``graded`` is the grading notebook: the learner's exercise cells in the reference notebook.
    Cells the learner added are left out, and so is any module the stage does not export, so a
    learner cannot swap a piece of the engine the checks compare against.
    """
    stage = find_stage(number)[0]
    try:
        texts = learner_modules(number, graded)
    except SourceError as exc:
        return _all_failed(stage, f"the notebook's exported cells do not form modules: {exc}")
    token = secrets.token_hex(16)
    with tempfile.TemporaryDirectory(prefix="aie-sealed-") as scratch:
        try:  # -P and a scratch folder: nothing next to the submission can shadow a module
            out = subprocess.run([sys.executable, "-P", "-m", "aie_lessons.course.sealed", number],
                                 input=json.dumps({"token": token, "modules": texts}), cwd=scratch,
                                 capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return _all_failed(stage, f"the checks did not finish within {timeout} s when run on their own")
    verdicts = [line for line in out.stdout.splitlines() if line.startswith(f"{token} ")]
    try:
        if out.returncode != 0 or len(verdicts) != 1:
            raise ValueError(f"exit status {out.returncode}")
        results = [CheckResult(str(r["exercise"]), r["passed"] is True, str(r["message"]))
                   for r in json.loads(verdicts[0].removeprefix(f"{token} "))]
    except (ValueError, KeyError, TypeError):
        detail = (out.stderr.strip().splitlines() or ["no output"])[-1]
        return _all_failed(stage, f"running the checks on your exported code failed: {detail}")
    return {r.exercise: r for r in results}


def learner_modules(number: str, graded: nbformat.NotebookNode) -> dict[str, str]:
    """The text of each module stage ``number`` exports, built from the grading notebook's own
    cells (not the learner's added ones); a module the stage does not export is dropped."""
    stage, expected, earlier = find_stage(number)
    own = [c for c in graded.cells if not str(c.get("id", "")).startswith("extra-")]
    texts = export_modules(own, f"notebooks/{stage.name}.ipynb", number, earlier)
    return {module: text for module, text in texts.items() if module in expected}


def _all_failed(stage, problem: str) -> dict[str, CheckResult]:
    return {e.id: CheckResult(e.id, False, problem) for e in stage.exercises}


def run_nbval(notebook: Path, cell_timeout: int) -> dict[str, dict]:
    """Run nbval on one notebook in a fresh kernel; return each cell's record by id."""
    report = notebook.with_suffix(".cells.jsonl")
    env = {**os.environ, REPORT_ENV: str(report)}
    cmd = [sys.executable, "-m", "pytest", str(notebook), "--nbval", "--nbval-current-env",
           "--nbval-sanitize-with", str(SANITIZE_FILE), "-p", "aie_lessons.course.nbval_plugin",
           "--nbval-cell-timeout", str(cell_timeout), "-q", "-p", "no:cacheprovider",
           "--rootdir", str(notebook.parent)]
    out = subprocess.run(cmd, cwd=notebook.parent, env=env, capture_output=True, text=True)
    if out.returncode not in (0, 1):  # 0: all cells passed, 1: some failed; anything else: nbval broke
        raise GradeError(f"nbval could not run {notebook.name} (exit status {out.returncode}): "
                         + " ".join((out.stdout + out.stderr).strip().splitlines()[-3:]))
    records = {}
    if report.exists():
        for line in report.read_text(encoding="utf-8").splitlines():
            record = json.loads(line)
            records[record["id"]] = record
    return records


def grade_stage(stage_source: Path, submission_dir: Path, cell_timeout: int) -> StageResult:
    stage = load_stage(stage_source)
    result = StageResult(stage=stage.number, name=stage.name)
    exercise_ids = [e.id for e in stage.exercises]
    reference = nbformat.read(SOLUTIONS_DIR / f"{stage.name}.ipynb", as_version=4)
    submitted = submission_dir / f"{stage.name}.ipynb"
    problem = None
    learner = None
    if not submitted.exists():
        problem = f"{submitted.name} is not in the submission"
    else:
        try:
            learner = nbformat.read(submitted, as_version=4)
        except Exception as exc:  # any unreadable file is a failed submission, reported as such
            problem = f"{submitted.name} is not a readable notebook ({exc})"
    if problem:
        result.exercises = [ExerciseResult(e, False, problem) for e in exercise_ids]
        code = [c for c in reference.cells if c.cell_type == "code"]
        result.cells_total = len(code)
        result.cell_failures = [("(notebook)", problem)]
        return result

    graded = grading_notebook(reference, learner)
    with tempfile.TemporaryDirectory(prefix="aie-grade-") as scratch:
        path = Path(scratch) / f"{stage.name}.ipynb"
        nbformat.write(graded, path)
        records = run_nbval(path, cell_timeout)

    def record_of(cell_id: str) -> dict:
        return records.get(cell_id) or {"passed": False, "message": "the cell did not run "
                                        "(an earlier cell timed out or the kernel died)"}

    reference_code = [c for c in reference.cells if c.cell_type == "code"]
    result.cells_total = len(reference_code)
    for cell in reference_code:
        record = record_of(cell.get("id"))
        if record["passed"]:
            result.cells_matched += 1
        else:
            result.cell_failures.append((cell.get("id"), _summary(record["message"])))

    exercise_cell = {e: c.get("id") for c in reference_code for e in exercises_in_cell_id(c.get("id"))}
    check_cell = {checked_exercise(c): c.get("id") for c in reference_code if checked_exercise(c)}
    sealed = sealed_checks(stage.number, graded, timeout=cell_timeout * (len(exercise_ids) + 1))
    for exercise in exercise_ids:
        cells = [exercise_cell.get(exercise), check_cell.get(exercise)]
        failed = [record_of(c) for c in cells if c is not None and not record_of(c)["passed"]]
        own = sealed.get(exercise, CheckResult(exercise, False, "its check did not run"))
        if failed:
            result.exercises.append(ExerciseResult(exercise, False, _summary(failed[0]["message"])))
        elif not own.passed:
            result.exercises.append(ExerciseResult(exercise, False, f"its check, run on its own: {own.message}"))
        else:
            result.exercises.append(ExerciseResult(exercise, True))
    return result


def format_report(results: list[StageResult]) -> str:
    lines = [f"{'stage':<22} {'exercises':>10} {'cells matched':>14}  result"]
    for r in results:
        passed = sum(e.passed for e in r.exercises)
        lines.append(f"{r.name:<22} {passed:>4} / {len(r.exercises):<3} {r.cells_matched:>6} / "
                     f"{r.cells_total:<5}  {'PASS' if r.passed else 'FAIL'}")
    for r in results:
        for e in r.exercises:
            if not e.passed:
                detail = "\n".join("      " + line for line in e.message.splitlines())
                lines.append(f"\n  {r.name} exercise {e.id} failed:\n{detail}")
        exercise_cells = {f"s{r.stage}-ex-", f"s{r.stage}-check-"}
        for cell_id, message in r.cell_failures:
            if not any(cell_id.startswith(p) for p in exercise_cells):
                detail = "\n".join("      " + line for line in message.splitlines())
                lines.append(f"\n  {r.name} cell {cell_id} differs from the reference:\n{detail}")
    return "\n".join(lines)


def write_junit(results: list[StageResult], path: Path) -> None:
    suites = ET.Element("testsuites", name="aie grade")
    for r in results:
        failures = sum(not e.passed for e in r.exercises) + (r.cells_total - r.cells_matched)
        suite = ET.SubElement(suites, "testsuite", name=r.name,
                              tests=str(len(r.exercises) + r.cells_total), failures=str(failures))
        for e in r.exercises:
            case = ET.SubElement(suite, "testcase", classname=r.name, name=f"exercise {e.id}")
            if not e.passed:
                ET.SubElement(case, "failure", message=e.message.splitlines()[0] if e.message else "failed").text = e.message
        failed_cells = dict(r.cell_failures)
        case = ET.SubElement(suite, "testcase", classname=r.name, name="reference outputs")
        if failed_cells:
            text = "\n\n".join(f"{cell}: {msg}" for cell, msg in failed_cells.items())
            ET.SubElement(case, "failure", message=f"{len(failed_cells)} cells differ").text = text
    ET.ElementTree(suites).write(path, encoding="utf-8", xml_declaration=True)


def grade(submission_dir: Path, stages: list[str] | None = None,
          cell_timeout: int = DEFAULT_CELL_TIMEOUT_S) -> list[StageResult]:
    if not submission_dir.is_dir():
        raise GradeError(f"{submission_dir} is not a folder. Fix: pass the folder that holds the "
                         "learner's NN_name.ipynb notebooks")
    sources = [s for s in stage_sources() if not stages or s.name[:2] in stages]
    if stages:
        unknown = sorted(set(stages) - {s.name[:2] for s in sources})
        if unknown:
            raise GradeError(f"no stage {', '.join(unknown)}; stages: "
                             f"{', '.join(s.name[:2] for s in stage_sources())}")
    return [grade_stage(source, submission_dir, cell_timeout) for source in sources]
