"""Run a stage's checks on a learner's code where that code cannot quietly change the checks.

In a notebook every cell shares one interpreter, so an exercise cell can replace a check
function, ``print`` or a torch function a check relies on, and its check cell then "passes".
The grader therefore runs every check a second time, here, in a fresh Python:

* the learner's exported modules are served to the import system from their text (the package
  on disk is not touched, so grading never changes what ``aie_lessons`` holds);
* the checks, torch, the builtins, the earlier stages' modules and this runner are imported
  *before* any learner code runs, and fingerprinted: every attribute's identity, a function's
  code, defaults and closure, a class's attributes and its methods' code, and the model module
  (its kernels and the step contract);
* after each check the fingerprint is taken again. A replaced or removed attribute — or an
  added one where nothing is ever added (the checks, the runner, ``torch.Tensor``) — fails that
  check and all later ones, naming what was changed;
* the verdict goes back on a file descriptor opened before learner code runs, tagged with a
  token the parent chose, so printed text cannot forge it.

This stops a learner's code from patching its way past a check. It is not a sandbox against a
determined attacker (who could, say, rewrite this frame's locals through the ``gc`` module).

Usage (by ``aie grade``): ``python -P -m aie_lessons.course.sealed NN`` with a JSON object
``{"token": ..., "modules": {module: source text}}`` on stdin; the result is the line of stdout
that starts with the token, followed by a JSON list of results.
"""

from __future__ import annotations

import builtins
import importlib
import importlib.abc
import importlib.util
import json
import linecache
import math
import os
import sys
import types
from types import ModuleType

import torch

if not torch.cuda.is_available():
    # Triton picks interpreter or compiler when it is first imported, and torch._dynamo (below)
    # imports it: choose for the stage-05 kernels now, as the flash module would have.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch._dynamo  # noqa: E402 - it rebinds torch.manual_seed when first imported: before the fingerprint
import torch.nn.functional  # noqa: E402

from aie_lessons.course import progress  # noqa: E402
from aie_lessons.course.build import ROOTS, load_stages, staged_modules  # noqa: E402
from aie_lessons.course.progress import check_results, find_stage  # noqa: E402
from aie_lessons.course.source import PACKAGE  # noqa: E402

Fingerprint = dict[tuple[str, str], object]


class LearnerModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves ``aie_lessons.<module>`` from the learner's text instead of the file on disk."""

    def __init__(self, texts: dict[str, str]):
        self.texts = texts

    def find_spec(self, fullname, path=None, target=None):
        name = fullname.removeprefix(f"{PACKAGE}.")
        if fullname.startswith(f"{PACKAGE}.") and name in self.texts:
            return importlib.util.spec_from_loader(fullname, self, origin=f"<your {name}>")
        return None

    def create_module(self, spec):
        return None  # the default module object

    def exec_module(self, module: ModuleType) -> None:
        name, origin = module.__name__.removeprefix(f"{PACKAGE}."), module.__spec__.origin
        text = self.texts[name]
        # Source lookups (tracebacks, inspect, and @triton.jit, which reads its kernel's source)
        # find the text here; mtime None tells linecache there is no file to re-check.
        linecache.cache[origin] = (len(text), None, text.splitlines(keepends=True), origin)
        exec(compile(text, origin, "exec"), module.__dict__)


def import_trusted(stage: str) -> dict[str, object]:
    """Import, before any learner code, everything a check's verdict depends on; return the
    namespaces to fingerprint. Earlier stages' modules are imported too, so the learner's code
    runs on top of the reference (or committed) engine, never replaces a piece of it."""
    for number in range(int(stage) + 1):
        try:
            importlib.import_module(f"{PACKAGE}.checks.stage{number:02d}")
        except ModuleNotFoundError:
            continue  # stages without exercises have no checks
    for earlier, modules, _ in staged_modules(load_stages(ROOTS), ROOTS):
        if earlier.number < stage:
            for module in modules:
                importlib.import_module(f"{PACKAGE}.{module}")
    spaces = {"builtins": builtins, "math": math, "torch": torch, "torch.Tensor": torch.Tensor,
              "torch.nn.Module": torch.nn.Module, "torch.nn.functional": torch.nn.functional,
              "torch.testing": torch.testing, "progress": progress, "sealed": sys.modules[__name__]}
    spaces |= {name: module for name, module in sys.modules.items()
               if name.startswith(f"{PACKAGE}.checks") or name == f"{PACKAGE}.course.progress"}
    model = sys.modules.get(f"{PACKAGE}.model")
    if model is not None:  # its kernels and the step contract: what every stage's model runs on
        spaces[f"{PACKAGE}.model"] = model
    return spaces


# Namespaces where nothing is ever added legitimately: a new name there shadows something (in the
# model's module, a builtin its forward calls).
CLOSED = ("sealed", "progress", "torch.Tensor", "torch.nn.Module", f"{PACKAGE}.checks", f"{PACKAGE}.model")


def _entries(obj: object) -> dict[str, object]:
    return dict(obj) if isinstance(obj, dict) else dict(vars(obj))


def _identity(value: object) -> object:
    """What must stay the same about one attribute: the object, and for a function the code,
    defaults and closure it runs with (which can be swapped without replacing the function)."""
    if isinstance(value, types.FunctionType):
        cells = tuple(_cell_id(cell) for cell in value.__closure__ or ())
        return (id(value), id(value.__code__), id(value.__defaults__), id(value.__kwdefaults__), cells)
    if isinstance(value, type) and value.__module__.startswith(PACKAGE):  # a method's code counts too
        return (id(value), tuple(sorted((k, _identity(v) if isinstance(v, types.FunctionType) else id(v))
                                        for k, v in vars(value).items())))
    return id(value)


def _cell_id(cell) -> int | None:
    try:
        return id(cell.cell_contents)
    except ValueError:  # a closure variable not yet assigned
        return None


def fingerprint(spaces: dict[str, object]) -> Fingerprint:
    return {(space, attr): _identity(value) for space, obj in spaces.items() for attr, value in _entries(obj).items()}


def changed(before: Fingerprint, after: Fingerprint) -> list[str]:
    """Attributes replaced or removed anywhere, or added to a closed namespace."""
    altered = [f"{space}.{attr}" for (space, attr), ident in before.items() if after.get((space, attr)) != ident]
    added = [f"{space}.{attr}" for (space, attr) in after.keys() - before.keys() if space.startswith(CLOSED)]
    return sorted(altered + added)


def run_sealed(stage: str, texts: dict[str, str]) -> list[dict]:
    spaces = import_trusted(stage)
    # Bound here, before any learner code runs: patching this module afterwards cannot change
    # what this frame calls.
    take, compare, result_of = fingerprint, changed, dict
    before = take(spaces)
    sys.meta_path.insert(0, LearnerModules(texts))
    found, _, _ = find_stage(stage)
    results: list[dict] = []
    tampered: list[str] = []
    for result in check_results(found):
        tampered = tampered or compare(before, take(spaces))
        verdict = result_of(exercise=str(result.exercise), passed=result.passed is True,
                            message=str(result.message))
        if tampered:
            verdict = result_of(exercise=verdict["exercise"], passed=False,
                                message=f"your code changed {', '.join(tampered[:3])}, which the checks "
                                        "rely on: grading runs the checks as written, so remove that change")
        results.append(verdict)
    return results


if __name__ == "__main__":
    # Read and opened before any learner code runs: printed text cannot forge the verdict.
    request = json.loads(sys.stdin.read())
    channel, dumps, token = os.fdopen(os.dup(sys.stdout.fileno()), "w"), json.dumps, request["token"]
    outcome = run_sealed(sys.argv[1], request["modules"])
    channel.write(f"\n{token} {dumps(outcome)}\n")
    channel.flush()
