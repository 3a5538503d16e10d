"""The package layering: a lower package never imports a higher one, and no module imports
itself back through others. Lowest first (the README's "Code layout"):

    base (errors, typed, log, files, profiling) -> solvers -> ops (kernels beside their references)
        -> layers (the layer types and what only layers use) -> models (the LM, its config and heads)
        -> parallel -> data -> train (and fpscale.config, the run config that assembles every section)
        -> eval -> hf -> cli (the commands; launch/*.py are their script form)

Every import counts, also one inside a function (a lazy import is still a dependency); only
imports under ``if TYPE_CHECKING:`` (annotations) do not.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "fpscale"
ORDER = ["base", "solvers", "ops", "layers", "models", "parallel", "data", "train", "eval", "hf", "cli"]
BASE = {"fpscale.errors", "fpscale.typed", "fpscale.log", "fpscale.files", "fpscale.profiling"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> str | None:
    if module in BASE:
        return "base"
    if module == "fpscale.config":
        return "train"
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ORDER else None


def runtime_nodes(tree: ast.AST):
    """Every node except the bodies of ``if TYPE_CHECKING:`` (annotations only, never run)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", "")) == "TYPE_CHECKING":
            yield from (n for child in node.orelse for n in [child, *runtime_nodes(child)])
            continue
        yield node
        yield from runtime_nodes(node)


def imports(path: Path) -> set[str]:
    """The fpscale modules ``path`` imports (``from pkg import mod`` resolved to the module)."""
    out = set()
    for node in runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("fpscale"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fpscale"):
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.add(sub if (ROOT.parent / Path(*sub.split("."))).with_suffix(".py").exists()
                        or (ROOT.parent / Path(*sub.split("."))).is_dir() else node.module)
    return out


MODULES = {module_name(p): imports(p) for p in sorted(ROOT.rglob("*.py"))}


def test_every_module_has_a_layer():
    assert [m for m in MODULES if m != "fpscale" and layer(m) is None] == []


@pytest.mark.parametrize("module", [m for m in MODULES if m != "fpscale"])
def test_no_lower_package_imports_a_higher_one(module):
    mine = ORDER.index(layer(module))
    upward = sorted(i for i in MODULES[module] if i != "fpscale" and ORDER.index(layer(i)) > mine)
    assert upward == [], f"{module} ({layer(module)}) imports {upward}"


def test_the_import_graph_has_no_cycle():
    """Depth-first search over module-level edges (a package's __init__ counts as a module)."""
    graph = {m: {i for i in deps if i in MODULES and i != m} for m, deps in MODULES.items()}
    for m, deps in graph.items():      # importing a.b.c runs a/__init__ and a/b/__init__ first
        deps.discard("fpscale")
    done: set[str] = set()

    def visit(m: str, path: list[str]) -> None:
        if m in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(m):] + [m]))
        if m in done:
            return
        for d in sorted(graph[m]):
            visit(d, path + [m])
        done.add(m)

    for m in graph:
        visit(m, [])


LONG = 400


@pytest.mark.parametrize("path", sorted(ROOT.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT.parent)))
def test_no_file_is_long_without_saying_why(path):
    """A module over 400 lines says in its docstring why it is one piece ("Over 400 lines: ...")."""
    lines = path.read_text().count("\n")
    if lines > LONG:
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        assert f"Over {LONG} lines:" in doc, (
            f"{path.relative_to(ROOT.parent)} has {lines} lines: split it, or say in its docstring why it is one "
            f"piece (a line starting 'Over {LONG} lines:')")
