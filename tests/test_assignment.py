"""Tests for tools/assignment.py: the hand-out keeps everything but the assigned bodies, and grading with
PPO_MAX_IMPL passes the real implementation and fails a wrong one and the stubs (one pytest subprocess each)."""

import ast
import importlib.util
import inspect
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import assignment

ROOT = Path(__file__).resolve().parents[1]


def run_gae_tests(impl: Path, *extra: str) -> subprocess.CompletedProcess:
    """`pytest tests/test_gae.py` from the repo root with PPO_MAX_IMPL=impl, as a student would run it."""
    env = {**os.environ, "PPO_MAX_IMPL": str(impl)}
    cmd = [sys.executable, "-m", "pytest", "tests/test_gae.py", "-q", "-p", "no:cacheprovider", *extra]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def load(path: Path, name: str):
    """Import a file under a private module name (so the real `gae` in sys.modules is left alone)."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_make_stubs_only_the_assigned_bodies(tmp_path):
    assignment.make(tmp_path, list(assignment.ASSIGNMENT))
    for module, functions in assignment.ASSIGNMENT.items():
        real = ast.parse((ROOT / f"{module}.py").read_text())
        stub = ast.parse((tmp_path / f"{module}.py").read_text())
        assert len(real.body) == len(stub.body)
        for r, s in zip(real.body, stub.body):
            if getattr(r, "name", None) in functions:
                # same signature and docstring; the body is the docstring and one raise
                assert ast.dump(r.args) == ast.dump(s.args) and ast.dump(r.returns) == ast.dump(s.returns)
                assert ast.get_docstring(r) == ast.get_docstring(s) and ast.get_docstring(s)
                assert len(s.body) == 2 and isinstance(s.body[1], ast.Raise)
                assert s.body[1].exc.func.id == "NotImplementedError"
            else:  # helpers, classes (ScalarHeadModel), imports and the __main__ example are untouched
                assert ast.dump(r) == ast.dump(s)


@pytest.mark.parametrize("module", list(assignment.ASSIGNMENT))
def test_make_stubs_import_and_raise_not_implemented(tmp_path, module):
    assignment.make(tmp_path, [module])
    mod = load(tmp_path / f"{module}.py", f"_stub_{module}")
    for name in assignment.ASSIGNMENT[module]:
        fn = getattr(mod, name)
        n_required = sum(p.default is p.empty for p in inspect.signature(fn).parameters.values())
        with pytest.raises(NotImplementedError, match=f"exercise: implement {module}.{name}"):
            fn(*[None] * n_required)


def test_make_refuses_to_overwrite_the_repo_or_a_students_file(tmp_path):
    with pytest.raises(SystemExit, match="repository itself"):
        assignment.make(ROOT, ["gae"])
    assignment.make(tmp_path, ["gae"])
    with pytest.raises(SystemExit, match="--force"):
        assignment.make(tmp_path, ["gae"])


def test_grading_passes_the_real_implementation(tmp_path):
    shutil.copy(ROOT / "gae.py", tmp_path / "gae.py")
    proc = run_gae_tests(tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert "failed" not in proc.stdout and "error" not in proc.stdout


def test_grading_fails_a_wrong_implementation(tmp_path):
    # a plausible student bug: the recursion Â_t = δ_t + γλ Â_{t+1} with λ halved
    src = (ROOT / "gae.py").read_text()
    right = "last_gae = delta + gamma * lam * last_gae"
    assert src.count(right) == 1
    (tmp_path / "gae.py").write_text(src.replace(right, "last_gae = delta + gamma * (0.5 * lam) * last_gae"))
    proc = run_gae_tests(tmp_path)
    assert proc.returncode == 1, proc.stdout[-2000:]
    assert "test_gae_eq9_equals_explicit_double_sum" in proc.stdout  # the test of Eq. 9 is the one that catches it


def test_grade_command_fails_the_stubs_and_prints_the_table(tmp_path):
    assignment.make(tmp_path, ["gae"])
    cmd = [sys.executable, "tools/assignment.py", "grade", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout[-2000:]
    row = next(line for line in proc.stdout.splitlines() if line.startswith("gae "))
    passed, failed, errors, total = map(int, row.split()[1:])
    assert passed == 0 and failed == total > 0 and errors == 0
