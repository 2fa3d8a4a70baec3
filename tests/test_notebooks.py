"""Every notebook under notebooks/ runs top to bottom under nbclient, in its small budget (PPO_MAX_FULL=0).

Run alone: `python -m pytest -m notebook`. The notebooks are executed in memory: their committed outputs
(from the full-budget runs) are never overwritten by the test.
"""
import sys
from pathlib import Path

import nbformat
import pytest
from ipykernel.kernelspec import write_kernel_spec
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

from conftest import selected, two_at_a_time

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


@pytest.fixture(scope="session")
def kernel_dirs(tmp_path_factory) -> list[str]:
    """A private 'python3' kernelspec that launches this very interpreter (sys.executable).

    A fresh `pip install -r requirements.txt` ships a 'python3' spec with ipykernel, but a user-level spec of
    the same name (~/.local/share/jupyter/kernels) may point at another Python without torch; writing our
    own into a temporary folder sidesteps both, and installs nothing into the environment.
    """
    kernels = tmp_path_factory.mktemp("kernels")
    write_kernel_spec(kernels / "python3")  # argv = [sys.executable, "-m", "ipykernel_launcher", ...]
    return [str(kernels)]


def execute(path: Path, kernel_dirs: list[str]) -> None:
    """One notebook top to bottom in a kernel of its own, in memory; raises CellExecutionError, naming the cell, on
    the first failing cell."""
    nb = nbformat.read(path, as_version=4)
    km = KernelManager(kernel_name="python3", kernel_spec_manager=KernelSpecManager(kernel_dirs=kernel_dirs))
    assert Path(km.kernel_spec.argv[0]) == Path(sys.executable)
    # cleanup_kc: shut the kernel down at the end, pass or fail. nbclient does that by default only for a kernel
    # manager of its own; given ours, it left every notebook's kernel running (with torch loaded) to the suite's end
    NotebookClient(nb, km=km, timeout=900, resources={"metadata": {"path": str(path.parent)}}).execute(cleanup_kc=True)


@pytest.fixture(scope="module")
def executed(request, kernel_dirs) -> dict:
    """The selected notebooks, two at a time (each kernel trains its runs on one core, --threads 1, and the machine
    has two; notebooks/runs.py's locks let two share the cached bases and runs): name → None, or the exception."""
    paths = [p for p in NOTEBOOKS if p in selected(request, "test_notebook_runs_top_to_bottom", "path")]

    def run(path):
        try:
            execute(path, kernel_dirs)
        except Exception as e:  # noqa: BLE001 — reported by that notebook's own test
            return e
        return None

    with pytest.MonkeyPatch.context() as mp:  # the kernels inherit the environment
        mp.setenv("PPO_MAX_FULL", "0")          # figure notebooks use FULL = False: the small budget
        mp.setenv("PPO_MAX_JOBS", "2")          # runs.slot(): two trainings at once, over both kernels
        return dict(zip([p.stem for p in paths], two_at_a_time(run, paths)))


@pytest.mark.notebook
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_top_to_bottom(path, executed):
    if executed[path.stem] is not None:
        raise executed[path.stem]
