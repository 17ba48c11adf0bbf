"""README and docs/ stay readable and their links lead somewhere: every page at most 400 lines, every
relative markdown link names a file that exists (and, with a #fragment into a markdown page, a
heading there), every backticked repository path that looks like a file exists, and `config --help`
describes every setting `config` accepts. Reads files only: no process, no model."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from swarmctl.commands import config as config_command

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MAX_LINES = 400

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")  # [text](target); images are links too: checked below
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`\n]+)`")
# A backticked path into the repository: starts at one of its top folders and ends in a file name
# with an extension (`benchmarks/results/x.json`, `swarmctl/node/home.py`), or names a folder (trailing /).
TOP = ("benchmarks", "docs", "harness", "kernels", "net", "plans", "scripts", "swarmctl", "tests")
REPO_PATH = re.compile(r"^(?:%s)/[\w./-]*(?:\.[a-z0-9]{1,5}|/)$" % "|".join(TOP))  # not module.ATTR


def _lines_outside_fences(text: str):
    """(line number, line) for every line not inside a ``` block: sample output is not a link."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def anchors(page: Path) -> set[str]:
    """GitHub's ids for a page's headings: lower case, punctuation dropped, spaces to hyphens."""
    found = set()
    for _, line in _lines_outside_fences(page.read_text()):
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            slug = re.sub(r"[^\w\- ]", "", title).replace(" ", "-")
            found.add(slug)
    return found


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_a_page_is_at_most_400_lines(page):
    lines = len(page.read_text().splitlines())
    where = " (it is generated: split or compact it in net/reference.py)" if page.name == "protocol.md" else ""
    assert lines <= MAX_LINES, f"{_name(page)} has {lines} lines; split it into pages of at most {MAX_LINES}{where}"


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_relative_links_lead_to_files_and_headings_that_exist(page):
    broken = []
    for number, line in _lines_outside_fences(page.read_text()):
        for target in [*LINK.findall(line), *IMAGE.findall(line)]:
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...: not ours to check
                continue
            path, _, fragment = target.partition("#")
            where = (page.parent / path).resolve() if path else page
            if not where.exists():
                broken.append(f"{_name(page)}:{number}: {target} (no such file)")
            elif fragment and where.suffix == ".md" and fragment not in anchors(where):
                broken.append(f"{_name(page)}:{number}: {target} (no heading #{fragment} in {where.name})")
    assert not broken, "broken links:\n" + "\n".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_backticked_repository_paths_exist(page):
    missing = []
    for number, line in _lines_outside_fences(page.read_text()):
        for code in CODE.findall(line):
            path = code.split()[0] if code.split() else ""
            if REPO_PATH.match(path) and not (ROOT / path).exists():
                missing.append(f"{_name(page)}:{number}: `{path}`")
    assert not missing, "paths named in the docs that are not in the repository:\n" + "\n".join(missing)


def test_the_checks_can_fail(tmp_path):
    """The link and path patterns find what they are meant to (a test of the test)."""
    assert LINK.findall("see [a](docs/x.md#y) and ![b](pic.svg)") == ["docs/x.md#y"]
    assert IMAGE.findall("![b](pic.svg)") == ["pic.svg"]
    assert REPO_PATH.match("benchmarks/results/bench_x.json") and REPO_PATH.match("swarmctl/asker/")
    assert not REPO_PATH.match("swarmctl ask") and not REPO_PATH.match("plans.whatif")
    assert not REPO_PATH.match("harness/tiny_models.KIMI_WIDTH") and not REPO_PATH.match("harness/tiny_models._echo")
    page = tmp_path / "p.md"
    page.write_text("## How activations travel: `--wire-dtype`\n```\n# not a heading\n```\n## Kimi's width (one machine)\n")
    assert anchors(page) == {"how-activations-travel---wire-dtype", "kimis-width-one-machine"}


def test_config_help_describes_every_setting():
    """`swarmctl config --help` (the module's docstring) names each setting `config` accepts."""
    described = {line.split()[0] for line in config_command.__doc__.splitlines()
                 if line.startswith("  ") and line.strip() and not line.startswith("   ")}
    assert set(config_command.SETTINGS) <= described, set(config_command.SETTINGS) - described


def test_the_benchmark_index_names_every_benchmark_and_results_file():
    """docs/benchmarks.md lists every script in benchmarks/ and every results file, and each
    results file it names exists (a name may be a glob: `bench_swarm_windows_*.json`)."""
    index = (ROOT / "docs" / "benchmarks.md").read_text()
    scripts = {p.name for p in (ROOT / "benchmarks").glob("*.py") if p.name != "__init__.py"}
    results = ROOT / "benchmarks" / "results"
    unnamed = [f"benchmarks/{s}" for s in sorted(scripts) if f"benchmarks/{s}" not in index]
    unnamed += [r.name for r in sorted(results.glob("*.json"))
                if r.name not in index and not any(r.match(g) for g in re.findall(r"`([\w*.-]+\*[\w*.-]*\.json)`", index))]
    assert not unnamed, f"docs/benchmarks.md does not index: {unnamed}"
    named = re.findall(r"`([\w*.-]+\.json)`", index)
    missing = [n for n in named if not list(results.glob(n))]
    assert not missing, f"docs/benchmarks.md names results files that are not there: {missing}"
