"""Run independent child Pythons two at a time: the one kind of parallelism that pays here."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor


def two_at_a_time(fn, items: list, monkeypatch) -> dict:
    """``{item: fn(item)}``, two items at a time, for functions that start child Pythons (sealed
    runs, gradings, console-script runs) and wait for them.

    Such a child is mostly a fresh Python importing torch, then small work: one core's worth.
    With one thread each (OMP_NUM_THREADS, inherited by the children's torch) two of them use the
    two cores without fighting over them, and take half the time when nothing else runs (under
    `make test`'s two pytest workers the other worker shares the cores too, and the pair still
    overlaps its start-ups). Every child of one call runs with that one thread, so results
    compared within a call come from the same thread count.
    """
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(items, pool.map(fn, items)))
