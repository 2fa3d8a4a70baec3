"""Hand out the equation files as assignments (bodies removed); grade one student or a class with the project's tests.

Implements (the exercises are the paper's equations; see docs/paper.md and TEACHING.md):
    ASSIGNMENT                 module → {function: equation}: the bodies students write; everything else is given
                                   gae.py           Eq. 7–11   k_step_return, k_step_advantage, compute_gae
                                   ppo_loss.py      Eq. 15, 16, 19, masked statistics, entropy
                                   reward_model.py  Eq. 1–2    bradley_terry_loss, response_lm_loss, reward_model_loss
                                   ppo_max.py       Eq. 18–19  RunningMoments.update, normalize_and_clip_rewards,
                                                               scale_rewards, shape_rewards (the score half only)
    stub_source(...)           a file with those bodies replaced by `raise NotImplementedError("exercise: …")`
    make(out, modules)         the hand-out folder: the stubbed files and, copied as they are, the project modules
                               they import, so `python handout/reward_model.py` runs its worked example from there
    make_student_repo(dest)    a copy of the committed files (git archive HEAD, or a --manifest) without the
                               solutions: the assigned bodies stubbed in place and the exercises notebook's worked
                               answers (# BEGIN SOLUTION … # END SOLUTION) removed; untracked files never go
    check_worksheet(path)      run a worksheet; one line naming the first cell that fails, without colour codes
    grade_submissions(subs)    every assigned function of every submission graded by the tests named after it
                               (tests/test_<module>.py::test_<function>_…), all submissions in one pytest session.
                               While a function is graded, the other assigned functions are the reference's, so a
                               mistake is reported at the function that makes it and nowhere else.
    impl_folder, import_from   PPO_MAX_IMPL: a folder (a relative path is taken from the repository root) whose
                               assigned modules replace the project's on import (tests/conftest.py, the notebook)

Run:
    python tools/assignment.py make --out handout/                       # all four modules
    python tools/assignment.py make --student-repo ../course-ppo-max     # the committed files without the solutions
    python tools/assignment.py check notebooks/exercises.ipynb           # a worksheet: which cell fails, if any
    PPO_MAX_IMPL=handout/ python -m pytest tests/test_gae.py -q          # a student's own check
    python tools/assignment.py grade handout/                            # one student: a line per function
    python tools/assignment.py grade --class submissions/ --csv grades.csv   # one row per student

The tests compare with independent computations (python loops, autograd, torch.distributions), never with our
implementation, so a correct solution written differently passes. Given code in the same file (e.g.
ppo_loss.masked_var, entropy_bonus_loss) calls the student's versions of the assigned functions.
"""
from __future__ import annotations

import ast
import csv
import importlib.abc
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository: tools/ sits one level below it
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the project's modules (data, train, ...)

from plumbing.cli import OneLineParser, UserError, cli_guard  # noqa: E402  (after the sys.path line above)

# module → {function (Class.method for a method): the equation it implements}. Only these bodies are removed.
ASSIGNMENT: dict[str, dict[str, str]] = {
    "gae": {"k_step_return": "Eq. 7", "k_step_advantage": "Eq. 8", "compute_gae": "Eq. 9–11"},
    "ppo_loss": {"masked_mean": "token-level mean", "masked_whiten": "Fig. 6", "logprobs_from_logits": "Eq. 15",
                 "policy_loss": "Eq. 15", "value_loss": "Eq. 16", "kl_full": "Eq. 3, 19", "kl_sampled": "Eq. 3, 19",
                 "entropy": "App. B.3"},
    "reward_model": {"bradley_terry_loss": "Eq. 1", "response_lm_loss": "Eq. 2", "reward_model_loss": "Eq. 2"},
    "ppo_max": {"RunningMoments.update": "Eq. 18", "normalize_and_clip_rewards": "Eq. 18",
                "scale_rewards": "Fig. 6", "shape_rewards": "Eq. 19"},
}
TEST_FILE = {"gae": "tests/test_gae.py", "ppo_loss": "tests/test_ppo_loss.py",
             "reward_model": "tests/test_reward_model.py", "ppo_max": "tests/test_ppo_max_scores.py"}
NOTEBOOK = "notebooks/exercises.ipynb"  # its answer cells mark the worked solution with # BEGIN / END SOLUTION
# not in a student repository: the mistakes' `find` strings are the reference's lines, and test_assignment.py grades
# the reference (which a student repository does not have)
TEACHER_ONLY = ("tests/student_mistakes.py", "tests/test_assignment.py")
STUDENT_TIMEOUT = 300  # seconds a worker may spend on one submission before it is stopped (an endless loop)
STARTUP_TIMEOUT = 900  # seconds a worker may take to import torch and collect the tests


def all_functions(modules: list[str] | None = None) -> list[str]:
    """"module.function" for every assigned function of `modules` (default: all), in ASSIGNMENT's order."""
    return [f"{m}.{f}" for m in (modules or ASSIGNMENT) for f in ASSIGNMENT[m]]


def test_prefix(function: str) -> str:
    """The name every test of `function` starts with: compute_gae → test_compute_gae, RunningMoments.update →
    test_running_moments_update."""
    return "test_" + re.sub(r"(?<!^)(?<!\.)(?=[A-Z])", "_", function).lower().replace(".", "_")


def graded_function(module: str, test_name: str) -> str | None:
    """The assigned function of `module` that a test grades: the one its name starts with (`test_<function>` or
    `test_<function>_…`, the longest if several), or None for a test of given code (masked_var, ScalarHeadModel)."""
    base = test_name.split("[")[0]
    hits = [f for f in ASSIGNMENT[module] if base == test_prefix(f) or base.startswith(test_prefix(f) + "_")]
    return max(hits, key=len, default=None)


# ------------------------------------------------------------------------------------------------------------------
# make: the hand-out and the student repository
# ------------------------------------------------------------------------------------------------------------------

def find_def(tree: ast.Module, function: str) -> ast.FunctionDef | None:
    """The `def` of "name" or "Class.method" at the top level of `tree`, or None."""
    scope, node = tree.body, None
    for part in function.split("."):
        node = next((n for n in scope if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                     and n.name == part), None)
        if node is None:
            return None
        scope = node.body
    return node if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None


def body_lines(source: str, module: str, functions: list[str]) -> dict[str, tuple[int, int]]:
    """{function: (first, last)}: the 1-based inclusive line range of each body, after its docstring."""
    tree = ast.parse(source)
    ranges = {}
    for name in functions:
        node = find_def(tree, name)
        if node is None:
            raise UserError(f"{module}.py has no function {name}; update ASSIGNMENT in tools/assignment.py")
        body = node.body
        if body[0].lineno == node.lineno:
            raise UserError(f"{module}.{name} has its body on the `def` line; cannot stub it")
        has_doc = (isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                   and isinstance(body[0].value.value, str))
        ranges[name] = ((body[0].end_lineno + 1) if has_doc else body[0].lineno, node.end_lineno)
    return ranges


def stub_source(source: str, module: str, functions: list[str]) -> str:
    """`source` with the body of each listed function (or Class.method) replaced by a NotImplementedError.

    Works on line ranges found with `ast`, so everything outside the removed bodies (the module docstring,
    signatures and docstrings, comments between functions, the `__main__` example, classes) is byte-for-byte kept.
    """
    lines = source.splitlines(keepends=True)
    tree = ast.parse(source)
    edits = []
    for name, (first, last) in body_lines(source, module, functions).items():
        indent = " " * find_def(tree, name).body[0].col_offset
        stub = f'{indent}raise NotImplementedError("exercise: implement {module}.{name} (see its docstring)")\n'
        edits.append((first, last, stub))
    for first, last, stub in sorted(edits, reverse=True):  # bottom-up, so earlier line numbers stay valid
        lines[first - 1 : last] = [stub]
    return "".join(lines)


def module_file(module: str) -> str:
    """A project module's file, relative to the repository: "gae" → gae.py, "plumbing.data" → plumbing/data.py."""
    return module.replace(".", "/") + ".py"


def project_imports(module: str) -> set[str]:
    """The project modules `module` imports at load time (top-level import statements): concept files ("gae") and
    the package's modules ("plumbing.data")."""
    tree = ast.parse((ROOT / module_file(module)).read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names |= {f"plumbing.{a.name}" for a in node.names} if node.module == "plumbing" else {node.module}
    return {n for n in names if (ROOT / module_file(n)).is_file()}


def dependencies(modules: list[str]) -> list[str]:
    """Every project module that loading `modules` imports, transitively, other than `modules` themselves."""
    seen, todo = set(), list(modules)
    while todo:
        for dep in project_imports(todo.pop()):
            if dep not in seen and dep not in modules:
                seen.add(dep)
                todo.append(dep)
    return sorted(seen)


def check_modules(modules: list[str]) -> list[str]:
    unknown = [m for m in modules if m not in ASSIGNMENT]
    if unknown:
        raise UserError(f"--modules {' '.join(unknown)}: not assigned modules; choose from {', '.join(ASSIGNMENT)}")
    return modules


def make(out: Path, modules: list[str], force: bool = False) -> list[Path]:
    """The hand-out: `modules` stubbed, in `out`, beside the project modules they import so that each file's
    `__main__` worked example runs from `out` alone. An assigned module imported by one of `modules` but not
    itself in `modules` (ppo_max.py imports gae.py and ppo_loss.py) is written stubbed too: a hand-out never
    holds a solution. Returns the files written."""
    check_modules(modules)
    out = out.resolve()
    if out == ROOT:
        raise UserError("make --out is the repository itself; that would blank the reference code")
    deps = dependencies(modules)
    files = {f"{m}.py": stub_source((ROOT / f"{m}.py").read_text(), m, list(ASSIGNMENT[m]))
             for m in modules + [d for d in deps if d in ASSIGNMENT]}
    files |= {module_file(d): (ROOT / module_file(d)).read_text() for d in deps if d not in ASSIGNMENT}
    if any(d.startswith("plumbing.") for d in deps):  # the package's own file, so `from plumbing import …` works
        files["plumbing/__init__.py"] = (ROOT / "plumbing" / "__init__.py").read_text()
    existing = [name for name in files if (out / name).exists()]
    if existing and not force:
        raise UserError(f"make: {out / existing[0]} exists (a student's work?); pass --force to overwrite")
    out.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text)
    for m in modules:
        print(f"wrote {out / (m + '.py')}  (implement: {', '.join(ASSIGNMENT[m])})")
    for d in deps:
        why = "stubbed too, not assigned here" if d in ASSIGNMENT else "given, imported by the files above"
        print(f"wrote {out / module_file(d)}  ({why})")
    return [out / name for name in files]


def strip_solutions(text: str, markdown: bool) -> tuple[str, list[str]]:
    """A notebook cell's source without its worked solution, and the solution's lines.

    Code cells mark it with `# BEGIN SOLUTION` … `# END SOLUTION` lines; it becomes a `raise NotImplementedError`
    naming what the check cells need. Markdown cells mark it with `<!-- BEGIN SOLUTION -->` … `<!-- END SOLUTION -->`;
    it becomes "*Your answer here.*".
    """
    begin, end = ("<!-- BEGIN SOLUTION -->", "<!-- END SOLUTION -->") if markdown else ("# BEGIN SOLUTION",
                                                                                        "# END SOLUTION")
    kept, removed, inside = [], [], None
    for line in text.splitlines():
        if line.strip() == begin:
            inside = []
            continue
        if line.strip() == end and inside is not None:
            removed += inside
            if markdown:
                kept.append("*Your answer here.*")
            else:
                defined = [n for n in defined_names("\n".join(inside)) if not n.startswith("_")]
                what = f"define {', '.join(defined)}" if defined else "your answer"
                kept.append(f'raise NotImplementedError("your answer here: {what}")')
            inside = None
            continue
        (kept if inside is None else inside).append(line)
    if inside is not None:
        raise UserError(f"{NOTEBOOK}: a cell has `{begin}` without `{end}`")
    return "\n".join(kept), removed


def defined_names(code: str) -> list[str]:
    """Top-level names a piece of code assigns or defines, in order."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return []
    names = []
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.append(node.name)
        for t in targets:
            names += [n.id for n in ast.walk(t) if isinstance(n, ast.Name)] if t is not None else []
    return list(dict.fromkeys(names))


def strip_notebook(nb: dict) -> dict:
    """The exercises notebook as a worksheet: the worked solutions removed (strip_solutions), every output and
    execution count cleared."""
    nb = json.loads(json.dumps(nb))  # a deep copy
    for cell in nb["cells"]:
        source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        stripped, _ = strip_solutions(source, markdown=cell["cell_type"] == "markdown")
        cell["source"] = stripped.splitlines(keepends=True)
        cell.get("metadata", {}).pop("execution", None)
        if cell["cell_type"] == "code":
            cell["outputs"], cell["execution_count"] = [], None
    return nb


def _git(*args: str) -> bytes:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, check=True).stdout


def repository_files(manifest: Path | None = None) -> dict[str, bytes]:
    """{path relative to ROOT: its content} of what a student repository is made from: the files committed at HEAD,
    as committed (`git archive HEAD`), or the files a `manifest` lists (one path a line, # comments), as they are on
    disk. Never a file git does not track: a teacher's untracked or ignored notes stay out."""
    if manifest is not None:
        try:
            names = [l.strip() for l in manifest.read_text().splitlines() if l.strip() and not l.startswith("#")]
        except OSError as e:
            raise UserError(f"--manifest {manifest}: {e.strerror or e}")
        for i, name in enumerate(names, 1):
            if not (ROOT / name).is_file() or ".." in Path(name).parts or Path(name).is_absolute():
                raise UserError(f"{manifest}:{i}: {name}: no such file in {ROOT}")
        return {name: (ROOT / name).read_bytes() for name in names}
    try:
        archive = _git("archive", "--format=tar", "HEAD")
    except (OSError, subprocess.CalledProcessError):
        raise UserError(f"make --student-repo: {ROOT} is not a git repository with a commit; commit the course, or "
                        f"give --manifest FILE (the files to hand out, one path a line)") from None
    import io
    import tarfile
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def left_out(taken: dict[str, bytes], manifest: Path | None) -> str:
    """One line: what of the teacher's working tree a student repository does not get (untracked and ignored files,
    uncommitted changes of tracked ones), or "" when nothing (or git cannot tell)."""
    if manifest is not None:
        return f"only the {len(taken)} files {manifest} lists"
    try:
        status = _git("status", "--porcelain=v1", "-z", "--ignored").decode(errors="replace").split("\0")
    except (OSError, subprocess.CalledProcessError):
        return ""
    untracked, ignored, changed = [], [], []
    for entry in (e for e in status if len(e) > 3):
        code, name = entry[:2], entry[3:]
        (untracked if code == "??" else ignored if code == "!!" else changed).append(name)
    show = lambda names: ", ".join(names[:6]) + (f", … ({len(names)} in all)" if len(names) > 6 else "")  # noqa: E731
    parts = [f"untracked {show(untracked)}" if untracked else "",
             f"uncommitted changes of {show(changed)} (handed out as committed)" if changed else "",
             f"ignored {show(ignored)}" if ignored else ""]
    return "; ".join(p for p in parts if p)


def make_student_repo(dest: Path, modules: list[str], manifest: Path | None = None) -> list[str]:
    """A copy of the repository at `dest` for students, made from what git tracks (repository_files: HEAD's files,
    or a manifest's): `modules` stubbed in place (their tests, conftest.py and everything else as they are),
    notebooks/exercises.ipynb without its worked answers, no git history (it holds the solutions) and none of
    TEACHER_ONLY. Prints what was written and, in one line, what was left out. Returns the files written, relative
    to `dest`."""
    check_modules(modules)
    dest = dest.resolve()
    if dest == ROOT or ROOT in dest.parents or dest in ROOT.parents:
        raise UserError(f"make --student-repo {dest}: choose a folder outside the repository {ROOT}")
    if dest.exists() and any(dest.iterdir()):
        raise UserError(f"make --student-repo {dest}: exists and is not empty; give a new folder")
    taken = repository_files(manifest)
    files = sorted(f for f in taken if f not in TEACHER_ONLY)
    for rel in files:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        module = rel[:-3] if rel.endswith(".py") and "/" not in rel else None
        if module in modules:
            target.write_text(stub_source(taken[rel].decode(), module, list(ASSIGNMENT[module])))
        elif rel == NOTEBOOK:
            target.write_text(json.dumps(strip_notebook(json.loads(taken[rel])), indent=1, ensure_ascii=False) + "\n")
        else:
            target.write_bytes(taken[rel])
            if ((ROOT / rel).stat().st_mode if (ROOT / rel).exists() else 0) & 0o111:
                target.chmod(0o755)
    print(f"wrote {dest}: {len(files)} files {'listed in ' + str(manifest) if manifest else 'committed at HEAD'}; "
          f"{', '.join(m + '.py' for m in modules)} without the assigned bodies, {NOTEBOOK} without its worked "
          f"answers; no .git, no {', '.join(TEACHER_ONLY)}")
    if (why := left_out(taken, manifest)):
        print(f"left out: {why}")
    return files


# ------------------------------------------------------------------------------------------------------------------
# PPO_MAX_IMPL: a student's folder in place of the project's modules
# ------------------------------------------------------------------------------------------------------------------

class ImplFolderError(UserError, ValueError):
    """PPO_MAX_IMPL names no folder. One line in a notebook too (IPython prints `_render_traceback_` instead of a
    traceback)."""

    def _render_traceback_(self) -> list[str]:
        return [f"error: {self}"]


def impl_folder(value: str) -> Path:
    """The folder PPO_MAX_IMPL names. A relative path is taken from the repository root, whatever the current
    directory: `PPO_MAX_IMPL=handout/` means <repo>/handout/ for pytest run from anywhere and for the notebook,
    whose kernel runs in notebooks/. A folder that does not exist is an ImplFolderError."""
    path = Path(value).expanduser()
    folder = path if path.is_absolute() else ROOT / path
    if folder.is_dir():
        return folder.resolve()
    hint = ""
    if not path.is_absolute() and (Path.cwd() / path).is_dir():
        hint = f"; a relative path is taken from the repository root: did you mean {(Path.cwd() / path).resolve()}?"
    raise ImplFolderError(f"PPO_MAX_IMPL={value}: no folder {folder}{hint}")


class _SubmissionFinder(importlib.abc.MetaPathFinder):
    """Imports from a student's folder: the assigned modules (`import gae`) if `assigned`, and a student's own helper
    modules (names no project module has). The project's other modules (data, engine, ...) always come from the
    repository, so the copies `make` puts beside the hand-out never shadow it."""

    def __init__(self, folder: Path, assigned: bool):
        self.folder, self.assigned = folder, assigned

    def find_spec(self, name, path=None, target=None):
        file = self.folder / f"{name}.py"
        ours = (ROOT / f"{name}.py").is_file()
        if path is None and file.is_file() and ((self.assigned and name in ASSIGNMENT) or not ours):
            return importlib.util.spec_from_file_location(name, file)
        return None


def import_from(folder: Path) -> list[str]:
    """From now on, importing an assigned module loads the student's file in `folder` where there is one.
    Returns the modules found there. Call it before anything imports them."""
    sys.meta_path.insert(0, _SubmissionFinder(folder, assigned=True))
    return [m for m in ASSIGNMENT if (folder / f"{m}.py").is_file()]


# ------------------------------------------------------------------------------------------------------------------
# grade: the worker (one pytest session, every submission) and the parent that runs it
# ------------------------------------------------------------------------------------------------------------------

_ABSENT, _RAISE = object(), object()


def _get(obj, dotted: str, default=_RAISE):
    """obj.a.b, where a class attribute is read from the class's own __dict__ (a plain function, not a bound one)."""
    try:
        for part in dotted.split("."):
            obj = obj.__dict__[part] if isinstance(obj, type) else getattr(obj, part)
        return obj
    except (AttributeError, KeyError):
        if default is _RAISE:
            raise
        return default


def _set(obj, dotted: str, value) -> None:
    """obj.a.b = value; value _ABSENT deletes the attribute."""
    *owner, last = dotted.split(".")
    for part in owner:
        obj = getattr(obj, part)
    if value is _ABSENT:
        delattr(obj, last)
    else:
        setattr(obj, last, value)


ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")  # a terminal's colour codes (IPython colours its tracebacks)


def first_line(text: str, limit: int = 240) -> str:
    """The first non-blank line of `text`, without colour codes, at most `limit` characters."""
    line = next((l.strip() for l in ANSI.sub("", str(text)).splitlines() if l.strip()), "")
    return line if len(line) <= limit else line[: limit - 1] + "…"


def load_submission(folder: Path, module: str, tag: str):
    """(the student's module, None) or (None, why it cannot be graded). Loaded under a private name, so the
    project's module of the same name stays the reference; its own imports (data, engine, gae, ...) are the
    project's."""
    file = folder / f"{module}.py"
    if not file.is_file():
        return None, f"missing: no {module}.py in {folder}"
    spec = importlib.util.spec_from_file_location(f"_submission_{tag}_{module}", file)
    mod = importlib.util.module_from_spec(spec)
    helpers = _SubmissionFinder(folder, assigned=False)  # the student's own modules, if their file imports any
    before = set(sys.modules)
    sys.modules[spec.name] = mod  # (dataclasses look their module up there)
    sys.meta_path.insert(0, helpers)
    try:
        spec.loader.exec_module(mod)
    except (Exception, SystemExit) as e:  # a syntax error, an import error, an exit at import: nothing to grade
        return None, f"error: {module}.py cannot be imported: {type(e).__name__}: {first_line(e)}"
    finally:
        sys.meta_path.remove(helpers)
        for name in set(sys.modules) - before - {spec.name}:  # the next student's helpers of the same name are theirs
            if Path(getattr(sys.modules[name], "__file__", None) or "/").parent == folder:
                del sys.modules[name]
    return mod, None


def short(x, digits: int = 6) -> str:
    """A tensor or number in a few characters: its values if there are few, else its shape and the first ones."""
    if type(x).__module__.startswith("torch") and hasattr(x, "shape"):
        if x.dim() == 0:
            return f"{x.item():.{digits}g}"
        values = x.detach().double().flatten().tolist()
        text = ", ".join(f"{v:.{digits}g}" for v in values[:6]) + (", …" if len(values) > 6 else "")
        return f"[{text}]" if x.dim() == 1 else f"{tuple(x.shape)} [{text}]"
    return f"{x:.{digits}g}" if isinstance(x, float) else first_line(repr(x), 120)


def expected_got(expected, actual) -> str:
    """"expected E, got A" with enough digits (6 to 15) to tell the two apart."""
    for digits in (6, 9, 12, 15):
        e, a = short(expected, digits), short(actual, digits)
        if e != a:
            break
    return f"expected {e}, got {a}"


def compared(actual, expected, lines: list[str]) -> str:
    """torch.testing.assert_close's verdict as "expected …, got …": for a tensor, the element that differs most."""
    tol = re.search(r"\(up to (\S+) allowed\)", " ".join(lines))
    allowed = f", {tol.group(1)} allowed" if tol else ""
    greatest = next((l for l in lines if l.startswith("Greatest absolute difference")), None)
    index = re.search(r"at index \(([\d, ]*)\)", greatest or "")
    shapes_match = getattr(actual, "shape", None) == getattr(expected, "shape", None)
    if index and shapes_match and getattr(expected, "dim", lambda: 0)() > 0:
        idx = tuple(int(i) for i in index.group(1).replace(" ", "").split(",") if i)
        count = next((l.split(":", 1)[1].split("(")[0].strip() for l in lines if l.startswith("Mismatched")), "?")
        return (f"at index {idx} of a {tuple(expected.shape)} result: {expected_got(expected[idx], actual[idx])} "
                f"({count.replace(' / ', ' of ')} elements differ{allowed})")
    if shapes_match:
        return expected_got(expected, actual) + (f" ({allowed[2:]})" if allowed else "")
    return f"{expected_got(expected, actual)} ({first_line(lines[0] if lines else '')})"


def failure_message(excinfo, student_file: Path) -> str:
    """One line for a failed test: expected vs got where the test compared numbers, else the first line of the
    error, with the line of the student's file it came from."""
    exc, frames, tb = excinfo.value, [], excinfo.tb
    while tb is not None:
        frames.append(tb)
        tb = tb.tb_next
    text = str(exc)
    lines = [l.strip() for l in text.splitlines() if l.strip()]
    if isinstance(exc, AssertionError):
        close = next((f for f in reversed(frames) if f.tb_frame.f_code.co_name == "assert_close"  # torch.testing's
                      and "torch" in f.tb_frame.f_code.co_filename), None)
        if close is not None and {"actual", "expected"} <= close.tb_frame.f_locals.keys():
            return compared(close.tb_frame.f_locals["actual"], close.tb_frame.f_locals["expected"], lines)
        approx = re.match(r"assert (.+) == (.+ ± .+)$", lines[0]) if lines else None
        if approx:  # `assert got == pytest.approx(expected)`
            return f"expected {approx.group(2)}, got {approx.group(1)}"
        if lines and lines[0].startswith("Regex pattern did not match"):  # pytest.raises(match=...)
            return "the error message does not match: " + " ".join(lines[1:3])
        return first_line(text) or "assertion failed"
    if type(exc).__name__ == "Failed" and text.startswith("DID NOT RAISE"):  # pytest.raises saw no exception
        return text.replace("<class '", "").replace("'>", "") + " (this input must be rejected)"
    mine = [f for f in frames if Path(f.tb_frame.f_code.co_filename).resolve() == student_file.resolve()]
    where = f" (at {student_file.name}:{mine[-1].tb_lineno})" if mine else ""
    return f"{type(exc).__name__}: {first_line(text)}{where}"


class GradePlugin:
    """A pytest plugin: each test of an assigned function runs once per submission that has the function, with the
    student's function in place of the reference one and the reference versions of the other assigned functions
    (in the student's module too), so a mistake is reported at the function that makes it."""

    def __init__(self, submissions: list[dict], results_path: Path):
        self.subs, self.results_path = submissions, results_path
        self.loaded: dict[tuple[int, str], object] = {}
        self.results = [{"name": s["name"], "folder": s["folder"], "seconds": 0.0, "functions": {}}
                        for s in submissions]
        self.pending = [0] * len(submissions)
        self.started: list[float | None] = [None] * len(submissions)
        for i, s in enumerate(submissions):
            t0 = time.perf_counter()
            for module in dict.fromkeys(f.split(".")[0] for f in s["functions"]):
                mod, why = load_submission(Path(s["folder"]), module, str(i))
                if mod is not None:
                    self.loaded[(i, module)] = mod
                for f in (f for f in s["functions"] if f.split(".")[0] == module):
                    name = f.split(".", 1)[1]
                    if why is not None:
                        self.record(i, f, why.split(":")[0], why)
                    elif not callable(_get(mod, name, None)):
                        self.record(i, f, "missing", f"missing: {module}.py has no function {name}")
            self.results[i]["seconds"] += time.perf_counter() - t0

    def record(self, i: int, function: str, status: str, message: str = "", test: str | None = None) -> None:
        """A function that cannot be graded (its file does not import, or it is missing): 0 of its tests passed."""
        self.results[i]["functions"][function] = {"status": status, "passed": 0, "total": 0, "message": message,
                                                  "test": test}

    def gradable(self, i: int, function: str) -> bool:
        return function in self.subs[i]["functions"] and function not in self.results[i]["functions"]

    def assigned(self, i: int, function: str) -> bool:
        return function in self.subs[i]["functions"]

    @staticmethod
    def function_of(path, test_name: str) -> str | None:
        """"module.function" graded by the test `test_name` of the file `path`, or None."""
        module = next((m for m, f in TEST_FILE.items() if Path(path) == ROOT / f), None)
        name = graded_function(module, test_name) if module else None
        return f"{module}.{name}" if name else None

    def pytest_generate_tests(self, metafunc):
        function = self.function_of(metafunc.definition.path, metafunc.function.__name__)
        if function is None:
            return
        # every submission it is assigned to: a test of a function that cannot be graded counts as not passed
        subs = [i for i in range(len(self.subs)) if self.assigned(i, function)]
        metafunc.parametrize("_graded_submission", subs, indirect=True, ids=[f"sub{i}" for i in subs])

    def pytest_collection_modifyitems(self, session, config, items):
        graded = [it for it in items  # (an empty parameter set, no submission to grade, gives a NOTSET param)
                  if isinstance(getattr(getattr(it, "callspec", None), "params", {}).get("_graded_submission"), int)]
        recorded = lambda it: self.results[it.callspec.params["_graded_submission"]]["functions"].get(  # noqa: E731
            self.function_of(it.path, it.originalname))  # missing, or its file does not import (set in __init__)
        for it in graded:
            if recorded(it) is not None:  # each of its tests counts, not passed, and is not run
                recorded(it)["total"] += 1
        graded = [it for it in graded if recorded(it) is None]
        kept = set(map(id, graded))
        config.hook.pytest_deselected(items=[it for it in items if id(it) not in kept])
        graded.sort(key=lambda it: it.callspec.params["_graded_submission"])  # stable: one submission after another
        items[:] = graded
        for it in graded:
            i = it.callspec.params["_graded_submission"]
            self.pending[i] += 1
            self.results[i]["functions"].setdefault(self.function_of(it.path, it.originalname),
                                                    {"status": "passed", "passed": 0, "total": 0, "message": "",
                                                     "test": None})
        with open(self.results_path, "a") as fh:  # collected: from now on each submission has `timeout` seconds
            fh.write(json.dumps({"ready": True}) + "\n")
        for i in range(len(self.subs)):
            for f in self.subs[i]["functions"]:  # an assigned function without a single test is not graded: say so
                self.results[i]["functions"].setdefault(f, {"status": "error", "passed": 0, "total": 0, "test": None,
                                                            "message": f"error: no test named {test_prefix(f)}_…"})
            if self.pending[i] == 0:
                self.flush(i)

    def swap(self, request):
        """The body of the `_graded_submission` fixture: the student's function in, for one test."""
        i = request.param
        module, name = self.function_of(request.node.path, request.node.originalname).split(".", 1)
        student, reference = self.loaded[(i, module)], sys.modules[module]
        if self.started[i] is None:
            self.started[i] = time.perf_counter()
        saved = []
        for other in ASSIGNMENT[module]:
            if other != name:
                saved.append((student, other, _get(student, other, _ABSENT)))
                _set(student, other, _get(reference, other))
        saved.append((reference, name, _get(reference, name)))
        _set(reference, name, _get(student, name))  # the tests, and given code such as masked_var, call it
        try:
            yield i
        finally:
            for obj, attr, value in reversed(saved):
                _set(obj, attr, value)

    @staticmethod
    def display_name(item) -> str:
        rest = re.sub(r"(?:^|-)sub\d+(?=-|$)", "", item.callspec.id).strip("-")
        return item.originalname + (f"[{rest}]" if rest else "")

    def pytest_runtest_makereport(self, item, call):
        if call.when == "teardown" or (call.when == "setup" and call.excinfo is None):
            return
        i = item.callspec.params["_graded_submission"]
        function = self.function_of(item.path, item.originalname)
        r = self.results[i]["functions"][function]
        r["total"] += 1
        if call.excinfo is None:
            r["passed"] += 1
        elif r["status"] == "passed":  # the first failing test of the function is the one reported
            student_file = Path(self.subs[i]["folder"]) / f"{function.split('.')[0]}.py"
            r.update(status="failed", test=self.display_name(item),
                     message=failure_message(call.excinfo, student_file))

    def pytest_runtest_teardown(self, item, nextitem):
        i = item.callspec.params["_graded_submission"]
        self.pending[i] -= 1
        if self.pending[i] == 0:
            self.results[i]["seconds"] += time.perf_counter() - (self.started[i] or time.perf_counter())
            self.flush(i)

    def flush(self, i: int) -> None:
        """Append submission i's result to the results file (a parent reads it as it grows)."""
        rows = self.results[i]["functions"]
        self.results[i]["functions"] = {f: rows[f] for f in self.subs[i]["functions"]}  # in ASSIGNMENT's order
        with open(self.results_path, "a") as fh:
            fh.write(json.dumps({"index": i, **self.results[i]}) + "\n")


def run_worker(job_path: Path, results_path: Path) -> int:
    """Grade the submissions of a job file in one pytest session: one JSON line per submission, appended to
    `results_path` as soon as it is done (so a parent can go on after a crash), then {"done": true}."""
    import pytest

    os.environ.pop("PPO_MAX_IMPL", None)  # the reference modules are the project's (tests/conftest.py reads it)
    job = json.loads(job_path.read_text())
    for m in ASSIGNMENT:
        __import__(m)  # the reference modules, before any student's file is loaded

    class Plugin(GradePlugin):
        @pytest.fixture(name="_graded_submission", autouse=True)  # autouse: so that it can take the parameter
        def _graded_submission(self, request):
            yield from self.swap(request)

    modules = [m for m in ASSIGNMENT if any(f.split(".")[0] == m for s in job["submissions"] for f in s["functions"])]
    os.chdir(ROOT)
    code = pytest.main([TEST_FILE[m] for m in modules] + ["-q", "-p", "no:cacheprovider", "--tb=no", "-W", "ignore"],
                       plugins=[Plugin(job["submissions"], results_path)])
    with open(results_path, "a") as fh:
        fh.write(json.dumps({"done": True, "exit": int(code)}) + "\n")
    return 0


def _watch_worker(job: list[dict], tmp: Path, timeout: float) -> tuple[list[dict], str | None]:
    """Run one worker on `job`; returns the results it wrote (with their job index) and, if it stopped before the
    end, why: it hung on a submission for `timeout` s, or died."""
    job_path, out, log = tmp / "job.json", tmp / "results.jsonl", tmp / "worker.log"
    job_path.write_text(json.dumps({"submissions": job}))
    out.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "PPO_MAX_IMPL"}
    results, ready, done, seen, last = [], False, False, 0, time.monotonic()
    with open(log, "w") as log_fh:
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "_worker", str(job_path), str(out)],
                                cwd=ROOT, env=env, stdout=log_fh, stderr=subprocess.STDOUT)
        while not done:
            try:
                proc.wait(timeout=0.2)
                exited = True
            except subprocess.TimeoutExpired:
                exited = False
            text = out.read_text() if out.exists() else ""
            lines = text.splitlines()[: text.count("\n")]  # whole lines only: the worker may be writing one
            for line in lines[seen:]:
                r = json.loads(line)
                ready, done = ready or r.get("ready", False), r.get("done", False)
                if done and r["exit"] not in (0, 1, 5):  # 0 all passed, 1 some failed, 5 nothing to run
                    raise RuntimeError(f"the grading worker stopped (pytest exit {r['exit']}): {log.read_text()[-2000:]}")
                if "index" in r:
                    results.append(r)
            if len(lines) > seen:
                seen, last = len(lines), time.monotonic()
            if exited and not done:
                if not ready:
                    raise RuntimeError(f"the grading worker did not start: {log.read_text()[-2000:]}")
                return results, f"error: the grading process died (exit status {proc.returncode}) in this submission"
            if not done and time.monotonic() - last > (timeout if ready else STARTUP_TIMEOUT):
                proc.kill()
                proc.wait()
                return results, f"error: grading stopped after {timeout:g} s without finishing (an endless loop?)"
        proc.wait()
    return results, None


def grade_submissions(submissions: list[tuple], functions: list[str], timeout: float = STUDENT_TIMEOUT) -> list[dict]:
    """Grade each (name, folder) on `functions` ("module.function"), or each (name, folder, its own functions), all in
    one worker process (one pytest session, so torch and the tests load once). A worker that crashes, or spends
    `timeout` s on one submission (an endless loop), is stopped: that submission's functions are errors, and a new
    worker goes on with the next one.
    Returns one result per submission: {"name", "folder", "seconds", "functions": {function: {"status", "passed",
    "total", "test", "message"}}}, status passed / failed / missing / error."""
    job = [{"name": s[0], "folder": str(s[1]), "functions": list(s[2]) if len(s) > 2 else functions}
           for s in submissions]
    results: dict[int, dict] = {}
    todo = list(range(len(submissions)))
    with tempfile.TemporaryDirectory() as tmp:
        while todo:
            done, why = _watch_worker([job[i] for i in todo], Path(tmp), timeout)
            for r in done:
                results[todo[r.pop("index")]] = r
            left = [i for i in todo if i not in results]
            if why is None and left:
                raise RuntimeError(f"the grading worker finished without grading {left}")
            if left:  # the worker hung on, or died in, the first submission it had not finished
                culprit = left.pop(0)
                results[culprit] = {**{k: job[culprit][k] for k in ("name", "folder")}, "seconds": 0.0,
                                    "functions": {f: {"status": "error", "passed": 0, "total": 0, "test": None,
                                                      "message": why} for f in job[culprit]["functions"]}}
            todo = left
    return [results[i] for i in range(len(submissions))]


# ------------------------------------------------------------------------------------------------------------------
# grade: the reports
# ------------------------------------------------------------------------------------------------------------------

STATUS = {"passed": "passed", "failed": "FAILED", "missing": "MISSING", "error": "ERROR"}


def equation(function: str) -> str:
    module, name = function.split(".", 1)
    return ASSIGNMENT[module][name]


def row_message(r: dict) -> str:
    """What a student reads for a function that did not pass: the test and its one-line message."""
    if r["status"] == "failed":
        return f"{r['test']}: {r['message']}"
    return r["message"].split(": ", 1)[1] if ": " in r["message"] else r["message"]


def print_report(result: dict) -> bool:
    """One student's grade: a line per function (passed / FAILED with the first failing test and its message /
    MISSING / ERROR), then the total. True iff every function passed."""
    rows = result["functions"]
    print(f"grading {result['folder']}: {len(rows)} functions in {result['seconds']:.1f} s")
    width = max(len(f) for f in rows)
    for f, r in rows.items():
        tests = f" {r['passed']}/{r['total']} tests" if r["total"] else ""
        print(f"  {STATUS[r['status']]:8s} {f:{width}s}  {equation(f):16s}{tests}")
        if r["status"] != "passed":
            print(f"           {row_message(r)}")
    n = sum(r["status"] == "passed" for r in rows.values())
    print(f"{n} of {len(rows)} functions passed" + ("" if n == len(rows) else "; the assignment is not complete"))
    return n == len(rows)


def class_table(results: list[dict]) -> list[dict]:
    """One row per student: counts, seconds, and per function "pass" or "<status>: <message>"."""
    table = []
    for res in results:
        rows = res["functions"]
        row = {"student": res["name"],
               "functions_passed": sum(r["status"] == "passed" for r in rows.values()), "functions": len(rows),
               "tests_passed": sum(r["passed"] for r in rows.values()), "tests": sum(r["total"] for r in rows.values()),
               "seconds": round(res["seconds"], 2)}
        for f, r in rows.items():
            row[f] = "pass" if r["status"] == "passed" else f"{r['status']}: {row_message(r)}"
        table.append(row)
    return table


def print_class(table: list[dict], seconds: float) -> None:
    width = max([len("student")] + [len(r["student"]) for r in table])
    print(f"{'student':{width}s}  functions     tests  seconds  first function not passed")
    for r in table:
        first = next((f"{f} ({equation(f)}): {v}" for f, v in r.items() if "." in f and v != "pass"), "")
        print(f"{r['student']:{width}s}  {r['functions_passed']:4d}/{r['functions']:<4d} {r['tests_passed']:5d}/"
              f"{r['tests']:<5d} {r['seconds']:6.1f}   {first_line(first, 160)}")
    print(f"{len(table)} students graded in {seconds:.1f} s")


def write_csv(table: list[dict], path: Path) -> None:
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(table[0]))
        writer.writeheader()
        writer.writerows(table)


def selected_functions(modules: list[str], functions: list[str] | None) -> list[str]:
    chosen = all_functions(check_modules(modules))
    if functions:
        unknown = [f for f in functions if f not in chosen]
        if unknown:
            raise UserError(f"--functions {' '.join(unknown)}: not assigned in {', '.join(modules)}; "
                            f"choose from {', '.join(chosen)}")
        chosen = [f for f in chosen if f in functions]
    return chosen


def grade(folder: Path, modules: list[str] | None = None, functions: list[str] | None = None,
          timeout: float = STUDENT_TIMEOUT) -> bool:
    """Grade one student's folder and print the report; True iff every assigned function passed."""
    if not folder.is_dir():
        raise UserError(f"grade {folder}: no such folder")
    modules = modules or list(ASSIGNMENT)
    if not any((folder / f"{m}.py").is_file() for m in modules) and \
            any((d / f"{m}.py").is_file() for d in folder.iterdir() if d.is_dir() for m in modules):
        print(f"note: {folder} holds no {'/'.join(m + '.py' for m in modules)} but its subfolders do: "
              f"grade a class with --class {folder}")
    (result,) = grade_submissions([(folder.name, folder.resolve())], selected_functions(modules, functions), timeout)
    return print_report(result)


def grade_class(folder: Path, csv_path: Path | None, modules: list[str] | None = None,
                functions: list[str] | None = None, timeout: float = STUDENT_TIMEOUT) -> bool:
    """Grade every subfolder of `folder` (one per student): print one table, write it as CSV. True iff every
    student passed every function."""
    if not folder.is_dir():
        raise UserError(f"grade --class {folder}: no such folder")
    students = sorted(d for d in folder.iterdir() if d.is_dir() and not d.name.startswith((".", "__")))
    if not students:
        raise UserError(f"grade --class {folder}: no subfolders (one per student) in it")
    chosen = selected_functions(modules or list(ASSIGNMENT), functions)
    t0 = time.perf_counter()
    table = class_table(grade_submissions([(d.name, d.resolve()) for d in students], chosen, timeout))
    print_class(table, time.perf_counter() - t0)
    csv_path = csv_path or folder / "grades.csv"
    write_csv(table, csv_path)
    print(f"wrote {csv_path}")
    return all(r["functions_passed"] == r["functions"] for r in table)


def check_worksheet(path: Path, timeout: float = 600) -> bool:
    """Run a worksheet (the exercises notebook, a student's copy) as a student's check: every cell from the top, in
    the notebook's folder; prints "all checks pass", or one line naming the first cell that does not hold and its
    error (no colour codes). True iff every cell ran."""
    import nbclient
    import nbformat
    from nbclient.exceptions import CellExecutionError
    if not path.is_file():
        raise UserError(f"check {path}: no such notebook")
    nb = nbformat.read(str(path), as_version=4)
    client = nbclient.NotebookClient(nb, timeout=timeout, resources={"metadata": {"path": str(path.parent)}})
    try:
        client.execute()
    except CellExecutionError as e:
        failed = next((i for i, c in enumerate(nb.cells) if c.cell_type == "code"
                       and any(o.get("output_type") == "error" for o in c.get("outputs", []))), None)
        error = next((o for o in nb.cells[failed].outputs if o.get("output_type") == "error"), {}) if failed is not \
            None else {}
        title = next((ANSI.sub("", c.source).strip().splitlines()[0] for c in reversed(nb.cells[:failed or 0])
                      if c.cell_type == "markdown" and c.source.strip()), "")
        why = f"{error.get('ename', 'error')}: {ANSI.sub('', error.get('evalue', ''))}" if error else \
            first_line(ANSI.sub("", str(e)))
        print(f"{path}: cell {failed} fails{f' (after {title!r})' if title else ''}: {first_line(why, 200)}")
        return False
    print(f"{path}: all checks pass")
    return True


def parser() -> OneLineParser:
    """The command line: make, grade, check."""
    p = OneLineParser(prog="tools/assignment.py", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=OneLineParser)
    pm = sub.add_parser("make", help="write the hand-out folder, or a copy of the repository without the solutions")
    where = pm.add_mutually_exclusive_group(required=True)
    where.add_argument("--out", type=Path, help="folder to write the stubbed modules (and what they import) into")
    where.add_argument("--student-repo", type=Path, help="new folder for a copy of the repository without solutions")
    pm.add_argument("--modules", nargs="+", default=list(ASSIGNMENT), help=f"of {', '.join(ASSIGNMENT)} (default all)")
    pm.add_argument("--force", action="store_true", help="--out: overwrite files that already exist there")
    pm.add_argument("--manifest", type=Path, help="--student-repo: the files to hand out, one path a line (default: "
                                                  "those committed at HEAD; never untracked or ignored ones)")
    pg = sub.add_parser("grade", help="grade a student's folder, or a class (a folder of student folders)")
    pg.add_argument("dir", type=Path, nargs="?", help="the student's folder (gae.py, ppo_loss.py, ...)")
    pg.add_argument("--class", dest="klass", type=Path, help="a folder with one subfolder per student")
    pg.add_argument("--csv", type=Path, help="--class: where to write the table (default <class folder>/grades.csv)")
    pg.add_argument("--modules", nargs="+", default=list(ASSIGNMENT), help="the modules assigned (default all)")
    pg.add_argument("--functions", nargs="+", help="grade only these, e.g. gae.compute_gae ppo_loss.masked_mean")
    pg.add_argument("--timeout", type=float, default=STUDENT_TIMEOUT,
                    help=f"seconds one student's tests may take before they are stopped (default {STUDENT_TIMEOUT})")
    pc = sub.add_parser("check", help="run a worksheet (the exercises notebook) and say which cell fails, if any")
    pc.add_argument("notebook", type=Path, nargs="?", default=Path(NOTEBOOK), help=f"default {NOTEBOOK}")
    pw = sub.add_parser("_worker")  # internal: grade_submissions runs it
    pw.add_argument("job", type=Path)
    pw.add_argument("results", type=Path)
    return p


@cli_guard
def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.cmd == "_worker":
        return run_worker(args.job, args.results)
    if args.cmd == "check":
        return 0 if check_worksheet(args.notebook) else 1
    if args.cmd == "make":
        if args.manifest and not args.student_repo:
            raise UserError("--manifest: only with --student-repo")
        if args.student_repo:
            make_student_repo(args.student_repo, args.modules, args.manifest)
        else:
            make(args.out, args.modules, args.force)
        return 0
    if (args.dir is None) == (args.klass is None):
        raise UserError("grade: give a student's folder or --class FOLDER (not both)")
    if args.klass:
        return 0 if grade_class(args.klass, args.csv, args.modules, args.functions, args.timeout) else 1
    return 0 if grade(args.dir, args.modules, args.functions, args.timeout) else 1


if __name__ == "__main__":
    sys.exit(main())
