"""Every figure table of README.md, docs/*.md and experiments/README.md says where its numbers come from (issue 49).

A *figure table* is a markdown table one of whose data cells is a number: digits with an optional sign or
comparison (<, ~), thousands separators, a decimal point, an exponent, a range (4.1-4.3e-3) and a unit (%, x,
ms, s, GB, M, ...), bold or not. Its *section* runs from the heading above it to the next heading. Each one is
  * recomputed by a test: the section names a test file (``tests/....py``) that exists and reads this page (the
    file names the page's path), as tests/test_quickstart_figure.py holds docs/evaluation.md's depth table to
    the sweep of the checkpoint it trains, and this file docs/gpu.md's parameter counts; or
  * expensive (experiments, GPU, multi-minute benchmarks): the section names a commit (7 to 40 hex digits that
    this checkout's history resolves, where it has its history) and a command that starts one of fpscale's
    scripts (``python|bash|deepspeed|torchrun|sbatch ... X.py|.sh|.sbatch``, or a path under bench/,
    experiments/, launch/ or scripts/); or
  * not a measurement: ``<!-- figures: none (WHY) -->`` on the line above the table (settings, counts read off
    the code).
Sentences with numbers are not checked: no rule simple enough tells a measured number in prose from a setting.
The README's "Results at a glance" bullets are (tests/test_readme.py::test_every_results_bullet_names_its_command).

    .venv/bin/python -m pytest -q tests/test_doc_figures.py
"""
from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = ["README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")), "experiments/README.md"]
UNIT = r"(%|x|×|ms|s|min|h|GB|GiB|MB|MiB|KiB|M|B|k|K|[GT]FLOP/s|GB/s|tok/s)"
NUMBER = r"-?[\d,]*\d(\.\d+)?(e[-+]?\d+)?"
CELL = re.compile(rf"^(\*\*)?[<>~≈+]?\s*{NUMBER}(\s*-\s*{NUMBER})?\s*{UNIT}?(\*\*)?$")
HEADING = re.compile(r"^#{1,6} ", re.M)
HEX = re.compile(r"\b[0-9a-f]{7,40}\b")
COMMAND = re.compile(r"(python3?|bash|deepspeed|torchrun|sbatch)\s+(\S+\s+)*?\S+\.(py|sh|sbatch)\b"
                     r"|\b(bench|experiments|launch|scripts)/[\w/]+\.(py|sh)\b")
TEST = re.compile(r"\btests/[\w/]+\.py\b")
NONE = re.compile(r"<!-- figures: none \(.+?\) -->\s*$")


@dataclass
class Table:
    page: str
    line: int             # 1-based, its header row
    section: str          # the text from the heading above to the next heading
    marked_none: bool     # <!-- figures: none (...) --> on the line above
    numbers: list[str]    # its data cells that are numbers

    def __str__(self) -> str:
        heading = self.section.lstrip().splitlines()[0][:70] if self.section.strip() else "(top)"
        return f"{self.page}:{self.line} (section {heading!r}; e.g. {', '.join(self.numbers[:3])})"


def figure_tables(page: str, text: str) -> list[Table]:
    """The figure tables of one page (tables inside fenced code blocks are code, not tables)."""
    lines = text.splitlines()
    starts = [0] + [text.count("\n", 0, m.start()) for m in HEADING.finditer(text)] + [len(lines)]
    fenced, inside = set(), False
    for i, line in enumerate(lines):
        if line.lstrip().startswith("```"):
            inside = not inside
        if inside:
            fenced.add(i)
    out, i = [], 0
    while i < len(lines):
        if not lines[i].startswith("|") or i in fenced:
            i += 1
            continue
        j = i
        while j < len(lines) and lines[j].startswith("|"):
            j += 1
        cells = [c.strip() for row in lines[i + 2:j] for c in row.strip().strip("|").split("|")]
        numbers = [c for c in cells if CELL.match(c)]
        if numbers:
            lo = max(s for s in starts if s <= i)
            hi = min(s for s in starts if s > i)
            out.append(Table(page, i + 1, "\n".join(lines[lo:hi]), i > 0 and bool(NONE.search(lines[i - 1])),
                             numbers))
        i = j
    return out


def known_commits(candidates: set[str]) -> set[str] | None:
    """The candidates that name a commit of this checkout, or None where it has no history to ask
    (not a git checkout, or a shallow clone)."""
    shallow = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=ROOT, capture_output=True,
                             text=True)
    if shallow.returncode != 0 or shallow.stdout.strip() != "false":
        return None
    names = sorted(candidates)
    out = subprocess.run(["git", "cat-file", "--batch-check"], cwd=ROOT, input="".join(f"{h}^{{commit}}\n"
                         for h in names), capture_output=True, text=True, timeout=60).stdout.splitlines()
    return {h for h, line in zip(names, out) if not line.endswith("missing") and "ambiguous" not in line}


def hexes(text: str) -> set[str]:
    return {h for h in HEX.findall(text) if re.search(r"[a-f]", h) and re.search(r"\d", h)}


def problem(table: Table, commits: set[str] | None) -> str | None:
    """Why ``table`` does not say where its numbers come from (None: it does)."""
    if table.marked_none:
        return None
    readers = [t for t in TEST.findall(table.section) if (ROOT / t).is_file()
               and table.page in (ROOT / t).read_text()]
    if readers:
        return None
    named = hexes(table.section)
    commit = named if commits is None else named & commits
    command = COMMAND.search(table.section)
    if commit and command:
        return None
    missing = [what for what, ok in (("a commit", commit), ("a command", command)) if not ok]
    unknown = f" ({', '.join(sorted(named))} not commits of this checkout)" if named and not commit else ""
    return f"{table}: names no test that reads the page, and lacks {' and '.join(missing)}{unknown}"


def all_tables() -> list[Table]:
    return [t for page in PAGES for t in figure_tables(page, (ROOT / page).read_text())]


def test_the_figure_tables_are_found():
    tables = all_tables()
    assert len(tables) >= 40, len(tables)
    found = {(t.page, t.section.lstrip().splitlines()[0]) for t in tables}
    assert ("docs/evaluation.md", "## Test-time compute: evaluating at several depths") in found
    assert any(page == "docs/experiments.md" for page, _ in found)


@pytest.mark.parametrize("page", PAGES)
def test_every_figure_table_names_its_test_or_its_commit_and_command(page):
    tables = figure_tables(page, (ROOT / page).read_text())
    commits = known_commits(set().union(*(hexes(t.section) for t in tables)))
    problems = [p for p in (problem(t, commits) for t in tables) if p]
    assert not problems, "\n".join(problems) + ("\n(recomputed by a test that reads the page, or measured at a "
                                                "commit with a command: tests/test_doc_figures.py)")


def test_the_rule_holds_a_table_to_its_source():
    table = "| model | ppl |\n|---|---:|\n| attn | 143.1 |\n"
    assert [t.numbers for t in figure_tables("docs/none.md", "## A\n\n" + table)] == [["143.1"]]
    assert figure_tables("docs/none.md", "| a | b |\n|---|---|\n| fpsa | seed 000 App. J |\n") == []     # words
    assert figure_tables("docs/none.md", "```\n" + table + "```\n") == []                               # code
    commit = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    cases = {"": "lacks a commit and a command", "`python experiments/language.py`": "lacks a commit",
             f"At {commit}.": "lacks a command", "At 0123abc, `python experiments/language.py`.": "not commits",
             f"At {commit}, `python experiments/language.py`.": None,
             "tests/test_quickstart_figure.py recomputes it.": "lacks a commit"}      # it does not read docs/none.md
    for words, want in cases.items():
        (t,) = figure_tables("docs/none.md", f"## A\n\n{words}\n\n{table}\n## B\n")
        got = problem(t, known_commits(hexes(t.section)))
        assert (got is None) if want is None else (got is not None and want in got), (words, got)
    (t,) = figure_tables("docs/evaluation.md", f"## A\n\ntests/test_quickstart_figure.py\n\n{table}")
    assert problem(t, set()) is None                                          # a test that reads the page
    (t,) = figure_tables("docs/none.md", f"## A\n\n<!-- figures: none (settings) -->\n{table}")
    assert problem(t, set()) is None


# ---- the cheap figures this file recomputes --------------------------------------------------------------------
@pytest.mark.slow       # ~2 s alone (seven 125m models built on the meta device), 6 s under load
def test_the_gpu_recipes_parameter_counts_are_the_models():
    """docs/gpu.md's recipe table: each 125m config's parameters (tied weights once), built on the meta device."""
    import torch

    import fpscale
    text = (ROOT / "docs" / "gpu.md").read_text()
    rows = re.findall(r"^\| `(125m_\w+)` \|[^\n]*?\| ([\d.]+M) \|", text, re.M)
    assert len(rows) == 7, rows
    for name, stated in rows:
        with torch.device("meta"):
            model = fpscale.build_model(fpscale.load_config(str(ROOT / "configs" / f"{name}.yaml")))
        measured = f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M"
        assert measured == stated, f"docs/gpu.md states {stated} parameters for {name}, the model has {measured}"
