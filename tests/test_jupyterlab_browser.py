"""The learner's JupyterLab, driven in a real Chromium: the course as a learner meets it.

`aie lab` (what `make lab` runs) serves a scratch copy of the course; Playwright drives Debian's
Chromium (never a browser of its own download) through the page: open a learner notebook, run
every cell, read the first exercise's message, type the solution into the cell, run it and see
its check pass; then open an executed solution notebook and see its charts drawn. Each step
leaves a screenshot in the test's temporary folder; a failing test lists them in its report.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest

from course_copy import copy_course, course_env

pytestmark = pytest.mark.slow

CHROMIUM = os.environ.get("AIE_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
if not CHROMIUM:
    pytest.skip("no Chromium here. Fix: install Debian's `chromium` package (.ci/run does) or set "
                "AIE_CHROMIUM to a Chromium binary", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright is missing. Fix: "
                               "pip install -e '.[dev]' (the dev extra has it)")

# As root in a container Chromium needs --no-sandbox; the rest keep it from calling out to
# Google's services, which this machine's closed network refuses, many times a second.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
LEARNER = "01_skeleton_loop.ipynb"
FIRST_EXERCISE = "1.1"
SOLUTION_COPY = "solution_01_skeleton_loop.ipynb"  # an executed solution, with its charts
CELLS = ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell"  # the cells of the notebook in view
KERNEL_IDLE = "text=Python 3 (ipykernel) | Idle"
KERNEL_BUSY = "text=Python 3 (ipykernel) | Busy"


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """`aie lab` on a free loopback port, serving a scratch course; yields (base URL, token, notebooks)."""
    course = copy_course(tmp_path_factory.mktemp("lab") / "course")
    shutil.copy(course / "solutions" / LEARNER, course / "notebooks" / SOLUTION_COPY)
    # JupyterLab keeps open tabs and settings under the home folder: a scratch set of its own,
    # so neither earlier runs nor the developer's own layout change what the test sees.
    env = {**course_env(course), "JUPYTERLAB_WORKSPACES_DIR": str(course / "lab-workspaces"),
           "JUPYTERLAB_SETTINGS_DIR": str(course / "lab-settings")}
    log = (course / "lab.log").open("w")
    # -m runs the copy's aie_lessons (PYTHONPATH puts it first), so the learner's commits in the
    # page could never write the real checkout; `aie lab` is the same main().
    proc = subprocess.Popen([sys.executable, "-m", "aie_lessons.cli", "lab", "--no-browser"],
                            cwd=course, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        url = wait_for_url(course / "lab.log", proc)
        base, token = re.fullmatch(r"(http://127\.0\.0\.1:\d+)/lab\?token=(\w+)", url).groups()
        wait_until_serving(f"{base}/api/status?token={token}", proc, course / "lab.log")
        yield base, token, course / "notebooks"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # Jupyter shuts its kernels down on SIGTERM
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def wait_for_url(log: Path, proc: subprocess.Popen, timeout: float = 60) -> str:
    """The URL `aie lab` prints, which is the one a learner opens."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(r"Open: (\S+)", log.read_text())
        if found:
            return found.group(1)
        assert proc.poll() is None, f"`aie lab` exited early:\n{log.read_text()}"
        time.sleep(0.2)
    raise AssertionError(f"`aie lab` printed no URL in {timeout} s:\n{log.read_text()}")


def wait_until_serving(url: str, proc: subprocess.Popen, log: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"JupyterLab exited:\n{log.read_text()}"
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"JupyterLab did not answer {url} in {timeout} s:\n{log.read_text()}")


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield chromium
        chromium.close()


class Screens:
    """Numbered screenshots of one test's steps, in its temporary folder."""

    def __init__(self, page, folder: Path):
        self.page, self.folder, self.paths = page, folder, []

    def shot(self, step: str) -> Path:
        path = self.folder / f"{len(self.paths) + 1:02d}_{step}.png"
        self.page.screenshot(path=str(path))
        self.paths.append(path)
        return path


@pytest.fixture
def page(browser, request, tmp_path):
    """A fresh page; its screenshots are listed in the report (and one more taken) on failure."""
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    page = context.new_page()
    page.set_default_timeout(60_000)
    request.node.screens = Screens(page, tmp_path)  # read by conftest's report hook
    yield page
    context.close()


def open_notebook(page, lab, name: str) -> None:
    base, token, _ = lab
    page.goto(f"{base}/lab/tree/{name}?token={token}")
    page.wait_for_selector(CELLS)
    page.wait_for_selector(KERNEL_IDLE)
    news = page.get_by_role("button", name="No")  # "get notified about Jupyter news?": no
    if news.count():
        news.first.click()


def current_tab_is_modified(page) -> bool:
    return "jp-mod-dirty" in (page.locator(".lm-TabBar-tab.jp-mod-current").first.get_attribute("class") or "")


def run_command(page, label: str) -> None:
    """Run a JupyterLab command by its menu label, through the command palette."""
    page.keyboard.press("Control+Shift+c")
    palette = page.locator(".lm-CommandPalette-input")
    palette.fill(label)
    page.locator(".lm-CommandPalette-item", has_text=label).first.click()


def wait_for_kernel(page) -> None:
    """Wait for the kernel to go busy (if it has not finished already) and back to idle."""
    try:
        page.wait_for_selector(KERNEL_BUSY, timeout=5_000)
    except sync_api.TimeoutError:
        pass  # the work was quicker than the status bar: idle is what we wait for next
    page.wait_for_selector(KERNEL_IDLE, timeout=600_000)


def save(page) -> None:
    page.keyboard.press("Control+s")
    page.wait_for_function("!document.querySelector('.lm-TabBar-tab.jp-mod-current.jp-mod-dirty')")


def cell(page, index: int):
    return page.locator(CELLS).nth(index)


def test_learner_notebook_opens_clean_stops_at_the_first_exercise_and_takes_its_solution(lab, page, request):
    screens = request.node.screens
    notebooks = lab[2]
    learner = nbformat.read(notebooks / LEARNER, as_version=4)
    ids = [c.get("id") for c in learner.cells]
    number = FIRST_EXERCISE.replace(".", "-")
    exercise, check = ids.index(f"s01-ex-{number}"), ids.index(f"s01-check-{number}")

    open_notebook(page, lab, LEARNER)
    page.wait_for_timeout(1_000)  # the kernel's info arrives after idle; it must change nothing
    screens.shot("opened")
    assert not current_tab_is_modified(page), \
        "opening the learner notebook marked it modified before any edit"
    assert page.locator(CELLS).count() == len(learner.cells)

    run_command(page, "Run All Cells")
    wait_for_kernel(page)
    stub = cell(page, check).locator(".jp-OutputArea-output", has_text="is not implemented yet")
    stub.wait_for()
    stub.scroll_into_view_if_needed()
    screens.shot("ran_all")
    assert f"Exercise {FIRST_EXERCISE} is not implemented yet" in stub.inner_text()

    save(page)
    ran = nbformat.read(notebooks / LEARNER, as_version=4)
    errors = [i for i, c in enumerate(ran.cells) if c.cell_type == "code"
              and any(o.output_type == "error" for o in c.outputs)]
    assert errors == [check], (f"the first error should be exercise {FIRST_EXERCISE}'s check "
                               f"(cell {check}); errors in cells {errors}")
    not_run = [i for i, c in enumerate(ran.cells[:check]) if c.cell_type == "code" and c.execution_count is None]
    assert not not_run, f"cells {not_run} before the first exercise did not run"

    solution = nbformat.read(notebooks.parent / "solutions" / LEARNER, as_version=4)
    reference_code = next(c.source for c in solution.cells if c.get("id") == ids[exercise])
    editor = cell(page, exercise).locator(".cm-content")
    editor.click()
    page.keyboard.press("Control+a")
    page.keyboard.insert_text(reference_code)  # one input event: no auto-indent or bracket closing
    screens.shot("typed_solution")
    page.keyboard.press("Shift+Enter")  # run the exercise cell; the check cell is selected next
    wait_for_kernel(page)
    page.keyboard.press("Shift+Enter")
    wait_for_kernel(page)
    passed = cell(page, check).locator(".jp-OutputArea-output", has_text=f"Exercise {FIRST_EXERCISE} passed")
    passed.wait_for()
    passed.scroll_into_view_if_needed()
    screens.shot("check_passed")
    assert not cell(page, check).locator(".jp-OutputArea-output", has_text="not implemented").count()

    save(page)
    solved = nbformat.read(notebooks / LEARNER, as_version=4)
    assert solved.cells[exercise].source == reference_code, "the typed code differs from the reference"
    outputs = "".join(o.get("text", "") for o in solved.cells[check].outputs)
    assert f"✓ Exercise {FIRST_EXERCISE} passed" in outputs


def test_executed_solution_notebook_draws_its_charts(lab, page, request):
    screens = request.node.screens
    executed = nbformat.read(lab[2] / SOLUTION_COPY, as_version=4)
    charts = sum("image/png" in o.get("data", {}) for c in executed.cells if c.cell_type == "code"
                 for o in c.outputs)
    assert charts, f"{SOLUTION_COPY} has no chart to look at"

    open_notebook(page, lab, SOLUTION_COPY)
    images = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-OutputArea-output img")
    images.nth(charts - 1).wait_for(state="attached")
    images.first.scroll_into_view_if_needed()
    images.evaluate_all("imgs => Promise.all(imgs.map(i => i.decode()))")  # wait until each is drawn
    screens.shot("chart")
    assert images.count() == charts
    sizes = images.evaluate_all("imgs => imgs.map(i => [i.complete, i.naturalWidth, i.naturalHeight])")
    assert all(done and w > 100 and h > 100 for done, w, h in sizes), f"charts not drawn: {sizes}"
    assert not current_tab_is_modified(page), "opening the executed solution marked it modified"
