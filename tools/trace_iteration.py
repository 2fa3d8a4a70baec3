"""Count what one PPO iteration puts in front of a reader: the project files and functions a trace of `train.ppo`
enters, the code lines of those functions, and how many of those lines are the algorithm rather than plumbing.

Implements (no equation: a reading aid, and the check that the loop stays readable):
    trace(repo, argv)      → train.main(argv) with sys.settrace on while train.ppo runs: every (file, function) of
                             the project entered (comprehensions and lambdas aside)
    function_lines(...)    → a function's code lines: def to end, without its docstring, blank and comment lines,
                             and functions defined inside it (they count when entered) — what a reader stepping into
                             it has in front of them, its branches not taken included
    classify(file, line)   → "algorithm" or one of the plumbing kinds below, from the source itself (ast)
    count(repo, argv)      → two shares of algorithm: of the code lines of every function entered, and of the lines
                             among them that ran (the tracer's "line" events: a statement written over several lines
                             counts at the lines the interpreter reports, usually its first)
    main(argv)             → the table; --json OUT writes it

How a line is classified (the same rules for any version of the code, so two versions can be compared):
  - the judge: toy_world.py and eval.py (gold, the synthetic human, scores every sample for the logs);
  - logging and the alarm: every line of plumbing/monitor.py;
  - checkpoints, signals, the guard: every line of plumbing/checkpoint.py;
  - ranks and DeepSpeed: plumbing/engine.py but set_lr and backward_step (the learning rate and the optimizer step are the
    algorithm's); in backward_step, the `if is_engine(model)` test and the DeepSpeed branch under it;
  - stats: a statement that assigns to, or appends to, a name or subscript containing "stats", "metrics" or "acc";
  - validation: an `assert`, an `if` whose body only raises, an `if` that tests a check_* call (the guard), and
    functions named check_* / validate*;
  - loop plumbing: in train.py, the lines of functions other than `ppo` and the LoopState/Models methods (the judge,
    the loop's plumbing object), and the lines of train.ppo that name one of PLUMBING_NAMES (the judge, gathering
    across ranks, metrics, the log and alarm, signals, checkpoints, the guard, the loop's end state, --break-at);
  - every other line is the algorithm (sampling, scoring, Eq. 18-19, GAE, the losses, the optimizer step, and the
    token bookkeeping that builds the model's inputs).

Run: python tools/trace_iteration.py                  # one iteration of the default run (its base cached or built)
     python tools/trace_iteration.py --repo ../old    # the same count on another checkout, to compare
"""
from __future__ import annotations

import argparse
import ast
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository: tools/ sits one level below it

# train.ppo's lines that name one of these are plumbing (judge, ranks, metrics, log/alarm, signals, checkpoints, guard)
PLUMBING_NAMES = ("judge", "gather_", "metrics", "log.", "alarm", "interrupt", "ckpts", "guard", "ended", "texts",
                  "gold", "plumbing", "GracefulExit", "time.time", "any_rank", "break_at", "breakpoint")
KINDS = ("algorithm", "the judge", "logging and the alarm", "checkpoints, signals, the guard", "ranks and DeepSpeed", "stats",
         "validation", "loop plumbing")
STATS_NAMES = ("stats", "metrics", "acc")
ARGV = ["--steps", "1", "--critic-pretrain-steps", "0", "--threads", "1"]


def trace(repo: Path, argv: list[str]) -> tuple[set[tuple[str, int]], set[tuple[str, str]]]:
    """(lines, functions) executed inside train.ppo for `argv`, in `repo`'s own .py files (relative paths)."""
    sys.path.insert(0, str(repo))
    import train
    own = {str(p.resolve()) for p in repo.rglob("*.py") if not {"runs", ".git", "tests"} & set(p.relative_to(repo).parts)}
    lines, functions = set(), set()

    def local(frame, event, arg):
        if event == "line":
            lines.add((frame.f_code.co_filename, frame.f_lineno))
        return local

    def on_call(frame, event, arg):
        name = frame.f_code.co_filename
        if event != "call" or name not in own:
            return None
        functions.add((name, frame.f_code.co_qualname))
        lines.add((name, frame.f_lineno))  # the def line itself is where a debugger stops first
        return local

    original = train.ppo

    def traced(*a, **k):
        sys.settrace(on_call)
        try:
            return original(*a, **k)
        finally:
            sys.settrace(None)

    train.ppo = traced
    train.main(argv)
    rel = lambda f: str(Path(f).relative_to(repo))  # noqa: E731
    return {(rel(f), n) for f, n in lines}, {(rel(f), q) for f, q in functions}


class Source:
    """One file's statements, for classify(): the function and the kind of statement at every line, and each
    function's def by its qualified name."""

    def __init__(self, path: Path):
        self.tree = ast.parse(path.read_text())
        self.text = path.read_text().splitlines()
        self.function_at: dict[int, list[str]] = defaultdict(list)   # line → enclosing def names, outermost first
        self.kind_at: dict[int, str] = {}
        self.functions: dict[str, ast.FunctionDef] = {}              # qualified name → its def
        self._walk(self.tree, [])

    def _walk(self, node, stack: list[str]) -> None:
        for child in ast.iter_child_nodes(node):
            inner = stack + [child.name] if isinstance(child, (ast.FunctionDef, ast.ClassDef)) else stack
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.functions[".".join(inner)] = child
            if isinstance(child, ast.stmt):
                for ln in range(child.lineno, (child.end_lineno or child.lineno) + 1):
                    self.function_at[ln] = inner if isinstance(child, (ast.FunctionDef, ast.ClassDef)) else stack
                kind = statement_kind(child)
                if kind:
                    for ln in range(child.lineno, (child.end_lineno or child.lineno) + 1):
                        self.kind_at.setdefault(ln, kind)
            self._walk(child, inner)


def statement_kind(node: ast.stmt) -> str | None:
    if isinstance(node, ast.Assert) or (isinstance(node, ast.If) and all(isinstance(s, ast.Raise) for s in node.body)
                                        and not node.orelse):
        return "validation"
    if isinstance(node, ast.If) and any(isinstance(n, ast.Call) and "check_" in ast.unparse(n.func)
                                        for n in ast.walk(node.test)):
        return "validation"  # `if bad := check_finite(...)`: the non-finite guard's test (its body is classified apart)
    targets = []
    if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Attribute):
        targets = [node.value.func.value]  # stats.append(...), acc.setdefault(k, []).append(v)
    names = " ".join(ast.unparse(t) for t in targets)
    if any(s in names for s in STATS_NAMES):
        return "stats"
    return None


def classify(repo: Path, sources: dict, file: str, line: int) -> str:
    src = sources.setdefault(file, Source(repo / file))
    functions = src.function_at.get(line, [])
    name = functions[-1] if functions else ""
    module = Path(file).stem
    if module == "monitor":  # plumbing/monitor.py: the loop's plumbing, the guard and signals, the logs and alarm
        if functions and functions[0] in ("LoopPlumbing", "LoopState"):
            return "loop plumbing"
        if functions and functions[0] in ("NonFiniteGuard", "GracefulExit", "debugger_active", "_is_finite"):
            return "checkpoints, signals, the guard"
        return "logging and the alarm"
    if module in ("toy_world", "eval"):
        return "the judge"  # gold (the synthetic human) scores every sample for the logs; training never sees it
    if module == "checkpoint":
        return "checkpoints, signals, the guard"
    if name.startswith(("check_", "validate", "_check")):
        return "validation"
    if module == "engine":
        if name not in ("set_lr", "backward_step"):
            return "ranks and DeepSpeed"
        if name == "backward_step" and "is_engine(model)" in "\n".join(src.text[line - 1:line]):
            return "ranks and DeepSpeed"
        if name == "backward_step" and in_engine_branch(src, line):
            return "ranks and DeepSpeed"
    if module == "train":
        if not functions or functions[0] not in ("ppo", "LoopState", "Models"):
            return "loop plumbing"
        if functions[0] == "ppo" and any(n in src.text[line - 1] for n in PLUMBING_NAMES):
            return "loop plumbing"
    return src.kind_at.get(line) or "algorithm"


def in_engine_branch(src: Source, line: int) -> bool:
    """A line of engine.backward_step inside its `if is_engine(model):` block."""
    for node in ast.walk(src.tree):
        if isinstance(node, ast.If) and "is_engine(model)" in ast.unparse(node.test):
            if node.body[0].lineno <= line <= node.body[-1].end_lineno:
                return True
    return False


def function_lines(src: "Source", qualname: str) -> list[int]:
    """The code lines of one function: its def line to its end, without its docstring, blank lines, comment lines
    and the bodies of functions defined inside it (those count when they are entered)."""
    node = src.functions.get(qualname)
    if node is None:
        return []
    skip = set()
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        skip |= set(range(body[0].lineno, body[0].end_lineno + 1))
    for inner in ast.walk(node):
        if inner is not node and isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef)):
            skip |= set(range(inner.lineno, inner.end_lineno + 1))
    text = src.text
    return [ln for ln in range(node.lineno, node.end_lineno + 1)
            if ln not in skip and text[ln - 1].strip() and not text[ln - 1].strip().startswith("#")]


def count(repo: Path, argv: list[str]) -> dict:
    ran, functions = trace(repo, argv)
    functions = {(f, q) for f, q in functions if not q.rsplit(".", 1)[-1].startswith("<")}  # comprehensions, lambdas
    sources: dict = {}
    kinds, ran_kinds, by_file, by_function = Counter(), Counter(), Counter(), {}
    for f, q in sorted(functions):
        src = sources.setdefault(f, Source(repo / f))
        lines = function_lines(src, q)
        for ln in lines:
            kind = classify(repo, sources, f, ln)
            kinds[kind] += 1
            if (f, ln) in ran:  # the same line as the tracer saw it run (a statement's first line)
                ran_kinds[kind] += 1
        by_file[f] += len(lines)
        by_function[f"{Path(f).stem}.{q}"] = len(lines)
    total, total_ran = sum(kinds.values()), sum(ran_kinds.values())
    return {"repo": str(repo), "argv": argv, "files": len({f for f, _ in functions}), "functions": len(functions),
            "lines": total, "algorithm_share": kinds["algorithm"] / total,
            "lines_run": total_ran, "algorithm_share_run": ran_kinds["algorithm"] / total_ran,
            "by_kind": {k: kinds[k] for k in KINDS if kinds[k]},
            "by_kind_run": {k: ran_kinds[k] for k in KINDS if ran_kinds[k]}, "by_file": dict(by_file.most_common()),
            "by_function": dict(sorted(by_function.items(), key=lambda kv: -kv[1])),
            "function_names": sorted(f"{Path(f).stem}.{q}" for f, q in functions)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="tools/trace_iteration.py", description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--repo", default=str(ROOT), help="the checkout to trace (default: this one)")
    p.add_argument("--out", default="runs/trace-iteration", help="the traced run's --out")
    p.add_argument("--json", default=None, help="also write the counts here")
    p.add_argument("--list", action="store_true", help="print every function entered")
    a, rest = p.parse_known_args(argv)
    repo = Path(a.repo).resolve()
    import os
    os.chdir(repo)  # runs/_base is relative to the checkout
    result = count(repo, ARGV + ["--out", a.out] + rest)
    print(f"\none PPO iteration ({' '.join(result['argv'])}) in {repo}:")
    print(f"  {result['files']} project files, {result['functions']} functions entered, {result['lines']} code lines in "
          f"them, {result['algorithm_share']:.0%} of them the algorithm")
    print(f"  {result['lines_run']} of those lines ran in this iteration, {result['algorithm_share_run']:.0%} of "
          f"them the algorithm")
    print(f"    {'':<34} {'code':>4} {'ran':>5}")
    for k, n in result["by_kind"].items():
        print(f"    {k:<34} {n:4d} {result['by_kind_run'].get(k, 0):5d}")
    print("  lines by file: " + ", ".join(f"{f} {n}" for f, n in result["by_file"].items()))
    if a.list:
        print("  functions (code lines): " + ", ".join(f"{k} {n}" for k, n in result["by_function"].items()))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
