"""A pytest plugin that makes nbval compare what a notebook *computes*, not what it warns.

nbval compares stderr like any other output, but stderr carries progress bars, deprecation
warnings and library chatter that change between versions and machines without the notebook
being wrong. Loaded with ``-p aie_lessons.course.nbval_plugin`` (``make test`` and ``aie grade``
do), it leaves stderr out of the comparison; stdout, results and errors are still compared.
"""

from __future__ import annotations


def pytest_collection_modifyitems(session, config, items) -> None:
    for item in items:
        notebook = item.parent
        skip = getattr(notebook, "skip_compare", None)
        if skip is not None and "stderr" not in skip:
            notebook.skip_compare = (*skip, "stderr")
