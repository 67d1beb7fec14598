"""A learner's progress: which stages hold their own code, and whether its checks pass.

``aie commit NN`` exports the learner's cells of stage NN into ``aie_lessons`` — only if the
stage's checks pass on them; ``aie reset NN`` puts the reference back; ``aie status`` shows a table.
Later notebooks import whatever the package holds, so a learner's attention runs inside the later
engine. Each notebook's first cell calls :func:`verify_committed_stages`, which says which
committed stage to reset when one of them breaks.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import textwrap
import traceback
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

import nbformat
from tqdm.auto import tqdm

from aie_lessons.course.build import ROOTS, load_stages, stage_module_table, staged_modules
from aie_lessons.course.source import PACKAGE, SourceError, Stage, checked_exercise, export_modules
from aie_lessons.infra.paths import REPO_ROOT

LEARNER_MARK = "# Generated from notebooks/"


@dataclass
class CheckResult:
    exercise: str
    passed: bool
    message: str = ""


class ProgressError(RuntimeError):
    """A commit or reset cannot be done; the message says why and what to do."""


def stages() -> list[Stage]:
    return load_stages(ROOTS)


def find_stage(number: str) -> tuple[Stage, dict[str, str], dict[str, str]]:
    """Stage ``number``, its reference modules (dotted name → text), and the names earlier stages
    export (name → module)."""
    for stage, modules, earlier in staged_modules(stages(), ROOTS):
        if stage.number == number:
            return stage, modules, earlier
    raise ProgressError(f"there is no stage {number}: stages are "
                        f"{', '.join(s.number for s in stages())}")


def is_committed(stage: Stage) -> bool:
    """True when the stage's modules hold the learner's code rather than the reference."""
    _, modules, _ = find_stage(stage.number)
    paths = [ROOTS.module_path(module) for module in modules]
    return any(path.exists() and path.read_text().startswith(LEARNER_MARK) for path in paths)


# --- running a stage's checks ------------------------------------------------------------------


FIXTURE_NAMES = ("model", "tokenizer", "config")


class _Fixtures(dict):
    """The objects check cells use besides exported names, created only when asked for."""

    def __missing__(self, key):
        from aie_lessons.infra.paths import default_model_dir

        if key == "model":
            from aie_lessons.model import LlamaModel

            self[key] = LlamaModel.from_pretrained(default_model_dir())
        elif key == "tokenizer":
            from aie_lessons.tokenizer import Tokenizer

            self[key] = Tokenizer.from_pretrained(default_model_dir())
        elif key == "config":
            from aie_lessons.config import ModelConfig

            self[key] = ModelConfig.from_json(default_model_dir())
        else:
            raise KeyError(key)
        return self[key]


def check_results(stage: Stage) -> Iterator[CheckResult]:
    """Run the stage's check cells against the modules the package holds now (in this process),
    yielding each result as it comes: a caller may look at the process between two checks."""
    import importlib

    from aie_lessons import checks

    namespace = _Fixtures()
    _, modules, _ = find_stage(stage.number)
    for name in modules:
        module = importlib.import_module(f"{PACKAGE}.{name}")
        namespace.update({k: v for k, v in vars(module).items() if not k.startswith("_")})
    # The checks and the fixtures win over any name of the learner's: a module that happens to
    # define `config`, or means to shadow `checks`, must not change what a check cell calls.
    for name in FIXTURE_NAMES:
        namespace.pop(name, None)
    namespace["checks"] = checks
    for cell in stage.notebook.cells:
        exercise = checked_exercise(cell)
        if not exercise:
            continue
        try:
            exec(compile(cell.source, f"<check {exercise}>", "exec"), {}, namespace)
            yield CheckResult(exercise, True)
        except Exception as exc:  # a failing check is a result to report, not a crash
            message = str(exc) or traceback.format_exception_only(type(exc), exc)[-1].strip()
            yield CheckResult(exercise, False, f"{type(exc).__name__}: {message}")


def run_checks(stage: Stage) -> list[CheckResult]:
    """Every check of the stage, against the modules the package holds now (in this process)."""
    return list(check_results(stage))


def run_checks_isolated(number: str, threads: int | None = None) -> list[CheckResult]:
    """Run a stage's checks in a fresh Python, so that modules just written are the ones imported.

    ``threads`` caps the child's torch threads, for running several stages side by side.
    """
    env = None if threads is None else {**os.environ, "OMP_NUM_THREADS": str(threads)}
    out = subprocess.run(
        [sys.executable, "-m", "aie_lessons.course.progress", number],
        capture_output=True, text=True, cwd=REPO_ROOT, env=env,
    )
    try:
        return [CheckResult(**r) for r in json.loads(out.stdout.strip().splitlines()[-1])]
    except (json.JSONDecodeError, IndexError) as exc:
        detail = (out.stderr.strip().splitlines() or ["no output"])[-1]
        return [CheckResult("import", False, f"the stage's modules do not import: {detail}")]


# --- commit, reset, status ---------------------------------------------------------------------


def learner_notebook_path(stage: Stage) -> Path:
    return ROOTS.notebooks / f"{stage.name}.ipynb"


def commit(number: str, notebook: Path | None = None) -> list[CheckResult]:
    """Export the learner's cells of a stage into the package if its checks pass on them."""
    stage, expected, earlier = find_stage(number)
    notebook = notebook or learner_notebook_path(stage)
    if not notebook.exists():
        raise ProgressError(f"{notebook} does not exist: open the stage's notebook in "
                            "JupyterLab, do its exercises and save it first")
    cells = nbformat.read(notebook, as_version=4).cells
    try:
        label = ROOTS.label(notebook.resolve())
    except ValueError:
        label = notebook.name
    if not label.startswith("notebooks/"):
        label = f"notebooks/{notebook.name}"
    try:
        theirs = export_modules(cells, label, number, earlier)
    except SourceError as exc:
        raise ProgressError(f"{notebook.name} cannot be committed: {exc}") from exc
    missing = sorted(module for module in expected if module not in theirs)
    if missing:
        raise ProgressError(
            f"{notebook.name} has no `# export: {missing[0]}` cell. Cells that start with "
            "`# export:` are what gets committed: restore the cell (git shows the original) "
            "and redo its exercise."
        )
    paths = {module: ROOTS.module_path(module) for module in expected}
    backups = {path: path.read_text() if path.exists() else None for path in paths.values()}
    for module, path in paths.items():
        write_module(path, theirs[module])
    results = run_checks_isolated(number)
    if not all(r.passed for r in results):
        for path, text in backups.items():
            if text is None:
                path.unlink()
            else:
                path.write_text(text)
    return results


def write_module(path: Path, text: str) -> None:
    """Write a module file; a module of a subpackage may be the first file of its folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def reset(number: str) -> None:
    """Put the reference code of a stage back into the package."""
    _, modules, _ = find_stage(number)
    for module, text in modules.items():
        write_module(ROOTS.module_path(module), text)


@dataclass
class NotebookProgress:
    """A learner notebook as last saved: exercises written, and those whose check cell's saved
    output says they passed."""

    written: int
    passing: int
    total: int

    def __str__(self) -> str:
        return f"written {self.written:>2} / {self.total:<2} passing {self.passing:>2} / {self.total}"


def notebook_progress(stage: Stage, path: Path | None = None) -> NotebookProgress | None:
    """The learner's own progress in a stage, read from its notebook (None if there is none).

    An exercise is *written* once its cell no longer holds the stub that raises "Exercise N.M is
    not implemented yet"; it is *passing* when its check cell's saved output shows the check's
    "✓ Exercise N.M passed" line — as of the last time the learner ran that cell and saved.
    """
    path = path or learner_notebook_path(stage)
    if not path.exists():
        return None
    cells = [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
    code = "\n".join(cell.source for cell in cells)
    ids = [exercise.id for exercise in stage.exercises]
    written = [i for i in ids if f"Exercise {i} is not implemented yet" not in code]
    passing = set()
    for cell in cells:
        exercise = checked_exercise(cell)
        outputs = "".join(str(o.get("text", "")) for o in cell.get("outputs", []))
        if exercise in ids and f"✓ Exercise {exercise} passed" in outputs:
            passing.add(exercise)
    return NotebookProgress(len(written), len(passing), len(ids))


def status_table(numbers: list[str] | None = None) -> str:
    """Each stage with exercises (or only those numbered): the learner's own notebook (exercises
    written and passing, as saved), whose code the package runs and how many of that code's checks
    pass, the modules the stage exports and the first line of each failure."""
    lines = ["your notebook: the exercises you wrote, and those whose check passed when you last ran it "
             "and saved;",
             "aie_lessons: the code later stages import (the reference until you `aie commit NN`), and "
             "how many of the stage's checks that code passes.",
             "",
             f"{'stage':<24} {'your notebook (as saved)':<34} {'aie_lessons runs':<18} {'its checks':>10}"]
    all_stages = stages()
    exports = stage_module_table(all_stages, ROOTS)
    wanted = {find_stage(number)[0].name for number in numbers or ()}  # an unknown number: ProgressError
    for stage in all_stages:
        if stage.name in wanted and not stage.exercises:
            raise ProgressError(f"stage {stage.number} has no exercises, so nothing to check: "
                                "name a stage that has (`aie status` lists them)")
    checked = [s for s in all_stages if s.exercises and (not wanted or s.name in wanted)]
    # A stage's checks are mostly a fresh Python importing torch, one core's work: run one stage
    # per core, each with one thread, and show how far it has got (it takes half a minute).
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        running = {pool.submit(run_checks_isolated, s.number, 1): s.number for s in checked}
        checks = {}
        for future in tqdm(as_completed(running), total=len(running), desc="running each stage's checks",
                           unit="stage", file=sys.stderr, leave=False):
            checks[running[future]] = future.result()
    for stage in checked:
        owner = "your code" if is_committed(stage) else "the reference"
        mine = notebook_progress(stage)
        results = checks[stage.number]
        passed = sum(r.passed for r in results)
        lines.append(f"{stage.name:<24} {str(mine) if mine else 'not found':<34} {owner:<18} "
                     f"{passed:>4} / {len(results)}")
        lines.append(textwrap.fill(
            ", ".join(exports[stage.name]) or "no modules", width=100,
            initial_indent="    exports ", subsequent_indent=" " * 12,
            break_long_words=False, break_on_hyphens=False,
        ))
        for r in results:
            if not r.passed:
                lines.append(f"    {r.exercise}: {r.message.splitlines()[0][:110]}")
    return "\n".join(lines)


def verify_committed_stages(before: str) -> None:
    """First cell of every notebook: fail early, and say which stage to reset, when a stage the
    learner committed earlier no longer passes its checks."""
    for stage in stages():
        if stage.number >= before or not is_committed(stage):
            continue
        with contextlib.redirect_stdout(io.StringIO()):  # only failures are worth showing here
            failed = [r for r in run_checks(stage) if not r.passed]
        if failed:
            raise ProgressError(
                f"stage {stage.number} holds your committed code, and its check for exercise "
                f"{failed[0].exercise} fails: {failed[0].message}\nFix: run `aie reset "
                f"{stage.number}` to use the reference code, or fix notebooks/{stage.name}.ipynb "
                f"and `aie commit {stage.number}`; then restart this notebook's kernel."
            )
    print("✓ earlier stages ready")


if __name__ == "__main__":  # used by run_checks_isolated
    found, _, _ = find_stage(sys.argv[1])
    print(json.dumps([r.__dict__ for r in run_checks(found)]))
