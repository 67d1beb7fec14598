"""Run one stage's checks on several versions of the learner's modules in one Python.

The grader's sealed run (``aie_lessons.course.sealed``) starts a fresh Python for every
submission, and most of its five seconds go to importing torch, the checks and the course.
A test that asks "which checks fail when only exercise X is wrong?" for every exercise of every
stage needs dozens of such runs, and what it tests is the checks' isolation from each other, not
the sealing (other tests cover that). So this child pays for the imports once: it imports what
the sealed run trusts, then for each version serves the learner's modules from their text with
the sealed run's own loader, runs the checks, and drops those modules before the next version.
After each version it also asks the sealed run's fingerprint whether anything the checks rely
on was changed: honest wrong code must never be reported as tampering.

Usage (by tests/test_grade.py): ``python -P tests/checks_per_version.py NN`` with a JSON object
``{version: {module: source text}}`` on stdin; the last line of stdout is the JSON object that
``checks_per_version`` returns.
"""

from __future__ import annotations

import json
import sys

from aie_lessons.course.progress import check_results, find_stage
from aie_lessons.course.sealed import LearnerModules, changed, fingerprint, import_trusted
from aie_lessons.course.source import PACKAGE


def forget(name: str) -> None:
    """Drop a module of the previous version: from ``sys.modules`` and from its parent package,
    so that neither ``import a.b`` nor ``from a import b`` finds it again."""
    module = sys.modules.pop(name)
    parent, _, child = name.rpartition(".")
    if getattr(sys.modules.get(parent), child, None) is module:
        delattr(sys.modules[parent], child)


def checks_per_version(stage: str, versions: dict[str, dict[str, str]]) -> dict[str, dict]:
    """``{version: {"results": [[exercise, passed, message], ...], "changed": [...]}}``.

    ``changed`` is what the sealed run's fingerprint would call tampering after that version's
    checks (it must stay empty for honest code): the fingerprint is taken once, after the trusted
    imports, and compared after every version.
    """
    spaces = import_trusted(stage)
    before = fingerprint(spaces)
    trusted = set(sys.modules)
    found, _, _ = find_stage(stage)
    loader = LearnerModules({})
    sys.meta_path.insert(0, loader)
    outcomes = {}
    for version, texts in versions.items():
        for name in [m for m in sys.modules if m.startswith(f"{PACKAGE}.") and m not in trusted]:
            forget(name)  # the previous version's modules, and any module that imported them
        loader.texts = texts
        results = [[r.exercise, r.passed, r.message] for r in check_results(found)]
        outcomes[version] = {"results": results, "changed": changed(before, fingerprint(spaces))}
    return outcomes


if __name__ == "__main__":
    result = checks_per_version(sys.argv[1], json.loads(sys.stdin.read()))
    print("\n" + json.dumps(result))
