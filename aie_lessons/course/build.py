"""Regenerate, or check, everything derived from the stage sources.

``python -m aie_lessons.course.build`` writes, for each ``solutions/NN_name.py``:

* its exported modules ``aie_lessons/NAME.py``;
* the learner notebook ``notebooks/NN_name.ipynb``;
* the executed solution notebook ``solutions/NN_name.ipynb`` (the nbval reference outputs).

``--check`` writes nothing and fails when any of them is stale, so a maintainer who edits a
source and forgets to rebuild is told by ``make test``. Executing is skipped in ``--check``: the
solution notebook is compared cell by cell (ids, types, sources), must have outputs, and must
record the digest of the sources it was executed from (its own and earlier stages', the checks).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from collections.abc import Iterator
from pathlib import Path

import nbformat

from aie_lessons.course.source import (
    Stage,
    defined_names,
    export_modules,
    learner_notebook,
    load_stage,
    reference_notebook,
)
from aie_lessons.paths import REPO_ROOT

SOLUTIONS_DIR = REPO_ROOT / "solutions"
NOTEBOOKS_DIR = REPO_ROOT / "notebooks"
PACKAGE_DIR = REPO_ROOT / "aie_lessons"
CELL_TIMEOUT_S = 900


def stage_sources() -> list[Path]:
    return sorted(SOLUTIONS_DIR.glob("[0-9][0-9]_*.py"))


def notebook_text(nb: nbformat.NotebookNode) -> str:
    return nbformat.writes(nb) + "\n"


def module_files(stage: Stage, earlier: dict[str, str]) -> dict[Path, str]:
    """The modules a stage exports; ``earlier`` maps earlier stages' names to their modules."""
    label = stage.source.relative_to(REPO_ROOT).as_posix()
    modules = export_modules(stage.notebook.cells, label, stage.number, earlier)
    return {PACKAGE_DIR / f"{name}.py": text for name, text in modules.items()}


def execute(nb: nbformat.NotebookNode, cwd: Path) -> nbformat.NotebookNode:
    """Run a notebook top to bottom in a fresh kernel of this Python, as nbval will."""
    from nbclient import NotebookClient

    client = NotebookClient(
        nb,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        record_timing=False,
        resources={"metadata": {"path": str(cwd)}},
    )
    client.execute()
    return nb


def staged_modules(stages: list[Stage]) -> Iterator[tuple[Stage, dict[Path, str], dict[str, str]]]:
    """Each stage, in order, with its module files and the names earlier stages export.

    Later stages' exported cells use earlier stages' names, so a stage's modules can only be
    generated once the stages before it are known.
    """
    earlier: dict[str, str] = {}
    for stage in stages:
        files = module_files(stage, dict(earlier))
        yield stage, files, dict(earlier)
        for path, text in files.items():
            earlier.update(dict.fromkeys(defined_names(text), path.stem))


def inputs_digest(stage: Stage, stages: list[Stage]) -> str:
    """A hash of everything a solution notebook's outputs depend on that the course writes:
    this stage's source, every earlier stage's (their modules are imported) and the checks."""
    digest = hashlib.sha256()
    earlier = [s for s in stages if s.number <= stage.number]
    checks = PACKAGE_DIR / "checks"
    check_files = [checks / "common.py"] + [checks / f"stage{s.number}.py" for s in earlier]
    for path in [*(s.source for s in earlier), *check_files]:
        if path.exists():
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def same_cells(a: nbformat.NotebookNode, b: nbformat.NotebookNode) -> bool:
    def key(nb):
        return [(c.get("id"), c.cell_type, c.source) for c in nb.cells]

    return key(a) == key(b)


def is_executed(nb: nbformat.NotebookNode) -> bool:
    code = [c for c in nb.cells if c.cell_type == "code"]
    return bool(code) and all(c.get("execution_count") for c in code)


def build(stages: list[str] | None = None, check: bool = False, run: bool = True) -> list[str]:
    """Bring derived files up to date (or, with ``check``, list the stale ones)."""
    stale: list[str] = []

    def sync(path: Path, text: str) -> None:
        current = path.read_text() if path.exists() else None
        if current == text:
            return
        stale.append(str(path.relative_to(REPO_ROOT)))
        if not check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)

    loaded = [load_stage(source) for source in stage_sources()]
    selected = [s for s in loaded if not stages or s.number in stages]
    for stage, files, _ in staged_modules(loaded):
        if stage in selected:
            for path, text in files.items():
                sync(path, text)
    for stage in selected:
        sync(NOTEBOOKS_DIR / f"{stage.name}.ipynb", notebook_text(learner_notebook(stage)))
    # Modules first: a solution notebook may import an earlier stage's module.
    for stage in selected:
        solution_path = SOLUTIONS_DIR / f"{stage.name}.ipynb"
        reference = reference_notebook(stage)
        reference.metadata["aie"] = {"inputs": inputs_digest(stage, loaded)}
        on_disk = nbformat.read(solution_path, as_version=4) if solution_path.exists() else None
        if (
            on_disk is not None
            and same_cells(on_disk, reference)
            and is_executed(on_disk)
            and on_disk.metadata.get("aie") == reference.metadata["aie"]
        ):
            continue
        stale.append(str(solution_path.relative_to(REPO_ROOT)))
        if run and not check:
            print(f"executing {stage.name} ...", flush=True)
            solution_path.write_text(notebook_text(execute(reference, SOLUTIONS_DIR)))
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="fail if any derived file is stale")
    parser.add_argument("--no-execute", action="store_true", help="do not run solution notebooks")
    parser.add_argument("--stages", help="comma-separated stage numbers, e.g. 00,01")
    args = parser.parse_args(argv)
    stages = args.stages.split(",") if args.stages else None
    stale = build(stages, check=args.check, run=not args.no_execute)
    if args.check:
        if stale:
            print("These files are out of date with their stage sources:")
            print("\n".join(f"  {p}" for p in stale))
            print("Fix: run `make notebooks` and commit the result.")
            return 1
        print("all derived files are up to date with solutions/*.py")
        return 0
    skipped = "" if not args.no_execute else " (solution notebooks left unexecuted: --no-execute)"
    print("\n".join(f"updated {p}" for p in stale) + skipped if stale else "all up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
