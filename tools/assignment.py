"""Hand out the equation files as assignments (function bodies removed) and grade them with the project's own tests.

Implements (the exercises are the paper's equations; see docs/paper.md and TEACHING.md):
    make   copies gae.py, ppo_loss.py, reward_model.py into a folder with the bodies of the functions in
           ASSIGNMENT replaced by `raise NotImplementedError("exercise: ...")`; signatures, docstrings,
           comments outside those bodies, private helpers and classes (ScalarHeadModel) are kept verbatim.
               gae.py           → Eq. 7–11  (k_step_return, k_step_advantage, compute_gae)
               ppo_loss.py      → Eq. 15, 16, 19 and the masked statistics (policy_loss, value_loss, kl_*, …)
               reward_model.py  → Eq. 1–2   (bradley_terry_loss, response_lm_loss, reward_model_loss)
    grade  runs `pytest tests/test_<module>.py` once per module file present in the folder, with
           PPO_MAX_IMPL=<folder>, so `import gae` in the tests loads the student's gae.py (tests/conftest.py
           puts that folder first on sys.path), and prints a pass/fail table. Exit status 0 iff all pass.

Run:
    python tools/assignment.py make --out handout/                         # all three modules
    python tools/assignment.py make --out handout/ --modules gae            # only gae.py
    # … the student fills in handout/gae.py …
    PPO_MAX_IMPL=handout/ python -m pytest tests/test_gae.py -q       # the student's own check
    python tools/assignment.py grade handout/                               # the teacher's table

The tests are the same ones that check our implementation against independent brute-force computations
(python loops, autograd, torch.distributions), so a student passes exactly when their code agrees with them.
Helpers in the same file that are not in ASSIGNMENT (e.g. ppo_loss.masked_var) call the student's versions
of the assigned ones, so they start working once those are filled in.
"""
from __future__ import annotations

import argparse
import ast
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository: tools/ sits one level below it
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the project's modules (data, train, ...)


# module → the module-level functions whose bodies the student writes (everything else is handed out as is)
ASSIGNMENT: dict[str, list[str]] = {
    "gae": ["k_step_return", "k_step_advantage", "compute_gae"],
    "ppo_loss": ["masked_mean", "masked_whiten", "logprobs_from_logits", "policy_loss", "value_loss",
                 "kl_full", "kl_sampled", "entropy"],
    "reward_model": ["bradley_terry_loss", "response_lm_loss", "reward_model_loss"],
}


def stub_source(source: str, module: str, functions: list[str]) -> str:
    """`source` with the body of each listed module-level function replaced by a NotImplementedError.

    Works on line ranges found with `ast`, so everything outside the removed bodies (the module docstring,
    comments between functions, the `__main__` example, classes) is byte-for-byte the original.
    """
    tree = ast.parse(source)
    defs = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    missing = [f for f in functions if f not in defs]
    if missing:
        raise SystemExit(f"assignment.py: {module}.py has no module-level function(s) {missing}; "
                         f"update ASSIGNMENT in assignment.py")
    lines = source.splitlines(keepends=True)
    edits = []  # (first line to drop, last line to drop, replacement), 1-based inclusive
    for name in functions:
        node = defs[name]
        body = node.body
        has_doc = (isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                   and isinstance(body[0].value.value, str))
        if body[0].lineno == node.lineno:
            raise SystemExit(f"assignment.py: {module}.{name} has its body on the `def` line; cannot stub it")
        indent = " " * body[0].col_offset
        first = (body[0].end_lineno + 1) if has_doc else body[0].lineno
        stub = f'{indent}raise NotImplementedError("exercise: implement {module}.{name} (see its docstring)")\n'
        edits.append((first, node.end_lineno, stub))
    for first, last, stub in sorted(edits, reverse=True):  # bottom-up, so earlier line numbers stay valid
        lines[first - 1 : last] = [stub]
    return "".join(lines)


def make(out: Path, modules: list[str], force: bool = False) -> list[Path]:
    """Write the stubbed copies of `modules` into `out`; returns the files written."""
    out = out.resolve()
    if out == ROOT:
        raise SystemExit("assignment.py make: --out is the repository itself; that would blank the reference code")
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for m in modules:
        dst = out / f"{m}.py"
        if dst.exists() and not force:
            raise SystemExit(f"assignment.py make: {dst} exists (a student's work?); pass --force to overwrite")
        dst.write_text(stub_source((ROOT / f"{m}.py").read_text(), m, ASSIGNMENT[m]))
        written.append(dst)
        print(f"wrote {dst}  ({len(ASSIGNMENT[m])} functions to implement: {', '.join(ASSIGNMENT[m])})")
    return written


def run_tests(impl: Path, module: str) -> dict:
    """Run tests/test_<module>.py against the files in `impl`: counts of passed / failed / errors / skipped,
    and under "failing" the names of the tests that failed or errored."""
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        env = {**os.environ, "PPO_MAX_IMPL": str(impl)}
        cmd = [sys.executable, "-m", "pytest", f"tests/test_{module}.py", "-q", "-p", "no:cacheprovider",
               f"--junitxml={xml}"]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if not xml.exists():  # pytest did not even collect (e.g. the student's file has a syntax error)
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-5:]
            print(f"  {module}: pytest could not run:\n    " + "\n    ".join(tail))
            return {"passed": 0, "failed": 0, "errors": 1, "skipped": 0, "failing": ["(collection)"]}
        suite = ET.parse(xml).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
        failing = [case.get("name") for case in suite.iter("testcase")
                   if case.find("failure") is not None or case.find("error") is not None]
    return {"passed": n["tests"] - n["failures"] - n["errors"] - n["skipped"], "failed": n["failures"],
            "errors": n["errors"], "skipped": n["skipped"], "failing": failing}


def grade(impl: Path) -> bool:
    """Grade every assignment module found in `impl`; print a table; True iff every test passed."""
    impl = impl.resolve()
    modules = [m for m in ASSIGNMENT if (impl / f"{m}.py").exists()]
    if not modules:
        raise SystemExit(f"assignment.py grade: {impl} holds none of {[m + '.py' for m in ASSIGNMENT]}")
    rows = [(m, run_tests(impl, m)) for m in modules]
    print(f"\ngrading {impl}")
    print(f"{'module':14s} {'passed':>7s} {'failed':>7s} {'errors':>7s} {'total':>7s}")
    for m, c in rows:
        total = c["passed"] + c["failed"] + c["errors"]
        print(f"{m:14s} {c['passed']:7d} {c['failed']:7d} {c['errors']:7d} {total:7d}")
    for m, c in rows:
        if c["failing"]:
            print(f"\nfailing in tests/test_{m}.py:\n  " + "\n  ".join(c["failing"]))
    return all(c["failed"] == 0 and c["errors"] == 0 for _, c in rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pm = sub.add_parser("make", help="write the stubbed modules (the hand-out) into a folder")
    pm.add_argument("--out", type=Path, required=True, help="folder to write the stubbed modules into")
    pm.add_argument("--modules", nargs="+", choices=list(ASSIGNMENT), default=list(ASSIGNMENT),
                    help="which modules to hand out (default: all)")
    pm.add_argument("--force", action="store_true", help="overwrite files that already exist in --out")
    pg = sub.add_parser("grade", help="run the tests of each module found in a folder against it")
    pg.add_argument("dir", type=Path, help="the student's folder (holds gae.py, ppo_loss.py, reward_model.py)")
    args = p.parse_args(argv)
    if args.cmd == "make":
        make(args.out, args.modules, args.force)
        return 0
    return 0 if grade(args.dir) else 1


if __name__ == "__main__":
    sys.exit(main())
