"""The one assertion behind every "this check names the mistake" test."""

from __future__ import annotations

import re

import pytest

from aie_lessons.checks import CheckFailed


def names_the_mistake(exercise: str, message: str):
    """Expect ``CheckFailed`` for ``exercise`` whose text goes on to contain ``message`` (a regex).

    A learner reads the message, so the test pins both halves: which exercise, and what is wrong.
    """
    pattern = f"Exercise {re.escape(exercise)}: .*{message}"
    return pytest.raises(CheckFailed, match=re.compile(pattern, re.DOTALL))
