"""The course's tools: one source per stage, the notebooks built from it, commits, checks, grading.

Every one of them reads notebooks with ``nbformat``, and importing ``nbformat`` imports
``jsonschema``, which builds the grammar of an optional IRI-format checker from the
``rfc3987_syntax`` package when that is installed (JupyterLab's dependencies install it). That took
2.4 of nbformat's 3.3 s import on an AVX2-only Zen 3, in every Python that reads a notebook — each
sealed grading run, ``aie status``, each pytest process with the course's nbval plugin — for a
string format that no notebook schema uses (nbformat validates without format checks). A ``None``
entry in ``sys.modules`` makes that optional import fail as jsonschema expects when the package
is missing; a process that imported it already keeps it.
"""

import sys

sys.modules.setdefault("rfc3987_syntax", None)
