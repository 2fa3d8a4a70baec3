"""Test set-up: put the repo root on sys.path, and let a teacher point the equation tests at a student's code.

Assignment mode (see TEACHING.md): `PPO_MAX_IMPL=handout/ pytest tests/test_gae.py` makes `import gae`,
`import ppo_loss`, `import reward_model` and `import ppo_max` load the student's files from that folder (where there
is one); every other module (data, engine, ...) still comes from the repository. A relative PPO_MAX_IMPL is taken
from the repository root, so it names the same folder whatever the current directory (tools/assignment.py's
impl_folder; the exercises notebook reads it the same way).
"""
import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "tools"))
# `python -m plumbing.data ...` and the other package commands, from any folder a test runs them in
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])  # the tools (tiny_model, bench, gpu_check, assignment) import as modules too

if os.environ.get("PPO_MAX_IMPL"):
    import assignment

    try:
        assignment.import_from(assignment.impl_folder(os.environ["PPO_MAX_IMPL"]))
    except assignment.ImplFolderError as e:
        raise SystemExit(f"error: {e}") from None


# ---------------------------------------------------------------------------------------------------------------
# Long trainings in the background: `@pytest.mark.background(["train.py", ...])` starts that command in a fresh folder
# of its own as soon as the tests are collected, and the test's `background` fixture waits for it. Most of the suite
# runs on one core; such a run takes the other one instead of adding its minutes to the end.
# ---------------------------------------------------------------------------------------------------------------
EARLY_MODULES = pytest.StashKey[list]()  # the modules start_early was called on (their summaries at the end)
BACKGROUND = pytest.StashKey[tuple]()  # item.stash[BACKGROUND] = (its folder, its Popen)


def pytest_collection_modifyitems(items):
    """The notebooks' tests last: their notebooks run on the spare core while the rest of the suite runs one test at a
    time on the other, and once those are done both cores finish the notebooks (test_notebooks.py's finish_on_both)."""
    items.sort(key=lambda item: item.get_closest_marker("notebook") is not None)   # stable: the order otherwise kept


def pytest_collection_finish(session):
    import subprocess
    import tempfile
    if session.config.option.collectonly:
        return
    for item in session.items:
        mark = item.get_closest_marker("background")
        if mark is not None:
            work = Path(tempfile.mkdtemp(prefix="ppo-max-background-"))
            argv = [sys.executable, str(ROOT / mark.args[0][0]), *mark.args[0][1:]]
            with open(work / "output.log", "w") as log:
                item.stash[BACKGROUND] = (work, subprocess.Popen(argv, cwd=work, stdout=log, stderr=subprocess.STDOUT))
    session.config.stash[EARLY_MODULES] = early_modules(session)
    for module in early_modules(session):  # e.g. test_notebooks: its notebooks start after the runs above
        module.start_early(session)


def early_modules(session) -> list:
    """The selected tests' modules that start work of their own once collected: start_early(session) then,
    stop_early() at the session's end."""
    modules = dict.fromkeys(getattr(item, "module", None) for item in session.items)
    return [m for m in modules if m is not None and hasattr(m, "start_early")]


def pytest_terminal_summary(terminalreporter, config):
    """What the modules that worked early report (e.g. when the notebooks ran)."""
    for module in config.stash.get(EARLY_MODULES, []):
        line = getattr(module, "early_summary", lambda: None)()
        if line:
            terminalreporter.write_line(line)


def pytest_sessionfinish(session):
    import shutil
    for module in early_modules(session):
        module.stop_early()
    for item in session.items:
        if BACKGROUND in item.stash:
            work, proc = item.stash[BACKGROUND]
            if proc.poll() is None:  # a run whose test never ran (-x, Ctrl-C): stop it
                proc.kill()
                proc.wait()
            shutil.rmtree(work, ignore_errors=True)


@pytest.fixture
def background(request) -> tuple[Path, int, str]:
    """The test's background command, finished: (its folder, its exit status, its output)."""
    work, proc = request.node.stash[BACKGROUND]
    proc.wait(timeout=1800)
    return work, proc.returncode, (work / "output.log").read_text()


# ---------------------------------------------------------------------------------------------------------------
# Many slow cases, two at a time: a module fixture runs the cases pytest selected (-k, a node id) on two threads,
# each a process of its own (the machine has two cores), and every case's test reads its own result.
# ---------------------------------------------------------------------------------------------------------------
def selected(request, test: str, param: str) -> set:
    """The values of `param` in the collected cases of the test function `test`."""
    return {item.callspec.params[param] for item in request.session.items
            if getattr(item, "originalname", None) == test}


def two_at_a_time(fn, args) -> list:
    """[fn(a) for a in args], two at once."""
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(max_workers=2) as pool:
        return list(pool.map(fn, args))


# ---------------------------------------------------------------------------------------------------------------
# End-to-end runs of train.py: the runs of one test module share a temporary working directory (so runs/_base, the
# cached stages 1-2, is theirs and not the user's), and are compared by their metrics.jsonl without the wall clock.
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def work(tmp_path_factory, request) -> Path:
    """A fresh directory for the test module, the current one while its tests run."""
    d = tmp_path_factory.mktemp(request.module.__name__.removeprefix("test_"))
    old = os.getcwd()
    os.chdir(d)
    yield d
    os.chdir(old)


def run_metrics(path) -> list[dict]:
    """The rows of <path>/metrics.jsonl without their time/ keys, the only ones that differ between equal runs."""
    return [{k: v for k, v in json.loads(l).items() if not k.startswith("time/")}
            for l in Path(path, "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="session")
def metrics():
    """run_metrics, for the tests and fixtures that compare runs."""
    return run_metrics
