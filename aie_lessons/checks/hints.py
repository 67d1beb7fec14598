"""``checks.hint("N.M")``: an exercise's hints, one level at a time, only when asked for.

A hint printed above a stub is read before the learner has tried, and a hint that is the code
takes the exercise away. So the stub names the task only, and the hints wait here in three
levels: the idea, the approach, the code. They are read from the stage's one source
(``solutions/NN_name.py``), so they can never drift from the reference solution.
"""

from __future__ import annotations

import re
import textwrap

from aie_lessons.infra.paths import REPO_ROOT

SOLUTIONS_DIR = REPO_ROOT / "solutions"
LEVEL_NAMES = ("the idea", "the approach", "the code")


def hint(exercise: str, level: int = 1) -> None:
    """Print hint ``level`` (1 the idea, 2 the approach, 3 the code) for ``exercise``, e.g. "2.2"."""
    from aie_lessons.course.source import exercises_in  # jupytext is needed only when asked

    if not isinstance(exercise, str):  # 1.10 as a float is 1.1: only a string says which
        raise TypeError(f'pass the exercise id as a string, e.g. checks.hint("1.10"), not {exercise!r}')
    if not re.fullmatch(r"\d+\.\d+", exercise):
        raise ValueError(f'exercise should look like "2.2" (stage.number), got {exercise!r}')
    exercise = ".".join(str(int(part)) for part in exercise.split("."))  # "01.2" is "1.2"
    if level not in (1, 2, 3):
        raise ValueError(f"level should be 1 (the idea), 2 (the approach) or 3 (the code), got {level!r}")
    stage = f"{int(exercise.split('.')[0]):02d}"
    sources = sorted(SOLUTIONS_DIR.glob(f"{stage}_*.py"))
    if not sources:
        raise FileNotFoundError(
            f"no stage source for exercise {exercise} in {SOLUTIONS_DIR}: hints are read from "
            "solutions/NN_name.py. Fix: run from a full clone of the course."
        )
    found = {e.id: e for e in exercises_in(sources[0].read_text())}
    if exercise not in found:
        raise ValueError(f"stage {stage} has no exercise {exercise}; its exercises are {', '.join(found)}")
    chosen = found[exercise]
    text = chosen.solution if level == 3 else textwrap.fill(chosen.hints[level - 1], width=96)
    more = f'\n(Still stuck? checks.hint("{exercise}", level={level + 1}) gives {LEVEL_NAMES[level]}.)' if level < 3 else ""
    print(f"Exercise {exercise}, hint {level} of 3 — {LEVEL_NAMES[level - 1]}:\n{text}{more}")
