"""Every third-party module the project imports is listed in requirements.txt, so a fresh clone's
`pip install -r requirements.txt` is enough, on any machine, not only on one where the module happens to be
installed. Scans every .py file and every notebook's code cells, imports inside functions included."""
from __future__ import annotations

import ast
import importlib.metadata
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()  # PEP 503: "Foo_Bar" and "foo-bar" are one distribution


def required() -> set[str]:
    names = set()
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.add(normalize(re.split(r"[\s<>=!~\[;]", line, maxsplit=1)[0]))
    return names


def sources() -> dict[str, str]:
    """{file label: Python source} for every tracked-looking .py file and every notebook's code cells."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        if not {"runs", ".git", "venv", ".venv", "__pycache__"} & set(path.relative_to(ROOT).parts):
            out[str(path.relative_to(ROOT))] = path.read_text()
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        code = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
        # IPython magics (%matplotlib, !pip) are not Python: drop those lines
        out[str(path.relative_to(ROOT))] = "\n".join(l for c in code for l in c.splitlines() if not l.lstrip()[:1] in "%!")
    return out


def imported_modules(source: str) -> set[str]:
    """Top-level names of every absolute import in `source`."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def local_modules() -> set[str]:
    """The project's own modules: top-level .py files, tests/, notebooks/ and tools/ helpers, and their folders."""
    return ({p.stem for d in (ROOT, ROOT / "tests", ROOT / "notebooks", ROOT / "tools") for p in d.glob("*.py")}
            | {p.name for p in ROOT.iterdir() if p.is_dir()})


def test_imported_modules_parse_as_expected():
    src = "import os, numpy.linalg as la\nfrom torch import nn\nfrom . import x\ndef f():\n    import tqdm.auto\n"
    assert imported_modules(src) == {"os", "numpy", "torch", "tqdm"}


OPTIONAL = {"wandb"}  # imported only behind --log-with wandb, after a check that says plainly when it is missing


def test_every_third_party_import_is_in_requirements():
    reqs, local = required(), local_modules() | OPTIONAL
    dists = importlib.metadata.packages_distributions()  # import name -> the distributions that provide it
    missing = []
    for label, source in sources().items():
        for module in sorted(imported_modules(source) - local - set(sys.stdlib_module_names)):
            provided_by = {normalize(d) for d in dists.get(module, [])}
            if not provided_by:
                missing.append(f"{label}: imports {module!r}, which no installed distribution provides")
            elif not provided_by & reqs:
                missing.append(f"{label}: imports {module!r} (from {', '.join(sorted(provided_by))}), "
                               f"not in requirements.txt")
    assert not missing, "\n".join(missing)


def test_requirements_are_pinned_and_explained():
    """Each requirement is pinned (a fresh clone installs what CI tested), and the comment block right above it
    names it before a colon ("# torch: ..."), saying why it is here. One comment may explain a group of lines."""
    lines = (ROOT / "requirements.txt").read_text().splitlines()
    for i, line in enumerate(lines):
        if not line.strip() or line.startswith("#"):
            continue
        assert "==" in line, f"requirements.txt:{i + 1}: {line!r} is not pinned"
        name, j = normalize(line.split("==")[0].strip()), i - 1
        named = set()
        while j >= 0 and lines[j].strip():  # the comments of the block of lines this one belongs to
            if lines[j].startswith("#"):
                named |= {normalize(w) for w in re.split(r"[,\s]+", lines[j][1:].split(":")[0]) if w}
            elif named:
                break  # a requirement above the comments: they belong to that group
            j -= 1
        assert name in named, f"requirements.txt:{i + 1}: {name} has no '# {name}: why' comment above it"
