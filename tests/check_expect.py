"""The one assertion behind every "this check names the mistake" test."""

from __future__ import annotations

import re
from collections import defaultdict

import pytest

from aie_lessons.checks import CheckFailed


def names_the_mistake(exercise: str, message: str):
    """Expect ``CheckFailed`` for ``exercise`` whose text goes on to contain ``message`` (a regex).

    A learner reads the message, so the test pins both halves: which exercise, and what is wrong.
    """
    pattern = f"Exercise {re.escape(exercise)}: .*{message}"
    return pytest.raises(CheckFailed, match=re.compile(pattern, re.DOTALL))


# Every wrong implementation a test feeds to a check, by exercise: the exercise standard asks for
# at least three per exercise, and tests/test_exercise_standard.py counts them here.
MUTANTS: dict[str, list[str]] = defaultdict(list)


def mutants(exercise: str, cases: list[tuple]):
    """Parametrize a test over ``(wrong implementation, message regex)`` pairs for ``exercise``.

    Use with ``names_the_mistake(exercise, message)`` in the test body; registering the cases
    lets the exercise standard's test prove that every exercise has enough of them. It counts
    distinct messages registered at import, so two mutants that the check cannot tell apart count
    once; whether each one fails with its message is the decorated test's job.
    """
    MUTANTS[exercise].extend(repr(message) for _, message in cases)
    ids = [getattr(wrong, "__name__", f"case{i}") for i, (wrong, _) in enumerate(cases)]
    return pytest.mark.parametrize("wrong, message", cases, ids=ids)
