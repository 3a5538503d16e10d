"""Every repository path, every dotted ``fpscale.`` name and every relative markdown link that the docs
(README.md, docs/*.md) and the package's docstrings and comments name resolves: the path exists (a glob
matches something), the module exists, and a name after it is defined at its top level (a function, class,
assignment or import).
Read from the source (ast), nothing imported: quick.

    .venv/bin/python -m pytest -q tests/test_doc_references.py
"""
from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOPS = ("fpscale", "bench", "tests", "configs", "scripts", "docs", "launch", "data", "experiments")
PATH = re.compile(r"(?<![\w./-])((?:%s)/(?:[\w./*-]|\{[\w.,-]+\})*\w)" % "|".join(TOPS))   # {a,b}: a shell's braces
LINK = re.compile(r"\]\(([^)#\s]+)")         # a markdown link's target, relative to its page
DOTTED = re.compile(r"(?<![\w./-])(fpscale(?:\.\w+)+)")
OUTPUTS = ("runs/", "cache/", "/tmp", "bench/results")        # what runs write, not the repository's
# named on purpose, not of this repository: an example of a dotted name, a user's data prefix, a peer's file,
# a key of the rendezvous store, and the old import paths fpscale.models.moved keeps working (with a warning)
ELSEWHERE = {"fpscale.a.b", "data/web_text_document", "data/word_problem/dataset.py", "fpscale/heartbeat",
             "scripts/train.py",          # jacobfa/Attractor's trainer (docs/attractor.md, docs/optimizers.md)
             "fpscale.models.fpsa", "fpscale.models.scan_triton", "fpscale.models.common"}


def texts():
    """(where, text) of every doc and of every comment and docstring of the package."""
    for md in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        yield md.relative_to(ROOT), md.read_text()
    for py in sorted((ROOT / "fpscale").rglob("*.py")):
        source = py.read_text()
        parts = [line.split("#", 1)[1] for line in source.splitlines() if "#" in line]
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                parts.append(ast.get_docstring(node) or "")
        yield py.relative_to(ROOT), "\n".join(parts)


def path_resolves(path: str) -> bool:
    path = path.rstrip(".")
    braces = re.search(r"\{([^}]*)\}", path)
    if braces:                      # configs/125m_{attn,fpsa}.yaml: every expansion resolves
        return all(path_resolves(path[:braces.start()] + part + path[braces.end():])
                   for part in braces.group(1).split(","))
    if "*" in path:
        return any(ROOT.glob(path))
    return (ROOT / path).exists()


@cache
def top_names(module_file: Path) -> frozenset:
    names = set()
    for node in ast.parse(module_file.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.If):            # try/if blocks at the top: their definitions count
            names.update(n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)))
    return frozenset(names)


def dotted_resolves(name: str) -> bool:
    parts = name.rstrip(".").split(".")
    for cut in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:cut])
        if base.is_dir() and cut == len(parts):        # a package (a namespace package has no __init__)
            return True
        for module in (base.with_suffix(".py"), base / "__init__.py"):
            if module.exists():
                rest = parts[cut:]
                return not rest or rest[0] in top_names(module) or (base / rest[0]).with_suffix(".py").exists()
    return False


def test_every_path_and_module_named_in_docs_and_docstrings_resolves():
    bad = []
    for where, text in texts():
        for path in set(PATH.findall(text)):
            if not path.startswith(OUTPUTS) and path not in ELSEWHERE and not path_resolves(path):
                bad.append(f"{where}: {path}")
        for name in set(DOTTED.findall(text)):
            if name not in ELSEWHERE and not dotted_resolves(name):
                bad.append(f"{where}: {name}")
    for md in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in set(LINK.findall(md.read_text())):
            if "://" not in target and not target.startswith("mailto:") and not (md.parent / target).exists():
                bad.append(f"{md.relative_to(ROOT)}: link {target}")
    assert not bad, "names that do not resolve:\n" + "\n".join(sorted(bad))
