"""Regenerate, or check, everything derived from the stage sources.

``python -m aie_lessons.course.build`` writes, for each ``solutions/NN_name.py``:

* its exported modules ``aie_lessons/NAME.py`` (a dotted ``PKG.NAME`` is
  ``aie_lessons/PKG/NAME.py``, and the package gets a generated ``__init__.py``);
* the learner notebook ``notebooks/NN_name.ipynb``;
* the executed solution notebook ``solutions/NN_name.ipynb`` (the nbval reference outputs);

and for the course as a whole the stage → module table in ``README.md``, between its
``stage-modules`` markers. It deletes orphans: files whose header says they are generated but
that no stage exports any more, which would otherwise go on importing, out of date.

Exports must not conflict. A module belongs to one stage, and a top-level name to one module:
auto-added imports look a name up across all modules, so two definers would make one of them
silently win.

``--check`` writes nothing and fails when any of them is stale, so a maintainer who edits a
source and forgets to rebuild is told by ``make test``. Executing is skipped in ``--check``: the
solution notebook is compared cell by cell (ids, types, sources), must have outputs, and must
record the digest of the sources it was executed from (its own and earlier stages', the checks).
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import nbformat

from aie_lessons.course import exercise_lines
from aie_lessons.course.source import (
    GENERATED_RE,
    PACKAGE,
    SourceError,
    Stage,
    defined_names,
    export_modules,
    learner_notebook,
    load_stage,
    module_file,
    package_init,
    reference_notebook,
)
from aie_lessons.infra.paths import REPO_ROOT

README_BEGIN = "<!-- stage-modules:begin -->"
README_END = "<!-- stage-modules:end -->"
CELL_TIMEOUT_S = 900


@dataclass(frozen=True)
class Roots:
    """Where the build reads the stage sources and writes what it derives. The course builds in
    its repository (``ROOTS``); tests build a small course of their own in a temporary folder."""

    repo: Path

    @property
    def solutions(self) -> Path:
        return self.repo / "solutions"

    @property
    def notebooks(self) -> Path:
        return self.repo / "notebooks"

    @property
    def package(self) -> Path:
        return self.repo / PACKAGE

    @property
    def readme(self) -> Path:
        return self.repo / "README.md"

    def module_path(self, module: str) -> Path:
        return self.repo / module_file(module)

    def label(self, path: Path) -> str:
        """A path as headers and messages show it: relative to the repository."""
        return path.relative_to(self.repo).as_posix()


ROOTS = Roots(REPO_ROOT)
SOLUTIONS_DIR = ROOTS.solutions
NOTEBOOKS_DIR = ROOTS.notebooks
PACKAGE_DIR = ROOTS.package


def stage_sources(roots: Roots = ROOTS) -> list[Path]:
    return sorted(roots.solutions.glob("[0-9][0-9]_*.py"))


def load_stages(roots: Roots = ROOTS) -> list[Stage]:
    return [load_stage(source) for source in stage_sources(roots)]


def notebook_text(nb: nbformat.NotebookNode) -> str:
    return nbformat.writes(nb) + "\n"


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


# --- modules: exported by one stage each, names defined once ------------------------------------


def _claim_module(module: str, label: str, exporters: dict[str, str]) -> None:
    """Record that the stage ``label`` exports ``module``, refusing a module that another stage
    exports, or one whose name a package already uses (or the other way round)."""
    if exporters.get(module, label) != label:
        raise SourceError(
            f"{exporters[module]} and {label} both export `{module}` ({module_file(module)}): a "
            f"module belongs to one stage. Fix: give {label}'s cells a module of their own "
            f"(`# export: NEW_NAME`), importing what they reuse from {PACKAGE}.{module}."
        )
    for other, other_label in exporters.items():
        short, long = sorted([module, other], key=len)
        if long.startswith(f"{short}."):
            raise SourceError(
                f"{other_label} exports `{other}` and {label} exports `{module}`: "
                f"{module_file(short)} and the package {PACKAGE}/{short.replace('.', '/')}/ "
                "cannot both exist. Fix: rename the module or the package."
            )
    exporters[module] = label


def _claim_name(name: str, module: str, label: str, earlier: dict[str, str],
                exporters: dict[str, str]) -> None:
    """Refuse a name that an earlier stage's module already defines."""
    if name in earlier:
        first = earlier[name]
        raise SourceError(
            f"`{name}` is defined both in {module_file(first)} ({exporters[first]}) and in "
            f"{module_file(module)} ({label}): auto-added imports of `{name}` cannot tell which "
            f"one is meant. Fix: rename one of them, or have {label} import `{name}` from "
            f"{PACKAGE}.{first} instead of defining it again."
        )


def staged_modules(
    stages: list[Stage], roots: Roots = ROOTS
) -> Iterator[tuple[Stage, dict[str, str], dict[str, str]]]:
    """Each stage, in order, with its modules (dotted name → text) and the names earlier stages
    export (name → module).

    Later stages' exported cells use earlier stages' names, so a stage's modules can only be
    generated once the stages before it are known. A stage whose modules conflict with earlier
    ones raises :class:`SourceError` before it is yielded.
    """
    earlier: dict[str, str] = {}
    exporters: dict[str, str] = {}
    for stage in stages:
        label = roots.label(stage.source)
        modules = export_modules(stage.notebook.cells, label, stage.number, dict(earlier))
        defined = {module: defined_names(text) for module, text in modules.items()}
        for module, names in defined.items():
            _claim_module(module, label, exporters)
            for name in sorted(names):
                _claim_name(name, module, label, earlier, exporters)
        yield stage, modules, dict(earlier)
        for module, names in defined.items():
            earlier.update(dict.fromkeys(names, module))


def stage_module_table(
    stages: list[Stage] | None = None, roots: Roots = ROOTS
) -> dict[str, list[str]]:
    """Each stage's name with the files of the modules it exports (``aie_lessons/...`` paths), in
    the order its cells export them: what README.md and ``aie status`` show."""
    stages = load_stages(roots) if stages is None else stages
    return {
        stage.name: [module_file(module) for module in modules]
        for stage, modules, _ in staged_modules(stages, roots)
    }


def package_inits(
    staged: list[tuple[Stage, dict[str, str], dict[str, str]]], roots: Roots = ROOTS
) -> dict[Path, str]:
    """A generated ``__init__.py`` for each subpackage that modules are exported into, headed by
    the first stage that exports into it."""
    inits: dict[Path, str] = {}
    for stage, modules, _ in staged:
        for module in modules:
            parts = module.split(".")[:-1]
            for depth in range(1, len(parts) + 1):
                path = roots.package.joinpath(*parts[:depth], "__init__.py")
                if path not in inits:
                    package = ".".join(parts[:depth])
                    inits[path] = package_init(package, roots.label(stage.source), stage.number)
    return inits


# --- orphans and the README table ---------------------------------------------------------------


def generated_from(path: Path) -> str | None:
    """The source a generated file's header names, or None for a hand-written file."""
    with path.open(encoding="utf-8") as file:
        match = GENERATED_RE.match(file.readline())
    return match["source"] if match else None


def orphans(expected: set[Path], roots: Roots = ROOTS) -> dict[Path, str]:
    """Generated files in the package that no stage exports any more, each with the source that
    its header says generated it."""
    found: dict[Path, str] = {}
    for path in sorted(roots.package.rglob("*.py")):
        source = generated_from(path)
        if source and path not in expected:
            found[path] = source
    return found


def remove_orphan(path: Path, roots: Roots = ROOTS) -> None:
    """Delete an orphan, then each folder it leaves with nothing but bytecode caches — a package
    whose generated ``__init__.py`` went with its last module."""
    path.unlink()
    folder = path.parent
    while folder != roots.package and all(p.name == "__pycache__" for p in folder.iterdir()):
        shutil.rmtree(folder)
        folder = folder.parent


def readme_block(table: dict[str, list[str]]) -> str:
    """The stage → module table as README.md shows it (Markdown)."""
    rows = [
        f"| {stage} | {', '.join(f'`{file}`' for file in files) or '—'} |"
        for stage, files in table.items()
    ]
    return "\n".join(["| stage | exports |", "|---|---|", *rows])


def with_readme_block(
    readme: str, block: str, markers: tuple[str, str] = (README_BEGIN, README_END),
    what: str = "stage → module table",
) -> str:
    """The README's text with what lies between a pair of markers replaced by ``block``."""
    begin_marker, end_marker = markers
    begin, end = readme.find(begin_marker), readme.find(end_marker)
    if begin < 0 or end < begin:
        raise SourceError(
            f"README.md has no `{begin_marker}` … `{end_marker}` block for the generated "
            f"{what}. Fix: put those two lines, in that order, where the table belongs."
        )
    return f"{readme[:begin + len(begin_marker)]}\n{block}\n{readme[end:]}"


# --- solution notebooks -------------------------------------------------------------------------


def inputs_digest(stage: Stage, stages: list[Stage], roots: Roots = ROOTS) -> str:
    """A hash of everything a solution notebook's outputs depend on that the course writes:
    this stage's source, every earlier stage's (their modules are imported) and the checks."""
    digest = hashlib.sha256()
    earlier = [s for s in stages if s.number <= stage.number]
    checks = roots.package / "checks"
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


def build(
    stages: list[str] | None = None, check: bool = False, run: bool = True, roots: Roots = ROOTS
) -> list[str]:
    """Bring derived files up to date (or, with ``check``, list the stale ones).

    Package files (modules, package ``__init__.py`` files, orphans) and README.md are derived from
    every stage together, so ``stages`` narrows only which stages' modules and notebooks are
    written.
    """
    stale: list[str] = []

    def sync(path: Path, text: str) -> None:
        current = path.read_text() if path.exists() else None
        if current == text:
            return
        stale.append(roots.label(path))
        if not check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)

    loaded = load_stages(roots)
    selected = [s for s in loaded if not stages or s.number in stages]
    staged = list(staged_modules(loaded, roots))
    for stage, modules, _ in staged:
        if stage in selected:
            for module, text in modules.items():
                sync(roots.module_path(module), text)
    inits = package_inits(staged, roots)
    for path, text in inits.items():
        sync(path, text)
    exported = {roots.module_path(module) for _, modules, _ in staged for module in modules}
    for path, source in orphans(exported | set(inits), roots).items():
        done = "" if check else "; deleted"
        stale.append(f"{roots.label(path)} (orphan: its header says {source} generated it, "
                     f"and no stage exports it any more{done})")
        if not check:
            remove_orphan(path, roots)
    readme = roots.readme.read_text() if roots.readme.exists() else ""
    readme = with_readme_block(readme, readme_block(stage_module_table(loaded, roots)))
    if exercise_lines.README_BEGIN in readme or any(s.exercises for s in loaded):
        readme = with_readme_block(readme, exercise_lines.table(loaded),
                                   (exercise_lines.README_BEGIN, exercise_lines.README_END),
                                   "table of learner-written lines")
    sync(roots.readme, readme)
    # Modules first: a solution notebook may import an earlier stage's module.
    for stage in selected:
        solution_path = roots.solutions / f"{stage.name}.ipynb"
        reference = reference_notebook(stage)
        reference.metadata["aie"] = {"inputs": inputs_digest(stage, loaded, roots)}
        on_disk = nbformat.read(solution_path, as_version=4) if solution_path.exists() else None
        if (
            on_disk is not None
            and same_cells(on_disk, reference)
            and is_executed(on_disk)
            and on_disk.metadata.get("aie") == reference.metadata["aie"]
        ):
            continue
        stale.append(roots.label(solution_path))
        if run and not check:
            print(f"executing {stage.name} ...", flush=True)
            solution_path.write_text(notebook_text(execute(reference, roots.solutions)))
    for stage in selected:
        learner_path = roots.notebooks / f"{stage.name}.ipynb"
        learner = learner_notebook(stage)
        learner.metadata["language_info"] = language_info(learner_path, roots.solutions / f"{stage.name}.ipynb")
        sync(learner_path, notebook_text(learner))
    return stale


def kernel_language_info() -> dict:
    """What this Python's kernel will report about its language: ipykernel's own dict."""
    from ipykernel.ipkernel import IPythonKernel

    return dict(IPythonKernel.language_info)


def language_info(learner_path: Path, solution_path: Path) -> dict:
    """The ``language_info`` a learner notebook carries: the one it has, else its solution's.

    JupyterLab writes the kernel's language_info into a notebook as the kernel starts, so a
    notebook without it, or with another Python's, opens already modified. It describes the
    machine, not the course: `aie lab` sets it to the learner's own kernel, and the build keeps
    what it finds rather than calling that notebook stale. A new notebook takes the one its
    executed solution recorded from the kernel.
    """
    for path in (learner_path, solution_path):
        if path.exists():
            info = nbformat.read(path, as_version=4).metadata.get("language_info")
            if info:
                return info
    return kernel_language_info()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="fail if any derived file is stale")
    parser.add_argument("--no-execute", action="store_true", help="do not run solution notebooks")
    parser.add_argument("--stages", help="comma-separated stage numbers, e.g. 00,01")
    args = parser.parse_args(argv)
    stages = args.stages.split(",") if args.stages else None
    try:
        stale = build(stages, check=args.check, run=not args.no_execute)
    except SourceError as exc:  # the message names the stage, the problem and the fix
        print(f"build: error: {exc}", file=sys.stderr)
        return 2
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
