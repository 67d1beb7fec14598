"""How much of each stage the learner writes: lines of code inside exercise regions.

The course's promise is that the learner builds the engine, so the share they write is a number
we watch. A line counts when it is code the learner must type: blank lines, comments and hint
lines inside a region do not. ``python -m aie_lessons.course.exercise_lines`` prints the table;
the build keeps the same table in README.md between its ``exercise-lines`` markers.
"""

from __future__ import annotations

import sys

from aie_lessons.course.source import Stage

README_BEGIN = "<!-- exercise-lines:begin -->"
README_END = "<!-- exercise-lines:end -->"


def stage_exercises(stage: Stage) -> list[tuple[str, int]]:
    """(exercise id, learner lines) for each exercise of the stage, in source order."""
    return [(e.id, e.learner_lines) for e in stage.exercises]


def table(stages: list[Stage]) -> str:
    """The per-stage table as Markdown: exercises, learner lines, and the total."""
    rows = ["| stage | exercises | learner lines |", "|---|---|---|"]
    total = 0
    for stage in stages:
        counted = stage_exercises(stage)
        if not counted:
            continue
        lines = sum(n for _, n in counted)
        total += lines
        listing = ", ".join(f"{ident} ({n})" for ident, n in counted)
        rows.append(f"| {stage.name} | {listing} | {lines} |")
    rows.append(f"| **all** | | **{total}** |")
    return "\n".join(rows)


def main() -> int:
    from aie_lessons.course.build import load_stages

    print(table(load_stages()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
