"""The runtime (what `aie generate` and `aie serve` run) stands apart from the course's tooling.

`course/` (building, grading, committing), `checks/` (the exercises' checks) and `harness/` (the
tools that start and load-test a server) serve the lessons; the model, the engine and the server
must run without them, so a learner's broken check or a grading change can never break serving.
`cli.py` is the one entry point for both, and imports course tooling inside the commands that
need it only.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import aie_lessons

PACKAGE = Path(aie_lessons.__file__).parent
NOT_RUNTIME = ("course", "checks", "harness")


def imported_modules(tree: ast.AST, module: str, is_package: bool = False) -> list[tuple[str, ast.stmt]]:
    """Every module an ``import`` or ``from … import`` in ``tree`` names, with its statement.
    Relative ones are resolved against ``module`` — against the package itself when the file is
    the package's ``__init__`` (``is_package``)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")
                parent = parts[:len(parts) - node.level + is_package]
                base = ".".join(parent + ([base] if base else []))
            found += [(f"{base}.{alias.name}" if base else alias.name, node) for alias in node.names]
    return found


def run_at_import(tree: ast.Module) -> ast.Module:
    """The statements that run when the module is imported: ``tree`` without function bodies."""
    class DropFunctions(ast.NodeTransformer):
        def visit_FunctionDef(self, node: ast.AST) -> None:
            return None

        visit_AsyncFunctionDef = visit_FunctionDef

    return DropFunctions().visit(tree)


def is_tooling(name: str) -> bool:
    parts = name.split(".")
    return parts[0] == "aie_lessons" and len(parts) > 1 and parts[1] in NOT_RUNTIME


def runtime_files() -> list[Path]:
    return [path for path in sorted(PACKAGE.rglob("*.py"))
            if path.relative_to(PACKAGE).parts[0] not in NOT_RUNTIME]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_runtime_modules_import_no_course_tooling():
    files = runtime_files()
    assert len(files) > 40 and any(p.parent.name == "engine" for p in files)  # the walk found the package
    offenders = []
    for path in files:
        if path.name == "cli.py":
            continue
        tree = ast.parse(path.read_text())
        found = imported_modules(tree, module_name(path), is_package=path.name == "__init__.py")
        offenders += [f"{path.relative_to(PACKAGE)}:{node.lineno} imports {name}"
                      for name, node in found if is_tooling(name)]
    assert not offenders, "runtime modules import course tooling:\n" + "\n".join(offenders)


def test_the_command_line_imports_course_tooling_only_inside_its_commands():
    tree = ast.parse((PACKAGE / "cli.py").read_text())
    top_level = [name for name, _ in imported_modules(run_at_import(tree), "aie_lessons.cli") if is_tooling(name)]
    assert not top_level, f"cli.py imports course tooling at module level: {top_level}"


def test_the_server_and_engine_load_without_course_tooling():
    """What the import statements say, checked by importing: the serving stack in a fresh
    interpreter loads no module of course/, checks/ or harness/."""
    code = ("import sys, aie_lessons.cli, aie_lessons.server.app, aie_lessons.server.serve, "
            "aie_lessons.engine.compiled_runner, aie_lessons.fast_decode\n"
            "print(sorted(m for m in sys.modules if m.split('.')[:2][-1] in %r and m.startswith('aie_lessons.')))"
            % (NOT_RUNTIME,))
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.strip() == "[]", loaded.stdout


def test_the_check_catches_a_tooling_import():
    """The walk sees a function-level, a relative and a ``from package import`` form alike, and
    ``run_at_import`` leaves out only what runs when a function is called."""
    source = ("def f():\n    from aie_lessons.course.grade import grade\n"
              "from ..checks import stage06\nfrom aie_lessons import harness\n")
    names = [name for name, _ in imported_modules(ast.parse(source), "aie_lessons.engine.x") if is_tooling(name)]
    assert sorted(names) == ["aie_lessons.checks.stage06", "aie_lessons.course.grade.grade", "aie_lessons.harness"]
    at_import = [name for name, _ in imported_modules(run_at_import(ast.parse(source)), "aie_lessons.engine.x")]
    assert sorted(at_import) == ["aie_lessons.checks.stage06", "aie_lessons.harness"]  # not f's import
    in_init = imported_modules(ast.parse("from . import course\n"), "aie_lessons", is_package=True)
    assert [name for name, _ in in_init] == ["aie_lessons.course"]
