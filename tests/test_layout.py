"""The layout's promises, checked on the source: the equation files import only torch (and each other), no module
imports one that imports it back, and the entry point is imported by nobody but drivers (tools/gpu_check.py, the notebooks'
runner, the tests)."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODULES = {p.stem: p for p in ROOT.glob("*.py")}
TOOLS = {p.stem: p for p in (ROOT / "tools").glob("*.py")}  # scripts on top of the project, imported by nobody


def imports(path: Path, top_level_only: bool = False) -> set[str]:
    """The project modules `path` imports (inside functions too, unless top_level_only)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    names = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names & (set(MODULES) | set(TOOLS))


def test_equation_files_import_only_torch():
    for name in ("gae", "ppo_loss"):
        tree = ast.parse(MODULES[name].read_text())
        third_party = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        third_party |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert third_party <= {"torch", "__future__", "math", "dataclasses", "typing"}, (name, third_party)
    # reward_model.py: its loss half (above the model-half banner) imports only torch
    loss_half = MODULES["reward_model"].read_text().split("# Model half")[0]
    assert {l.split()[1].split(".")[0] for l in loss_half.splitlines() if l.startswith(("import ", "from "))} == {"torch"}


def test_no_import_cycles():
    graph = {name: imports(path) - {name} for name, path in {**MODULES, **TOOLS}.items()}
    for start in graph:  # depth-first search for a path that comes back to `start`
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in graph[node]:
                assert nxt != start, "import cycle: " + " -> ".join(path + [start])
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, path + [nxt]))


# scripts on top of the entry point (like the notebooks' runner and the tests)
DRIVERS = {"train", "gpu_check", "trace_iteration", "memory_check", "architectures", "bench"}


def test_nothing_imports_the_entry_point():
    for name, path in {**MODULES, **TOOLS}.items():
        assert "train" not in imports(path) or name in DRIVERS, f"{name}.py imports train.py"


def test_no_project_module_imports_a_tool():
    for name, path in MODULES.items():
        assert not imports(path) & set(TOOLS), f"{name}.py imports {imports(path) & set(TOOLS)} from tools/"


def test_no_function_in_train_py_is_longer_than_80_lines():
    tree = ast.parse(MODULES["train"].read_text())
    long = {n.name: n.end_lineno - n.lineno + 1 for n in ast.walk(tree)
            if isinstance(n, ast.FunctionDef) and n.end_lineno - n.lineno + 1 > 80}
    assert not long, long


def test_stages_1_and_2_do_not_import_the_ppo_recipe():
    """SFT and the reward model come before PPO: they take their flags' plumbing from cli.py and their model
    utilities (dropout off, position ids) from lm.py, never from ppo_max.py."""
    for name in ("sft", "reward_model", "lm", "cli"):
        assert "ppo_max" not in imports(MODULES[name]), f"{name}.py imports ppo_max.py"


def test_cli_plumbing_lives_in_cli_py():
    """The algorithm files define no flag machinery: arg, check_value and the range tables are cli.py's."""
    for name in ("ppo_max", "gae", "ppo_loss", "reward_model", "sft"):
        tree = ast.parse(MODULES[name].read_text())
        defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        defined |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
        assert not defined & {"arg", "check_value", "OneLineParser", "fail", "cli_guard"}, name
        assert not {d for d in defined if d.endswith("_CHECKS")}, name


SECTION = r"§ ?(\d+(?:\.\d+)*)|(?:App\.|Appendix) ([A-C](?:\.\d+)?)"


def test_every_section_reference_has_a_heading_in_docs_paper_md():
    """Code, notebooks and docs cite the paper as §N.N and App. X.N; docs/paper.md has a heading for each."""
    import re
    headings = [l for l in (ROOT / "docs" / "paper.md").read_text().splitlines() if l.startswith("#")]
    have = {m.group(1) or m.group(2) for l in headings for m in re.finditer(SECTION, l)}
    files = [*ROOT.glob("*.py"), *ROOT.glob("tools/*.py"), *ROOT.glob("notebooks/*.ipynb"), *ROOT.glob("docs/*.md"),
             ROOT / "README.md", ROOT / "TEACHING.md"]
    missing = {}
    for path in files:
        for m in re.finditer(SECTION, path.read_text()):
            ref = m.group(1) or m.group(2)
            if ref not in have:
                missing.setdefault(ref, path.name)
    assert not missing, f"cited without a heading in docs/paper.md: {missing}"
