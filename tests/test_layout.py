"""The layout's promises, checked on the source: the top level is the book (a dozen concept files, read top to bottom)
and everything else one package below it (plumbing/); the equation files import only torch (and each other); no
module imports one that imports it back; the entry point is imported by nobody but drivers (tools/gpu_check.py, the
notebooks' runner, the tests); one function per job where the project once had several."""
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODULES = {p.stem: p for p in ROOT.glob("*.py")}                                         # the book
PACKAGE = {f"plumbing.{p.stem}": p for p in (ROOT / "plumbing").glob("*.py") if p.stem != "__init__"}
TOOLS = {p.stem: p for p in (ROOT / "tools").glob("*.py")}  # scripts on top of the project, imported by nobody
ALL = {**MODULES, **PACKAGE, **TOOLS}
BOOK = ("toy_world", "sft", "reward_model", "gae", "ppo_loss", "ppo_max", "critic_free", "dpo", "best_of_n", "train",
        "eval")  # the README's reading order; the user's names


def imports(path: Path, top_level_only: bool = False) -> set[str]:
    """The project modules `path` imports (inside functions too, unless top_level_only): "gae", "plumbing.data"."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    names = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names |= {a.name if a.name.startswith("plumbing.") else a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "plumbing":  # from plumbing import data, engine
                names |= {f"plumbing.{a.name}" for a in node.names}
            else:
                names.add(node.module if node.module.startswith("plumbing.") else node.module.split(".")[0])
    return names & set(ALL)


def code_lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_the_top_level_is_the_book_and_the_rest_one_package():
    assert set(BOOK) <= set(MODULES), set(BOOK) - set(MODULES)
    assert len(MODULES) <= 12, sorted(MODULES)
    # the book's length; toy_world_b.py, a second synthetic world beside toy_world.py, is read after it, on its own
    total = sum(code_lines(p) for name, p in MODULES.items() if name != "toy_world_b")
    assert total <= 3600, {name: code_lines(p) for name, p in MODULES.items()}
    assert code_lines(MODULES["toy_world_b"]) <= 360
    assert code_lines(MODULES["train"]) <= 350
    folders = {p.parent.relative_to(ROOT).parts[0] for p in ROOT.rglob("*.py")
               if p.parent != ROOT and not {".git", "runs", "mutants"} & set(p.relative_to(ROOT).parts)}
    assert folders <= {"plumbing", "tools", "tests", "notebooks"}, folders


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
    graph = {name: imports(path) - {name} for name, path in ALL.items()}
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
    for name, path in ALL.items():
        assert "train" not in imports(path) or name in DRIVERS, f"{name} imports train.py"


def test_no_project_module_imports_a_tool():
    for name, path in {**MODULES, **PACKAGE}.items():
        assert not imports(path) & set(TOOLS), f"{name} imports {imports(path) & set(TOOLS)} from tools/"


def test_train_py_is_main_the_stage_calls_and_the_loop():
    tree = ast.parse(MODULES["train"].read_text())
    functions = [n.name for n in tree.body if isinstance(n, ast.FunctionDef)]
    assert functions == ["main", "ppo"], functions
    long = {n.name: n.end_lineno - n.lineno + 1 for n in ast.walk(tree)
            if isinstance(n, ast.FunctionDef) and n.end_lineno - n.lineno + 1 > 80}
    assert not long, long


def test_stages_1_and_2_do_not_import_the_ppo_recipe():
    """SFT and the reward model come before PPO: they take their flags' plumbing from plumbing/cli.py and their model
    utilities (dropout off, position ids) from the package, never from ppo_max.py."""
    for name in ("sft", "reward_model", "plumbing.models", "plumbing.cli", "plumbing.config"):
        assert "ppo_max" not in imports(ALL[name]), f"{name} imports ppo_max.py"


def test_flag_machinery_lives_in_the_package():
    """The concept files define no flag machinery or configuration: arg, the dataclasses of flags, check_value and
    the parser are plumbing/'s (config.py holds every default)."""
    for name in BOOK:
        tree = ast.parse(MODULES[name].read_text())
        defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        defined |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
        assert not defined & {"arg", "check_value", "OneLineParser", "fail", "cli_guard", "build_parser", "PRESETS",
                              "RunConfig", "PPOConfig", "SFTConfig", "RMConfig", "DPOConfig"}, name


def test_one_function_per_job():
    """One whitening, one reward-to-go loop (GAE), one last-real-token rule: a second implementation of any of
    them is a definition (or an inline formula) somewhere else."""
    code = {name: p.read_text() for name, p in {**MODULES, **PACKAGE}.items()}
    whiten = [name for name, text in code.items() if re.search(r"^def \w*whiten\w*\(", text, re.M)]
    assert whiten == ["ppo_loss"], whiten
    last = [name for name, text in code.items() if re.search(r"\.sum\((dim=)?1\)(\.long\(\))? - 1\b", text)]
    assert not last, f"the last real token computed inline in {last}: use reward_model.last_token_index"
    reversed_loops = [name for name, text in code.items() if "for t in reversed(range(" in text]
    assert reversed_loops == ["gae"], reversed_loops


SECTION = r"§ ?(\d+(?:\.\d+)*)|(?:App\.|Appendix) ([A-C](?:\.\d+)?)"


def test_every_section_reference_has_a_heading_in_docs_paper_md():
    """Code, notebooks and docs cite the paper as §N.N and App. X.N; docs/paper.md has a heading for each."""
    headings = [l for l in (ROOT / "docs" / "paper.md").read_text().splitlines() if l.startswith("#")]
    have = {m.group(1) or m.group(2) for l in headings for m in re.finditer(SECTION, l)}
    files = [*ROOT.glob("*.py"), *ROOT.glob("plumbing/*.py"), *ROOT.glob("tools/*.py"), *ROOT.glob("notebooks/*.ipynb"),
             *ROOT.glob("docs/*.md"), ROOT / "README.md", ROOT / "TEACHING.md"]
    missing = {}
    for path in files:
        for m in re.finditer(SECTION, path.read_text()):
            ref = m.group(1) or m.group(2)
            if ref not in have:
                missing.setdefault(ref, path.name)
    assert not missing, f"cited without a heading in docs/paper.md: {missing}"
