"""Execute figure notebooks in place, as the committed ones are: records mode (PPO_MAX_MODE=records), every cell's
output written back into the .ipynb and every PNG into notebooks/figures/.

Implements: no equation; the one command that brings every committed notebook up to date with the tree.
Run:
  python notebooks/execute.py                      every notebook under notebooks/ but exercises.ipynb
  python notebooks/execute.py vanilla_collapse rm  those
  python notebooks/execute.py --registry-only      the notebooks that print a registry's verdicts (Claim.notebook):
                                                   all but overoptimization.ipynb, which judges no registry claim
Panels of a registry's runs are drawn from the committed records (seconds); the panels a record cannot draw are
retrained at train.py's budget, or read from runs/ when a run of the same flags and code is cached there (runs.py).
PPO_MAX_JOBS sets how many runs train side by side (default: one per core). Prints each notebook's wall time.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SKIP = ("exercises",)   # the students' notebook: its outputs are theirs to make


def notebooks(names: list[str]) -> list[Path]:
    paths = [HERE / f"{n.removesuffix('.ipynb')}.ipynb" for n in names] or \
        [p for p in sorted(HERE.glob("*.ipynb")) if p.stem not in SKIP]
    missing = [p.name for p in paths if not p.exists()]
    if missing:
        print(f"error: no notebook {', '.join(missing)} in {HERE}", file=sys.stderr)
        raise SystemExit(2)
    return paths


def execute(path: Path, env: dict, timeout: int = -1) -> None:
    """One notebook top to bottom in its own kernel (in notebooks/), its outputs written back into the file."""
    import nbformat
    from nbclient import NotebookClient
    nb = nbformat.read(path, as_version=4)
    os.environ.update(env)   # the kernel inherits this process's environment
    NotebookClient(nb, timeout=None if timeout < 0 else timeout, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    nbformat.write(nb, path)


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if "--registry-only" in args:
        sys.path.insert(0, str(HERE))
        import claims
        args = [a for a in args if a != "--registry-only"] or sorted({c.notebook for c in claims.R.claims})
    paths = notebooks(args)
    env = {"PPO_MAX_MODE": "records"}
    os.environ.pop("PPO_MAX_FULL", None)
    os.environ.pop("PPO_MAX_RETRAIN", None)
    os.environ.pop("PPO_MAX_FIGURES", None)
    t_all = time.time()
    for path in paths:
        t0 = time.time()
        execute(path, env)
        print(f"{path.name}: executed in place in {time.time() - t0:.0f} s", flush=True)
    print(f"{len(paths)} notebook(s) in {time.time() - t_all:.0f} s")


if __name__ == "__main__":
    main()
