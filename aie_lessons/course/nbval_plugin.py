"""A pytest plugin for nbval runs of course notebooks (``-p aie_lessons.course.nbval_plugin``).

* nbval compares stderr like any other output, but stderr carries progress bars, deprecation
  warnings and library chatter that change between versions and machines without the notebook
  being wrong. This plugin leaves stderr out; stdout, results and errors are still compared.
* With ``AIE_CELL_REPORT=path`` set, it writes one JSON line per cell (its id, whether it
  passed, and nbval's report) so that ``aie grade`` can pair results with cells by id.
"""

from __future__ import annotations

import json
import os
import re

import pytest

REPORT_ENV = "AIE_CELL_REPORT"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def pytest_collection_modifyitems(session, config, items) -> None:
    for item in items:
        notebook = item.parent
        skip = getattr(notebook, "skip_compare", None)
        if skip is not None and "stderr" not in skip:
            notebook.skip_compare = (*skip, "stderr")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    path = os.environ.get(REPORT_ENV)
    cell = getattr(item, "cell", None)
    if not path or cell is None or report.when != "call":
        return
    record = {
        "id": cell.get("id"),
        "passed": report.passed,
        "skipped": report.skipped,
        "message": _ANSI.sub("", report.longreprtext or ""),
    }
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
