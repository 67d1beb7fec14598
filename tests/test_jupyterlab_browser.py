"""The learner's JupyterLab, driven in a real Chromium: the course as a learner meets it.

`aie lab` (what `make lab` runs) serves a scratch copy of the course; Playwright drives Debian's
Chromium (never a browser of its own download) through the page: open a learner notebook, run
every cell, read the first exercise's message, type the solution into the cell, run it and see
its check pass; then open an executed solution notebook and see its charts drawn. Each step
leaves a screenshot in the test's temporary folder; a failing test lists them, and the server's
log, in its report.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import nbformat
import pytest

from course_copy import copy_course, course_env

pytestmark = pytest.mark.slow

# CI installs Chromium and sets this, so that there a missing browser fails instead of skipping.
REQUIRE_ENV = "AIE_REQUIRE_BROWSER"
CHROMIUM = os.environ.get("AIE_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
_missing = (None if CHROMIUM else "no Chromium here. Fix: install Debian's `chromium` package (.ci/run "
            "does) or set AIE_CHROMIUM to a Chromium binary")
try:
    from playwright import sync_api
except ImportError:
    _missing = _missing or "Playwright is missing. Fix: pip install -e '.[dev]' (the dev extra has it)"
if _missing:
    if os.environ.get(REQUIRE_ENV):
        pytest.fail(f"{REQUIRE_ENV} is set but {_missing}", pytrace=False)
    pytest.skip(_missing, allow_module_level=True)

# Chromium's sandbox needs user namespaces, which root in a container does not get; the other
# flags keep it from calling Google's services, which a closed network refuses many times a second.
CHROMIUM_ARGS = ["--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
if os.geteuid() == 0:
    CHROMIUM_ARGS.append("--no-sandbox")
LEARNER = "01_skeleton_loop.ipynb"
SOLUTION_COPY = "solution_01_skeleton_loop.ipynb"  # an executed solution, with its charts
OTHER_PYTHON = "0.0"  # the learner notebook is made to name it, so `aie lab` must put it right
CELLS = ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell"  # the cells of the notebook in view
PROMPTS = ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-InputPrompt"
KERNEL_IDLE = "text=/Python 3 \\(ipykernel\\) \\| Idle/"
# JupyterLab's own settings for the test: every cell in the page (its newer default keeps cells
# out of view out of the DOM, and the test finds cells by their index) and no news pop-up.
LAB_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": '{"windowingMode": "none"}',
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": '{"fetchNews": "false"}',
}


class Lab(NamedTuple):
    base: str  # http://127.0.0.1:PORT
    token: str
    notebooks: Path  # the scratch copy's notebooks/, which the server serves
    log: Path  # everything `aie lab` and Jupyter printed


def os_chosen_port() -> int:
    """A port the OS reports free now (a fixed one could be taken by another test or server)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory, real_model_dir) -> Iterator[Lab]:
    """`aie lab` on a scratch course, with its own Jupyter folders: none of the developer's."""
    course = copy_course(tmp_path_factory.mktemp("lab") / "course")
    shutil.copy(course / "solutions" / LEARNER, course / "notebooks" / SOLUTION_COPY)
    learner = nbformat.read(course / "notebooks" / LEARNER, as_version=4)
    learner.metadata["language_info"]["version"] = OTHER_PYTHON
    nbformat.write(learner, course / "notebooks" / LEARNER)
    jupyter = course / "jupyter"
    for name, text in LAB_SETTINGS.items():
        (jupyter / "settings" / name).parent.mkdir(parents=True, exist_ok=True)
        (jupyter / "settings" / name).write_text(text)
    env = {**course_env(course), "JUPYTER_CONFIG_DIR": str(jupyter / "config"),
           "JUPYTER_DATA_DIR": str(jupyter / "data"), "JUPYTER_RUNTIME_DIR": str(jupyter / "runtime"),
           "JUPYTER_PREFER_ENV_PATH": "1", "JUPYTERLAB_SETTINGS_DIR": str(jupyter / "settings"),
           "JUPYTERLAB_WORKSPACES_DIR": str(jupyter / "workspaces")}
    log = course / "lab.log"
    # -m runs the copy's aie_lessons (PYTHONPATH puts it first), so a commit made in the page
    # could never write the real checkout; `aie lab` is the same main(). `aie lab` becomes
    # Jupyter (exec), so this process is the server and its signals reach it.
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "aie_lessons.cli", "lab", "--no-browser",
                                 "--port", str(os_chosen_port())],
                                cwd=course, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        url = wait_for_url(log, proc)
        found = re.fullmatch(r"(http://127\.0\.0\.1:\d+)/lab\?token=(\w+)", url)
        assert found, f"`aie lab` printed {url!r}, not a loopback URL with a token"
        printed = log.read_text()
        assert "Stop: " in printed and "Ctrl-C" in printed, f"`aie lab` did not say how to stop:\n{printed}"
        assert "1 notebook(s) now name this kernel's Python" in printed, printed
        wait_until_serving(f"{found[1]}/api/status?token={found[2]}", proc, log)
        yield Lab(found[1], found[2], course / "notebooks", log)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # Jupyter shuts its kernels down on SIGTERM
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


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
    """Poll the server's status API until it answers (it starts seconds after printing the URL)."""
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
def browser() -> Iterator[sync_api.Browser]:
    with sync_api.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield chromium
        chromium.close()


class Screens:
    """Numbered screenshots of one test's steps, in its temporary folder."""

    def __init__(self, page: sync_api.Page, folder: Path, log: Path):
        self.page, self.folder, self.log, self.paths = page, folder, log, []

    def shot(self, step: str) -> Path:
        path = self.folder / f"{len(self.paths) + 1:02d}_{step}.png"
        self.page.screenshot(path=str(path))
        self.paths.append(path)
        return path


@pytest.fixture
def page(browser, lab: Lab, request, tmp_path) -> Iterator[sync_api.Page]:
    """A fresh page; conftest's report hook lists its screenshots (and takes one more) on failure."""
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    page = context.new_page()
    page.set_default_timeout(60_000)
    request.node.screens = Screens(page, tmp_path, lab.log)
    yield page
    context.close()


def open_notebook(page: sync_api.Page, lab: Lab, name: str) -> None:
    page.goto(f"{lab.base}/lab/tree/{name}?token={lab.token}")
    page.wait_for_selector(CELLS)
    page.wait_for_selector(KERNEL_IDLE)


def tab_modified(page: sync_api.Page) -> bool:
    return bool(page.locator(".lm-TabBar-tab.jp-mod-current.jp-mod-dirty").count())


def stays_unmodified(page: sync_api.Page, seconds: float = 5) -> bool:
    """Whether the tab shows no unsaved change for ``seconds`` (the kernel's info may come late)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if tab_modified(page):
            return False
        page.wait_for_timeout(250)
    return True


def menu(page: sync_api.Page, top: str, item: str) -> None:
    """Click a main-menu command by its exact label, as a learner would."""
    page.get_by_role("menuitem", name=top, exact=True).click()
    page.get_by_role("menuitem", name=item, exact=True).click()


def prompt(page: sync_api.Page, index: int) -> str:
    return page.locator(CELLS).nth(index).locator(".jp-InputPrompt").inner_text().strip()


def wait_until_ran(page: sync_api.Page, index: int, before: str, timeout_ms: int = 600_000) -> None:
    """Wait until cell ``index`` has a new execution count and nothing is queued or running.

    The prompt is what JupyterLab itself shows: "[*]" while queued or running, "[n]" when done.
    Waiting on the kernel's idle status instead would be wrong: it is idle between the cells of
    one Run All.
    """
    page.wait_for_function(
        """([selector, index, before]) => {
            const prompts = [...document.querySelectorAll(selector)].map(p => p.textContent.trim());
            return /\\[\\d+\\]/.test(prompts[index]) && prompts[index] !== before
                && !prompts.some(p => p.includes('*'));
        }""", arg=[PROMPTS, index, before], timeout=timeout_ms)


def run_cell(page: sync_api.Page, index: int) -> None:
    before = prompt(page, index)
    page.locator(CELLS).nth(index).locator(".jp-InputArea-prompt").click()
    page.keyboard.press("Shift+Enter")
    wait_until_ran(page, index, before)


def save(page: sync_api.Page) -> None:
    page.keyboard.press("Control+s")
    page.wait_for_function("!document.querySelector('.lm-TabBar-tab.jp-mod-current.jp-mod-dirty')")


def error_cells(nb: nbformat.NotebookNode) -> list[int]:
    return [i for i, c in enumerate(nb.cells)
            if c.cell_type == "code" and any(o.output_type == "error" for o in c.outputs)]


def test_learner_notebook_opens_clean_stops_at_the_first_exercise_and_takes_its_solution(lab, page, request):
    screens = request.node.screens
    learner = nbformat.read(lab.notebooks / LEARNER, as_version=4)
    ids = [c.get("id") for c in learner.cells]
    exercise = next(i for i, cell_id in enumerate(ids) if cell_id and cell_id.startswith("s01-ex-"))
    number = ids[exercise].removeprefix("s01-ex-").replace("-", ".")
    check = ids.index(f"s01-check-{number.replace('.', '-')}")
    code = [i for i, c in enumerate(learner.cells) if c.cell_type == "code"]

    open_notebook(page, lab, LEARNER)
    screens.shot("opened")
    assert stays_unmodified(page), "opening the learner notebook marked it modified before any edit"
    assert page.locator(CELLS).count() == len(learner.cells)

    menu(page, "Run", "Run All Cells")
    wait_until_ran(page, code[0], before="[ ]:")  # and every cell after it, up to the error
    save(page)
    ran = nbformat.read(lab.notebooks / LEARNER, as_version=4)
    assert error_cells(ran) == [check], (f"the only error should be exercise {number}'s check (cell "
                                         f"{check}); errors in cells {error_cells(ran)}")
    not_run = [i for i in code if i < check and ran.cells[i].execution_count is None]
    assert not not_run, f"cells {not_run} before the first exercise did not run"
    stub = page.locator(CELLS).nth(check).locator(".jp-OutputArea-output", has_text="is not implemented yet")
    stub.scroll_into_view_if_needed()
    screens.shot("ran_all")
    assert f"Exercise {number} is not implemented yet" in stub.inner_text()

    solution = nbformat.read(lab.notebooks.parent / "solutions" / LEARNER, as_version=4)
    reference_code = next(c.source for c in solution.cells if c.get("id") == ids[exercise])
    page.locator(CELLS).nth(exercise).locator(".cm-content").click()
    page.keyboard.press("Control+a")
    page.keyboard.insert_text(reference_code)  # one input event: no auto-indent or bracket closing
    screens.shot("typed_solution")
    run_cell(page, exercise)
    run_cell(page, check)
    passed = page.locator(CELLS).nth(check).locator(".jp-OutputArea-output", has_text=f"Exercise {number} passed")
    passed.scroll_into_view_if_needed()
    screens.shot("check_passed")
    assert not page.locator(CELLS).nth(check).locator(".jp-OutputArea-output", has_text="not implemented").count()

    save(page)
    solved = nbformat.read(lab.notebooks / LEARNER, as_version=4)
    assert solved.cells[exercise].source == reference_code, "the typed code differs from the reference"
    assert error_cells(solved) == [], f"errors after solving, in cells {error_cells(solved)}"
    outputs = "".join(o.get("text", "") for o in solved.cells[check].outputs)
    assert f"✓ Exercise {number} passed" in outputs


def test_executed_solution_notebook_draws_its_charts(lab, page, request):
    screens = request.node.screens
    executed = nbformat.read(lab.notebooks / SOLUTION_COPY, as_version=4)
    charts = sum("image/png" in o.get("data", {}) for c in executed.cells if c.cell_type == "code"
                 for o in c.outputs)
    assert charts, f"{SOLUTION_COPY} has no chart to look at"

    open_notebook(page, lab, SOLUTION_COPY)
    images = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-OutputArea-output img")
    images.nth(charts - 1).wait_for(state="attached")
    images.evaluate_all("imgs => Promise.all(imgs.map(i => i.decode()))")  # wait until each is drawn
    images.first.scroll_into_view_if_needed()
    screens.shot("chart")
    assert images.count() == charts
    sizes = images.evaluate_all("imgs => imgs.map(i => [i.complete, i.naturalWidth, i.naturalHeight])")
    assert all(done and w > 100 and h > 100 for done, w, h in sizes), f"charts not drawn: {sizes}"
    assert stays_unmodified(page, seconds=2), "opening the executed solution marked it modified"
