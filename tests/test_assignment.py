"""Tests for tools/assignment.py: the hand-out and the student repository keep everything but the solutions, and
`grade` passes the reference, fails every function of the untouched hand-out and of a partial submission, and catches
the held-out student mistakes of tests/student_mistakes.py, each at the function that makes it.

Cost: every grading check of the reference, the hand-out, partial submissions and the mistakes shares one worker
process (the module fixture `graded`); the command line, the notebook, conftest.py and the hand-out's worked examples
add a few short subprocesses.
"""
import ast
import csv
import importlib.util
import inspect
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import assignment
from student_mistakes import MISTAKES

ROOT = Path(__file__).resolve().parents[1]
ALL = assignment.all_functions()


def load(path: Path, name: str):
    """Import a file under a private module name (so the real module in sys.modules is left alone)."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def clean_env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in ("PPO_MAX_IMPL", "PYTHONPATH")}


def with_mistake(mistake: dict) -> str:
    """The reference file of the mistake's module with the mistake made, inside the function's body only."""
    module, name = mistake["function"].split(".", 1)
    source = (ROOT / f"{module}.py").read_text()
    ((first, last),) = assignment.body_lines(source, module, [name]).values()
    lines = source.splitlines(keepends=True)
    body = "".join(lines[first - 1 : last])
    assert body.count(mistake["find"]) == 1, f"{mistake['mistake']}: `find` must occur once in {mistake['function']}"
    lines[first - 1 : last] = [body.replace(mistake["find"], mistake["replace"])]
    return "".join(lines)


# ------------------------------------------------------------------------------------------------ the tests' naming


def test_every_assigned_function_is_graded_by_tests_named_after_it():
    for module, functions in assignment.ASSIGNMENT.items():
        tree = ast.parse((ROOT / assignment.TEST_FILE[module]).read_text())
        names = [n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")]
        graded = {assignment.graded_function(module, n) for n in names}
        assert set(functions) <= graded, f"{module}: no test_<function>_… for {set(functions) - graded}"
        doc = ast.get_docstring(ast.parse((ROOT / f"{module}.py").read_text()))
        for function, label in functions.items():  # the equation shown by `grade` is the one the file names
            for ref in re.findall(r"(?:Eq|Fig|App)\. [\w.]+", label.replace("–", " ")):
                assert ref in doc, f"{module}.{function}: {ref} is not in {module}.py's Implements block"


def test_graded_tests_call_the_assigned_functions_through_their_module():
    """`from gae import compute_gae` in a test would keep the reference function while grade swaps the student's in."""
    for module, functions in assignment.ASSIGNMENT.items():
        tree = ast.parse((ROOT / assignment.TEST_FILE[module]).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == module:
                bound = {a.name for a in node.names}
                assert not bound & set(functions), f"{assignment.TEST_FILE[module]}: from {module} import {bound}"


def test_test_prefix_and_graded_function():
    assert assignment.test_prefix("RunningMoments.update") == "test_running_moments_update"
    assert assignment.graded_function("ppo_loss", "test_entropy_bonus_no_clip_is_minus_coef_mean_entropy") == "entropy"
    assert assignment.graded_function("ppo_loss", "test_masked_var_ddof") is None  # given code is not graded
    assert assignment.graded_function("gae", "test_compute_gae_eq9_equals_explicit_double_sum[1.0-0.9]") == \
        "compute_gae"


# ------------------------------------------------------------------------------------------------ make


def test_make_stubs_only_the_assigned_bodies(tmp_path):
    assignment.make(tmp_path, list(assignment.ASSIGNMENT))
    for module, functions in assignment.ASSIGNMENT.items():
        real = ast.parse((ROOT / f"{module}.py").read_text())
        stub = ast.parse((tmp_path / f"{module}.py").read_text())
        stubbed = set()
        for function in functions:
            r, s = assignment.find_def(real, function), assignment.find_def(stub, function)
            assert ast.dump(r.args) == ast.dump(s.args) and ast.dump(r.returns) == ast.dump(s.returns)
            assert ast.get_docstring(r) == ast.get_docstring(s) and ast.get_docstring(s)
            assert len(s.body) == 2 and isinstance(s.body[1], ast.Raise)  # the docstring and one raise
            assert s.body[1].exc.func.id == "NotImplementedError"
            s.body, r.body = [], []  # compare the rest of the file with these bodies taken out
            stubbed.add(function)
        assert ast.dump(real) == ast.dump(stub), f"{module}.py: something besides {stubbed} changed"


@pytest.mark.parametrize("module", list(assignment.ASSIGNMENT))
def test_make_stubs_import_and_raise_not_implemented(tmp_path, module):
    assignment.make(tmp_path, [module])
    mod = load(tmp_path / f"{module}.py", f"_stub_{module}")
    for name in assignment.ASSIGNMENT[module]:
        fn = assignment._get(mod, name)
        args = [p for p in inspect.signature(fn).parameters.values() if p.default is p.empty]
        with pytest.raises(NotImplementedError, match=f"exercise: implement {module}.{name}"):
            fn(*[None] * len(args))


def test_make_refuses_to_overwrite_the_repo_or_a_students_file(tmp_path):
    with pytest.raises(assignment.UserError, match="repository itself"):
        assignment.make(ROOT, ["gae"])
    assignment.make(tmp_path, ["gae"])
    with pytest.raises(assignment.UserError, match="--force"):
        assignment.make(tmp_path, ["gae"])


def test_make_copies_what_the_files_import_and_stubs_an_assigned_dependency(tmp_path):
    assignment.make(tmp_path, ["ppo_max"])  # ppo_max.py imports critic_free, the package and three assigned ones
    written = {str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*.py")}
    deps = assignment.dependencies(["ppo_max"])
    assert written == {"ppo_max.py", "plumbing/__init__.py", *(assignment.module_file(d) for d in deps)}
    assert {"gae", "ppo_loss", "reward_model", "critic_free", "plumbing.config", "plumbing.engine"} <= set(deps)
    for given in written - {"ppo_max.py", "gae.py", "ppo_loss.py", "reward_model.py"}:
        assert (tmp_path / given).read_text() == (ROOT / given).read_text(), given
    for module in ("gae", "ppo_loss", "reward_model"):  # never a solution in a hand-out, even of one not assigned now
        text = (tmp_path / f"{module}.py").read_text()
        assert all(f"exercise: implement {module}.{f} " in text for f in assignment.ASSIGNMENT[module])


def test_handout_worked_examples_run_from_the_handout_folder(tmp_path):
    """`python handout/reward_model.py` finds data, engine, lora, ... in the hand-out; filled in, ppo_max.py's worked
    example prints its pasted numbers; nothing comes from the repository (another folder, no PYTHONPATH)."""
    handout = tmp_path / "handout"
    assignment.make(handout, list(assignment.ASSIGNMENT))
    run = dict(cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=600)
    proc = subprocess.run([sys.executable, "handout/reward_model.py"], **run)
    assert proc.returncode == 1 and "ModuleNotFoundError" not in proc.stderr, proc.stderr[-2000:]
    assert "NotImplementedError: exercise: implement reward_model.bradley_terry_loss" in proc.stderr
    for module in ("gae", "ppo_loss", "ppo_max"):  # a student who is done
        shutil.copy(ROOT / f"{module}.py", handout / f"{module}.py")
    proc = subprocess.run([sys.executable, "handout/ppo_max.py"], **run)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "RunningMoments(count=5, mean=2.7, std=1.32665)" in proc.stdout
    assert "[-0.01000,  0.82500,  0.00000]" in proc.stdout


# ------------------------------------------------------------------------------------------------ the student repo


def solution_lines(code: str) -> list[str]:
    """The code of each non-blank line, without its comment (what a leak would show)."""
    out = []
    for line in code.splitlines():
        line = re.sub(r"\s+#\s.*$", "", line).strip()
        if line and not line.startswith("#"):
            out.append(line)
    return out


def texts(root: Path, files: list[str], skip: dict[str, list[tuple[int, int]]] | None = None,
          answers: bool = True) -> str:
    """The text files `files` under `root` in one string (notebooks: their cells' sources and outputs), leaving out
    the line ranges in `skip` (file → [(first, last)]) and, with answers=False, the exercises notebook's answers."""
    parts = []
    for rel in files:
        path = root / rel
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        if path.suffix == ".ipynb":
            nb = json.loads(text)
            if not answers and rel == assignment.NOTEBOOK:
                for c in nb["cells"]:
                    c["source"], c["outputs"] = assignment.strip_solutions("".join(c["source"]),
                                                                            c["cell_type"] == "markdown")[0], []
            text = "\n".join("".join(c["source"]) + "\n" + "\n".join(
                "".join(o.get("text", "")) + "".join(o.get("data", {}).get("text/plain", ""))
                for o in c.get("outputs", [])) for c in nb["cells"])
        lines = text.splitlines()
        for first, last in (skip or {}).get(rel, []):
            lines[first - 1 : last] = [""] * (last - first + 1)
        parts.append("\n".join(lines))
    return "\n".join(parts)


def test_student_repo_holds_no_solution_line(tmp_path):
    dest = tmp_path / "course"
    files = assignment.make_student_repo(dest, list(assignment.ASSIGNMENT))
    assert set(files) == set(assignment.repository_files()) - set(assignment.TEACHER_ONLY)
    copied = sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file())
    assert copied == sorted(files) and not (dest / ".git").exists()
    # every solution line: the assigned bodies, and the notebook's worked answers
    bodies = {f"{m}.py": assignment.body_lines((ROOT / f"{m}.py").read_text(), m, list(fs)).values()
              for m, fs in assignment.ASSIGNMENT.items()}
    solution = set()
    for rel, ranges in bodies.items():
        lines = (ROOT / rel).read_text().splitlines()
        for first, last in ranges:
            solution |= set(solution_lines("\n".join(lines[first - 1 : last])))
    nb = json.loads((ROOT / assignment.NOTEBOOK).read_text())
    answers = [assignment.strip_solutions("".join(c["source"]), c["cell_type"] == "markdown")[1] for c in nb["cells"]]
    assert sum(map(len, answers)) > 40  # the markers are there: 7 answers in 5 exercises
    solution |= {l for a in answers for l in solution_lines("\n".join(a)) if len(l) > 3}
    # a line the given code also holds (`return loss, stats`, `else:`) is not a leak: it is handed out anyway
    given = texts(ROOT, files, skip={rel: list(r) for rel, r in bodies.items()}, answers=False)
    distinctive = {l for l in solution if l not in given}
    assert len(distinctive) > 0.9 * len(solution), sorted(solution - distinctive)
    copy = texts(dest, copied)
    leaked = sorted(l for l in distinctive if l in copy)
    assert not leaked, f"solution lines in the student repo: {leaked[:5]}"
    # the copy: the assigned files are the stubs, the notebook is a worksheet with no outputs
    for m, fs in assignment.ASSIGNMENT.items():
        assert (dest / f"{m}.py").read_text() == assignment.stub_source((ROOT / f"{m}.py").read_text(), m, list(fs))
    sheet = json.loads((dest / assignment.NOTEBOOK).read_text())
    assert all(not c.get("outputs") for c in sheet["cells"] if c["cell_type"] == "code")
    sources = ["".join(c["source"]) for c in sheet["cells"]]
    markers = {"# BEGIN SOLUTION", "# END SOLUTION", "<!-- BEGIN SOLUTION -->", "<!-- END SOLUTION -->"}
    assert not any(line.strip() in markers for s in sources for line in s.splitlines())
    assert any('raise NotImplementedError("your answer here: define p_prefer_w")' in s for s in sources)
    assert any("*Your answer here.*" in s for s in sources)
    # and its own tests run there, against the stubs
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_gae.py", "-k",
                           "worked_example"], cwd=dest, env=clean_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1 and "NotImplementedError: exercise: implement gae.compute_gae" in proc.stdout


def test_student_repo_holds_only_committed_files(tmp_path, monkeypatch, capsys):
    """A teacher's tree with an untracked solution file, an ignored one and an uncommitted change: the student
    repository has none of them (HEAD's files as committed), and one line says what was left out."""
    teacher, course = tmp_path / "teacher", tmp_path / "course"
    (teacher / "notebooks").mkdir(parents=True)
    shutil.copy(ROOT / "gae.py", teacher / "gae.py")
    shutil.copy(ROOT / assignment.NOTEBOOK, teacher / assignment.NOTEBOOK)
    (teacher / ".gitignore").write_text("secret/\n")

    def git(*args):
        subprocess.run(["git", "-C", str(teacher), "-c", "user.name=t", "-c", "user.email=t@t", *args], check=True,
                       capture_output=True)
    git("init", "-q")
    git("add", "-A")
    git("commit", "-qm", "the course")
    solution = "delta = rewards[:, t] + gamma * next_values - values[:, t]"  # a line of the reference compute_gae
    assert solution in (teacher / "gae.py").read_text()
    for rel in ("notes/my_gae_solution.py", "secret/answers.py"):
        (teacher / rel).parent.mkdir()
        (teacher / rel).write_text(f"# the reference line\n{solution}\n")
    with open(teacher / "gae.py", "a") as fh:
        fh.write("# a change the teacher has not committed\n")
    monkeypatch.setattr(assignment, "ROOT", teacher)
    files = assignment.make_student_repo(course, ["gae"])
    assert sorted(files) == [".gitignore", "gae.py", assignment.NOTEBOOK]
    assert sorted(str(p.relative_to(course)) for p in course.rglob("*") if p.is_file()) == sorted(files)
    handed = (course / "gae.py").read_text()
    assert solution not in handed and "not committed" not in handed and "NotImplementedError" in handed
    assert capsys.readouterr().out.splitlines()[-1] == ("left out: untracked notes/; uncommitted changes of gae.py "
                                                        "(handed out as committed); ignored secret/")
    # or exactly the files a manifest lists
    (teacher / "course.txt").write_text("# what the course hands out\ngae.py\n")
    assert assignment.make_student_repo(tmp_path / "course2", ["gae"], teacher / "course.txt") == ["gae.py"]
    (teacher / "course.txt").write_text("gae.py\nnotes/none.py\n")
    with pytest.raises(assignment.UserError, match=r"course.txt:2: notes/none.py: no such file"):
        assignment.make_student_repo(tmp_path / "course3", ["gae"], teacher / "course.txt")


def teaching_commands() -> list[str]:
    """Every command of TEACHING.md's ```bash blocks, a continued line joined, its comment dropped."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "TEACHING.md").read_text(), re.S)
    lines = "\n".join(blocks).replace("\\\n", " ").splitlines()
    return [l.split("  #")[0].strip() for l in lines if l.strip() and not l.startswith("#")]


@pytest.mark.slow
def test_every_teaching_command_runs_as_written(tmp_path):
    """TEACHING.md's commands, in its order, in a fresh copy of the committed repository: each runs (no usage error,
    no missing file); the ones whose work is graded elsewhere in this file (pytest on a hand-out, grade) run on the
    smallest case: their folders and test files exist and their flags parse. The worksheet check runs in the student
    repository and names the first cell that fails, in one line without colour codes."""
    commands = teaching_commands()
    assert len(commands) >= 13 and commands[0].startswith("python tools/assignment.py check"), commands
    clone = tmp_path / "ppo-max"
    for rel, content in assignment.repository_files().items():
        (clone / rel).parent.mkdir(parents=True, exist_ok=True)
        (clone / rel).write_bytes(content)
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "a fresh clone"]):  # a clone: a git repository
        subprocess.run(["git", "-C", str(clone), "-c", "user.name=t", "-c", "user.email=t@t", *args], check=True,
                       capture_output=True)
    env = clean_env()
    checks = [c for c in commands if c.startswith("python tools/assignment.py check")]  # after the student repo
    for command in [c for c in commands if c not in checks] + checks:
        argv = command.split()
        impl = argv.pop(0).split("=", 1)[1] if argv[0].startswith("PPO_MAX_IMPL=") else None
        cwd = tmp_path / "course-ppo-max" if command in checks else clone  # the worksheet: in the student repository
        if argv[2:3] == ["grade"]:
            if "--class" in argv:
                shutil.copytree(clone / "handout", clone / "submissions" / "alice")
            args = assignment.parser().parse_args(argv[2:])
            assert (cwd / (args.klass or args.dir)).is_dir(), command
            continue
        if argv[1:3] == ["-m", "pytest"]:
            assert (cwd / argv[3]).is_file() and (cwd / impl).is_dir(), command
            continue
        proc = subprocess.run([sys.executable, *argv[1:]], cwd=cwd, env={**env, **({"PPO_MAX_IMPL": impl} if impl
                              else {})}, capture_output=True, text=True, timeout=600)
        assert "usage:" not in proc.stderr and "No such file" not in proc.stderr, (command, proc.stderr)
        if argv[1] == "handout/gae.py":  # the worked example stops at the first exercise
            assert proc.returncode == 1 and "NotImplementedError: exercise: implement gae." in proc.stderr
        elif argv[2] == "check":
            assert proc.returncode == 1 and "\x1b" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
            (line,) = proc.stdout.strip().splitlines()
            assert re.match(r"notebooks/exercises.ipynb: cell \d+ fails .*NotImplementedError: your answer here: "
                            r"define p_prefer_w", line), line
        else:
            assert proc.returncode == 0, (command, proc.stdout, proc.stderr)


def test_student_repo_refuses_the_repository_and_a_folder_in_use(tmp_path):
    with pytest.raises(assignment.UserError, match="outside the repository"):
        assignment.make_student_repo(ROOT / "course", ["gae"])
    (tmp_path / "x").write_text("a student's work")
    with pytest.raises(assignment.UserError, match="not empty"):
        assignment.make_student_repo(tmp_path, ["gae"])


# ------------------------------------------------------------------------------------------------ PPO_MAX_IMPL


def test_impl_folder_is_relative_to_the_repository_root_wherever_you_are(tmp_path, monkeypatch):
    (tmp_path / "handout").mkdir()
    relative = os.path.relpath(tmp_path / "handout", ROOT)
    for cwd in (ROOT, ROOT / "notebooks", tmp_path):
        monkeypatch.chdir(cwd)
        assert assignment.impl_folder(relative) == (tmp_path / "handout").resolve()
    with pytest.raises(assignment.ImplFolderError, match=r"did you mean .*handout\?"):
        assignment.impl_folder("handout")  # from tmp_path: there is a handout/ here, but not in the repository
    with pytest.raises(assignment.ImplFolderError, match="no folder") as err:
        assignment.impl_folder("no/such/folder")
    assert err.value._render_traceback_() == [f"error: {err.value}"]  # one line in a notebook


def test_conftest_takes_a_relative_impl_from_the_repository_root(tmp_path):
    """Run from tests/, `PPO_MAX_IMPL=<relative>` still loads the student's gae.py (here the hand-out's stubs)."""
    assignment.make(tmp_path, ["gae"])
    env = {**clean_env(), "PPO_MAX_IMPL": os.path.relpath(tmp_path, ROOT)}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_gae.py", "-k",
                           "compute_gae_worked_example"], cwd=ROOT / "tests", env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 1 and "NotImplementedError: exercise: implement gae.compute_gae" in proc.stdout


@pytest.mark.notebook
def test_exercises_notebook_with_a_relative_impl_checks_the_students_code(tmp_path):
    """The kernel runs in notebooks/; `PPO_MAX_IMPL` relative to the repository root still names the student's folder,
    so exercise 1's check fails on the stub; a folder that does not exist stops the first cell with one line."""
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError
    import nbformat

    assignment.make(tmp_path, ["gae", "ppo_loss", "reward_model"])
    nb = nbformat.read(ROOT / assignment.NOTEBOOK, as_version=4)
    setup, check = nb.cells[1], nb.cells[4]  # the imports; exercise 1's check (Bradley–Terry)
    sheet = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(""), setup, nb.cells[3], check])
    client = NotebookClient(sheet, timeout=600, resources={"metadata": {"path": str(ROOT / "notebooks")}})
    with client.setup_kernel(env=clean_env()):
        def run(index: int, env_value: str | None = None):
            if env_value is not None:
                sheet.cells[0].source = f"import os\nos.environ['PPO_MAX_IMPL'] = {env_value!r}"
                client.execute_cell(sheet.cells[0], 0)
            return client.execute_cell(sheet.cells[index], index)

        with pytest.raises(CellExecutionError) as err:
            run(1, "no/such/folder")
        error = next(o for o in sheet.cells[1].outputs if o.output_type == "error")
        assert error.traceback == [f"error: PPO_MAX_IMPL=no/such/folder: no folder {ROOT / 'no/such/folder'}"]
        run(1, os.path.relpath(tmp_path, ROOT))
        printed = "".join(o.get("text", "") for o in sheet.cells[1].outputs)
        assert printed.count(str(tmp_path.resolve())) == 3, printed  # gae, ppo_loss, reward_model: the student's
        with pytest.raises(CellExecutionError, match="exercise: implement reward_model.bradley_terry_loss"):
            run(2), run(3)


# ------------------------------------------------------------------------------------------------ grade


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """One grading run (one worker process) of: the reference, the untouched hand-out, a partial submission (only
    gae.py), a broken one (ppo_loss.py without entropy, reward_model.py that does not parse), and every mistake."""
    base = tmp_path_factory.mktemp("submissions")
    assignment.make(base / "handout", list(assignment.ASSIGNMENT))
    (base / "partial").mkdir()
    shutil.copy(ROOT / "gae.py", base / "partial" / "gae.py")
    (base / "broken").mkdir()
    source = (ROOT / "ppo_loss.py").read_text()
    start, end = source.index("def entropy(logits"), source.index("def entropy_bonus_loss")
    (base / "broken" / "ppo_loss.py").write_text(source[:start] + source[end:].replace(
        "mean_entropy = masked_mean(entropy(logits), mask)", "mean_entropy = masked_mean(logits[..., 0], mask)"))
    (base / "broken" / "reward_model.py").write_text("def bradley_terry_loss(r_chosen, r_rejected:\n    pass\n")
    td = "        delta = rewards[:, t] + gamma * next_values - values[:, t]"
    for name, helper in [("helped", "r + gamma * v1 - v0"), ("misled", "r + v1 - v0")]:  # each with its own my_td.py
        (base / name).mkdir()
        (base / name / "gae.py").write_text((ROOT / "gae.py").read_text().replace("import torch\n", "import torch\n"
                                            "import my_td\n", 1).replace(td, td.replace("rewards[:, t] + gamma * "
                                            "next_values - values[:, t]", "my_td.td(rewards[:, t], next_values, "
                                            "values[:, t], gamma)")))
        (base / name / "my_td.py").write_text(f"def td(r, v1, v0, gamma):\n    return {helper}\n")
    subs = [("reference", ROOT, ALL), ("handout", base / "handout", ALL), ("partial", base / "partial", ALL),
            ("broken", base / "broken", ALL), ("helped", base / "helped", ALL[:3]), ("misled", base / "misled", ALL[:3])]
    for k, mistake in enumerate(MISTAKES):
        folder = base / f"mistake{k:02d}"
        folder.mkdir()
        module = mistake["function"].split(".")[0]
        (folder / f"{module}.py").write_text(with_mistake(mistake))
        subs.append((f"mistake{k:02d}", folder, [mistake["function"]]))
    return {r["name"]: r for r in assignment.grade_submissions(subs, ALL)}


def test_grade_passes_the_reference_on_every_function(graded):
    rows = graded["reference"]["functions"]
    assert list(rows) == ALL
    assert {f: r["status"] for f, r in rows.items() if r["status"] != "passed"} == {}
    assert all(r["total"] > 0 for r in rows.values())


def test_grade_fails_every_function_of_the_untouched_handout(graded):
    for function, r in graded["handout"]["functions"].items():
        assert r["status"] == "failed" and r["passed"] == 0, (function, r)
        assert f"NotImplementedError: exercise: implement {function} (see its docstring)" in r["message"]


def test_grade_fails_a_partial_submission_and_says_what_is_missing(graded, capsys):
    rows = graded["partial"]["functions"]
    assert all(rows[f]["status"] == "passed" for f in assignment.all_functions(["gae"]))
    for f in assignment.all_functions(["ppo_loss", "reward_model", "ppo_max"]):
        module = f.split(".")[0]
        assert rows[f]["status"] == "missing" and f"no {module}.py in " in rows[f]["message"]
    assert not assignment.print_report(graded["partial"])
    out = capsys.readouterr().out
    assert re.search(r"MISSING +ppo_max\.shape_rewards +Eq\. 19", out) and "the assignment is not complete" in out


def test_grade_names_a_missing_function_and_a_file_that_does_not_import(graded):
    rows = graded["broken"]["functions"]
    assert rows["ppo_loss.entropy"]["status"] == "missing"
    assert rows["ppo_loss.entropy"]["message"] == "missing: ppo_loss.py has no function entropy"
    assert rows["ppo_loss.policy_loss"]["status"] == "passed"  # graded with the reference entropy: not its fault
    for f in assignment.all_functions(["reward_model"]):
        assert rows[f]["status"] == "error" and "reward_model.py cannot be imported: SyntaxError" in rows[f]["message"]
    # a function that cannot be graded has 0 of its tests passed, never "tests 100/100" for what did import
    reference = graded["reference"]["functions"]
    for f in assignment.all_functions(["reward_model"]) + ["ppo_loss.entropy"]:
        assert rows[f]["passed"] == 0 and rows[f]["total"] == reference[f]["total"] > 0, (f, rows[f])
    (row,) = assignment.class_table([graded["broken"]])
    assert row["tests"] == sum(r["total"] for r in reference.values()) and row["tests_passed"] < row["tests"]


def test_grade_loads_a_students_own_helper_module(graded):
    """gae.py may import a module of the student's own (my_td.py, a name no project module has); each student's is
    theirs, although the two have the same name."""
    assert graded["helped"]["functions"]["gae.compute_gae"]["status"] == "passed"
    assert graded["misled"]["functions"]["gae.compute_gae"]["status"] == "failed"  # its my_td forgets γ


def test_grade_catches_the_held_out_student_mistakes(graded, capsys):
    """At least 39 in 41 of the mistakes fail `grade`, each in a line that names its function and equation, and the
    ones that slip through are exactly those the data file says slip (with why)."""
    caught, slipped = [], []
    for k, mistake in enumerate(MISTAKES):
        result = graded[f"mistake{k:02d}"]
        assert list(result["functions"]) == [mistake["function"]]
        assignment.print_report(result)
        out = capsys.readouterr().out
        row = re.search(rf"^  FAILED +{re.escape(mistake['function'])} +{re.escape(assignment.equation(mistake['function']))}"
                        rf" +0*\d+/\d+ tests\n +(test_\S+): (.+)$", out, re.M)
        if row and row.group(1).startswith(assignment.test_prefix(mistake["function"].split(".", 1)[1])):
            caught.append(mistake["mistake"])
        else:
            slipped.append(mistake["mistake"])
    assert len(MISTAKES) >= 41
    assert len(caught) >= math.ceil(39 / 41 * len(MISTAKES)), slipped
    assert slipped == [m["mistake"] for m in MISTAKES if m.get("slips")]


def test_grade_messages_say_expected_and_got(graded):
    by_mistake = {m["mistake"]: graded[f"mistake{k:02d}"]["functions"][m["function"]] for k, m in enumerate(MISTAKES)}
    score_first = by_mistake["the score on the first token instead of the last real one"]
    assert re.fullmatch(r"at index \(0, 0\) of a \(5, 6\) result: expected -0\.07\d+, got 0\.58\d+ "
                        r"\(8 of 30 elements differ, 1e-12 allowed\)", score_first["message"]), score_first
    entropy = by_mistake["log(softmax) entropy: 0·(−inf) = NaN in float32"]
    assert entropy["test"] == "test_entropy_finite_in_float32_at_large_logit_gaps"
    assert "expected 2.9e-12, got nan" in entropy["message"]
    nan_safe = by_mistake["not NaN-safe: NaN·0 at padding poisons the mean"]
    assert nan_safe["test"] == "test_masked_mean_ignores_nan_and_inf_at_masked_positions"  # masked_mean's own test
    empty = by_mistake["an empty mask divides by zero (NaN, not 0)"]
    assert empty["message"] == "all-zero mask: expected 0, got nan"


def test_grade_command_grades_a_class_into_one_table_and_stops_an_endless_loop(tmp_path):
    """`python tools/assignment.py grade --class`: one row per student, the CSV, exit status 1 when anyone failed; a
    student whose code loops forever is stopped after --timeout seconds and reported, the others are graded."""
    klass = tmp_path / "class"
    for name in ("ada", "bob", "cy", "dee"):
        (klass / name).mkdir(parents=True)
    shutil.copy(ROOT / "gae.py", klass / "ada" / "gae.py")  # done
    assignment.make(klass / "bob", ["gae"])  # handed in the hand-out as it was; cy handed in nothing
    (klass / "dee" / "gae.py").write_text((ROOT / "gae.py").read_text().replace(
        "    for t in reversed(range(T)):", "    while True:\n        pass\n    for t in reversed(range(T)):"))
    proc = subprocess.run([sys.executable, "tools/assignment.py", "grade", "--class", str(klass), "--modules", "gae",
                           "--timeout", "20"], cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    out = proc.stdout
    assert re.search(r"^ada +3/3 ", out, re.M) and re.search(r"^bob +0/3 .*gae\.k_step_return \(Eq\. 7\): ", out, re.M)
    assert re.search(r"^cy +0/3 .*missing: no gae\.py in ", out, re.M) and "4 students graded in" in out
    assert re.search(r"^dee +0/3 .*error: grading stopped after 20 s without finishing \(an endless loop\?\)", out, re.M)
    with open(klass / "grades.csv") as fh:
        rows = {r["student"]: r for r in csv.DictReader(fh)}
    assert rows["ada"]["functions_passed"] == "3" and rows["ada"]["gae.compute_gae"] == "pass"
    assert rows["bob"]["gae.compute_gae"].startswith("failed: test_compute_gae_")
    assert rows["cy"]["gae.compute_gae"].startswith("missing: no gae.py in ")


def test_grade_command_exit_status_is_the_whole_assignment(graded, monkeypatch, tmp_path, capsys):
    """One student: status 0 only when every function passed. (The grading itself is the `graded` fixture's.)"""
    monkeypatch.setattr(assignment, "grade_submissions", lambda subs, functions, timeout: [graded[subs[0][0]]])
    for name, status in [("reference", 0), ("partial", 1), ("handout", 1)]:
        (tmp_path / name).mkdir()
        assert assignment.main(["grade", str(tmp_path / name)]) == status
    out = capsys.readouterr().out
    assert "18 of 18 functions passed\n" in out and "3 of 18 functions passed; the assignment is not complete" in out


def test_grade_command_errors_are_one_line(tmp_path, capsys):
    for argv, message in [(["grade", str(tmp_path / "nobody")], "no such folder"),
                          (["grade", str(tmp_path), "--functions", "gae.gae"], "--functions gae.gae: not assigned"),
                          (["grade", "--class", str(tmp_path)], "no subfolders"),
                          (["make", "--out", str(tmp_path), "--modules", "train"], "--modules train: not assigned")]:
        with pytest.raises(SystemExit) as exit_:
            assignment.main(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.count("\n") == 1 and message in err, err
