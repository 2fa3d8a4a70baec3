"""Mutation testing of the equation and method files with mutmut: how many small wrong edits the fast tests catch.

Implements (no equation: this file measures the tests of the files that implement them):
    TESTS                        → each method file and the fast test files that exercise it
    workspace(module, work)      → a folder of its own for one module: links to the repository and mutmut's setup.cfg
    run(module, work, children)  → `mutmut run` there; returns its counts (killed, survived, no tests, timeout, ...)
    main(argv)                   → one module after another, then the table docs/testing.md shows

Run: python tools/mutation.py [gae critic_free ...] [--work runs/mutation] [--max-children 2] [--keep] [--only NAME ...]
     (the developer tool is not a requirement of the project: `pip install mutmut==3.8.1` first; not run in CI)
     cd runs/mutation/gae && mutmut results         (the survivors' names; `mutmut show NAME` prints one's diff)

mutmut copies the module (mutated), the rest of the repository and tests/ into `<work>/<module>/mutants/` and runs
pytest there. It first records which tests call which function, then runs, for each mutant, only the selected fast
tests that call the mutated function, stopping at the first failure. A mutant is killed when a test fails, survives
when all pass, and has no tests when no selected test calls its function. The score is killed / (killed + survived +
no tests + timeouts). The work folder is under runs/ (ignored by git and by tests/test_requirements.py's scan of
the sources), and each run starts from an empty one unless --keep.
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

FAST = "not slow and not notebook and not deepspeed and not heavy"  # the fast tests, as CI runs them

# Each module's own tests, the peers' formulas re-implemented (test_conventions.py) where it has equations there, and
# tests/test_mutation_gaps.py (the tests written for the survivors that were real gaps).
TESTS = {
    "gae": ["tests/test_gae.py", "tests/test_conventions.py"],
    "critic_free": ["tests/test_critic_free.py", "tests/test_conventions.py"],
    "best_of_n": ["tests/test_best_of_n.py"],
    "dpo": ["tests/test_dpo.py"],
    "ppo_loss": ["tests/test_ppo_loss.py", "tests/test_kl_direction.py", "tests/test_conventions.py"],
    "ppo_max": ["tests/test_ppo_max_scores.py", "tests/test_ppo_max_update.py", "tests/test_kl_direction.py",
                "tests/test_conventions.py"],
    "reward_model": ["tests/test_reward_model.py", "tests/test_conventions.py"],
}
GAPS = "tests/test_mutation_gaps.py"

# What the workspace links to: everything the tests import or read, but not the module under test (mutmut copies it).
LINKED = ["tests", "tools", "data", "docs", "pytest.ini", "README.md"]

# mutmut's exit codes of a mutant's check (mutmut/stats.py, status_by_exit_code); any other one is "suspicious"
STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 2: "interrupted", 33: "no tests", 34: "skipped",
          35: "suspicious", 36: "timeout", 37: "caught by type check", -24: "timeout", 24: "timeout", 152: "timeout",
          255: "timeout", -11: "segfault", -9: "segfault"}


def workspace(module: str, work: Path) -> Path:
    """<work>/<module>/: a setup.cfg that points mutmut at `module`.py and its tests, and links to the repository."""
    ws = work / module
    ws.mkdir(parents=True, exist_ok=True)
    names = [p.name for p in ROOT.glob("*.py")] + [n for n in LINKED if (ROOT / n).exists()]
    for name in names:
        if not (ws / name).exists():
            (ws / name).symlink_to(ROOT / name)
    tests = [t for t in TESTS[module] + [GAPS] if (ROOT / t).exists()]
    also = [n for n in names if n != f"{module}.py" and n != "tests"]
    lines = ["[mutmut]", f"source_paths = {module}.py", "also_copy ="] + [f"    {n}" for n in also]
    lines += ["pytest_add_cli_args_test_selection ="] + [f"    {t}" for t in tests]
    lines += ["pytest_add_cli_args =", "    -m", f"    {FAST}", "    -p", "    no:cacheprovider",
              "process_isolation = forkserver", "use_git_change_detection = false"]
    (ws / "setup.cfg").write_text("\n".join(lines) + "\n")
    return ws


def run(module: str, work: Path, children: int, only: list[str] = ()) -> dict:
    """mutmut run for one module (only the mutants that `only`'s names or shell patterns match, if any); its counts
    by status (of those, if any), and the wall time in seconds."""
    ws = workspace(module, work)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    mutmut = shutil.which("mutmut") or str(Path(sys.executable).parent / "mutmut")
    start = time.time()
    subprocess.run([mutmut, "run", "--max-children", str(children), *only], cwd=ws, env=env, check=False)
    counts: dict[str, int] = {}
    for meta in (ws / "mutants").glob(f"{module}.py.meta"):
        for name, code in json.loads(meta.read_text())["exit_code_by_key"].items():
            # mutmut resets the other verdicts when the test selection changes: count only the mutants asked for
            if only and not any(fnmatch.fnmatchcase(name, pattern) for pattern in only):
                continue
            status = "not checked" if code is None else STATUS.get(code, "suspicious")
            counts[status] = counts.get(status, 0) + 1
    counts["wall_s"] = round(time.time() - start)
    return counts


def score(counts: dict) -> float:
    """killed / every mutant that was checked or had no test (a mutant no fast test calls is not caught)."""
    caught = counts.get("killed", 0) + counts.get("caught by type check", 0)
    total = sum(v for k, v in counts.items() if k not in ("wall_s", "skipped", "not checked"))
    return caught / total if total else float("nan")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("modules", nargs="*", default=list(TESTS), help=f"any of {', '.join(TESTS)} (default: all)")
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "mutation", help="where the workspaces go")
    ap.add_argument("--max-children", type=int, default=2, help="mutants checked at once (one per free core)")
    ap.add_argument("--keep", action="store_true", help="reuse a workspace's earlier results instead of a new run")
    ap.add_argument("--only", nargs="+", default=[], metavar="NAME",
                    help="check only these mutants (again, with --keep), e.g. gae.x__check_inputs__mutmut_21, or "
                         "shell patterns as mutmut takes them, e.g. 'reward_model.x_score_pairs__mutmut_*'")
    args = ap.parse_args(argv)
    unknown = [m for m in args.modules if m not in TESTS]
    if unknown:
        print(f"error: unknown module {unknown[0]!r}; expected one of {', '.join(TESTS)}", file=sys.stderr)
        raise SystemExit(2)
    if not shutil.which("mutmut") and not (Path(sys.executable).parent / "mutmut").exists():
        print("error: mutmut is not installed; `pip install mutmut==3.8.1` (a developer tool, not a requirement)",
              file=sys.stderr)
        raise SystemExit(2)
    table = {}
    for module in args.modules:
        if not args.keep:
            shutil.rmtree(args.work / module, ignore_errors=True)
        only = [n for n in args.only if n.startswith(module + ".")]
        table[module] = run(module, args.work, args.max_children, only)
        print(f"{module}: {table[module]}", flush=True)
    print(f"\n{'file':<16}{'mutants':>8}{'killed':>8}{'survived':>9}{'no tests':>9}{'timeout':>8}{'score':>8}"
          f"{'wall':>7}")
    for module, c in table.items():
        total = sum(v for k, v in c.items() if k not in ("wall_s", "skipped", "not checked"))
        print(f"{module + '.py':<16}{total:>8}{c.get('killed', 0):>8}{c.get('survived', 0):>9}"
              f"{c.get('no tests', 0):>9}{c.get('timeout', 0):>8}{score(c):>8.1%}{c['wall_s']:>6}s")
    return table


if __name__ == "__main__":
    main()
