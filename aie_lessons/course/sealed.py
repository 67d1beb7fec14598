"""Run a stage's checks on a learner's code where that code cannot change the checks.

In a notebook every cell shares one interpreter, so an exercise cell can replace a check
function, ``print`` or a torch function a check relies on, and its check cell then "passes".
The grader therefore runs every check a second time, here, in a fresh Python:

* the learner's exported modules are served to the import system from their text (the package
  on disk is not touched, so grading never changes what ``aie_lessons`` holds);
* the checks, torch and the builtins are imported *before* any learner code runs, and every
  attribute they expose is fingerprinted (the identity of each value);
* after each check the fingerprint is taken again: a changed attribute fails that check and all
  later ones, naming what was changed.

Usage (by ``aie grade``): ``python -m aie_lessons.course.sealed NN`` with a JSON object
``{module: source text}`` on stdin; the last line of stdout is the JSON list of results.
"""

from __future__ import annotations

import builtins
import importlib.abc
import importlib.util
import json
import math
import os
import sys
from types import ModuleType

import torch
import torch.nn.functional

from aie_lessons import checks
from aie_lessons.course import progress
from aie_lessons.course.progress import CheckResult, check_results, find_stage
from aie_lessons.course.source import PACKAGE

Fingerprint = dict[tuple[str, str], int]


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
        name = module.__name__.removeprefix(f"{PACKAGE}.")
        exec(compile(self.texts[name], module.__spec__.origin, "exec"), module.__dict__)


def trusted_namespaces(stage: str) -> dict[str, object]:
    """Everything a check's verdict depends on besides the learner's code."""
    importlib.import_module(f"{PACKAGE}.checks.stage{stage}")
    spaces = {"builtins": builtins, "math": math, "torch": torch, "torch.Tensor": torch.Tensor,
              "torch.nn.functional": torch.nn.functional, "torch.testing": torch.testing,
              "progress": progress, "sealed": sys.modules[__name__]}
    spaces |= {name: module for name, module in sys.modules.items() if name.startswith(f"{PACKAGE}.checks")}
    return spaces


def fingerprint(spaces: dict[str, object]) -> Fingerprint:
    return {(space, attr): id(value) for space, obj in spaces.items() for attr, value in vars(obj).items()}


def changed(before: Fingerprint, after: Fingerprint) -> list[str]:
    """Attributes that were replaced or removed (new ones are fine: modules load lazily)."""
    return sorted(f"{space}.{attr}" for (space, attr), ident in before.items() if after.get((space, attr)) != ident)


def run_sealed(stage: str, texts: dict[str, str]) -> list[CheckResult]:
    spaces = trusted_namespaces(stage)
    # Bound here, before any learner code runs: patching the module's functions afterwards
    # cannot change what this frame calls.
    take, compare = fingerprint, changed
    before = take(spaces)
    sys.meta_path.insert(0, LearnerModules(texts))
    found, _, _ = find_stage(stage)
    results: list[CheckResult] = []
    tampered: list[str] = []
    for result in check_results(found):
        tampered = tampered or compare(before, take(spaces))
        if tampered:
            result = CheckResult(result.exercise, False,
                                 f"your code changed {', '.join(tampered[:3])}, which the checks rely on: "
                                 "grading runs the checks as written, so remove that change")
        results.append(result)
    return results


if __name__ == "__main__":
    # Opened before any learner code runs: a patched print or sys.stdout cannot forge the verdict.
    channel, dumps = os.fdopen(os.dup(sys.stdout.fileno()), "w"), json.dumps
    outcome = run_sealed(sys.argv[1], json.loads(sys.stdin.read()))
    channel.write("\n" + dumps([r.__dict__ for r in outcome]) + "\n")
    channel.flush()
