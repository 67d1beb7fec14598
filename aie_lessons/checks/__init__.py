"""Check cells' logic: each function tests one exercise and names the typical mistake.

A check never compares against the package's own copy of the exercise (that could be the
learner's code after ``aie commit``): it recomputes the expected result from the published
formula, and when the answer is wrong it tries the usual wrong answers to say which one it was.
"""

from aie_lessons.checks import stage01, stage02, stage03, stage04, stage05, stage06, stage07, stage08, stage09, stage10
from aie_lessons.checks.common import CheckFailed
from aie_lessons.checks.hints import hint

__all__ = ["CheckFailed", "hint", "stage01", "stage02", "stage03", "stage04", "stage05", "stage06", "stage07", "stage08", "stage09", "stage10"]
